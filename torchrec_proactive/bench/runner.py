"""``torchrec-proactive bench``: resident vs reactive vs proactive, side by side in one run.

Usage::

    torchrec-proactive bench [--quick] [--json out.json] [--timeline out/] [--scaling out/]
                             [--sweep-bandwidth 0.05,0.1,0.2] [--world-size 2]
    torchrec-proactive bench --cache-planning [--quick] [--cache-budget-bytes B] [--json out.json]
    torchrec-proactive bench --tier ssd [--quick] [--tier-dir DIR] [--host-cache-mb MB] [--json out.json]
                             [--timeline out/]

Configurations (same model, data and initial weights): ``resident`` (stock TorchRec, every
row in device memory), ``reactive`` (depth 0), ``depth_k`` for each ``--depths`` entry,
``auto`` (the depth the trainer's ``prefetch=auto`` rule picks), ``cache100`` (a 100% cache:
the store's own overhead) and ``cache1_reactive`` / ``cache1`` (a 1% cache, at depth 0 and at
the deepest depth).

On CPU the host-to-device link is an *emulated* copy engine (``link.kind == "emulated"``)
whose bandwidth is calibrated, unless given, so that one step's cold fetch costs
``--target-fetch-fraction`` of a resident step. Every figure in the output says so.

Every configuration runs once per round, ``--rounds`` rounds (rotated order): many short
rounds rather than a few long ones, so that each ratio is judged on per-round ratios, which
cancel the machine's drift. From 6 rounds on, each rate and each ratio comes with a 95%
interval (``noise.py``) and a ratio is "within noise" when its interval holds 1; fewer
rounds (``--quick``: 1) print the figures bare, with no interval and no verdict. Every rank runs one
intra-op thread per core it has to itself (ranks and the fetch workers share the cores).
Progress goes to stderr, the summary to stdout
(``--json -``: the JSON report to stdout and the summary to stderr).

``--tier ssd`` benchmarks instead a table larger than host memory on this machine's disk
(``O_DIRECT``), at several depths of its two hops (disk -> host cache -> device cache),
against the same table in DRAM (``bench/ssd.py``; JSON key ``ssd``). Its files go to a new
directory under ``--tier-dir`` and are removed afterwards, also on an error or Ctrl-C.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

# (benchmarks/soak.py and gpu_check.py take the argument types from here too)
from .cli_args import (SHARDINGS, HelpFormatter, checked, comma_list, depth_pairs, float_above,  # noqa: F401
                       float_at_least, float_in, int_at_least)
from .noise import MIN_PAIRED_ROUNDS, format_ratio, sweep_warnings
from ..quiet import quiet_third_party
from .report import COUNTER_KEYS, REQUIRED_KEYS, format_table, summarize

# --------------------------------------------------------------------------------------------
# running

#: Rounds of a default run: 12 per-round ratios give a t-interval about a third as wide as
#: one per-round ratio's spread (noise.MIN_PAIRED_ROUNDS is the least that gives one).
DEFAULT_ROUNDS = 12


DEFAULT_LOAD_FACTOR = 0.05
#: --model sequence's default: its default history (512 samples x 32 ids per rank, Zipf 1.05
#: over 400k items) brings about 8k distinct rows a global batch to the history table, which
#: a 5% cache (20k slots) holds for less than depth 1 beside the batch awaiting backward
#: (measured: 0.97 prefetches a step deferred to their lookup at every depth)
SEQUENCE_LOAD_FACTOR = 0.2


def cache_load_factor(args: argparse.Namespace) -> float:
    """``--cache-load-factor``, or the model's default."""
    if args.cache_load_factor is not None:
        return float(args.cache_load_factor)
    return SEQUENCE_LOAD_FACTOR if getattr(args, "model", "dlrm") == "sequence" else DEFAULT_LOAD_FACTOR


