"""Launching ranks: under torchrun/torchx (``WORLD_SIZE`` set) or as N local processes.

``rank_main`` is what every rank runs: compose the config, run the mode, return a small
picklable result. It composes on each rank (cheap) so that a rank started with different
overrides is caught by the config check instead of silently diverging.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import asdict
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from .compose import compose_config

MODES = ("train", "compare")


def _quiet() -> None:
    # Deprecation chatter from TorchRec/torch internals on every rank; not actionable here.
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    warnings.filterwarnings("ignore", message="Local function is not supported by pickle")


def rank_main(rank: int, world_size: int, mode: str, overrides: Sequence[str],
              config_dir: Optional[str] = None, rank_overrides: Optional[Dict[int, List[str]]] = None) -> Any:
    """Runs ``mode`` on this rank (process group already initialised).

    ``rank_overrides`` adds overrides on some ranks only - for tests of the config check.
    """
    _quiet()
    extra = (rank_overrides or {}).get(rank, [])
    cfg = compose_config(list(overrides) + list(extra), config_dir)
    if mode == "train":
        from .train import run_training

        return asdict(run_training(cfg))
    if mode == "compare":
        from .compare import run_compare

        return run_compare(cfg)
    raise ValueError(f"mode={mode!r} is invalid: must be one of {MODES}")


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
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=timedelta(minutes=30))
        try:
            return [rank_main(dist.get_rank(), dist.get_world_size(), mode, overrides, config_dir)]
        finally:
            dist.destroy_process_group()
    if nproc < 1:
        raise ValueError(f"--nproc={nproc} is invalid: must be >= 1")
    from ..launch import run_ranks

    return run_ranks(rank_main, world_size=nproc, timeout_s=timeout_s, pg_timeout_s=1800.0,
                     mode=mode, overrides=list(overrides), config_dir=config_dir)
