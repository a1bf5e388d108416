"""Checkpoints written with ``torch.distributed.checkpoint`` (DCP): they reshard, so a run
saved on N ranks resumes on any number of ranks, and they load without unpickling code.

Layout under ``checkpoint_dir``::

    step_00000040/.metadata, __0_0.distcp, ...   DCP: model, fused and dense optimizer state
    step_00000040/MANIFEST.json   written last, by rank 0: config, position, each rank's RNG
    LATEST                        name of the newest complete step directory

Tensors go to DCP - ``ShardedTensor`` tables and optimizer state by their global offsets,
replicated dense tensors once - so loading into a model sharded for another world size reads
each rank's rows wherever they were written. Everything else (position, RNG states, results,
the optimizer's param groups) goes to the manifest as JSON. Nothing is read with pickle's full
power: DCP's ``.metadata`` (a pickle) is read by an unpickler that admits only DCP's own
metadata classes, and a checkpoint holding pickled objects instead of tensors is refused.

"Has a manifest" means "complete": a re-written step directory loses its manifest first, the
manifest is written (``fsync``, ``os.replace``) only after DCP's collective save returned on
every rank, and ``LATEST`` after it. An interrupted save leaves the previous checkpoint - and
``LATEST`` - as they were.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import pickle
import random
import shutil
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from .compose import diff
from .errors import CheckpointError, ConfigError
from .rundir import LATEST, MANIFEST, complete_checkpoints, latest_checkpoint

FORMAT = 2  # 1: one torch.save file per rank (same world size only, unpickled on load)
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


# ---------------------------------------------------------------------- JSON of non-tensor state
def to_json(obj: Any) -> Any:
    """RNG states, positions and results as JSON (tuples, NumPy arrays and small CPU tensors
    tagged, so that :func:`from_json` gives back the same types)."""
    if isinstance(obj, torch.Tensor):
        data = obj.detach().cpu().contiguous()
        return {"__tensor__": base64.b64encode(data.numpy().tobytes()).decode(), "dtype": str(data.dtype)[6:],
                "shape": list(data.shape)}
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": base64.b64encode(np.ascontiguousarray(obj).tobytes()).decode(),
                "dtype": obj.dtype.str, "shape": list(obj.shape)}
    if isinstance(obj, tuple):
        return {"__tuple__": [to_json(v) for v in obj]}
    if isinstance(obj, list):
        return [to_json(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_json(v) for k, v in obj.items()}
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"checkpoint: cannot store a {type(obj).__name__} in the manifest (only tensors, arrays "
                    f"and JSON values)")


def from_json(obj: Any) -> Any:
    if isinstance(obj, list):
        return [from_json(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        raw = np.frombuffer(base64.b64decode(obj["__tensor__"]), dtype=_numpy_dtype(obj["dtype"]))
        return torch.from_numpy(raw.copy()).view(obj["shape"])
    if "__ndarray__" in obj:
        return np.frombuffer(base64.b64decode(obj["__ndarray__"]), dtype=np.dtype(obj["dtype"])).reshape(obj["shape"]).copy()
    if "__tuple__" in obj:
        return tuple(from_json(v) for v in obj["__tuple__"])
    return {k: from_json(v) for k, v in obj.items()}


def _numpy_dtype(torch_dtype_name: str) -> np.dtype:
    return torch.empty(0, dtype=getattr(torch, torch_dtype_name)).numpy().dtype


# ---------------------------------------------------------------------- safe DCP reading
# What DCP's .metadata pickle may name: its own metadata dataclasses and the torch types they
# hold. Anything else (a function, a class with a __reduce__ that runs code) is refused.
_SAFE_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "MetadataIndex", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                 "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"), ("collections", "OrderedDict"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_CONSTANTS):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a tensor checkpoint's metadata")


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader, except that ``.metadata`` is unpickled with an allow-list and a
    checkpoint that stores pickled objects (DCP's planner would unpickle them without the
    tensors-only restriction) is refused; DCP reads the tensors themselves tensors-only."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as fh:
                metadata = _MetadataUnpickler(fh).load()
        except (pickle.UnpicklingError, AttributeError, ImportError) as err:
            raise CheckpointError(f"{path}: not a tensor checkpoint this program wrote ({err}); refusing to load it") from None
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise CheckpointError(f"{path}: not a DCP metadata file; refusing to load it")
        objects = sorted(k for k, v in metadata.state_dict_metadata.items()
                         if not isinstance(v, dcp_metadata.TensorStorageMetadata))
        if objects:
            raise CheckpointError(f"{path}: holds pickled objects, not tensors ({objects[:3]}); refusing to load it")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _split(payload: Mapping[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``payload`` as (tensors for DCP, the rest for JSON), both nested as given. Empty dicts
    are dropped from the tensor side: a stateless fused optimizer (e.g. EXACT_SGD) has an
    empty state entry, which DCP saves as nothing and then reports missing on load."""
    tensors: Dict[str, Any] = {}
    rest: Dict[str, Any] = {}
    for key, value in payload.items():
        if isinstance(value, torch.Tensor):
            tensors[key] = value
        elif isinstance(value, Mapping) and not _is_json_leaf(value):
            t, r = _split(value)
            if t:
                tensors[key] = t
            if r or not value:
                rest[key] = r
        else:
            rest[key] = value
    return tensors, rest


