"""``torchrec-proactive``: generate data, train, compare reactive vs. proactive, benchmark.

    torchrec-proactive gen-data --out-dir data/synth --num-samples 100000 --max-cardinality 20000
    torchrec-proactive train --nproc 2 experiment=debug_2rank          # N local ranks
    torchrun --nproc_per_node 8 -m torchrec_proactive.cli train model=dlrm_kaggle data=criteo_kaggle
    torchrec-proactive compare --nproc 2                                # the README main job
    torchrec-proactive bench ...

``train`` and ``compare`` take Hydra overrides of ``conf/`` (see ``conf/config.yaml``).
Under torchrun/torchx (``WORLD_SIZE`` set) the process is one rank and ``--nproc`` is
ignored.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import List, Optional, Sequence

EXIT_USAGE = 2


def _add_common(p: argparse.ArgumentParser, default_nproc: int) -> None:
    p.add_argument("--nproc", type=int, default=default_nproc,
                   help=f"local ranks to spawn when not under torchrun (default {default_nproc})")
    p.add_argument("--config-dir", default=None, help="the conf/ directory (default: the repository's)")
    p.add_argument("--cfg", action="store_true", help="print the composed config and exit")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=dlrm_kaggle train.batch_size=512")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchrec-proactive", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("gen-data", help="write synthetic Criteo-format TSV (and optionally preprocess it)")
    g.add_argument("--out-dir", required=True, help="directory for the TSV file(s)")
    g.add_argument("--layout", choices=("kaggle", "terabyte"), default="kaggle")
    g.add_argument("--num-samples", type=int, default=100_000)
    g.add_argument("--num-files", type=int, default=1, help="terabyte layout: day files")
    g.add_argument("--cardinality-scale", type=float, default=1.0)
    g.add_argument("--max-cardinality", type=int, default=None)
    g.add_argument("--zipf-alpha", type=float, default=1.1)
    g.add_argument("--positive-rate", type=float, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--preprocess", action="store_true", help="also write npy files to <out-dir>/preprocessed")
    g.set_defaults(func=cmd_gen_data)

    t = sub.add_parser("train", help="train DLRM/DCNv2 on Criteo with proactive fetching")
    _add_common(t, default_nproc=1)
    t.set_defaults(func=cmd_train)

    c = sub.add_parser("compare", help="reactive vs. proactive on the same data and caches (emulated link on CPU)")
    _add_common(c, default_nproc=2)
    c.set_defaults(func=cmd_compare)

    # `bench` hands every argument (--help included) to the runner; see main().
    sub.add_parser("bench", help="benchmarks (torchrec_proactive.bench.runner; `bench --help`)", add_help=False)
    return parser


def cmd_gen_data(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .data import SyntheticCriteoSpec, generate

    spec = SyntheticCriteoSpec(
        layout=args.layout, num_samples=args.num_samples, cardinality_scale=args.cardinality_scale,
        max_cardinality=args.max_cardinality, zipf_alpha=args.zipf_alpha, seed=args.seed,
        num_files=args.num_files, positive_rate=args.positive_rate,
    )
    paths = generate(spec, args.out_dir)
    print(f"wrote {len(paths)} file(s): {', '.join(str(p) for p in paths)}")
    if args.preprocess:
        from .data.criteo import preprocess

        pre = preprocess(paths, Path(args.out_dir) / "preprocessed")
        print(f"preprocessed into {pre.out_dir}: {pre.total_samples} rows, cardinalities {list(pre.cardinalities)}")
    return 0


def _compose_or_exit(overrides: Sequence[str], config_dir: Optional[str]) -> object:
    from hydra.errors import HydraException

    from .app.compose import compose_config

    try:
        return compose_config(overrides, config_dir)
    except (HydraException, ValueError, FileNotFoundError) as e:
        print(f"torchrec-proactive: config error: {e}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None


def _run(mode: str, args: argparse.Namespace, overrides: List[str]) -> List[object]:
    from .app.compose import to_yaml
    from .app.entry import launch
    from .launch import RankFailure

    cfg = _compose_or_exit(overrides, args.config_dir)  # fail fast, before any rank starts
    if args.cfg:
        print(to_yaml(cfg))  # type: ignore[arg-type]
        raise SystemExit(0)
    try:
        return launch(mode, overrides, nproc=args.nproc, config_dir=args.config_dir)
    except RankFailure as e:
        print(f"torchrec-proactive {mode}: {e}", file=sys.stderr)
        raise SystemExit(1) from None


def cmd_train(args: argparse.Namespace) -> int:
    results = _run("train", args, list(args.overrides))
    first = results[0]
    if isinstance(first, dict) and os.environ.get("RANK", "0") == "0":
        print(json.dumps({k: first.get(k) for k in ("steps", "depth", "train_loss", "evals", "last_checkpoint")},
                         default=str))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from .app.compare import format_table

    overrides = list(args.overrides)
    if not any(o.lstrip("+~").startswith("experiment=") for o in overrides):
        overrides.insert(0, "experiment=compare_cpu")
    result = _run("compare", args, overrides)[0]
    if isinstance(result, dict) and "rows" in result and os.environ.get("RANK", "0") == "0":
        print(format_table(result))
    return 0


def cmd_bench(argv: Sequence[str]) -> int:
    try:
        runner = importlib.import_module("torchrec_proactive.bench.runner")
    except ModuleNotFoundError as e:
        if e.name not in ("torchrec_proactive.bench.runner", "torchrec_proactive.bench"):
            raise
        print("torchrec-proactive bench: the benchmark runner (torchrec_proactive.bench.runner) is not "
              "available in this installation", file=sys.stderr)
        return EXIT_USAGE
    import inspect

    if inspect.signature(runner.main).parameters:
        return int(runner.main(list(argv)) or 0)
    sys.argv = ["torchrec-proactive bench", *argv]
    return int(runner.main() or 0)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return cmd_bench(argv[1:])
    parser = build_parser()
    # Options may come after overrides (`train experiment=x --nproc 2 prefetch=auto`):
    # argparse stops filling the positional list at the first option, so collect the rest.
    args, rest = parser.parse_known_args(argv)
    if rest:
        if not hasattr(args, "overrides") or any(r.startswith("-") for r in rest):
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        args.overrides = list(args.overrides) + rest
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
