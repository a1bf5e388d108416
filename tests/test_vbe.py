"""Variable batch per feature (VBE) through the proactive EBC sharder on 2 gloo ranks: the
same outputs (expanded by ``inverse_indices``) and parameters as stock TorchRec, and
bit-identical across depths at a 20% cache, table-wise and row-wise (the sharding types stock
TorchRec supports with VBE)."""

from __future__ import annotations

import pytest

from . import exactness_worker
from .cases_worker import launch_cases, ok

pytestmark = pytest.mark.multiprocess

CASES = {"table_wise": dict(sharding="table_wise", depths=[0, 2]),
         "row_wise": dict(sharding="row_wise", depths=[0, 1, 2])}


@pytest.fixture(scope="module")
def runs():
    return launch_cases(exactness_worker.vbe_and_compare, list(CASES), list(CASES.values()))


@pytest.mark.parametrize("name", list(CASES))
def test_vbe_matches_stock_and_is_exact_across_depths(runs, name):
    for res in ok(runs[name]):
        assert res["n_out"] == 6
        assert len(set(res["rows_requested"].values())) == 1 and res["rows_requested"][0] > 0
        assert res["hit_rate"][0] < 1.0  # a 20% cache: rows were fetched
        assert res["bitwise_equal_across_depths"], res
        assert res["same_keys_as_stock"]
        assert res["max_param_diff_vs_stock"] < 1e-5, res
        assert res["max_out_diff_vs_stock"] < 1e-5, res
