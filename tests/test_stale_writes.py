"""Issue #40, items 1-3: writes through tensors taken earlier, ``reset_parameters()`` and
training in ``model.eval()`` lose no training - against stock TorchRec on gloo ranks.

1. A write through any tensor the module handed out, whenever it was taken, changes
   exactly the rows written: every other row (and every other table of the group) keeps
   the updates its cache holds, and the written rows read as written - stock's results.
   Reads through a tensor taken earlier show the host tier as of the last write-back (said
   in the docstrings); a ``state_dict()`` writes the cache back, after which they are live.
2. ``reset_parameters()`` re-initialises the weights and keeps the optimizer state.
3. ``model.eval()`` training updates the tables in backward, as FBGEMM does in any mode; an
   evaluation pipeline (the model in eval mode) updates nothing, as stock's.

Rank-side code: tests/stale_writes_worker.py.
"""

from __future__ import annotations

import pytest

from torchrec_proactive.launch import run_ranks

from . import stale_writes_worker

TOL = 1e-5
PATHS = ["named_parameters_rows", "named_parameters_copy", "state_dict_row", "registered_attribute",
         "optimizer_state", "numpy_rows", "data_rows", "scale_table"]


def _launch(world_size: int, checks):
    return run_ranks(stale_writes_worker.run_checks, world_size=world_size, timeout_s=540, pg_timeout_s=120,
                     checks=checks)


def _ok(results, name):
    out = []
    for rank, res in enumerate(results):
        assert "error" not in res[name], f"rank {rank}: check {name} raised:\n{res[name]['error']}"
        out.append(res[name]["ok"])
    return out


def _checks(sharding: str):
    return {
        "stale_writes": {"paths": PATHS, "sharding": sharding},
        "stale_reads": {"sharding": sharding},
        "reset_keeps_state": {"sharding": sharding},
        "eval_mode_training": {"sharding": sharding},
    }


# (conftest's inplace_and_stale_launches runs _checks("table_wise_rank0") on 1 rank and
# _checks("row_wise") on 2, in the launches test_inplace_and_pins' checks share)
@pytest.fixture(scope="module")
def one_rank(inplace_and_stale_launches):
    return inplace_and_stale_launches[("stale", 1)]


@pytest.fixture(scope="module")
def two_ranks(inplace_and_stale_launches):
    return inplace_and_stale_launches[("stale", 2)]


def _assert_stale_writes(results):
    for res in _ok(results, "stale_writes"):
        for path in PATHS:
            r = res[path]
            assert r["n_out"][0] == r["n_out"][1] == 12, (path, r)
            assert r["out_diff"] < TOL, (path, r)
            assert r["param_diff"] < TOL and r["opt_diff"] < TOL, (path, r)


def _assert_stale_reads(results):
    for res in _ok(results, "stale_reads"):
        assert res["early_vs_stock_live"] < TOL, res


def _assert_reset(results):
    for res in _ok(results, "reset_keeps_state"):
        assert res["stock_state_max"] > 0, res  # the state a lossy reset would drop
        assert res["reset_param_diff"] < TOL and res["reset_state_diff"] < TOL, res
        assert res["out_diff"] < TOL and res["param_diff"] < TOL and res["opt_diff"] < TOL, res


def _assert_eval_mode(results):
    for res in _ok(results, "eval_mode_training"):
        assert res["trained"] > 1e-4, res  # the tables did train
        assert res["param_diff"] < TOL, res
        assert res["eval_pipeline_changed"] == 0.0 and res["eval_pipeline_diff"] < TOL, res


def test_writes_through_early_tensors_lose_nothing_1_rank(one_rank):
    _assert_stale_writes(one_rank)


def test_early_tensors_read_live_values_after_a_write_back_1_rank(one_rank):
    _assert_stale_reads(one_rank)


def test_reset_parameters_keeps_optimizer_state_1_rank(one_rank):
    _assert_reset(one_rank)


def test_training_in_eval_mode_updates_tables_1_rank(one_rank):
    _assert_eval_mode(one_rank)


@pytest.mark.multiprocess
def test_writes_through_early_tensors_lose_nothing_2_ranks(two_ranks):
    _assert_stale_writes(two_ranks)


@pytest.mark.multiprocess
def test_reset_and_eval_mode_training_2_ranks(two_ranks):
    _assert_stale_reads(two_ranks)
    _assert_reset(two_ranks)
    _assert_eval_mode(two_ranks)
