"""TorchRec integration on 2 gloo ranks: exactness vs stock TorchRec, ordering, drain, interop.

The 2-rank cases of this module run in one launch (the module fixture ``launched``; each
test's fixture is its view of it): starting 2 ranks - spawning, importing torch and
TorchRec, the process group - takes ~10 s on 2 cores, more than most of these checks. A case
that raises fails its own test only. (test_modules_on_different_ranks_keep_the_collectives_in_step
keeps a launch of its own: the hang it guards against would stop every case of a shared one.)
"""

from __future__ import annotations

import pytest

from torchrec_proactive.launch import run_ranks

from . import exactness_worker, pipeline_worker
from .cases_worker import call as _call
from .cases_worker import launch_cases as _launch_cases
from .cases_worker import ok as _ok

pytestmark = pytest.mark.multiprocess

SHARDINGS = {
    "table_wise": "table_wise",
    "row_wise": "row_wise",
    "column_wise": "column_wise",
    "table_row_wise": "table_row_wise",
    # data-parallel tables keep working beside proactive ones
    "mixed_with_dp": {"t0": "row_wise", "t1": "table_wise", "t2": "column_wise", "t3": "data_parallel"},
}


# Load factors from 0.5% (smaller than one batch's rows: part of a batch is served from the
# host tier) through 10% (prefetches wait for pins at the deeper depths) to 100%.
LOAD_FACTORS = [0.005, 0.1, 1.0]
DEPTHS = [0, 1, 2, 4, 8]


def _check_matrix(results, n_runs):
    for res in results:
        assert len(res["runs"]) == n_runs
        for key, run in res["runs"].items():
            assert run["n_out"] == 5, key
            # bit-identical across depths and cache sizes (per optimizer)
            assert run["bitwise_equal_to_first"], key
            if "max_param_diff_vs_stock" in run:
                assert run["same_keys_as_stock"], key
                assert run["max_param_diff_vs_stock"] < 1e-5, (key, run)
                assert run["max_out_diff_vs_stock"] < 1e-5, (key, run)
    return results


def _cases():
    """(key, cases_worker.call's kwargs) of every case the module's one 2-rank launch runs."""
    return [
        *((("any_cache", name), dict(fn=exactness_worker.matrix, sharding=SHARDINGS[name],
                                     optimizers=["rowwise_adagrad"], depths=DEPTHS, caches=LOAD_FACTORS))
          for name in SHARDINGS),
        *((("device_planner", case), dict(fn=exactness_worker.matrix, sharding=SHARDINGS[case[0]],
                                          optimizers=["rowwise_adagrad"], depths=DEVICE_DEPTHS, caches=DEVICE_CACHES,
                                          planner="device", one_id_per_bag=case[1], weighted=case[2]))
          for case in DEVICE_PLANNER),
        *((("one_id", case), dict(fn=exactness_worker.matrix, sharding=SHARDINGS[case[0]],
                                  optimizers=["rowwise_adagrad"], depths=[0, 2, 8], caches=[0.005, 1.0],
                                  one_id_per_bag=True, weighted=case[1], pooling=case[2]))
          for case in ONE_ID),
        ("every_optimizer", dict(fn=exactness_worker.matrix, sharding="row_wise",
                                 optimizers=["sgd", "adagrad", "adam"], depths=[0, 2, 8], caches=[0.005, 1.0])),
        *((("ordering", depth), dict(fn=pipeline_worker.ordering, depth=depth, steps=8)) for depth in (1, 3)),
        *((("drain", case), dict(fn=pipeline_worker.drain, num_batches=case[0], depth=case[1])) for case in DRAINS),
        ("eval_and_stop_early", dict(fn=pipeline_worker.eval_and_stop_early)),
        *((("interop", s), dict(fn=pipeline_worker.state_dict_interop, sharding=s)) for s in ("row_wise", "column_wise")),
        *((("resume", o), dict(fn=pipeline_worker.checkpoint_resume, optimizer=o)) for o in ("rowwise_adagrad", "adam")),
        ("planner_auto", dict(fn=exactness_worker.planner_auto)),
        *((("weighted", s), dict(fn=exactness_worker.weighted_features, sharding=s)) for s in ("table_wise", "row_wise")),
        ("deferred_prepare_once", dict(fn=pipeline_worker.deferred_batches_prepare_once)),
        *((("turns", case), dict(fn=pipeline_worker.interleaved_validation, load_factor=case[0], validation=case[1],
                                 planner=case[2])) for case in TURNS),
        ("leaked_pins", dict(fn=pipeline_worker.leaked_pins)),
    ]


