"""``torchrec-proactive bench``: resident vs reactive vs proactive, side by side in one run.

Usage::

    torchrec-proactive bench [--quick] [--json out.json] [--timeline out/] [--scaling out/]
                             [--sweep-bandwidth 0.05,0.1,0.2] [--world-size 2]

On CPU the host-to-device link is an *emulated* copy engine (``link.kind == "emulated"``)
whose bandwidth is calibrated, unless given, so that one step's cold fetch costs
``--target-fetch-fraction`` of a resident step. Every figure in the output says so.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from ..launch import run_ranks
from .rank import BenchSettings, bench_rank
from .workload import Workload

REQUIRED_KEYS = (
    "reactive_samples_per_s", "proactive_samples_per_s", "resident_samples_per_s", "speedup_vs_reactive",
    "fraction_of_resident", "stall_ms_reactive", "stall_ms_proactive", "link", "best_depth", "configs",
)


def summarize(rank0: Dict[str, Any], world_size: int) -> Dict[str, Any]:
    """The report: headline ratios (each the quotient of the reported rates) + per-config table."""
    res = rank0["results"]
    proactive = {k: v for k, v in res.items() if k.startswith("depth_") and "error" not in v}
    best_name = max(proactive, key=lambda k: proactive[k]["samples_per_s"]) if proactive else None
    reactive, resident = res["reactive"], res["resident"]
    best = proactive.get(best_name) if best_name else None
    report: Dict[str, Any] = {
        "world_size": world_size,
        "backend": "gloo",
        "resident_samples_per_s": resident["samples_per_s"],
        "reactive_samples_per_s": reactive["samples_per_s"],
        "proactive_samples_per_s": best["samples_per_s"] if best else None,
        "best_depth": best["prefetch_depth"] if best else None,
        "speedup_vs_reactive": best["samples_per_s"] / reactive["samples_per_s"] if best else None,
        "fraction_of_resident": best["samples_per_s"] / resident["samples_per_s"] if best else None,
        "stall_ms_reactive": reactive["stall_ms_per_step"],
        "stall_ms_proactive": best["stall_ms_per_step"] if best else None,
        "stall_reduction": (1.0 - best["stall_ms_per_step"] / reactive["stall_ms_per_step"])
        if best and reactive["stall_ms_per_step"] > 0 else None,
        "reactive_stall_share_of_step": reactive["stall_ms_per_step"] / reactive["step_ms_median"],
        "link": rank0["link"],
        "comm_s": rank0["comm"],
        "configs": list(res.values()),
    }
    if "auto" in res:
        report["auto_depth"] = res["auto"].get("chosen_depth")
        report["auto_samples_per_s"] = res["auto"]["samples_per_s"]
    if "cache100" in res:
        report["cache100_overhead_vs_resident"] = resident["samples_per_s"] / res["cache100"]["samples_per_s"]
    return report


def format_table(report: Dict[str, Any]) -> str:
    link = report["link"]
    lines = [
        f"link: {link['kind']} (modelled copy engine) {link['bandwidth_gbps']:.4g} GB/s, "
        f"{link['latency_us']:.0f} us latency"
        + (f" - calibrated so a cold fetch costs {link['target_fetch_fraction']:.0%} of a resident step"
           if link.get("calibrated") else ""),
        f"{'config':<12}{'depth':>6}{'samples/s':>11}{'step ms':>9}{'p90 ms':>8}{'stall ms':>9}"
        f"{'rows/step':>10}{'MB/step':>8}{'hit':>6}",
    ]
    for c in report["configs"]:
        if "error" in c:
            lines.append(f"{c['name']:<12}{c['prefetch_depth']!s:>6}  error: {c['error'][:80]}")
            continue
        hit = "-" if c.get("hit_rate") is None else f"{c['hit_rate']:.2f}"
        depth = "-" if c.get("prefetch_depth") is None else c["prefetch_depth"]
        lines.append(
            f"{c['name']:<12}{depth!s:>6}{c['samples_per_s']:>11.0f}{c['step_ms_median']:>9.1f}{c['step_ms_p90']:>8.1f}"
            f"{c['stall_ms_per_step']:>9.2f}{c['rows_fetched_per_step']:>10.0f}{c['bytes_moved_per_step'] / 1e6:>8.2f}{hit:>6}"
        )
    if report.get("speedup_vs_reactive") is not None:
        lines.append(
            f"proactive (depth {report['best_depth']}) / reactive = {report['speedup_vs_reactive']:.2f}x; "
            f"proactive / all-resident = {report['fraction_of_resident']:.2f}; "
            f"stall {report['stall_ms_reactive']:.1f} -> {report['stall_ms_proactive']:.1f} ms/step"
        )
    if "cache100_overhead_vs_resident" in report:
        lines.append(f"100%-cache step time / stock resident = {report['cache100_overhead_vs_resident']:.2f}x")
    if "auto_depth" in report:
        lines.append(f"auto chose depth {report['auto_depth']}")
    return "\n".join(lines)


def _settings(args: argparse.Namespace) -> BenchSettings:
    workload = Workload(num_tables=args.tables, rows_per_table=args.rows, embedding_dim=args.dim,
                        batch_size=args.batch_size, zipf_alpha=args.zipf_alpha)
    s = BenchSettings(
        workload=workload, sharding=args.sharding, cache_load_factor=args.cache_load_factor,
        depths=tuple(int(d) for d in args.depths.split(",")), warmup_steps=args.warmup, measure_steps=args.steps,
        link_bandwidth_gbps=args.link_bandwidth_gbps, link_latency_us=args.link_latency_us,
        target_fetch_fraction=args.target_fetch_fraction, trace=bool(args.timeline or args.scaling),
        rounds=args.rounds,
    )
    if args.quick:
        s = replace(s, workload=replace(workload, num_tables=min(workload.num_tables, 4),
                                        rows_per_table=min(workload.rows_per_table, 20_000),
                                        batch_size=min(workload.batch_size, 256)),
                    warmup_steps=min(s.warmup_steps, 4), measure_steps=min(s.measure_steps, 10), depths=(1, 2, 4),
                    rounds=1)
    return s


def run_bench(settings: BenchSettings, world_size: int = 2, timeout_s: float = 1800) -> Dict[str, Any]:
    """Runs the benchmark on ``world_size`` local gloo ranks; returns the report and rank-0 raw data."""
    out = run_ranks(bench_rank, world_size=world_size, timeout_s=timeout_s, settings=settings)
    report = summarize(out[0], world_size)
    report["settings"] = out[0]["settings"]
    return {"report": report, "raw": out}


def _write_timeline(raw: List[Dict[str, Any]], report: Dict[str, Any], out_dir: Path) -> List[Path]:
    from .timeline import render_timeline_png, write_chrome_trace

    best = f"depth_{report['best_depth']}" if report.get("best_depth") is not None else None
    picked = {"reactive (depth 0)": "reactive"}
    if best:
        picked[f"proactive (depth {report['best_depth']})"] = best
    events = {label: [e for r in raw for e in r["traces"].get(name, [])] for label, name in picked.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    png = render_timeline_png(events, out_dir / "timeline.png", max_batches=6,
                              title=f"{report['world_size']} gloo ranks, emulated link {report['link']['bandwidth_gbps']:.3g} GB/s")
    trace = write_chrome_trace(events, out_dir / "timeline.trace.json")
    return [png, trace]


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="torchrec-proactive bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small model, few steps (about a minute)")
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--timeline", type=Path, help="write timeline.png and a Chrome trace here")
    p.add_argument("--scaling", type=Path, help="also run 1 rank, calibrate the scaling model, plot projections here")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--sharding", default="table_wise")
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--zipf-alpha", type=float, default=1.05)
    p.add_argument("--cache-load-factor", type=float, default=0.05)
    p.add_argument("--depths", default="1,2,4")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--rounds", type=int, default=3, help="times each configuration runs (rotated order)")
    p.add_argument("--link-bandwidth-gbps", type=float, default=None, help="default: calibrated")
    p.add_argument("--link-latency-us", type=float, default=100.0)
    p.add_argument("--target-fetch-fraction", type=float, default=0.6)
    p.add_argument("--sweep-bandwidth", default=None, help="comma-separated GB/s values: one run each")
    args = p.parse_args(argv)
    settings = _settings(args)

    if args.sweep_bandwidth:
        rows = []
        for bw in (float(x) for x in args.sweep_bandwidth.split(",")):
            rep = run_bench(replace(settings, link_bandwidth_gbps=bw, include_cache100=False), args.world_size)["report"]
            rows.append({k: rep[k] for k in REQUIRED_KEYS if k != "configs"})
            print(f"{bw:>8.4g} GB/s: reactive {rep['reactive_samples_per_s']:.0f}/s, proactive "
                  f"{rep['proactive_samples_per_s']:.0f}/s (depth {rep['best_depth']}), speed-up "
                  f"{rep['speedup_vs_reactive']:.2f}x, resident {rep['resident_samples_per_s']:.0f}/s", flush=True)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"sweep": rows}, indent=2))
        return 0

    result = run_bench(settings, args.world_size)
    report = result["report"]
    if args.timeline:
        report["timeline_files"] = [str(x) for x in _write_timeline(result["raw"], report, args.timeline)]
    if args.scaling:
        from .scaling_report import scaling_report

        report["scaling"] = scaling_report(settings, result, args.scaling)
    print(format_table(report), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str))
        print(f"report written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
