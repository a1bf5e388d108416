"""Issue #25, parts 1 and 2: nothing stale, nothing pinned by chance.

1. Whatever a user writes in place into the tensors TorchRec exposes (``state_dict()``,
   ``named_parameters()``, ``dcp.load`` into both state dicts) is what the next lookup reads,
   with batches in flight, at every depth and cache size - as with stock TorchRec.
2. Pin lifetime follows a rule, not the garbage collector: a training forward's pins end at
   its backward, or at the module's next training forward (or a flush, load or reset) when
   no backward came first; a backward that comes later still updates its rows exactly.
   These checks run with ``gc.disable()``; on 2+ ranks TorchRec's all-to-all holds the
   autograd graph in a reference cycle, so a finalizer-based release would never run.

Rank-side code: tests/inplace_worker.py (stock TorchRec and the plugin side by side).
"""

from __future__ import annotations

import pytest

from torchrec_proactive.launch import run_ranks

from . import inplace_worker

TOL = 1e-5


def _launch(world_size: int, checks):
    return run_ranks(inplace_worker.run_checks, world_size=world_size, timeout_s=540, pg_timeout_s=120,
                     checks=checks)


def _ok(results, name):
    out = []
    for rank, res in enumerate(results):
        assert "error" not in res[name], f"rank {rank}: check {name} raised:\n{res[name]['error']}"
        out.append(res[name]["ok"])
    return out


def _checks(tmp, world_size, sharding):
    return {
        "inplace_writes": {"ckpt_dir": str(tmp), "depth": 2, "load_factor": 0.3, "sharding": sharding},
        "pins_without_gc": {"load_factor": 0.35, "dropped": 30},
        "late_backward": {"load_factor": 0.1},
        "late_backward_device_planner": {"load_factor": 0.1, "planner": "device"},
    }


# (conftest's inplace_and_stale_launches runs _checks(..., 2, "row_wise") on 2 ranks and
# _checks(..., 1, "table_wise_rank0") on 1, in the launches test_stale_writes' checks share)
@pytest.fixture(scope="module")
def two_ranks(inplace_and_stale_launches):
    return inplace_and_stale_launches[("inplace", 2)]


@pytest.fixture(scope="module")
def one_rank(inplace_and_stale_launches):
    return inplace_and_stale_launches[("inplace", 1)]


def _assert_inplace(results):
    for res in _ok(results, "inplace_writes"):
        assert res["zeroed"], res  # the user's loop found the table's parameter
        assert res["n_out"][0] == res["n_out"][1] == 12, res
        # dcp.load into the state dicts' tensors, then training: stock's results.
        assert res["after_load_param_diff"] < TOL, res
        assert res["out_diff"] < TOL and res["final_param_diff"] < TOL, res
        assert res["eval_diff"] < TOL, res
        # A table zeroed through named_parameters() pools to zero at the next lookup.
        assert res["t1_pooled_abs_max"] == (0.0, 0.0), res


def _assert_pins(results):
    for res in _ok(results, "pins_without_gc"):
        r = res["no_gc"]
        assert r["n_stores"] >= 1, res
        # The rule: at most the last forward (whose backward may still come) holds pins.
        assert max(r["in_flight_after_peek"]) <= 1 and r["in_flight_before_flush"] <= 1, res
        assert r["in_flight_after_flush"] == 0 and r["in_flight_end"] == 0, res
        # Training after the peeks runs as it would without them: never the whole cache
        # pinned, nothing served from the host tier.
        assert r["max_pinned"] < r["slots"], res
        assert r["stats"]["overflow_rows"] == res["clean_stats"]["overflow_rows"] == 0, res
        assert r["stats"]["deferred_batches"] <= res["clean_stats"]["deferred_batches"], res
        # Nothing depends on when (or whether) the cycle collector runs.
        assert res["gc_independent"], res


def _assert_late_backward(results):
    for name in ("late_backward", "late_backward_device_planner"):
        for res in _ok(results, name):
            assert res["param_diff"] < TOL, (name, res)
            assert res["late_updates"] > 0 and res["in_flight_end"] == 0, (name, res)


@pytest.mark.slow  # (the same cases on 1 rank run in the default suite; 2 ranks: -m slow)
@pytest.mark.multiprocess
def test_inplace_writes_are_read_by_the_next_lookup_2_ranks(two_ranks):
    _assert_inplace(two_ranks)


@pytest.mark.slow  # (the same cases on 1 rank run in the default suite; 2 ranks: -m slow)
@pytest.mark.multiprocess
def test_pins_do_not_depend_on_the_gc_2_ranks(two_ranks):
    _assert_pins(two_ranks)


@pytest.mark.slow  # (the same cases on 1 rank run in the default suite; 2 ranks: -m slow)
@pytest.mark.multiprocess
def test_a_backward_after_the_next_forward_is_exact_2_ranks(two_ranks):
    _assert_late_backward(two_ranks)


def test_inplace_writes_are_read_by_the_next_lookup_1_rank(one_rank):
    _assert_inplace(one_rank)


def test_pins_do_not_depend_on_the_gc_1_rank(one_rank):
    _assert_pins(one_rank)


def test_a_backward_after_the_next_forward_is_exact_1_rank(one_rank):
    _assert_late_backward(one_rank)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_pins_and_inplace_writes_4_ranks(tmp_path):
    results = _launch(4, {
        "inplace_writes": {"ckpt_dir": str(tmp_path), "depth": 1, "load_factor": 0.5, "sharding": "row_wise"},
        "pins_without_gc": {"load_factor": 0.35, "dropped": 20},
    })
    _assert_inplace(results)
    _assert_pins(results)