@pytest.fixture(scope="module")
def launched():
    cases = _cases()
    return _launch_cases(_call, [key for key, _ in cases], [kwargs for _, kwargs in cases])


def _view(launched, kind: str, keys) -> dict:
    return {key: launched[(kind, key)] for key in keys}


@pytest.fixture(scope="module")
def any_cache_runs(launched):
    return _view(launched, "any_cache", SHARDINGS)


@pytest.mark.parametrize("name", list(SHARDINGS))
def test_any_cache_size_and_depth_is_exact_vs_stock(any_cache_runs, name):
    results = _check_matrix(_ok(any_cache_runs[name]), n_runs=len(DEPTHS) * len(LOAD_FACTORS))
    def total(run: str, key: str) -> int:
        return sum(res["runs"][f"rowwise_adagrad/{run}"][key] for res in results)

    # the tiny cache really is smaller than a batch, and the deep pipeline really waits
    assert total("0.005/k0", "overflow_rows") > 0
    assert total("0.005/k8", "deferred_batches") > 0
    assert total("1.0/k8", "deferred_batches") == 0 and total("1.0/k8", "overflow_rows") == 0

    # each is said once per module, with the cache size that would avoid it
    def warnings_of(run: str) -> list:
        return [w for res in results for w in res["runs"][f"rowwise_adagrad/{run}"]["cache_warnings"]]

    waits = [w for w in warnings_of("0.005/k8") if "fetch waits" in w]
    assert 1 <= len(waits) <= 2 and "slots are needed" in waits[0], warnings_of("0.005/k8")
    served = [w for w in warnings_of("0.005/k0") if "were served from the host tier" in w]
    assert served and "A cache of at least" in served[0], warnings_of("0.005/k0")
    assert warnings_of("1.0/k8") == [] and warnings_of("1.0/k0") == []


DEVICE_PLANNER = [("mixed_with_dp", False, True), ("row_wise", True, False)]
DEVICE_DEPTHS, DEVICE_CACHES = [0, 2, 8], [0.005, 0.1, 1.0]


@pytest.fixture(scope="module")
def device_planner_runs(launched):
    return _view(launched, "device_planner", DEVICE_PLANNER)


@pytest.mark.parametrize("name,one_id_per_bag,weighted", DEVICE_PLANNER)
def test_the_device_planner_is_exact_vs_stock_through_torchrec(device_planner_runs, name, one_id_per_bag, weighted):
    """The planner CUDA uses (fixed-shape, on the device: TieredTable(planner="device")), run on CPU through
    TorchRec's sharding on 2 ranks: bit-identical across depths and caches, stock's numbers."""
    results = _check_matrix(_ok(device_planner_runs[(name, one_id_per_bag, weighted)]),
                            n_runs=len(DEVICE_DEPTHS) * len(DEVICE_CACHES))
    runs = [res["runs"] for res in results]
    assert sum(r["rowwise_adagrad/0.005/k0"]["overflow_rows"] for r in runs) > 0
    assert sum(r["rowwise_adagrad/0.005/k8"]["deferred_batches"] for r in runs) > 0


ONE_ID = [("table_wise", True, "sum"), ("column_wise", False, "mean"), ("row_wise", True, "sum"),
          ("table_row_wise", False, "mean")]


@pytest.fixture(scope="module")
def one_id_runs(launched):
    return _view(launched, "one_id", ONE_ID)


@pytest.mark.parametrize("name,weighted,pooling", ONE_ID)
def test_one_id_per_feature_is_exact_vs_stock(one_id_runs, name, weighted, pooling):
    # Criteo's shape: every bag holds one id, so lookups are gathers and the pooled rows are
    # laid out sample-major directly (row-wise shardings also see empty bags after the
    # bucketisation, and take the general path).
    _check_matrix(_ok(one_id_runs[(name, weighted, pooling)]), n_runs=3 * 2)


def test_every_optimizer_is_exact_across_depths_and_caches(launched):
    # (row_wise, sgd/adagrad/adam, depths 0, 2, 8, caches 0.005 and 1.0: see _cases)
    results = _check_matrix(_ok(launched["every_optimizer"]), n_runs=3 * 3 * 2)
    for res in results:
        adam_runs = [k for k in res["runs"] if k.startswith("adam")]
        assert adam_runs and all("max_param_diff_vs_stock" not in res["runs"][k] for k in adam_runs)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SHARDINGS))
