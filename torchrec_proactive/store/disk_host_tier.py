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
by a read-modify-write of its page (no read when the page's every row is written).

Data path of one batch:

1. ``prefetch(rows, write_only)`` - bookkeeping on the caller's thread: which rows are in
   DRAM (pinned), which are not (each gets an unpinned slot chosen by CLOCK, a second-chance
   approximation of least recently used; a dirty victim's record is copied out now, to be
   written to its page).
   ``rows`` are read from the file; ``write_only`` rows - whole records the caller
   overwrites, such as the device cache's write-backs - get a slot and no read. Returns a
   :class:`DiskTicket` at once; its I/O runs in the background.
2. ``wait(ticket)`` - the rows are in DRAM (its write-backs may still be in flight: their
   records were copied out, and the page order below keeps them exact).
3. ``gather(rows)`` / ``scatter(rows, values)`` - read or write the rows' records (weights,
   then each optimizer state) in DRAM; a scatter marks them dirty.
4. ``release(ticket)`` - unpins the rows (each ticket once).
5. ``flush()`` - every dirty row written to the file (e.g. before a checkpoint reads it).

One owner orders every disk move: one thread takes the tickets in issue order and turns each
into page requests on the file's pool of ``io_threads`` (default 64), so the reads of several
tickets - batches staged ahead, and the batch being planned - are in flight together. The
order it keeps:

