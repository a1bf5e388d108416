"""The trainer's non-tensor state in a checkpoint's manifest, checked before any of it is used.

The manifest's values (position, RNG states, the fused step counter, carried results, param
groups) are applied by :meth:`~torchrec_proactive.app.loop.Trainer.resume`. A value of the
wrong type or with other keys would fail there with a ``TypeError`` deep in numpy or torch,
or silently change the run; here it is one :class:`CheckpointError` naming the manifest and
the value. Every saved rank's values are checked on every rank (a rank of another world
size may take any of them), so all ranks refuse alike.
"""

from __future__ import annotations

import random
from typing import Any, Dict, Sequence

import numpy as np
import torch

from .checkpoint import decode
from .errors import CheckpointError
from .rundir import MANIFEST

# Summary fields a checkpoint carries, with the types they may have.
SUMMARY_TYPES: Dict[str, Any] = {"train_loss": (float, int, type(None)), "steady": dict, "evals": list,
                                 "depth_choice": (dict, type(None)), "depth": int}


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_saved_state(manifest: Dict[str, Any], where: Any, position_fields: Sequence[str]) -> None:
    """Raises :class:`CheckpointError` unless the manifest's position has exactly
    ``position_fields`` (counts) and every saved rank's values are ones the trainer wrote."""
    path = f"{where}/{MANIFEST}"
    state = decode(manifest["state"], where, "saved state")
    position = state.get("position")
    if not isinstance(position, dict) or sorted(position) != sorted(position_fields) or \
            not all(_is_count(v) for v in position.values()):
        raise CheckpointError(f"{path}: the saved position is {position!r}, not the counts "
                              f"{', '.join(position_fields)}; refusing to load it")
    for index, rank in enumerate(decode(manifest["ranks"], where, "per-rank state")):
        try:
            _check_rank(rank)
        except (TypeError, ValueError, KeyError, AttributeError, RuntimeError, IndexError) as e:
            text = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
            raise CheckpointError(f"{path}: saved rank {index}'s state is not one this program writes ({text}); "
                                  f"refusing to load it") from None


def _check_rank(rank: Dict[str, Any]) -> None:
    rng = rank["rng"]
    if not isinstance(rng, dict) or sorted(rng) != ["numpy", "python", "torch"]:
        raise ValueError(f"rng holds {sorted(rng) if isinstance(rng, dict) else type(rng).__name__}")
    # Each state is tried on a private generator: the process's own are set only once all pass.
    if not isinstance(rng["torch"], torch.Tensor) or rng["torch"].dtype != torch.uint8:
        raise TypeError("rng.torch is not a byte tensor")
    torch.Generator().set_state(rng["torch"])
    np.random.RandomState().set_state(rng["numpy"])
    random.Random().setstate(rng["python"])
    if rank.get("epoch_np_state") is not None:
        np.random.RandomState().set_state(rank["epoch_np_state"])
    step = rank.get("optimizer_step")
    if step is not None and not _is_count(step):
        raise TypeError(f"optimizer_step {step!r}")
    groups = rank.get("param_groups", [])
    if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params", []), list)
                                               for g in groups):
        raise TypeError("param_groups are not a list of groups")
    summary = rank.get("summary", {})
    if not isinstance(summary, dict):
        raise TypeError(f"summary is a {type(summary).__name__}")
    for key, value in summary.items():
        if key not in SUMMARY_TYPES or not isinstance(value, SUMMARY_TYPES[key]) or isinstance(value, bool):
            raise TypeError(f"summary.{key} = {str(value)[:40]!r}")
