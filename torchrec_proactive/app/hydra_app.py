"""``train`` and ``compare`` as a Hydra application (``hydra.main`` over the packaged configs).

Everything a Hydra user reaches for is Hydra's own: its argument parser (``-m/--multirun``,
``--cfg job|hydra|all``, ``--resolve``, ``--info``, ``-cd/--config-dir``, ``--hydra-help``),
its run and sweep directories (``hydra.run.dir``, ``hydra.sweep.dir``, ``hydra.job.chdir``),
its search path (``--config-dir`` and ``hydra.searchpath`` *add* to the packaged configs)
and its launcher: a sweep runs one job after another, and each job launches its own ranks
into its own run directory under the sweep directory.

Two things are ours, so that mistakes stay one line with exit code 2: every job's config
is composed and validated against the schema before Hydra starts anything (a typo in the
third job of a sweep fails before the first one trains), and a job's user error ends the
process with that line instead of Hydra's report.

Under torchrun/torchx (``WORLD_SIZE`` set) every process is one rank: runs use the compose
API there (one run directory for all ranks, agreed by rank 0), and ``-m`` is refused.
"""

from __future__ import annotations

import logging
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Tuple

from .compose import (
    CONFIG_NAME,
    canonical_overrides,
    compose_config,
    packaged_config_dir,
    uses_default_output_dir,
    validate,
)
from .errors import EXIT_USAGE, UserError
from .rundir import JOB_LOG_ENV, LAUNCHES, hydra_record, record_launch

# Keys that name paths: under hydra.job.chdir=true the job runs inside its run directory,
# so relative paths given on the command line are made absolute against the directory the
# user started from (what hydra.utils.to_absolute_path does) before the ranks see them.
PATH_KEYS = ("data.root", "data.preprocessed_dir", "train.output_dir", "train.checkpoint_dir", "cache.profile_path")

Report = Callable[[List[Any]], None]


def hydra_parser(prog: str) -> Any:
    """Hydra's own command-line parser, named after the subcommand in its usage line."""
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()
    parser.prog = prog
    return parser


def parse_hydra_argv(prog: str, argv: Sequence[str]) -> Tuple[Any, List[str]]:
    """Hydra's parse of ``argv`` with options and overrides in any order (this CLI always
    allowed ``train experiment=x --cfg job``), and ``argv`` in the order Hydra's own parse in
    ``hydra.main`` accepts: options first, then the overrides."""
    args = hydra_parser(prog).parse_intermixed_args(list(argv))
    overrides = Counter(args.overrides)
    options = []
    for token in argv:
        if overrides[token] > 0:
            overrides[token] -= 1
        elif token in ("--info", "-i"):
            # Its value is optional: spelt out, so that the overrides placed after the options
            # are not taken for it (`train experiment=x --info` -> `--info=all experiment=x`).
            options.append(f"--info={args.info}")
        elif options and options[-1].startswith("--info=") and token == args.info:
            continue  # (the value of an `--info VALUE` just spelt out)
        else:
            options.append(token)
    return args, [*options, *args.overrides]


def job_overrides(overrides: Sequence[str], multirun: bool) -> List[List[str]]:
    """The overrides of every job Hydra's basic sweeper would launch (one list without
    ``-m``). A sweep the basic sweeper cannot expand (another sweeper's ranges) is left for
    that sweeper: those jobs are validated when they start."""
    if not multirun:
        return [list(overrides)]
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from .compose import _explain
    from .errors import ConfigError

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as e:
        raise ConfigError(_explain(e)) from e
    try:
        return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
    except HydraException:
        return []


def _quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _pinned(node: Any, overrides: Sequence[str], output_dir: str, original_cwd: str) -> List[str]:
    """Overrides that give the ranks this job's run directory, and absolute paths when
    Hydra changed the working directory (``hydra.job.chdir=true``)."""
    from omegaconf import OmegaConf

    pins = {}
    if uses_default_output_dir(node, overrides):
        pins["train.output_dir"] = output_dir
    if os.path.realpath(os.getcwd()) != os.path.realpath(original_cwd):
        for key in PATH_KEYS:
            value = pins.get(key, OmegaConf.select(node, key))
            if isinstance(value, str) and value and not os.path.isabs(value):
                pins[key] = os.path.join(original_cwd, value)
    for key, value in pins.items():
        OmegaConf.update(node, key, value, merge=False)
    return [f"{k}={_quote(v)}" for k, v in pins.items()]


