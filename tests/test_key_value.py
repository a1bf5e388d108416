"""Issue 42 item 4: tables planned the way TorchRec offloads tables to SSD - compute kernel
``key_value`` with ``ParameterConstraints(key_value_params=KeyValueParams(
ssd_storage_directory=DIR))`` - are served by the proactive sharder from the three-tier store
(device cache <- DRAM host cache <- a file per table shard), on gloo ranks, exactly.

Rank-side code: tests/key_value_worker.py.
"""

from __future__ import annotations

import pytest

from . import key_value_worker
from .cases_worker import launch_cases, ok

TOL = 1e-5
CASES = [("table_wise", "rowwise_adagrad"), ("row_wise", "sgd"), ("column_wise", "adam"),
         ("table_row_wise", "rowwise_adagrad")]
_results = {}


def _case(tmp_path_factory, key):
    """The module's 2-rank cases, all in one launch (starting ranks costs more than a case):
    CASES against stock, and "load_mid_pipeline"."""
    if not _results:
        from .cases_worker import call

        base = tmp_path_factory.mktemp("kv")
        _results.update(launch_cases(
            call, [*CASES, "load_mid_pipeline"],
            [*({"fn": key_value_worker.check_against_stock, "sharding": s, "optim": o,
                "directory": str(base / f"{s}-{o}")} for s, o in CASES),
             {"fn": key_value_worker.check_load_mid_pipeline, "directory": str(base / "load_mid_pipeline")}],
            timeout_s=300))
    return ok(_results[key])


@pytest.mark.parametrize("sharding,optim", CASES)
def test_key_value_tables_train_as_stock(tmp_path_factory, sharding, optim):
    for rank, res in enumerate(_case(tmp_path_factory, (sharding, optim))):
        for run in ("depth2_disk2", "depth0_disk0", "depth1_disk4"):
            r = res[run]
            assert r["param_diff"] <= TOL and r["out_diff"] <= TOL, (rank, run, r)
            # the tables lived on disk: rows came from and went to the files, which are gone at close
            assert r["rows_read"] > 0 and r["rows_written"] > 0, (rank, run, r)
            assert r["table_stats_rows_read"] == r["rows_read"] and r["host_cache_rows"], (rank, run, r)
            assert r["files_while_alive"] >= 1 and r["files_after_close"] == 0, (rank, run, r)
        # disk_depth 4 > prefetch_depth 1: batches were staged, their rows read before their plan
        staged, plain = res["depth1_disk4"], res["depth2_disk2"]
        assert staged["staged_batches"] > 0 and staged["stage_rows_read"] > 0, (rank, staged)
        assert staged["plan_rows_hit"] > 0, (rank, staged)
        assert plain["staged_batches"] == 0 and plain["stage_rows_read"] == 0, (rank, plain)
        assert res["depths_bit_identical"], rank


def test_a_load_with_batches_in_flight_applies_whole(tmp_path_factory):
    assert _case(tmp_path_factory, "load_mid_pipeline") == [True, True]
