"""Faults of the disk tier (issue 42 item 5), injected: a directory that cannot hold the
file, a full disk mid-run, a short read, the file truncated or replaced under the job. Each
is one ``DiskTierError`` line naming the table and the file; the store stays consistent and
loses nothing (dirty rows stay dirty, records whose write failed stay in DRAM), and a run
resumed after the fault is cleared ends bit-identical to the same table in DRAM."""

from __future__ import annotations

import errno
import os
import re
import threading

import pytest
import torch

from torchrec_proactive.fetch import FetchEngine
from torchrec_proactive.fetch.lookahead import run_lookahead
from torchrec_proactive.store import OptimizerConfig, OptimType, TieredTable, pooled_lookup, row_file
from torchrec_proactive.store.row_file import DiskTierError

from .io_faults import inject, io_backend  # noqa: F401 (a fixture)

ROWS, DIM, STEPS = 3000, 8, 20
CONFIG = OptimizerConfig(OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.05)
RECORD = 4 * DIM + 8


def _batches():
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        values = (torch.rand(48, generator=g) ** 2 * ROWS).long()
        out.append((values, torch.arange(0, 49, 2), None, torch.randn(24, DIM, generator=g)))
    return out


def _init():
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(1))


def _step(anchor, consumed):
    def step(i, tb, batch):
        pooled_lookup(tb, anchor).backward(batch[3])
        consumed.append(i)
    return step


@pytest.fixture(scope="module")
def dram_rows():
    table = TieredTable("t", _init(), CONFIG, num_slots=150)
    engine, consumed = FetchEngine(), []
    run_lookahead(table, engine, _batches(), 0, _step(torch.empty(0, requires_grad=True), consumed))
    engine.flush([table])
    return [table.host_weight.clone(), *[v.clone() for v in table.host_state.values()]]


def _disk_table(tmp_path):
    # Host cache of 250 rows for a 3000-row table: dirty rows are evicted (written) all along.
    return TieredTable.on_disk("t", ROWS, DIM, CONFIG, num_slots=150, directory=tmp_path,
                               host_cache_bytes=250 * RECORD, initial_weight=_init())


def _disk_error(e: BaseException) -> DiskTierError:
    while e is not None and not isinstance(e, DiskTierError):
        e = e.__cause__ or e.__context__
    assert e is not None, "no DiskTierError in the chain"
    return e


def _one_line(err: DiskTierError, table, *words):
    msg = str(err)
    assert "\n" not in msg and msg.startswith("table 't': disk tier file ")
    assert str(table.disk.file.path) in msg
    for w in words:
        assert w in msg, msg


def _faulty_run(table, inject, clear, depth=1, disk_depth=4):
    """Trains until the injected fault stops the run, checks the store, clears the fault and
    trains the batches not consumed yet. Returns the fault."""
    engine, consumed = FetchEngine(), []
    step = _step(torch.empty(0, requires_grad=True), consumed)
    batches = _batches()
    inject()
    try:
        with pytest.raises(Exception) as e:
            run_lookahead(table, engine, batches, depth, step, disk_depth=disk_depth)
            engine.flush([table])
        table.disk.settle()  # (requests still in flight when it was raised end, failing or not)
        table.check_invariants(expect_drained=True)  # consistent: nothing pinned, maps inverse
        assert 0 < len(consumed) < STEPS, len(consumed)  # (it happened mid-run)
    finally:
        clear()
    run_lookahead(table, engine, batches[len(consumed):], depth, step, disk_depth=disk_depth)
    engine.flush([table])
    table.check_invariants(expect_drained=True)
    return _disk_error(e.value)


