"""Checkpoints every rank can write and read on its own, safe against interrupted writes.

Layout under ``checkpoint_dir``::

    step_00000040/rank_00000.pt   rank 0's model + optimizer state_dicts, position, RNG
    step_00000040/rank_00001.pt
    step_00000040/MANIFEST.json   written last, by rank 0, once every rank's file is in place
    LATEST                        name of the newest complete step directory

A write goes 1. to ``.<name>.<pid>.partial``, 2. ``fsync``, 3. ``os.replace`` onto its
name, 4. ``fsync`` of the directory. The manifest is written only after a barrier that
follows every rank's step 4, and a re-written step directory loses its manifest first, so
"has a manifest" means "complete". An interrupted save leaves the previous checkpoint -
and ``LATEST`` - as they were.

The model and optimizer are saved with their own ``state_dict()`` (TorchRec's
``ShardedTensor`` for sharded tables), so any TorchRec tooling can read a rank's file.
Restoring needs the same world size and plan.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from .compose import diff
from .errors import ConfigError
from .rundir import LATEST, MANIFEST, complete_checkpoints, latest_checkpoint

FORMAT = 1
# Keys whose change makes a checkpoint meaningless to continue from. Prefetch depth, link,
# logging, length of training and paths may change on resume (depth never changes numerics).
_MUST_MATCH = ("model.", "data.", "sharding.", "cache.", "optimizer.", "train.batch_size", "train.seed")
_MAY_DIFFER = ("data.root", "data.preprocessed_dir", "cache.fit_depth")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Any) -> None:
    """``write(fileobj)`` into a temporary file, fsync, then rename onto ``path``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    with open(tmp, "wb") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def rng_state() -> Dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


class Checkpointer:
    def __init__(self, directory: Path, rank: int, world_size: int, keep: int, log: logging.Logger) -> None:
        self.directory = Path(directory)
        self.rank = rank
        self.world_size = world_size
        self.keep = keep
        self.log = log

    # ------------------------------------------------------------------ save
    def save(self, step: int, payload: Dict[str, Any], manifest_extra: Dict[str, Any]) -> Path:
        """Collective. Every rank writes its file; rank 0 completes the checkpoint."""
        target = self.directory / step_dir_name(step)
        if self.rank == 0:
            target.mkdir(parents=True, exist_ok=True)
            (target / MANIFEST).unlink(missing_ok=True)  # re-writing: incomplete until the end
        dist.barrier()
        name = f"rank_{self.rank:05d}.pt"
        atomic_write(target / name, lambda fh: torch.save(payload, fh))
        sizes: List[Any] = [None] * self.world_size
        dist.all_gather_object(sizes, (name, (target / name).stat().st_size))
        if self.rank == 0:
            manifest = {
                "format": FORMAT, "step": step, "world_size": self.world_size, "created": time.time(),
                "files": {str(r): {"name": n, "bytes": b} for r, (n, b) in enumerate(sizes)},
                **manifest_extra,
            }
            atomic_write(target / MANIFEST, lambda fh: fh.write(json.dumps(manifest, indent=1).encode()))
            atomic_write(self.directory / LATEST, lambda fh: fh.write(target.name.encode()))
            self._prune(keep_name=target.name)
        dist.barrier()
        self.log.info("checkpoint %s written (%d ranks)", target, self.world_size)
        return target

    def _prune(self, keep_name: str) -> None:
        complete = self.complete()
        for old in complete[: max(len(complete) - self.keep, 0)]:
            if old.name != keep_name:
                shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------------ find / load
    def complete(self) -> List[Path]:
        """Complete checkpoints, oldest first."""
        return complete_checkpoints(self.directory)

    def latest(self) -> Optional[Path]:
        """The newest complete checkpoint (``LATEST`` if it is complete), or ``None``."""
        return latest_checkpoint(self.directory)

    def load(self, path: Path, config_flat: Dict[str, Any], map_location: Any) -> Dict[str, Any]:
        manifest = json.loads((path / MANIFEST).read_text())
        if manifest.get("format") != FORMAT:
            raise ValueError(f"{path}: checkpoint format {manifest.get('format')} is not {FORMAT}")
        if manifest["world_size"] != self.world_size:
            raise ConfigError(
                f"{path} was written by {manifest['world_size']} ranks; this run has {self.world_size} "
                f"(restoring sharded state needs the same world size: --nproc {manifest['world_size']})"
            )
        check_compatible(manifest.get("config", {}), config_flat, path)
        entry = manifest["files"][str(self.rank)]
        file = path / entry["name"]
        if not file.is_file() or file.stat().st_size != entry["bytes"]:
            raise ValueError(f"{file} is missing or does not have the {entry['bytes']} bytes the manifest lists")
        return torch.load(file, map_location=map_location, weights_only=False)


def check_compatible(saved: Dict[str, Any], current: Dict[str, Any], where: Any) -> None:
    keys: Sequence[str] = [
        k for k in sorted(set(saved) | set(current))
        if k.startswith(_MUST_MATCH) and k not in _MAY_DIFFER
    ]
    changed = diff(saved, current, keys)
    if changed:
        detail = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in changed.items())
        raise ConfigError(f"cannot resume from {where}: the config changed ({detail})")
