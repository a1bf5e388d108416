"""The host tier of a table larger than host memory: a bounded DRAM cache of its file's pages.

Three tiers, top to bottom: the device cache (``TieredTable``), this host cache (DRAM,
``num_page_slots`` pages of whole rows, pinned memory on CUDA later), and the table's file
(``row_file.RowFile``). This module is the lower hop: it brings the pages of a batch's rows
into DRAM ahead of time and keeps them there while the upper hop reads and writes them.

Data path of one batch:

1. ``prefetch(rows)`` - bookkeeping on the caller's thread: which of the rows' pages are in
   DRAM (pinned), which are not (each gets a page slot: a free one, else the least recently
   used unpinned one, whose page is written to the file first when dirty). Returns a
   :class:`DiskTicket` at once; its I/O runs in the background.
2. ``wait(ticket)`` - the pages are in DRAM.
3. ``gather(rows)`` / ``scatter(rows, values)`` - read or write the rows' records (weights,
   then each optimizer state) in DRAM; a scatter marks the pages dirty.
4. ``release(ticket)`` - unpins the pages (each ticket once).
5. ``flush()`` - every dirty page written to the file (e.g. before a checkpoint reads it).

One owner orders every disk move: tickets run one after another on one thread, in issue
order, each writing its dirty victims before reading its misses into their slots. So a
page evicted dirty reaches its file before any later read of it, whatever is in flight.
Within a ticket, reads and writes go out together (the file's thread pool).

Invariants (``check_invariants``): ``page_slot`` and ``slot_page`` are inverse on occupied
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
from .row_file import BLOCK, RowFile, aligned_buffer

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
    """The disk moves of one batch: pages to write back (from their slots, before those
    slots are reused) and pages to read; the slots it pins until ``release``."""

    seq: int
    pinned_slots: np.ndarray
    write_pages: np.ndarray
    write_slots: np.ndarray
    read_pages: np.ndarray
    read_slots: np.ndarray
    released: bool = False
    _done: threading.Event = field(default_factory=threading.Event, repr=False)
    _error: Optional[BaseException] = field(default=None, repr=False)

    def done(self) -> bool:
        return self._done.is_set()


class DiskHostTier:
    """A bounded DRAM cache of a :class:`RowFile`'s pages (see the module docstring).

    Args:
        file: the table shard's file (its ``row_bytes`` must be ``record_layout``'s size).
        components: the record's parts (weight, then each optimizer state).
        num_page_slots: pages the DRAM cache holds (at least the pages any batches in
            flight pin together).
    """

    def __init__(self, file: RowFile, components: Sequence[Component], num_page_slots: int) -> None:
        self.file = file
        self.table = file.table
        self.components = list(components)
        self.offsets, record = record_layout(self.components)
        if record != file.layout.row_bytes:
            raise StoreStateError(f"table '{self.table}': the file holds records of {file.layout.row_bytes} bytes, "
                                  f"its components need {record}")
        self.rows_per_page = file.layout.rows_per_page
        self.page_bytes = file.layout.page_bytes
        self.num_pages = file.num_pages
        self.num_slots = max(1, min(int(num_page_slots), self.num_pages))
        self._buffer = aligned_buffer(self.num_slots * self.page_bytes)
        raw = torch.from_numpy(self._buffer)
        # Per component, a [slots, rows_per_page, width] view into the page buffer.
        self.views: List[torch.Tensor] = []
        for c, off in zip(self.components, self.offsets):
            size = torch.empty((), dtype=c.dtype).element_size()
            typed = raw.view(c.dtype)
            self.views.append(typed.as_strided((self.num_slots, self.rows_per_page, c.width),
                                               (self.page_bytes // size, record // size, 1), off // size))
        self.page_slot = np.full(self.num_pages, -1, dtype=np.int64)
        self.slot_page = np.full(self.num_slots, -1, dtype=np.int64)
        self.pins = np.zeros(self.num_slots, dtype=np.int32)
        self.dirty = np.zeros(self.num_slots, dtype=bool)
        self.last_used = np.zeros(self.num_slots, dtype=np.int64)
        self._clock = 0
        self._seq = 0
        self.in_flight = 0
        self.pages_read = self.pages_written = self.page_hits = self.page_misses = 0
        self.max_requests_in_flight = 0
        self._queue: "queue.Queue[Optional[DiskTicket]]" = queue.Queue()
        self._worker = threading.Thread(target=self._run, name=f"disk-{self.table}", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ planning
    def _pages_of(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= self.file.num_rows):
            bad = int(rows.min()) if rows.min() < 0 else int(rows.max())
            raise StoreStateError(f"table '{self.table}': row {bad} is not in the file's rows [0, {self.file.num_rows})")
        return np.unique(rows // self.rows_per_page)

    def prefetch(self, rows: np.ndarray) -> DiskTicket:
        """Pins the pages of ``rows`` and queues the disk moves that bring the missing ones
        into DRAM (dirty victims written first). Raises ``CacheCapacityError``, changing
        nothing, when the pages do not fit beside the pinned ones."""
        pages = self._pages_of(rows)
        slots = self.page_slot[pages]
        miss = slots < 0
        need = int(miss.sum())
        candidates = np.flatnonzero(self.pins == 0)
        if need:
            hit_slots = slots[~miss]
            candidates = np.setdiff1d(candidates, hit_slots, assume_unique=True)
            if candidates.size < need:
                raise CacheCapacityError(
                    f"table '{self.table}': a batch needs {need} more pages in the host cache of {self.num_slots} "
                    f"pages, but only {candidates.size} are not pinned by batches in flight; give the host cache at "
                    f"least {int(self.pins.astype(bool).sum()) + pages.size} pages "
                    f"({(int(self.pins.astype(bool).sum()) + pages.size) * self.page_bytes} bytes)")
            # Free slots first (their page is -1: they sort first by last use, kept at 0),
            # then the least recently used.
            order = np.lexsort((self.last_used[candidates], self.slot_page[candidates] >= 0))
            victims = candidates[order[:need]]
        else:
            victims = np.empty(0, dtype=np.int64)
        old_pages = self.slot_page[victims]
        evicted = old_pages >= 0
        wb = victims[evicted & self.dirty[victims]]
        wb_pages = self.slot_page[wb]
        self.page_slot[old_pages[evicted]] = -1
        new_pages = pages[miss]
        self.slot_page[victims] = new_pages
        self.page_slot[new_pages] = victims
        self.dirty[victims] = False
        slots = self.page_slot[pages]
        self.pins[slots] += 1
        self._clock += 1
        self.last_used[slots] = self._clock
        self.page_hits += int(pages.size - need)
        self.page_misses += need
        self._seq += 1
        order_wb = np.argsort(wb_pages)
        order_rd = np.argsort(new_pages)
        ticket = DiskTicket(self._seq, slots, wb_pages[order_wb], wb[order_wb], new_pages[order_rd],
                            victims[order_rd])
        self.in_flight += 1
        self._queue.put(ticket)
        return ticket

    # ------------------------------------------------------------------ the disk owner
    def _run(self) -> None:
        while True:
            ticket = self._queue.get()
            if ticket is None:
                return
            try:
                if ticket.write_pages.size:
                    w = self.file.write_pages(ticket.write_pages, self._buffer, ticket.write_slots)
                    self.max_requests_in_flight = max(self.max_requests_in_flight, w.requests)
                    w.wait()
                    self.pages_written += int(ticket.write_pages.size)
                if ticket.read_pages.size:
                    r = self.file.read_pages(ticket.read_pages, self._buffer, ticket.read_slots)
                    self.max_requests_in_flight = max(self.max_requests_in_flight, r.requests)
                    r.wait()
                    self.pages_read += int(ticket.read_pages.size)
            except BaseException as e:  # reported to whoever waits for this ticket
                ticket._error = e
            finally:
                ticket._done.set()

    def wait(self, ticket: DiskTicket) -> None:
        """Returns once the ticket's pages are in DRAM; raises its I/O error (the pages it
        was to read are then unmapped, so nothing reads what did not arrive)."""
        ticket._done.wait()
        if ticket._error is not None:
            self._forget(ticket)
            raise ticket._error

    def _forget(self, ticket: DiskTicket) -> None:
        gone = ticket.read_slots[self.slot_page[ticket.read_slots] == ticket.read_pages]
        self.page_slot[self.slot_page[gone]] = -1
        self.slot_page[gone] = -1

    def release(self, ticket: DiskTicket) -> None:
        """Unpins the ticket's pages (idempotent)."""
        if ticket.released:
            return
        ticket.released = True
        self.pins[ticket.pinned_slots] -= 1
        self.in_flight -= 1

    # ------------------------------------------------------------------ rows
    def _where(self, rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        r = rows.to(torch.int64).numpy()
        slots = self.page_slot[r // self.rows_per_page]
        if slots.size and slots.min() < 0:
            missing = int(r[np.argmin(slots)])
            raise StoreStateError(f"table '{self.table}': row {missing} is not in the host cache; prefetch and wait "
                                  f"for its batch first")
        return torch.from_numpy(slots), torch.from_numpy(r % self.rows_per_page)

    def gather(self, rows: torch.Tensor) -> List[torch.Tensor]:
        """The records of ``rows`` (in DRAM: pinned by a waited ticket), per component."""
        slots, within = self._where(rows)
        return [v[slots, within] for v in self.views]

    def scatter(self, rows: torch.Tensor, values: Sequence[torch.Tensor]) -> None:
        """Writes the records of ``rows`` (in DRAM), per component; their pages become dirty."""
        slots, within = self._where(rows)
        for v, val in zip(self.views, values):
            v[slots, within] = val.reshape(val.shape[0], -1).to(v.dtype)
        self.dirty[slots.numpy()] = True

    def write_rows(self, rows: torch.Tensor, values: Sequence[torch.Tensor]) -> None:
        """Writes whole records through the cache, in chunks that fit it (e.g. a table's
        initial values, streamed in: never the whole table in DRAM at once)."""
        rows = rows.to(torch.int64)
        chunk = max(1, (self.num_slots - int(self.pins.astype(bool).sum())) // 2) * self.rows_per_page
        for start in range(0, rows.shape[0], chunk):
            part = rows[start: start + chunk]
            ticket = self.prefetch(part.numpy())
            try:
                self.wait(ticket)
                self.scatter(part, [v[start: start + chunk] for v in values])
            finally:
                self.release(ticket)

    # ------------------------------------------------------------------ whole tier
    def flush(self) -> None:
        """Writes every dirty page to the file, behind every queued ticket (they are clean
        afterwards)."""
        slots = np.flatnonzero(self.dirty & (self.slot_page >= 0))
        pages = self.slot_page[slots]
        order = np.argsort(pages)
        self.dirty[slots] = False
        ticket = DiskTicket(0, np.empty(0, dtype=np.int64), pages[order], slots[order],
                            np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64), released=True)
        self._queue.put(ticket)
        ticket._done.wait()
        if ticket._error is not None:
            self.dirty[slots] = True
            raise ticket._error

    def check_invariants(self, expect_drained: bool = False) -> None:
        problems = []
        occ = np.flatnonzero(self.slot_page >= 0)
        if not np.array_equal(self.page_slot[self.slot_page[occ]], occ):
            problems.append("page_slot and slot_page are not inverse")
        if int((self.page_slot >= 0).sum()) != occ.size:
            problems.append("pages mapped to free slots")
        if (self.pins < 0).any():
            problems.append("negative pins")
        if expect_drained and (self.pins.any() or self.in_flight):
            problems.append(f"{int(self.pins.astype(bool).sum())} slots pinned, {self.in_flight} tickets in flight")
        if problems:
            raise StoreStateError(f"table '{self.table}' host cache: " + "; ".join(problems))

    def stats(self) -> Dict[str, int]:
        return {"pages_read": self.pages_read, "pages_written": self.pages_written, "page_hits": self.page_hits,
                "page_misses": self.page_misses, "max_requests_in_flight": self.max_requests_in_flight,
                "reads": self.file.reads, "bytes_read": self.file.bytes_read}

    def close(self, remove: bool = True) -> None:
        """Stops the disk owner (after what is queued) and closes the file."""
        if self._worker.is_alive():
            self._queue.put(None)
            self._worker.join()
        self.file.close(remove=remove)
