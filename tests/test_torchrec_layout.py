"""Criteo as users have it: TorchRec's binary layout, both ways.

* Our preprocessing writes exactly what TorchRec's own ``torchrec.datasets.criteo``
  utilities write (same names, dtypes and values), so TorchRec's reference trainer reads it.
* A ``data.root`` of TorchRec-preprocessed files (no TSVs) is used where it is: memory-mapped,
  nothing copied or written there, batches identical to ours.
"""

from __future__ import annotations

import contextlib
import io
import os
import stat
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import pytest
from torchrec.datasets.criteo import BinaryCriteoUtils, InMemoryBinaryCriteoIterDataPipe

from tests.test_cli import TINY, cli
from torchrec_proactive.data import KAGGLE_CARDINALITIES, SyntheticCriteoSpec, generate
from torchrec_proactive.data.criteo import batch_counts, make_dataloaders, open_torchrec_binary, preprocess


def _torchrec_preprocess(tsvs: List[Path], out: Path, contiguous: bool = True) -> None:
    """What TorchRec's scripts do (npy_preproc_criteo.py, then contiguous_preproc_criteo.py),
    with TorchRec's own functions and names."""
    out.mkdir(parents=True)
    names = ["train" if p.name == "train.txt" else p.name for p in tsvs]
    for tsv, name in zip(tsvs, names):
        BinaryCriteoUtils.tsv_to_npys(str(tsv), str(out / f"{name}_dense.npy"), str(out / f"{name}_sparse.npy"),
                                      str(out / f"{name}_labels.npy"), dataset_name="criteo_1tb")
    if contiguous:
        with contextlib.redirect_stdout(io.StringIO()):
            BinaryCriteoUtils.sparse_to_contiguous([str(out / f"{n}_sparse.npy") for n in names], str(out),
                                                   frequency_threshold=3)


@pytest.fixture(scope="module")
def days(tmp_path_factory: pytest.TempPathFactory) -> Tuple[List[Path], Path]:
    tmp = tmp_path_factory.mktemp("days")
    spec = SyntheticCriteoSpec(layout="terabyte", num_samples=1200, num_files=2, max_cardinality=300, seed=5)
    tsvs = generate(spec, tmp / "tsv", progress=False)
    theirs = tmp / "torchrec"
    _torchrec_preprocess(tsvs, theirs)
    return tsvs, theirs


def _npys(d: Path) -> Dict[str, np.ndarray]:
    return {p.name: np.load(p) for p in sorted(d.glob("*.npy"))}


def test_our_preprocessing_writes_torchrecs_layout(days, tmp_path: Path) -> None:
    tsvs, theirs = days
    ours = preprocess(tsvs, tmp_path / "ours", progress=False, frequency_threshold=3)
    mine, reference = _npys(tmp_path / "ours"), _npys(theirs)
    assert sorted(reference) == ["day_0_dense.npy", "day_0_labels.npy", "day_0_sparse.npy",
                                 "day_0_sparse_contig_freq.npy", "day_1_dense.npy", "day_1_labels.npy",
                                 "day_1_sparse.npy", "day_1_sparse_contig_freq.npy"]
    assert sorted(mine) == sorted(reference)
    for name, array in reference.items():
        assert mine[name].dtype == array.dtype and np.array_equal(mine[name], array), name
    assert [p.name for p in ours.sparse_paths] == ["day_0_sparse_contig_freq.npy", "day_1_sparse_contig_freq.npy"]


def _batches(pre, eval_fraction: float = 0.25) -> List[np.ndarray]:
    out = []
    for split in make_dataloaders(pre, 64, 0, 1, eval_fraction=eval_fraction):
        for b in split:
            ids = b.sparse_features.values().numpy().reshape(26, -1).T
            out.append(np.concatenate([b.dense_features.numpy(), ids, b.labels.numpy()[:, None]], axis=1))
    return out