* per page: a request on page P waits for every earlier *write* of P (a write is a
  read-modify-write of P, patching the victims' records in). So a row evicted dirty reaches
  its file before any later read of it, and two write-backs of one page never overwrite each
  other. Reads of pages no earlier write touches run in any order;
* per slot: a ticket whose rows hit slots another ticket is still reading is ready only when
  that one is (``deps``); a victim slot whose read is still landing (its batch was unstaged
  first) takes its new row only after it landed (``slot_deps``).

Faults: a failed request is one ``DiskTierError`` naming the table and the file. A ticket
whose read failed raises it at ``wait`` and the rows that did not arrive are unmapped (read
again next time). A dirty record whose write failed stays in DRAM as an *orphan*: the next
prefetch of its row takes it from there (dirty again, written with its next eviction) and
``flush`` writes it, so nothing is lost and a retry after the fault is cleared continues
exactly. A write failure (or a failed read of a batch staged and never waited) is raised by
the next ``wait`` or ``flush``.

Invariants (``check_invariants``): ``row_slot`` and ``slot_row`` are inverse on occupied
slots; a pinned slot is never a victim; a dirty slot holds its row's value; no orphan is
also cached; pins return to 0 when every ticket is released.
"""

from __future__ import annotations

import collections
import queue
import threading
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .errors import CacheCapacityError, StoreStateError
from .row_file import DiskTierError, RowFile, aligned_buffer

__all__ = ["Component", "DiskHostTier", "DiskTicket", "HostCacheCapacityError", "record_layout"]

_EMPTY = np.empty(0, dtype=np.int64)


#: How long ``close`` waits for the disk owner to stop before it gives up waiting.
CLOSE_TIMEOUT_S = 10.0


class HostCacheCapacityError(CacheCapacityError):
    """The host cache cannot hold the rows that batches in flight and staged pin together."""


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


def _split_by_writes(runs: List["_Run"]) -> Tuple[List["_Run"], List["_Run"]]:
    """``(free, held)``: the runs whose earlier writes have all ended, and the others - each
    run in exactly one, by one look at each write (a write may end while this runs: two
    looks could put a run in both groups, or in neither)."""
    free: List[_Run] = []
    held: List[_Run] = []
    for run in runs:
        (free if all(pw.event.is_set() for pw in run.after) else held).append(run)
    return free, held


def _spans(spans: List[Tuple[int, int]]) -> np.ndarray:
    """The indices of half-open ``[a, b)`` spans, concatenated (vector ops)."""
    if not spans:
        return _EMPTY
    a, b = np.array(spans, dtype=np.int64).T
    lengths = b - a
    starts = np.repeat(a - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
    return starts + np.arange(int(lengths.sum()), dtype=np.int64)


class _PageWrite:
    """One write request: pages ``[first, last)``, id ``wid`` in the owner's ``_writes``;
    ``event`` is set when it ended. When it failed, ``failed_seq`` is the last ticket issued
    before its records became orphans: those tickets may have planned to read the rows from
    the file, which lacks them."""

    __slots__ = ("event", "failed_seq", "error", "wid", "first", "last")

    def __init__(self, wid: int, first: int, last: int) -> None:
        self.event = threading.Event()
        self.failed_seq: Optional[int] = None
        self.error: Optional[BaseException] = None
        self.wid, self.first, self.last = wid, first, last


@dataclass(eq=False)
class _Run:
    """One request of a ticket: file pages ``[first, first + count)`` in its staging at page
    ``at``; ``read``: the pages are read first; its read rows ``[r0, r1)`` and write rows
    ``[w0, w1)`` (the ticket's sorted lists); the earlier writes of its pages it follows;
    its own write, if it writes."""

    first: int
    at: int
    count: int
    read: bool
    r0: int
    r1: int
    w0: int
    w1: int
    after: List[_PageWrite]
    write: Optional[_PageWrite]
    # A failed earlier write of its pages that this run's write passes on: the file still
    # lacks that write's records, so reads by tickets up to its ``failed_seq`` must not
    # trust the page after this write either.
    taint: Optional[_PageWrite] = None


@dataclass(eq=False)
class DiskTicket:
    """The disk moves of one batch (or one stage, or one flush): rows to read into their
    slots, write-only rows given slots, dirty records to write (copied out at prefetch; an
    orphan flag says the row is no longer cached, so its record is the only copy), and the
    slots it pins until ``release``.

    ``done()``: its rows are in DRAM (its reads landed, and those of the tickets it waits
    for); its writes may still be in flight."""

    seq: int
    kind: str
    pinned_slots: np.ndarray
    read_rows: np.ndarray
    read_slots: np.ndarray
    wo_rows: np.ndarray
    wo_slots: np.ndarray
    write_rows: np.ndarray
    write_records: np.ndarray
    write_orphan: np.ndarray
    deps: List["DiskTicket"] = field(default_factory=list, repr=False)
    slot_deps: List["DiskTicket"] = field(default_factory=list, repr=False)
    released: bool = False
    reported: bool = False
    _ready: threading.Event = field(default_factory=threading.Event, repr=False)
    _finished: threading.Event = field(default_factory=threading.Event, repr=False)
    _read_error: Optional[BaseException] = field(default=None, repr=False)
    _write_error: Optional[BaseException] = field(default=None, repr=False)
    _reads_left: int = field(default=0, repr=False)
    _tasks_left: int = field(default=0, repr=False)
    _staging: Optional[np.ndarray] = field(default=None, repr=False)
    _runs: List[_Run] = field(default_factory=list, repr=False)
    # (the owner's per-row indices into the staging; see ``_runs_of``)
    _view: Optional[np.ndarray] = field(default=None, repr=False)
    _r_at: Optional[np.ndarray] = field(default=None, repr=False)
    _r_off: Optional[np.ndarray] = field(default=None, repr=False)
    _w_at: Optional[np.ndarray] = field(default=None, repr=False)
    _w_off: Optional[np.ndarray] = field(default=None, repr=False)
    _r_from_file: Optional[np.ndarray] = field(default=None, repr=False)

    def done(self) -> bool:
        return (self._ready.is_set() and all(d._ready.is_set() for d in self.deps)
                and all(d._ready.is_set() for d in self.slot_deps))

    @property
    def error(self) -> Optional[BaseException]:
        return self._read_error


class DiskHostTier:
    """A bounded DRAM cache of a :class:`RowFile`'s rows (see the module docstring).

    Args:
        file: the table shard's file (its ``row_bytes`` must be ``record_layout``'s size).
        components: the record's parts (weight, then each optimizer state).
        num_row_slots: rows the DRAM cache holds (at least the rows any batches in flight
            and staged pin together).
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
        # Whether the slot holds its row's value (False: a read or a write-only row's
        # overwrite has not landed yet).
        self.valid = np.zeros(self.num_slots, dtype=bool)
        # The ticket reading into each slot (its seq; 0: none).
        self._filler = np.zeros(self.num_slots, dtype=np.int64)
        self.last_used = np.zeros(self.num_slots, dtype=np.int64)
        # CLOCK: a slot's reference bit (used since the hand last passed) and the hand.
        self.ref = np.zeros(self.num_slots, dtype=bool)
        self._hand = 0
        self.victim_slots_scanned = self.victims_chosen = 0
        self._clock = 0
        self._seq = 0
        self.in_flight = 0
        # Bookkeeping is changed by the planning thread and the fetch engine's thread, and
        # counters by the I/O threads: one lock for all of it (held for NumPy ops only).
        self._lock = threading.Lock()
        self._pending: Dict[int, DiskTicket] = {}  # tickets whose reads have not all landed
        self._active: Dict[int, DiskTicket] = {}  # tickets whose requests have not all ended
        self._failed: List[DiskTicket] = []  # failed tickets not yet forgotten
        self._unreported: List[BaseException] = []  # faults no ``wait`` has raised yet
        self._orphans: Dict[int, np.ndarray] = {}  # row -> its record, when its write failed
        # Per page, its last write: an id into ``_writes`` (-1: none kept). The owner's only.
        self._page_write = np.full(file.num_pages, -1, dtype=np.int64)
        self._writes: Dict[int, _PageWrite] = {}
        self._write_ids = 0
        # Writes that ended well, for the owner to forget (``_forget_ended_writes``): a page
        # whose last write ended is followed by nobody, and the owner looks at fewer pages.
        self._ended_writes: "collections.deque[_PageWrite]" = collections.deque()
        self.reset_stats()
        self._queue: "queue.Queue[Optional[DiskTicket]]" = queue.Queue()
        self._worker = threading.Thread(target=self._run, name=f"disk-{self.table}", daemon=True)
        self._worker.start()

    def reset_stats(self) -> None:
        """Zeroes the counters (``stats``), this tier's and its file's."""
        self.rows_read = self.rows_written = self.row_hits = self.row_misses = 0
        self.write_only_rows = self.pages_not_read = self.orphans_taken = self.write_failures = 0
        self.tickets = self.tickets_read = self.rows_read_per_ticket_max = 0
        self.stages = self.stage_rows = self.stage_rows_read = 0
        self.plan_rows_hit = self.plan_rows_missed = self.faults = 0
        self.victim_slots_scanned = self.victims_chosen = 0
        f = self.file
        with f._lock:
            f.reads = f.writes = f.bytes_read = f.bytes_written = f.pages_read = f.pages_written = 0
            f.reads_in_flight_max = f._reads_in_flight_sum = 0

    # ------------------------------------------------------------------ planning
    def pinned_rows(self) -> int:
        """Rows pinned now by tickets not released (batches in flight, stages)."""
        with self._lock:
            return int(np.count_nonzero(self.pins))

    def _unique_rows(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= self.num_rows):
            bad = int(rows.min()) if rows.min() < 0 else int(rows.max())
            raise StoreStateError(f"table '{self.table}': row {bad} is not in the file's rows [0, {self.num_rows})")
        return np.unique(rows)

    def prefetch(self, rows: np.ndarray, write_only: Optional[np.ndarray] = None, kind: str = "batch") -> DiskTicket:
        """Pins ``rows`` and ``write_only`` rows in DRAM and queues the disk moves that read
        the missing ``rows`` (``write_only`` rows get a slot, no read: the caller overwrites
        their whole records after ``wait``). Dirty victims' records are copied out now and
        written in the background. ``kind``: ``"batch"``, ``"stage"`` (a future batch's rows,
        read ahead) or ``"bulk"`` (whole-table reads and writes), for the counters only.

        Raises ``HostCacheCapacityError`` (a ``CacheCapacityError``), changing nothing, when
        the rows do not fit beside the pinned ones."""
        rows = self._unique_rows(rows)
        wo = _EMPTY if write_only is None else self._unique_rows(write_only)
        if wo.size and rows.size:
            wo = np.setdiff1d(wo, rows, assume_unique=True)
        with self._lock:
            self._sweep()
            ticket = self._plan(rows, wo, kind)
            if ticket._tasks_left:
                self._queue.put(ticket)  # (under the lock: the owner takes tickets in seq order)
        return ticket

    def _plan(self, rows: np.ndarray, wo: np.ndarray, kind: str) -> DiskTicket:
        """``prefetch``'s bookkeeping (under the lock)."""
        all_rows = np.concatenate((rows, wo))
        slots = self.row_slot[all_rows]
        miss = slots < 0
        need = int(np.count_nonzero(miss))
        hit_slots = slots[~miss]
        if need:
            victims = self._victims(need, hit_slots)
            if victims.size < need:
                free = (self.pins == 0) & ~(self.dirty & ~self.valid)
                free[hit_slots] = False
                pinned = int(np.count_nonzero(self.pins))
                least = pinned + all_rows.size - int(np.count_nonzero(self.pins[hit_slots]))
                what = "staging a batch" if kind == "stage" else "a batch"
                raise HostCacheCapacityError(
                    f"table '{self.table}': {what} needs {need} more rows in the host cache of {self.num_slots} "
                    f"rows, but only {int(np.count_nonzero(free))} are not pinned by batches in flight or staged; "
                    f"give the host cache at least {least} rows ({least * self.record} bytes). Nothing changed")
        else:
            victims = _EMPTY
        # Victim slots whose read is still landing (a batch staged, then unstaged before it
        # was used): the new rows go in only after it landed.
        slot_deps = self._pending_tickets(self._filler[victims]) if victims.size else []
        old_rows = self.slot_row[victims]
        evicted = old_rows >= 0
        wb = victims[evicted & self.dirty[victims]]
        wb_rows = self.slot_row[wb]
        wb_records = self._records[wb]  # (a copy: the slot is reused at once)
        self.row_slot[old_rows[evicted]] = -1
        new_rows = all_rows[miss]
        self.slot_row[victims] = new_rows
        self.row_slot[new_rows] = victims
        self.dirty[victims] = False
        self.valid[victims] = False
        n_read = int(np.count_nonzero(miss[: rows.size]))
        read_rows, read_slots = new_rows[:n_read], victims[:n_read]
        wo_rows, wo_slots = new_rows[n_read:], victims[n_read:]
        self._seq += 1
        seq = self._seq
        self._filler[read_slots] = seq
        # A write-only row's slot is the caller's to fill: no earlier read may land there
        # after it (``wait`` waits for it) nor be undone over it.
        wo_hits = slots[rows.size:][~miss[rows.size:]]
        if wo_hits.size:
            slot_deps += [t for t in self._pending_tickets(self._filler[wo_hits]) if t not in slot_deps]
            self._filler[wo_hits] = 0
        self._filler[wo_slots] = 0
        # The ticket's rows read from slots another ticket is still reading: ready with it.
        deps = self._pending_tickets(self._filler[slots[: rows.size][~miss[: rows.size]]])
        w_rows, w_records, w_orphan = [wb_rows], [wb_records], [np.ones(wb_rows.size, dtype=bool)]
        if self._orphans:
            if wo_rows.size:  # overwritten whole by the caller: the orphan is superseded
                for r in wo_rows[np.isin(wo_rows, np.fromiter(self._orphans, dtype=np.int64))].tolist():
                    del self._orphans[r]
            if read_rows.size and self._orphans:
                # Rows whose last write failed: written with this ticket (and read back from
                # the patched page), dirty again until that write lands.
                mine = read_rows[np.isin(read_rows, np.fromiter(self._orphans, dtype=np.int64))]
                if mine.size:
                    w_rows.append(mine)
                    w_records.append(np.stack([self._orphans.pop(r) for r in mine.tolist()]))
                    w_orphan.append(np.ones(mine.size, dtype=bool))
                    self.dirty[self.row_slot[mine]] = True
                    self.orphans_taken += int(mine.size)
        write_rows = np.concatenate(w_rows)
        order = np.argsort(write_rows, kind="stable")
        pinned = self.row_slot[all_rows]
        self.pins[pinned] += 1
        self._clock += 1
        self.last_used[pinned] = self._clock
        self.ref[pinned] = True
        n_hits = rows.size - n_read
        self.row_hits += n_hits
        self.row_misses += n_read
        self.write_only_rows += int(wo_rows.size)
        self.tickets += 1
        if kind == "stage":
            self.stages += 1
            self.stage_rows += int(rows.size)
            self.stage_rows_read += n_read
        elif kind == "batch":
            self.plan_rows_hit += n_hits
            self.plan_rows_missed += n_read
        if n_read:
            self.tickets_read += 1
            self.rows_read_per_ticket_max = max(self.rows_read_per_ticket_max, n_read)
        ticket = DiskTicket(seq, kind, pinned, read_rows, read_slots, wo_rows, wo_slots, write_rows[order],
                            np.concatenate(w_records)[order], np.concatenate(w_orphan)[order], deps, slot_deps)
        self.in_flight += 1
        self._start(ticket)
        return ticket

    def _victims(self, need: int, exclude: np.ndarray) -> np.ndarray:
        """``need`` victim slots by CLOCK (second chance), or fewer when the cache has no
        more (the caller refuses the batch; nothing changed but reference bits and the hand).

        A slot is a candidate when unpinned, not in ``exclude`` (the batch's own hits) and
        holding its value (an orphan read back, dirty, whose read has not landed has no
        record to write yet); a candidate used since the hand last passed gets a second
        chance (its bit is cleared). The hand scans a window of about twice what is needed,
        doubling until it has enough: O(rows asked for), not O(host cache) - a host cache
        of a million rows is searched in microseconds, as the device cache's clock-hand
        window is. Deterministic for the same history."""
        n = self.num_slots
        if exclude.size:
            self.pins[exclude] += 1  # (not candidates while the hand passes; undone below)
        try:
            taken: List[np.ndarray] = []
            got, scanned, window = 0, 0, max(64, 2 * need)
            while got < need and scanned < 2 * n:  # two sweeps: the first may only clear bits
                w = min(window, n, 2 * n - scanned)  # (at most n: no slot twice in a window)
                idx = (self._hand + np.arange(w, dtype=np.int64)) % n
                ok = (self.pins[idx] == 0) & ~(self.dirty[idx] & ~self.valid[idx])
                second = ok & self.ref[idx]
                ok &= ~self.ref[idx]
                if scanned + w > n and got:  # the second sweep: never the same slot twice
                    ok &= ~np.isin(idx, np.concatenate(taken))
                pick = np.flatnonzero(ok)[: need - got]
                upto = int(pick[-1]) + 1 if got + pick.size == need else w
                # bits cleared only where the hand passed
                self.ref[idx[:upto][second[:upto]]] = False
                taken.append(idx[pick])
                got += pick.size
                self._hand = int((self._hand + upto) % n)
                scanned += upto
                window *= 2
            self.victim_slots_scanned += scanned
            self.victims_chosen += got
            return np.concatenate(taken) if taken else _EMPTY
        finally:
            if exclude.size:
                self.pins[exclude] -= 1

    def _start(self, ticket: DiskTicket) -> None:
        """Sets what the ticket waits for before the owner takes it (under the lock)."""
        if ticket.read_rows.size:
            ticket._tasks_left = 1  # (the owner sets the real counts)
            self._pending[ticket.seq] = ticket
            self._active[ticket.seq] = ticket
        elif ticket.write_rows.size:
            ticket._tasks_left = 1
            ticket._ready.set()  # (nothing to read: ready now, its writes in the background)
            self._active[ticket.seq] = ticket
        else:
            ticket._ready.set()
            ticket._finished.set()

    def _pending_tickets(self, seqs: np.ndarray) -> List[DiskTicket]:
        if not self._pending or seqs.size == 0:
            return []
        return [self._pending[s] for s in np.unique(seqs).tolist() if s in self._pending]

    def _sweep(self) -> None:
        """Drops landed tickets from ``_pending`` and unmaps the rows of failed ones (under
        the lock), so nothing planned from now on hits a row that did not arrive."""
        for seq in [s for s, t in self._pending.items() if t._ready.is_set()]:
            del self._pending[seq]
        failed, self._failed = self._failed, []
        for t in failed:
            self._forget(t)
            if not t.reported and t._read_error is not None:
                t.reported = True
                self._unreported.append(t._read_error)

    # ------------------------------------------------------------------ the disk owner
    def _run(self) -> None:
        while True:
            ticket = self._queue.get()
            if ticket is None:
                return
            try:
                self._issue(ticket)
            except BaseException as e:  # (nothing submitted: reported to whoever waits for it)
                for run in ticket._runs:
                    self._end_run(ticket, run, e)
                if not ticket._runs:
                    self._end_run(ticket, None, e)
                with self._lock:
                    ticket._tasks_left = 0
                self._finish(ticket, 0)

    def _issue(self, ticket: DiskTicket) -> None:
        """Turns the ticket into page requests (``_Run``) following the earlier writes of
        their pages, and puts them on the file's I/O pool."""
        if len(self._writes) > 4096 and ticket.seq % 64 == 0:
            self._prune_writes(ticket.seq)
        runs = ticket._runs = []
        self._runs_of(ticket, runs)
        ticket._reads_left = sum(1 for r in runs if r.r1 > r.r0)
        # Once per ticket (two ``stat`` calls): a file truncated or replaced under the job is
        # found before anything is read from it or written to it.
        self.file.check_identity()
        shares = self.file.shares(runs)
        ticket._tasks_left = len(shares)
        if ticket._reads_left == 0:
            ticket._ready.set()
        for share in shares:
            self.file.submit(self._do_share, ticket, share)

    def _forget_ended_writes(self) -> None:
        """Forgets the writes that ended well since the last call (the owner only): their
        pages are followed by nobody now, unless a later write took them over."""
        ended = self._ended_writes
        while ended:
            w = ended.popleft()
            pages = self._page_write[w.first:w.last]
            pages[pages == w.wid] = -1
            self._writes.pop(w.wid, None)

    def _prune_writes(self, seq: int) -> None:
        """Forgets the page writes that ended and that no ticket from ``seq`` on follows
        (the owner only; pages naming a forgotten one have none)."""
        self._writes = {i: w for i, w in self._writes.items()
                        if not w.event.is_set() or (w.failed_seq is not None and seq <= w.failed_seq)}

    def _runs_of(self, ticket: DiskTicket, runs: List[_Run]) -> None:
        """The ticket's requests, into ``runs``: runs of consecutive pages alike (read or
        not, written or not), each following the earlier writes of its pages (the owner
        only: it alone keeps ``_page_write``)."""
        self._forget_ended_writes()
        rpp = self.rows_per_page
        rp = ticket.read_rows // rpp
        wp = ticket.write_rows // rpp
        pages = np.union1d(rp, wp)
        if pages.size == 0:
            return
        wpages, wcount = np.unique(wp, return_counts=True)
        at_w = np.searchsorted(pages, wpages)
        writes = np.zeros(pages.size, dtype=bool)
        writes[at_w] = True
        full = np.zeros(pages.size, dtype=bool)
        full[at_w] = wcount >= np.minimum(rpp, self.num_rows - wpages * rpp)
        read = ~full  # (a page whose every row is overwritten is not read)
        self.pages_not_read += int(np.count_nonzero(full))
        brk = np.flatnonzero((np.diff(pages) != 1) | (read[1:] != read[:-1]) | (writes[1:] != writes[:-1])) + 1
        starts = np.concatenate(([0], brk))
        ends = np.concatenate((brk, [pages.size]))
        most = self.file.max_run_pages
        if (ends - starts).max() > most:  # (runs longer than a request are cut)
            bounds = list(zip(starts.tolist(), ends.tolist()))
            starts = np.concatenate([np.arange(s_, e_, most) for s_, e_ in bounds])
            ends = np.concatenate([np.minimum(np.arange(s_, e_, most) + most, e_) for s_, e_ in bounds])
        ticket._staging = aligned_buffer(pages.size * self.page_bytes)
        # Per row, once per ticket (vector ops): its page in the staging and place in the
        # page, so that a request only slices them.
        ticket._view = self._page_view(ticket._staging)
        ticket._r_at, ticket._r_off = np.searchsorted(pages, rp), ticket.read_rows % rpp
        ticket._w_at, ticket._w_off = np.searchsorted(pages, wp), ticket.write_rows % rpp
        # Read rows that came from the file (not orphans written back with this ticket),
        # cumulated, for the counters.
        from_file = ~np.isin(ticket.read_rows, ticket.write_rows) if ticket.write_rows.size else \
            np.ones(ticket.read_rows.size, dtype=bool)
        ticket._r_from_file = np.concatenate(([0], np.cumsum(from_file)))
        firsts, lasts = pages[starts], pages[ends - 1] + 1
        r0s, r1s = np.searchsorted(rp, firsts).tolist(), np.searchsorted(rp, lasts).tolist()
        w0s, w1s = np.searchsorted(wp, firsts).tolist(), np.searchsorted(wp, lasts).tolist()
        # The earlier writes of the ticket's pages it must follow: those not ended, and failed
        # ones it was issued before the records of became orphans (vector ops; a Python loop
        # only over pages that have one).
        ids = self._page_write[pages]
        run_of = np.searchsorted(starts, np.arange(pages.size), side="right") - 1
        after: List[List[_PageWrite]] = [[] for _ in range(starts.size)]
        for k in np.flatnonzero(ids >= 0).tolist():
            pw = self._writes.get(int(ids[k]))
            if pw is not None and (not pw.event.is_set()
                                   or (pw.failed_seq is not None and ticket.seq <= pw.failed_seq)):
                r = int(run_of[k])
                if pw not in after[r]:
                    after[r].append(pw)
        wrote = writes[starts]
        for k, (a, b, first, last) in enumerate(zip(starts.tolist(), ends.tolist(), firsts.tolist(), lasts.tolist())):
            write = None
            if wrote[k]:
                self._write_ids += 1
                write = _PageWrite(self._write_ids, first, last)
                self._writes[self._write_ids] = write
                self._page_write[first:last] = self._write_ids
            runs.append(_Run(first, a, b - a, bool(read[a]), r0s[k], r1s[k], w0s[k], w1s[k], after[k], write))

    def _page_view(self, staging: np.ndarray) -> np.ndarray:
        """The staging's pages as ``[pages, rows_per_page, record]`` (a view)."""
        n = staging.size // self.page_bytes
        return np.lib.stride_tricks.as_strided(staging, (n, self.rows_per_page, self.record),
                                               (self.page_bytes, self.record, 1), writeable=True)

    def _do_share(self, ticket: DiskTicket, runs: List[_Run]) -> None:
        """A share of a ticket's requests, on one pool thread, in two groups: the runs whose
        pages no earlier write still holds, then the others, each after those writes - so a
        read of a page nobody writes never waits for a write of another page. Per group:
        the reads (one call with the ``aio`` backend), the write records patched in, one
        copy of all their read rows into their slots, then their writes. The copy precedes
        the writes, so an orphan's row is in DRAM (dirty) even if its write fails again; a
        write's end is marked as soon as its group's writes ended, for what follows it."""
        for group in _split_by_writes(runs):
            if group:
                self._move_group(ticket, group)
        self._finish(ticket, 1)

    def _move_group(self, ticket: DiskTicket, runs: List[_Run]) -> None:
        failed: Dict[int, BaseException] = {}
        for run in runs:
            try:
                self._follow(ticket, run)
            except BaseException as e:  # (reported through the ticket)
                failed[id(run)] = e
        assert ticket._staging is not None and ticket._view is not None
        reading = [r for r in runs if r.read and id(r) not in failed]
        for run, error in zip(reading, self._moved(False, ticket._staging, reading)):
            if error is not None:
                failed[id(run)] = error
        for run in runs:
            if id(run) in failed:
                self._end_run(ticket, run, failed[id(run)])
        patch = _spans([(r.w0, r.w1) for r in runs if r.w1 > r.w0 and id(r) not in failed])
        if patch.size:
            assert ticket._w_at is not None and ticket._w_off is not None
            ticket._view[ticket._w_at[patch], ticket._w_off[patch]] = ticket.write_records[patch]
        done = [r for r in runs if r.r1 > r.r0 and id(r) not in failed]
        if done:
            for d in ticket.slot_deps:
                d._ready.wait()
            sel = _spans([(r.r0, r.r1) for r in done])
            rows, slots = ticket.read_rows[sel], ticket.read_slots[sel]
            assert ticket._r_at is not None and ticket._r_off is not None
            self._records[slots] = ticket._view[ticket._r_at[sel], ticket._r_off[sel]]
            from_file = sum(int(ticket._r_from_file[r.r1] - ticket._r_from_file[r.r0])  # type: ignore[index]
                            for r in done)
            with self._lock:
                # Valid only where the slot is still this read's: one given to another row
                # meanwhile (unstaged, then a victim) gets its value from that row's move,
                # which waits for this copy (``slot_deps``).
                mine = (self._filler[slots] == ticket.seq) & (self.slot_row[slots] == rows)
                self.valid[slots[mine]] = True
                self.rows_read += from_file
                ticket._reads_left -= len(done)
                if ticket._reads_left == 0 and ticket._read_error is None:
                    ticket._ready.set()
        writing = [r for r in runs if r.w1 > r.w0 and id(r) not in failed]
        errors = dict(zip(map(id, writing), self._moved(True, ticket._staging, writing)))
        written = sum(r.w1 - r.w0 for r in writing if errors[id(r)] is None)
        if written:
            with self._lock:
                self.rows_written += written
        for run in writing:  # (a run that neither failed nor wrote has nothing to end)
            self._end_run(ticket, run, errors[id(run)], reads_landed=True)

    def _moved(self, write: bool, staging: np.ndarray, runs: List[_Run]) -> List[Optional[BaseException]]:
        """The runs' reads or writes; per run, its error. Whatever goes wrong is a run's
        error, never an exception here: every run must end, or what follows its writes
        would wait for ever."""
        if not runs:
            return []
        spans = [(r.first, r.at, r.count) for r in runs]
        try:
            return list(self.file.write_runs(staging, spans) if write else self.file.read_runs(staging, spans))
        except BaseException as e:
            return [e] * len(runs)

    def _follow(self, ticket: DiskTicket, run: _Run) -> None:
        """Waits for the earlier writes of the run's pages; one that failed fails the run
        when it has rows to read (its write passes the failure on, ``taint``)."""
        for pw in run.after:
            pw.event.wait()  # (an earlier request, started before this one: first in, first out)
            if pw.failed_seq is not None and ticket.seq <= pw.failed_seq:
                if run.r1 > run.r0:
                    # (the write's own line, so that what went wrong is said wherever it shows)
                    raise DiskTierError(f"{pw.error} (so page {run.first} was not read after it)")
                if run.taint is None or pw.failed_seq > run.taint.failed_seq:  # type: ignore[operator]
                    run.taint = pw

    def _end_run(self, ticket: DiskTicket, run: Optional[_Run], error: Optional[BaseException],
                 reads_landed: bool = False) -> None:
        """After a request: on failure, its dirty records become orphans (kept in DRAM) and
        the failure goes to the ticket (a read failure unless its reads landed); its write
        is marked ended (so that what follows it may go), failed or not."""
        if error is None:
            if run is not None and run.write is not None:
                if run.taint is not None:
                    run.write.error, run.write.failed_seq = run.taint.error, run.taint.failed_seq
                run.write.event.set()
                if run.taint is None:
                    self._ended_writes.append(run.write)
            return
        with self._lock:
            w0, w1 = (0, ticket.write_rows.size) if run is None else (run.w0, run.w1)
            if w1 > w0:
                self.write_failures += 1
                rows = ticket.write_rows[w0:w1]
                keep = ticket.write_orphan[w0:w1].copy()
                # Not a row a later ticket writes (a newer record: it follows this write
                # on the page, and registers its own should it fail too)...
                for t in self._active.values():
                    if t.seq > ticket.seq and t.write_rows.size:
                        keep &= ~np.isin(rows, t.write_rows)
                for i in np.flatnonzero(keep).tolist():
                    row = int(rows[i])
                    slot = self.row_slot[row]
                    # ...nor where the cache holds the row's value (an orphan read back
                    # before its write failed) or will (a write-only row: the caller's newer
                    # one); a read still to land follows this write and fails with it.
                    if slot < 0 or (self._filler[slot] != 0 and not self.valid[slot]):
                        self._orphans[row] = ticket.write_records[w0 + i].copy()
            reads = run is None or (run.r1 > run.r0 and not reads_landed)
            if reads:
                if ticket._read_error is None:
                    ticket._read_error = error
                if run is not None:
                    ticket._reads_left -= 1
            elif ticket._write_error is None:
                ticket._write_error = error
            if run is not None and run.write is not None:
                run.write.error = error
                run.write.failed_seq = self._seq  # (>= any taint's: tickets issued so far)
        if run is not None and run.write is not None:
            run.write.event.set()

    def _finish(self, ticket: DiskTicket, tasks: int) -> None:
        with self._lock:
            ticket._tasks_left -= tasks
            if ticket._tasks_left > 0:
                return
            ticket._staging = ticket._view = None
            ticket._runs = []
            self._active.pop(ticket.seq, None)
            if ticket._read_error is not None:
                self.faults += 1
                self._failed.append(ticket)
            if ticket._write_error is not None:
                self.faults += 1
                if ticket.kind != "flush":
                    self._unreported.append(ticket._write_error)
        ticket._ready.set()
        ticket._finished.set()

    # ------------------------------------------------------------------ waiting
    def wait(self, ticket: DiskTicket, report_faults: bool = True) -> None:
        """Returns once the ticket's rows are in DRAM. Raises its read error, or that of a
        ticket whose reads it waits for - or a fault of earlier moves no wait raised yet (a
        failed write, a failed read of a batch staged and never waited). Then the rows it
        was to bring that did not arrive are unmapped (read again next time, so nothing
        reads what did not arrive); its pins stay until ``release``. ``report_faults``
        False: only the ticket's own (and its reads') errors are raised, the others wait
        for the next wait or flush."""
        ticket._ready.wait()
        for d in ticket.slot_deps:
            d._ready.wait()
        for d in ticket.deps:
            d._ready.wait()
        error: Optional[BaseException] = ticket._read_error
        failed = [d for d in ticket.deps if d._read_error is not None]
        if error is None and not failed and not (report_faults and self._unreported):
            return
        with self._lock:
            if error is None and failed:
                cause = failed[0]._read_error
                error = DiskTierError(str(cause))
                error.__cause__ = cause
            if error is None and report_faults and self._unreported:
                # The first fault stands for those behind it (one cause, one line); all are
                # counted in ``faults``.
                error, self._unreported = self._unreported[0], []
            if error is None:
                return
            # (a failure the sweep queued before this wait came is raised here, once)
            raised = {id(error), *(id(d._read_error) for d in failed)}
            self._unreported = [e for e in self._unreported if id(e) not in raised]
            ticket.reported = True
            for d in failed:
                d.reported = True
                self._forget(d)
            self._forget(ticket)
        raise error

    def settle(self) -> List[BaseException]:
        """Waits until every request issued so far has ended (reads and background writes),
        and returns the faults among them that no ``wait`` raised (forgetting them: e.g.
        after a fault was raised, before it is cleared and the run resumed)."""
        with self._lock:
            active = list(self._active.values())
        for t in active:
            t._finished.wait()
        with self._lock:
            self._sweep()
            faults, self._unreported = self._unreported, []
        return faults

    def _forget(self, ticket: DiskTicket) -> None:
        """Unmaps the rows the ticket was to bring and did not (reads that did not land,
        write-only slots nobody wrote) - only where the slot is still theirs (under the
        lock). Rows that did land stay: other tickets may hit them."""
        s = ticket.read_slots
        if s.size:
            self._unmap(s[(self._filler[s] == ticket.seq) & (self.slot_row[s] == ticket.read_rows) & ~self.valid[s]])
        s = ticket.wo_slots
        if s.size:
            self._unmap(s[(self.slot_row[s] == ticket.wo_rows) & ~self.valid[s]])

    def _unmap(self, slots: np.ndarray) -> None:
        if slots.size:
            self.row_slot[self.slot_row[slots]] = -1
            self.slot_row[slots] = -1
            self.dirty[slots] = False
            self.valid[slots] = False
            self._filler[slots] = 0

    def release(self, ticket: DiskTicket) -> None:
        """Unpins the ticket's rows (idempotent)."""
        with self._lock:
            if ticket.released:
                return
            ticket.released = True
            self.pins[ticket.pinned_slots] -= 1
            self.in_flight -= 1

    # ------------------------------------------------------------------ rows
    def _where(self, rows: torch.Tensor, reading: bool) -> torch.Tensor:
        r = rows.to(torch.int64).numpy()
        slots = self.row_slot[r]
        if slots.size and slots.min() < 0:
            missing = int(r[np.argmin(slots)])
            raise StoreStateError(f"table '{self.table}': row {missing} is not in the host cache; prefetch and wait "
                                  f"for its batch first")
        if reading and slots.size and not self.valid[slots].all():
            missing = int(r[np.argmin(self.valid[slots])])
            raise StoreStateError(f"table '{self.table}': row {missing} is in the host cache but its value has not "
                                  f"arrived (a write target not written yet)")
        return torch.from_numpy(slots)

    def gather(self, rows: torch.Tensor, out: Optional[Sequence[torch.Tensor]] = None) -> List[torch.Tensor]:
        """The records of ``rows`` (in DRAM: pinned by a waited ticket), per component;
        into ``out`` (``[len(rows), width]`` per component, e.g. pinned staging) if given."""
        slots = self._where(rows, reading=True)
        if out is None:
            return [v.index_select(0, slots) for v in self.views]
        return [torch.index_select(v, 0, slots, out=o) for v, o in zip(self.views, out)]

    def scatter(self, rows: torch.Tensor, values: Sequence[torch.Tensor]) -> None:
        """Writes the records of ``rows`` (in DRAM), per component; they become dirty."""
        slots = self._where(rows, reading=False)
        for v, val in zip(self.views, values):
            v.index_copy_(0, slots, val.reshape(val.shape[0], -1).to(v.dtype))
        s = slots.numpy()
        self.valid[s] = True
        self.dirty[s] = True

    def write_rows(self, rows: torch.Tensor, values: Sequence[torch.Tensor]) -> None:
        """Writes whole records through the cache, in chunks that fit it (e.g. a table's
        initial values, streamed in: never the whole table in DRAM at once, and nothing read
        from the file)."""
        rows = rows.to(torch.int64)
        chunk = max(1, (self.num_slots - int(np.count_nonzero(self.pins))) // 2)
        for start in range(0, rows.shape[0], chunk):
            part = rows[start: start + chunk]
            ticket = self.prefetch(_EMPTY, part.numpy(), kind="bulk")
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
        chunk = max(1, (self.num_slots - int(np.count_nonzero(self.pins))) // 2)
        for start in range(0, rows.shape[0], chunk):
            part = rows[start: start + chunk]
            ticket = self.prefetch(part.numpy(), kind="bulk")
            try:
                self.wait(ticket)
                for o, v in zip(out, self.gather(part)):
                    o[start: start + part.shape[0]] = v
            finally:
                self.release(ticket)
        return out

    # ------------------------------------------------------------------ whole tier
    def flush(self) -> None:
        """Writes every dirty row, and every orphan, to the file, behind every queued ticket
        (they are clean afterwards). Raises a fault of earlier moves not raised yet, or its
        own; the rows it did not write stay dirty (orphans stay orphans)."""
        with self._lock:
            pending = list(self._pending.values())
        for t in pending:  # (an orphan read back is dirty before it lands)
            t._ready.wait()
        with self._lock:
            self._sweep()
            if self._unreported:
                error, self._unreported = self._unreported[0], []
                raise error
            slots = np.flatnonzero(self.dirty & self.valid & (self.slot_row >= 0))
            rows = self.slot_row[slots]
            orphans = np.fromiter(self._orphans, dtype=np.int64, count=len(self._orphans))
            records = [self._records[slots]] + ([np.stack([self._orphans.pop(r) for r in orphans.tolist()])]
                                                if orphans.size else [])
            write_rows = np.concatenate((rows, orphans))
            if write_rows.size == 0:
                return
            order = np.argsort(write_rows, kind="stable")
            keep = np.concatenate((np.zeros(rows.size, dtype=bool), np.ones(orphans.size, dtype=bool)))
            self.dirty[slots] = False
            self._seq += 1
            ticket = DiskTicket(self._seq, "flush", _EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY, write_rows[order],
                                np.concatenate(records)[order], keep[order], released=True, reported=True)
            self._start(ticket)
            self._queue.put(ticket)
        ticket._finished.wait()
        if ticket._write_error is not None:
            with self._lock:
                self.dirty[slots[self.slot_row[slots] == rows]] = True
            raise ticket._write_error

    def check_invariants(self, expect_drained: bool = False) -> None:
        problems = []
        occ = np.flatnonzero(self.slot_row >= 0)
        if not np.array_equal(self.row_slot[self.slot_row[occ]], occ):
            problems.append("row_slot and slot_row are not inverse")
        if int((self.row_slot >= 0).sum()) != occ.size:
            problems.append("rows mapped to free slots")
        if (self.pins < 0).any():
            problems.append("negative pins")
        if (self.dirty & ~self.valid & (self._filler == 0)).any():  # (an orphan's read may be landing)
            problems.append("dirty slots without their value")
        if self._orphans and (self.row_slot[np.fromiter(self._orphans, dtype=np.int64)] >= 0).any():
            problems.append("orphan rows also cached")
        if expect_drained and (self.pins.any() or self.in_flight):
            problems.append(f"{int(self.pins.astype(bool).sum())} slots pinned, {self.in_flight} tickets in flight")
        if problems:
            raise StoreStateError(f"table '{self.table}' host cache: " + "; ".join(problems))

    def stats(self) -> Dict[str, float]:
        """Counters since creation (or ``reset_stats``); every one a count of what was done,
        never a time:

        * ``rows_read`` / ``pages_read`` / ``read_requests`` / ``bytes_read``: rows that came
          from the file, the pages and requests that brought them (and the pages the
          read-modify-writes read); ``rows_written`` / ``pages_written`` /
          ``write_requests`` / ``bytes_written`` likewise;
        * ``reads_in_flight_max`` / ``reads_in_flight_mean``: reads in flight at most, and on
          average as each read started (``max_requests_in_flight``: the same maximum);
        * ``tickets``, ``tickets_read`` (those that read), ``rows_read_per_ticket_max`` /
          ``rows_read_per_ticket_mean`` (rows a ticket asked the file for);
        * ``row_hits`` / ``row_misses``: rows to read found in DRAM or not;
          ``write_only_rows``: rows given a slot with no read (overwritten whole);
          ``pages_not_read``: written pages whose every row was overwritten (no read);
        * ``stages`` / ``stage_rows`` / ``stage_rows_read``: batches staged ahead, their rows,
          the rows they read; ``plan_rows_hit`` / ``plan_rows_missed``: a planned batch's rows
          to read already in DRAM or on their way (read ahead) / read by the plan itself;
        * ``orphan_rows`` (now: dirty records whose write failed, kept in DRAM),
          ``orphans_taken`` (served from there since), ``write_failures`` (failed write
          requests), ``faults`` (tickets that failed);
        * ``victim_slots_scanned`` / ``victims_chosen``: slots the CLOCK hand passed and the
          victims it chose (their ratio is the search's cost per row: O(1), not O(cache))."""
        f = self.file
        return {"rows_read": self.rows_read, "rows_written": self.rows_written, "row_hits": self.row_hits,
                "row_misses": self.row_misses, "pages_read": f.pages_read, "pages_written": f.pages_written,
                "read_requests": f.reads, "write_requests": f.writes, "bytes_read": f.bytes_read,
                "bytes_written": f.bytes_written, "reads_in_flight_max": f.reads_in_flight_max,
                "reads_in_flight_mean": f.reads_in_flight_mean, "max_requests_in_flight": f.reads_in_flight_max,
                "tickets": self.tickets, "tickets_read": self.tickets_read,
                "rows_read_per_ticket_max": self.rows_read_per_ticket_max,
                "rows_read_per_ticket_mean": self.row_misses / self.tickets_read if self.tickets_read else 0.0,
                "write_only_rows": self.write_only_rows, "pages_not_read": self.pages_not_read,
                "stages": self.stages, "stage_rows": self.stage_rows, "stage_rows_read": self.stage_rows_read,
                "plan_rows_hit": self.plan_rows_hit, "plan_rows_missed": self.plan_rows_missed,
                "orphan_rows": len(self._orphans), "orphans_taken": self.orphans_taken,
                "write_failures": self.write_failures, "faults": self.faults,
                "victim_slots_scanned": self.victim_slots_scanned, "victims_chosen": self.victims_chosen}

    def close(self, remove: bool = True) -> None:
        """Stops the disk owner (after what is queued) and closes the file (after what is
        in flight)."""
        if self._worker.is_alive():
            self._queue.put(None)
            # Bounded: closing while unwinding from Ctrl-C, the interrupt may have left the
            # owner waiting for something that will not come; the process must still end
            # (its threads are daemons) and the scratch file still go.
            self._worker.join(timeout=CLOSE_TIMEOUT_S)
        self.file.close(remove=remove, wait=not self._worker.is_alive())
