"""``torchrec-proactive bench``: resident vs reactive vs proactive, side by side in one run.

Usage::

    torchrec-proactive bench [--quick] [--json out.json] [--timeline out/] [--scaling out/]
                             [--sweep-bandwidth 0.05,0.1,0.2] [--world-size 2]

Configurations (same model, data and initial weights): ``resident`` (stock TorchRec, every
row in device memory), ``reactive`` (depth 0), ``depth_k`` for each ``--depths`` entry,
``auto`` (the depth the trainer's ``prefetch=auto`` rule picks), ``cache100`` (a 100% cache:
the store's own overhead) and ``cache1_reactive`` / ``cache1`` (a 1% cache, at depth 0 and at
the deepest depth).

On CPU the host-to-device link is an *emulated* copy engine (``link.kind == "emulated"``)
whose bandwidth is calibrated, unless given, so that one step's cold fetch costs
``--target-fetch-fraction`` of a resident step. Every figure in the output says so.

Every configuration runs ``--rounds`` times (rotated order). Each rate comes with an
interval: the range of its per-round rates, widened to the 95% confidence interval of the
median step over all measured steps. A ratio whose two intervals overlap is reported as
"within noise". Progress goes to stderr, the summary to stdout (``--json -``: the JSON
report to stdout and the summary to stderr).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

REQUIRED_KEYS = (
    "reactive_samples_per_s", "proactive_samples_per_s", "resident_samples_per_s", "speedup_vs_reactive",
    "fraction_of_resident", "stall_ms_reactive", "stall_ms_proactive", "link", "best_depth", "configs",
)

#: Per-configuration counters (per step, summed over ranks): what moved, not how fast. They
#: depend on the data, the cache and the depth only, so tests can assert them exactly.
COUNTER_KEYS = ("rows_requested_per_step", "rows_fetched_per_step", "rows_fetched_at_lookup_per_step",
                "bytes_moved_per_step", "rows_written_back_per_step", "hit_rate", "deferred_batches_per_step",
                "overflow_rows_per_step")

#: ``planning.SHARDING_TYPES`` + ``auto`` (kept here so that ``--help`` and usage errors need
#: no TorchRec import; tests/test_bench_cli.py checks that the two agree).
SHARDINGS = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel", "auto")

# --------------------------------------------------------------------------------------------
# third-party noise

# Raised inside TorchRec / PyTorch for calls they make themselves: nothing a user of the bench
# can act on. Filtered by message, in our entry points and the rank processes they spawn only
# (never at library import).
_THIRD_PARTY_WARNINGS: Tuple[Tuple[type, str], ...] = (
    (FutureWarning, r"`broadcast_buffers` is deprecated"),  # DistributedModelParallel -> DDP
    (FutureWarning, r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated"),
)
_THIRD_PARTY_LOG_LINES: Tuple[Tuple[str, str], ...] = (
    ("torch.fx._symbolic_trace", "is_fx_tracing will return true"),  # TorchRec's fx checks
)


class _DropLines(logging.Filter):
    def __init__(self, fragment: str) -> None:
        super().__init__()
        self.fragment = fragment

    def filter(self, record: logging.LogRecord) -> bool:
        return self.fragment not in record.getMessage()


def quiet_third_party() -> None:
    """Filters the known third-party warnings we cannot fix (idempotent). Entry points only."""
    for category, message in _THIRD_PARTY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, fragment in _THIRD_PARTY_LOG_LINES:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropLines) and f.fragment == fragment for f in logger.filters):
            logger.addFilter(_DropLines(fragment))


# --------------------------------------------------------------------------------------------
# noise

_Z95 = 1.959964


def _median_ci(values: Sequence[float]) -> Tuple[float, float]:
    """Distribution-free 95% confidence interval of the median (order statistics)."""
    x = sorted(values)
    n = len(x)
    half = _Z95 * math.sqrt(n) / 2
    lo = max(1, int(math.floor(n / 2 - half)))
    hi = min(n, int(math.ceil(1 + n / 2 + half)))
    return x[lo - 1], x[hi - 1]


def _add_noise(c: Dict[str, Any], samples_per_step: int) -> None:
    """Adds ``samples_per_s_rounds``, ``samples_per_s_interval`` and ``noise_pct`` to a config."""
    per_round = [r for r in c.get("step_ms_per_round") or [] if r]
    if not per_round:
        return
    rate = lambda ms: samples_per_step / (ms / 1e3)  # noqa: E731
    rounds = [rate(statistics.median(r)) for r in per_round]
    ci_fast, ci_slow = _median_ci([t for r in per_round for t in r])
    lo = min([rate(ci_slow), c["samples_per_s"], *rounds])
    hi = max([rate(ci_fast), c["samples_per_s"], *rounds])
    c["samples_per_s_rounds"] = rounds
    c["samples_per_s_interval"] = [lo, hi]
    c["noise_pct"] = 100 * (hi - lo) / 2 / c["samples_per_s"]


def _overlap(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    (a_lo, a_hi), (b_lo, b_hi) = a["samples_per_s_interval"], b["samples_per_s_interval"]
    return a_lo <= b_hi and b_lo <= a_hi


def _ratio(a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, Any]:
    (a_lo, a_hi), (b_lo, b_hi) = a["samples_per_s_interval"], b["samples_per_s_interval"]
    return {"value": a["samples_per_s"] / b["samples_per_s"], "interval": [a_lo / b_hi, a_hi / b_lo],
            "within_noise": _overlap(a, b)}


def noise_verdicts(reactive: Dict[str, Any], resident: Dict[str, Any], best: Dict[str, Any],
                   proactive: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Whether the headline ratios are beyond noise (configs carry ``samples_per_s_interval``).

    All-resident is the upper bound of proactive: proactive above it is reported as "at the
    upper bound" when within noise and as an upper-bound violation (suspect figures) beyond.
    """
    speed = _ratio(best, reactive)
    speed["verdict"] = ("within noise: the two intervals overlap, no measured difference" if speed["within_noise"]
                        else "beyond noise")
    frac = _ratio(best, resident)
    above = frac["value"] > 1.0
    frac["upper_bound_violation"] = above and not frac["within_noise"]
    if above and frac["within_noise"]:
        frac["verdict"] = ("within noise of all-resident, its upper bound: read as 'at the upper bound', "
                           "not a win")
    elif above:
        frac["verdict"] = ("UPPER-BOUND VIOLATION: above all-resident beyond noise, which proactive cannot "
                           "be (all-resident is its upper bound); the figures are suspect (machine contention?), "
                           "rerun with more --rounds / --steps")
    elif frac["within_noise"]:
        frac["verdict"] = "within noise of all-resident"
    else:
        frac["verdict"] = "below all-resident beyond noise"
    tied = [c["prefetch_depth"] for c in proactive if c["name"] != best["name"] and _overlap(c, best)]
    return {"speedup_vs_reactive": speed, "fraction_of_resident": frac, "depths_within_noise_of_best": tied,
            "method": "interval = range of the per-round rates, widened to the 95% CI of the median step "
                      "(order statistics over every measured step); within noise = intervals overlap"}


