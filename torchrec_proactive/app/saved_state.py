"""The trainer's non-tensor state in a checkpoint's manifest, checked before any of it is used.

The manifest's values (position, RNG states, the fused step counter, carried results, param
groups) are applied by :meth:`~torchrec_proactive.app.loop.Trainer.resume`. A value of the
wrong type or with other keys would fail there with a ``TypeError`` deep in numpy or torch,
or silently change the run; here it is one :class:`CheckpointError` naming the manifest and
the value. Every saved rank's values are checked on every rank (a rank of another world
size may take any of them), so all ranks refuse alike.

The manifest's seal is a checksum anyone can recompute, so its numbers are range-checked
too (:func:`check_numbers`) against the run that wrote them - its config is in the manifest:
the epoch within ``train.epochs``, the step within ``train.max_steps``, the position within
one epoch (``step = epoch x batches per epoch + batch_in_epoch``, the loop's invariant), the
batches within the synthetic data set, counters within int64. A number no run could have
saved would otherwise train "epoch 10^30" or end in a traceback deep in the loop.
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


INT64_MAX = 2**63 - 1  # the step counters are int64 tensors (FBGEMM's TBE ``iter``)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _config_count(config: Dict[str, Any], key: str) -> Any:
    value = config.get(key)
    return value if _is_count(value) and value > 0 else None


def check_numbers(manifest: Dict[str, Any], where: Any) -> None:
    """Raises :class:`CheckpointError` (one line: the field, its value and the limit) for a
    position, step counter or summary depth that the run which saved the checkpoint could
    not have reached. Fields of the wrong type are left to :func:`check_saved_state`."""
    path = f"{where}/{MANIFEST}"

    def refuse(text: str) -> None:
        raise CheckpointError(f"{path}: {text}; refusing to load it")

    config = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    state = manifest.get("state") if isinstance(manifest.get("state"), dict) else {}
    position = state.get("position") if isinstance(state.get("position"), dict) else {}
    step, epoch, batch = (position.get(k) for k in ("step", "epoch", "batch_in_epoch"))
    epochs, max_steps = _config_count(config, "train.epochs"), _config_count(config, "train.max_steps")
    if _is_count(epoch) and epochs is not None and epoch > epochs:
        refuse(f"position.epoch is {epoch}, beyond train.epochs={epochs} of the run that saved it (a finished run "
               f"stands at epoch {epochs}, batch 0)")
    if _is_count(epoch) and _is_count(batch) and epoch == epochs and batch > 0:
        refuse(f"position.batch_in_epoch is {batch} in epoch {epoch}, after the last epoch of the run that saved it "
               f"(train.epochs={epochs}: it ends at batch 0 of epoch {epochs})")
    if _is_count(step) and max_steps is not None and step > max_steps:
        refuse(f"position.step is {step}, beyond train.max_steps={max_steps} of the run that saved it")
    if _is_count(step) and _is_count(epoch) and _is_count(batch):
        if batch > step:
            refuse(f"position.batch_in_epoch is {batch}, more than position.step {step} (the steps trained in all, "
                   f"every batch of an epoch one step)")
        if epoch == 0 and batch != step:
            refuse(f"position.batch_in_epoch is {batch} in epoch 0, where it must equal position.step {step}")
        if epoch > 0 and ((step - batch) % epoch or (step - batch) // epoch <= batch):
            refuse(f"position.step {step}, position.epoch {epoch} and position.batch_in_epoch {batch} do not make "
                   f"{epoch} whole epoch(s) of more than {batch} batches (step = epoch x batches per epoch + "
                   f"batch_in_epoch)")
        batch_size, samples = _config_count(config, "train.batch_size"), _config_count(config, "data.num_samples")
        world = manifest.get("world_size")
        if config.get("data.source") == "synthetic" and batch_size and samples and _is_count(world):
            per_epoch = (step - batch) // epoch if epoch else batch
            if per_epoch * batch_size * world > samples:
                what = (f"position.batch_in_epoch is {batch}" if not epoch else
                        f"position.step {step} in epoch {epoch} means {per_epoch} batches per epoch")
                refuse(f"{what}: {per_epoch} batches of train.batch_size={batch_size} on {world} rank(s) are more "
                       f"samples than data.num_samples={samples}")
    for name, value in (("step", step), ("epoch", epoch), ("batch_in_epoch", batch)):
        if _is_count(value) and value > INT64_MAX:
            refuse(f"position.{name} is {value}, beyond the int64 limit {INT64_MAX}")
    depth_limit = max((v for v in (config.get("prefetch.depth"), config.get("prefetch.max_depth")) if _is_count(v)),
                      default=None)
    for index, rank in enumerate(manifest.get("ranks") if isinstance(manifest.get("ranks"), list) else []):
        if not isinstance(rank, dict):
            continue
        counter = rank.get("optimizer_step")
        if _is_count(counter) and counter > INT64_MAX:
            refuse(f"saved rank {index}'s optimizer_step (the fused tables' step counter, an int64) is {counter}, "
                   f"beyond {INT64_MAX}")
        summary = rank.get("summary") if isinstance(rank.get("summary"), dict) else {}
        depth = summary.get("depth")
        if _is_count(depth) and depth_limit is not None and depth > depth_limit:
            refuse(f"saved rank {index}'s summary.depth is {depth}, beyond the prefetch.depth/prefetch.max_depth "
                   f"({depth_limit}) of the run that saved it")


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
    check_numbers(manifest, where)


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
