"""Cache planning sizes both levels (issue 42 item 4): the host caches of tables on disk are
planned from their miss-ratio curves under one DRAM budget (``plan_host_caches``), and the
real store, replayed on the same batches, reads fewer rows from disk with the planned sizes
than with the budget split evenly. Counters only: rows the store read from its files."""

from __future__ import annotations

import pytest
import torch

from torchrec_proactive.cacheplan.curve import MissRatioCurve
from torchrec_proactive.cacheplan.host_plan import (HostBudgetError, disk_reads_per_batch, effective_slots, host_floor,
                                                   plan_host_caches)
from torchrec_proactive.fetch import FetchEngine
from torchrec_proactive.fetch.lookahead import run_lookahead
from torchrec_proactive.store import OptimizerConfig, OptimType, TieredTable, pooled_lookup

DIM, STEPS, BAGS = 8, 160, 64
CONFIG = OptimizerConfig(OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.05)
DEVICE_SLOTS = 100
#: per table: (rows, p) with ids ~ rows * u**p (p = 1: uniform, larger p more skewed) - two
#: skewed tables beside a large uniform one, whose host rows save few reads each
TABLES = {"hot": (2000, 3.0), "warm": (2000, 1.8), "huge": (20000, 1.0)}
EVEN = 800  # host rows a table when the budget is split evenly