def sweep_warnings(rows: Sequence[Dict[str, Any]]) -> List[str]:
    """Warnings for rates that fall as the link gets faster, beyond noise (rows in any order)."""
    out: List[str] = []
    ordered = sorted(rows, key=lambda r: r["link"]["bandwidth_gbps"])
    for key, label in (("reactive_samples_per_s", "reactive"), ("proactive_samples_per_s", "proactive")):
        pts = [r for r in ordered if r.get(key) is not None and r.get(f"{key}_interval")]
        for a, b in zip(pts, pts[1:]):
            (a_lo, a_hi), (b_lo, b_hi) = a[f"{key}_interval"], b[f"{key}_interval"]
            if b[key] < a[key] and b_hi < a_lo:
                out.append(
                    f"non-monotonic sweep: {label} samples/s falls from {a[key]:.0f} [{a_lo:.0f}-{a_hi:.0f}] at "
                    f"{a['link']['bandwidth_gbps']:g} GB/s to {b[key]:.0f} [{b_lo:.0f}-{b_hi:.0f}] at "
                    f"{b['link']['bandwidth_gbps']:g} GB/s, beyond noise; a faster link cannot slow training "
                    f"down: the machine was probably busy, rerun with more --rounds / --steps")
    return out


# --------------------------------------------------------------------------------------------
# report


