"""Reading ``torch.distributed.checkpoint`` (DCP) directories without trusting them.

DCP's ``.metadata`` is a pickle, and stock ``dcp.load`` unpickles it as it is: a crafted
file runs code. :class:`SafeFileSystemReader` (a drop-in ``storage_reader``) and
:func:`load_checkpoint` (a drop-in for ``dcp.load``) read it with an unpickler that admits
only DCP's own metadata classes, check its structure, and refuse any storage entry whose
``relative_path`` leaves the checkpoint directory (an absolute path, ``..``, or a link
pointing out of it). DCP reads the tensors themselves with ``weights_only=True``.

    from torchrec_proactive.checkpoint import load_checkpoint
    load_checkpoint(state, "outputs/run/checkpoint")   # instead of dcp.load(state, checkpoint_id=...)

Everything refused raises :class:`CheckpointReadError` (a ``ValueError``) with a one-line
message naming the file. :func:`file_digest` is the per-file checksum the trainer app
records in its manifests. Needs torch, not TorchRec.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from pathlib import Path
from typing import Any, Dict, Optional, Union

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo

__all__ = ["CheckpointReadError", "SafeFileSystemReader", "load_checkpoint", "file_digest", "METADATA"]

METADATA = ".metadata"  # DCP's file name for the global metadata


class CheckpointReadError(ValueError):
    """A checkpoint directory that is not a tensor checkpoint DCP wrote, or whose files point
    outside it. ``user_error``: the CLI reports it as one line (exit 2), not a traceback."""

    user_error = True


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


def file_digest(path: Union[str, Path], chunk_bytes: int = 1 << 20) -> str:
    """SHA-256 (hex) of a file's bytes, read in chunks (memory stays bounded). SHA-256, not
    BLAKE2b: on CPUs with SHA extensions (x86 since about 2017, ARMv8) it is the faster one."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(chunk_bytes), b""):
            digest.update(chunk)
    return digest.hexdigest()


def confined(directory: Union[str, Path], relative: Any) -> Path:
    """``directory / relative`` if it names a file inside ``directory`` (links resolved),
    else :class:`CheckpointReadError`. Absolute paths and ``..`` are refused outright."""
    if not isinstance(relative, str) or not relative or "\0" in relative:
        raise CheckpointReadError(f"{directory}: names a file {relative!r}, which is not a file name; "
                                  f"refusing to load it")
    if os.path.isabs(relative) or ".." in Path(relative).parts:
        raise CheckpointReadError(f"{directory}: names the file {relative!r}, outside the checkpoint directory "
                                  f"(every file a checkpoint names must be inside it); refusing to load it")
    target = Path(directory) / relative
    root = os.path.realpath(directory)
    if os.path.commonpath([root, os.path.realpath(target)]) != root:
        raise CheckpointReadError(f"{target}: links outside the checkpoint directory {directory}; refusing to load it")
    return target


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_tensor_entry(fqn: Any, md: Any) -> Optional[str]:
    """Why ``md`` is not a well-formed tensor entry, or None."""
    if not isinstance(fqn, str):
        return f"a key {fqn!r} that is not a name"
    if not isinstance(md, dcp_metadata.TensorStorageMetadata):
        return f"{fqn!r} holds pickled objects, not tensors"
    props, size, chunks = getattr(md, "properties", None), getattr(md, "size", None), getattr(md, "chunks", None)
    if not isinstance(getattr(props, "dtype", None), torch.dtype):
        return f"{fqn!r} has no tensor dtype"
    if not isinstance(size, (tuple, list)) or not all(_is_int(n) for n in size):
        return f"{fqn!r} has the size {size!r}"
    if not isinstance(chunks, (list, tuple)):
        return f"{fqn!r} has the chunks {chunks!r}"
    for chunk in chunks:
        offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
        if (not isinstance(chunk, dcp_metadata.ChunkStorageMetadata) or not isinstance(offsets, (tuple, list))
                or not isinstance(sizes, (tuple, list)) or len(offsets) != len(size) or len(sizes) != len(size)
                or not all(_is_int(n) for n in (*offsets, *sizes))
                or any(o + s > n for o, s, n in zip(offsets, sizes, size))):
            return f"{fqn!r} has a chunk {chunk!r} that does not fit its size {tuple(size)}"
    return None