def _is_json_leaf(value: Mapping[str, Any]) -> bool:
    return not any(isinstance(v, (torch.Tensor, Mapping)) for v in value.values())


def _merge(into: Dict[str, Any], other: Mapping[str, Any]) -> Dict[str, Any]:
    for key, value in other.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value
    return into


class Checkpointer:
    """Saves and loads a trainer's state under ``directory`` (see the module docstring).

    ``save``/``load`` are collective. ``per_rank`` names payload keys whose values differ
    between ranks (RNG states, each rank's results): each rank's are kept, and a rank of a
    run with another world size takes those of saved rank ``rank % saved_world_size``.
    """

    def __init__(self, directory: Path, rank: int, world_size: int, keep: int, log: logging.Logger) -> None:
        self.directory = Path(directory)
        self.rank = rank
        self.world_size = world_size
        self.keep = keep
        self.log = log

    # ------------------------------------------------------------------ save
    def save(self, step: int, payload: Dict[str, Any], manifest_extra: Dict[str, Any],
             per_rank: Sequence[str] = ()) -> Path:
        """Collective. Tensors of ``payload`` (``ShardedTensor`` or replicated) go to DCP, the
        rest (JSON values, arrays, tuples) to the manifest; rank 0 completes the checkpoint."""
        target = self.directory / step_dir_name(step)
        if self.rank == 0:
            if target.exists():  # re-writing: incomplete from now on, and no stale shard files
                (target / MANIFEST).unlink(missing_ok=True)
                shutil.rmtree(target)
            target.mkdir(parents=True)
        dist.barrier()
        shared = {k: v for k, v in payload.items() if k not in per_rank}
        tensors, rest = _split(shared)
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(target)))
        mine = to_json({k: payload[k] for k in per_rank if k in payload})
        everyone: List[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine)
        if self.rank == 0:
            manifest = {
                "format": FORMAT, "step": step, "world_size": self.world_size, "created": time.time(),
                "state": to_json(rest), "ranks": everyone, **manifest_extra,
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

    def manifest(self, path: Path) -> Dict[str, Any]:
        try:
            manifest = json.loads((Path(path) / MANIFEST).read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path}: its {MANIFEST} cannot be read ({e}); refusing to load it") from None
        steps = [manifest.get("step"), manifest.get("position", {}).get("step")] if isinstance(manifest, dict) else []
        for step in (s for s in steps if s is not None):
            if Path(path).name.startswith("step_") and step_dir_name(int(step)) != Path(path).name:
                raise CheckpointError(
                    f"{path}: its {MANIFEST} says step {step}, the directory says {Path(path).name}; the manifest "
                    f"was changed after the save, refusing to load it"
                )
        if manifest.get("format") != FORMAT:
            raise ConfigError(
                f"{path}: checkpoint format {manifest.get('format')} is not {FORMAT} (format 1 checkpoints, one "
                f"pickled file per rank, are not loaded: loading them could run code from the checkpoint directory)"
            )
        return manifest

    def saved_keys(self, path: Path) -> List[str]:
        """The flattened names of the tensors the checkpoint holds."""
        reader = SafeFileSystemReader(str(path))
        return sorted(reader.read_metadata().state_dict_metadata)

    def unplaced_keys(self, path: Path, template: Dict[str, Any]) -> List[str]:
        """The checkpoint's tensors ``template`` has no place for (e.g. optimizer state that
        is created lazily, at the first step)."""
        tensors, _ = _split(template)
        return sorted(set(self.saved_keys(path)) - set(flatten_state_dict(tensors)[0]))

    def load(self, path: Path, config_flat: Optional[Dict[str, Any]], map_location: Any = "cpu",
             template: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """The saved payload. Tensors are loaded into ``template`` (the live model's and
        optimizer's state dicts: ``ShardedTensor`` entries get this rank's rows, whatever the
        world size that wrote them) and returned in it; without a template every tensor comes
        back whole, on ``map_location``. Refuses a checkpoint whose config differs where it must
        not (``check_compatible``; ``config_flat=None``: only reading it, no check)."""
        path = Path(path)
        manifest = self.manifest(path)
        if config_flat is not None:
            check_compatible(manifest.get("config", {}), config_flat, path)
        saved = self.saved_keys(path)
        if template is None:
            template = self._whole_tensors(path, map_location)
        tensors, _ = _split(template)
        flat, _ = flatten_state_dict(tensors)
        missing = sorted(set(flat) - set(saved))
        if missing:
            raise CheckpointError(f"{path}: holds no {missing[:3]}{' ...' if len(missing) > 3 else ''} "
                             f"({len(missing)} tensors this model needs)")
        try:
            dcp.load(tensors, storage_reader=SafeFileSystemReader(str(path)))
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as e:  # (DCP's is a BaseException)
            # A truncated or overwritten file: say which checkpoint, why, and what else there is.
            # (DCP's message is each rank's traceback: its last line says what went wrong.)
            cause = ([line for line in str(e).strip().splitlines() if line.strip()] or [type(e).__name__])[-1]
            others = [p.name for p in self.complete() if p != path]
            raise CheckpointError(
                f"{path}: cannot be read, it is damaged ({cause.split('. ')[0][:160]}); delete it to resume from "
                f"an earlier checkpoint ({', '.join(others) if others else 'none is left'})"
            ) from e
        ranks = [from_json(r) for r in manifest["ranks"]]
        out = _merge(from_json(manifest.get("state", {})), tensors)
        out = _merge(out, ranks[self.rank % len(ranks)])
        out["saved_ranks"] = ranks  # every saved rank's per-rank values
        return out

    def _whole_tensors(self, path: Path, map_location: Any) -> Dict[str, Any]:
        """Empty full-size tensors for every tensor in the checkpoint, nested as saved."""
        md = SafeFileSystemReader(str(path)).read_metadata()
        flat = {
            fqn: torch.empty(tuple(m.size), dtype=m.properties.dtype, device=map_location)
            for fqn, m in md.state_dict_metadata.items()
        }
        nested: Dict[str, Any] = {}
        for fqn, tensor in flat.items():
            mapping = md.planner_data.get(fqn, (fqn,)) if isinstance(md.planner_data, dict) else (fqn,)
            node = nested
            for part in mapping[:-1]:
                node = node.setdefault(part, {})
            node[mapping[-1]] = tensor
        return nested


def fused_optimizer_step(model: torch.nn.Module) -> Optional[int]:
    """The proactive tables' step counter (FBGEMM's TBE ``iter``): it advances on every
    forward and is in no state dict, so checkpoints carry it. None if this rank has none."""
    for module in model.modules():
        for kernel in getattr(module, "proactive_kernels", ()):  # a proactive sharded EBC
            return int(kernel.store.step)
    return None


def restore_param_groups(current: List[Dict[str, Any]], saved_ranks: Sequence[Sequence[Dict[str, Any]]]
                         ) -> List[Dict[str, Any]]:
    """The live optimizer's param groups (which name this rank's parameters) with the
    hyper-parameters (``lr`` ...) of the saved group holding the same parameters on any saved
    rank; a group no saved rank held keeps its own (the config they come from must match)."""
    by_param: Dict[str, Dict[str, Any]] = {}
    for groups in saved_ranks:
        for group in groups:
            for name in group.get("params", []):
                by_param.setdefault(str(name), group)
    out = []
    for group in current:
        match = next((by_param[str(p)] for p in group["params"] if str(p) in by_param), None)
        out.append(group if match is None else {**{k: v for k, v in match.items() if k != "params"},
                                                "params": group["params"]})
    return out


def check_compatible(saved: Dict[str, Any], current: Dict[str, Any], where: Any) -> None:
    keys: Sequence[str] = [
        k for k in sorted(set(saved) | set(current))
        if k.startswith(_MUST_MATCH) and k not in _MAY_DIFFER
    ]
    changed = diff(saved, current, keys)
    if changed:
        detail = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in changed.items())
        raise ConfigError(f"cannot resume from {where}: the config changed ({detail})")