def summarize(rank0: Dict[str, Any], world_size: int) -> Dict[str, Any]:
    """The report: headline ratios (each the quotient of the reported rates) + per-config table."""
    res = rank0["results"]
    batch = rank0.get("settings", {}).get("workload", {}).get("batch_size")
    for c in res.values():
        if "error" not in c and batch:
            _add_noise(c, world_size * batch)
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
    for name, key in (("resident", "resident_samples_per_s_interval"), ("reactive", "reactive_samples_per_s_interval")):
        if "samples_per_s_interval" in res[name]:
            report[key] = res[name]["samples_per_s_interval"]
    if best and "samples_per_s_interval" in best:
        report["proactive_samples_per_s_interval"] = best["samples_per_s_interval"]
        if "samples_per_s_interval" in reactive and "samples_per_s_interval" in resident:
            report["noise"] = noise_verdicts(reactive, resident, best, list(proactive.values()))
    if "auto" in res:
        report["auto_depth"] = res["auto"].get("chosen_depth")
        report["auto_samples_per_s"] = res["auto"]["samples_per_s"]
    if "cache100" in res:
        report["cache100_overhead_vs_resident"] = resident["samples_per_s"] / res["cache100"]["samples_per_s"]
        if "samples_per_s_interval" in res["cache100"] and "samples_per_s_interval" in resident:
            report["cache100_within_noise_of_resident"] = _overlap(res["cache100"], resident)
    return report


def _workload_lines(report: Dict[str, Any]) -> List[str]:
    """What was measured (the table's figures mean little without it) and, for a single
    round, that its verdicts rest on one round's step times only."""
    settings = report.get("settings")
    if not settings:
        return []
    w = settings["workload"]
    lines = [
        f"workload: {w['num_tables']} tables x {w['rows_per_table']} rows x {w['embedding_dim']}, batch "
        f"{w['batch_size']} per rank, {report['world_size']} {report['backend']} rank(s), "
        f"cache load factor {settings['cache_load_factor']:g}; {settings['measure_steps']} timed steps x {settings['rounds']} "
        f"round(s) per configuration"
    ]
    if settings["rounds"] < 2:
        lines.append("one round: a smoke test, not a measurement - the intervals below come from that round's "
                     "step times alone (run without --quick, 3 rounds, for ratios to quote)")
    return lines


def _noise_word(within: bool) -> str:
    return "within noise" if within else "beyond noise"


def format_table(report: Dict[str, Any]) -> str:
    link = report["link"]
    lines = _workload_lines(report) + [
        f"link: {link['kind']} (modelled copy engine) {link['bandwidth_gbps']:.4g} GB/s, "
        f"{link['latency_us']:.0f} us latency"
        + (f" - calibrated so a cold fetch costs {link['target_fetch_fraction']:.0%} of a resident step"
           if link.get("calibrated") else ""),
        f"{'config':<16}{'depth':>6}{'samples/s':>11}{'±%':>6}{'rounds':>7}{'step ms':>9}{'p90 ms':>8}{'stall ms':>9}"
        f"{'plan ms':>8}{'cpu ms':>7}{'rows/step':>10}{'@lookup':>8}{'MB/step':>8}{'hit':>6}{'deferred':>9}"
        f"{'overflow':>9}",
    ]
    for c in report["configs"]:
        if "error" in c:
            lines.append(f"{c['name']:<16}{c['prefetch_depth']!s:>6}  error: {c['error'][:80]}")
            continue
        hit = "-" if c.get("hit_rate") is None else f"{c['hit_rate']:.2f}"
        depth = "-" if c.get("prefetch_depth") is None else c["prefetch_depth"]
        noise = "-" if c.get("noise_pct") is None else f"{c['noise_pct']:.1f}"
        lines.append(
            f"{c['name']:<16}{depth!s:>6}{c['samples_per_s']:>11.0f}{noise:>6}{c.get('rounds', 1):>7}"
            f"{c['step_ms_median']:>9.1f}{c['step_ms_p90']:>8.1f}"
            f"{c['stall_ms_per_step']:>9.2f}{c.get('plan_ms_per_step', 0.0):>8.2f}"
            f"{c.get('plan_cpu_ms_per_step', 0.0):>7.2f}{c['rows_fetched_per_step']:>10.0f}"
            f"{c.get('rows_fetched_at_lookup_per_step', 0.0):>8.0f}"
            f"{c['bytes_moved_per_step'] / 1e6:>8.2f}{hit:>6}"
            f"{c.get('deferred_batches_per_step', 0.0):>9.2f}{c.get('overflow_rows_per_step', 0.0):>9.0f}"
        )
    noise = report.get("noise")
    if report.get("speedup_vs_reactive") is not None:
        speed = f"proactive (depth {report['best_depth']}) / reactive = {report['speedup_vs_reactive']:.2f}x"
        frac = f"proactive / all-resident = {report['fraction_of_resident']:.2f}"
        if noise:
            s, f = noise["speedup_vs_reactive"], noise["fraction_of_resident"]
            speed += f" [{s['interval'][0]:.2f}-{s['interval'][1]:.2f}], {s['verdict']}"
            frac += f" [{f['interval'][0]:.2f}-{f['interval'][1]:.2f}], {f['verdict']}"
        elif report["fraction_of_resident"] > 1:
            frac += " (above its upper bound: noise, not a win)"
        lines.append(f"{speed}; stall {report['stall_ms_reactive']:.1f} -> {report['stall_ms_proactive']:.1f} ms/step")
        lines.append(frac)
        if noise and noise["depths_within_noise_of_best"]:
            tied = noise["depths_within_noise_of_best"]
            which = f"depth {tied[0]} is" if len(tied) == 1 else f"depths {', '.join(str(d) for d in tied)} are"
            lines.append(f"depth {report['best_depth']} is the fastest, but {which} within noise of it")
    if "cache100_overhead_vs_resident" in report:
        line = f"100%-cache step time / stock resident = {report['cache100_overhead_vs_resident']:.2f}x"
        if "cache100_within_noise_of_resident" in report:
            line += f", {_noise_word(report['cache100_within_noise_of_resident'])}"
        lines.append(line)
    if "auto_depth" in report:
        lines.append(f"auto chose depth {report['auto_depth']}")
    if noise:
        lines.append(f"±%: half-width of each rate's interval; {noise['method']}")
    lines.append("plan ms / cpu ms: planning per step, wall time and the planning thread's CPU time (planning "
                 "overlaps the output all-to-all); deferred: prefetches per step that waited for pins; "
                 "overflow: rows per step served from the host tier (cache smaller than one batch); "
                 "@lookup: rows per step copied while the lookup waited (the critical path)")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# running


