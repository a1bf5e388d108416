"""Criteo preprocessing and loading built on TorchRec's own ``torchrec.datasets.criteo``.

Pipeline: TSV -> ``BinaryCriteoUtils.tsv_to_npys`` (per file: dense float32 log counts,
raw int64 hashes, labels) -> ``BinaryCriteoUtils.sparse_to_contiguous`` (all files at once:
hashes -> contiguous ids) -> ``InMemoryBinaryCriteoIterDataPipe`` (batches of
``torchrec.datasets.utils.Batch``).

Traps in TorchRec's utilities that this module works around (see also the comments at
each call site):

* ``tsv_to_npys`` decides that a file is the unlabeled Kaggle test set when
  ``dataset_name == "criteo_kaggle"`` and the string ``"test"`` occurs anywhere in the
  *path* - including directories such as pytest's ``/tmp/pytest-of-u/.../test_x0``. It then
  reads the label column as I1 and writes labels of -1. We always pass
  ``dataset_name="criteo_1tb"`` (identical parsing for labeled files, no path heuristic) and
  check afterwards that every label is 0 or 1, so such a mistake cannot pass silently.
* ``tsv_to_npys`` subtracts the minimum integer of the *whole file* before the log, so the
  dense transform differs between files whose minimum differs (real Criteo has negative
  values in I2). The synthetic generator pins the minimum of every file to 0.
* ``sparse_to_contiguous`` names its outputs ``basename.split(".")[0] + suffix`` and keys
  its inputs by that name, so two inputs whose names agree up to the first dot silently
  overwrite each other. We give intermediate files unique, dot-free names.
* ``BinaryCriteoUtils.shuffle`` reads ``day_{d}_sparse.npy`` while ``sparse_to_contiguous``
  writes ``day_{d}_sparse_contig_freq.npy``; and it goes through a float32 matrix and writes
  int32, so running it on raw 32-bit hashes (i.e. before the contiguous step) corrupts them.
  We never call it: order within the training split is kept and ``shuffle_batches`` is
  TorchRec's within-batch shuffle.
* ``InMemoryBinaryCriteoIterDataPipe`` with ``stage="val"``/``"test"`` halves the *first*
  file it is given, and the reference DLRM setup evaluates on the last day, which it also
  trains on. We always use ``stage="train"`` and hand it disjoint row ranges instead.
* ``InMemoryBinaryCriteoIterDataPipe.__init__`` calls ``np.random.seed(0)`` (global state);
  we restore the caller's global NumPy RNG state right after constructing it.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
from torchrec.datasets.criteo import (
    CAT_FEATURE_COUNT,
    FREQUENCY_THRESHOLD,
    INT_FEATURE_COUNT,
    BinaryCriteoUtils,
    InMemoryBinaryCriteoIterDataPipe,
)
from torch.utils.data import IterableDataset
from tqdm import tqdm

from .npy_files import (
    CriteoFormatError,
    check_array,
    check_torchrec_files,
    find_torchrec_files,
    first_bad,
    torchrec_file_names,
)

PathLike = Union[str, Path]
_LOG = logging.getLogger(__name__)

_MANIFEST = PREPROCESS_MANIFEST = "manifest.json"  # written last by preprocess(): its output is complete
_MANIFEST_VERSION = 2  # 2: TorchRec's file names and int32 labels
# sparse_to_contiguous appends this to basename.split(".")[0] of each input.
_CONTIG_SUFFIX = "_contig_freq.npy"
_KINDS = ("dense", "sparse", "labels")


# Criteo's column names (the TSV has no header): the label, I1..I13, C1..C26.
FIELD_NAMES = ("label", *(f"I{i}" for i in range(1, INT_FEATURE_COUNT + 1)),
               *(f"C{i}" for i in range(1, CAT_FEATURE_COUNT + 1)))
_INT32 = (-(2**31), 2**31 - 1)


def _bad_field(fields: Sequence[str]) -> Optional[Tuple[str, str, str]]:
    """``(field, value, what is wrong)`` for the first field of one TSV row that TorchRec's
    parser cannot take (``tsv_to_npys``: integer label and counts, int32 counts, hex ids;
    empty counts and ids are missing values), else ``None``."""
    if len(fields) != len(FIELD_NAMES):
        shown = "\t".join(fields)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        return ("row", shown, f"has {len(fields)} tab-separated fields, Criteo rows have {len(FIELD_NAMES)} "
                "(label, 13 integers, 26 hex ids)")
    label = fields[0]
    if label not in ("0", "1"):
        return ("label", label, "must be 0 or 1 (only labeled Criteo files are supported)")
    for name, value in zip(FIELD_NAMES[1:1 + INT_FEATURE_COUNT], fields[1:1 + INT_FEATURE_COUNT]):
        if value == "":
            continue
        try:
            number = int(value)
        except ValueError:
            return (name, value, "is not an integer")
        if not _INT32[0] <= number <= _INT32[1]:
            return (name, value, f"is outside int32 [{_INT32[0]}, {_INT32[1]}]")
    for name, value in zip(FIELD_NAMES[1 + INT_FEATURE_COUNT:], fields[1 + INT_FEATURE_COUNT:]):
        if value == "":
            continue
        try:
            int(value, 16)
        except ValueError:
            return (name, value, "is not a hexadecimal id")
    return None


def find_format_error(tsv: PathLike) -> Optional[str]:
    """The one-line description of the first malformed row of ``tsv`` (file, line number,
    field, value), or ``None`` if every row parses. Reads the file once, in text."""
    with open(tsv, "r", newline="") as fh:
        for number, line in enumerate(fh, start=1):
            bad = _bad_field(line.rstrip("\r\n").split("\t"))
            if bad is not None:
                field, value, why = bad
                return f"{tsv}, line {number}: {field}={value!r} {why}" if field != "row" else \
                    f"{tsv}, line {number}: the row {why}: {value!r}"
    return None


@dataclass(frozen=True)
class PreprocessedCriteo:
    """Binary Criteo in TorchRec's layout, ready for ``make_dataloaders``; one entry per
    day (or Kaggle's one ``train`` file), in order.

    Invariants: for file ``i``, ``dense_paths[i]`` holds float32 ``[num_samples[i], 13]``
    (``log(count - file_min + 2)``), ``sparse_paths[i]`` ``[num_samples[i], 26]`` integer
    ids, ``labels_paths[i]`` int32 ``[num_samples[i], 1]`` in {0, 1} - what TorchRec's
    ``tsv_to_npys`` writes. Without ``hashes`` the ids are contiguous (``sparse_to_contiguous``):
    ``0 < id < cardinalities[f]`` in column ``f`` (1 = ids seen fewer than
    ``frequency_threshold`` times) and consistent across files. With ``hashes`` they are
    taken modulo ``hashes[f]`` (= ``cardinalities[f]``) as batches are made, as TorchRec's
    reference trainer does (raw Criteo hashes, or ids for tables set smaller).
    """

    out_dir: Path
    names: Tuple[str, ...]
    dense_paths: Tuple[Path, ...]
    sparse_paths: Tuple[Path, ...]
    labels_paths: Tuple[Path, ...]
    cardinalities: Tuple[int, ...]
    num_samples: Tuple[int, ...]
    hashes: Optional[Tuple[int, ...]] = None
    multi_hot_sizes: Optional[Tuple[int, ...]] = None
    """Set for MLPerf DLRM-v2's multi-hot files: ``sparse_paths`` are ``.npz`` archives with
    ``multi_hot_sizes[f]`` ids per sample of feature ``f`` (see :mod:`.multi_hot`)."""

    @property
    def total_samples(self) -> int:
        return sum(self.num_samples)


def _file_tags(paths: Sequence[Path]) -> List[str]:
    """Prefixes of the npy files of each input: TorchRec's own names for Criteo's files
    (``train.txt`` -> ``train_*.npy``, ``day_3`` -> ``day_3_*.npy``, so TorchRec's reference
    trainer reads our output), else a unique, dot-free name (see the naming trap)."""
    criteo = [p.name[: -len(".txt")] if p.name == "train.txt" else p.name for p in paths]
    if all(re.fullmatch(r"train|day_\d+", n) for n in criteo) and len(set(criteo)) == len(criteo):
        return criteo
    return [f"{i:02d}_{re.sub(r'[^A-Za-z0-9_-]', '_', p.name)}" for i, p in enumerate(paths)]


def _input_fingerprint(paths: Sequence[Path]) -> List[Dict[str, object]]:
    return [{"path": str(p), "size": p.stat().st_size} for p in paths]


def _outputs_for(out_dir: Path, tag: str) -> Dict[str, Path]:
    return {
        "dense": out_dir / f"{tag}_dense.npy",
        "raw_sparse": out_dir / f"{tag}_sparse.npy",
        "labels": out_dir / f"{tag}_labels.npy",
        "sparse": out_dir / (f"{tag}_sparse".split(".")[0] + _CONTIG_SUFFIX),
    }


def _load_if_fresh(
    out_dir: Path, inputs: Sequence[Path], tags: Sequence[str], frequency_threshold: int
) -> Optional[PreprocessedCriteo]:
    """Returns the previous result when its manifest matches these inputs and settings and
    every output exists and is at least as new as every input; otherwise None."""
    manifest_path = out_dir / _MANIFEST
    if not manifest_path.exists():
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        return None
    if (
        manifest.get("version") != _MANIFEST_VERSION
        or manifest.get("inputs") != _input_fingerprint(inputs)
        or manifest.get("frequency_threshold") != frequency_threshold
    ):
        return None
    newest_input = max(p.stat().st_mtime_ns for p in inputs)
    outputs = [_outputs_for(out_dir, t) for t in tags]
    for files in outputs:
        for kind in _KINDS:
            p = files[kind]
            if not p.exists() or p.stat().st_mtime_ns < newest_input:
                return None
    return _result(out_dir, tags, manifest["cardinalities"], manifest["num_samples"])


def _result(
    out_dir: Path, tags: Sequence[str], cardinalities: Sequence[int], num_samples: Sequence[int]
) -> PreprocessedCriteo:
    outputs = [_outputs_for(out_dir, t) for t in tags]
    return PreprocessedCriteo(
        out_dir=out_dir,
        names=tuple(tags),
        dense_paths=tuple(o["dense"] for o in outputs),
        sparse_paths=tuple(o["sparse"] for o in outputs),
        labels_paths=tuple(o["labels"] for o in outputs),
        cardinalities=tuple(int(c) for c in cardinalities),
        num_samples=tuple(int(n) for n in num_samples),
    )


def _tsv_to_npys(tsv: Path, files: Dict[str, Path]) -> int:
    """Runs TorchRec's parser on one labeled TSV (its output, as it is); checks the shapes
    and the labels. Returns the row count."""
    if tsv.stat().st_size == 0:
        raise CriteoFormatError(f"{tsv} is empty: a Criteo file needs at least one row")
    # "criteo_1tb" rather than "criteo_kaggle": same parsing of labeled rows, and it
    # disables the '"test" in path' switch to unlabeled parsing (see module docstring).
    try:
        BinaryCriteoUtils.tsv_to_npys(
            str(tsv),
            str(files["dense"]),
            str(files["raw_sparse"]),
            str(files["labels"]),
            dataset_name="criteo_1tb",
        )
    except Exception as e:  # TorchRec's datapipes report a malformed row without file or line
        found = find_format_error(tsv)
        if found is None:
            raise
        raise CriteoFormatError(found) from e
    labels = np.load(files["labels"])
    dense_shape = BinaryCriteoUtils.get_shape_from_npy(str(files["dense"]))
    sparse_shape = BinaryCriteoUtils.get_shape_from_npy(str(files["raw_sparse"]))
    rows = labels.shape[0]
    if dense_shape != (rows, INT_FEATURE_COUNT) or sparse_shape != (rows, CAT_FEATURE_COUNT):
        raise ValueError(
            f"{tsv}: unexpected shapes dense={dense_shape} sparse={sparse_shape} for {rows} rows"
        )
    bad = ~np.isin(labels, (0, 1))
    if bad.any():  # TorchRec's parser takes any integer label
        raise CriteoFormatError(find_format_error(tsv) or (
            f"{tsv}: {int(bad.sum())} labels outside {{0, 1}} (first {int(labels[bad][0])}); "
            "only labeled Criteo files (label + 13 ints + 26 hashes per line) are supported"))
    return rows


def preprocess(
    tsv_files: Sequence[PathLike],
    out_dir: PathLike,
    progress: bool = True,
    *,
    frequency_threshold: int = FREQUENCY_THRESHOLD,
    log: Optional[logging.Logger] = None,
) -> PreprocessedCriteo:
    """Converts labeled Criteo TSV files to binary npy files with contiguous ids.

    All files are re-indexed together (ids must agree across days), so the vocabulary is
    built from every file, including rows that ``make_dataloaders`` later holds out for
    evaluation - as in TorchRec's reference preprocessing; labels are never used for it.
    Ids seen fewer than ``frequency_threshold`` times in total map to 1.

    Work is skipped when ``out_dir`` holds a manifest for the same inputs (paths and sizes)
    and threshold and every output is at least as new as every input; ``log`` says which.
    A malformed file raises :class:`CriteoFormatError` (file, line, field, value) and
    leaves no output of this call behind. Not safe to run concurrently on one ``out_dir``:
    run it on one rank and barrier.
    """
    log = log or _LOG
    inputs = [Path(p).resolve() for p in tsv_files]
    if not inputs:
        raise ValueError("tsv_files is empty: need at least one Criteo TSV file")
    for p in inputs:
        if not p.is_file():
            raise ValueError(f"Criteo TSV file {p} does not exist")
    if frequency_threshold < 0:
        raise ValueError(f"frequency_threshold={frequency_threshold} is invalid: must be >= 0")
    out = Path(out_dir).resolve()
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    tags = _file_tags(inputs)

    cached = _load_if_fresh(out, inputs, tags, frequency_threshold)
    if cached is not None:
        log.info("preprocessing: reusing %s (%d rows; its manifest matches the %d input file(s) and "
                 "frequency_threshold=%d)", out, cached.total_samples, len(inputs), frequency_threshold)
        return cached
    (out / _MANIFEST).unlink(missing_ok=True)  # the manifest marks completion: drop it first
    log.info("preprocessing %d Criteo TSV file(s) (%s) into %s: TorchRec's tsv_to_npys, then "
             "sparse_to_contiguous with frequency_threshold=%d", len(inputs), _names(inputs), out,
             frequency_threshold)

    outputs = [_outputs_for(out, t) for t in tags]
    try:
        result = _convert(inputs, outputs, out, tags, progress, frequency_threshold)
    except BaseException:
        # nothing half-written: this call's outputs go (the inputs are never touched)
        for files in outputs:
            for path in files.values():
                path.unlink(missing_ok=True)
        if created and not any(out.iterdir()):
            out.rmdir()
        raise
    log.info("preprocessing done: %d rows, %d tables (largest %d rows) in %s", result.total_samples,
             len(result.cardinalities), max(result.cardinalities), out)
    return result


def _names(paths: Sequence[Path]) -> str:
    return ", ".join(p.name for p in paths[:3]) + (f" .. {paths[-1].name}" if len(paths) > 3 else "")


def _convert(inputs: Sequence[Path], outputs: Sequence[Dict[str, Path]], out: Path, tags: Sequence[str],
             progress: bool, frequency_threshold: int) -> PreprocessedCriteo:
    num_samples = [
        _tsv_to_npys(tsv, files)
        for tsv, files in tqdm(
            list(zip(inputs, outputs)), desc="tsv -> npy", unit="file", disable=not progress
        )
    ]

    # sparse_to_contiguous is a pure-Python loop over every value (two passes), roughly
    # 1 s per 10^5 rows; it prints per column and file, which we hide unless progress, and
    # then send to stderr with the bars: stdout is for results (the CLI's final JSON line).
    quiet = contextlib.redirect_stdout(sys.stderr if progress else io.StringIO())
    with quiet:
        BinaryCriteoUtils.sparse_to_contiguous(
            [str(o["raw_sparse"]) for o in outputs],
            str(out),
            frequency_threshold=frequency_threshold,
            output_file_suffix=_CONTIG_SUFFIX,
        )
    cardinalities = _cardinalities([o["sparse"] for o in outputs])

    manifest = {
        "version": _MANIFEST_VERSION,
        "inputs": _input_fingerprint(inputs),
        "frequency_threshold": frequency_threshold,
        "tags": tags,
        "num_samples": num_samples,
        "cardinalities": cardinalities,
    }
    tmp = out / f".{_MANIFEST}.{os.getpid()}.partial"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out / _MANIFEST)
    return _result(out, tags, cardinalities, num_samples)


def _cardinalities(sparse_paths: Sequence[Path]) -> List[int]:
    """Embedding table sizes: max id + 1 per column over all files (ids start at 1 or 2,
    so row 0 - and row 1 without a frequency threshold - is allocated but never used)."""
    top = np.zeros(CAT_FEATURE_COUNT, dtype=np.int64)
    for p in sparse_paths:
        arr = np.load(p, mmap_mode="r")
        if len(arr):
            top = np.maximum(top, arr.max(axis=0))
    return [int(t) + 1 for t in np.maximum(top, 1)]


# ---------------------------------------------------------------------------------------
# TorchRec's binary layout, used in place


def open_torchrec_binary(
    directory: PathLike, layout: str, num_days: int = 24, log: Optional[logging.Logger] = None,
    multi_hot: bool = False,
) -> Optional[PreprocessedCriteo]:
    """The files TorchRec's Criteo preprocessing wrote in ``directory``, used where they
    are (memory-mapped, never copied or rewritten), or ``None`` if a file is missing.

    Per file prefix (:func:`torchrec_file_names`): ``<p>_dense.npy``, ``<p>_labels.npy`` and
    ``<p>_sparse_contig_freq.npy`` (contiguous ids: ``contiguous_preproc_criteo.py``, table
    sizes = largest id + 1) or else ``<p>_sparse.npy`` (raw hashes: ``npy_preproc_criteo.py``;
    taken modulo Criteo's per-feature cardinalities, the ``num_embeddings_per_feature`` of
    TorchRec's reference DLRM commands). Only the arrays' headers are read, plus one pass
    over contiguous ids for their table sizes.

    ``multi_hot``: the sparse features are MLPerf DLRM-v2's ``<p>_sparse_multi_hot.npz``
    instead (ids already hashed modulo the 1TB cardinalities, the tables' sizes).
    """
    from .criteo_synth import KAGGLE_CARDINALITIES, TERABYTE_CARDINALITIES

    log = log or _LOG
    root = Path(directory)
    if multi_hot:
        names = torchrec_file_names(layout, num_days)
        dense = [root / f"{n}_dense.npy" for n in names]
        labels = [root / f"{n}_labels.npy" for n in names]
        if not all(p.is_file() for p in dense + labels):
            return None
        return _open_multi_hot(root, names, dense, labels, log)
    files = find_torchrec_files(root, layout, num_days)
    if files is None:
        return None
    names, sparse = list(files.names), list(files.sparse)
    hashes = tuple(KAGGLE_CARDINALITIES if layout == "kaggle" else TERABYTE_CARDINALITIES) if files.raw else None
    num_samples = check_torchrec_files(files)  # dtypes, truncation, rows (headers only)
    dense, labels = list(files.dense), list(files.labels)
    if hashes is None:
        log.info("data: using TorchRec's preprocessed files in %s in place (%d file(s), %d rows, contiguous ids); "
                 "reading the ids once for the table sizes", root, len(names), sum(num_samples))
        cardinalities = _cardinalities(sparse)
    else:
        log.info("data: using TorchRec's preprocessed files in %s in place (%d file(s), %d rows, raw ids hashed "
                 "modulo Criteo's %s cardinalities)", root, len(names), sum(num_samples), layout)
        cardinalities = list(hashes)
    return PreprocessedCriteo(
        out_dir=root, names=tuple(names), dense_paths=tuple(dense), sparse_paths=tuple(sparse),
        labels_paths=tuple(labels), cardinalities=tuple(cardinalities), num_samples=tuple(num_samples),
        hashes=hashes,
    )


def _open_multi_hot(root: Path, names: Sequence[str], dense: Sequence[Path], labels: Sequence[Path],
                    log: logging.Logger) -> Optional[PreprocessedCriteo]:
    from .criteo_synth import TERABYTE_CARDINALITIES
    from .multi_hot import MULTI_HOT_SUFFIX, multi_hot_sizes

    sparse = [root / f"{n}{MULTI_HOT_SUFFIX}" for n in names]
    if not all(p.is_file() for p in sparse):
        return None
    num_samples, sizes = [], set()
    for d, s, l in zip(dense, sparse, labels):
        try:
            rows, hot = multi_hot_sizes(s)
        except ValueError as e:
            raise CriteoFormatError(str(e)) from e
        shapes = [(check_array(d, "dense", INT_FEATURE_COUNT), INT_FEATURE_COUNT), (check_array(l, "labels", 1), 1)]
        if shapes != [(rows, INT_FEATURE_COUNT), (rows, 1)]:
            raise CriteoFormatError(f"{s} has {rows} rows but {d.name} / {l.name} have shapes {shapes}")
        num_samples.append(rows)
        sizes.add(hot)
    if len(sizes) != 1:
        raise CriteoFormatError(f"{root}: the multi-hot files disagree on ids per sample: {sorted(sizes)}")
    hot = sizes.pop()
    log.info("data: using MLPerf DLRM-v2 multi-hot files in %s in place (%d file(s), %d rows, ids per sample %s)",
             root, len(names), sum(num_samples), list(hot))
    return PreprocessedCriteo(
        out_dir=root, names=tuple(names), dense_paths=tuple(dense), sparse_paths=tuple(sparse),
        labels_paths=tuple(labels), cardinalities=tuple(TERABYTE_CARDINALITIES), num_samples=tuple(num_samples),
        multi_hot_sizes=hot,
    )


# ---------------------------------------------------------------------------------------
# Loading


@dataclass(frozen=True)
class RowRange:
    """Rows ``[start, stop)`` of file ``index``."""

    index: int
    start: int
    stop: int


def split_rows(
    num_samples: Sequence[int], eval_fraction: float
) -> Tuple[List[RowRange], List[RowRange]]:
    """Temporal hold-out: the last ``round(total * eval_fraction)`` rows (at least 1) of the
    concatenated files are evaluation, everything before is training. The two lists cover
    every row exactly once and never overlap."""
    total = sum(num_samples)
    n_eval = max(1, int(round(total * eval_fraction)))
    n_train = total - n_eval
    train: List[RowRange] = []
    evaluation: List[RowRange] = []
    offset = 0
    for index, rows in enumerate(num_samples):
        cut = min(max(n_train - offset, 0), rows)  # rows of this file that are training
        if cut > 0:
            train.append(RowRange(index, 0, cut))
        if cut < rows:
            evaluation.append(RowRange(index, cut, rows))
        offset += rows
    return train, evaluation


def batch_counts(rows: int, batch_size: int, world_size: int, drop_last: bool) -> Tuple[int, np.ndarray]:
    """``(full batches over all ranks, size of each rank's last partial batch)`` for
    ``rows`` rows - the split TorchRec's ``InMemoryBinaryCriteoIterDataPipe`` makes: full
    batches in rounds of ``world_size``; without ``drop_last`` the rows left over are
    shared out (sizes differing by at most one), and a remainder too small to give every
    rank a row takes the last full round back into the share-out."""
    full = rows // (batch_size * world_size) * world_size
    last = np.zeros(world_size, dtype=np.int64)
    left = rows - full * batch_size
    if drop_last or left == 0:
        return full, last
    if left < world_size:  # not a row for every rank: share out the last full round too
        full -= world_size
        left += batch_size * world_size
    last += left // world_size
    last[: left % world_size] += 1
    return full, last


def _open(path: Path) -> np.ndarray:
    # copy-on-write: memory-mapped (the files need not fit in memory, nothing is copied
    # before a batch is made), and batches made from it are writable arrays for torch
    return np.load(path, mmap_mode="c")


class _CheckedPipe(InMemoryBinaryCriteoIterDataPipe):
    """TorchRec's pipe, checking each batch's values as it is made from the rows just read:
    labels in {0, 1}, ids >= 0 (two reductions over arrays already in memory). A bad value
    is a :class:`CriteoFormatError` naming the file, the row, the value and the limit."""

    parts: Sequence[RowRange] = ()
    labels_paths: Sequence[Path] = ()
    sparse_paths: Sequence[Path] = ()

    def __iter__(self) -> Iterator[Any]:
        self._made = 0  # batches made by this iteration: locates a bad row in its file
        yield from super().__iter__()

    def _np_arrays_to_batch(self, dense: np.ndarray, sparse: np.ndarray, labels: np.ndarray) -> Any:
        made, self._made = self._made, self._made + 1
        i = first_bad(labels, 0, 1)
        if i is not None:
            path, row = self._locate(made, i)
            raise CriteoFormatError(f"{self.labels_paths[path]}, row {row}: label={labels.flat[i]} is invalid: "
                                    "must be 0 or 1")
        i = first_bad(sparse, 0, None)
        if i is not None:
            path, row = self._locate(made, i // CAT_FEATURE_COUNT)
            raise CriteoFormatError(f"{self.sparse_paths[path]}, row {row}: C{i % CAT_FEATURE_COUNT + 1} id "
                                    f"{sparse.flat[i]} is invalid: ids must be >= 0")
        return super()._np_arrays_to_batch(dense, sparse, labels)

    def _locate(self, made: int, offset: int) -> Tuple[int, int]:
        """``(file index, row in that file)`` of row ``offset`` of this rank's ``made``-th
        batch: full batches go round the ranks in turn, then each rank's share of the rest."""
        full_rounds = self.num_full_batches // self.world_size
        if made < full_rounds:
            start = (made * self.world_size + self.rank) * self.batch_size
        else:
            start = self.num_full_batches * self.batch_size + int(self.last_batch_sizes[: self.rank].sum())
        row = start + offset
        for part in self.parts:
            if row < part.stop - part.start:
                return part.index, part.start + row
            row -= part.stop - part.start
        raise AssertionError(f"row {start + offset} is past the split")  # batch_counts covers the split


def _make_multi_hot_pipe(pre: PreprocessedCriteo, parts: Sequence[RowRange], batch_size: int, rank: int,
                         world_size: int, shuffle_batches: bool, drop_last: bool) -> IterableDataset:
    from .multi_hot import MultiHotCriteoPipe, npz_member

    sparse = {i: [npz_member(pre.sparse_paths[i], str(f)) for f in range(CAT_FEATURE_COUNT)]
              for i in sorted({p.index for p in parts})}
    full, last = batch_counts(sum(p.stop - p.start for p in parts), batch_size, world_size, drop_last)
    return MultiHotCriteoPipe(
        dense=[_open(pre.dense_paths[p.index])[p.start:p.stop] for p in parts],
        sparse=[[m[p.start:p.stop] for m in sparse[p.index]] for p in parts],
        labels=[_open(pre.labels_paths[p.index])[p.start:p.stop] for p in parts],
        batch_size=batch_size, rank=rank, world_size=world_size, full=full, last=last,
        shuffle_batches=shuffle_batches, label_files=[(pre.labels_paths[p.index], p.start) for p in parts],
    )


def _make_pipe(
    pre: PreprocessedCriteo,
    parts: Sequence[RowRange],
    batch_size: int,
    rank: int,
    world_size: int,
    shuffle_batches: bool,
    drop_last: bool,
) -> IterableDataset:
    """TorchRec's pipe over row ranges of memory-mapped files, the files used in place.

    TorchRec's pipe takes whole files only; it is built memory-mapped on the files of
    ``parts`` (which reads nothing but headers), then narrowed to the rows of ``parts``."""
    if pre.multi_hot_sizes is not None:
        return _make_multi_hot_pipe(pre, parts, batch_size, rank, world_size, shuffle_batches, drop_last)
    files = sorted({p.index for p in parts})
    rng_state = np.random.get_state()  # its __init__ reseeds the global NumPy RNG
    try:
        pipe = _CheckedPipe(
            # "train" for both splits: "val"/"test" would halve the first file we pass.
            stage="train",
            dense_paths=[str(pre.dense_paths[i]) for i in files],
            sparse_paths=[str(pre.sparse_paths[i]) for i in files],
            labels_paths=[str(pre.labels_paths[i]) for i in files],
            batch_size=batch_size,
            rank=rank,
            world_size=world_size,
            drop_last=drop_last,
            shuffle_batches=shuffle_batches,
            mmap_mode=True,
            # contiguous ids are < cardinality already; raw hashes are taken modulo these
            hashes=list(pre.hashes) if pre.hashes is not None else None,
        )
    finally:
        np.random.set_state(rng_state)
    pipe.dense_arrs = [_open(pre.dense_paths[p.index])[p.start : p.stop] for p in parts]
    pipe.sparse_arrs = [_open(pre.sparse_paths[p.index])[p.start : p.stop] for p in parts]
    pipe.labels_arrs = [_open(pre.labels_paths[p.index])[p.start : p.stop] for p in parts]
    pipe.num_rows_per_file = [p.stop - p.start for p in parts]
    pipe.parts, pipe.labels_paths, pipe.sparse_paths = list(parts), pre.labels_paths, pre.sparse_paths
    pipe.num_full_batches, pipe.last_batch_sizes = batch_counts(
        sum(pipe.num_rows_per_file), batch_size, world_size, drop_last)
    return pipe


def make_dataloaders(
    pre: PreprocessedCriteo,
    batch_size: int,
    rank: int,
    world_size: int,
    eval_fraction: float = 0.1,
    shuffle_batches: bool = False,
    drop_last: bool = True,
) -> Tuple[InMemoryBinaryCriteoIterDataPipe, InMemoryBinaryCriteoIterDataPipe]:
    """Returns ``(train, eval)`` iterables of ``torchrec.datasets.utils.Batch``:
    ``dense_features`` float32 ``[B, 13]``, ``sparse_features`` a KeyedJaggedTensor with keys
    ``cat_0..cat_25`` and one id per sample and key, ``labels`` float32 ``[B]``.

    * Evaluation is the last ``eval_fraction`` of all rows (in file order, i.e. the latest
      days), disjoint from training (``split_rows``).
    * Sharding is TorchRec's: the split is cut into consecutive batches and batch ``k``
      goes to rank ``k % world_size``, so ranks see disjoint batches. Every rank yields the
      same number of batches; with ``drop_last`` the trailing partial round is dropped,
      without it the last round is shared out with sizes differing by at most one.
    * ``shuffle_batches`` permutes rows within each training batch (TorchRec's option,
      drawn from the global NumPy RNG); evaluation is never shuffled.

    The files are memory-mapped and used in place (nothing is copied or loaded up front;
    each rank reads the rows of its own batches), so a data set need not fit in memory.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} is invalid: must be an int >= 1")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} is invalid: must be >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is invalid: must be in [0, world_size={world_size})")
    if not (0.0 < eval_fraction < 1.0) or math.isnan(eval_fraction):
        raise ValueError(f"eval_fraction={eval_fraction} is invalid: must be in (0, 1)")
    train_parts, eval_parts = split_rows(pre.num_samples, eval_fraction)
    minimum = batch_size * world_size
    for split, parts in (("train", train_parts), ("eval", eval_parts)):
        rows = sum(p.stop - p.start for p in parts)
        # Fewer rows would give some ranks no batch at all (TorchRec's pipe even yields
        # nothing on every rank when rows < world_size, whatever drop_last says).
        if rows < minimum:
            raise ValueError(
                f"{split} split has {rows} rows, fewer than batch_size*world_size={minimum}; "
                "use more samples, a smaller batch or a different eval_fraction"
            )
    train = _make_pipe(pre, train_parts, batch_size, rank, world_size, shuffle_batches, drop_last)
    evaluation = _make_pipe(pre, eval_parts, batch_size, rank, world_size, False, drop_last)
    return train, evaluation


def iter_rows(pre: PreprocessedCriteo) -> Iterator[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Yields ``(dense, sparse, labels)`` arrays file by file, in file order (for checks)."""
    for d, s, l in zip(pre.dense_paths, pre.sparse_paths, pre.labels_paths):
        yield np.load(d), np.load(s), np.load(l)
