"""The host tier of a table larger than host memory: a bounded DRAM cache of its rows over
the table's file.

Three tiers, top to bottom: the device cache (``TieredTable``), this host cache (DRAM,
``num_row_slots`` records: a row's weights and optimizer state), and the table's file
(``row_file.RowFile``: whole-row pages, moved whole). This module is the lower hop: it
brings a batch's rows into DRAM ahead of time and keeps them there while the upper hop reads
and writes them.

Why rows and not pages: ids are hashed, so a page's other rows are as cold as any; a cache
of pages would hold one wanted row and ``rows_per_page - 1`` unwanted ones per slot (at 15
rows a page, a 25% cache holds fewer hot rows than a 2% row cache). A read fetches a page
(the unit ``O_DIRECT`` moves) and keeps the rows asked for; a dirty row evicted is written
by a read-modify-write of its page.

Data path of one batch:

1. ``prefetch(rows)`` - bookkeeping on the caller's thread: which rows are in DRAM (pinned),
   which are not (each gets a slot: a free one, else the least recently used unpinned one,
   whose row is written to the file first when dirty). Returns a :class:`DiskTicket` at
   once; its I/O runs in the background.
2. ``wait(ticket)`` - the rows are in DRAM.
3. ``gather(rows)`` / ``scatter(rows, values)`` - read or write the rows' records (weights,
   then each optimizer state) in DRAM; a scatter marks them dirty.
4. ``release(ticket)`` - unpins the rows (each ticket once).
5. ``flush()`` - every dirty row written to the file (e.g. before a checkpoint reads it).

One owner orders every disk move: tickets run one after another on one thread, in issue
order. A ticket reads the pages of its missing rows and of its dirty victims (all in flight
together), patches the victims' records into their pages and writes those pages, then
copies the missing rows into their slots. So a row evicted dirty reaches its file before
any later read of it, whatever is in flight, and two victims of one page never overwrite
each other.

Invariants (``check_invariants``): ``row_slot`` and ``slot_row`` are inverse on occupied
slots; a pinned slot is never a victim; pins return to 0 when every ticket is released.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .errors import CacheCapacityError, StoreStateError
from .row_file import RowFile, aligned_buffer

__all__ = ["Component", "DiskHostTier", "DiskTicket", "record_layout"]


@dataclass(frozen=True)
class Component:
    """One part of a row's record: its name, dtype and elements per row (a row-wise
    optimizer state is 1)."""

    name: str
    dtype: torch.dtype
    width: int


def record_layout(components: Sequence[Component]) -> Tuple[List[int], int]:
    """Byte offsets of each component within a row's record, each aligned to its element
    size, and the record's size (a multiple of 8, so that records tile pages evenly)."""
    offsets, at = [], 0
    for c in components:
        size = torch.empty((), dtype=c.dtype).element_size()
        at = -(-at // size) * size
        offsets.append(at)
        at += size * c.width
    return offsets, max(8, -(-at // 8) * 8)


@dataclass(eq=False)
class DiskTicket:
    """The disk moves of one batch: dirty victims to write back (their rows, from their
    slots, before those slots are reused) and rows to read into their slots; the slots it
    pins until ``release``."""

    seq: int
    pinned_slots: np.ndarray
    write_rows: np.ndarray
    write_slots: np.ndarray
    read_rows: np.ndarray
    read_slots: np.ndarray
    released: bool = False
    _done: threading.Event = field(default_factory=threading.Event, repr=False)
    _error: Optional[BaseException] = field(default=None, repr=False)

    def done(self) -> bool:
        return self._done.is_set()


class DiskHostTier:
    """A bounded DRAM cache of a :class:`RowFile`'s rows (see the module docstring).

    Args:
        file: the table shard's file (its ``row_bytes`` must be ``record_layout``'s size).
        components: the record's parts (weight, then each optimizer state).
        num_row_slots: rows the DRAM cache holds (at least the rows any batches in flight
            pin together).
    """

    def __init__(self, file: RowFile, components: Sequence[Component], num_row_slots: int) -> None:
        self.file = file
        self.table = file.table
        self.components = list(components)
        self.offsets, record = record_layout(self.components)
        if record != file.layout.row_bytes:
            raise StoreStateError(f"table '{self.table}': the file holds records of {file.layout.row_bytes} bytes, "
                                  f"its components need {record}")
        self.record = record
        self.rows_per_page = file.layout.rows_per_page
        self.page_bytes = file.layout.page_bytes
        self.num_rows = file.num_rows
        self.num_slots = max(1, min(int(num_row_slots), self.num_rows))
        self._records = np.zeros((self.num_slots, record), dtype=np.uint8)
        raw = torch.from_numpy(self._records).view(-1)
        # Per component, a [slots, width] view into the records.
        self.views: List[torch.Tensor] = []
        for c, off in zip(self.components, self.offsets):
            size = torch.empty((), dtype=c.dtype).element_size()
            self.views.append(raw.view(c.dtype).as_strided((self.num_slots, c.width), (record // size, 1), off // size))
        self.row_slot = np.full(self.num_rows, -1, dtype=np.int64)
        self.slot_row = np.full(self.num_slots, -1, dtype=np.int64)
        self.pins = np.zeros(self.num_slots, dtype=np.int32)
        self.dirty = np.zeros(self.num_slots, dtype=bool)
        self.last_used = np.zeros(self.num_slots, dtype=np.int64)
        self._clock = 0
        self._seq = 0
        self.in_flight = 0
        self.rows_read = self.rows_written = self.row_hits = self.row_misses = 0
        self.pages_read = self.pages_written = 0
        self.max_requests_in_flight = 0
        self._queue: "queue.Queue[Optional[DiskTicket]]" = queue.Queue()
        self._worker = threading.Thread(target=self._run, name=f"disk-{self.table}", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ planning
    def _unique_rows(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= self.num_rows):
            bad = int(rows.min()) if rows.min() < 0 else int(rows.max())
            raise StoreStateError(f"table '{self.table}': row {bad} is not in the file's rows [0, {self.num_rows})")
        return np.unique(rows)

    def prefetch(self, rows: np.ndarray) -> DiskTicket:
        """Pins ``rows`` in DRAM and queues the disk moves that bring the missing ones in
        (dirty victims written first). Raises ``CacheCapacityError``, changing nothing,
        when they do not fit beside the pinned rows."""
        rows = self._unique_rows(rows)
        slots = self.row_slot[rows]
        miss = slots < 0
        need = int(miss.sum())
        if need:
            candidates = np.flatnonzero(self.pins == 0)
            candidates = np.setdiff1d(candidates, slots[~miss], assume_unique=True)
            if candidates.size < need:
                pinned = int(self.pins.astype(bool).sum())
                raise CacheCapacityError(
                    f"table '{self.table}': a batch needs {need} more rows in the host cache of {self.num_slots} "
                    f"rows, but only {candidates.size} are not pinned by batches in flight; give the host cache at "
                    f"least {pinned + rows.size} rows ({(pinned + rows.size) * self.record} bytes). Nothing changed")
            # Free slots first (their row is -1), then the least recently used.
            order = np.lexsort((self.last_used[candidates], self.slot_row[candidates] >= 0))
            victims = candidates[order[:need]]
        else:
            victims = np.empty(0, dtype=np.int64)
        old_rows = self.slot_row[victims]
        evicted = old_rows >= 0
        wb = victims[evicted & self.dirty[victims]]
        wb_rows = self.slot_row[wb]
        self.row_slot[old_rows[evicted]] = -1
        new_rows = rows[miss]
        self.slot_row[victims] = new_rows
        self.row_slot[new_rows] = victims
        self.dirty[victims] = False
        slots = self.row_slot[rows]
        self.pins[slots] += 1
        self._clock += 1
        self.last_used[slots] = self._clock
        self.row_hits += int(rows.size - need)
        self.row_misses += need
        self._seq += 1
        ticket = DiskTicket(self._seq, slots, wb_rows, wb, new_rows, victims)
        self.in_flight += 1
        self._queue.put(ticket)
        return ticket

    # ------------------------------------------------------------------ the disk owner
    def _move(self, ticket: DiskTicket) -> None:
        """Reads the pages of the ticket's rows (missing and written back), patches the
        write-backs into them and writes those pages, then fills the missing rows' slots."""
        rpp, record = self.rows_per_page, self.record
        wb_pages = np.unique(ticket.write_rows // rpp)
        pages = np.unique(np.concatenate((ticket.read_rows // rpp, wb_pages)))
        if pages.size == 0:
            return
        staging = aligned_buffer(pages.size * self.page_bytes)
        r = self.file.read_pages(pages, staging)
        self.max_requests_in_flight = max(self.max_requests_in_flight, r.requests)
        r.wait()
        self.pages_read += int(pages.size)
        if ticket.write_rows.size:
            at = np.searchsorted(pages, ticket.write_rows // rpp)
            start = (ticket.write_rows % rpp) * record
            staging[(at * self.page_bytes + start)[:, None] + np.arange(record)[None, :]] = \
                self._records[ticket.write_slots]
            sel = np.searchsorted(pages, wb_pages)
            w = self.file.write_pages(wb_pages, staging, sel)
            self.max_requests_in_flight = max(self.max_requests_in_flight, w.requests)
            w.wait()
            self.pages_written += int(wb_pages.size)
            self.rows_written += int(ticket.write_rows.size)
        if ticket.read_rows.size:
            at = np.searchsorted(pages, ticket.read_rows // rpp)
            start = (ticket.read_rows % rpp) * record
            idx = (at * self.page_bytes + start)[:, None] + np.arange(record)[None, :]
            self._records[ticket.read_slots] = staging[idx]
            self.rows_read += int(ticket.read_rows.size)

    def _run(self) -> None:
        while True:
            ticket = self._queue.get()
            if ticket is None:
                return
            try:
                self._move(ticket)
            except BaseException as e:  # reported to whoever waits for this ticket
                ticket._error = e
            finally:
                ticket._done.set()

    def wait(self, ticket: DiskTicket) -> None:
        """Returns once the ticket's rows are in DRAM; raises its I/O error (the rows it was
        to read are then unmapped, so nothing reads what did not arrive)."""
        ticket._done.wait()
        if ticket._error is not None:
            self._forget(ticket)
            raise ticket._error

    def _forget(self, ticket: DiskTicket) -> None:
        gone = ticket.read_slots[self.slot_row[ticket.read_slots] == ticket.read_rows]
        self.row_slot[self.slot_row[gone]] = -1
        self.slot_row[gone] = -1

    def release(self, ticket: DiskTicket) -> None:
        """Unpins the ticket's rows (idempotent)."""
        if ticket.released:
            return
        ticket.released = True
        self.pins[ticket.pinned_slots] -= 1
        self.in_flight -= 1

    # ------------------------------------------------------------------ rows
    def _where(self, rows: torch.Tensor) -> torch.Tensor:
        r = rows.to(torch.int64).numpy()
        slots = self.row_slot[r]
        if slots.size and slots.min() < 0:
            missing = int(r[np.argmin(slots)])
            raise StoreStateError(f"table '{self.table}': row {missing} is not in the host cache; prefetch and wait "
                                  f"for its batch first")
        return torch.from_numpy(slots)

    def gather(self, rows: torch.Tensor) -> List[torch.Tensor]:
        """The records of ``rows`` (in DRAM: pinned by a waited ticket), per component."""
        slots = self._where(rows)
        return [v.index_select(0, slots) for v in self.views]

    def scatter(self, rows: torch.Tensor, values: Sequence[torch.Tensor]) -> None:
        """Writes the records of ``rows`` (in DRAM), per component; they become dirty."""
        slots = self._where(rows)
        for v, val in zip(self.views, values):
            v.index_copy_(0, slots, val.reshape(val.shape[0], -1).to(v.dtype))
        self.dirty[slots.numpy()] = True

    def write_rows(self, rows: torch.Tensor, values: Sequence[torch.Tensor]) -> None:
        """Writes whole records through the cache, in chunks that fit it (e.g. a table's
        initial values, streamed in: never the whole table in DRAM at once)."""
        rows = rows.to(torch.int64)
        chunk = max(1, (self.num_slots - int(self.pins.astype(bool).sum())) // 2)
        for start in range(0, rows.shape[0], chunk):
            part = rows[start: start + chunk]
            ticket = self.prefetch(part.numpy())
            try:
                self.wait(ticket)
                self.scatter(part, [v[start: start + chunk] for v in values])
            finally:
                self.release(ticket)

    def read_rows(self, rows: torch.Tensor) -> List[torch.Tensor]:
        """The whole records of ``rows`` (any rows, in order), per component, read through
        the cache in chunks that fit it: fresh tensors, never the whole table at once
        unless asked for it."""
        rows = rows.to(torch.int64)
        out = [torch.empty(rows.shape[0], c.width, dtype=c.dtype) for c in self.components]
        chunk = max(1, (self.num_slots - int(self.pins.astype(bool).sum())) // 2)
        for start in range(0, rows.shape[0], chunk):
            part = rows[start: start + chunk]
            ticket = self.prefetch(part.numpy())
            try:
                self.wait(ticket)
                for o, v in zip(out, self.gather(part)):
                    o[start: start + part.shape[0]] = v
            finally:
                self.release(ticket)
        return out

    # ------------------------------------------------------------------ whole tier
    def flush(self) -> None:
        """Writes every dirty row to the file, behind every queued ticket (they are clean
        afterwards)."""
        slots = np.flatnonzero(self.dirty & (self.slot_row >= 0))
        rows = self.slot_row[slots]
        order = np.argsort(rows)
        self.dirty[slots] = False
        empty = np.empty(0, dtype=np.int64)
        ticket = DiskTicket(0, empty, rows[order], slots[order], empty, empty, released=True)
        self._queue.put(ticket)
        ticket._done.wait()
        if ticket._error is not None:
            self.dirty[slots] = True
            raise ticket._error

    def check_invariants(self, expect_drained: bool = False) -> None:
        problems = []
        occ = np.flatnonzero(self.slot_row >= 0)
        if not np.array_equal(self.row_slot[self.slot_row[occ]], occ):
            problems.append("row_slot and slot_row are not inverse")
        if int((self.row_slot >= 0).sum()) != occ.size:
            problems.append("rows mapped to free slots")
        if (self.pins < 0).any():
            problems.append("negative pins")
        if expect_drained and (self.pins.any() or self.in_flight):
            problems.append(f"{int(self.pins.astype(bool).sum())} slots pinned, {self.in_flight} tickets in flight")
        if problems:
            raise StoreStateError(f"table '{self.table}' host cache: " + "; ".join(problems))

    def stats(self) -> Dict[str, int]:
        return {"rows_read": self.rows_read, "rows_written": self.rows_written, "row_hits": self.row_hits,
                "row_misses": self.row_misses, "pages_read": self.pages_read, "pages_written": self.pages_written,
                "max_requests_in_flight": self.max_requests_in_flight, "bytes_read": self.file.bytes_read}

    def close(self, remove: bool = True) -> None:
        """Stops the disk owner (after what is queued) and closes the file."""
        if self._worker.is_alive():
            self._queue.put(None)
            self._worker.join()
        self.file.close(remove=remove)