def _settings(args: argparse.Namespace) -> Any:
    from .rank import BenchSettings
    from .workload import Workload

    workload = Workload(num_tables=args.tables, rows_per_table=args.rows, embedding_dim=args.dim,
                        batch_size=args.batch_size, zipf_alpha=args.zipf_alpha)
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 3)
    s = BenchSettings(
        workload=workload, sharding=args.sharding, cache_load_factor=args.cache_load_factor,
        depths=tuple(args.depths), warmup_steps=args.warmup, measure_steps=args.steps,
        link_bandwidth_gbps=args.link_bandwidth_gbps, link_latency_us=args.link_latency_us,
        target_fetch_fraction=args.target_fetch_fraction, trace=bool(args.timeline or args.scaling),
        rounds=rounds,
    )
    if args.quick:
        s = replace(s, workload=replace(workload, num_tables=min(workload.num_tables, 4),
                                        rows_per_table=min(workload.rows_per_table, 20_000),
                                        batch_size=min(workload.batch_size, 256)),
                    warmup_steps=min(s.warmup_steps, 4), measure_steps=min(s.measure_steps, 10), depths=(1, 2, 4))
    return s


def _expected_measurements(settings: Any) -> int:
    # resident, reactive, the depths, cache100, the 1% cache pair and auto (measured in every round)
    configs = (2 + len(settings.depths) + (1 if settings.include_cache100 else 0)
               + (2 if getattr(settings, "include_cache1", False) else 0) + (1 if settings.include_auto else 0))
    return (2 if settings.link_bandwidth_gbps is None else 0) + settings.rounds * configs


def _bench_worker(rank: int, world_size: int, settings: Any, label: str = "bench") -> Dict[str, Any]:
    """One bench rank, quiet about third-party warnings; rank 0 draws the progress bar (stderr)."""
    quiet_third_party()
    from .rank import bench_rank

    if rank != 0:
        return bench_rank(rank, world_size, settings)
    from tqdm import tqdm

    with tqdm(total=_expected_measurements(settings), desc=label, unit="run", file=sys.stderr,
              dynamic_ncols=True, mininterval=0.5) as bar:
        def progress(stage: str, name: str, round_index: Optional[int]) -> None:
            if stage == "start":
                where = "link calibration" if round_index is None else f"round {round_index + 1}/{settings.rounds}"
                bar.set_description(f"{label}: {name}, {where}")
            else:
                bar.update(1)

        return bench_rank(rank, world_size, settings, progress=progress)