def _batches(rows: int, p: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        values = (torch.rand(BAGS, generator=g) ** p * rows).long()
        out.append((values, torch.arange(BAGS + 1), None, torch.randn(BAGS, DIM, generator=g)))
    return out


def _curve(batches, rows: int, depth: int) -> MissRatioCurve:
    return MissRatioCurve.from_steps([b[0].numpy() for b in batches], rows, depth=depth)


def _disk_reads(tmp_path, name, rows, batches, host_slots: int, record: int, device_slots: int = DEVICE_SLOTS) -> int:
    """Rows the real store reads from its file over the batches (depth 1, one table)."""
    table = TieredTable.on_disk(name, rows, DIM, CONFIG, num_slots=device_slots, directory=tmp_path,
                                host_cache_bytes=host_slots * record)
    try:
        engine = FetchEngine()
        anchor = torch.empty(0, requires_grad=True)
        run_lookahead(table, engine, batches, 1, lambda i, tb, batch: pooled_lookup(tb, anchor).backward(batch[3]))
        engine.flush([table])
        return int(table.disk.stats()["row_misses"])
    finally:
        table.close()


def _record(tmp_path) -> int:
    table = TieredTable.on_disk("probe", 16, DIM, CONFIG, num_slots=4, directory=tmp_path, host_cache_bytes=1 << 20)
    try:
        return table.disk.record
    finally:
        table.close()


def test_planned_host_caches_read_fewer_rows_from_disk_than_an_even_split(tmp_path):
    record = _record(tmp_path)
    batches = {t: _batches(rows, p, seed) for seed, (t, (rows, p)) in enumerate(TABLES.items())}
    curves = {t: _curve(batches[t], rows, depth=1) for t, (rows, _) in TABLES.items()}
    budget = len(TABLES) * EVEN * record
    plan = plan_host_caches(curves, {t: record for t in curves}, budget)
    assert sum(plan.host_cache_bytes.values()) <= budget
    assert all(plan.slots[t] >= host_floor(curves[t]) >= 2 * curves[t].pinned_rows for t in curves)
    # the uniform table's rows save least: it keeps its floor, the skewed ones take the rest
    assert plan.slots["huge"] == host_floor(curves["huge"]) < EVEN, plan.describe()
    assert plan.slots["hot"] + plan.slots["warm"] > 2 * EVEN, plan.describe()

    even = {t: _disk_reads(tmp_path, t, TABLES[t][0], batches[t], EVEN, record) for t in TABLES}
    planned = {t: _disk_reads(tmp_path, t, TABLES[t][0], batches[t], plan.slots[t], record) for t in TABLES}
    # (the reads a batch sees first are read at any size: the split moves the rest, ~10% here)
    assert sum(planned.values()) < 0.95 * sum(even.values()), (planned, even, plan.describe())

    # The inclusive reading (misses of a cache of the host's slots) predicts the store's
    # reads; the exclusive one (device + host slots) is further off on every table.
    for slots, counted in ((plan.slots, planned), ({t: EVEN for t in TABLES}, even)):
        for t, c in curves.items():
            inclusive = disk_reads_per_batch(c, slots[t]) * c.num_batches
            exclusive = disk_reads_per_batch(c, slots[t] + DEVICE_SLOTS) * c.num_batches
            assert abs(inclusive - counted[t]) < abs(exclusive - counted[t]), (t, inclusive, exclusive, counted[t])
            assert abs(inclusive - counted[t]) <= 0.05 * counted[t], (t, inclusive, counted[t])


def test_a_host_budget_below_the_pinned_rows_is_one_line_naming_the_minimum():
    curve = _curve(_batches(2000, 2.5, 0), 2000, depth=4)
    floor = host_floor(curve)
    with pytest.raises(HostBudgetError) as e:
        plan_host_caches({"t": curve}, {"t": 48}, budget_bytes=10 * 48)
    assert e.value.minimum_bytes == floor * 48
    assert "\n" not in str(e.value) and f"t {floor} rows" in str(e.value) and str(floor * 48) in str(e.value)
    # at the minimum exactly, every table gets its floor
    plan = plan_host_caches({"t": curve}, {"t": 48}, budget_bytes=e.value.minimum_bytes)
    assert plan.slots == {"t": floor}


def test_the_two_levels_read_what_one_cache_of_their_effective_size_misses(tmp_path):
    """``effective_slots`` (``max(h, d + h / 2)``, its 1/2 fitted on replays of the "warm"
    table) on the "hot" table, held out, across host caches below, at and above the device
    cache: within 7% of the store's counted reads, and nearer than the inclusive reading
    (``max(h, d)``) and the exclusive one (``d + h``) wherever those differ from it."""
    record = _record(tmp_path)
    rows, p = TABLES["hot"]
    batches = _batches(rows, p, 7)
    curve = _curve(batches, rows, depth=1)
    for device, host in ((400, 200), (300, 300), (200, 600), (700, 400)):
        counted = _disk_reads(tmp_path, "h", rows, batches, host, record, device_slots=device)

        def reads(slots: float) -> float:
            return disk_reads_per_batch(curve, int(round(slots))) * curve.num_batches

        ours = reads(effective_slots(host, device))
        assert abs(ours - counted) <= 0.07 * counted, (device, host, ours, counted)
        for other in (max(host, device), device + host):
            if abs(other - effective_slots(host, device)) > 50:
                assert abs(ours - counted) < abs(reads(other) - counted), (device, host, other, counted)


def test_host_rows_go_where_the_device_cache_leaves_reads():
    """Two equal tables, one with every row on the device: the budget beyond the floors
    goes to the other, and the one on the device reads nothing from disk."""
    rows, p = TABLES["warm"]
    curve = _curve(_batches(rows, p, 1), rows, depth=1)
    floor = host_floor(curve)
    plan = plan_host_caches({"whole": curve, "cached": curve}, {"whole": 40, "cached": 40}, 4 * floor * 40,
                            device_slots={"whole": rows, "cached": DEVICE_SLOTS})
    assert plan.slots["whole"] == floor < plan.slots["cached"], plan.describe()
    assert f"over {rows} device rows" in plan.describe()
    for wrong in ({"whole": rows, "typo": 3}, {"whole": -1}):
        with pytest.raises(ValueError, match="device_slots"):
            plan_host_caches({"whole": curve}, {"whole": 40}, 4 * floor * 40, device_slots=wrong)
    assert plan.disk_reads_per_batch["whole"] == 0.0 < plan.disk_reads_per_batch["cached"]


def test_a_plan_never_spends_more_than_its_budget():
    """Over a sweep of budgets, the planned bytes never exceed the budget (nearly collinear
    points of a curve's hull once made a later segment look steeper than the one before it,
    and the allocation took it first, skipping the earlier one's bytes)."""
    g = torch.Generator().manual_seed(0)
    shapes = {"uni": (20000, 1.0), "skew": (5000, 4.0), "mid": (10000, 2.0)}
    steps = {t: [] for t in shapes}
    for _ in range(40):
        for t, (rows, p) in shapes.items():
            steps[t].append((torch.rand(128, generator=g) ** p * rows).long().numpy())
    curves = {t: MissRatioCurve.from_steps(steps[t], rows, depth=4) for t, (rows, _) in shapes.items()}
    record = {"uni": 72, "skew": 72, "mid": 40}
    minimum = sum(host_floor(c) * record[t] for t, c in curves.items())
    over = []
    for budget in range(minimum, 700_000, 997):
        plan = plan_host_caches(curves, record, budget)
        if sum(plan.host_cache_bytes.values()) > budget:
            over.append((budget, sum(plan.host_cache_bytes.values())))
    assert not over, over[:5]


def test_a_budget_is_spent_while_a_table_still_reads_from_disk():
    """No budget stays idle while a table is not whole: beyond the sample's last reuse the
    hits rise to all of them at the whole table (steady state), so the budget goes on, and
    a budget that holds every table makes every table whole, reading nothing from disk."""
    rows, p = TABLES["huge"]
    curves = {"huge": _curve(_batches(rows, p, 3), rows, depth=1),
              "hot": _curve(_batches(TABLES["hot"][0], TABLES["hot"][1], 4), TABLES["hot"][0], depth=1)}
    record = {"huge": 40, "hot": 40}
    whole = sum(c.num_rows * 40 for c in curves.values())
    for budget in (whole // 2, (3 * whole) // 4):
        plan = plan_host_caches(curves, record, budget)
        assert budget - 2 * 40 <= sum(plan.host_cache_bytes.values()) <= budget, plan.describe()
    plan = plan_host_caches(curves, record, whole)
    assert plan.slots == {t: c.num_rows for t, c in curves.items()}
    assert set(plan.disk_reads_per_batch.values()) == {0.0}
