"""TorchRec's Criteo ``.npy`` arrays on disk: which files a data root holds, and checks of
each array that read only its header.

NumPy only (no torch, no TorchRec), so the launching process runs these checks before any
rank starts: a truncated file, a wrong dtype or a missing day is one line naming the file
(or the config key) instead of a traceback from every rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple, Union

import numpy as np

PathLike = Union[str, Path]

NUM_DENSE = 13  # Criteo's integer features (TorchRec's INT_FEATURE_COUNT)
NUM_SPARSE = 26  # Criteo's categorical features (TorchRec's CAT_FEATURE_COUNT)
CONTIG_SUFFIX = "_contig_freq.npy"  # what TorchRec's sparse_to_contiguous appends


class CriteoFormatError(ValueError):
    """Criteo data that is not in the format TorchRec's tools write (a malformed TSV row, a
    truncated or mistyped ``.npy`` array, a label outside {0, 1}); the message is one line
    naming the file and the value. ``user_error``: the CLI prints it as one line with exit
    code 2 (see ``torchrec_proactive.app.errors``)."""

    user_error = True


@dataclass(frozen=True)
class NpyHeader:
    shape: Tuple[int, ...]
    dtype: np.dtype
    offset: int  # where the data starts


def read_header(path: PathLike) -> NpyHeader:
    """The header of an ``.npy`` file (NumPy's own reader); a file NumPy cannot parse is a
    :class:`CriteoFormatError` naming it."""
    try:
        with open(path, "rb") as fh:
            version = np.lib.format.read_magic(fh)
            reader = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                      else np.lib.format.read_array_header_2_0)
            shape, _fortran, dtype = reader(fh)
            return NpyHeader(tuple(int(s) for s in shape), np.dtype(dtype), fh.tell())
    except ValueError as e:
        raise CriteoFormatError(f"{path} is not a readable .npy array ({str(e).splitlines()[0]})") from None


# What TorchRec's tsv_to_npys writes: dense float32 log counts, int32 labels, integer ids.
_DTYPES = {"dense": "float32", "labels": "int32", "sparse": "an integer type"}


def check_array(path: PathLike, kind: str, columns: int) -> int:
    """Checks one array of ``kind`` (``dense``, ``labels``, ``sparse``) from its header and
    the file size; returns its row count. Invariant on return: the file holds all the
    ``[rows, columns]`` elements its header announces, in the dtype TorchRec writes."""
    head = read_header(path)
    if kind == "sparse":
        dtype_ok = np.issubdtype(head.dtype, np.integer)
    else:
        dtype_ok = head.dtype == np.dtype(_DTYPES[kind])
    if not dtype_ok:
        raise CriteoFormatError(
            f"{path}: dtype {head.dtype} is invalid: TorchRec's {kind} arrays are {_DTYPES[kind]} "
            f"(convert with np.save(path, array.astype(...)))")
    if len(head.shape) != 2 or head.shape[1] != columns:
        raise CriteoFormatError(f"{path}: shape {head.shape} is invalid: TorchRec's {kind} arrays are "
                                f"[rows, {columns}]")
    need = head.offset + int(np.prod(head.shape)) * head.dtype.itemsize
    size = Path(path).stat().st_size
    if size < need:
        raise CriteoFormatError(
            f"{path} is truncated: {size} bytes, its header announces {head.shape} {head.dtype} = {need} bytes; "
            f"copy or regenerate the file")
    return head.shape[0]


def torchrec_file_names(layout: str, num_days: int) -> List[str]:
    """The prefixes TorchRec's preprocessing gives each file: ``train`` (Kaggle) or
    ``day_0`` .. ``day_{num_days-1}`` (1TB)."""
    return ["train"] if layout == "kaggle" else [f"day_{d}" for d in range(num_days)]


@dataclass(frozen=True)
class TorchRecFiles:
    """One complete set of TorchRec's one-hot arrays (``raw``: ``<p>_sparse.npy`` holds raw
    hashes; else ``<p>_sparse_contig_freq.npy`` holds contiguous ids)."""

    names: Tuple[str, ...]
    dense: Tuple[Path, ...]
    sparse: Tuple[Path, ...]
    labels: Tuple[Path, ...]
    raw: bool


def find_torchrec_files(root: PathLike, layout: str, num_days: int) -> Optional[TorchRecFiles]:
    """The complete set of TorchRec's files for ``layout`` in ``root`` (contiguous ids
    preferred to raw hashes), or ``None``. Looks at names only."""
    root = Path(root)
    names = torchrec_file_names(layout, num_days)
    dense = tuple(root / f"{n}_dense.npy" for n in names)
    labels = tuple(root / f"{n}_labels.npy" for n in names)
    if not all(p.is_file() for p in dense + labels):
        return None
    for raw, suffix in ((False, f"_sparse{CONTIG_SUFFIX}"), (True, "_sparse.npy")):
        sparse = tuple(root / f"{n}{suffix}" for n in names)
        if all(p.is_file() for p in sparse):
            return TorchRecFiles(tuple(names), dense, sparse, labels, raw)
    return None


def check_torchrec_files(files: TorchRecFiles, multi_hot: bool = False) -> List[int]:
    """Header checks of every array of ``files`` (``multi_hot``: dense and labels only, the
    sparse side being MLPerf's archives); returns the rows per file. Raises
    :class:`CriteoFormatError` naming the file for a wrong dtype, a truncated file, or files
    of one day that disagree on their row count."""
    rows = []
    for name, d, s, l in zip(files.names, files.dense, files.sparse, files.labels):
        counts = {d: check_array(d, "dense", NUM_DENSE), l: check_array(l, "labels", 1)}
        if not multi_hot:
            counts[s] = check_array(s, "sparse", NUM_SPARSE)
        if len(set(counts.values())) != 1:
            shown = ", ".join(f"{p.name}: {n}" for p, n in counts.items())
            raise CriteoFormatError(f"{Path(d).parent}: the files of {name} disagree on their rows ({shown})")
        rows.append(counts[d])
    return rows


def describe_missing(root: PathLike, layout: str, num_days: int) -> Optional[str]:
    """What is wrong with a ``data.root`` that holds part of a Criteo data set, in config
    words, or ``None`` when it holds no Criteo file at all (TSVs or TorchRec arrays)."""
    root = Path(root)
    if not root.is_dir():
        return None
    present = {p.name for p in root.iterdir()}
    if layout == "terabyte":
        days = sorted({int(m.group(1)) for n in present for m in [re.match(r"day_(\d+)(?:_|$)", n)] if m})
        wanted = set(range(num_days))
        have = [d for d in days if d in wanted]
        if have and len(have) < num_days:
            shown = ", ".join(f"day_{d}" for d in have[:4]) + (" ..." if len(have) > 4 else "")
            return (f"data.num_days={num_days} needs day_0 .. day_{num_days - 1}, data.root={str(root)!r} holds "
                    f"{len(have)} of them ({shown}): set data.num_days={len(have)} if those are day_0 .. "
                    f"day_{len(have) - 1}, or add the missing days")
    names = torchrec_file_names(layout, num_days)
    sparse = [n for n in sorted(present) for p in names
              if n in (f"{p}_sparse{CONTIG_SUFFIX}", f"{p}_sparse.npy")]
    if sparse:
        need = [f"{p}_{kind}.npy" for p in names for kind in ("dense", "labels") if f"{p}_{kind}.npy" not in present]
        if need:
            return (f"data.root={str(root)!r}: found sparse files ({', '.join(sparse[:2])}"
                    f"{' ...' if len(sparse) > 2 else ''}) but not {', '.join(need[:2])}"
                    f"{' ...' if len(need) > 2 else ''}: put the dense and label files beside them "
                    f"(TorchRec's npy_preproc_criteo.py writes all three)")
    return None


def first_bad(values: np.ndarray, low: int, high: Optional[int]) -> Optional[int]:
    """Flat index of the first element of ``values`` outside ``[low, high]`` (no upper limit
    when ``high`` is None), else ``None``. Two reductions over the batch in the usual case."""
    if values.size == 0 or (values.min() >= low and (high is None or values.max() <= high)):
        return None
    bad = values < low if high is None else (values < low) | (values > high)
    return int(np.flatnonzero(bad)[0])