def _settings(args: argparse.Namespace) -> Any:
    from .rank import BenchSettings
    from .workload import Workload

    workload = Workload(num_tables=args.tables, rows_per_table=args.rows, embedding_dim=args.dim,
                        batch_size=args.batch_size, zipf_alpha=args.zipf_alpha, skew=args.skew, model=args.model,
                        history_length=args.history_length, history_rows=args.history_rows)
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else DEFAULT_ROUNDS)
    s = BenchSettings(
        workload=workload, sharding=args.sharding, cache_load_factor=cache_load_factor(args),
        depths=tuple(args.depths), warmup_steps=args.warmup, measure_steps=args.steps,
        link_bandwidth_gbps=args.link_bandwidth_gbps, link_latency_us=args.link_latency_us,
        target_fetch_fraction=args.target_fetch_fraction, trace=bool(args.timeline or args.scaling),
        rounds=rounds,
    )
    if args.quick:
        s = replace(s, workload=replace(workload, num_tables=min(workload.num_tables, 4),
                                        rows_per_table=min(workload.rows_per_table, 20_000),
                                        history_rows=min(workload.history_rows, 40_000),
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
    import os

    import torch

    # One intra-op thread per core the rank has to itself: more would make the ranks (and
    # their fetch workers) take turns on the cores, noise that no number of rounds averages out.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
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


def timeline_figures(report: Dict[str, Any], picked: Dict[str, str]) -> Dict[str, Dict[str, Any]]:
    """The table's step and stall figures of the configurations in the picture (label ->
    configuration name), with the steps they cover: the picture states these, not others."""
    by_name = {c["name"]: c for c in report["configs"] if "error" not in c}
    return {label: {"step_ms": by_name[name]["step_ms_median"], "stall_ms_per_step": by_name[name]["stall_ms_per_step"],
                    "steps": by_name[name]["steps_measured"], "rounds": by_name[name].get("rounds", 1)}
            for label, name in picked.items() if name in by_name}


def _write_timeline(raw: List[Dict[str, Any]], report: Dict[str, Any], out_dir: Path) -> List[Path]:
    from .timeline import render_timeline_png, write_chrome_trace

    best = f"depth_{report['best_depth']}" if report.get("best_depth") is not None else None
    picked = {"reactive (depth 0)": "reactive"}
    if best:
        picked[f"proactive (depth {report['best_depth']})"] = best
    events = {label: [e for r in raw for e in r["traces"].get(name, [])] for label, name in picked.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    png = render_timeline_png(events, out_dir / "timeline.png", max_batches=6, figures=timeline_figures(report, picked),
                              title=f"{report['world_size']} gloo ranks, emulated link {report['link']['bandwidth_gbps']:.3g} "
                                    f"GB/s; bars: each configuration's first round, as traced")
    trace = write_chrome_trace(events, out_dir / "timeline.trace.json")
    return [png, trace]


# --------------------------------------------------------------------------------------------
# command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torchrec-proactive bench", description=__doc__, formatter_class=HelpFormatter)
    out = p.add_argument_group("outputs")
    out.add_argument("--quick", action="store_true",
                     help="small model, few steps: at most 4 tables x 20k rows, batch 256, 4 + 10 steps, depths "
                          "1,2,4 and 1 round unless --rounds is given (10-30 s, 1.5-5 min with --scaling; a smoke "
                          "test: no intervals and no verdicts)")
    out.add_argument("--json", type=Path, metavar="PATH",
                     help="write the JSON report here ('-': to stdout, the summary then goes to stderr); "
                          "default: no JSON")
    out.add_argument("--timeline", type=Path, metavar="DIR",
                     help="write timeline.png and timeline.trace.json (Chrome trace) here; default: none")
    out.add_argument("--scaling", type=Path, metavar="DIR",
                     help="also run 1 rank, the skewed 1/2/4-rank straggler runs and the held-out runs built to tell "
                          "the step model from a null model (--scaling-held-out), validate the model on them, project "
                          "it to GPU systems (DGX H100/H200, a GH200 node, DGX H100 with NVMe) for the workloads owners "
                          "run and write projection.png/json here; under 25 min on 2 cores; default: none")
    sc = p.add_argument_group("scaling study (with --scaling)")
    sc.add_argument("--scaling-profile", type=comma_list(str, "profile names"), default=None, metavar="NAME,...",
                    help="hardware profiles to project to (dgx_h100, dgx_h200, gh200_node, dgx_h100_nvme; a name's "
                         "start works); default: all four")
    sc.add_argument("--scaling-workloads", type=comma_list(str, "workload names"), default=None, metavar="NAME,...",
                    help="workloads to project (dcnv2_multi_hot, dlrm_one_hot, dcnv2_multi_hot_scaled); default: all "
                         "three, and a custom one when --scaling-tables/rows/dim/batch/ids-per-sample are given")
    sc.add_argument("--scaling-tables", type=int_at_least(1), default=None, metavar="N",
                    help="a custom workload: tables (one feature each); default: no custom workload")
    sc.add_argument("--scaling-rows", type=int_at_least(1), default=None, metavar="N",
                    help="a custom workload: rows per table (default 40,000,000 when another custom flag is given)")
    sc.add_argument("--scaling-dim", type=int_at_least(1), default=None, metavar="D",
                    help="a custom workload: embedding dimension (default 128)")
    sc.add_argument("--scaling-batch", type=int_at_least(1), default=None, metavar="B",
                    help="a custom workload: samples per GPU (default 8192)")
    sc.add_argument("--scaling-ids-per-sample", type=float_above(0.0), default=None, metavar="X",
                    help="a custom workload: ids per sample and table, multi-hot as MLPerf's generator expands them "
                         "(default 1)")
    sc.add_argument("--scaling-host-link-gbps", type=float_above(0.0), default=None, metavar="GBPS",
                    help="achievable host->device copy bandwidth per direction (band +-10%%) for every profile chosen "
                         "(GH200's C2C link included: pick profiles with --scaling-profile); the link's capacity shared "
                         "with the NIC stays the profile's, so the NIC never cuts an override below itself; default: "
                         "each profile's cited figure")
    sc.add_argument("--scaling-network-gbps", type=float_above(0.0), default=None, metavar="GBPS",
                    help="achievable NIC bandwidth per GPU per direction (band +-10%%), for every profile chosen; "
                         "default: the profile's")
    sc.add_argument("--scaling-link-latency-us", type=float_at_least(0.0), default=None, metavar="US",
                    help="latency of one host->device copy (per batch), every profile; default: 10")
    sc.add_argument("--scaling-host-dram-gbps", type=float_above(0.0), default=None, metavar="GBPS",
                    help="achievable host DRAM bandwidth of one host memory (a DGX node's sockets, one Grace), shared "
                         "by its GPUs' copies (band +-10%%); default: the profile's (460 on a DGX, 410 on GH200)")
    sc.add_argument("--scaling-step-overhead-ms", type=float_at_least(0.0), default=None, metavar="MS",
                    help="fixed per-step cost beyond the MLPerf-sourced step (TorchRec's eager pipeline), a third in "
                         "the forward (band x0.5-x2); default: 0 with a band of 0-4 ms")
    sc.add_argument("--scaling-nvme-latency-us", type=float_above(0.0), default=None, metavar="US",
                    help="NVMe profiles: one page read's latency (band +-20%%); default: 90")
    sc.add_argument("--scaling-nvme-reads-in-flight", type=float_above(0.0), default=None, metavar="N",
                    help="NVMe profiles: reads in flight per GPU (the store's I/O threads); default: 64")
    sc.add_argument("--scaling-ssd-json", type=comma_list(Path, "paths"), default=None, metavar="PATH,...",
                    help="bench --tier ssd JSON reports to validate the NVMe model on, held out; default: none")
    sc.add_argument("--scaling-held-out", type=comma_list(str, "held-out run names"), default=None, metavar="NAME,...",
                    help=f"held-out runs to measure ({', '.join(HELD_OUT_RUNS)}, or none); default: all of them, "
                         f"bursts only with --quick")
    sc.add_argument("--scaling-trace", type=Path, default=None, metavar="NPY",
                    help="your ids to replay instead of Zipf: an .npy of shape [samples, tables] (e.g. a "
                         "TorchRec-preprocessed Criteo day_N_sparse.npy); default: Zipf ids")
    sc.add_argument("--scaling-straggler-ranks", type=comma_list(int_at_least(1), "integers >= 1"), default="1,2,4",
                    metavar="N,...", help="gloo rank counts of the measured straggler runs (skewed tables, "
                                          "table-wise; small model, link-bound)")
    sc.add_argument("--scaling-straggler-skew", type=float_in(-1e-12, 0.99), default=0.5, metavar="S",
                    help="table skew of the straggler runs (see --skew)")
    out.add_argument("--sweep-bandwidth", type=comma_list(float_above(0.0), "numbers > 0"), metavar="GBPS,...",
                     help="comma-separated emulated link bandwidths in GB/s: one run each, warns when the rates "
                          "are non-monotonic beyond noise; default: no sweep")
    out.add_argument("--cache-planning", action="store_true",
                     help="run only the cache-planning case: skewed tables, planner-chosen vs uniform load factors "
                          "at equal cache bytes, on 1 rank (JSON key cache_planning; see bench/cache_planning.py)")
    out.add_argument("--cache-budget-bytes", type=int_at_least(1), default=None, metavar="B",
                     help="--cache-planning: device budget per rank in bytes (default: a quarter of the tables' bytes)")
    w = p.add_argument_group("workload")
    w.add_argument("--world-size", type=int_at_least(1), default=2, metavar="N", help="local gloo ranks")
    w.add_argument("--sharding", choices=SHARDINGS, default="table_wise", metavar="TYPE",
                   help=f"sharding type of every table, one of {', '.join(SHARDINGS)}")
    w.add_argument("--model", choices=("dlrm", "sequence"), default="dlrm",
                   help="dlrm: DLRM over --tables pooled tables; sequence: the same pooled tables beside a user "
                        "history of --history-length ids per sample over --history-rows items, looked up per id "
                        "(an EmbeddingCollection, ProactiveEmbeddingCollectionSharder)")
    w.add_argument("--history-length", type=int_at_least(1), default=32, metavar="L",
                   help="--model sequence: history ids per sample (Zipf-skewed with --zipf-alpha)")
    w.add_argument("--history-rows", type=int_at_least(1), default=400_000, metavar="N",
                   help="--model sequence: rows of the history (item) table")
    w.add_argument("--tables", type=int_at_least(1), default=8, metavar="N", help="embedding tables")
    w.add_argument("--rows", type=int_at_least(1), default=100_000, metavar="N", help="rows per table (at most)")
    w.add_argument("--dim", type=checked("a multiple of 4 >= 4 (FBGEMM)", lambda v: v >= 4 and v % 4 == 0, int),
                   default=64, metavar="D", help="embedding dimension")
    w.add_argument("--batch-size", type=int_at_least(1), default=512, metavar="B", help="samples per rank per step")
    w.add_argument("--zipf-alpha", type=float_above(0.0), default=1.05, metavar="A",
                   help="Zipf skew of the sparse ids")
    w.add_argument("--skew", type=float_in(-1e-12, 0.99), default=0.0, metavar="S",
                   help="skewed tables: table i's Zipf exponent is A * (1 + S * (1 - 2 i / (n - 1))), so "
                        "table-wise shards differ in misses per step (stragglers)")
    w.add_argument("--cache-load-factor", type=float_in(0.0, 1.0), default=None, metavar="F",
                   help=f"device cache size as a fraction of each local shard's rows (default {DEFAULT_LOAD_FACTOR}; "
                        f"{SEQUENCE_LOAD_FACTOR} with --model sequence, whose batches bring many more distinct rows: "
                        f"a history table's cache must hold k + 1 batches of them for depth k to prefetch)")
    t = p.add_argument_group("disk tier (--tier ssd: a table larger than host memory, on this machine's disk)")
    t.add_argument("--tier", choices=("dram", "ssd"), default="dram",
                   help="dram: the bench above (every table's host tier in DRAM); ssd: one table whose rows live in a "
                        "file on disk behind a host cache, at depths 0, 1 and --ssd-depths against the same table in "
                        "DRAM (JSON key ssd; bench/ssd.py); with --quick a tiny table, seconds, no claims. It reads "
                        "--dim, --zipf-alpha, --cache-load-factor (the device cache), --warmup, --steps, --rounds, "
                        "--json and --timeline too")
    t.add_argument("--tier-dir", type=Path, default=None, metavar="DIR",
                   help="--tier ssd: where the table's file goes (in a new subdirectory, removed afterwards; DIR is "
                        "created when missing); default: a new directory under the system's temporary directory")
    t.add_argument("--table-gb", type=float_above(0.0), default=2.0, metavar="GB",
                   help="--tier ssd: size of the table's file (sized down, with a note, where the disk or the memory "
                        "for the dram configuration lacks room)")
    t.add_argument("--host-cache-mb", type=float_above(0.0), default=256.0, metavar="MB",
                   help="--tier ssd: the host cache (DRAM) in front of the file; the table should be at least 4x it")
    t.add_argument("--ssd-depths", type=depth_pairs, default=None, metavar="K:KD,...",
                   help="--tier ssd: deeper configurations besides reactive and depth_1, each host->device depth K "
                        "and disk depth KD (K alone: K:K); default: 1:4,2:8,4:16 (2:2,4:4,8:8 on a store whose "
                        "lookahead has no disk depth of its own)")
    t.add_argument("--ids-per-step", type=int_at_least(1), default=4096, metavar="N",
                   help="--tier ssd: Zipf ids a step (one per sample; --zipf-alpha), as the default bench's 8 tables "
                        "x 512 samples")
    t.add_argument("--step-ms", type=float_above(0.0), default=10.0, metavar="MS",
                   help="--tier ssd: the device's step, EMULATED by a sleep between lookup and backward")
    t.add_argument("--io-threads", type=int_at_least(1), default=64, metavar="N",
                   help="--tier ssd: disk reads in flight at most (the file's I/O threads)")
    t.add_argument("--time-budget-min", type=float_above(0.0), default=14.0, metavar="MIN",
                   help="--tier ssd: rounds past the 6 that intervals need stop where the next would end the run "
                        "later than this (the summary says so); the rounds asked are a maximum")
    m = p.add_argument_group("measurement")
    m.add_argument("--depths", type=comma_list(int_at_least(1), "integers >= 1"), default="1,2,4,8",
                   metavar="K,...", help="proactive prefetch depths (reactive, depth 0, always runs)")
    m.add_argument("--warmup", type=int_at_least(1), default=8, metavar="N", help="warm-up steps per run, not timed")
    m.add_argument("--steps", type=int_at_least(1), default=32, metavar="N", help="timed steps per run (round)")
    m.add_argument("--rounds", type=int_at_least(1), default=None, metavar="N",
                   help="times each configuration runs, in rotated order; from 6 rounds on, rates and ratios get "
                        "95%% intervals and verdicts from the per-round figures, fewer rounds none "
                        f"(default: {DEFAULT_ROUNDS}, 1 with --quick)")
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
        speed = (format_ratio(rep["noise"]["speedup_vs_reactive"]) if rep.get("noise")
                 else f"{rep['speedup_vs_reactive']:.2f}x" if rep["best_depth"] is not None else "")
        proactive = (f"proactive {rep['proactive_samples_per_s']:.0f}/s (depth {rep['best_depth']}), speed-up {speed}"
                     if rep["best_depth"] is not None else "proactive: every depth failed")
        print(f"{bw:>8.4g} GB/s: reactive {rep['reactive_samples_per_s']:.0f}/s, {proactive}, "
              f"resident {rep['resident_samples_per_s']:.0f}/s", file=summary, flush=True)
    found = sweep_warnings(rows)
    for w in found:
        print(f"WARNING: {w}", file=summary, flush=True)
    judged = all(r.get("reactive_samples_per_s_interval") for r in rows)
    if not judged and len(rows) > 1:
        print(f"rates not judged for monotonicity: fewer than {MIN_PAIRED_ROUNDS} rounds per point give no "
              f"intervals (--rounds {settings.rounds})", file=summary, flush=True)
    elif not found and len(rows) > 1:
        print(f"rates are monotonic in bandwidth (within noise) over {len(rows)} points", file=summary, flush=True)
    _write_json(args.json, {"sweep": rows, "warnings": found})
    return 0


def _study_settings(args: argparse.Namespace) -> Any:
    """The projection's inputs from the command line (profiles and their figures, workloads, trace)."""
    from ..model.hardware import PROFILES, profile_named
    from ..model.workloads import WORKLOADS, custom_workload, workload_named
    from .scaling_study import StudySettings

    profiles = tuple(profile_named(n) for n in args.scaling_profile) if args.scaling_profile else PROFILES
    if args.scaling_trace is not None and not args.scaling_trace.is_file():
        raise ValueError(f"--scaling-trace {str(args.scaling_trace)!r}: no such file (expected an .npy of ids, "
                         f"shape [samples, tables])")
    unknown = [n for n in (args.scaling_held_out or []) if n not in HELD_OUT_RUNS + ("none",)]
    if unknown:
        raise ValueError(f"--scaling-held-out {unknown[0]!r}: no such run; expected some of "
                         f"{', '.join(HELD_OUT_RUNS)}, or none")

    for path in args.scaling_ssd_json or []:
        try:
            ssd = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"--scaling-ssd-json {str(path)!r}: not a readable JSON report ({e})") from None
        if "disk_probe" not in (ssd.get("ssd") or ssd):
            raise ValueError(f"--scaling-ssd-json {str(path)!r}: not a bench --tier ssd report (no ssd.disk_probe)")

    def overridden(p: Any) -> Any:
        bands = {name: (lo, hi) for name, lo, hi in p.bands}
        changes: Dict[str, Any] = {}
        for key, value, scale in (("host_link_achievable_gbps", args.scaling_host_link_gbps, 1.0),
                                  ("network_achievable_gbps", args.scaling_network_gbps, 1.0),
                                  ("host_dram_gbps", args.scaling_host_dram_gbps, 1.0)):
            if value is not None:
                changes[key] = value * scale
                bands[key] = (0.9 * value * scale, 1.1 * value * scale)
        if args.scaling_link_latency_us is not None:
            changes["host_link_latency_s"] = args.scaling_link_latency_us * 1e-6
        if args.scaling_step_overhead_ms is not None:
            v = args.scaling_step_overhead_ms * 1e-3
            changes["step_overhead_s"] = v
            bands["step_overhead_s"] = (0.5 * v, 2.0 * v)
        if p.tier == "nvme":
            if args.scaling_nvme_latency_us is not None:
                v = args.scaling_nvme_latency_us * 1e-6
                changes["nvme_latency_s"] = v
                bands["nvme_latency_s"] = (0.8 * v, 1.2 * v)
            if args.scaling_nvme_reads_in_flight is not None:
                changes["nvme_reads_in_flight"] = args.scaling_nvme_reads_in_flight
        return replace(p, **changes, bands=tuple((k, lo, hi) for k, (lo, hi) in bands.items())) if changes else p

    workloads = tuple(workload_named(n) for n in args.scaling_workloads) if args.scaling_workloads else WORKLOADS
    custom = (args.scaling_tables, args.scaling_rows, args.scaling_dim, args.scaling_batch, args.scaling_ids_per_sample)
    if any(v is not None for v in custom):
        workloads = workloads + (custom_workload(args.scaling_tables or 26, args.scaling_rows or 40_000_000,
                                                 args.scaling_dim or 128, args.scaling_batch or 8192,
                                                 args.scaling_ids_per_sample or 1.0),)
    study = StudySettings(profiles=tuple(overridden(p) for p in profiles), workloads=workloads,
                          trace=args.scaling_trace)
    if not any(p.key == study.headline[0] for p in study.profiles) or not any(
            w.name == study.headline[1] for w in study.workloads):
        study = replace(study, headline=(study.profiles[0].key, study.workloads[0].name, 8))
    if args.quick:  # fewer scales and a smaller locality check (a smoke test of the study)
        study = replace(study, world_sizes=(1, 8, 64), check_rows=100_000, check_hotness=(1, 4),
                        check_fractions=(0.1,), check_steps=16, check_warmup=6, load_steps=16, quick=True)
    if args.scaling_trace is not None:
        _check_trace(args.scaling_trace, study)  # a bad trace is refused here, not after minutes of benchmarks
    return study


def _check_trace(path: Path, study: Any) -> None:
    import numpy as np

    try:
        data = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise ValueError(f"--scaling-trace {str(path)!r}: not a readable .npy id array ({e})") from None
    if data.ndim != 2 or data.shape[0] < 2:
        raise ValueError(f"--scaling-trace {str(path)!r}: expected [samples, tables] with at least 2 samples, got "
                         f"shape {tuple(data.shape)}")
    if data.dtype.kind not in "iu":  # (a float id would be truncated into another row, silently)
        raise ValueError(f"--scaling-trace {str(path)!r}: expected integer ids, got dtype {data.dtype}")
    low = int(np.asarray(data).min())
    if low < 0:
        raise ValueError(f"--scaling-trace {str(path)!r}: ids must be >= 0, found {low}")


#: The held-out runs ``--scaling`` measures besides the straggler runs: each built where the
#: null model (no schedule) and the step model disagree by more than the 15% target.
HELD_OUT_RUNS = ("slow_link", "bursts", "bursts_2_ranks", "multi_hot", "long_bursts", "long_bursts_2_ranks",
                 "rare_bursts", "rare_bursts_2_ranks")


#: Rounds of each run the validation reads beside the main bench (the 1-rank run, the straggler
#: runs, the held-out runs). Each round builds its model afresh, and a build runs fast or slow
#: for all its steps: a round's mean step spread as much over 72 steps as over its first 24
#: (measured on two held-out runs, 6 rounds), and taking the rounds' common drift out left the
#: split-half spread of a configuration's median round at 8-9%. So the number of rounds, not
#: their length, sets how well an entry is measured: 8 rounds, where 5 of 24 steps were.
VALIDATION_ROUNDS = 8


def _small_settings(settings: Any, args: argparse.Namespace, **workload: Any) -> Any:
    """The straggler runs' small model (4 tables x 20k rows, batch 256, table-wise, a 20% cache
    that pins k + 1 batches, a 100%-cache run for the store's own overhead) at reactive and
    depths 1 and 2 (where the null model and the step model part), :data:`VALIDATION_ROUNDS`
    rounds of 6 + 16 steps (16: whole periods of a burst every 4th or 8th batch; the validation
    takes the median of each configuration's round means, and needs no interval)."""
    w = settings.workload
    small = replace(w, num_tables=4, rows_per_table=min(w.rows_per_table, 20_000), batch_size=min(w.batch_size, 256),
                    skew=0.0, **workload)
    return replace(settings, workload=small, sharding="table_wise", depths=(1, 2), include_auto=False,
                   cache_load_factor=0.2, include_cache100=True, include_cache1=False, trace=False,
                   link_bandwidth_gbps=None, warmup_steps=4 if args.quick else 6,
                   measure_steps=8 if args.quick else 16, rounds=1 if args.quick else VALIDATION_ROUNDS)


def _held_out_runs(settings: Any, args: argparse.Namespace) -> List[Tuple[str, Any, int]]:
    """(label, settings, ranks) of the held-out runs asked for (:data:`HELD_OUT_RUNS`):

    * ``slow_link``: one batch's copy about a step long (``target_fetch_fraction`` 1.7): depth 1
      stalls for the rest of the forward and planning, which the null model does not see;
    * ``bursts``: every 4th batch draws all its ids uniformly (cold), the mean copy a resident
      step (``target_fetch_fraction`` 1.0): a burst's copy outlasts its window at depths 1 and 2
      and stalls the steps behind it, while the mean copy fits;
    * ``bursts_2_ranks``: the same on 2 table-wise ranks;
    * ``multi_hot``: 8 ids a sample and table (64 samples), the slow link: planning and the
      hand-off grow with the ids;
    * ``long_bursts`` and ``long_bursts_2_ranks`` (1 and 2 ranks): every 8th batch cold beside a
      50% cache, the mean copy 1.3 resident steps, depths 1, 2 and 4: meant to make a burst's
      copy several steps long, so that it stalls depth 2 as well as depth 1. Measured, a burst
      copied only ~3x the other batches' rows (they still miss a 50% cache), and only depth 1
      on 2 ranks told the models apart;
    * ``rare_bursts`` and ``rare_bursts_2_ranks``: the same with Zipf(1.4) ids, whose batches
      bring few rows the cache has not seen (a cache of the bench's length is never full, so
      what a batch misses is what it sees first: a larger cache changes nothing, measured), the
      mean copy one resident step: a burst's copy is several steps long."""
    names = args.scaling_held_out or (["bursts"] if args.quick else list(HELD_OUT_RUNS))
    if "none" in names:
        return []
    out = []
    for name in names:
        if name == "slow_link":
            out.append(("held-out: slow link", replace(_small_settings(settings, args), target_fetch_fraction=1.7), 1))
        elif name == "bursts":
            out.append(("held-out: bursts", replace(_small_settings(settings, args, burst_every=4),
                                                    target_fetch_fraction=1.0), 1))
        elif name == "bursts_2_ranks":
            out.append(("held-out: bursts, 2 ranks", replace(_small_settings(settings, args, burst_every=4),
                                                             target_fetch_fraction=1.0), 2))
        elif name == "multi_hot":
            s = _small_settings(settings, args, ids_per_feature=8)
            out.append(("held-out: multi-hot", replace(s, workload=replace(s.workload, batch_size=64),
                                                       target_fetch_fraction=1.7), 1))
        elif name in ("long_bursts", "long_bursts_2_ranks"):
            s = replace(_small_settings(settings, args, burst_every=8), cache_load_factor=0.5, depths=(1, 2, 4),
                        target_fetch_fraction=1.3)
            two = name.endswith("2_ranks")
            out.append((f"held-out: long bursts{', 2 ranks' if two else ''}", s, 2 if two else 1))
        elif name in ("rare_bursts", "rare_bursts_2_ranks"):
            s = replace(_small_settings(settings, args, burst_every=8, zipf_alpha=1.4), cache_load_factor=0.5,
                        depths=(1, 2, 4), target_fetch_fraction=1.0)
            two = name.endswith("2_ranks")
            out.append((f"held-out: rare bursts{', 2 ranks' if two else ''}", s, 2 if two else 1))
    return out


def _straggler_settings(settings: Any, args: argparse.Namespace) -> Any:
    """The straggler runs: a small model with skewed tables, table-wise, its link calibrated
    so that a cold fetch costs a whole resident step (the link is the bottleneck, so 4 ranks
    on 2 cores measure the link, not the CPU); reactive, depth 1 (TorchRec's prefetch
    pipeline schedule) and deeper. (Stragglers here come from the skew, which persists from
    step to step; the projection adds batch-to-batch variance.)"""
    w = settings.workload
    small = replace(w, num_tables=4, rows_per_table=min(w.rows_per_table, 20_000), batch_size=min(w.batch_size, 256),
                    skew=args.scaling_straggler_skew)
    # A 20% cache: at 4 ranks one rank's table sees 4 x 256 ids a step, and the cache must
    # hold k + 1 = 5 batches' rows, or prefetches wait for pins and no depth is what it says.
    # The 100% cache is measured too: it is the store's own overhead at this rank count,
    # an input of the model (without it the 1-rank runs were modelled 50% fast).
    return replace(settings, workload=small, sharding="table_wise", depths=(1, 2, 4), include_auto=False,
                   cache_load_factor=0.2,
                   include_cache100=True, include_cache1=False, trace=False, target_fetch_fraction=1.0,
                   link_bandwidth_gbps=None, warmup_steps=4 if args.quick else 6,
                   measure_steps=8 if args.quick else 24, rounds=1 if args.quick else VALIDATION_ROUNDS)


def _scaling(settings: Any, report: Dict[str, Any], args: argparse.Namespace, study: Any) -> Dict[str, Any]:
    """The scaling study: calibrated and validated on this run, a 1-rank run on the same link
    regime, the straggler runs and the held-out runs, projected to GPU systems; writes
    projection.{json,png}. ``study``: :func:`_study_settings`, checked by ``main`` before
    anything ran. Returns its summary for the bench report."""
    from .scaling_study import write_study

    runs = [report]
    if args.world_size != 1:
        # Its link calibrated as this run's was (a cold fetch costs the same share of a
        # resident step), unless a bandwidth was given: the same regime, not the same link
        # (the same link would put one rank's copy right at the length of its step, where a
        # run's jitter, not the model, decides). The calibration set's run: VALIDATION_ROUNDS.
        one = replace(settings, trace=False, include_auto=False, rounds=min(settings.rounds, VALIDATION_ROUNDS))
        runs.insert(0, run_bench(one, world_size=1, label="scaling: 1-rank run")["report"])
    straggle = _straggler_settings(settings, args)
    stragglers = []
    for n in args.scaling_straggler_ranks:
        rep = run_bench(straggle, world_size=n, label=f"scaling: stragglers, {n} rank(s)")["report"]
        rep["settings"] = {**rep.get("settings", {}), "cache_load_factor": straggle.cache_load_factor}
        stragglers.append(rep)
    extra = []
    for label, held, ranks in _held_out_runs(settings, args):
        extra.append((label, run_bench(held, world_size=ranks, label=f"scaling: {label}")["report"]))
    ssd_reports = [json.loads(Path(p).read_text()) for p in (args.scaling_ssd_json or [])]
    doc = write_study(args.scaling, runs, study, straggler_runs=stragglers, extra_runs=extra, ssd_reports=ssd_reports)
    return {k: doc.get(k) for k in ("validation", "validation_max_abs_error", "calibration_max_abs_error",
                                     "held_out_max_abs_error", "targets", "misses", "stragglers", "verdicts", "files",
                                     "discriminating", "validation_verdict", "sensitivity", "counter_summary")}


def _cache_planning(args: argparse.Namespace, summary: Any) -> int:
    from .cache_planning import PlanningCase, SkewedWorkload, run_cache_planning, summary_line

    case = PlanningCase(budget_bytes=args.cache_budget_bytes or 0)
    if args.quick:
        case = replace(case, workload=SkewedWorkload(embedding_dim=16, batch_size=128, table_rows=(4000, 2000, 1000, 500)),
                       profile_steps=80, warmup_steps=30, measure_steps=10, rounds=1,
                       # half the tables' bytes: at this size TorchRec's fixed I/O estimate is a large share
                       budget_bytes=args.cache_budget_bytes or 240_000)
    out = run_cache_planning(case)
    print(summary_line(out), file=summary, flush=True)
    _write_json(args.json, {"cache_planning": out})
    return 0


def _ssd(args: argparse.Namespace, summary: Any) -> int:
    """``--tier ssd`` (bench/ssd.py): the directory first (a bad --tier-dir: one line, exit 2,
    before anything heavy), then the run; its files are removed whatever happens."""
    from .tier_dir import TierDir, TierDirError, terminate_as_interrupt

    try:
        tier = TierDir(args.tier_dir)
    except TierDirError as e:
        _say(f"torchrec-proactive bench: {e}")
        return 2
    try:
        with terminate_as_interrupt():
            report = _ssd_run(args, tier)
    except KeyboardInterrupt:
        removed = tier.remove()
        _say(f"torchrec-proactive bench: interrupted; the tier files under {tier.path} "
             f"{'were removed' if removed else 'could NOT be removed'}")
        return 130
    except _SsdUsage as e:
        tier.remove()
        _say(f"torchrec-proactive bench: {e}")
        return 2
    except Exception as e:
        from ..store.errors import ProactiveError

        removed = tier.remove()
        if not isinstance(e, (ProactiveError, OSError)):
            raise
        _say(f"torchrec-proactive bench: {e} (tier files {'removed' if removed else 'NOT removed: ' + str(tier.path)})")
        return 1
    finally:
        removed = tier.remove()
    from .ssd import format_ssd_summary, public, write_ssd_timeline

    report["tier_dir"], report["files_removed"] = str(tier.path), removed
    if args.timeline:
        report["timeline_files"] = write_ssd_timeline(report, args.timeline)
        for f in report["timeline_files"]:
            _say(f"wrote {f}")
    print(format_ssd_summary(report), file=summary, flush=True)
    _write_json(args.json, {"ssd": public(report)})
    return 0


class _SsdUsage(ValueError):
    """A --tier ssd option this store cannot run: one line, exit 2."""


def _ssd_run(args: argparse.Namespace, tier: Any) -> Dict[str, Any]:
    from tqdm import tqdm

    from . import ssd
    from .tier_dir import MEMORY_FILESYSTEMS, filesystem_of

    s = ssd.SsdSettings(table_bytes=int(args.table_gb * ssd.GB), host_cache_bytes=int(args.host_cache_mb * ssd.MB),
                        dim=args.dim, ids_per_step=args.ids_per_step, zipf_alpha=args.zipf_alpha,
                        device_cache_fraction=cache_load_factor(args), step_ms=args.step_ms, io_threads=args.io_threads,
                        depths=tuple(args.ssd_depths or ()), warmup_steps=args.warmup, timed_steps=args.steps,
                        rounds=args.rounds or DEFAULT_ROUNDS)
    if args.quick:
        s = ssd.quick_settings(s)
        if args.rounds:
            s = replace(s, rounds=args.rounds)
    separate = ssd.disk_depth_supported()
    uneven = [f"{k}:{kd}" for k, kd in s.depths if k != kd]
    if uneven and not separate:
        raise _SsdUsage(f"--ssd-depths {','.join(uneven)}: this store's lookahead has no disk depth of its own yet "
                        f"(the disk hop is as deep as the host->device hop): give K:K")
    s, notes = ssd.fit_to_machine(s, tier.free_bytes())
    fs = filesystem_of(tier.path)
    if fs in MEMORY_FILESYSTEMS:
        notes.append(f"the tier directory {tier.path} is on {fs}: the table's file lives in memory, so these figures "
                     f"measure memory, not a disk (give --tier-dir on a disk)")
    for n in notes:
        _say(f"note: {n}")
    configs = ssd.configs_for(s, separate)
    total = s.rounds * (len(configs) + 1)
    with tqdm(total=total, desc="ssd", unit="run", file=sys.stderr, dynamic_ncols=True, mininterval=0.5) as bar:
        def progress(what: str, done: int) -> None:
            bar.set_description(f"ssd: {what}")
            bar.update(done - bar.n)

        report = ssd.run_ssd_bench(s, tier.path, notes, progress=progress, trace=bool(args.timeline),
                                   budget_s=60 * args.time_budget_min)
    report["filesystem"] = fs
    return report


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
    if args.tier == "ssd":
        return _ssd(args, summary)
    settings = _settings(args)
    study = None
    if args.scaling:
        try:
            study = _study_settings(args)  # bad scaling inputs: one line, before anything runs
        except ValueError as e:
            _say(f"torchrec-proactive bench: {e}")
            return 2
    try:
        if args.cache_planning:
            return _cache_planning(args, summary)
        if args.sweep_bandwidth:
            return _sweep(args, settings, summary)
        result = run_bench(settings, args.world_size)
        report = result["report"]
        if args.timeline:
            report["timeline_files"] = [str(x) for x in _write_timeline(result["raw"], report, args.timeline)]
            for f in report["timeline_files"]:
                _say(f"wrote {f}")
        if args.scaling:
            report["scaling"] = _scaling(settings, report, args, study)
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
