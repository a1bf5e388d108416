"""Reads in flight (issue 42 item 2): the host cache's one owner puts the page requests of
several tickets on the file's pool together (``io_threads``, default 64), while keeping the
order that makes it exact - a dirty row evicted reaches its page before a later read of it,
two write-backs of one page never overwrite each other - and write-only rows read nothing.
Every check is on counters and values, none on time: concurrency is proven by a barrier
that only as many reads in flight at once can pass."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

from torchrec_proactive.store import glibc_aio, row_file
from torchrec_proactive.store.disk_host_tier import Component, DiskHostTier, record_layout
from torchrec_proactive.store.row_file import RowFile

from .io_faults import inject, io_backend  # noqa: F401 (a fixture)

COMPONENTS = [Component("weight", torch.float32, 12), Component("momentum1", torch.float32, 1)]
RPP = 73  # rows per 4 KiB page of 56-byte records


def _tier(tmp_path, rows=20000, row_slots=300, io_threads=64) -> DiskHostTier:
    _, record = record_layout(COMPONENTS)
    f = RowFile(tmp_path / "t.rows", num_rows=rows, row_bytes=record, table="t", io_threads=io_threads)
    return DiskHostTier(f, COMPONENTS, num_row_slots=row_slots)


def _gated_preadv(monkeypatch, parties):
    """``os.preadv`` whose first ``parties`` calls return only once that many are in flight."""
    real = os.preadv
    barrier = threading.Barrier(parties, timeout=30)
    calls = [0]
    lock = threading.Lock()

    def preadv(fd, buffers, offset):
        with lock:
            calls[0] += 1
            gated = calls[0] <= parties
        if gated:
            barrier.wait()
        return real(fd, buffers, offset)

    monkeypatch.setattr(row_file.os, "preadv", preadv)


def _values(rows, fill):
    return [torch.full((len(rows), 12), float(fill)), torch.full((len(rows), 1), float(fill))]


@pytest.mark.parametrize("io_threads, parties", [(64, 30), (8, 8)])
def test_the_reads_of_several_tickets_are_in_flight_together(tmp_path, monkeypatch, io_threads, parties):
    monkeypatch.setenv("TORCHREC_PROACTIVE_DISK_IO", "threads")  # (one request a call: a barrier can count them)
    tier = _tier(tmp_path, io_threads=io_threads)
    try:
        _gated_preadv(monkeypatch, parties)
        # Three batches of 10 rows, each on a page of its own, none adjacent: 30 requests.
        batches = [np.arange(20 * b, 20 * b + 20, 2) * RPP for b in range(3)]
        tickets = [tier.prefetch(rows) for rows in batches]
        for t in tickets:
            tier.wait(t)  # (a barrier that 30 reads cannot pass together would raise here)
            tier.release(t)
        s = tier.stats()
        assert s["reads_in_flight_max"] == parties == s["max_requests_in_flight"]
        if parties == 30:
            # No read ends before the 30th starts: the k-th starts with k in flight.
            assert s["reads_in_flight_mean"] == pytest.approx(15.5)
        assert (s["rows_read"], s["read_requests"], s["pages_read"]) == (30, 30, 30)
        assert (s["tickets_read"], s["rows_read_per_ticket_max"], s["rows_read_per_ticket_mean"]) == (3, 10, 10.0)
        tier.check_invariants(expect_drained=True)
    finally:
        tier.close()


@pytest.mark.skipif(not glibc_aio.available(), reason="glibc's POSIX AIO is Linux/glibc only")
def test_with_aio_each_ticket_is_one_call_and_several_tickets_move_together(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHREC_PROACTIVE_DISK_IO", "aio")
    tier = _tier(tmp_path, io_threads=64)
    try:
        batches = [np.arange(20 * b, 20 * b + 20, 2) * RPP for b in range(3)]
        # A request of each ticket is heard of only once all three tickets' calls are in
        # flight together: a barrier one call at a time cannot pass.
        firsts = {int(rows[0] // RPP) * 4096 for rows in batches}
        barrier = threading.Barrier(3, timeout=30)

        def read(offset, got):
            if offset in firsts:
                barrier.wait()
            return got

        inject(monkeypatch, "aio", read=read)
        calls = tier.file._aio.calls
        tickets = [tier.prefetch(rows) for rows in batches]
        for t in tickets:
            tier.wait(t)
            tier.release(t)
        s = tier.stats()
        assert tier.file._aio.calls == calls + 3 and tier.file._aio.requests_per_call_max == 10
        assert (s["rows_read"], s["read_requests"], s["pages_read"]) == (30, 30, 30)
        # (each call counts min(its requests, descriptors) in flight: three at once make 30)
        assert s["reads_in_flight_max"] == 30
        tier.check_invariants(expect_drained=True)
    finally:
        tier.close()


def _gated_writes(monkeypatch, backend, blocked_calls=1):
    """Writes whose first ``blocked_calls`` requests end only once the returned event is set
    (the store hears of them then)."""
    gate = threading.Event()
    calls = [0]

    def write(offset, got):
        calls[0] += 1
        if calls[0] <= blocked_calls:
            assert gate.wait(30)
        return got

    inject(monkeypatch, backend, write=write)
    return gate


def test_a_row_evicted_dirty_reaches_its_page_before_a_later_read_of_it(tmp_path, monkeypatch, io_backend):
    tier = _tier(tmp_path, row_slots=4)
    try:
        t = tier.prefetch(np.array([0]))
        tier.wait(t)
        tier.scatter(torch.tensor([0]), _values([0], 1.5))
        tier.release(t)
        gate = _gated_writes(monkeypatch, io_backend)
        # Four rows of other pages evict row 0 (dirty): its page's write hangs...
        t = tier.prefetch(np.array([1, 2, 3, 4]) * RPP)
        tier.wait(t)  # ...and this batch is ready all the same (the record was copied out)
        tier.release(t)
        again = tier.prefetch(np.array([0]))
        time.sleep(0.2)  # (room for a wrong order to show: the read must not pass the write)
        assert not again.done()
        gate.set()
        tier.wait(again)
        w, s = tier.gather(torch.tensor([0]))
        assert torch.equal(w, torch.full((1, 12), 1.5)) and torch.equal(s, torch.full((1, 1), 1.5))
        tier.release(again)
        tier.check_invariants(expect_drained=True)
    finally:
        tier.close()


def test_two_write_backs_of_one_page_do_not_overwrite_each_other(tmp_path, monkeypatch, io_backend):
    tier = _tier(tmp_path, row_slots=2)
    try:
        t = tier.prefetch(np.array([0, 1]))  # two rows of page 0
        tier.wait(t)
        tier.scatter(torch.tensor([0, 1]), [torch.stack([torch.full((12,), 2.0), torch.full((12,), 3.0)]),
                                            torch.tensor([[2.0], [3.0]])])
        tier.release(t)
        gate = _gated_writes(monkeypatch, io_backend)
        for row in (RPP, 2 * RPP):  # each evicts one of them: two read-modify-writes of page 0
            t = tier.prefetch(np.array([row]))
            tier.wait(t)
            tier.release(t)
        assert tier.stats()["rows_written"] == 0  # (the first write hangs; the second follows it)
        gate.set()
        tier.flush()
        w, s = tier.read_rows(torch.tensor([0, 1]))
        assert w[:, 0].tolist() == [2.0, 3.0] and s.view(-1).tolist() == [2.0, 3.0]
        assert tier.stats()["rows_written"] == 2 and tier.stats()["write_requests"] == 2
    finally:
        tier.close()


def test_write_only_rows_read_nothing_and_whole_pages_are_written_unread(tmp_path):
    tier = _tier(tmp_path, row_slots=400)
    try:
        rows = np.arange(0, 2 * RPP + 10)  # two whole pages and 10 rows of a third
        t = tier.prefetch(np.empty(0, dtype=np.int64), write_only=rows)
        tier.wait(t)
        assert tier.stats()["pages_read"] == 0 and tier.stats()["write_only_rows"] == rows.size
        with pytest.raises(Exception, match="has not arrived"):
            tier.gather(torch.tensor([5]))  # (a write target not written yet)
        tier.scatter(torch.from_numpy(rows), _values(rows, 4.0))
        tier.release(t)
        tier.flush()
        s = tier.stats()
        # The two whole pages are written without a read; the third is read, patched, written.
        assert (s["pages_written"], s["pages_not_read"], s["pages_read"], s["rows_written"]) == (3, 2, 1, rows.size)
        tier.reset_stats()
        assert not any(tier.stats()[k] for k in ("pages_written", "rows_written", "reads_in_flight_max"))
        w, _ = tier.read_rows(torch.tensor([0, RPP, 2 * RPP + 9, 2 * RPP + 10]))
        assert w[:, 0].tolist() == [4.0, 4.0, 4.0, 0.0]
    finally:
        tier.close()


class _EndsWhileLookedAt:
    """A write's ``event`` that ends between two looks at it (it is running when first asked)."""

    def __init__(self) -> None:
        self.looks = 0

    def is_set(self) -> bool:
        self.looks += 1
        return self.looks > 1


def test_a_write_ending_while_a_share_splits_its_runs_leaves_each_run_in_one_group():
    """The bench found a ticket whose rows were handed out before they arrived: a share split
    its runs into "earlier writes ended" and "not yet" with two looks at each write, and a
    write that ended between them put its run in neither group (never read) or both (counted
    twice, so the ticket was ready early). One look decides now."""
    from torchrec_proactive.store.disk_host_tier import _PageWrite, _Run, _split_by_writes

    def run(first, after):
        return _Run(first, 0, 1, True, 0, 1, 0, 0, after, None)

    write = _PageWrite(1, 3, 4)
    write.event = _EndsWhileLookedAt()
    runs = [run(1, []), run(3, [write]), run(7, [])]
    free, held = _split_by_writes(runs)
    assert sorted(r.first for r in free + held) == [1, 3, 7]  # each run once
    assert [r.first for r in held] == [3] and write.event.looks == 1
