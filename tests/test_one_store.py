"""One store, two planners (issue 30): ``TieredTable`` holds the data path once; the host
and device planners differ only in where the bookkeeping lives, and both hand back the one
``FetchPlan``. So a rule about data (moves, updates, statistics, pins) is written once and
holds for both."""

from __future__ import annotations

import gc

import pytest
import torch

from torchrec_proactive.fetch import FetchEngine
from torchrec_proactive.fetch.lookahead import run_lookahead
from torchrec_proactive.store import (
    DevicePlanner,
    FetchPlan,
    HostPlanner,
    OptimizerConfig,
    OptimType,
    TieredTable,
    pooled_lookup,
)

ROWS, DIM = 600, 4

# What moves data, updates rows or keeps statistics: the table's alone.
DATA_PATH = ("transfer", "enqueue_moves", "gather_host", "fill", "write_back", "apply_gradients",
             "release", "count_forward", "external_writes", "invalidate", "plan_flush", "plan_refresh")


def _batches(steps=12, bags=32, per_bag=3, seed=0, high=ROWS):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        values = torch.randint(0, high, (bags * per_bag,), generator=g)
        offsets = torch.arange(0, bags * per_bag + 1, per_bag)
        out.append((values, offsets, None, torch.randn(bags, DIM, generator=g)))
    return out


def _train(planner: str, slots: int, depth: int, hot_rows=None, high=ROWS):
    torch.manual_seed(0)
    table = TieredTable("t", torch.randn(ROWS, DIM), OptimizerConfig(OptimType.EXACT_ROWWISE_ADAGRAD),
                        num_slots=slots, planner=planner, hot_rows=hot_rows)
    engine = FetchEngine()
    anchor = torch.empty(0, requires_grad=True)
    plans = []

    def consume(i, tb, batch):
        plans.append(tb.plan)
        pooled_lookup(tb, anchor).backward(batch[3])

    run_lookahead(table, engine, _batches(high=high), depth, consume)
    engine.flush([table])
    engine.drain()
    for plan in plans:
        plan.resolve_sizes()  # (a device plan's sizes, where a drain would read them)
    return table, plans


def test_the_planners_keep_bookkeeping_only():
    for planner_type in (HostPlanner, DevicePlanner):
        defined = {name for name in DATA_PATH if name in vars(planner_type)}
        assert not defined, f"{planner_type.__name__} defines the table's {sorted(defined)}"
    host, _ = _train("host", 200, 1)
    device, _ = _train("device", 200, 1)
    assert type(host) is type(device) is TieredTable
    assert isinstance(host.planner, HostPlanner) and isinstance(device.planner, DevicePlanner)


@pytest.mark.parametrize("slots,hot,high", [(ROWS, None, ROWS), (400, torch.arange(0, 50), 300)])
def test_both_planners_count_the_same_statistics_for_the_same_batches(slots, hot, high):
    """A cache that never evicts (all rows; or hot rows, with room for every row the batches
    touch) makes the same
    hits and misses whichever victims a planner would pick, so every counter must agree:
    preloaded rows, fills, flushed write-backs and the bytes they move are counted by one
    rule. (The device table used to leave preloaded rows out of ``rows_fetched`` and the
    host table flushed bytes out of ``bytes_moved``.)"""
    gc.disable()  # (nothing here may depend on the collector)
    try:
        host, host_plans = _train("host", slots, 2, hot, high)
        device, device_plans = _train("device", slots, 2, hot, high)
    finally:
        gc.enable()
    assert device.stats.as_dict() == host.stats.as_dict()
    assert host.stats.rows_written_back > 0 and host.stats.rows_fetched >= (hot.numel() if hot is not None else ROWS)
    assert [type(p) for p in host_plans + device_plans] == [FetchPlan] * (len(host_plans) + len(device_plans))
    assert [p.num_hits for p in device_plans] == [p.num_hits for p in host_plans]
    host.check_invariants(expect_drained=True)
    device.check_invariants(expect_drained=True)
    assert torch.equal(device.host_weight, host.host_weight)


