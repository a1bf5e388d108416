"""torchrec-proactive: generate Criteo-format data, train DLRM/DCNv2 with proactive cold-row
fetching, compare reactive vs. proactive, benchmark.

examples:
  torchrec-proactive gen-data --out-dir data/mine --num-samples 100000 --max-cardinality 20000
  torchrec-proactive train --nproc 2 experiment=debug_2rank data.root=data/mine
  torchrec-proactive train --nproc 2 -m prefetch.depth=0,1,2 experiment=ci_tiny
  torchrun --nproc_per_node 8 -m torchrec_proactive.cli train experiment=kaggle_proactive data.root=/data/criteo
  torchrec-proactive compare --nproc 2
  torchrec-proactive bench --quick
  torchrec-proactive bench --tier ssd --json ssd.json --timeline ssd/

train and compare are Hydra applications over the packaged configs (conf/ in the
repository): overrides, -m sweeps, --cfg, --info, --config-dir (see `train --help`).
Under torchrun or torchx (WORLD_SIZE set) each process is one rank and --nproc is
ignored. Mistakes in arguments, config, data or run directory end in one line on stderr
and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any, Callable, List, Optional, Sequence, Tuple

from .app.elastic import record_user_error, recorded
from .app.errors import EXIT_USAGE, UserError

PROG = "torchrec-proactive"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """argparse's defaults in every option's help, descriptions and epilogs kept as written.

    Options without a meaningful default (``None``: the help says what happens instead,
    required ones, positionals) get no "(default: ...)" suffix. Descriptions and epilogs lose
    their reStructuredText markup (``--help`` is read in a terminal)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        from .bench.cli_args import plain_text  # (stdlib only)

        return super()._fill_text(plain_text(text), width, indent)

    def _get_help_string(self, action: argparse.Action) -> Optional[str]:
        if action.default is None or action.required or not action.option_strings:
            return action.help
        return super()._get_help_string(action)


