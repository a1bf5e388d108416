"""Synthetic Criteo generator -> TorchRec preprocessing -> loaders, on tiny data.

Note: every pytest temporary directory contains "test" (``/tmp/pytest-of-.../test_x0``),
which is exactly the path that TorchRec's ``tsv_to_npys`` would treat as the unlabeled
Kaggle test set; these tests therefore also cover that our preprocessing is immune to it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import pytest
import torch

from torchrec_proactive.data import (
    KAGGLE_CARDINALITIES,
    TERABYTE_CARDINALITIES,
    SyntheticCriteoSpec,
    generate,
    sample_zipf_ranks,
)
from torchrec_proactive.data.criteo import (
    PreprocessedCriteo,
    RowRange,
    make_dataloaders,
    preprocess,
    split_rows,
)
from torchrec_proactive.data.criteo_synth import mix32

_HEX8 = re.compile(r"[0-9a-f]{8}")
_KEYS = [f"cat_{i}" for i in range(26)]


# ---------------------------------------------------------------------------------------
# Fixtures: generate + preprocess once per module.


def _build(tmp_root: Path, spec: SyntheticCriteoSpec) -> Tuple[List[Path], PreprocessedCriteo]:
    tsv = generate(spec, tmp_root / "raw", progress=False)
    return tsv, preprocess(tsv, tmp_root / "npy", progress=False)


@pytest.fixture(scope="module")
def kaggle(tmp_path_factory: pytest.TempPathFactory) -> Tuple[List[Path], PreprocessedCriteo]:
    spec = SyntheticCriteoSpec(layout="kaggle", num_samples=2000, cardinality_scale=0.001, seed=3)
    return _build(tmp_path_factory.mktemp("kaggle"), spec)


@pytest.fixture(scope="module")
def terabyte(tmp_path_factory: pytest.TempPathFactory) -> Tuple[List[Path], PreprocessedCriteo]:
    spec = SyntheticCriteoSpec(
        layout="terabyte", num_samples=2000, num_files=2, cardinality_scale=1e-4, seed=5
    )
    return _build(tmp_path_factory.mktemp("terabyte"), spec)


def _read_rows(path: Path) -> List[List[str]]:
    return [line.split("\t") for line in path.read_text().splitlines()]


def _full_arrays(pre: PreprocessedCriteo) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    dense = np.concatenate([np.load(p) for p in pre.dense_paths])
    sparse = np.concatenate([np.load(p) for p in pre.sparse_paths])
    labels = np.concatenate([np.load(p) for p in pre.labels_paths]).reshape(-1)
    return dense, sparse, labels


def _collect(batches) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    dense, sparse, labels = [], [], []
    for b in batches:
        dense.append(b.dense_features.numpy())
        kjt = b.sparse_features
        sparse.append(np.stack([kjt[k].values().numpy() for k in _KEYS], axis=1))
        labels.append(b.labels.numpy())
    return np.concatenate(dense), np.concatenate(sparse), np.concatenate(labels)


# ---------------------------------------------------------------------------------------
# Spec and generator


def test_spec_cardinalities_scale_and_clamp() -> None:
    assert SyntheticCriteoSpec().cardinalities() == list(KAGGLE_CARDINALITIES)
    tb = SyntheticCriteoSpec(layout="terabyte", num_files=3)
    assert tb.cardinalities() == list(TERABYTE_CARDINALITIES)
    assert tb.file_names() == ["day_0", "day_1", "day_2"]
    small = SyntheticCriteoSpec(cardinality_scale=0.01, max_cardinality=1000, min_cardinality=5)
    cards = small.cardinalities()
    assert len(cards) == 26 and min(cards) == 5 and max(cards) == 1000
    assert cards[1] == 6  # round(583 * 0.01)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"layout": "avazu"}, "layout='avazu'"),
        ({"num_samples": 0}, "num_samples=0 is invalid: must be >= 1"),
        ({"cardinality_scale": 0.0}, "cardinality_scale=0.0"),
        ({"cardinality_scale": float("inf")}, "cardinality_scale=inf"),
        ({"min_cardinality": 1}, "min_cardinality=1 is invalid: must be >= 2"),
        ({"max_cardinality": 3, "min_cardinality": 4}, "max_cardinality=3 is invalid: must be >="),
        ({"zipf_alpha": -1.0}, "zipf_alpha=-1.0"),
        ({"seed": -1}, "seed=-1 is invalid: must be >= 0"),
        ({"num_files": 2}, "num_files=2 is invalid for layout='kaggle'"),
        ({"layout": "terabyte", "num_files": 5, "num_samples": 4}, "must be <= num_samples=4"),
        ({"positive_rate": 1.0}, "positive_rate=1.0"),
        ({"cardinality_scale": 1000.0, "layout": "terabyte"}, "above the limit 4294967296"),
    ],
)
def test_spec_validation_errors(kwargs: Dict[str, object], fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        SyntheticCriteoSpec(**kwargs)


def test_generate_is_deterministic(tmp_path: Path) -> None:
    spec = SyntheticCriteoSpec(layout="terabyte", num_samples=300, num_files=2, seed=11)
    a = generate(spec, tmp_path / "a", progress=False)
    b = generate(spec, tmp_path / "b", progress=False)
    other = generate(
        SyntheticCriteoSpec(layout="terabyte", num_samples=300, num_files=2, seed=12),
        tmp_path / "c",
        progress=False,
    )
    assert [p.name for p in a] == ["day_0", "day_1"]
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]
    assert a[0].read_bytes() != other[0].read_bytes()
    assert not list((tmp_path / "a").glob(".*partial"))  # temporaries renamed away


def test_tsv_is_criteo_format(kaggle) -> None:
    tsv, _ = kaggle
    assert [p.name for p in tsv] == ["train.txt"]
    rows = _read_rows(tsv[0])
    assert len(rows) == 2000
    missing_int = missing_cat = 0
    for row in rows:
        assert len(row) == 1 + 13 + 26
        assert row[0] in ("0", "1")
        for v in row[1:14]:
            assert v == "" or v.isdigit(), v  # non-negative decimal counts
            missing_int += v == ""
        for v in row[14:]:
            assert v == "" or _HEX8.fullmatch(v), v
            missing_cat += v == ""
    assert missing_int > 0 and missing_cat > 0  # empty fields, like real Criteo
    ctr = np.mean([r[0] == "1" for r in rows])
    assert 0.18 < ctr < 0.33  # Kaggle-like positive rate (~25.6%)


def test_categories_are_zipf_skewed(tmp_path: Path) -> None:
    # Sampler over the full domain: top 1% of a 10M vocabulary takes most draws (~85%).
    n = 10_000_000
    ranks = sample_zipf_ranks(np.random.default_rng(0), n, 1.1, 100_000)
    assert ranks.min() >= 0 and ranks.max() < n
    assert np.mean(ranks < n // 100) > 0.8
    # In the TSV: the top 1% of distinct hashes of a 10M-cardinality feature (C3) take a
    # large share of its occurrences (uniform would give about 1%).
    (path,) = generate(SyntheticCriteoSpec(num_samples=2000, seed=1), tmp_path, progress=False)
    values = [row[14 + 2] for row in _read_rows(path) if row[14 + 2]]
    _, counts = np.unique(values, return_counts=True)
    counts = np.sort(counts)[::-1]
    top = max(1, len(counts) // 100)
    assert counts[:top].sum() / counts.sum() > 0.15


def test_hash_is_a_bijection_not_the_rank() -> None:
    ranks = np.arange(100_000)
    hashed = mix32(ranks, 12345)
    assert len(np.unique(hashed)) == len(ranks)  # distinct categories stay distinct
    assert hashed.max() < 2**32
    assert not np.array_equal(np.argsort(hashed), ranks)  # order by hash != order by rank


# ---------------------------------------------------------------------------------------
# Preprocessing


def test_preprocess_outputs(kaggle) -> None:
    _, pre = kaggle
    assert pre.num_samples == (2000,) and len(pre.cardinalities) == 26
    dense, sparse, labels = _full_arrays(pre)
    assert dense.dtype == np.float32 and dense.shape == (2000, 13)
    assert sparse.dtype == np.int64 and sparse.shape == (2000, 26)
    assert labels.dtype == np.int32 and set(np.unique(labels)) <= {0, 1}  # TorchRec's tsv_to_npys layout
    # log(count - 0 + 2): the generator pins each file's minimum integer to 0.
    assert dense.min() == pytest.approx(np.log(2.0))
    assert (sparse >= 1).all() and (sparse < np.array(pre.cardinalities)).all()
    assert (sparse.max(axis=0) + 1 == np.array(pre.cardinalities)).all()


def test_preprocess_skips_when_fresh_and_redoes_when_stale(tmp_path: Path) -> None:
    spec = SyntheticCriteoSpec(num_samples=200, cardinality_scale=1e-3)
    tsv = generate(spec, tmp_path / "raw", progress=False)
    first = preprocess(tsv, tmp_path / "npy", progress=False)
    stamp = first.sparse_paths[0].stat().st_mtime_ns
    assert preprocess(tsv, tmp_path / "npy", progress=False) == first
    assert first.sparse_paths[0].stat().st_mtime_ns == stamp  # nothing rewritten
    future = first.sparse_paths[0].stat().st_mtime + 100
    os.utime(tsv[0], (future, future))  # input now newer than the outputs
    again = preprocess(tsv, tmp_path / "npy", progress=False)
    assert again == first and again.sparse_paths[0].stat().st_mtime_ns != stamp


def test_preprocess_ignores_test_in_path_and_rejects_bad_labels(tmp_path: Path) -> None:
    # A labeled file literally named test.txt in a "test" directory: TorchRec's kaggle
    # mode would read it as unlabeled (labels -1, columns shifted); ours keeps the labels.
    spec = SyntheticCriteoSpec(num_samples=50, cardinality_scale=1e-3)
    (src,) = generate(spec, tmp_path / "g", progress=False)
    test_dir = tmp_path / "test_dir"
    test_dir.mkdir()
    renamed = test_dir / "test.txt"
    renamed.write_bytes(src.read_bytes())
    pre = preprocess([renamed], tmp_path / "test_out", progress=False)
    labels = np.load(pre.labels_paths[0]).reshape(-1)
    expected = [float(r[0]) for r in _read_rows(src)]
    assert labels.tolist() == expected

    bad = tmp_path / "bad.tsv"
    bad.write_text("2" + "\t1" * 13 + "\tabcdef01" * 26 + "\n")
    with pytest.raises(ValueError, match=r"bad\.tsv, line 1: label='2' must be 0 or 1"):
        preprocess([bad], tmp_path / "bad_out", progress=False)
    with pytest.raises(ValueError, match="tsv_files is empty"):
        preprocess([], tmp_path / "none", progress=False)


# ---------------------------------------------------------------------------------------
# Loading


def test_split_rows_is_a_disjoint_cover() -> None:
    train, ev = split_rows([1000, 1000], 0.1)
    assert train == [RowRange(0, 0, 1000), RowRange(1, 0, 800)]
    assert ev == [RowRange(1, 800, 1000)]
    train, ev = split_rows([1000, 1000], 0.6)
    assert train == [RowRange(0, 0, 800)]
    assert ev == [RowRange(0, 800, 1000), RowRange(1, 0, 1000)]


def test_kaggle_loader_batches(kaggle) -> None:
    _, pre = kaggle
    before = np.random.get_state()[1].copy()
    train, ev = make_dataloaders(pre, batch_size=64, rank=0, world_size=1)
    assert np.array_equal(np.random.get_state()[1], before)  # global RNG untouched
    batches = list(train)
    assert len(batches) == len(train) == 1800 // 64
    cards = torch.tensor(pre.cardinalities)
    for b in batches:
        assert b.dense_features.shape == (64, 13) and b.dense_features.dtype == torch.float32
        assert b.labels.shape == (64,) and b.labels.dtype == torch.int32
        kjt = b.sparse_features
        assert kjt.keys() == _KEYS and kjt.stride() == 64
        assert (kjt.lengths() == 1).all()
        ids = torch.stack([kjt[k].values() for k in _KEYS], dim=1)
        assert (ids >= 0).all() and (ids < cards).all()
    assert len(list(ev)) == 200 // 64


@pytest.mark.parametrize("eval_fraction", [0.1, 0.6])  # inside day_1 / across both days
def test_eval_split_is_disjoint_from_train(terabyte, eval_fraction: float) -> None:
    _, pre = terabyte
    assert pre.names == ("day_0", "day_1") and pre.num_samples == (1000, 1000)
    train, ev = make_dataloaders(pre, 32, 0, 1, eval_fraction=eval_fraction, drop_last=False)
    t_dense, t_sparse, t_labels = _collect(train)
    e_dense, e_sparse, e_labels = _collect(ev)
    n_eval = round(2000 * eval_fraction)
    assert len(t_labels) == 2000 - n_eval and len(e_labels) == n_eval
    dense, sparse, labels = _full_arrays(pre)
    # Train is exactly the leading rows and eval exactly the trailing rows, in order:
    # together they cover every row once, so no sample is in both.
    assert np.array_equal(t_sparse, sparse[: 2000 - n_eval])
    assert np.array_equal(e_sparse, sparse[2000 - n_eval :])
    assert np.array_equal(t_dense, dense[: 2000 - n_eval])
    assert np.array_equal(e_labels, labels[2000 - n_eval :])


def test_ranks_get_disjoint_equal_shards(terabyte) -> None:
    _, pre = terabyte
    world, bs = 2, 48
    shards = [make_dataloaders(pre, bs, r, world)[0] for r in range(world)]
    per_rank = [list(s) for s in shards]
    assert len(per_rank[0]) == len(per_rank[1]) == 1800 // (bs * world)
    _, sparse, _ = _full_arrays(pre)
    for rank, batches in enumerate(per_rank):
        for k, b in enumerate(batches):
            start = (k * world + rank) * bs  # TorchRec round-robin: batch j -> rank j % world
            ids = torch.stack([b.sparse_features[key].values() for key in _KEYS], dim=1)
            assert np.array_equal(ids.numpy(), sparse[start : start + bs])


def test_make_dataloaders_validation(kaggle) -> None:
    _, pre = kaggle
    with pytest.raises(ValueError, match=r"rank=2 is invalid"):
        make_dataloaders(pre, 8, 2, 2)
    with pytest.raises(ValueError, match=r"eval_fraction=1.0 is invalid"):
        make_dataloaders(pre, 8, 0, 1, eval_fraction=1.0)
    with pytest.raises(ValueError, match=r"eval split has 200 rows, fewer than"):
        make_dataloaders(pre, 256, 0, 1)


def _auroc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Mann-Whitney AUROC with average ranks for ties."""
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    avg_rank = np.cumsum(counts) - (counts - 1) / 2.0
    ranks = avg_rank[inverse]
    pos = labels == 1
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def test_labels_are_learnable(tmp_path: Path) -> None:
    spec = SyntheticCriteoSpec(num_samples=4000, max_cardinality=2000, seed=0)
    _, pre = _build(tmp_path, spec)
    train, ev = make_dataloaders(pre, 100, 0, 1, eval_fraction=0.25)
    _, t_sparse, t_labels = _collect(train)
    _, e_sparse, e_labels = _collect(ev)
    # Naive-Bayes-style score: sum over features of the smoothed per-id target log-odds,
    # fitted on train only and scored on the held-out tail.
    prior, strength = t_labels.mean(), 20.0
    score = np.zeros(len(e_labels))
    for f, card in enumerate(pre.cardinalities):
        pos = np.bincount(t_sparse[:, f], weights=t_labels, minlength=card)
        cnt = np.bincount(t_sparse[:, f], minlength=card)
        rate = (pos + strength * prior) / (cnt + strength)
        score += np.log(rate / (1 - rate))[e_sparse[:, f]]
    assert 0 < e_labels.sum() < len(e_labels)
    assert _auroc(score, e_labels) > 0.6
