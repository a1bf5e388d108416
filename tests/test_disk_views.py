"""``disk_views.disk_view``: live views of a table ON DISK (no host tensor holds its rows).
Metadata and views cost nothing; a read flushes the owner's device cache first and reads only
the view's rows, in chunks; in-place writes go through to exactly the rows they cover, and the
cache takes them. The owner is a real one: a fetch engine's flush of the table."""

from __future__ import annotations

import copy
import gc
import io
import pickle

import numpy as np
import pytest
import torch

from torchrec_proactive.fetch import FetchEngine
from torchrec_proactive.fetch.lookahead import run_lookahead
from torchrec_proactive.integration.disk_views import DiskRowsView, disk_view, disk_view_io
from torchrec_proactive.store import OptimizerConfig, OptimType, StoreStateError, TieredTable, pooled_lookup

ROWS, DIM, CHUNK = 600, 4, 32
OPT = OptimizerConfig(OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.1)
RECORD = 24  # bytes of one row on disk: 4 weights and the row-wise state, padded to 8


class EngineOwner:
    """What a view needs of the kernel serving the table: its device cache written back
    through the fetch engine before a value is touched; writes counted."""

    def __init__(self, engine: FetchEngine, table: TieredTable) -> None:
        self.engine, self.table = engine, table
        self.flushes = self.writes = 0

    def before_host_access(self) -> None:
        self.engine.flush([self.table])
        self.flushes += 1

    def after_host_write(self) -> None:
        self.writes += 1


def _init() -> torch.Tensor:
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(0))


def _table(tmp_path, where: str = "disk", host_rows: int = 80) -> TieredTable:
    if where == "dram":
        return TieredTable("t", _init(), OPT, num_slots=40)
    return TieredTable.on_disk("t", ROWS, DIM, OPT, num_slots=40, directory=tmp_path,
                               host_cache_bytes=host_rows * RECORD, initial_weight=_init())


def _batches(steps: int = 6, bags: int = 12, per_bag: int = 3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, ROWS, (bags * per_bag,), generator=g), torch.arange(0, bags * per_bag + 1, per_bag),
             None, torch.randn(bags, DIM, generator=g)) for _ in range(steps)]


def _train(table: TieredTable) -> EngineOwner:
    """A few training steps; the updated rows stay dirty in the device cache."""
    engine, anchor = FetchEngine(), torch.empty(0, requires_grad=True)
    run_lookahead(table, engine, _batches(), 1, lambda i, tb, b: pooled_lookup(tb, anchor).backward(b[3]))
    assert table.has_dirty()
    return EngineOwner(engine, table)


def _reference(tmp_path):
    """The trained table's weight and row-wise state, from the same run in DRAM."""
    ref = _table(tmp_path, "dram")
    _train(ref).before_host_access()
    return ref.host_weight.clone(), ref.host_state["momentum1"].clone()


def _lookup(table: TieredTable, rows: torch.Tensor) -> torch.Tensor:
    """One bag per row, zero gradient: the rows as the next lookup sees them."""
    engine, anchor, out = FetchEngine(), torch.empty(0, requires_grad=True), []
    batch = (rows, torch.arange(rows.numel() + 1), None, torch.zeros(rows.numel(), DIM))

    def step(i, tb, b):
        pooled = pooled_lookup(tb, anchor)
        out.append(pooled.detach().clone())
        pooled.backward(b[3])

    run_lookahead(table, engine, [batch], 0, step)
    engine.flush([table])
    return out[0]


def test_metadata_and_views_read_nothing(tmp_path):
    table = _table(tmp_path)
    owner = _train(table)
    io_counts = disk_view_io(table)
    io_counts.reset()
    w = disk_view(owner, table, 0, 100, 300, chunk_rows=CHUNK)
    s = disk_view(owner, table, 1, 100, 300, chunk_rows=CHUNK)
    try:
        assert isinstance(w, DiskRowsView) and isinstance(s, DiskRowsView)
        assert w.shape == (300, DIM) and w.dtype == torch.float32 and w.device == torch.device("cpu")
        assert w.stride() == (DIM, 1) and w.is_contiguous() and not w.requires_grad and not w.is_pinned()
        assert s.shape == (300,) and s.dim() == 1 and s.numel() == 300 and s.is_contiguous()
        assert w.store_rows == (100, 400) and s.store_rows == (100, 400)
        # Views stay views of the sub-range; nothing is read.
        assert w.narrow(0, 10, 20).store_rows == (110, 130)
        assert w[10:30][5:7].store_rows == (115, 117)
        assert w[7].shape == (DIM,) and w[7].store_rows == (107, 108)
        assert w[:, 1:3].store_rows == (100, 400) and not w[:, 1:3].is_contiguous()
        assert w.view(-1).shape == (300 * DIM,) and w.reshape(150, 2 * DIM).store_rows == (100, 400)
        assert w.detach().store_rows == (100, 400) and w.t().shape == (DIM, 300)
        assert [p.store_rows for p in w.split(100)] == [(100, 200), (200, 300), (300, 400)]
        assert s[299:].store_rows == (399, 400)
        param = torch.nn.Parameter(w, requires_grad=False)  # (as named_parameters wraps them)
        assert isinstance(param, DiskRowsView) and param.store_rows == (100, 400)
        assert "rows [100, 400)" in repr(w)  # (the repr reads nothing)
        assert torch.empty_like(w).shape == w.shape and type(torch.empty_like(w)) is torch.Tensor
        assert owner.flushes == 0 and io_counts.read_calls == 0 and io_counts.write_calls == 0
        assert table.has_dirty()  # (nothing flushed the cache)
    finally:
        table.close()


