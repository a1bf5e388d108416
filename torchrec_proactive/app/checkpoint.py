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
power: DCP's ``.metadata`` (a pickle) is read by :mod:`torchrec_proactive.checkpoint`'s
reader, which admits only DCP's own metadata classes and refuses pickled objects and any file
name that leaves the step directory.

Damage is refused, not loaded: the manifest records every file's size and SHA-256 checksum
(``files``) and its own (``seal``); a load verifies them all first (each rank a share of the
files) and a mismatch is one line naming the file and the checkpoints that are intact. The
seal is an unkeyed checksum that anyone can recompute: it detects damage, not a deliberate
edit (the values behind it are range-checked, :mod:`.saved_state`). A checkpoint whose files
match and that still does not fit this run is never called damaged: a table whose row-wise
optimizer state (row-wise Adagrad's, one value per row of each column shard) would be split
into other column shards than saved is refused before anything loads, naming the table
(:func:`check_column_layout`), and anything else the load trips on is named as a mismatch
with this run's model.

"Has a manifest" means "complete": a re-written step directory loses its manifest first, the
manifest is written (``fsync``, ``os.replace``) only after DCP's collective save returned on
every rank, and ``LATEST`` after it. An interrupted save leaves the previous checkpoint - and
``LATEST`` - as they were.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from ..checkpoint import METADATA, CheckpointReadError, SafeFileSystemReader, confined, file_digest
from ..integration.disk_views import StreamingSavePlanner
from .errors import CheckpointError, ConfigError
from .resume import refuse_changes
from .rundir import LATEST, MANIFEST, STEP_DIR, complete_checkpoints, latest_checkpoint

# 3: per-file checksums and the manifest's seal. 2: neither (still read, its bytes unverified).
# 1: one torch.save file per rank (unpickled on load: refused).
FORMAT = 3
_READABLE = (2, 3)
_HEX64 = re.compile(r"[0-9a-f]{64}")


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
    """The inverse of :func:`to_json`. Raises ``ValueError``/``TypeError`` on a value it did
    not write (a tag with other keys, an unknown dtype, a shape that does not fit the bytes)."""
    if isinstance(obj, list):
        return [from_json(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        _tag_keys(obj, {"__tensor__", "dtype", "shape"})
        raw = np.frombuffer(base64.b64decode(obj["__tensor__"], validate=True), dtype=_numpy_dtype(obj["dtype"]))
        return torch.from_numpy(raw.copy()).view(_shape(obj["shape"]))
    if "__ndarray__" in obj:
        _tag_keys(obj, {"__ndarray__", "dtype", "shape"})
        if not isinstance(obj["dtype"], str) or np.dtype(obj["dtype"]).hasobject:
            raise TypeError(f"array dtype {obj['dtype']!r}")
        return np.frombuffer(base64.b64decode(obj["__ndarray__"], validate=True),
                             dtype=np.dtype(obj["dtype"])).reshape(_shape(obj["shape"])).copy()
    if "__tuple__" in obj:
        _tag_keys(obj, {"__tuple__"})
        if not isinstance(obj["__tuple__"], list):
            raise TypeError(f"a tuple tag holding a {type(obj['__tuple__']).__name__}")
        return tuple(from_json(v) for v in obj["__tuple__"])
    return {k: from_json(v) for k, v in obj.items()}


def _tag_keys(obj: Dict[str, Any], keys: set) -> None:
    if set(obj) != keys:
        raise ValueError(f"a tagged value with the keys {sorted(obj)}, not {sorted(keys)}")


def _shape(shape: Any) -> List[int]:
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                              for n in shape):
        raise TypeError(f"shape {shape!r}")
    return shape


def _numpy_dtype(torch_dtype_name: Any) -> np.dtype:
    dtype = getattr(torch, torch_dtype_name, None) if isinstance(torch_dtype_name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype tag {torch_dtype_name!r} is not a torch dtype")
    return torch.empty(0, dtype=dtype).numpy().dtype


def decode(obj: Any, where: Any, what: str) -> Any:
    """:func:`from_json` of a manifest's ``what``, a :class:`CheckpointError` if it cannot be."""
    try:
        return from_json(obj)
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError, binascii.Error) as e:
        raise CheckpointError(f"{where}: its {MANIFEST} holds a {what} this program did not write "
                              f"({str(e).splitlines()[0][:120] if str(e) else type(e).__name__}); refusing to load "
                              f"it") from None


def seal(manifest: Mapping[str, Any]) -> str:
    """The manifest's own checksum: SHA-256 of its canonical JSON without ``seal``."""
    body = json.dumps({k: v for k, v in manifest.items() if k != "seal"}, sort_keys=True, allow_nan=True)
    return hashlib.sha256(body.encode()).hexdigest()


# ---------------------------------------------------------------------- reading files safely
def read_metadata(path: Path) -> dcp_metadata.Metadata:
    """The checkpoint's DCP metadata, read safely (:mod:`torchrec_proactive.checkpoint`)."""
    try:
        return SafeFileSystemReader(str(path)).read_metadata()
    except CheckpointReadError as e:
        raise CheckpointError(str(e)) from None


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


def _gather(value: Any) -> List[Any]:
    """``value`` of every rank (just this one outside a process group of several)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _first_line(text: str) -> str:
    return ([line for line in text.strip().splitlines() if line.strip()] or [""])[0][:160]


# ---------------------------------------------------------------------- column splits
Splits = Tuple[Tuple[int, int], ...]  # (first column, end) of each column shard of a 2-D table


def column_splits(pieces: Iterable[Tuple[Sequence[int], Sequence[int]]]) -> Splits:
    """The distinct column ranges of a 2-D tensor's shards, from each shard's (offsets, sizes)."""
    return tuple(sorted({(int(o[1]), int(o[1]) + int(n[1])) for o, n in pieces}))


def live_column_splits(value: Any) -> Optional[Splits]:
    """The column ranges of a live 2-D tensor: a ``ShardedTensor``'s shards, or one whole
    range; ``None`` for anything else."""
    if not isinstance(value, torch.Tensor) or value.dim() != 2:
        return None
    metadata = getattr(value, "metadata", None)
    if callable(metadata) and hasattr(metadata(), "shards_metadata"):
        return column_splits((m.shard_offsets, m.shard_sizes) for m in metadata().shards_metadata)
    return ((0, int(value.shape[1])),)


@dataclass
class RowWiseState:
    """A table whose fused optimizer state is one value per row of each column shard."""

    table: str
    dim: int
    splits: Splits  # as saved
    states: List[str] = field(default_factory=list)  # e.g. ["momentum1"]


def row_wise_state_tables(md: dcp_metadata.Metadata) -> Dict[str, RowWiseState]:
    """``{model key: RowWiseState}`` for every 2-D ``model.<param>`` the checkpoint holds
    beside a 1-D ``optimizer.state.<param>.<table>.<name>``: TorchRec's layout of row-wise
    state (row-wise Adagrad's ``momentum1``), whose length is rows x column shards."""
    entries = md.state_dict_metadata
    out: Dict[str, RowWiseState] = {}
    for key, entry in entries.items():
        if not key.startswith("optimizer.state.") or len(getattr(entry, "size", ())) != 1:
            continue
        parts = key[len("optimizer.state."):].rsplit(".", 2)
        weight = entries.get(f"model.{parts[0]}") if len(parts) == 3 else None
        if weight is None or len(getattr(weight, "size", ())) != 2:
            continue
        record = out.get(f"model.{parts[0]}")
        if record is None:
            record = out[f"model.{parts[0]}"] = RowWiseState(
                parts[1], int(weight.size[1]), column_splits((c.offsets, c.sizes) for c in weight.chunks))
        record.states.append(parts[2])
    return out


def _describe_splits(splits: Splits, dim: int) -> str:
    if splits == ((0, dim),):
        return "whole (1 column shard)"
    return f"in {len(splits)} column shards (columns {', '.join(f'{a}-{b - 1}' for a, b in splits)})"


def check_column_layout(path: Path, manifest: Mapping[str, Any], md: dcp_metadata.Metadata,
                        planned: Mapping[str, Optional[Splits]], planned_words: str) -> None:
    """Raises :class:`ConfigError` when a table with row-wise optimizer state would be split
    into other column shards than the checkpoint's (``planned``: model key -> this run's
    column ranges; a key it lacks, or ``None``, is not known here and not checked).

    Row-wise Adagrad keeps, per row of each column shard, the sum of the mean squared
    gradient over that shard's columns, laid out by TorchRec as rows x shards. A whole-row
    value does not hold the per-shard ones, so whole -> column shards cannot be re-laid; the
    reverse could be approximated (the width-weighted mean of the shards' values, not what a
    table-wise run accumulates in floating point) and is not done either. Stock TorchRec
    fails on both (DCP's size mismatch); this names the table, the optimizer and the change."""
    changed = [(key, record, planned[key]) for key, record in sorted(row_wise_state_tables(md).items())
               if planned.get(key) is not None and planned[key] != record.splits]
    if not changed:
        return
    _, record, now = changed[0]
    config = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    optimizer = config.get("optimizer.embedding")
    what = (f"row-wise Adagrad (optimizer.embedding={optimizer!r})" if optimizer == "rowwise_adagrad"
            else f"optimizer.embedding={optimizer!r}" if isinstance(optimizer, str) else "its fused optimizer")
    saved_type, saved_world = config.get("sharding.type"), manifest.get("world_size")
    saved_words = (f"sharding.type={saved_type!r} on {saved_world} rank(s)" if isinstance(saved_type, str)
                   else f"{saved_world} rank(s)")
    advice = ("a sharding.type that keeps its columns whole (table_wise, row_wise, table_row_wise, or column_wise "
              "on 1 rank)" if record.splits == ((0, record.dim),) else f"the column split it was saved with "
              f"({saved_words})")
    more = (f" ({len(changed) - 1} more table(s) alike: {', '.join(repr(r.table) for _, r, _ in changed[1:4])}"
            f"{' ...' if len(changed) > 4 else ''})" if len(changed) > 1 else "")
    meaning = (": the running sum of the mean squared gradient over that shard's columns"
               if optimizer == "rowwise_adagrad" else "")
    raise ConfigError(
        f"cannot resume from {path}: table {record.table!r}: {what} keeps row-wise state ({', '.join(record.states)}), "
        f"one value per row of each column shard{meaning}. This checkpoint holds the table's {record.dim} columns "
        f"{_describe_splits(record.splits, record.dim)}, saved with {saved_words}, and {planned_words} splits them "
        f"{_describe_splits(now, record.dim)}; row-wise state is not re-laid between column splits, so nothing was "
        f"loaded{more}. The checkpoint is intact: "
        f"resume it with {advice}, or start a new run (another train.output_dir) for the new sharding"
    )


class Checkpointer:
    """Saves and loads a trainer's state under ``directory`` (see the module docstring).

    ``save``/``load``/``verify`` are collective. ``per_rank`` names payload keys whose values
    differ between ranks (RNG states, each rank's results): each rank's are kept, and a rank
    of a run with another world size takes those of saved rank ``rank % saved_world_size``.
    Every refusal is a :class:`CheckpointError` with a one-line message, raised on every rank.
    """

    def __init__(self, directory: Path, rank: int, world_size: int, keep: int, log: logging.Logger) -> None:
        self.directory = Path(directory)
        self.rank = rank
        self.world_size = world_size
        self.keep = keep
        self.log = log
        self._verified: Dict[Path, str] = {}  # checkpoint -> seal of the manifest its files matched

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
        # Tables on disk (tier=ssd) are saved a chunk of rows at a time, never whole in DRAM
        # (the planner leaves every other tensor as DCP's default planner would).
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(target)), planner=StreamingSavePlanner())
        files = self._digests(target)
        mine = to_json({k: payload[k] for k in per_rank if k in payload})
        everyone: List[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine)
        if self.rank == 0:
            manifest = {
                "format": FORMAT, "step": step, "world_size": self.world_size, "created": time.time(),
                "state": to_json(rest), "ranks": everyone, "files": files, **manifest_extra,
            }
            manifest["seal"] = seal(manifest)
            atomic_write(target / MANIFEST, lambda fh: fh.write(json.dumps(manifest, indent=1).encode()))
            atomic_write(self.directory / LATEST, lambda fh: fh.write(target.name.encode()))
            self._prune(keep_name=target.name)
        dist.barrier()
        self.log.info("checkpoint %s written (%d ranks)", target, self.world_size)
        return target

    def _digests(self, target: Path) -> Dict[str, Dict[str, Any]]:
        """Collective: size and checksum of every file DCP wrote in ``target``, each rank
        reading a share of them (rank 0 lists them: DCP's save returned on every rank)."""
        names: List[Any] = [sorted(p.name for p in target.iterdir() if p.is_file()) if self.rank == 0 else None]
        if dist.is_initialized() and self.world_size > 1:
            dist.broadcast_object_list(names, src=0)
        share = {n: {"bytes": (target / n).stat().st_size, "sha256": file_digest(target / n)}
                 for n in names[0][self.rank::self.world_size]}
        return {k: v for part in _gather(share) for k, v in sorted(part.items())}

    def _prune(self, keep_name: str) -> None:
        complete = self.complete()
        for old in complete[: max(len(complete) - self.keep, 0)]:
            if old.name != keep_name:
                shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------------ find / check
    def complete(self) -> List[Path]:
        """Complete checkpoints, oldest first."""
        return complete_checkpoints(self.directory)

    def latest(self) -> Optional[Path]:
        """The newest complete checkpoint (``LATEST`` if it is complete), or ``None``.
        A ``LATEST`` naming anything but a step directory of this directory is refused."""
        return latest_checkpoint(self.directory)

    def manifest(self, path: Path, explain: bool = True) -> Dict[str, Any]:
        """The checkpoint's manifest, checked: its seal, every field's type, the step against
        the directory's name, and every file name inside the directory. ``explain``: name the
        intact checkpoints in a refusal."""
        path = Path(path)
        others = (lambda: self._others(path)) if explain else (lambda: "")
        where = path / MANIFEST
        if where.is_symlink():
            raise CheckpointError(f"{where}: is a symbolic link (to {os.readlink(where)}); the save writes the manifest "
                                  f"itself, so a link is refused, not followed")
        try:
            manifest = json.loads(where.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path}: its {MANIFEST} cannot be read ({_first_line(str(e))}); refusing to "
                                  f"load it{others()}") from None
        if not isinstance(manifest, dict):
            raise CheckpointError(f"{where}: holds a {type(manifest).__name__}, not a manifest; refusing to load it")
        if manifest.get("format") not in _READABLE or isinstance(manifest.get("format"), bool):
            raise ConfigError(
                f"{path}: checkpoint format {manifest.get('format')!r} is not {FORMAT} (format 1 checkpoints, one "
                f"pickled file per rank, are not loaded: loading them could run code from the checkpoint directory)"
            )
        if manifest["format"] >= 3 and manifest.get("seal") != seal(manifest):
            raise CheckpointError(f"{where}: was changed or damaged after the save (its checksum does not match); "
                                  f"refusing to load it{others()}")
        if not STEP_DIR.fullmatch(path.name):  # the step check below must not be skippable by a name
            raise CheckpointError(f"{path}: not a checkpoint directory (those are named step_<8 digits>, after "
                                  f"their step); refusing to load it")
        _expect(manifest, where, "step", int)
        _expect(manifest, where, "world_size", int)
        _expect(manifest, where, "ranks", list)
        _expect(manifest, where, "state", dict)
        _expect(manifest, where, "created", (int, float))
        if "config" in manifest:
            _expect(manifest, where, "config", dict)
        if step_dir_name(manifest["step"]) != path.name:
            raise CheckpointError(
                f"{path}: its {MANIFEST} says step {manifest['step']}, the directory says {path.name}; the manifest "
                f"was changed after the save, refusing to load it"
            )
        if manifest["world_size"] < 1 or len(manifest["ranks"]) != manifest["world_size"] or \
                not all(isinstance(r, dict) for r in manifest["ranks"]):
            raise CheckpointError(f"{where}: world_size {manifest['world_size']} with {len(manifest['ranks'])} "
                                  f"ranks' entries (one mapping per saved rank expected); refusing to load it")
        for position in (manifest.get("position"), manifest["state"].get("position")):  # (the trainer's)
            if isinstance(position, dict) and position.get("step") != manifest["step"]:
                raise CheckpointError(
                    f"{path}: its {MANIFEST} says step {position.get('step')!r}, the directory says {path.name}; the "
                    f"manifest was changed after the save, refusing to load it"
                )
        if manifest["format"] >= 3:
            _check_files(manifest, path)
        return manifest

    def verify(self, path: Path) -> Dict[str, Any]:
        """Collective. The checked manifest, once every file matches its recorded size and
        checksum (each rank hashes a share) and the DCP metadata reads safely and names only
        recorded files. Refuses, on every rank alike, naming the file and the intact checkpoints."""
        path = Path(path)
        manifest = self.manifest(path)
        if self._verified.get(path) == manifest.get("seal", "unsealed"):
            return manifest
        bad = _gather(self._damaged(path, manifest, self.rank, self.world_size))
        bad = sorted(b for part in bad for b in part)
        if bad:
            # (a file linked elsewhere is intact: put it back, nothing to delete or fall back from)
            damaged = not all(why.startswith("links outside") for _, why in bad)
            raise CheckpointError(f"{path / bad[0][0]}: {bad[0][1]}; refusing to load {path.name}"
                                  f"{' (and ' + str(len(bad) - 1) + ' more files)' if len(bad) > 1 else ''}"
                                  f"{self._others(path) if damaged else ''}")
        md = read_metadata(path)
        if manifest["format"] >= 3:
            unrecorded = sorted({s.relative_path for s in md.storage_data.values()} - set(manifest["files"]))
            if unrecorded:
                raise CheckpointError(f"{path}: its {METADATA} names {unrecorded[0]!r}, a file its {MANIFEST} does not "
                                      f"record; refusing to load it{self._others(path)}")
        else:
            self.log.warning("checkpoint %s: format 2, written without checksums: its files are not verified", path)
        self._verified[path] = manifest.get("seal", "unsealed")
        return manifest

    @staticmethod
    def _damaged(path: Path, manifest: Dict[str, Any], rank: int, world_size: int) -> List[Tuple[str, str]]:
        """(file, what is wrong) for this rank's share of the recorded files."""
        if manifest["format"] < 3:
            return []
        out = []
        for name in sorted(manifest["files"])[rank::world_size]:
            want = manifest["files"][name]
            try:
                file = confined(path, name)
                size = file.stat().st_size
                if size != want["bytes"]:
                    out.append((name, f"{size} bytes, {want['bytes']} when it was saved (damaged)"))
                elif file_digest(file) != want["sha256"]:
                    out.append((name, "its bytes do not match the checksum recorded when it was saved (damaged)"))
            except CheckpointReadError:
                # (intact bytes, elsewhere: not damage, and nothing to delete)
                out.append((name, f"links outside the checkpoint directory {path}; put the file itself there "
                                  f"in place of the link"))
            except OSError as e:
                out.append((name, f"cannot be read ({e.strerror or type(e).__name__})"))
        return out

    def intact(self, but: Optional[Path] = None) -> List[Path]:
        """This rank's look at the other complete checkpoints: those whose manifest and files
        all check out (every file hashed here: only for a message after a refusal)."""
        out = []
        for other in self.complete():
            if but is not None and other == Path(but):
                continue
            try:
                manifest = self.manifest(other, explain=False)
                if not self._damaged(other, manifest, 0, 1):
                    read_metadata(other)
                    out.append(other)
            except CheckpointError:
                continue
        return out

    def _others(self, path: Path) -> str:
        names = [p.name for p in self.intact(but=path)]
        return (f"; intact checkpoints in {self.directory}: {', '.join(names)} (delete {Path(path).name} to resume "
                f"from the latest of them)" if names else f"; no other intact checkpoint in {self.directory}")

    def saved_keys(self, path: Path) -> List[str]:
        """The flattened names of the tensors the checkpoint holds."""
        return sorted(read_metadata(path).state_dict_metadata)

    def unplaced_keys(self, path: Path, template: Dict[str, Any]) -> List[str]:
        """The checkpoint's tensors ``template`` has no place for (e.g. optimizer state that
        is created lazily, at the first step)."""
        tensors, _ = _split(template)
        return sorted(set(self.saved_keys(path)) - set(flatten_state_dict(tensors)[0]))

    # ------------------------------------------------------------------ load
    def load(self, path: Path, config_flat: Optional[Dict[str, Any]], map_location: Any = "cpu",
             template: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """The saved payload, after :meth:`verify`. Tensors are loaded into ``template`` (the
        live model's and optimizer's state dicts: ``ShardedTensor`` entries get this rank's
        rows, whatever the world size that wrote them) and returned in it; without a template
        every tensor comes back whole, on ``map_location``. Refuses a checkpoint whose config
        differs where the saved state would be wrong (:func:`~.resume.refuse_changes`; ``config_flat=None``:
        only reading it, no check)."""
        path = Path(path)
        manifest = self.verify(path)
        if config_flat is not None:
            refuse_changes(manifest.get("config", {}), config_flat, path)
        state = decode(manifest["state"], path, "saved state")
        ranks = decode(manifest["ranks"], path, "per-rank state")
        md = read_metadata(path)
        saved = sorted(md.state_dict_metadata)
        whole = template is None
        if template is None:
            template = self._whole_tensors(path, map_location)
        tensors, _ = _split(template)
        flat, _ = flatten_state_dict(tensors)
        missing = sorted(set(flat) - set(saved))
        if missing:
            raise CheckpointError(f"{path}: holds no {missing[:3]}{' ...' if len(missing) > 3 else ''} "
                                  f"({len(missing)} tensors this model needs)")
        if not whole:  # (whole tensors are read as saved, whatever their split)
            check_column_layout(path, manifest, md, {k: live_column_splits(flat[k]) for k in row_wise_state_tables(md)
                                                     if k in flat},
                                f"this run's sharding plan on {self.world_size} rank(s)")
        try:
            dcp.load(tensors, storage_reader=SafeFileSystemReader(str(path)))
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as e:  # (DCP's is a BaseException)
            # Files that match their checksums and still do not load into this run's tensors:
            # not damage (the checksums rule that out), a mismatch with this run's model.
            # (DCP's message is each rank's traceback: its last line says what went wrong.)
            cause = ([line for line in str(e).strip().splitlines() if line.strip()] or [type(e).__name__])[-1]
            verified = ("its files match the checksums recorded at the save: they are intact"
                        if manifest["format"] >= 3 else "a format 2 checkpoint, whose files have no checksums")
            raise CheckpointError(
                f"{path}: cannot be loaded into this run's model ({cause.split('. ')[0][:160]}); {verified}: this "
                f"run's tables, shapes or sharding differ from the saved ones in a way the resume checks do not "
                f"name. Resume it with the config it was saved with (its {MANIFEST} holds it)"
            ) from None
        out = _merge(state, tensors)
        out = _merge(out, ranks[self.rank % len(ranks)])
        out["saved_ranks"] = ranks  # every saved rank's per-rank values
        return out

    def _whole_tensors(self, path: Path, map_location: Any) -> Dict[str, Any]:
        """Empty full-size tensors for every tensor in the checkpoint, nested as saved."""
        md = read_metadata(path)
        flat = {
            fqn: torch.empty(tuple(m.size), dtype=m.properties.dtype, device=map_location)
            for fqn, m in md.state_dict_metadata.items()
        }
        nested: Dict[str, Any] = {}
        for fqn, tensor in flat.items():
            mapping = md.planner_data.get(fqn, (fqn,)) if isinstance(md.planner_data, dict) else (fqn,)
            if not isinstance(mapping, (tuple, list)) or not mapping or \
                    not all(isinstance(p, (str, int)) for p in mapping):
                raise CheckpointError(f"{path}: its {METADATA} maps {fqn!r} to {mapping!r}; refusing to load it")
            node = nested
            for part in mapping[:-1]:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise CheckpointError(f"{path}: its {METADATA} nests {fqn!r} inside a tensor; refusing to load it")
            node[mapping[-1]] = tensor
        return nested


def _expect(manifest: Dict[str, Any], where: Path, key: str, kind: Any) -> None:
    value = manifest.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) or (isinstance(value, int) and value < 0):
        raise CheckpointError(f"{where}: {key} is {value!r}, not a {getattr(kind, '__name__', 'number')} this program "
                              f"writes; refusing to load it")


