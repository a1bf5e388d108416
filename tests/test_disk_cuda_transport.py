"""A table on disk moves through the CUDA transport's worker path (pinned staging, chunks,
write-backs, fills, overflow rows) as through the CPU's ``transfer``: the store's host tier is
read and written only through the store (``gather_host`` / ``put_host``), between its
``begin_moves`` and ``end_moves`` - so the disk hop's order holds on CUDA too.

On this CPU-only machine the transport runs its own code on CPU tensors with synchronous
stand-ins for streams and events (``tests/cuda_stream_standin.py``); the stream fences are
``benchmarks/gpu_check.py``'s to prove on a GPU."""

from __future__ import annotations

import pytest
import torch

from torchrec_proactive.fetch import FetchEngine
from torchrec_proactive.fetch.lookahead import run_lookahead
from torchrec_proactive.store import OptimizerConfig, OptimType, TieredTable, disk_record_bytes, pooled_lookup

from .cuda_stream_standin import cpu_streams

ROWS, DIM = 4000, 16


def _batches(steps=14, bags=24, per_bag=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        values = (torch.rand(bags * per_bag, generator=g) ** 2 * ROWS).long()  # skewed
        out.append((values, torch.arange(0, bags * per_bag + 1, per_bag), None, torch.randn(bags, DIM, generator=g)))
    return out


def _train(table: TieredTable, engine: FetchEngine, depth: int, disk_depth=None) -> TieredTable:
    anchor = torch.empty(0, requires_grad=True)
    run_lookahead(table, engine, _batches(), depth,
                  lambda i, tb, batch: pooled_lookup(tb, anchor).backward(batch[3]), disk_depth=disk_depth)
    engine.flush([table])
    table.check_invariants(expect_drained=True)
    return table


def _rows_of(table: TieredTable) -> list:
    """Every row's weight and state, read through the host tier (on disk: in chunks)."""
    if table.disk is None:
        return [table.host_weight.clone(), *[v.clone() for v in table.host_state.values()]]
    table.flush_to_disk()
    parts = table.disk.read_rows(torch.arange(ROWS))
    return [parts[0]] + [p.reshape(ROWS, *v.shape[1:]) for p, v in zip(parts[1:], table.host_state.values())]


def _cuda_engine():
    from torchrec_proactive.fetch.cuda import CudaStreamTransport

    transport = CudaStreamTransport(torch.device("cpu"))
    return FetchEngine(transport), transport


@pytest.mark.parametrize("optim, slots, depth, disk_depth", [
    (OptimType.EXACT_ROWWISE_ADAGRAD, 200, 2, 4),   # device cache 5%, host cache 15%, staged ahead
    (OptimType.ADAM, 60, 1, None),                   # a device cache below a batch: overflow rows
    (OptimType.EXACT_ROWWISE_ADAGRAD, ROWS, 1, None),  # the whole table on the device: the preload
])
def test_a_table_on_disk_trains_through_the_cuda_transport_as_in_dram(tmp_path, monkeypatch, optim, slots,
                                                                      depth, disk_depth):
    torch.manual_seed(0)
    init = torch.randn(ROWS, DIM)
    config = OptimizerConfig(optim, learning_rate=0.05)
    # The same table in DRAM, on the CPU transport, at the same depth: the same plans.
    want_table = _train(TieredTable("t", init.clone(), config, num_slots=slots), FetchEngine(), depth)
    want = _rows_of(want_table)
    with cpu_streams(monkeypatch):
        engine, transport = _cuda_engine()
        table = TieredTable.on_disk("t", ROWS, DIM, config, num_slots=slots, directory=tmp_path,
                                    host_cache_bytes=600 * disk_record_bytes(DIM, config), initial_weight=init)
        try:
            _train(table, engine, depth, disk_depth)
            got = _rows_of(table)
            disk = table.disk.stats()
        finally:
            engine.close()
            table.close()
    assert all(torch.equal(a, b) for a, b in zip(got, want)), (optim, slots, depth)
    # The moves took the transport's worker path (staging), not kernels on issue, and the disk
    # tier served the table: its host cache is far smaller than the table.
    assert transport.device_tickets == 0 and transport.staging.allocations > 0
    assert disk["row_misses"] > 600 and disk["rows_written"] > 0, disk
    assert table.stats.rows_fetched == want_table.stats.rows_fetched
    if slots == 60:
        assert table.stats.overflow_rows > 0 and table.stats.overflow_rows == want_table.stats.overflow_rows


def test_a_table_in_dram_moves_the_same_bytes_through_the_cuda_transport(monkeypatch):
    """The worker path that now goes through the store's host-tier accessors is the DRAM
    tables' path too: bit-identical to the CPU transport, the same rows and bytes moved."""
    torch.manual_seed(0)
    init = torch.randn(ROWS, DIM)
    config = OptimizerConfig(OptimType.ADAM, learning_rate=0.05)
    want = _train(TieredTable("t", init.clone(), config, num_slots=60), FetchEngine(), depth=1)
    with cpu_streams(monkeypatch):
        engine, transport = _cuda_engine()
        got = _train(TieredTable("t", init.clone(), config, num_slots=60), engine, depth=1)
        engine.close()
    assert all(torch.equal(a, b) for a, b in zip(_rows_of(got), _rows_of(want)))
    assert got.stats.as_dict() == want.stats.as_dict()
    assert got.stats.overflow_rows > 0