@pytest.mark.parametrize("where", ["disk", "dram"])
def test_a_read_flushes_first_and_reads_only_its_rows(tmp_path, where):
    want_w, want_s = _reference(tmp_path)
    table = _table(tmp_path, where)
    owner = _train(table)
    io_counts = disk_view_io(table)
    io_counts.reset()
    try:
        w = disk_view(owner, table, 0, 200, 300, chunk_rows=CHUNK)
        got = w.clone()
        assert type(got) is torch.Tensor and torch.equal(got, want_w[200:500])  # bit for bit, after the flush
        assert owner.flushes == 1 and not table.has_dirty()
        assert io_counts.rows_read == 300 and io_counts.max_rows_per_read == CHUNK
        assert io_counts.read_calls == -(-300 // CHUNK) and io_counts.max_rows_materialized == 300
        io_counts.reset()
        assert torch.equal(w[50:60].clone(), want_w[250:260])  # a sub-view reads its rows only
        assert io_counts.rows_read == 10 and owner.flushes == 2
        s = disk_view(owner, table, 1, 0, ROWS, chunk_rows=CHUNK)
        assert torch.equal(s.clone(), want_s) and torch.equal(w[:, 2].clone(), want_w[200:500, 2])
        whole = disk_view(owner, table, 0, 0, ROWS, chunk_rows=CHUNK)
        assert torch.equal(whole.clone(), want_w)
        if where == "disk":
            assert table.disk.num_slots == 80  # (the host cache holds 80 of the 600 rows)
    finally:
        table.close()


def test_values_leave_as_plain_tensors(tmp_path):
    want_w, want_s = _reference(tmp_path)
    table = _table(tmp_path)
    owner = _train(table)
    try:
        w = disk_view(owner, table, 0, 40, 100, chunk_rows=CHUNK)
        s = disk_view(owner, table, 1, 40, 100, chunk_rows=CHUNK)
        want = want_w[40:140]
        assert w.cpu() is w  # (already on the CPU: still the view)
        assert torch.equal(w, want) and torch.equal(want, w) and torch.equal(s, want_s[40:140])
        for got in (w * 2, w + s[:, None], w.sum(1), w.to(torch.float64), w.clone(), w.contiguous().clone()):
            assert type(got) is torch.Tensor
        assert torch.equal(w * 2, want * 2) and torch.equal(w + s[:, None], want + want_s[40:140, None])
        assert np.array_equal(w.numpy(), want.numpy()) and np.array_equal(np.asarray(w), want.numpy())
        assert w.tolist() == want.tolist() and w[3, 1].item() == want[3, 1].item()
        buf = io.BytesIO()
        torch.save({"w": w, "s": s}, buf)
        buf.seek(0)
        loaded = torch.load(buf)
        assert type(loaded["w"]) is torch.Tensor and torch.equal(loaded["w"], want)
        assert torch.equal(loaded["s"], want_s[40:140])
        for copied in (copy.deepcopy(w), pickle.loads(pickle.dumps(w))):
            assert type(copied) is torch.Tensor and torch.equal(copied, want)
        assert owner.flushes >= 1 and not table.has_dirty()
    finally:
        table.close()


def test_writes_go_through_to_the_rows_they_cover(tmp_path):
    table = _table(tmp_path)
    owner = _train(table)
    resident = set(table.resident_rows().tolist())
    mirror_w, mirror_s = _reference(tmp_path)  # what the table holds; the writes are applied to it too
    io_counts = disk_view_io(table)
    w = disk_view(owner, table, 0, 0, ROWS, chunk_rows=CHUNK)
    s = disk_view(owner, table, 1, 0, ROWS, chunk_rows=CHUNK)
    try:
        io_counts.reset()
        src = torch.arange(50 * DIM, dtype=torch.float32).view(50, DIM)
        w[100:150].copy_(src)
        mirror_w[100:150].copy_(src)
        assert io_counts.rows_read == 0 and io_counts.rows_written == 50  # a copy_ reads nothing
        assert io_counts.max_rows_per_write == CHUNK and owner.writes == 1 and owner.flushes == 1
        w[150:160].fill_(1.5)
        mirror_w[150:160].fill_(1.5)
        assert io_counts.rows_read == 0 and io_counts.rows_written == 60
        w[0:40].mul_(0.5)
        mirror_w[0:40].mul_(0.5)
        assert io_counts.rows_read == 40 and io_counts.rows_written == 100  # a mul_ reads, then writes
        w[7] = torch.full((DIM,), -3.0)
        mirror_w[7] = torch.full((DIM,), -3.0)
        w[200:260, 1:3].zero_()  # some columns: their rows read and written back
        mirror_w[200:260, 1:3].zero_()
        s[300:340].add_(1.0)
        mirror_s[300:340].add_(1.0)
        torch.nn.init.uniform_(w[400:420], generator=torch.Generator().manual_seed(5))
        torch.nn.init.uniform_(mirror_w[400:420], generator=torch.Generator().manual_seed(5))
        torch.add(src[:10], 1.0, out=w[500:510])
        torch.add(src[:10], 1.0, out=mirror_w[500:510])
        w[590:600].copy_(w[0:10])  # view to view
        mirror_w[590:600].copy_(mirror_w[0:10])
        assert owner.writes == 9 and io_counts.max_rows_per_call == CHUNK
        got_w, got_s = table.read_host_rows(0, ROWS)
        assert torch.equal(got_w, mirror_w) and torch.equal(got_s, mirror_s)  # every other row untouched
        # Cached copies took the writes: the next lookup sees them.
        written = {7, *range(0, 40), *range(100, 160), *range(200, 260), *range(400, 420), *range(500, 510),
                   *range(590, 600)}
        rows = torch.tensor(sorted(resident & written), dtype=torch.int64)
        assert rows.numel() > 0
        assert torch.equal(_lookup(table, rows), mirror_w[rows])
    finally:
        table.close()


def test_a_write_with_a_batch_in_flight_reaches_its_cached_rows(tmp_path):
    """A write between steps with a batch planned and fetched (not yet looked up) goes to the
    file and to the cached copies the batch will read, as with a resident table."""
    table = _table(tmp_path)
    owner = _train(table)
    w = disk_view(owner, table, 0, 0, 20, chunk_rows=CHUNK)
    plan = table.plan(torch.tensor([1, 2]))  # a batch planned and not yet looked up
    owner.engine.run([plan])
    try:
        w.fill_(0.0)
        assert torch.equal(w.clone(), torch.zeros(20, DIM))
        slots = table.planner.row_to_slot[torch.tensor([1, 2])].long()
        assert torch.equal(table.cache_weight[slots], torch.zeros(2, DIM))  # what its lookup reads
        table.release(plan)
    finally:
        table.close()


def test_what_a_disk_view_refuses(tmp_path):
    table = _table(tmp_path)
    owner = _train(table)
    w = disk_view(owner, table, 0, 0, 20, chunk_rows=CHUNK)
    try:
        with pytest.raises(NotImplementedError, match="changes a view's shape in place"):
            w.resize_(10, DIM)
        with pytest.raises(NotImplementedError, match="a view as torch.int32"):
            w.view(torch.int32)
        with pytest.raises(NotImplementedError, match="elements repeat"):
            w[0:1].expand(5, DIM).fill_(1.0)
        with pytest.raises(ValueError, match=r"rows \[590, 610\) are not in its rows \[0, 600\)"):
            disk_view(owner, table, 0, 590, 20)
        with pytest.raises(ValueError, match="component 2 is not one of its 2"):
            disk_view(owner, table, 2, 0, 20)
        # A view outliving its owner (the kernel, whose finalizer removes the file) says so.
        orphan = disk_view(EngineOwner(owner.engine, table), table, 0, 0, 20)
        gc.collect()
        assert orphan.shape == (20, DIM)  # (metadata still answers)
        with pytest.raises(RuntimeError, match="table 't' weight: the module serving this table is gone"):
            orphan.clone()
    finally:
        table.close()
