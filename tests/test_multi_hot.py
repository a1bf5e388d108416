"""MLPerf DLRM-v2's multi-hot Criteo (``day_{i}_sparse_multi_hot.npz``) through the data and
model configs: memory-mapped members, batches with several ids per sample, TorchRec's
split over ranks, and a training run on them."""

from __future__ import annotations

from pathlib import Path
from typing import List, Tuple

import numpy as np
import pytest

from tests.test_cli import TINY, assert_user_error, cli
from torchrec_proactive.data.criteo import make_dataloaders, open_torchrec_binary
from torchrec_proactive.data.multi_hot import npz_member
from torchrec_proactive.data.npy_files import CriteoFormatError

HOT = [2, 1, 3, 1, 1, 4, 1, 1, 1, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 5, 1, 1, 1, 1, 1]
ROWS = 50  # per table


def write_days(root: Path, rows: List[int], hot: List[int] = HOT, compressed: bool = False) -> None:
    """Multi-hot days laid out as MLPerf's materialize_synthetic_multihot_dataset.py writes them."""
    root.mkdir(parents=True, exist_ok=True)
    for day, n in enumerate(rows):
        rng = np.random.default_rng(day)
        np.save(root / f"day_{day}_dense.npy", rng.random((n, 13), dtype=np.float32))
        np.save(root / f"day_{day}_labels.npy", (rng.random((n, 1)) < 0.3).astype(np.int32))
        members = {str(f): rng.integers(0, ROWS, (n, h)) for f, h in enumerate(hot)}
        (np.savez_compressed if compressed else np.savez)(root / f"day_{day}_sparse_multi_hot.npz", **members)


def test_members_are_memory_mapped_and_batches_carry_every_id(tmp_path: Path) -> None:
    write_days(tmp_path, [300, 200])
    member = npz_member(tmp_path / "day_1_sparse_multi_hot.npz", "20")
    assert isinstance(member, np.memmap) and member.shape == (200, 5)
    with np.load(tmp_path / "day_1_sparse_multi_hot.npz") as z:
        assert np.array_equal(member, z["20"])

    pre = open_torchrec_binary(tmp_path, "terabyte", num_days=2, multi_hot=True)
    assert pre is not None and pre.multi_hot_sizes == tuple(HOT) and pre.num_samples == (300, 200)
    seen: List[Tuple[int, np.ndarray]] = []
    for rank in (0, 1):
        train, ev = make_dataloaders(pre, 40, rank, 2, eval_fraction=0.2)
        assert len(train) == 5 and len(ev) == 1  # 400 train rows / (40 x 2); 100 eval rows
        for b in train:
            kjt = b.sparse_features
            assert kjt.stride() == 40 and b.dense_features.shape == (40, 13)
            for f, key in enumerate(kjt.keys()):
                assert kjt[key].lengths().tolist() == [HOT[f]] * 40
            seen.append((rank, kjt["cat_20"].values().numpy().reshape(40, 5)))
    # batch k of the training rows went to rank k % 2, rows in file order across the day boundary
    days = [np.load(tmp_path / f"day_{d}_sparse_multi_hot.npz")["20"] for d in (0, 1)]
    every = np.concatenate(days)
    by_batch = sorted(seen, key=lambda s: s[0])  # rank 0's batches 0, 2, 4, ... then rank 1's
    rank0 = [ids for r, ids in by_batch if r == 0]
    rank1 = [ids for r, ids in by_batch if r == 1]
    for k in range(10):
        got = (rank0 if k % 2 == 0 else rank1)[k // 2]
        assert np.array_equal(got, every[k * 40:(k + 1) * 40]), k


def test_multi_hot_labels_are_checked_batch_by_batch(tmp_path: Path) -> None:
    write_days(tmp_path, [300, 200])
    labels = np.load(tmp_path / "day_1_labels.npy")
    labels[10, 0] = -1
    np.save(tmp_path / "day_1_labels.npy", labels)
    pre = open_torchrec_binary(tmp_path, "terabyte", num_days=2, multi_hot=True)
    train, _ = make_dataloaders(pre, 50, 0, 1, eval_fraction=0.2)
    with pytest.raises(CriteoFormatError, match=r"day_1_labels\.npy, row 10: label=-1 is invalid: must be 0 or 1"):
        for _ in train:
            pass


def test_compressed_or_mismatched_files_are_one_line_errors(tmp_path: Path) -> None:
    write_days(tmp_path / "z", [100], compressed=True)
    with pytest.raises(ValueError, match=r"day_0_sparse_multi_hot\.npz: 0\.npy is compressed"):
        open_torchrec_binary(tmp_path / "z", "terabyte", num_days=1, multi_hot=True)


@pytest.mark.multiprocess
def test_train_on_multi_hot_files_through_the_configs(tmp_path: Path) -> None:
    root = tmp_path / "mlperf"
    write_days(root, [1500, 1500])
    common = [*TINY, "data=criteo_terabyte_multi_hot", f"data.root={root}", "data.num_days=2",
              "data.eval_fraction=0.2", f"model.num_embeddings_per_feature=[{','.join([str(ROWS)] * 26)}]"]
    run = cli("train", *common, f"data.multi_hot_sizes=[{','.join(map(str, HOT))}]",
              f"train.output_dir={tmp_path / 'out'}")
    assert run.rc == 0, run
    assert "multi-hot files" in run.err and run.result()["steps"] == 6, run
    wrong = cli("train", *common, f"data.multi_hot_sizes=[{','.join(['1'] * 26)}]",
                f"train.output_dir={tmp_path / 'out2'}")
    assert_user_error(wrong, "data.multi_hot_sizes=", "ids per sample")
