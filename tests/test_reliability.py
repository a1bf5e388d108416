"""Bad input, faults and recovery: clear errors, no hangs, nothing lost."""

from __future__ import annotations


import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

from torchrec_proactive.integration.validation import InputValidator
from torchrec_proactive.launch import RankFailure, run_ranks
from torchrec_proactive.store import IdOutOfRangeError, InvalidInputError

from . import reliability_worker as rw
from .cases_worker import call, launch_cases, ok

CONFIGS = [
    EmbeddingBagConfig(name="users", embedding_dim=8, num_embeddings=100, feature_names=["user", "friend"]),
    EmbeddingBagConfig(name="items", embedding_dim=8, num_embeddings=50, feature_names=["item"]),
]


def kjt(values, lengths, keys=("user", "friend", "item"), weights=None):
    vals = torch.tensor(values) if values else torch.zeros(0, dtype=torch.int64)
    return KeyedJaggedTensor(keys=list(keys), values=vals, lengths=torch.tensor(lengths),
                             weights=None if weights is None else torch.tensor(weights))


# ---------------------------------------------------------------------- unit: validator
@pytest.mark.parametrize(
    "values,lengths,pattern",
    [
        ([1, 2, 3, 50], [1, 1, 1, 0, 0, 1], r"feature 'item' \(table 'items'\): id 50 is out of range \[0, 50\) in sample 1"),
        ([1, -4, 3], [1, 1, 1, 0, 0, 0], r"feature 'user' \(table 'users'\): id -4 is out of range \[0, 100\) in sample 1"),
        ([1, 2, 100], [0, 1, 1, 1, 0, 0], r"feature 'friend' \(table 'users'\): id 100 is out of range \[0, 100\)"),
    ],
)
def test_out_of_range_ids_name_feature_table_value_limit_and_sample(values, lengths, pattern):
    with pytest.raises(IdOutOfRangeError, match=pattern):
        InputValidator(CONFIGS).check(kjt(values, lengths))


def test_malformed_batches_are_refused():
    v = InputValidator(CONFIGS)
    with pytest.raises(InvalidInputError, match="lengths add up to 3 but it holds 2 ids"):
        v.check(kjt([1, 2], [1, 1, 1, 0, 0, 0]))
    # Features of another module riding in the same KJT are not this module's to check
    # (TorchRec routes each module its own), whatever their ids; ours still are.
    v.check(kjt([1, -5], [1, 1], keys=("user", "ghost")))
    with pytest.raises(IdOutOfRangeError, match="feature 'user'"):
        v.check(kjt([10_000, -5], [1, 1], keys=("user", "ghost")))
    with pytest.raises(InvalidInputError, match="NaN or Inf"):
        v.check(kjt([1, 2], [1, 1, 0, 0, 0, 0], weights=[1.0, float("nan")]))
    with pytest.raises(InvalidInputError, match="integers"):
        v.check(kjt([1.0], [1, 0, 0, 0, 0, 0]))
    v.check(kjt([], [0, 0, 0, 0, 0, 0]))  # empty batches are fine
    v.check(kjt([99, 0, 49], [1, 1, 1, 0, 0, 0]))