def run_bench(settings: Any, world_size: int = 2, timeout_s: float = 1800, label: str = "bench") -> Dict[str, Any]:
    """Runs the benchmark on ``world_size`` local gloo ranks; returns the report and rank-0 raw data."""
    from ..launch import run_ranks

    print(f"{label}: starting {world_size} gloo rank(s)", file=sys.stderr, flush=True)
    out = run_ranks(_bench_worker, world_size=world_size, timeout_s=timeout_s, settings=settings, label=label)
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


# --------------------------------------------------------------------------------------------
# command line


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in every option's help; an option whose help already explains its default
    (``None`` meaning "computed") is left as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None and "default" in text:
            return text
        return super()._get_help_string(action)


def _checked(kind: str, test: Callable[[Any], bool], convert: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(s: str) -> Any:
        try:
            v = convert(s)
        except ValueError:
            v = None
        if v is None or not test(v):
            raise argparse.ArgumentTypeError(f"invalid value {s!r}: expected {kind}")
        return v

    parse.__name__ = kind  # argparse names the type in some messages
    return parse


def _finite(s: str) -> float:
    v = float(s)
    if not math.isfinite(v):
        raise ValueError(s)
    return v


def int_at_least(lo: int) -> Callable[[str], int]:
    return _checked(f"an integer >= {lo}", lambda v: v >= lo, int)


def float_above(lo: float) -> Callable[[str], float]:
    return _checked(f"a number > {lo:g}", lambda v: v > lo, _finite)


def float_at_least(lo: float) -> Callable[[str], float]:
    return _checked(f"a number >= {lo:g}", lambda v: v >= lo, _finite)


def float_in(lo: float, hi: float) -> Callable[[str], float]:
    return _checked(f"a number in ({lo:g}, {hi:g}]", lambda v: lo < v <= hi, _finite)


def comma_list(item: Callable[[str], Any], kind: str) -> Callable[[str], List[Any]]:
    def parse(s: str) -> List[Any]:
        items = s.split(",")
        for x in items:
            try:
                item(x.strip())
            except argparse.ArgumentTypeError:
                raise argparse.ArgumentTypeError(f"invalid value {s!r}: expected comma-separated {kind} "
                                                 f"(item {x.strip()!r})") from None
        return [item(x.strip()) for x in items]

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torchrec-proactive bench", description=__doc__, formatter_class=HelpFormatter)
    out = p.add_argument_group("outputs")
    out.add_argument("--quick", action="store_true",
                     help="small model, few steps: at most 4 tables x 20k rows, batch 256, 4 + 10 steps, depths "
                          "1,2,4 and 1 round unless --rounds is given (10-30 s; a smoke test, too short for ratios)")
    out.add_argument("--json", type=Path, metavar="PATH",
                     help="write the JSON report here ('-': to stdout, the summary then goes to stderr); "
                          "default: no JSON")
    out.add_argument("--timeline", type=Path, metavar="DIR",
                     help="write timeline.png and timeline.trace.json (Chrome trace) here; default: none")
    out.add_argument("--scaling", type=Path, metavar="DIR",
                     help="also run 1 rank, calibrate the scaling model and write projection.png/json here; "
                          "default: none")
    out.add_argument("--sweep-bandwidth", type=comma_list(float_above(0.0), "numbers > 0"), metavar="GBPS,...",
                     help="comma-separated emulated link bandwidths in GB/s: one run each, warns when the rates "
                          "are non-monotonic beyond noise; default: no sweep")
    w = p.add_argument_group("workload")
    w.add_argument("--world-size", type=int_at_least(1), default=2, metavar="N", help="local gloo ranks")
    w.add_argument("--sharding", choices=SHARDINGS, default="table_wise", metavar="TYPE",
                   help=f"sharding type of every table, one of {', '.join(SHARDINGS)}")
    w.add_argument("--tables", type=int_at_least(1), default=8, metavar="N", help="embedding tables")
    w.add_argument("--rows", type=int_at_least(1), default=100_000, metavar="N", help="rows per table (at most)")
    w.add_argument("--dim", type=_checked("a multiple of 4 >= 4 (FBGEMM)", lambda v: v >= 4 and v % 4 == 0, int),
                   default=64, metavar="D", help="embedding dimension")
    w.add_argument("--batch-size", type=int_at_least(1), default=512, metavar="B", help="samples per rank per step")
    w.add_argument("--zipf-alpha", type=float_above(0.0), default=1.05, metavar="A",
                   help="Zipf skew of the sparse ids")
    w.add_argument("--cache-load-factor", type=float_in(0.0, 1.0), default=0.05, metavar="F",
                   help="device cache size as a fraction of each local shard's rows")
    m = p.add_argument_group("measurement")
    m.add_argument("--depths", type=comma_list(int_at_least(1), "integers >= 1"), default="1,2,4,8",
                   metavar="K,...", help="proactive prefetch depths (reactive, depth 0, always runs)")
    m.add_argument("--warmup", type=int_at_least(1), default=8, metavar="N", help="warm-up steps per run, not timed")
    m.add_argument("--steps", type=int_at_least(1), default=64, metavar="N", help="timed steps per run")
    m.add_argument("--rounds", type=int_at_least(1), default=None, metavar="N",
                   help="times each configuration runs, in rotated order; the spread across rounds is reported "
                        "(default: 3, 1 with --quick)")
    m.add_argument("--link-bandwidth-gbps", type=float_above(0.0), default=None, metavar="GBPS",
                   help="emulated link bandwidth (default: calibrated to --target-fetch-fraction)")
    m.add_argument("--link-latency-us", type=float_at_least(0.0), default=100.0, metavar="US",
                   help="emulated link latency per copy")
    m.add_argument("--target-fetch-fraction", type=float_above(0.0), default=0.6, metavar="F",
                   help="calibration: cold fetch time of one step / resident step time")
    return p


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _sweep(args: argparse.Namespace, settings: Any, summary: Any) -> int:
    rows = []
    bandwidths = sorted(set(args.sweep_bandwidth))
    for i, bw in enumerate(bandwidths, start=1):
        rep = run_bench(replace(settings, link_bandwidth_gbps=bw, include_cache100=False), args.world_size,
                        label=f"sweep {i}/{len(bandwidths)} ({bw:g} GB/s)")["report"]
        row = {k: rep[k] for k in REQUIRED_KEYS if k != "configs"}
        for k in ("reactive_samples_per_s_interval", "proactive_samples_per_s_interval", "noise"):
            if k in rep:
                row[k] = rep[k]
        # What crossed the link, per configuration: the link's speed changes when rows arrive,
        # never which rows move (a deterministic check of the sweep, unlike its rates).
        row["counters"] = {c["name"]: {k: c.get(k) for k in COUNTER_KEYS} for c in rep["configs"] if "error" not in c}
        rows.append(row)
        proactive = (f"proactive {rep['proactive_samples_per_s']:.0f}/s (depth {rep['best_depth']}), speed-up "
                     f"{rep['speedup_vs_reactive']:.2f}x" if rep["best_depth"] is not None else "proactive: every depth failed")
        print(f"{bw:>8.4g} GB/s: reactive {rep['reactive_samples_per_s']:.0f}/s, {proactive}, "
              f"resident {rep['resident_samples_per_s']:.0f}/s", file=summary, flush=True)
    found = sweep_warnings(rows)
    for w in found:
        print(f"WARNING: {w}", file=summary, flush=True)
    if not found and len(rows) > 1:
        print(f"rates are monotonic in bandwidth (within noise) over {len(rows)} points", file=summary, flush=True)
    _write_json(args.json, {"sweep": rows, "warnings": found})
    return 0


def _write_json(path: Optional[Path], doc: Dict[str, Any]) -> None:
    if path is None:
        return
    text = json.dumps(doc, indent=2, default=str)
    if str(path) == "-":
        print(text, flush=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    _say(f"wrote {path}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_third_party()
    from ..launch import RankFailure

    # `--json -` puts the JSON on stdout: the summary moves to stderr.
    summary = sys.stderr if args.json is not None and str(args.json) == "-" else sys.stdout
    settings = _settings(args)
    try:
        if args.sweep_bandwidth:
            return _sweep(args, settings, summary)
        result = run_bench(settings, args.world_size)
        report = result["report"]
        if args.timeline:
            report["timeline_files"] = [str(x) for x in _write_timeline(result["raw"], report, args.timeline)]
            for f in report["timeline_files"]:
                _say(f"wrote {f}")
        if args.scaling:
            from .scaling_report import scaling_report

            report["scaling"] = scaling_report(settings, result, args.scaling)
            for f in report["scaling"]["files"]:
                _say(f"wrote {f}")
    except RankFailure as e:
        _say(f"torchrec-proactive bench: {getattr(e, 'user_message', None) or e}")
        return 1
    print(format_table(report), file=summary, flush=True)
    _write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
