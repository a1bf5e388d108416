"""``TieredTable.read_host_rows`` / ``write_host_rows``: the host tier read and written by row
range, the same for a table in DRAM and one on disk; cached copies take the writes."""

import pytest
import torch

from torchrec_proactive.fetch import FetchEngine
from torchrec_proactive.fetch.lookahead import run_lookahead
from torchrec_proactive.store import OptimizerConfig, OptimType, StoreStateError, TieredTable, pooled_lookup
from torchrec_proactive.store.lookup import plan_table_batch

ROWS, DIM = 300, 4
OPT = OptimizerConfig(OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.1)


def _table(tmp_path, where):
    init = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(0))
    if where == "dram":
        return TieredTable("t", init, OPT, num_slots=40)
    return TieredTable.on_disk("t", ROWS, DIM, OPT, num_slots=40, directory=tmp_path, host_cache_bytes=60 * 32,
                               initial_weight=init)


def _lookup_rows(table, rows):
    """One forward/backward over ``rows`` with a zero gradient (they end up cached); the
    pooled rows of the forward."""
    engine, anchor = FetchEngine(), torch.empty(0, requires_grad=True)
    batch = (rows, torch.arange(rows.numel() + 1), None, torch.zeros(rows.numel(), DIM))
    out = []

    def step(i, tb, b):
        pooled = pooled_lookup(tb, anchor)
        out.append(pooled.detach().clone())
        pooled.backward(b[3])

    run_lookahead(table, engine, [batch], 0, step)
    return engine, out[0]


@pytest.mark.parametrize("where", ["dram", "disk"])
def test_read_and_write_by_range(tmp_path, where):
    table = _table(tmp_path, where)
    init = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(0))
    w, s = table.read_host_rows(10, 50)
    assert torch.equal(w, init[10:60]) and torch.equal(s, torch.zeros(50))
    table.write_host_rows(10, [torch.full((50, DIM), 7.0), None])
    w2, s2 = table.read_host_rows(0, ROWS)
    assert torch.equal(w2[10:60], torch.full((50, DIM), 7.0))
    assert torch.equal(w2[:10], init[:10]) and torch.equal(w2[60:], init[60:])
    assert torch.equal(s2, torch.zeros(ROWS))  # None kept the state
    with pytest.raises(Exception, match=r"rows \[290, 310\) are not in its rows \[0, 300\)"):
        table.read_host_rows(290, 20)
    table.close()


@pytest.mark.parametrize("where", ["dram", "disk"])
def test_a_cached_row_takes_the_write(tmp_path, where):
    table = _table(tmp_path, where)
    rows = torch.tensor([3, 5, 200])
    engine, _ = _lookup_rows(table, rows)
    engine.flush([table])
    assert set(table.resident_rows().tolist()) >= {3, 5, 200}
    table.write_host_rows(4, [torch.full((2, DIM), 9.0), None])  # rows 4 (not cached) and 5 (cached)
    _, pooled = _lookup_rows(table, torch.tensor([5]))
    assert torch.equal(pooled, torch.full((1, DIM), 9.0))
    table.close()


def test_a_write_refused_while_a_cached_row_is_dirty(tmp_path):
    table = _table(tmp_path, "dram")
    engine, anchor = FetchEngine(), torch.empty(0, requires_grad=True)
    batch = (torch.tensor([1]), torch.tensor([0, 1]), None, torch.ones(1, DIM))
    run_lookahead(table, engine, [batch], 0, lambda i, tb, b: pooled_lookup(tb, anchor).backward(b[3]))
    with pytest.raises(StoreStateError, match="flush it first"):
        table.write_host_rows(0, [torch.zeros(2, DIM), None])
    assert table.has_dirty()


def test_a_write_with_a_batch_in_flight_reaches_its_lookup(tmp_path):
    """On disk, a row written while a batch holding it is planned and fetched (the pipeline
    between two steps) is what that batch's lookup reads, as with a resident table."""
    table = _table(tmp_path, "disk")
    engine, anchor = FetchEngine(), torch.empty(0, requires_grad=True)
    ids = torch.tensor([7, 8, 9])
    tb = plan_table_batch(table, ids, torch.arange(4))
    engine.run([tb.plan])  # fetched: rows 7-9 pinned in the cache, the batch not looked up yet
    assert table.in_flight == 1
    table.write_host_rows(8, [torch.full((1, DIM), 5.0), None])
    got = pooled_lookup(tb, anchor)
    assert torch.equal(got[1], torch.full((DIM,), 5.0))
    table.close()