def test_full_matrix_every_optimizer_sharding_cache_and_depth(name):
    results = _check_matrix(run_ranks(
        exactness_worker.matrix, world_size=2, timeout_s=1200, sharding=SHARDINGS[name],
        optimizers=["sgd", "adagrad", "rowwise_adagrad", "adam"], depths=DEPTHS, caches=LOAD_FACTORS,
    ), n_runs=4 * len(DEPTHS) * len(LOAD_FACTORS))
    for res in results:
        adam_runs = [k for k in res["runs"] if k.startswith("adam")]
        assert adam_runs and all("max_param_diff_vs_stock" not in res["runs"][k] for k in adam_runs)


@pytest.fixture(scope="module")
def orderings(launched):
    return _view(launched, "ordering", [1, 3])


@pytest.mark.parametrize("depth", [1, 3])
def test_fetch_of_batch_n_plus_k_is_planned_during_forward_n(orderings, depth):
    results = _ok(orderings[depth])
    for res in results:
        records = {r["index"]: r for r in res["records"]}
        fwd = res["fwd"]
        assert sorted(records) == list(range(8)) and sorted(fwd) == list(range(8))
        for j, rec in records.items():
            # no forward reads a row before its fetch completed
            assert rec["completed"] is not None and rec["completed"] <= rec["lookup"] + 1e-6, rec
            assert rec["lookup"] <= fwd[j][1]
            if j >= depth:
                # fetch of batch N+k issued before forward of batch N finished, and planned
                # while N's output all-to-all ran (after N's lookup), off the critical path
                assert rec["issued"] < fwd[j - depth][1], (j, rec, fwd[j - depth])
                assert rec["issued"] > records[j - depth]["lookup"], (j, rec, records[j - depth])
        lanes = {e["lane"] for e in res["events"]}
        assert {"data_dist", "fetch", "compute"} <= lanes
        # Only the first batch (nothing ran before it to hide behind) copied rows at its lookup.
        assert records[0]["fetched"] > 0
        assert res["stats"]["rows_fetched_at_lookup"] == records[0]["fetched"]
        assert res["stats"]["rows_fetched"] > records[0]["fetched"]


DRAINS = [(0, 2), (1, 2), (2, 4), (3, 2)]


@pytest.fixture(scope="module")
def drains(launched):
    return _view(launched, "drain", DRAINS)


@pytest.mark.parametrize("num_batches,depth", DRAINS)
def test_drain_with_fewer_batches_than_pipeline_depth(drains, num_batches, depth):
    for res in _ok(drains[(num_batches, depth)]):
        assert res == {"n": num_batches, "n2": num_batches}


def test_eval_and_early_stop_leak_no_pins(launched):
    for res in _ok(launched["eval_and_stop_early"]):
        assert res["eval_n"] == 6 and res["unchanged"]


@pytest.fixture(scope="module")
def interops(launched):
    return _view(launched, "interop", ["row_wise", "column_wise"])


@pytest.mark.parametrize("sharding", ["row_wise", "column_wise"])
def test_state_dict_round_trip_with_stock_torchrec(interops, sharding):
    for res in _ok(interops[sharding]):
        assert res["to_stock"] and res["shapes_match"]
        assert res["from_stock_pred_diff"] < 1e-6


@pytest.fixture(scope="module")
def resumes(launched):
    return _view(launched, "resume", ["rowwise_adagrad", "adam"])


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
def test_model_and_optimizer_state_dicts_resume_bit_identically(resumes, optimizer):
    for res in _ok(resumes[optimizer]):
        assert res["outputs_equal"] and res["params_equal"], res


def test_torchrec_planner_auto_plan_on_cpu(launched):
    for res in _ok(launched["planner_auto"]):
        assert res["kernels"] == ["fused_uvm_caching"] and res["n_proactive_kernels"] >= 1
        assert res["max_param_diff"] < 1e-5 and res["max_out_diff"] < 1e-5


@pytest.fixture(scope="module")
def weighted_runs(launched):
    return _view(launched, "weighted", ["table_wise", "row_wise"])


@pytest.mark.parametrize("sharding", ["table_wise", "row_wise"])
def test_weighted_features_match_stock(weighted_runs, sharding):
    for res in _ok(weighted_runs[sharding]):
        assert res["n"] == 5 and res["max_param_diff"] < 1e-5 and res["max_out_diff"] < 1e-5, res


def test_a_deferred_prefetch_is_prepared_once_and_retried_on_the_store_only(launched):
    for res in _ok(launched["deferred_prepare_once"]):
        once = res["kernels"] * res["steps"]
        assert res["stats"]["deferred_batches"] > 0, res  # the cache really made prefetches wait
        assert res["calls"]["prepare"] == once, res
        assert res["calls"]["plan"] > once, res  # ... and they were planned again