def test_a_flush_of_a_clean_cache_moves_nothing_on_either_planner():
    for planner in ("host", "device"):
        table = TieredTable("t", torch.randn(ROWS, DIM), OptimizerConfig(), num_slots=100, planner=planner)
        engine = FetchEngine()
        engine.flush([table])
        assert table.stats.rows_written_back == 0 and table.stats.bytes_moved == 0
        assert not table.has_dirty()


@pytest.mark.parametrize("planner", ["host", "device"])
def test_a_lookup_before_its_rows_moved_is_refused(planner):
    """Planned but never issued to the fetch engine: the cache does not hold the rows yet, so
    a lookup would read whatever the slots held (it used to, silently)."""
    from torchrec_proactive.store import NotPrefetchedError, plan_table_batch

    table = TieredTable("t", torch.randn(ROWS, DIM), OptimizerConfig(), num_slots=100, planner=planner)
    tb = plan_table_batch(table, torch.tensor([5, 6, 7, 8]), torch.arange(5))
    with pytest.raises(NotPrefetchedError, match="table 't': a batch was looked up but its rows were not moved yet"):
        pooled_lookup(tb, torch.empty(0, requires_grad=True))
    FetchEngine().run([tb.plan])
    out = pooled_lookup(tb, torch.empty(0, requires_grad=True))
    assert torch.equal(out, table.host_weight[5:9])


@pytest.mark.parametrize("planner", ["host", "device"])
def test_a_batch_that_cannot_fit_says_what_to_do(planner):
    from torchrec_proactive.store import CacheCapacityError, plan_table_batch

    table = TieredTable("t", torch.randn(ROWS, DIM), OptimizerConfig(), num_slots=100, planner=planner)
    ids = torch.arange(0, 300)
    with pytest.raises(CacheCapacityError, match="table 't'.*100.*Nothing changed.*overflow=True"):
        plan_table_batch(table, ids, torch.arange(0, 301, 3))
    assert table.in_flight == 0
    tb = plan_table_batch(table, ids, torch.arange(0, 301, 3), overflow=True)
    assert tb.plan.num_overflow == 200


def test_a_lone_device_batch_with_more_ids_than_slots_is_told_that_waiting_cannot_help():
    """The device planner bounds a batch's slots by its id count (it cannot read the unique
    count without a sync): 300 ids of 50 rows in 100 slots wait only while batches are in
    flight; alone, the message must point at overflow=True, which then plans it exactly."""
    from torchrec_proactive.store import CacheCapacityError, plan_table_batch

    table = TieredTable("t", torch.randn(ROWS, DIM), OptimizerConfig(), num_slots=100, planner="device")
    ids, offsets = torch.arange(300) % 50, torch.arange(0, 301, 3)
    with pytest.raises(CacheCapacityError, match="no batch in flight waiting cannot help: plan it with overflow=True"):
        plan_table_batch(table, ids, offsets)
    tb = plan_table_batch(table, ids, offsets, overflow=True)
    assert (tb.plan.num_rows, tb.plan.num_overflow, table.planner.host_syncs) == (50, 0, 1)


def test_plan_ids_gives_the_same_rows_and_inverse_on_both_planners():
    """``TieredTable.plan_ids`` (ids in any order, duplicates allowed) is one API: each id's
    entry of ``plan.rows`` is its row whichever planner made the plan."""
    ids = torch.tensor([7, 3, 7, 599, 0, 3])
    for planner in ("host", "device"):
        table = TieredTable("t", torch.randn(ROWS, DIM), OptimizerConfig(), num_slots=100, planner=planner)
        plan = table.plan_ids(ids)
        assert table.in_flight == 1 and plan.resolve_sizes()[0] == 4
        assert torch.equal(plan.rows[plan.inverse], ids), planner
        table.release(plan)
        assert table.in_flight == 0