def test_plan_naming_unknown_tables_is_refused():
    from torchrec.distributed.types import ParameterSharding

    from tests.sparse_model import SparseModel, make_tables
    from torchrec_proactive import ProactiveEmbeddingBagCollectionSharder
    from torchrec_proactive.planning import build_plan

    model = SparseModel(make_tables(2, rows=50, dim=8))
    sharder = ProactiveEmbeddingBagCollectionSharder()
    ps = ParameterSharding(sharding_type="table_wise", compute_kernel="fused_uvm_caching", ranks=[0])
    with pytest.raises(ValueError, match=r"names tables \['nope'\].*it has \['t0', 't1'\]"):
        sharder._mark_cached_tables(model.ebc, {"t0": ps, "nope": ps})
    grid = ParameterSharding(sharding_type="grid_shard", compute_kernel="fused_uvm_caching", ranks=[0, 1])
    with pytest.raises(ValueError, match=r"table 't1': sharding type 'grid_shard' is not supported.*supported:"):
        sharder._mark_cached_tables(model.ebc, {"t0": ps, "t1": grid})
    with pytest.raises(ValueError, match=r"unknown tables \['nope'\]"):
        build_plan(model, sharder, {"nope": "row_wise"}, world_size=2)
    with pytest.raises(ValueError, match="prefetch_depth"):
        from torchrec_proactive import ProactiveTrainPipeline

        ProactiveTrainPipeline(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"), prefetch_depth=-1)
    with pytest.raises(ValueError, match="cache_load_factor"):
        ProactiveEmbeddingBagCollectionSharder(cache_load_factor=0.0)


# ---------------------------------------------------------------------- 2 ranks

BAD_IDS = [("table_wise", 300), ("row_wise", -1), ("row_wise", 10**6)]


@pytest.fixture(scope="module")
def launched():
    """Every 2-rank case of this module that ends in results, in one launch (starting 2 ranks
    costs more than a case); the cases that fail the launch on purpose start their own."""
    cases = [*((case, dict(fn=rw.bad_ids, sharding=case[0], value=case[1])) for case in BAD_IDS),
             ("recovery_is_exact", dict(fn=rw.recovery_is_exact)),
             ("empty_batches", dict(fn=rw.empty_batches)),
             ("capacity_too_small", dict(fn=rw.capacity_too_small)),
             ("dataloader_fails", dict(fn=rw.dataloader_fails))]
    return launch_cases(call, [key for key, _ in cases], [kwargs for _, kwargs in cases], timeout_s=300)


@pytest.fixture(scope="module")
def bad_id_runs(launched):
    return {case: launched[case] for case in BAD_IDS}


@pytest.mark.multiprocess
@pytest.mark.parametrize("sharding,value", BAD_IDS)
def test_bad_id_is_refused_before_it_is_sent_and_training_continues(bad_id_runs, sharding, value):
    for res in ok(bad_id_runs[(sharding, value)]):
        assert res["error"] is not None and "IdOutOfRangeError" in res["error"]
        assert f"id {value} is out of range [0, 300)" in res["error"] and "table 't1'" in res["error"]
        # which batch: the pipeline reads batches ahead of the one it trains (a user trial)
        assert "the pipeline's batch 3 (counted from 0" in res["error"], res["error"]
        assert res["continued"] == 3 and res["params_intact"]


@pytest.mark.multiprocess
def test_bad_id_on_one_rank_fails_the_job_naming_that_rank():
    # The launcher stops at the first rank that reports an error (the other one, waiting in a
    # collective, is not waited for: that would end in "did not finish", which fails the match).
    with pytest.raises(RankFailure, match=r"rank 0 failed:[\s\S]*feature 'f1' \(table 't1'\): id 999"):
        run_ranks(rw.bad_ids, world_size=2, timeout_s=120, sharding="row_wise", value=999, only_rank=0)


@pytest.mark.multiprocess
def test_nan_dense_batch_is_refused_and_recovery_is_exact(launched):
    for res in ok(launched["recovery_is_exact"]):
        assert res["error"] and "batch 4" in res["error"] and "NaN or Inf" in res["error"]
        assert res["equal"], res


@pytest.mark.multiprocess
def test_empty_batches_and_a_rank_without_ids_match_stock(launched):
    for res in ok(launched["empty_batches"]):
        assert res["n"] == 6 and res["max_diff"] < 1e-5 and res["out_diff"] < 1e-5


@pytest.mark.multiprocess
def test_cache_too_small_for_depth_still_trains_exactly_counts_and_warns_once(launched):
    results = ok(launched["capacity_too_small"])
    for res in results:
        assert res["n"] == 8 and res["bitwise"], res
        # the table owner's rank waited for pins, and served what never fit from the host tier
    assert sum(r["deferred"] for r in results) > 0 and sum(r["overflow"] for r in results) > 0, results
    # the effective depth is counted (ProactiveStats.prefetch_lead_lookups): per batch, how many
    # lookups ahead its fetch was issued. Reactive: 0. Depth 4 with room: batch 0 is fetched
    # at its lookup, batches 1-4 are planned in batch 0's output all-to-all, then batch j + 4
    # in batch j's: batch j runs min(j, 4) lookups ahead. Batches that waited for pins (here:
    # until their lookup) ran with less lead.
    for res in results:
        leads = res["leads"]
        assert leads["batches"] == 8 and leads["depth0"] == 0, leads
        assert leads["roomy_deferred"] == 0 and leads["roomy_depth4"] == sum(min(j, 4) for j in range(8)), leads
    waited = [r["leads"] for r in results if r["deferred"]]
    assert waited and all(w["small_cache_depth4"] < w["roomy_depth4"] for w in waited), waited
    for res in results:
        waits = [w for w in res["warnings"] if "fetch waits" in w]
        served = [w for w in res["warnings"] if "were served from the host tier" in w]
        assert len(waits) <= 1 and len(served) <= 1, res["warnings"]  # each once, not per batch
        assert len(waits) + len(served) == len(res["warnings"]), res["warnings"]
        if res["deferred"]:
            assert waits and "slots are needed" in waits[0] and "load_factor" in waits[0], res
        if res["overflow"]:
            assert served and "slots" in served[0] and "load_factor" in served[0], res


@pytest.mark.multiprocess
def test_ranks_with_different_depths_fail_clearly_instead_of_hanging():
    with pytest.raises(RankFailure, match=r"ranks disagree on the pipeline.*prefetch_depth="):
        run_ranks(rw.mismatched_depths, world_size=2, timeout_s=120)


@pytest.mark.multiprocess
@pytest.mark.parametrize("sigkill, cause", [(False, "died with exit code 3"),
                                            (True, r"was killed \(SIGKILL: most often the out-of-memory killer")])
def test_a_rank_killed_mid_training_fails_the_job_with_its_cause(sigkill, cause):
    # Found by the death watcher, not by the launch timeout (that one says "did not finish"):
    # the job fails as soon as the rank is gone, naming it and how it ended.
    with pytest.raises(RankFailure, match=f"rank 1 {cause}"):
        run_ranks(rw.dies_mid_training, world_size=2, timeout_s=120, pg_timeout_s=30, sigkill=sigkill)


@pytest.mark.multiprocess
def test_failing_dataloader_drains_without_leaking_pins(launched):
    for res in ok(launched["dataloader_fails"]):
        assert res == {"error": "dataloader worker crashed", "pins": 0}
