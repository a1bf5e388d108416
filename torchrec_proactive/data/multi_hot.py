"""MLPerf DLRM-v2's multi-hot Criteo (``day_{i}_sparse_multi_hot.npz``), memory-mapped.

MLPerf's ``materialize_synthetic_multihot_dataset.py`` turns each one-hot id of the 1TB
set into ``multi_hot_sizes[f]`` ids of feature ``f`` and saves, per day, an uncompressed
``np.savez`` archive with one ``[rows, multi_hot_sizes[f]]`` member per feature (``"0"`` ..
``"25"``); dense features and labels stay in ``day_{i}_{dense,labels}.npy``. The members are
memory-mapped where they lie in the archive, so a 143 GB day is never loaded.

Batches are ``torchrec.datasets.utils.Batch`` with a KeyedJaggedTensor whose feature ``f``
has ``multi_hot_sizes[f]`` ids per sample, cut and shared out over ranks exactly as
TorchRec's ``InMemoryBinaryCriteoIterDataPipe`` does for one-hot files.
"""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path
from typing import Iterator, List, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import IterableDataset
from torchrec.datasets.criteo import CAT_FEATURE_COUNT, DEFAULT_CAT_NAMES
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from .npy_files import CriteoFormatError, first_bad

MULTI_HOT_SUFFIX = "_sparse_multi_hot.npz"
#: MLPerf Training DLRM-v2's ``--multi_hot_sizes``.
MLPERF_MULTI_HOT_SIZES: Tuple[int, ...] = (
    3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1,
)  # fmt: skip
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # zip local file header: signature .. name and extra lengths


def npz_member(path: Path, key: str) -> np.ndarray:
    """Member ``key`` of an uncompressed ``.npz`` (``np.savez``), memory-mapped copy-on-write.

    Raises ``ValueError`` naming the file when the member is missing or compressed
    (``np.savez_compressed`` archives cannot be mapped)."""
    with zipfile.ZipFile(path) as archive:
        try:
            info = archive.getinfo(f"{key}.npy")
        except KeyError:
            raise ValueError(f"{path} has no member {key}.npy (MLPerf's multi-hot files hold 0.npy .. "
                             f"{CAT_FEATURE_COUNT - 1}.npy)") from None
        if info.compress_type != zipfile.ZIP_STORED:
            raise ValueError(f"{path}: {key}.npy is compressed; multi-hot files must be written with np.savez "
                             "(as MLPerf's script does) to be memory-mapped")
    with open(path, "rb") as fh:
        fh.seek(info.header_offset)
        signature, name_len, extra_len = _LOCAL_HEADER.unpack(fh.read(_LOCAL_HEADER.size))
        if signature != b"PK\x03\x04":
            raise ValueError(f"{path}: {key}.npy has no zip local header where the directory says")
        fh.seek(info.header_offset + _LOCAL_HEADER.size + name_len + extra_len)
        version = np.lib.format.read_magic(fh)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read_header(fh)
        offset = fh.tell()
    return np.memmap(path, dtype=dtype, mode="c", offset=offset, shape=shape, order="F" if fortran else "C")


def multi_hot_sizes(path: Path) -> Tuple[int, Tuple[int, ...]]:
    """``(rows, ids per sample of each feature)`` of one multi-hot file (headers only)."""
    members = [npz_member(path, str(f)) for f in range(CAT_FEATURE_COUNT)]
    rows = {m.shape[0] for m in members}
    if len(rows) != 1 or any(m.ndim != 2 for m in members):
        raise ValueError(f"{path}: members of shapes {[m.shape for m in members]}; expected [rows, ids per sample]")
    return rows.pop(), tuple(int(m.shape[1]) for m in members)


class _Rows:
    """Rows ``[start, stop)`` of the concatenation of several arrays' row ranges."""

    def __init__(self, parts: Sequence[np.ndarray]) -> None:
        self.parts = list(parts)
        self.starts = np.cumsum([0] + [len(p) for p in self.parts])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def take(self, start: int, stop: int) -> np.ndarray:
        pieces = []
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        for i in range(first, len(self.parts)):
            lo, hi = max(start, self.starts[i]), min(stop, self.starts[i + 1])
            if lo >= hi:
                break
            pieces.append(self.parts[i][lo - self.starts[i]: hi - self.starts[i]])
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


class MultiHotCriteoPipe(IterableDataset):
    """Batches of multi-hot Criteo from row ranges of memory-mapped files.

    ``dense`` / ``labels`` are per-part arrays; ``sparse`` per part, one array per feature.
    Batch ``k`` of the concatenated rows goes to rank ``k % world_size``; ``full`` and
    ``last`` come from :func:`~torchrec_proactive.data.criteo.batch_counts` (TorchRec's split)."""

    def __init__(self, dense: Sequence[np.ndarray], sparse: Sequence[Sequence[np.ndarray]],
                 labels: Sequence[np.ndarray], batch_size: int, rank: int, world_size: int, full: int,
                 last: np.ndarray, shuffle_batches: bool,
                 label_files: Sequence[Tuple[Path, int]] = ()) -> None:
        self.dense, self.labels = _Rows(dense), _Rows(labels)
        # (file, its first row) of each labels part: names a bad label's file and row
        self.label_files = list(label_files)
        self.sparse = [_Rows([s[f] for s in sparse]) for f in range(CAT_FEATURE_COUNT)]
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.full, self.last, self.shuffle_batches = full, last, shuffle_batches

    def __len__(self) -> int:
        return self.full // self.world_size + int(self.last[0] > 0)

    def _ranges(self) -> Iterator[Tuple[int, int]]:
        b = self.batch_size
        for k in range(self.rank, self.full, self.world_size):
            yield k * b, (k + 1) * b
        if self.last[0] > 0:
            start = self.full * b + int(self.last[: self.rank].sum())
            yield start, start + int(self.last[self.rank])

    def __iter__(self) -> Iterator[Batch]:
        for start, stop in self._ranges():
            dense, labels = self.dense.take(start, stop), self.labels.take(start, stop)
            bad = first_bad(labels, 0, 1)  # on the rows just read: two reductions
            if bad is not None:
                raise CriteoFormatError(f"{self._where(start + bad)}: label={labels.flat[bad]} is invalid: "
                                        "must be 0 or 1")
            ids = [s.take(start, stop) for s in self.sparse]
            if self.shuffle_batches:  # TorchRec's within-batch shuffle, from numpy's global RNG
                order = np.random.permutation(stop - start)
                dense, labels, ids = dense[order], labels[order], [i[order] for i in ids]
            yield self._batch(dense, ids, labels)

    def _where(self, row: int) -> str:
        part = int(np.searchsorted(self.labels.starts, row, side="right")) - 1
        if part >= len(self.label_files):
            return f"labels row {row} of the split"
        path, first = self.label_files[part]
        return f"{path}, row {first + row - int(self.labels.starts[part])}"

    @staticmethod
    def _batch(dense: np.ndarray, ids: List[np.ndarray], labels: np.ndarray) -> Batch:
        rows = len(dense)
        lengths = np.repeat(np.array([i.shape[1] for i in ids], dtype=np.int32), rows)
        values = np.concatenate([i.reshape(-1) for i in ids]).astype(np.int64, copy=False)
        return Batch(
            dense_features=torch.from_numpy(np.ascontiguousarray(dense)),
            sparse_features=KeyedJaggedTensor(keys=list(DEFAULT_CAT_NAMES), values=torch.from_numpy(values),
                                              lengths=torch.from_numpy(lengths), stride=rows),
            labels=torch.from_numpy(np.ascontiguousarray(labels).reshape(-1)),
        )
