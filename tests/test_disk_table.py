"""A table on disk (``TieredTable.on_disk``: device cache <- host cache <- O_DIRECT file) trains
bit-identically to the same table in DRAM, at any depth and with caches far smaller than the
table at both levels; its disk moves are queued when a batch is planned, ahead of its fills."""

from __future__ import annotations

import pytest
import torch

from torchrec_proactive.store import InvalidInputError, OptimizerConfig, OptimType, TieredTable

from .disk_training import every_row, skewed_batches, train

ROWS, DIM = 20000, 32


def _batches(steps=16, bags=32, per_bag=2, seed=0):
    return skewed_batches(ROWS, DIM, steps, bags, per_bag, seed)


def _train(table: TieredTable, depth: int) -> TieredTable:
    train(table, _batches(), depth)
    return table


_rows_of = every_row


@pytest.mark.parametrize("optim", [OptimType.EXACT_ROWWISE_ADAGRAD, OptimType.ADAM])
def test_a_table_on_disk_trains_as_the_table_in_dram(tmp_path, optim):
    torch.manual_seed(0)
    init = torch.randn(ROWS, DIM)
    config = OptimizerConfig(optim, learning_rate=0.05)
    want = _rows_of(_train(TieredTable("t", init.clone(), config, num_slots=300), depth=0))
    for depth in (0, 1, 3):
        # Device cache 1.5% of the rows; host cache 3000 rows (15%).
        record = 4 * DIM * (3 if optim == OptimType.ADAM else 1) + (0 if optim == OptimType.ADAM else 8)
        table = TieredTable.on_disk("t", ROWS, DIM, config, num_slots=300, directory=tmp_path,
                                    host_cache_bytes=3000 * record, initial_weight=init)
        assert table.disk.num_slots == 3000
        try:
            _train(table, depth)
            got = _rows_of(table)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (optim, depth)
            disk = table.disk.stats()
            assert table.disk.num_rows > 5 * table.disk.num_slots  # the table does not fit the host cache
            assert disk["row_misses"] > table.disk.num_slots and disk["rows_written"] > 0, disk
            assert table.stats.rows_fetched > 300  # and not the device cache
        finally:
            table.close()
        assert not (tmp_path / "t.rows").exists()


def test_a_table_on_disk_is_refused_where_it_does_not_run_yet(tmp_path):
    with pytest.raises(InvalidInputError, match=r"table 't': a table on disk is planned on the host \(planner='host'\)"):
        TieredTable("t", torch.empty(10, 4, device="meta"), OptimizerConfig(), num_slots=5, planner="device",
                    disk=object())  # type: ignore[arg-type]


def test_a_device_cache_of_the_whole_table_over_a_smaller_host_cache(tmp_path):
    """A device cache as large as the table is filled with every row at the first batch (the
    preload): on disk those rows come through the host cache a chunk at a time, so a host
    cache far smaller than the table serves it - bit-identical to the table in DRAM (found
    by a user trial: the preload pinned every row in the host cache at once)."""
    torch.manual_seed(0)
    init = torch.randn(ROWS, DIM)
    config = OptimizerConfig(OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.05)
    want = _rows_of(_train(TieredTable("t", init.clone(), config, num_slots=ROWS), depth=1))
    record = 4 * DIM + 8
    table = TieredTable.on_disk("t", ROWS, DIM, config, num_slots=ROWS, directory=tmp_path,
                                host_cache_bytes=2000 * record, initial_weight=init)
    try:
        got = _rows_of(_train(table, depth=1))
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    finally:
        table.close()


def test_a_group_of_many_long_table_names_gets_a_short_file_name(tmp_path):
    """A TorchRec group's store is named after all its tables ('a+b+...'); its file is named
    after the first, so twenty long names do not exceed a file name's 255 bytes."""
    from torchrec_proactive.integration.embedding_kernel import _build_store

    name = "+".join(f"user_history_embedding_table_{i:02d}" for i in range(20))
    config = OptimizerConfig(OptimType.EXACT_SGD, learning_rate=0.05)
    store = _build_store(disk_directory=tmp_path, host_cache_bytes=1 << 16, name=name,
                         host_weight=torch.empty(100, 4, device="meta"), optimizer=config, num_slots=10)
    try:
        assert [p.name for p in tmp_path.iterdir()] == ["user_history_embedding_table_00-and-19-more.rows"]
        assert store.name == name  # messages still name every table
    finally:
        store.close()