def _at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: an int >= ``minimum`` (argparse turns the error into its usual
    one-line usage error, exit code 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: must be an integer >= {minimum}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is invalid: must be >= {minimum}")
        return value

    parse.__name__ = f"int >= {minimum}"
    return parse


def _version() -> str:
    from importlib import metadata

    from . import __version__

    stack = []
    for dist in ("torch", "torchrec", "fbgemm-gpu", "fbgemm-gpu-cpu", "hydra-core", "torchx"):
        try:
            stack.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    return f"{PROG} {__version__} ({', '.join(stack)})"


def _config_epilog() -> str:
    """The config groups with their options, and the experiments, for ``train --help``."""
    try:
        from .app.compose import config_tree

        tree = config_tree()
    except Exception as e:  # --help must work even with a broken install
        return f"config groups: unavailable ({e})"
    groups = {g: opts for g, opts in tree.items() if g != "experiment"}
    width = max(len(g) for g in groups) + 2
    lines = ["config groups (pick one with group=option; set any field with group.field=value):"]
    lines += [f"  {g + ':':<{width}}{', '.join(opts)}" for g, opts in groups.items()]
    lines += ["", "experiments (experiment=name; conf/experiment/<name>.yaml, or yours in --config-dir):",
              f"  {', '.join(tree.get('experiment', []))}", "",
              "every field, with its default and limits: train --cfg, and torchrec_proactive/config/schema.py.",
              "outputs: Hydra's run directory (default outputs/<date>/<time>, new for every run); a directory",
              "that holds a previous run is refused unless train.resume=true, which continues it.",
              "data: data.root (default data/synthetic, under the current directory: generated data goes",
              "there); preprocessed arrays go to <data set>/preprocessed (data.preprocessed_dir) and the",
              "cache profile to <data set>/cache_profile.json (cache.profile_path): set both to leave the",
              "data directory unwritten.", "",
              HYDRA_OPTIONS]
    return "\n".join(lines)


HYDRA_OPTIONS = """Hydra options (this is a Hydra application; Hydra parses these itself):
  -m, --multirun        a sweep: one job per combination of comma-separated values
                        (prefetch.depth=0,1,2), each in its own run directory under
                        hydra.sweep.dir, each launching its own --nproc ranks
  --cfg {job,hydra,all} print Hydra's composed config (with --resolve: resolved;
                        -p PACKAGE: one part) and exit; --cfg alone prints the validated
                        config the ranks run, every field resolved
  --info [{all,config,defaults,defaults-tree,plugins,searchpath}]
                        Hydra's information about the app and its search path
  -cd, --config-dir DIR adds DIR to the search path after the packaged configs (it may
                        hold only experiment/my_run.yaml); hydra.searchpath=[...] adds more
  --hydra-help          Hydra's own help
run directories: hydra.run.dir (default outputs/<date>/<time>), or in a sweep
hydra.sweep.dir/hydra.sweep.subdir; hydra.job.chdir=true runs the job inside it.
train.output_dir, when set, wins over both."""


def _add_run_options(p: argparse.ArgumentParser, default_nproc: int) -> None:
    p.add_argument("--nproc", type=_at_least(1), default=default_nproc,
                   help="local ranks (processes) to spawn for each run (each job of a sweep); ignored under "
                        "torchrun/torchx")
    p.add_argument("overrides", nargs="*", default=[],
                   help="Hydra overrides: group=option (experiment=debug_2rank, prefetch=auto) or "
                        "group.field=value (train.batch_size=512), hydra.* (hydra.run.dir=...)")


def build_parser() -> argparse.ArgumentParser:
    """The ``torchrec-proactive`` argument parser (``bench`` is handed to its own runner)."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser(
        "gen-data", formatter_class=_HelpFormatter,
        help="write synthetic Criteo-format TSV (and optionally preprocess it)",
        description="Writes synthetic data in the Criteo TSV format (label, 13 integer and 26 hex categorical "
                    "columns), Zipf-skewed ids, learnable labels.\n`train data=synthetic data.root=<out-dir>` "
                    "then trains on exactly these files.")
    g.add_argument("--out-dir", required=True,
                   help="directory for the TSV file(s) and spec.json; pass it to train as data.root (required)")
    g.add_argument("--layout", choices=("kaggle", "terabyte"), default="kaggle",
                   help="kaggle: one train.txt; terabyte: day_0 .. day_<n-1>")
    g.add_argument("--num-samples", type=int, default=100_000, help="rows to write, all files together")
    g.add_argument("--num-files", type=int, default=1, help="day files (terabyte layout only; kaggle has 1)")
    g.add_argument("--cardinality-scale", type=float, default=1.0,
                   help="multiplies Criteo's per-feature cardinalities")
    g.add_argument("--max-cardinality", type=int, default=None,
                   help="cap on any feature's cardinality (default: no cap; train's data.max_cardinality is 20000)")
    g.add_argument("--zipf-alpha", type=float, default=1.1, help="skew of id popularity (larger: hotter head)")
    g.add_argument("--positive-rate", type=float, default=None,
                   help="fraction of clicks (default: the layout's, 0.256 kaggle, 0.034 terabyte)")
    g.add_argument("--seed", type=int, default=0, help="generator seed: the data is a function of all options")
    g.add_argument("--preprocess", action="store_true",
                   help="also convert to TorchRec's npy format in <out-dir>/preprocessed (train otherwise "
                        "does it on first use)")
    g.set_defaults(func=cmd_gen_data, parser=g)

    epilog = _config_epilog()
    t = sub.add_parser("train", formatter_class=_HelpFormatter, epilog=epilog,
                       help="train DLRM/DCNv2 on Criteo with proactive fetching",
                       description="Trains DLRM or DCNv2 on Criteo-format data with the proactive sharder and "
                                   "pipeline. The last line on stdout is the run's result as JSON (keys: "
                                   "torchrec_proactive/app/result.py, TrainResult), also written to "
                                   "<run dir>/result.json; under torchrun/torchx rank 0 prints it, as the job's "
                                   "last line (torchx's own status lines follow it). Each launch into a run "
                                   "directory (the first, then every resume) keeps its record in <run "
                                   "dir>/launches/<n>/ (Hydra's .hydra/ holds the latest launch's).")
    _add_run_options(t, default_nproc=1)
    t.set_defaults(func=cmd_train, parser=t)

    c = sub.add_parser("compare", formatter_class=_HelpFormatter, epilog=epilog,
                       help="reactive vs. proactive on the same data and caches (emulated link on CPU)",
                       description="Trains prefetch depth 0 (reactive) and depth k (proactive) on the same data\n"
                                   "and caches, in interleaved rounds of about 10 steps after a warm-up, and prints:\n"
                                   "  each run's samples/s, step and stall;\n"
                                   "  the speed-up with its 95% interval and verdict, as 1.23x [1.10-1.37], beyond\n"
                                   "  noise (from the per-round ratios; fewer than 6 rounds give neither);\n"
                                   "  where each run's step time went, per phase (stall, planning, forward, backward,\n"
                                   "  optimizer, the rest of the step);\n"
                                   "  whether the final parameters are bit-identical;\n"
                                   "  where the run's files went (compare.json holds every figure and round).\n"
                                   "Default: experiment=compare_cpu (2 ranks, 156 steps a run in 14 rounds, about\n"
                                   "1.5 minutes on 2 cores).")
    _add_run_options(c, default_nproc=2)
    c.set_defaults(func=cmd_compare, parser=c)

    pc = sub.add_parser("profile-cache", formatter_class=_HelpFormatter, epilog=epilog,
                        help="measure each table's miss-ratio curve on the run's data (and plan the cache sizes)",
                        description="Samples cache.profile_batches global batches of the training data, measures "
                                    "each table's miss-ratio curve at the run's prefetch depth and saves it "
                                    "(cache.profile_path, default cache_profile.json in the data set's directory; "
                                    "reused while data, tables, batch and depth are unchanged). Per table it "
                                    "prints the distinct rows per batch, the cacheability and the floor (min_slots: "
                                    "the rows depth + 1 batches pin, which every planned cache holds), then the "
                                    "smallest cache.budget_bytes that places every cache at its floor on the run's "
                                    "ranks (smaller budgets are refused). With cache.budget_bytes=B (and "
                                    "sharding=auto) it also prints the slots the planner picks and the miss rate the "
                                    "curve expects of each; `train` with the same config uses them. The last line "
                                    "on stdout is JSON (the same figures).")
    _add_run_options(pc, default_nproc=1)
    pc.set_defaults(func=cmd_profile_cache, parser=pc)

    # `bench` hands every argument (--help included) to the runner; see main().
    sub.add_parser("bench", help="benchmarks (torchrec_proactive.bench.runner; `bench --help`)", add_help=False)
    return parser


def _gen_data_error(parser: argparse.ArgumentParser, e: ValueError) -> None:
    """The spec's ``field=value is invalid`` in the words of the command line (``--field``)."""
    text = str(e)
    for name in ("num_samples", "num_files", "cardinality_scale", "max_cardinality", "zipf_alpha",
                 "positive_rate", "seed", "layout"):
        text = text.replace(f"{name}=", f"--{name.replace('_', '-')}=")
    parser.error(text)


def cmd_gen_data(args: argparse.Namespace) -> int:
    """``gen-data``: writes the TSV files (and ``spec.json``) into ``--out-dir``."""
    from pathlib import Path

    from .quiet import quiet_third_party

    quiet_third_party()  # (--preprocess runs TorchRec's Criteo pipes: their pickle note)

    from .data import SyntheticCriteoSpec, generate

    try:
        spec = SyntheticCriteoSpec(
            layout=args.layout, num_samples=args.num_samples, cardinality_scale=args.cardinality_scale,
            max_cardinality=args.max_cardinality, zipf_alpha=args.zipf_alpha, seed=args.seed,
            num_files=args.num_files, positive_rate=args.positive_rate,
        )
    except ValueError as e:
        _gen_data_error(args.parser, e)
    progress = sys.stderr.isatty()  # bars on a terminal only; redirected logs stay plain
    existing = [p.name for p in Path(args.out_dir).glob("*") if p.name in ("spec.json", "train.txt")
                or p.name.startswith("day_")] if Path(args.out_dir).is_dir() else []
    if existing:
        print(f"gen-data: replacing the data set in {args.out_dir} ({', '.join(sorted(existing)[:3])}"
              f"{' ...' if len(existing) > 3 else ''})", file=sys.stderr)
    try:
        paths = generate(spec, args.out_dir, progress=progress)
        print(f"wrote {len(paths)} file(s): {', '.join(str(p) for p in paths)}")
        if args.preprocess:
            from .data.criteo import preprocess

            pre = preprocess(paths, Path(args.out_dir) / "preprocessed", progress=progress)
            print(f"preprocessed into {pre.out_dir}: {pre.total_samples} rows, cardinalities {list(pre.cardinalities)}")
    except OSError as e:
        raise UserError(f"--out-dir={args.out_dir!r} cannot be written: {e.strerror or e} ({e.filename})") from e
    except ValueError as e:
        if getattr(e, "user_error", False):  # a malformed file: file, line, field, value
            raise UserError(str(e)) from e
        raise
    print(f"train on it with: {PROG} train data=synthetic data.root={args.out_dir}")
    return 0


CFG_KINDS = ("job", "hydra", "all")


def split_run_argv(argv: Sequence[str]) -> Tuple[List[str], List[str], bool]:
    """``(ours, hydra's, typed_cfg)``: ``--nproc`` (and ``-h``) are this CLI's, everything
    else goes to Hydra's parser untouched. A bare ``--cfg`` (not followed by job, hydra or
    all) asks for the validated config and is taken out."""
    ours: List[str] = []
    hydra_argv: List[str] = []
    typed_cfg = False
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--nproc":
            ours += argv[i:i + 2]
            i += 2
            continue
        if a.startswith("--nproc=") or a in ("-h", "--help"):
            ours.append(a)
        elif a in ("--cfg", "-c") and (i + 1 == len(argv) or argv[i + 1] not in CFG_KINDS):
            typed_cfg = True
        else:
            hydra_argv.append(a)
        i += 1
    return ours, hydra_argv, typed_cfg


def _run(mode: str, argv: Sequence[str], report: Callable[[List[Any]], None]) -> int:
    parser = build_parser()
    ours, hydra_argv, typed_cfg = split_run_argv(argv)
    args = parser.parse_args([mode, *ours])  # --help, and --nproc's usage errors (exit code 2)
    if typed_cfg:
        # Only Hydra and the schema are imported before the config is composed (not torch), so a
        # config mistake is reported in about a second.
        from .app.compose import compose_config, to_yaml
        from .app.hydra_app import parse_hydra_argv

        hydra_args, _ = parse_hydra_argv(f"{PROG} {mode}", hydra_argv)
        print(to_yaml(compose_config(hydra_args.overrides, hydra_args.config_dir)))
        raise SystemExit(0)
    from .app.hydra_app import run_app

    return run_app(mode, hydra_argv, args.nproc, report)


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"  # under torchrun every rank reports


# Under torchrun (torchx runs it) each worker's stdout and stderr reach the console through
# log tails that poll every 0.1 s, one thread per stream (torchrun's --tee, then torchx's
# local scheduler), so a result printed right after the last log line may be shown before
# it. Waiting this long first makes the result the last line of the job's output.
TAIL_SETTLE_S = 1.0


def _settle_before_result() -> None:
    if "WORLD_SIZE" in os.environ:
        import time

        sys.stderr.flush()
        time.sleep(TAIL_SETTLE_S)


def _report_train(results: List[Any]) -> None:
    from .app.result import TrainResult

    if _is_rank0():
        _settle_before_result()
        print(TrainResult.from_summary(results[0]).to_json(), flush=True)


def _report_compare(results: List[Any]) -> None:
    from .app.compare import format_table

    result = results[0]
    if isinstance(result, dict) and "rows" in result and _is_rank0():
        _settle_before_result()
        print(format_table(result), flush=True)


def cmd_train(argv: Sequence[str]) -> int:
    """``train``: runs the ranks (of every job, with ``-m``), prints each run's
    :class:`~torchrec_proactive.app.result.TrainResult` line."""
    return _run("train", argv, _report_train)


def cmd_compare(argv: Sequence[str]) -> int:
    """``compare``: reactive vs. proactive, printed as a table (``experiment=compare_cpu``
    unless an experiment is given)."""
    argv = list(argv)
    if not any(a.lstrip("+~").startswith("experiment=") for a in argv):
        argv.insert(0, "experiment=compare_cpu")
    return _run("compare", argv, _report_compare)


def _report_profile(results: List[Any]) -> None:
    import json

    if _is_rank0():
        _settle_before_result()
        out = results[0]
        for name, t in sorted(out["tables"].items()):
            planned = (f", planned {t['planned_slots']} slots (miss rate {t['planned_miss_rate']:.3f})"
                       if "planned_slots" in t else "")
            print(f"{name}: {t['expected_lookups']:.0f} distinct rows/batch, cacheability {t['cacheability']:.3f}, "
                  f"at least {t['min_slots']} of {t['rows']} rows cached{planned}", flush=True)
        print(f"minimum cache.budget_bytes at prefetch depth {out['prefetch_depth']}: {out['min_budget_bytes']} "
              f"bytes per device (every table's cache at its floor)", flush=True)
        if "plan" in out:
            print(out["plan"]["log"], flush=True)
        print(json.dumps(out), flush=True)


def cmd_profile_cache(argv: Sequence[str]) -> int:
    """``profile-cache``: the run's cache profile (and plan), printed; JSON last."""
    return _run("profile-cache", argv, _report_profile)


def cmd_bench(argv: Sequence[str]) -> int:
    """``bench``: hands ``argv`` to :mod:`torchrec_proactive.bench.runner`."""
    try:
        runner = importlib.import_module("torchrec_proactive.bench.runner")
    except ModuleNotFoundError as e:
        if e.name not in ("torchrec_proactive.bench.runner", "torchrec_proactive.bench"):
            raise
        print(f"{PROG} bench: the benchmark runner (torchrec_proactive.bench.runner) is not "
              "available in this installation", file=sys.stderr)
        return EXIT_USAGE
    import inspect

    if inspect.signature(runner.main).parameters:
        return int(runner.main(list(argv)) or 0)
    sys.argv = [f"{PROG} bench", *argv]
    return int(runner.main() or 0)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``torchrec-proactive`` console script. Returns the exit code; a
    :class:`~torchrec_proactive.app.errors.UserError` becomes one line on stderr and 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return cmd_bench(argv[1:])
    command = argv[0] if argv else None
    try:
        if command in ("train", "compare", "profile-cache"):
            # Hydra parses its own flags and the overrides (see HYDRA_OPTIONS)
            run = {"train": cmd_train, "compare": cmd_compare, "profile-cache": cmd_profile_cache}[command]
            return int(run(argv[1:]) or 0)
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except UserError as e:
        message = f"{PROG} {command}: error: {e}"
        print(message, file=sys.stderr)
        record_user_error(message)  # under torchrun/torchx: the root cause its summary shows
        return EXIT_USAGE


if __name__ == "__main__":  # how torchrun and the torchx component start each rank
    sys.exit(recorded(main)())
