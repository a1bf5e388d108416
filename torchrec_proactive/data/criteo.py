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
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
from torchrec.datasets.criteo import (
    CAT_FEATURE_COUNT,
    FREQUENCY_THRESHOLD,
    INT_FEATURE_COUNT,
    BinaryCriteoUtils,
    InMemoryBinaryCriteoIterDataPipe,
)
from tqdm import tqdm

PathLike = Union[str, Path]
_LOG = logging.getLogger(__name__)

_MANIFEST = "manifest.json"
_MANIFEST_VERSION = 1
# sparse_to_contiguous appends this to basename.split(".")[0] of each input.
_CONTIG_SUFFIX = "_contig_freq.npy"
_SPLIT_DIR = "splits"
_KINDS = ("dense", "sparse", "labels")


class CriteoFormatError(ValueError):
    """A Criteo TSV file that is not in Criteo's format; the message is one line naming the
    file, the line number, the field and the value. ``user_error``: the CLI prints it as
    one line with exit code 2 (see ``torchrec_proactive.app.errors``)."""

    user_error = True


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
    """Binary Criteo ready for ``make_dataloaders``; one entry per input TSV, in input order.

    Invariants: for file ``i``, ``dense_paths[i]`` holds float32 ``[num_samples[i], 13]``
    (``log(count - file_min + 2)``), ``sparse_paths[i]`` int64 ``[num_samples[i], 26]`` with
    ``0 < id < cardinalities[f]`` in column ``f`` (1 = ids seen fewer than
    ``frequency_threshold`` times, 0 never used), ``labels_paths[i]`` float32
    ``[num_samples[i], 1]`` in {0, 1}. Ids are consistent across files.
    """

    out_dir: Path
    names: Tuple[str, ...]
    dense_paths: Tuple[Path, ...]
    sparse_paths: Tuple[Path, ...]
    labels_paths: Tuple[Path, ...]
    cardinalities: Tuple[int, ...]
    num_samples: Tuple[int, ...]

    @property
    def total_samples(self) -> int:
        return sum(self.num_samples)


def _file_tag(index: int, path: Path) -> str:
    """Unique, dot-free prefix for the npy files of input ``index`` (see the naming trap)."""
    stem = re.sub(r"[^A-Za-z0-9_-]", "_", path.name)
    return f"{index:02d}_{stem}"


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


def _save_atomic(path: Path, array: np.ndarray) -> None:
    """Writes via a per-process temporary name and renames, so concurrent writers of the
    same content (several ranks) never expose a half-written file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    with open(tmp, "wb") as fh:  # a file object: np.save would append ".npy" to a name
        np.save(fh, array)
    os.replace(tmp, path)


def _tsv_to_npys(tsv: Path, files: Dict[str, Path]) -> int:
    """Runs TorchRec's parser on one labeled TSV, then converts labels to float32 (what
    losses expect, so batches need no conversion). Returns the row count."""
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
    _save_atomic(files["labels"], labels.astype(np.float32).reshape(-1, 1))
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
    tags = [_file_tag(i, p) for i, p in enumerate(inputs)]

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


def _part_paths(pre: PreprocessedCriteo, part: RowRange) -> Dict[str, Path]:
    """Paths of the three arrays for ``part``; a whole file uses the preprocessed files, a
    partial one is sliced into ``out_dir/splits`` once (reused while newer than the source)."""
    source = {
        "dense": pre.dense_paths[part.index],
        "sparse": pre.sparse_paths[part.index],
        "labels": pre.labels_paths[part.index],
    }
    if part.start == 0 and part.stop == pre.num_samples[part.index]:
        return source
    split_dir = pre.out_dir / _SPLIT_DIR
    split_dir.mkdir(exist_ok=True)
    name = pre.names[part.index]
    result = {}
    for kind, src in source.items():
        dst = split_dir / f"{name}_rows_{part.start}_{part.stop}_{kind}.npy"
        if not dst.exists() or dst.stat().st_mtime_ns < src.stat().st_mtime_ns:
            arr = np.load(src, mmap_mode="r")
            _save_atomic(dst, np.ascontiguousarray(arr[part.start : part.stop]))
        result[kind] = dst
    return result


def _make_pipe(
    pre: PreprocessedCriteo,
    parts: Sequence[RowRange],
    batch_size: int,
    rank: int,
    world_size: int,
    shuffle_batches: bool,
    drop_last: bool,
) -> InMemoryBinaryCriteoIterDataPipe:
    paths = [_part_paths(pre, p) for p in parts]
    rng_state = np.random.get_state()  # its __init__ reseeds the global NumPy RNG
    try:
        return InMemoryBinaryCriteoIterDataPipe(
            # "train" for both splits: "val"/"test" would halve the first file we pass.
            stage="train",
            dense_paths=[str(p["dense"]) for p in paths],
            sparse_paths=[str(p["sparse"]) for p in paths],
            labels_paths=[str(p["labels"]) for p in paths],
            batch_size=batch_size,
            rank=rank,
            world_size=world_size,
            drop_last=drop_last,
            shuffle_batches=shuffle_batches,
            # ids are already contiguous and < cardinality: no modulo hashing.
            hashes=None,
        )
    finally:
        np.random.set_state(rng_state)


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

    Every rank loads the whole of both splits into memory (TorchRec's in-memory pipe reads
    all files and skips other ranks' batches). Batches may share memory with those arrays:
    do not modify them in place.
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
