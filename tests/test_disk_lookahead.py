"""Lookahead across both hops (issue 42 item 2): a table on disk stages a batch's rows
(``TieredTable.stage_rows``: pinned in the host cache, disk reads queued) ``disk_depth``
batches ahead, while its host->device moves go ``depth`` ahead. Staging changes only which
rows are where: parameters stay bit-identical to the same table in DRAM; a host cache too
small for what is staged refuses in one line, changing nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torchrec_proactive.fetch import FetchEngine
from torchrec_proactive.fetch.lookahead import run_lookahead
from torchrec_proactive.store import CacheCapacityError, OptimizerConfig, OptimType, TieredTable, pooled_lookup

from .disk_training import every_row, skewed_batches, train

ROWS, DIM, STEPS = 3000, 8, 16
CONFIG = OptimizerConfig(OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.05)
RECORD = 4 * DIM + 8  # weight + a row-wise state, padded to 8 bytes


def _batches(steps=STEPS, bags=24, per_bag=2, seed=0):
    return skewed_batches(ROWS, DIM, steps, bags, per_bag, seed)


def _init():
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(1))


def _train(table, depth, disk_depth=None, batches=None):
    return train(table, batches or _batches(), depth, disk_depth)


_rows_of = every_row


def _disk_table(tmp_path, host_rows=600, slots=150):
    return TieredTable.on_disk("t", ROWS, DIM, CONFIG, num_slots=slots, directory=tmp_path,
                               host_cache_bytes=host_rows * RECORD, initial_weight=_init())


def test_staging_ahead_trains_bit_identically_and_reads_before_the_plan(tmp_path):
    dram = TieredTable("t", _init(), CONFIG, num_slots=150)
    _train(dram, 0)
    want = _rows_of(dram)
    missed = {}
    for depth, disk_depth in [(0, 0), (1, 1), (1, 4), (2, 6)]:
        table = _disk_table(tmp_path)
        try:
            table.disk.reset_stats()
            report = _train(table, depth, disk_depth)
            s = table.disk.stats()
            got = _rows_of(table)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (depth, disk_depth)
            assert s["row_misses"] > table.disk.num_slots // 2 and s["rows_written"] > 0, s
        finally:
            table.close()
        missed[(depth, disk_depth)] = s["plan_rows_missed"]
        # Each hop's lead, batch by batch (past the start): the plan `depth` ahead, the
        # stage `disk_depth` ahead.
        assert all(j - i == depth for j, i in report.planned_at.items() if j >= depth)
        if disk_depth > depth:
            assert all(j - report.staged_at[j] == disk_depth for j in range(disk_depth, STEPS))
            # The rows a plan reads from the host tier were there or on their way already:
            # the reads were issued when the batch was staged, disk_depth batches ahead. (A
            # row the device cache held when its batch was staged is not staged; should both
            # caches evict it before the plan, the plan reads it: rare, counted.)
            assert s["plan_rows_hit"] > 0 and s["plan_rows_missed"] * 50 <= s["plan_rows_hit"], s
            assert s["stages"] == STEPS and s["stage_rows_read"] > 0, s
            assert report.leads()[0] > report.leads()[1]
        else:
            assert s["stages"] == 0 and not report.staged_at
    assert missed[(1, 1)] > 0 and missed[(0, 0)] > 0  # without staging the plan reads itself
    assert missed[(1, 4)] * 20 < missed[(1, 1)] and missed[(2, 6)] * 20 < missed[(1, 1)], missed


def test_a_stage_pins_rows_reads_them_once_and_unstage_is_idempotent(tmp_path):
    table = _disk_table(tmp_path, host_rows=200)
    try:
        d = table.disk
        d.reset_stats()
        rows = torch.tensor([5, 7, 5, 2999, 1500])
        stage = table.stage_rows(rows)
        read = d.stats()["stage_rows_read"]
        assert stage.rows == 4 and read == 3  # (row 2999 is still cached from writing the initial rows)
        slots = d.row_slot[[5, 7, 1500, 2999]]
        assert (slots >= 0).all() and (d.pins[slots] == 1).all()
        again = table.stage_rows(rows)  # there already: no read
        assert d.stats()["stage_rows_read"] == read and d.stats()["stages"] == 2
        assert (d.pins[slots] == 2).all()
        table.unstage(stage)
        table.unstage(stage)
        table.unstage(again)
        assert not d.pins.any()
        with pytest.raises(Exception, match=r"table 't': id 3000 is out of range \[0, 3000\)"):
            table.stage_rows(torch.tensor([3000]))
        table.check_invariants(expect_drained=True)
    finally:
        table.close()


def test_a_host_cache_too_small_for_staged_and_planned_rows_refuses_in_one_line(tmp_path):
    table = _disk_table(tmp_path, host_rows=40, slots=10)
    try:
        d = table.disk
        first = table.stage_rows(torch.arange(0, 30))
        before = (d.row_slot.copy(), d.pins.copy(), d.stats()["tickets"])
        with pytest.raises(CacheCapacityError) as e:
            table.stage_rows(torch.arange(100, 120))
        msg = str(e.value)
        assert "\n" not in msg
        assert msg.startswith("table 't': staging a batch needs 20 more rows in the host cache of 40 rows")
        assert "at least 50 rows (2000 bytes). Nothing changed" in msg
        assert np.array_equal(before[0], d.row_slot) and np.array_equal(before[1], d.pins)
        assert d.stats()["tickets"] == before[2]
        table.unstage(first)
        table.check_invariants(expect_drained=True)
    finally:
        table.close()


def test_run_lookahead_stages_what_fits_and_stays_exact_with_a_tight_host_cache(tmp_path):
    dram = TieredTable("t", _init(), CONFIG, num_slots=60)
    _train(dram, 0)
    want = _rows_of(dram)
    table = _disk_table(tmp_path, host_rows=220)  # about 3 batches' rows: not disk_depth 8's
    try:
        report = _train(table, 1, 8)
        assert report.stages_waited > 0  # some stages waited for room
        assert all(torch.equal(a, b) for a, b in zip(_rows_of(table), want))
    finally:
        table.close()


def test_disk_depth_below_depth_is_refused():
    table = TieredTable("t", _init(), CONFIG, num_slots=60)
    with pytest.raises(ValueError, match=r"disk_depth must be >= depth \(2\), got 1"):
        run_lookahead(table, FetchEngine(), _batches(2), 2, lambda *a: None, disk_depth=1)
    # Off disk, staging does nothing (and changes nothing).
    stage = table.stage_rows(torch.tensor([1, 2]))
    assert stage.ticket is None
    table.unstage(stage)


def test_any_staging_at_any_time_changes_no_value(tmp_path):
    """Stages of random rows made and dropped at random points of a run (never used by a
    plan, some never dropped until the end) move rows only: the result is DRAM's."""
    dram = TieredTable("t", _init(), CONFIG, num_slots=150)
    _train(dram, 0)
    want = _rows_of(dram)
    table = _disk_table(tmp_path, host_rows=500)
    g = torch.Generator().manual_seed(5)
    held = []
    engine, anchor = FetchEngine(), torch.empty(0, requires_grad=True)

    def step(i, tb, batch):
        pooled_lookup(tb, anchor).backward(batch[3])
        held.append(table.stage_rows(torch.randint(0, ROWS, (30,), generator=g), skip_cached=bool(i % 2)))
        if i % 3 == 0:
            table.unstage(held.pop(0))

    try:
        run_lookahead(table, engine, _batches(), 1, step, disk_depth=3)
        for stage in held:
            table.unstage(stage)
        engine.flush([table])
        table.check_invariants(expect_drained=True)
        assert table.disk.stats()["stages"] > STEPS
        assert all(torch.equal(a, b) for a, b in zip(_rows_of(table), want))
    finally:
        table.close()