TURNS = [(0.01, "proactive", "host"), (0.1, "proactive", "host"), (0.01, "stock_eval", "host"),
         (0.1, "stock_eval", "host"), (0.01, "plain_forward", "host"), (0.1, "plain_forward", "host"),
         (0.01, "proactive", "device")]


@pytest.fixture(scope="module")
def turns(launched):
    return _view(launched, "turns", TURNS)


@pytest.mark.parametrize("load_factor,validation,planner", TURNS)
def test_pipelines_take_turns_on_one_model_as_in_stock(turns, load_factor, validation, planner):
    """Mid-epoch validation by a second pipeline (or plain forwards) while the training
    pipeline holds batches in flight: each pipeline owns its batches; results equal stock's."""
    for res in _ok(turns[(load_factor, validation, planner)]):
        assert res["n"] == res["n_ref"] == [10, 4], res
        assert res["train_diff"] < 1e-5 and res["val_diff"] < 1e-5 and res["param_diff"] < 1e-5, res
        if load_factor == 0.01:  # smaller than one batch: evictions, waits and overflow happened
            assert res["stats"]["overflow_rows"] > 0 and res["stats"]["rows_written_back"] > 0, res["stats"]


def test_no_pin_outlives_its_batch_and_loads_apply_mid_flight(launched):
    for res in _ok(launched["leaked_pins"]):
        # Six forwards whose loss was dropped pin nothing more than the last one, whose graph
        # DDP keeps until the next forward (it used to be all six: 153 of 200 slots).
        assert res["in_flight_after_peeks"] <= 1 and res["pins_after_peeks"] < res["slots"] // 2, res
        assert res["lookup_after_load_reads_loaded_rows"], res
        assert res["load_after_peeks"] and res["drained_after_drop"] and res["model_load_applied"], res


def test_stats_per_table_add_up_to_the_totals_and_reset():
    """``stats(per_table=True)``: each store's figures, keyed by the tables it serves (a
    TorchRec group of several tables is one store: ``t0+t1``), adding up to ``stats()``;
    ``reset_stats()`` zeroes both, and counting starts again from the next batch."""
    res = run_ranks(pipeline_worker.per_table_stats, world_size=1)[0]
    for phase in ("before", "after"):
        total, tables = res[phase]["total"], res[phase]["tables"]
        assert sorted(tables) == ["t0+t1", "t2"], tables
        for key in ("rows_requested", "hits", "rows_fetched", "rows_written_back", "bytes_moved", "overflow_rows"):
            assert sum(t[key] for t in tables.values()) == total[key], (phase, key, tables, total)
        for t in tables.values():
            assert t["rows_requested"] > 0 and t["hit_rate"] == t["hits"] / t["rows_requested"]
    assert res["before"]["total"]["batches"] == 5 and res["after"]["total"]["batches"] == 3
    reset = res["reset"]
    assert all(v == 0 for k, v in reset["total"].items() if k != "hit_rate"), reset["total"]
    assert all(v == 0 for t in reset["tables"].values() for k, v in t.items() if k != "hit_rate"), reset["tables"]
    assert res["after"]["total"]["rows_requested"] < res["before"]["total"]["rows_requested"]


def test_modules_on_different_ranks_keep_the_collectives_in_step():
    """A user trial's model (a history table and an EBC fed from one KJT, the history held
    by one rank only): every rank trains every batch - with an EBC for the history at depth 1,
    and with an EC for it at depth 2 with a cache so small that one rank's prefetches wait.
    (Before: a rank with batches waiting to be planned wrapped its module's output all-to-all
    and a rank without did not; the ranks' backward all-to-alls then came in different orders,
    and gloo hung, or aborted with "Received data size doesn't match expected size".)"""
    cases = {"ebc_depth1": dict(depth=1, history_as="ebc", load_factors={"t_history": 0.5, "t_user": 0.5, "t_cat": 0.5}),
             "ec_depth2_waits": dict(depth=2, history_as="ec",
                                     load_factors={"t_history": 0.5, "t_user": 0.5, "t_cat": 0.2})}
    runs = _launch_cases(pipeline_worker.modules_on_different_ranks, list(cases), list(cases.values()), timeout_s=90)
    assert [r["steps"] for r in _ok(runs["ebc_depth1"])] == [10, 10]
    waits = _ok(runs["ec_depth2_waits"])
    assert [r["steps"] for r in waits] == [10, 10]
    assert any(r["deferred"] > 0 for r in waits), waits  # (the case that aborted: prefetches waited)
