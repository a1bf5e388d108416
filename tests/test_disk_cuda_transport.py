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
from torchrec_proactive.store import OptimizerConfig, OptimType, TieredTable, disk_record_bytes

from .cuda_stream_standin import cpu_streams
from .disk_training import every_row, same_rows, skewed_batches, train, trained_in_dram

ROWS, DIM = 4000, 16


def _batches():
    return skewed_batches(ROWS, DIM, steps=14, bags=24, per_bag=3)


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
    want_table = trained_in_dram(init, config, slots, _batches(), depth)
    want = every_row(want_table)
    with cpu_streams(monkeypatch):
        engine, transport = _cuda_engine()
        table = TieredTable.on_disk("t", ROWS, DIM, config, num_slots=slots, directory=tmp_path,
                                    host_cache_bytes=600 * disk_record_bytes(DIM, config), initial_weight=init)
        try:
            train(table, _batches(), depth, disk_depth, engine=engine)
            got = every_row(table)
            disk = table.disk.stats()
        finally:
            engine.close()
            table.close()
    assert same_rows(got, want), (optim, slots, depth)
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
    want = TieredTable("t", init.clone(), config, num_slots=60)
    train(want, _batches(), depth=1)
    with cpu_streams(monkeypatch):
        engine, _ = _cuda_engine()
        got = TieredTable("t", init.clone(), config, num_slots=60)
        train(got, _batches(), depth=1, engine=engine)
        engine.close()
    assert same_rows(every_row(got), every_row(want))
    assert got.stats.as_dict() == want.stats.as_dict()
    assert got.stats.overflow_rows > 0