def test_torchrec_files_are_used_in_place_memory_mapped(days, tmp_path: Path) -> None:
    tsvs, theirs = days
    before = {p.name: p.stat().st_mtime_ns for p in theirs.iterdir()}
    os.chmod(theirs, stat.S_IRUSR | stat.S_IXUSR)  # read-only: nothing may be written there
    try:
        found = open_torchrec_binary(theirs, "terabyte", num_days=2)
        assert found is not None and found.hashes is None and found.num_samples == (600, 600)
        ours = preprocess(tsvs, tmp_path / "ours", progress=False, frequency_threshold=3)
        assert found.cardinalities == ours.cardinalities
        got, want = _batches(found), _batches(ours)
        assert len(got) == len(want) == 18 and all(np.array_equal(a, b) for a, b in zip(got, want))
        train, _ = make_dataloaders(found, 64, 0, 1, eval_fraction=0.25)
        assert all(isinstance(a, np.memmap) for a in train.dense_arrs + train.sparse_arrs + train.labels_arrs)
    finally:
        os.chmod(theirs, stat.S_IRWXU)
    assert {p.name: p.stat().st_mtime_ns for p in theirs.iterdir()} == before
    assert open_torchrec_binary(theirs, "terabyte", num_days=3) is None  # day_2 missing


def test_raw_torchrec_ids_are_hashed_like_torchrecs_reference(tmp_path: Path) -> None:
    (tsv,) = generate(SyntheticCriteoSpec(num_samples=400, seed=2), tmp_path / "tsv", progress=False)
    _torchrec_preprocess([tsv], tmp_path / "raw", contiguous=False)  # train_{dense,sparse,labels}.npy
    found = open_torchrec_binary(tmp_path / "raw", "kaggle")
    assert found is not None and found.hashes == KAGGLE_CARDINALITIES == found.cardinalities
    raw = np.load(tmp_path / "raw" / "train_sparse.npy")
    train, _ = make_dataloaders(found, 50, 0, 1, eval_fraction=0.2)
    first = next(iter(train)).sparse_features.values().numpy().reshape(26, -1).T
    assert np.array_equal(first, raw[:50] % np.array(KAGGLE_CARDINALITIES))


@pytest.mark.parametrize("rows,batch,world,drop_last", [
    (1000, 64, 1, True), (1000, 64, 3, True), (1000, 64, 3, False), (1000, 100, 4, False),
    (1001, 250, 4, False), (130, 64, 2, False), (129, 64, 2, False), (7, 2, 3, False),
])
def test_batch_counts_match_torchrecs_pipe(tmp_path: Path, rows: int, batch: int, world: int, drop_last: bool) -> None:
    for kind, shape, dtype in (("dense", (rows, 13), np.float32), ("sparse", (rows, 26), np.int64),
                               ("labels", (rows, 1), np.int32)):
        np.save(tmp_path / f"{kind}.npy", np.zeros(shape, dtype=dtype))
    pipe = InMemoryBinaryCriteoIterDataPipe("train", [str(tmp_path / "dense.npy")], [str(tmp_path / "sparse.npy")],
                                            [str(tmp_path / "labels.npy")], batch, 0, world, drop_last=drop_last)
    full, last = batch_counts(rows, batch, world, drop_last)
    assert full == pipe.num_full_batches and last.tolist() == pipe.last_batch_sizes.tolist()


@pytest.mark.multiprocess
def test_train_on_a_root_of_torchrec_files(days, tmp_path: Path) -> None:
    _, theirs = days
    before = sorted(p.name for p in theirs.iterdir())
    run = cli("train", *TINY, "data=criteo_terabyte", f"data.root={theirs}", "data.num_days=2",
              "data.eval_fraction=0.1", f"train.output_dir={tmp_path / 'out'}")
    assert run.rc == 0, run
    assert "using TorchRec's preprocessed files" in run.err and "preprocessing" not in run.err, run
    assert run.result()["steps"] == 6
    assert sorted(p.name for p in theirs.iterdir()) == before