def _task(mode: str, nproc: int, config_dir: Optional[str], report: Report) -> Callable[[Any], None]:
    def task(node: Any) -> None:
        from hydra.core.hydra_config import HydraConfig

        from ..launch import RankFailure
        from .entry import run_command

        hc = HydraConfig.get()
        overrides = list(hc.overrides.task)
        # The ranks' main log goes to Hydra's job log too (<run dir>/<mode>.log): the ranks
        # are other processes, which Hydra's logging set-up does not reach.
        job_logs = [h.baseFilename for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
        if job_logs:
            os.environ[JOB_LOG_ENV] = job_logs[0]
        # the search path the ranks compose with is the one this job was composed with
        overrides += [o for o in hc.overrides.hydra if o.lstrip("+~").startswith("hydra.searchpath=")]
        if hc.output_subdir is not None:  # Hydra's record, kept: the next launch here overwrites .hydra/
            record = hydra_record(os.path.join(hc.runtime.output_dir, hc.output_subdir))
            if record:
                record_launch(hc.runtime.output_dir, record)
        try:
            overrides += _pinned(node, overrides, hc.runtime.output_dir, hc.runtime.cwd)
            cfg = validate(node)
            results = run_command(mode, overrides, nproc=nproc, config_dir=config_dir, cfg=cfg)
        except UserError as e:  # one line, exit code 2, for every job of a sweep too
            print(f"torchrec-proactive {mode}: error: {e}", file=sys.stderr)
            raise SystemExit(EXIT_USAGE) from None
        except RankFailure as e:  # a bug or a crash: keep the traceback
            print(f"torchrec-proactive {mode}: {e}", file=sys.stderr)
            raise SystemExit(1) from None
        finally:
            os.environ.pop(JOB_LOG_ENV, None)  # the next job of a sweep has its own
        report(results)

    task.__module__ = __name__
    task.__qualname__ = task.__name__ = mode
    return task


def _record_in_run_dir(argv: List[str], overrides: Sequence[str], cfg: Any, nproc: int) -> List[str]:
    """``argv`` with Hydra's run directory set to the run's (``train.output_dir``), after the
    checks that may refuse the run: Hydra writes its record (``.hydra/``, ``<mode>.log``)
    into its run directory before the job starts, so a refusal must come first and the
    record must land where the run does, not in a stray ``outputs/<date>/<time>``."""
    from .preflight import check_inputs
    from .rundir import check_run_dir

    check_run_dir(cfg)  # a fresh run into a previous run's directory
    check_inputs(cfg, nproc)  # data files, and the checkpoint a resume continues from (on nproc ranks)
    if any(o.lstrip("+~").startswith("hydra.run.dir=") for o in overrides):
        return argv  # the user chose it; train.output_dir follows it unless set too
    return [*argv, f"hydra.run.dir={_quote(str(cfg.train.output_dir))}"]


def keep_earlier_record(run_dir: Path) -> None:
    """A run directory from before launch records: its Hydra record (which this launch is
    about to overwrite) becomes its first launch record. Called once nothing can refuse."""
    earlier = hydra_record(Path(run_dir) / ".hydra")
    if earlier and not (Path(run_dir) / LAUNCHES).exists():
        record_launch(run_dir, earlier)


def one_cache_for_the_sweep(mode: str, cfgs: Sequence[Any]) -> List[str]:
    """The override that sizes every job's caches for the sweep's largest depth, when the
    jobs run different prefetch depths and their caches depend on the depth
    (``cache.fit_depth`` or ``cache.budget_bytes``) and none sets ``cache.sized_for_depth``:
    a depth comparison that changes the caches is not one. Says so on stderr."""
    depths = sorted({c.prefetch.capacity_depth for c in cfgs})
    if len(depths) < 2 or any(c.cache.sized_for_depth is not None for c in cfgs):
        return []
    if not any(c.cache.fit_depth or c.cache.budget_bytes for c in cfgs):
        return []  # (each job's caches are cache.load_factor's, whatever its depth)
    deepest = depths[-1]
    print(f"torchrec-proactive {mode}: the sweep's jobs run prefetch depths {', '.join(map(str, depths))}: every "
          f"job's caches are sized for depth {deepest} (cache.sized_for_depth={deepest}), so that only the depth "
          f"differs between them; set cache.sized_for_depth to size them for another depth", file=sys.stderr)
    return [f"cache.sized_for_depth={deepest}"]


def run_app(mode: str, hydra_argv: Sequence[str], nproc: int, report: Report) -> int:
    """Runs ``mode`` as a Hydra application on ``hydra_argv`` (Hydra's flags and overrides).

    Raises :class:`~torchrec_proactive.app.errors.UserError` for a config mistake in any
    job, before anything runs."""
    from .entry import refuse_mode, run_command, under_torchrun

    from ..config.schema import register

    register()  # the schema node the defaults list names, for Hydra's own composition too
    prog = f"torchrec-proactive {mode}"
    argv = canonical_overrides(hydra_argv)
    if not any(a in ("-cd", "--config-dir") or a.startswith("--config-dir=") for a in argv) \
            and os.environ.get("TORCHREC_PROACTIVE_CONFIG_DIR"):
        argv = ["--config-dir", os.environ["TORCHREC_PROACTIVE_CONFIG_DIR"], *argv]
    args, argv = parse_hydra_argv(prog, argv)  # argparse: a usage error exits with 2
    if args.config_dir is not None:  # the ranks may start in another directory (hydra.job.chdir)
        args.config_dir = os.path.abspath(args.config_dir)
    if args.config_name is not None or args.config_path is not None:
        raise UserError("--config-name/--config-path are not supported: the packaged configs are the primary "
                        "config; add yours with --config-dir or hydra.searchpath")
    modes = [flag for flag, on in (("--run", args.run), ("--multirun", args.multirun), ("--cfg", args.cfg),
                                   ("--info", args.info), ("--shell-completion", args.shell_completion)) if on]
    if len(modes) > 1:  # (Hydra's own check raises a ValueError with a traceback)
        raise UserError(f"{' and '.join(modes)} cannot be given together: use one of --run, --multirun, --cfg, "
                        f"--info per call")
    inspecting = args.info is not None or args.help or args.hydra_help or args.shell_completion
    if args.multirun and under_torchrun():
        raise UserError("-m/--multirun launches its own ranks for each job; under torchrun/torchx every process "
                        "is one rank: run the sweep outside torchrun")
    if not inspecting:
        jobs = job_overrides(args.overrides, args.multirun)
        fixed_dirs = []
        cfgs = []
        for job in jobs:
            cfg = compose_config(job, args.config_dir)  # ConfigError: one line, exit code 2
            if not args.cfg:  # (before Hydra writes its record into the run directory)
                refuse_mode(mode, cfg)
            cfgs.append(cfg)
            if any(o.lstrip("+").startswith("train.output_dir=") for o in job):
                fixed_dirs.append(cfg.train.output_dir)
        if len(jobs) > 1 and len(set(fixed_dirs)) < len(fixed_dirs):
            raise UserError(
                f"train.output_dir={fixed_dirs[0]} is the same for {len(fixed_dirs)} jobs of the sweep, and a run "
                f"directory holds one run: leave train.output_dir unset (each job runs in hydra.sweep.dir/<job "
                f"number>) or sweep it too"
            )
        sweep_cache = [] if args.cfg else one_cache_for_the_sweep(mode, cfgs)
        if sweep_cache:
            argv += sweep_cache
            cfgs = [compose_config([*job, *sweep_cache], args.config_dir) for job in jobs]
        if not args.multirun and not args.cfg and not under_torchrun():
            argv = _record_in_run_dir(argv, args.overrides, cfg, nproc)
        if not args.cfg and not under_torchrun() and any(c.cache.budget_bytes > 0 for c in cfgs):
            from .cache_plan import refuse_budget_before_launch

            for c in cfgs:  # a budget below the minimum: one line before any rank starts or anything is written
                refuse_budget_before_launch(c, nproc)
        if not args.multirun and not args.cfg and not under_torchrun() and cfg.train.resume:
            keep_earlier_record(cfg.train.output_dir)
    if under_torchrun() and not (inspecting or args.cfg):
        report(run_command(mode, args.overrides, nproc=nproc, config_dir=args.config_dir))
        return 0

    import hydra

    if not any(o.startswith("hydra.job.name=") for o in args.overrides):
        argv = [*argv, f"hydra.job.name={mode}"]  # the job's log file is <run dir>/<mode>.log
    app = hydra.main(config_path=str(packaged_config_dir()), config_name=CONFIG_NAME,
                     version_base="1.3")(_task(mode, nproc, args.config_dir, report))
    saved = sys.argv
    sys.argv = [prog, *argv]
    try:
        app()
    finally:
        sys.argv = saved
    return 0

