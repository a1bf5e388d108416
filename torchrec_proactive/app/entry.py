"""Launching ranks: under torchrun/torchx (``WORLD_SIZE`` set) or as N local processes.

torch is imported only once ranks are launched, so the CLI reports config mistakes fast.

``rank_main`` is what every rank runs: compose the config, run the mode, return a small
picklable result. It composes on each rank (cheap) so that a rank started with different
overrides is caught by the config check instead of silently diverging.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import asdict
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence

from .compose import compose_config
from .config_words import capacity_error, host_cache_error, in_config_words
from ..quiet import quiet_third_party
from .errors import ConfigError, UserError

MODES = ("train", "compare", "profile-cache")

def _agree_output_dir(cfg: Any, overrides: Sequence[str]) -> Any:
    """Rank 0's ``train.output_dir`` on every rank, unless the command line set it.

    The default names the time the config was composed (``outputs/<date>/<time>``), and
    each rank composes its own: ranks started a second apart would otherwise disagree."""
    import torch.distributed as dist

    if any(o.lstrip("+").startswith("train.output_dir=") for o in overrides) or dist.get_world_size() == 1:
        return cfg
    box = [cfg.train.output_dir]
    dist.broadcast_object_list(box, src=0)
    cfg.train.output_dir = box[0]
    return cfg


def pin_output_dir(overrides: Sequence[str], cfg: Any) -> List[str]:
    """``overrides`` plus ``train.output_dir=<the composed value>`` unless already set, so
    that local ranks started later use the run directory the launcher composed."""
    if any(o.lstrip("+").startswith("train.output_dir=") for o in overrides):
        return list(overrides)
    return [*overrides, f"train.output_dir={cfg.train.output_dir}"]


def rank_main(rank: int, world_size: int, mode: str, overrides: Sequence[str],
              config_dir: Optional[str] = None, rank_overrides: Optional[Dict[int, List[str]]] = None,
              record: bool = False) -> Any:
    """Runs ``mode`` on this rank (process group already initialised).

    ``rank_overrides`` adds overrides on some ranks only - for tests of the config check.
    ``record``: rank 0 keeps the launch's record in the run directory (under torchrun,
    where no Hydra app made one).
    A cache too small for the prefetch depth is raised as a
    :class:`~torchrec_proactive.app.errors.ConfigError` naming ``cache.load_factor`` and
    ``prefetch.*``.
    """
    quiet_third_party()
    from ..store import CacheCapacityError
    from ..store.disk_host_tier import HostCacheCapacityError
    from ..store.row_file import DiskTierError

    extra = (rank_overrides or {}).get(rank, [])
    cfg = _agree_output_dir(compose_config(list(overrides) + list(extra), config_dir), overrides)
    if record and rank == 0:
        _record_launch(cfg, overrides)
    with warnings.catch_warnings():  # restores showwarning (and the filters) afterwards
        warnings.showwarning = _InConfigWords(cfg, rank, warnings.showwarning)
        try:
            if mode == "train":
                from .train import run_training

                return asdict(run_training(cfg))
            if mode == "compare":
                from .compare import run_compare

                return run_compare(cfg)
            if mode == "profile-cache":
                from .cache_plan import run_profile

                return run_profile(cfg)
        except HostCacheCapacityError as e:
            raise host_cache_error(cfg, e) from e
        except CacheCapacityError as e:
            raise capacity_error(cfg, e) from e
        except DiskTierError as e:  # one line naming the table and its file (tier=ssd)
            raise UserError(str(e)) from e
    raise ValueError(f"mode={mode!r} is invalid: must be one of {MODES}")


def _record_launch(cfg: Any, overrides: Sequence[str]) -> None:
    """Under torchrun (no Hydra record): rank 0 keeps this launch's overrides and config in
    ``<train.output_dir>/launches/<n>/``, as the Hydra app does with Hydra's record - unless
    the run will be refused for a previous run in its directory."""
    from .compose import to_yaml
    from .rundir import previous_run, record_launch

    if not cfg.train.resume and previous_run(cfg) is not None:
        return
    import yaml

    listed = yaml.safe_dump([str(o) for o in overrides], default_flow_style=False)
    record_launch(cfg.train.output_dir, {"overrides.yaml": listed, "config.yaml": to_yaml(cfg)})


class _InConfigWords:
    """``warnings.showwarning`` for a run: this package's own warnings (e.g. a cache too
    small for one batch) go to the rank's log as one line in config words; any other
    warning is shown as usual."""

    def __init__(self, cfg: Any, rank: int, show: Any) -> None:
        self.cfg, self.rank, self.show = cfg, rank, show

    def __call__(self, message: Any, category: Any, filename: str, lineno: int, file: Any = None,
                 line: Optional[str] = None) -> None:
        log = logging.getLogger(f"torchrec_proactive.rank{self.rank}")  # set up by env.setup_logging
        ours = f"{os.sep}torchrec_proactive{os.sep}" in filename
        if not ours or not log.handlers:
            self.show(message, category, filename, lineno, file, line)
            return
        log.warning("warning: %s", in_config_words(str(message), self.cfg))


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def launch(mode: str, overrides: Sequence[str], nproc: int = 1, config_dir: Optional[str] = None,
           timeout_s: float = 24 * 3600.0) -> List[Any]:
    """Runs ``mode`` on every rank and returns the ranks' results (this rank's only, under torchrun).

    Under torchrun (``WORLD_SIZE`` and ``RANK`` set) this process is one rank: it joins the
    ``env://`` process group. Otherwise ``nproc`` local ranks are spawned with gloo (CPU) or
    NCCL (CUDA) and the call returns when all are done, failing fast with the first failing
    rank's traceback.
    """
    if under_torchrun():
        import torch
        import torch.distributed as dist

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=timedelta(minutes=30))
        try:
            return [rank_main(dist.get_rank(), dist.get_world_size(), mode, overrides, config_dir, record=True)]
        finally:
            dist.destroy_process_group()
    if nproc < 1:
        raise UserError(f"--nproc={nproc} is invalid: must be >= 1")
    from ..launch import run_ranks

    return run_ranks(rank_main, world_size=nproc, timeout_s=timeout_s, pg_timeout_s=1800.0,
                     mode=mode, overrides=list(overrides), config_dir=config_dir)


def refuse_mode(mode: str, cfg: Any) -> None:
    """Raises :class:`ConfigError` (one line) for a mode this config's model cannot run:
    ``profile-cache`` profiles pooled (``EmbeddingBagCollection``) tables only, so not the
    history table of ``model.arch='sequence'`` (whose ``cache.budget_bytes`` the schema refuses)."""
    if mode == "profile-cache" and cfg.model.arch == "sequence":
        raise ConfigError("model.arch='sequence' is invalid for profile-cache: cache profiles cover "
                          "EmbeddingBagCollection tables only, not its history table; profile a DLRM model "
                          "(model=debug, dlrm_kaggle, dcnv2_terabyte) or size the caches with cache.load_factor")


def run_command(mode: str, overrides: Sequence[str], nproc: int = 1, config_dir: Optional[str] = None,
                cfg: Any = None) -> List[Any]:
    """What the entry points (``torchrec-proactive train``/``compare``, the example script)
    run: compose (``cfg``, if already composed), refuse a reused run directory, pin the run
    directory for the local ranks, hide the known third-party warnings, launch.

    Raises :class:`~torchrec_proactive.app.errors.UserError` for every mistake the user can
    fix - in this process or on any rank - and :class:`~torchrec_proactive.launch.RankFailure`
    for anything else a rank raised.
    """
    from .preflight import check_inputs
    from .rundir import check_run_dir

    cfg = compose_config(overrides, config_dir) if cfg is None else cfg  # fail fast, before any rank
    refuse_mode(mode, cfg)
    quiet_third_party()
    if not under_torchrun():  # under torchrun each rank checks (collectively) in build_run
        check_run_dir(cfg)
        overrides = pin_output_dir(overrides, cfg)
    world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun() else nproc
    check_inputs(cfg, world_size)  # data files and the checkpoint to resume: one line now, not from every rank later
    from ..launch import RankFailure

    try:
        return launch(mode, overrides, nproc=nproc, config_dir=config_dir)
    except RankFailure as e:
        if e.user_message is not None:
            raise UserError(e.user_message) from None
        raise


def train_for_script(prog: str, overrides: Sequence[str], nproc: int = 1, config_dir: Optional[str] = None) -> int:
    """The example scripts' ``main``: trains (:func:`run_command`), then prints the run's
    :class:`~torchrec_proactive.app.result.TrainResult` JSON as the last stdout line (the same
    line as ``torchrec-proactive train``; under torchrun on rank 0 only), or a user's mistake as
    one ``prog: error: ...`` line on stderr (no traceback). Returns the exit code."""
    import sys

    from .errors import EXIT_USAGE
    from .result import TrainResult

    try:
        results = run_command("train", overrides, nproc=nproc, config_dir=config_dir)
    except UserError as e:  # one line, no traceback: the message names key, value and limit
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank gets here
        print(TrainResult.from_summary(results[0]).to_json())
    return 0