def check_metadata(metadata: Any, directory: Union[str, Path], where: Any) -> dcp_metadata.Metadata:
    """``metadata`` if it is DCP metadata of tensors only, every storage entry a confined
    file name with a non-negative offset and length; else :class:`CheckpointReadError`."""
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointReadError(f"{where}: not a DCP metadata file; refusing to load it")
    tensors, storage = getattr(metadata, "state_dict_metadata", None), getattr(metadata, "storage_data", None)
    if not isinstance(tensors, dict):
        raise CheckpointReadError(f"{where}: its state_dict_metadata is a {type(tensors).__name__}, not a mapping of "
                                  f"tensor names; refusing to load it")
    problems = [p for p in (_check_tensor_entry(k, v) for k, v in tensors.items()) if p]
    if problems:
        raise CheckpointReadError(f"{where}: {problems[0]} ({len(problems)} such entries); refusing to load it")
    if not isinstance(storage, dict):
        raise CheckpointReadError(f"{where}: its storage_data is a {type(storage).__name__}, not a mapping of "
                                  f"storage entries; refusing to load it")
    for index, info in storage.items():
        if not isinstance(index, dcp_metadata.MetadataIndex) or not isinstance(info, _StorageInfo):
            raise CheckpointReadError(f"{where}: a storage entry {index!r} is not DCP's; refusing to load it")
        confined(directory, getattr(info, "relative_path", None))
        if not _is_int(getattr(info, "offset", None)) or not _is_int(getattr(info, "length", None)):
            raise CheckpointReadError(f"{where}: the storage entry of {index.fqn!r} has offset "
                                      f"{getattr(info, 'offset', None)!r}, length {getattr(info, 'length', None)!r}; "
                                      f"refusing to load it")
        descriptors = getattr(info, "transform_descriptors", None)
        if descriptors is not None and not (isinstance(descriptors, (list, tuple))
                                            and all(isinstance(d, str) for d in descriptors)):
            raise CheckpointReadError(f"{where}: the storage entry of {index.fqn!r} has transforms {descriptors!r}; "
                                      f"refusing to load it")
    if getattr(metadata, "planner_data", None) is not None and not isinstance(metadata.planner_data, dict):
        raise CheckpointReadError(f"{where}: its planner_data is a {type(metadata.planner_data).__name__}; "
                                  f"refusing to load it")
    return metadata


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader, except that ``.metadata`` is unpickled with an allow-list and
    checked (:func:`check_metadata`): a checkpoint that stores pickled objects instead of
    tensors, or names files outside its directory, is refused."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as fh:
                metadata = _MetadataUnpickler(fh).load()
        except FileNotFoundError:
            raise CheckpointReadError(f"{path}: missing, so this is not a complete checkpoint; refusing to load it") \
                from None
        except Exception as err:  # truncated, flipped or crafted bytes: whatever pickle trips on
            raise CheckpointReadError(f"{path}: not a tensor checkpoint's metadata ({type(err).__name__}: "
                                      f"{str(err).splitlines()[0][:120] if str(err) else 'empty'}); refusing to load "
                                      f"it") from None
        metadata = check_metadata(metadata, self.path, path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def load_checkpoint(state_dict: Dict[str, Any], checkpoint_id: Union[str, Path]) -> None:
    """``dcp.load(state_dict, checkpoint_id=...)`` through :class:`SafeFileSystemReader`:
    collective, loads in place (``ShardedTensor`` entries get this rank's rows, whatever world
    size saved them). Raises :class:`CheckpointReadError` for a directory it must not read."""
    reader = SafeFileSystemReader(str(checkpoint_id))
    reader.read_metadata()  # refused here, as itself: inside dcp.load it would come wrapped per rank
    dcp.load(state_dict, storage_reader=reader)
