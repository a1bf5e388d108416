"""Per-rank runtime: device, seeds, output directory, logging, and the config check."""

from __future__ import annotations

import glob
import logging
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from ..config.schema import Config
from .compose import config_hash, diff, flatten
from .errors import ConfigError
from .rundir import JOB_LOG_ENV


class ConfigMismatchError(RuntimeError):
    """Ranks were started with different configs."""


@dataclass(frozen=True)
class RankEnv:
    """Where this rank runs. Built after the process group exists."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    output_dir: Path  # this rank's own directory: <train.output_dir>/rank_<r>

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _gpus_given(environ: Mapping[str, str]) -> Optional[str]:
    """What says this job was given GPUs (``CUDA_VISIBLE_DEVICES`` naming devices - Slurm's
    ``--gres=gpu`` sets it - else an NVIDIA device file), or None."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        shown = visible.strip()
        return f"CUDA_VISIBLE_DEVICES={shown}" if shown and shown not in ("-1", "NoDevFiles") else None
    devices = sorted(glob.glob("/dev/nvidia[0-9]*"))
    return devices[0] if devices else None


def cpu_build_note(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """One line when this job was given GPUs but its torch is a CPU build (it would train on
    CPU), naming the fix; None otherwise."""
    given = _gpus_given(os.environ if environ is None else environ)
    if given is None or torch.version.cuda is not None:
        return None
    return (f"this job was given GPUs ({given}) but its torch is a CPU build (torch {torch.__version__} in "
            f"{sys.prefix}), so it trains on CPU: scripts/bootstrap.sh installs the CUDA stack only where "
            f"nvidia-smi works, so a .venv made on a GPU-less login node is the CPU build - rebuild it on a GPU "
            f"node (rm -rf .venv; srun --gres=gpu:1 bash scripts/bootstrap.sh), or set train.device=cpu to train "
            f"on CPU on purpose")


def pick_device(choice: str, local_rank: int) -> torch.device:
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            raise ConfigError(f"train.device='cuda' is invalid: this torch is a CPU build (torch {torch.__version__} "
                              f"in {sys.prefix}); scripts/bootstrap.sh installs the CUDA stack only where nvidia-smi "
                              f"works: rebuild the .venv on a GPU node (rm -rf .venv; bash scripts/bootstrap.sh there)")
        raise ConfigError("train.device='cuda' is invalid: no CUDA device is available (torch "
                          f"{torch.__version__}, CUDA {torch.version.cuda}; nvidia-smi shows what the node has)")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def make_env(cfg: Config) -> RankEnv:
    """The env of this rank in the current (default) process group."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    out = Path(cfg.train.output_dir) / f"rank_{rank}"
    out.mkdir(parents=True, exist_ok=True)
    return RankEnv(rank, world, local_rank, local_world, pick_device(cfg.train.device, local_rank), out)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class _TqdmHandler(logging.Handler):
    """Writes above rank 0's progress bars instead of through them."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # a log line must never take training down
            self.handleError(record)


class _IntoRunLog(logging.Handler):
    """The library's own WARNING lines (the sharder's summary of the tables it tiered, with
    their cache sizes) into the run's log, beside its other lines."""

    def __init__(self, target: logging.Logger) -> None:
        super().__init__(logging.WARNING)
        self.target = target

    def emit(self, record: logging.LogRecord) -> None:
        self.target.handle(record)


def setup_logging(env: RankEnv, name: str = "torchrec_proactive") -> logging.Logger:
    """Rank 0 logs to stderr and its file; other ranks only to their own file. The library's
    WARNING lines (``torchrec_proactive.integration``) go there too."""
    logger = logging.getLogger(f"{name}.rank{env.rank}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for h in list(logger.handlers):
        logger.removeHandler(h)
        h.close()
    fmt = logging.Formatter(f"%(asctime)s [rank {env.rank}] %(message)s", "%H:%M:%S")
    fh = logging.FileHandler(env.output_dir / "train.log")
    fh.setFormatter(fmt)
    logger.addHandler(fh)
    if env.is_main:
        sh = _TqdmHandler()
        sh.setFormatter(fmt)
        logger.addHandler(sh)
        job_log = os.environ.get(JOB_LOG_ENV)
        if job_log:  # Hydra's record of the job holds the run's own log
            jh = logging.FileHandler(job_log)
            jh.setFormatter(fmt)
            logger.addHandler(jh)
    library = logging.getLogger(f"{name}.integration")
    for h in [h for h in library.handlers if isinstance(h, _IntoRunLog)]:
        library.removeHandler(h)
    library.addHandler(_IntoRunLog(logger))
    library.propagate = False  # (said once, in the run's words: not again by a root handler)
    return logger


def check_same_config(cfg: Config, env: RankEnv) -> str:
    """All-gathers each rank's config hash; fails on every rank, naming the first rank
    whose config differs from rank 0's and the keys that differ. Returns the hash."""
    mine = config_hash(cfg)
    hashes: List[Any] = [None] * env.world_size
    dist.all_gather_object(hashes, mine)
    if all(h == hashes[0] for h in hashes):
        return mine
    # Rare path: gather the flattened configs to say what differs.
    flats: List[Any] = [None] * env.world_size
    dist.all_gather_object(flats, flatten(cfg))
    bad = next(r for r, h in enumerate(hashes) if h != hashes[0])
    changes: Dict[str, Any] = diff(flats[0], flats[bad])
    detail = ", ".join(f"{k}: rank 0 has {a!r}, rank {bad} has {b!r}" for k, (a, b) in changes.items())
    raise ConfigMismatchError(
        f"rank {bad} was started with a different config than rank 0 (hash {hashes[bad]} vs "
        f"{hashes[0]}): {detail}. Every rank must get identical overrides."
    )