def _same(table, want):
    table.flush_to_disk()
    assert table.disk.stats()["orphan_rows"] == 0
    got = table.read_host_rows(0, ROWS)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_directory_that_cannot_hold_the_file_is_one_line(tmp_path, monkeypatch):
    with pytest.raises(DiskTierError) as e:
        TieredTable.on_disk("emb", ROWS, DIM, CONFIG, num_slots=10, directory=tmp_path / "missing",
                            host_cache_bytes=100 * RECORD)
    assert str(e.value) == (f"table 'emb': disk tier file {tmp_path / 'missing' / 'emb.rows'} cannot be created: "
                            f"{tmp_path / 'missing'} is not a directory")
    real_access = os.access
    monkeypatch.setattr(row_file.os, "access", lambda p, mode: False if str(p) == str(tmp_path) else real_access(p, mode))
    with pytest.raises(DiskTierError, match=r"^table 'emb': disk tier file .*emb\.rows cannot be created: .* is not "
                                            r"writable$"):
        TieredTable.on_disk("emb", ROWS, DIM, CONFIG, num_slots=10, directory=tmp_path, host_cache_bytes=100 * RECORD)
    monkeypatch.setattr(row_file.os, "access", real_access)
    real_open = os.open

    def read_only_fs(path, flags, mode=0o777):
        if str(path).endswith("emb.rows"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real_open(path, flags, mode)

    monkeypatch.setattr(row_file.os, "open", read_only_fs)
    with pytest.raises(DiskTierError, match=r"^table 'emb': disk tier file .*emb\.rows cannot be opened: Read-only "
                                            r"file system$"):
        TieredTable.on_disk("emb", ROWS, DIM, CONFIG, num_slots=10, directory=tmp_path, host_cache_bytes=100 * RECORD)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("depth, disk_depth", [(0, 0), (1, 4)])
def test_a_full_disk_mid_run_loses_nothing_and_a_resumed_run_is_exact(tmp_path, monkeypatch, dram_rows, depth,
                                                                      disk_depth, io_backend):
    table = _disk_table(tmp_path)
    assert table.disk.file.io_backend == io_backend
    calls = [0]

    def full_after_some(offset, got):
        calls[0] += 1
        if calls[0] > 40:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return got

    orphans, ended = [], []
    try:
        err = _faulty_run(table, lambda: ended.append(inject(monkeypatch, io_backend, write=full_after_some)),
                          lambda: (orphans.append(table.disk.stats()["orphan_rows"]), ended[0]()), depth, disk_depth)
        _one_line(err, table, "write failed at byte", "the disk is full")
        assert orphans[0] > 0  # the records whose write failed, kept in DRAM...
        s = table.disk.stats()
        # ...taken back by the resumed run where it needed their rows, or written by the flush.
        assert s["write_failures"] > 0 and s["orphans_taken"] + s["orphan_rows"] > 0, s
        _same(table, dram_rows)
    finally:
        table.close()


@pytest.mark.parametrize("nth", [60, 150])
def test_a_short_read_mid_run_is_one_line_and_a_resumed_run_is_exact(tmp_path, monkeypatch, dram_rows, nth,
                                                                     io_backend):
    table = _disk_table(tmp_path)
    calls = [0]
    lock = threading.Lock()

    def short_once(offset, got):
        with lock:
            calls[0] += 1
            n = calls[0]
        return got - 100 if n == nth else got

    ended = []
    try:
        err = _faulty_run(table, lambda: ended.append(inject(monkeypatch, io_backend, read=short_once)),
                          lambda: ended[0]())
        _one_line(err, table, "short read at byte")
        got, want = re.search(r"short read at byte \d+: (\d+) of (\d+) bytes", str(err)).groups()
        assert int(want) - int(got) == 100
        _same(table, dram_rows)
    finally:
        table.close()


@pytest.mark.parametrize("how", ["truncated", "replaced"])
def test_a_file_truncated_or_replaced_under_the_job_is_found_at_the_next_move(tmp_path, how):
    table = _disk_table(tmp_path)
    path = table.disk.file.path
    engine, anchor = FetchEngine(), torch.empty(0, requires_grad=True)
    consumed = []

    def step(i, tb, batch):
        pooled_lookup(tb, anchor).backward(batch[3])
        consumed.append(i)
        if i == 4:
            if how == "truncated":
                os.truncate(path, 4096)
            else:
                other = tmp_path / "other"
                other.write_bytes(b"\0" * table.disk.file.size)
                os.replace(other, path)

    try:
        with pytest.raises(Exception) as e:
            run_lookahead(table, engine, _batches(), 1, step, disk_depth=3)
        err = _disk_error(e.value)
        # (writes in flight at the truncation may have grown it again, short of its size)
        want = ("was truncated under the running job (" if how == "truncated"
                else "was replaced under the running job")
        _one_line(err, table, want)
        if how == "truncated":
            assert re.search(rf"\(\d+ of {table.disk.file.size} bytes\)$", str(err))
        assert 4 <= len(consumed) < STEPS
        table.disk.settle()
        table.check_invariants(expect_drained=True)
        with pytest.raises(DiskTierError, match=want.split(" (")[0]):
            table.disk.file.check_identity()
    finally:
        table.close()
    # Only our own file is removed at close: one put in its place is left alone.
    assert path.exists() == (how == "replaced")