def _check_files(manifest: Dict[str, Any], path: Path) -> None:
    files = manifest.get("files")
    where = path / MANIFEST
    if not isinstance(files, dict) or METADATA not in files:
        raise CheckpointError(f"{where}: records no checksum of {METADATA} (files: {type(files).__name__}); refusing "
                              f"to load it")
    for name, entry in files.items():
        if not isinstance(entry, dict) or set(entry) != {"bytes", "sha256"} or not isinstance(entry["bytes"], int) \
                or isinstance(entry["bytes"], bool) or not isinstance(entry["sha256"], str) \
                or not _HEX64.fullmatch(entry["sha256"]):
            raise CheckpointError(f"{where}: the record of {name!r} is {entry!r}, not a size and checksum; refusing "
                                  f"to load it")
        if "/" in name or name in (".", "..", MANIFEST) or "\0" in name:
            raise CheckpointError(f"{where}: records {name!r}, which is not a file of the checkpoint directory; "
                                  f"refusing to load it")


def fused_optimizer_step(model: torch.nn.Module) -> Optional[int]:
    """The proactive tables' step counter (FBGEMM's TBE ``iter``): it advances on every
    forward and is in no state dict, so checkpoints carry it. None if this rank has none."""
    for module in model.modules():
        for kernel in getattr(module, "proactive_kernels", ()):  # a proactive sharded EBC
            return int(kernel.store.step)
    return None


def restore_param_groups(current: List[Dict[str, Any]], saved_ranks: Sequence[Sequence[Dict[str, Any]]],
                         keep: Sequence[str] = ()) -> List[Dict[str, Any]]:
    """The live optimizer's param groups (which name this rank's parameters) with the
    hyper-parameters of the saved group holding the same parameters on any saved rank, except
    those named in ``keep`` (e.g. ``lr``: a resumed run may set a new rate); a group no saved
    rank held keeps its own."""
    by_param: Dict[str, Dict[str, Any]] = {}
    for groups in saved_ranks:
        for group in groups:
            for name in group.get("params", []):
                by_param.setdefault(str(name), group)
    out = []
    for group in current:
        match = next((by_param[str(p)] for p in group["params"] if str(p) in by_param), None)
        out.append(group if match is None else {**{k: v for k, v in match.items() if k != "params"},
                                                **{k: group[k] for k in keep if k in group},
                                                "params": group["params"]})
    return out
