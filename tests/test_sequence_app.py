"""``model=sequence`` (issue 45, item 5): a sequence recommender trained with the Hydra app.

* The synthetic history generator (``data/history.py``): a sample's history is a function of
  the sample alone, lengths uniform on 1..L, ids in range, the head as skewed as the
  docstring's formula says.
* The config: what the history table cannot have yet (``tier=ssd``, ``cache.budget_bytes``,
  ``table_row_wise``) is refused in one line naming the keys, exit code 2; the caches are
  sized for the history's ids.
* On 2 gloo ranks: the app trains it, the history table is proactive (its store counts the
  rows its lookups requested), a resumed run continues it bit-identically, and ``compare``
  ends with bit-identical parameters.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest
import torch

from torchrec_proactive.data.history import (
    HISTORY_FEATURE,
    HistorySpec,
    histories,
    sample_keys,
    share_below,
    splitmix64,
    with_history,
)

from .test_dlrm_example import _losses  # (a run's step losses from its metrics file)

# ---------------------------------------------------------------------- the generator


def _criteo_batch(ids: np.ndarray):
    """A Criteo-shaped batch: ``ids`` is ``[B, F]``, one id per sample and feature."""
    from torchrec import KeyedJaggedTensor
    from torchrec.datasets.utils import Batch

    batch, features = ids.shape
    kjt = KeyedJaggedTensor(keys=[f"cat_{f}" for f in range(features)],
                            values=torch.from_numpy(ids.T.reshape(-1).astype(np.int64)),
                            lengths=torch.ones(batch * features, dtype=torch.int32))
    return Batch(dense_features=torch.zeros(batch, 13), sparse_features=kjt, labels=torch.zeros(batch))


def _history_of(batch) -> List[List[int]]:
    jt = batch.sparse_features[HISTORY_FEATURE]
    return [row.tolist() for row in jt.to_dense()]


def test_a_samples_history_is_its_own_whatever_the_batch():
    spec = HistorySpec(length=6, rows=500, alpha=1.1, seed=3)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1000, size=(48, 26))
    whole = _history_of(with_history(_criteo_batch(ids), spec))
    # the same samples in another order and in other batches: the same history each
    order = rng.permutation(48)
    shuffled = _history_of(with_history(_criteo_batch(ids[order]), spec))
    assert [shuffled[i] for i in np.argsort(order)] == whole
    halves = _history_of(with_history(_criteo_batch(ids[:20]), spec)) + \
        _history_of(with_history(_criteo_batch(ids[20:]), spec))
    assert halves == whole
    # another sample (one id changed) or another seed: another history (for most samples)
    other = ids.copy()
    other[:, 7] += 1
    assert sum(a != b for a, b in zip(_history_of(with_history(_criteo_batch(other), spec)), whole)) > 40
    reseeded = _history_of(with_history(_criteo_batch(ids), HistorySpec(length=6, rows=500, alpha=1.1, seed=4)))
    assert sum(a != b for a, b in zip(reseeded, whole)) > 40
    # the batch keeps its own features, in order, with the history last
    out = with_history(_criteo_batch(ids), spec).sparse_features
    assert out.keys() == [f"cat_{f}" for f in range(26)] + [HISTORY_FEATURE]
    assert torch.equal(out["cat_3"].values(), torch.from_numpy(ids[:, 3]).long())


def test_multi_hot_bags_key_the_sample_whatever_the_order_inside_a_bag():
    from torchrec import KeyedJaggedTensor

    # two samples, two features; sample 1's bag of f0 in another order: the same keys
    a = KeyedJaggedTensor(keys=["f0", "f1"], values=torch.tensor([5, 6, 7, 8, 9, 1]),
                          lengths=torch.tensor([1, 2, 2, 1]))
    b = KeyedJaggedTensor(keys=["f0", "f1"], values=torch.tensor([5, 7, 6, 8, 9, 1]),
                          lengths=torch.tensor([1, 2, 2, 1]))
    assert np.array_equal(sample_keys(a), sample_keys(b))
    # an id moved to another feature is another sample
    c = KeyedJaggedTensor(keys=["f0", "f1"], values=torch.tensor([5, 6, 7, 8, 1, 9]),
                          lengths=torch.tensor([1, 2, 1, 2]))
    assert sample_keys(c)[1] != sample_keys(a)[1]


def test_lengths_are_uniform_on_1_to_L_and_ids_in_range():
    spec = HistorySpec(length=8, rows=3000, alpha=1.1)
    keys = splitmix64(np.arange(80_000, dtype=np.uint64))
    lengths, ids = histories(keys, spec)
    assert lengths.min() == 1 and lengths.max() == 8 and int(lengths.sum()) == ids.size
    counts = np.bincount(lengths, minlength=9)[1:]
    # uniform: each length's share within 5 standard errors of 1/8
    assert np.abs(counts / keys.size - 1 / 8).max() < 5 * np.sqrt((1 / 8) * (7 / 8) / keys.size), counts
    assert ids.min() >= 0 and ids.max() < spec.rows and ids.dtype == np.int64
    again = histories(keys, spec)
    assert np.array_equal(again[0], lengths) and np.array_equal(again[1], ids)


@pytest.mark.parametrize("alpha", [0.8, 1.0, 1.1, 1.5])
def test_the_top_ids_take_the_share_the_formula_predicts(alpha: float):
    spec = HistorySpec(length=8, rows=10_000, alpha=alpha)
    _, ids = histories(splitmix64(np.arange(40_000, dtype=np.uint64)), spec)
    for k in (1, 100, 1000):  # the hottest id, the top 1% and the top 10%
        predicted = share_below(k, spec.rows, alpha)
        measured = float((ids < k).mean())
        assert abs(measured - predicted) < 0.01, (k, measured, predicted)
    # skewed as Zipf: id 0 drawn more often than id 10, which is drawn more than id 1000
    counts = np.bincount(ids, minlength=spec.rows)
    assert counts[0] > counts[10] > counts[1000]


def test_a_bad_spec_is_refused():
    with pytest.raises(ValueError, match="length >= 1"):
        HistorySpec(length=0, rows=10, alpha=1.0)
    with pytest.raises(ValueError, match="alpha > 0"):
        HistorySpec(length=3, rows=10, alpha=0.0)


# ---------------------------------------------------------------------- config, sizes


@pytest.mark.parametrize("overrides,fragments", [
    (["tier=ssd", "tier.dir=/tmp/x"], ["tier.kind='ssd' is invalid", "model.arch='sequence'", "tier=dram"]),
    (["sharding=auto", "cache.budget_bytes=700000"], ["cache.budget_bytes=700000 is invalid", "model.arch='sequence'",
                                                      "cache.budget_bytes=0"]),
    (["sharding=table_row_wise"], ["sharding.type='table_row_wise' is invalid", "model.arch='sequence'"]),
    (["model.history_length=0"], ["model.history_length=0", ">= 1"]),
    (["model.history_zipf_alpha=0"], ["model.history_zipf_alpha=0", "> 0"]),
])
def test_what_the_history_table_cannot_have_is_refused_naming_the_keys(overrides, fragments):
    from torchrec_proactive.app.compose import compose_config
    from torchrec_proactive.app.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        compose_config(["experiment=ci_tiny", "model=sequence", *overrides])
    text = str(info.value)
    assert "\n" not in text, text
    for fragment in fragments:
        assert fragment in text, (fragment, text)


@pytest.mark.parametrize("how", ["cli", "example"])
def test_tier_ssd_with_the_sequence_model_exits_2_in_one_line(tmp_path: Path, how: str):
    from tests.test_cli import REPO, assert_user_error, cli

    args = ["experiment=ci_tiny", "tier=ssd", f"tier.dir={tmp_path / 'ssd'}", f"train.output_dir={tmp_path / 'run'}"]
    if how == "cli":
        run = cli("train", "model=sequence", *args, timeout=120)
    else:  # the example's script puts model=sequence first itself
        run = cli(*args, script=REPO / "examples" / "sequence_recommender" / "train.py", timeout=120)
    assert_user_error(run, "tier.kind='ssd'", "model.arch='sequence'")
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_profile_cache_of_the_sequence_model_exits_2_in_one_line(tmp_path: Path):
    from tests.test_cli import assert_user_error, cli

    run = cli("profile-cache", "experiment=ci_tiny", "model=sequence", "sharding=auto",
              f"data.root={tmp_path / 'data'}", f"train.output_dir={tmp_path / 'run'}", timeout=120)
    assert_user_error(run, "model.arch='sequence' is invalid for profile-cache", "cache.load_factor")
    assert not (tmp_path / "data").exists() and not (tmp_path / "run").exists()  # refused before anything is written


def test_the_history_cache_holds_the_batches_ids():
    from torchrec_proactive.app.compose import compose_config
    from torchrec_proactive.app.model import cache_slots, model_tables

    cfg = compose_config(["experiment=ci_tiny", "model=sequence", "model.history_rows=50000",
                          "cache.load_factor=0.01"])
    tables = model_tables(cfg.model, [600] * 26)
    assert [t.name for t in tables][-1] == "t_history"
    slots, notes = cache_slots(tables, cfg, world_size=2, local_size=2, depth=2)
    # 3 batches in flight, 2 ranks x 64 samples x up to 8 history ids each
    assert slots["t_history"] == 3 * 2 * 64 * cfg.model.history_length
    assert slots["t_cat_0"] == 3 * 2 * 64  # one id per sample in the pooled features
    assert any(n.startswith("t_history:") for n in notes)


def test_a_checkpoint_saved_before_the_history_keys_still_resumes():
    """Checkpoints of DLRM runs saved before ``model.history_*`` existed hold no such keys:
    at their defaults now they are no change (anything else still is)."""
    from torchrec_proactive.app.compose import compose_config, flatten
    from torchrec_proactive.app.errors import ConfigError
    from torchrec_proactive.app.resume import refuse_changes

    now = flatten(compose_config(["experiment=ci_tiny", "train.output_dir=/tmp/x"]))
    saved = {k: v for k, v in now.items() if not k.startswith("model.history_")}
    assert refuse_changes(saved, now, "ckpt") == {}
    changed = flatten(compose_config(["experiment=ci_tiny", "train.output_dir=/tmp/x", "model.history_rows=77"]))
    with pytest.raises(ConfigError, match="model.history_rows: checkpoint None vs now 77"):
        refuse_changes(saved, changed, "ckpt")


# ---------------------------------------------------------------------- 2 gloo ranks

STOP = 7  # mid-epoch (18 steps per epoch: 3000 rows, 20% held out, 2 ranks x 64)




def _scenario(rank: int, world_size: int, root: str) -> Dict[str, Any]:
    from torchrec_proactive.app.compose import compose_config
    from torchrec_proactive.app.entry import rank_main
    from torchrec_proactive.app.train import build_run

    # row-wise: both ranks hold a shard of the history table, each cached in part (3 batches
    # of 2 x 64 x 8 ids = 3072 slots of its 5000 rows)
    base = ["experiment=ci_tiny", "model=sequence", "sharding=row_wise", f"data.root={root}/data", "train.epochs=1"]
    # A: the app's run, kept at hand to read its tables' counters
    trainer = build_run(compose_config(base + [f"train.output_dir={root}/A"]))
    summary = trainer.fit()
    ec = trainer.dmp.module.model.embedding_collection
    ec_stats = dict(ec.proactive_stats.snapshot())
    tables = trainer.pipeline.stats(per_table=True)
    # B then C: stopped mid-epoch, resumed at another depth
    rank_main(rank, world_size, "train", base + [f"train.output_dir={root}/B", f"train.max_steps={STOP}"])
    c = rank_main(rank, world_size, "train", base + [f"train.output_dir={root}/B", "train.resume=true",
                                                     "prefetch.depth=1"])
    # test_compare_ends_bit_identical's compare, in the same launch (what `compare --nproc 2` runs
    # on each rank; the CLI prints rank 0's result with compare.format_table)
    compare = rank_main(rank, world_size, "compare", [
        "experiment=ci_tiny", "model=sequence", "train.eval=false", "train.max_steps=12", f"data.root={root}/data",
        f"train.output_dir={root}/cmp"])
    return {"ec_type": type(ec).__name__, "ec_stats": ec_stats, "tables": tables, "evals_a": summary.evals,
            "evals_c": c["evals"], "losses_a": _losses(Path(root) / "A", rank),
            "losses_c": _losses(Path(root) / "B", rank), "cache_slots": summary.cache_slots,
            "compare": compare, "compare_dir": f"{root}/cmp"}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> List[Dict[str, Any]]:
    from torchrec_proactive.launch import run_ranks

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    root = tmp_path_factory.mktemp("sequence")
    return run_ranks(_scenario, world_size=2, timeout_s=300, root=str(root))


@pytest.mark.multiprocess
def test_the_app_trains_it_with_a_proactive_history_table(ranks: List[Dict[str, Any]]):
    for r in ranks:
        assert r["ec_type"] == "ProactiveShardedEmbeddingCollection"
        history = r["tables"]["t_history"]
        # the history table's own store: its lookups requested rows, missed some, hit most
        assert history["rows_requested"] > 0 and 0 < history["rows_fetched"] < history["rows_requested"]
        assert history["hits"] > 0
        # pipelined: most of its rows fetched ahead of their lookup (after each drain one batch is not)
        assert r["ec_stats"]["rows_fetched_at_lookup"] < 0.5 * r["ec_stats"]["rows_fetched"], r["ec_stats"]
        assert r["cache_slots"]["t_history"] > 0
        losses = [r["losses_a"][s] for s in sorted(r["losses_a"])]
        assert len(losses) == 18 and all(np.isfinite(losses))
        assert np.mean(losses[-6:]) < np.mean(losses[:6]), losses
        assert r["evals_a"] and r["evals_a"][-1]["auroc"] > 0.55, r["evals_a"]


@pytest.mark.multiprocess
def test_a_resumed_run_continues_it_bit_identically(ranks: List[Dict[str, Any]]):
    for r in ranks:
        # the same histories for the same samples after the restart: the same losses, bit for bit
        assert r["losses_c"] == r["losses_a"]
        assert r["evals_c"][-1]["auroc"] == r["evals_a"][-1]["auroc"]
        assert r["evals_c"][-1]["logloss"] == r["evals_a"][-1]["logloss"]


@pytest.mark.multiprocess
def test_compare_ends_bit_identical(ranks: List[Dict[str, Any]]):
    from torchrec_proactive.app.compare import format_table

    table = format_table(ranks[0]["compare"])  # what `torchrec-proactive compare` prints
    assert "final parameters bit-identical: yes" in table, table
    doc = json.loads((Path(ranks[0]["compare_dir"]) / "compare.json").read_text())
    assert doc["cache_slots"]["reactive"]["t_history"] == doc["cache_slots"]["proactive"]["t_history"] > 0
