"""CUDA transport: a dedicated copy stream, reused pinned staging, events.

Device plans (made by a ``DevicePlanner``, for a table whose host tier the GPU addresses: FBGEMM host-mapped
UVM) move with no host involvement: the issuing thread enqueues, on the copy stream, a
wait for the plan's ready event, one ``move_rows_`` kernel per tensor and direction
(write-backs, then fills; ``store/row_moves.py``: padding entries do nothing, so no size
is read on the host) and a copy of the plan's sizes into pinned memory, then records
E_done and goes on. The training thread never waits for these tickets, whatever the depth
(``FetchEngine.wait`` finds them done; the lookup's stream waits on E_done on the GPU). A
flush, drain or synchronous move that reads the host tier next waits for E_done on the
host (``settle``). Timeline, one ticket::

    1. M  plan(N+k) on the planner's stream P (after P waited for C; event E_plan on P,
          store/plan_stream.py), then issue: records E_ready on C, and on X: wait(E_ready),
          wait(E_plan), write-back kernels, fill kernels, sizes -> pinned, record E_done.
          No host wait.
    2. M  forward(N+k): C.wait_event(E_done) before the lookup reads the slots.
    3. M  later, at any issue or wait: the sizes' copy has landed (E_done passed) -> the
          statistics and the host's pinned-row bound take them in (``poll_sizes``).

When the worker still has tickets queued, a device ticket is queued behind them (the
worker enqueues the same kernels), so tickets start in issue order either way.

Everything else (host-planned tables, overflow plans, a host tier the GPU cannot address)
moves in three parts, all FIFO on one worker thread and one copy stream:

1. *write back* dirty victims: gather their cache rows on the copy stream into a device
   staging buffer, copy it into pinned host staging, synchronise, scatter into the host tier;
2. *gather* the missing rows on the host into pinned staging (a CPU ``index_select``);
3. *fill*: copy the staging to the device (async) and scatter into the victim slots.

Stream fences, as numbered timelines (compute stream C, copy stream X, worker thread W,
main thread M). One ticket, steady state::

    1. M  plan(N+k): picks victims - slots no in-flight batch pins. The rows resident from
          the start (preload) are fills of the first plan; a flush is a plan of write-backs
          only; all of them are tickets like any other, so all go through X in issue order.
    2. M  issue: records event E_ready on C. Every kernel that last updated a victim slot
          (the backward of an earlier batch) was enqueued on C before E_ready.
    3. W  X.wait_event(E_ready): the write-back gather cannot read a victim slot before its
          last update ran, nor can the fill overwrite it.
    4. W  write back (synchronise X: the host scatter needs the bytes), gather, H2D, scatter;
          record E_done on X.
    5. M  forward(N+k): C.wait_event(E_done) before the lookup reads the slots.
    6. M  backward(N+k) updates the slots on C; the slots stay pinned until then, so no
          later ticket picks them as victims (step 1) while those kernels are pending.

Whoever waits first (the forward, a ``drain`` for a checkpoint, a flush): every successful
``FetchEngine.wait`` calls ``complete``, which enqueues ``C.wait_event(E_done)`` on the
*current* stream of the waiting thread, so::

    1. M  drain() on stream S waits for ticket t: S.wait_event(E_done(t)).
    2. M  forward on C waits for t again: C.wait_event(E_done(t)) - not skipped because
          someone else waited first; an already-passed event costs nothing on the GPU.

Staging reuse (two sides of pinned host arenas, A and B, used by chunks in turn)::

    1. W  chunk k gathers into A and enqueues H2D copies that read A; records E_h2d(A) on X.
    2. W  chunk k+1 (of the same ticket or the next) gathers into B while X still copies
          out of A: E_h2d(B).synchronize() first (B's last copy, two chunks back).
    3. W  chunk k+2 uses A again: E_h2d(A).synchronize() before rewriting it, so no copy
          reads bytes meant for a later one. Write-back staging is read by the host right
          after an X synchronize, so it is free at once. Every move (fills, write-backs,
          overflow rows) goes in chunks of at most ``CHUNK_BYTES`` per tensor, so neither
          side outgrows one chunk.

A failed ticket (an exception in W)::

    1. W  raises in ticket t; the engine cancels every ticket queued behind t (they never
          touch X) and records the failure.
    2. M  the next wait/issue rolls back t and the cancelled tickets, newest first: their
          rows are unmapped (host copies are current) or their dirty victims re-mapped.
    3. M  the next ticket plans against a store in which every mapped row is in its slot,
          so it is correct whatever t left half-copied in the slots it had claimed.

Stall on the GPU timeline (not host enqueue time): ``begin_wait`` records E_wait0 on the
waiting stream before the host blocks for the ticket, ``complete`` records E_wait1 after
``wait_event(E_done)``; ``E_wait0 ->
E_wait1`` is how long that stream sat blocked on the copy. Pairs are read once both have
completed (no synchronisation), summed in ``gpu_stall_ms``.

Device plans that take this path (overflow, no host-mapped tier) hold
their row lists and sizes on the device: step 4 starts by reading them back on X
(``resolve_sizes``: the worker W blocks), then moves the same bytes. Before its first host
read of a host tier after device moves, the worker synchronises X (those kernels write
the host tier). Every list is bounded by the batch's ids,
and a flush moves one bounded chunk per ticket, so staging never grows with the dirty set.

Nothing here imports TorchRec.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Deque, Dict, Iterator, List, Optional, Tuple

import torch

from ..store.row_moves import moves_on_device
from .engine import Ticket, Transport


#: Pinned staging one chunk of a move may use (per weight/state tensor): fills, write-backs,
#: preloads and flushes of any size move in chunks of this many bytes, so staging stays bounded.
CHUNK_BYTES = 64 << 20


def _pinned(shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=True)


class _PinnedStaging:
    """Pinned host arenas, two sets (``side`` 0 and 1) of one per (dtype, row width),
    reused across tickets.

    Consecutive chunks use the two sides in turn, so the host gathers chunk k+1 into one
    side while chunk k's copy still reads the other. ``begin(side)`` starts a chunk on that
    side; each ``get`` returns a slice that does not overlap the slices handed out since, so
    several tensors' copies can be in flight at once. An arena that must grow is replaced;
    the old one stays alive for copies still reading it (PyTorch's pinned allocator records
    the streams that use a block).
    """

    def __init__(self) -> None:
        self._arenas: Dict[Any, torch.Tensor] = {}
        self._cursor: Dict[Any, int] = {}
        self._side = 0
        self.allocations = 0

    def begin(self, side: int = 0) -> None:
        self._side = side
        self._cursor = {k: v for k, v in self._cursor.items() if k[0] != side}

    def get(self, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        key = (self._side, dtype, width)
        start = self._cursor.get(key, 0)
        arena = self._arenas.get(key)
        if arena is None or arena.shape[0] < start + rows:
            capacity = max(start + rows, 2 * (0 if arena is None else arena.shape[0]), 1024)
            arena = _pinned((capacity, width), dtype)
            self._arenas[key] = arena
            self.allocations += 1
            start = 0
        self._cursor[key] = start + rows
        return arena[start: start + rows]


class CudaStreamTransport(Transport):
    """Copies on a dedicated CUDA stream (see the module docstring for the fences)."""

    kind = "cuda"
    asynchronous = True

    def __init__(self, device: torch.device) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaStreamTransport needs CUDA")
        self.device = torch.device(device)
        self.copy_stream = torch.cuda.Stream(device=self.device)
        self.staging = _PinnedStaging()
        # Per staging side, the event after the last host-to-device copy out of it.
        self._last_h2d: List[Optional[torch.cuda.Event]] = [None, None]
        self._side = 1
        self._stall_events: Deque[Tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self.gpu_stall_ms = 0.0
        self._wait_started: Dict[int, Any] = {}  # ticket seq -> E_wait0 (see begin_wait)
        self._moves_on_device = moves_on_device(self.device)
        self._device_moves_unsynced = False  # kernels on X may still write a host tier
        self.device_tickets = 0  # tickets whose moves were enqueued without a host read

    def prepare(self, ticket: Ticket) -> None:
        # Recorded on the stream that owns the cache (a device planner's stream),
        # never merely "whatever is current": every fused update of a victim slot and the
        # plan's own bookkeeping ops precede it there.
        owner = next((p.table.owner_stream for p in ticket.plans if p.table.owner_stream is not None), None)
        ticket.ready_event = (owner or torch.cuda.current_stream(self.device)).record_event()

    def runs_on_issue(self, ticket: Ticket) -> bool:
        return self._moves_on_device and all(
            p.planned_on_device and p.overflow_rows is None and p.table.host_on_device is not None
            for p in ticket.plans)

    def settle(self, ticket: Ticket) -> None:
        if ticket.host_pending and ticket.device_event is not None:
            ticket.device_event.synchronize()
            ticket.host_pending = False

    @torch.no_grad()
    def _enqueue_on_device(self, ticket: Ticket) -> None:
        stream = self.copy_stream
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            self._wait_for_plans(stream, ticket)
            for plan in ticket.plans:
                for t in (plan.writeback_rows, plan.writeback_slots, plan.fill_rows, plan.fill_slots, plan.counts):
                    # Allocated on the owner stream and read here: not reused before X read them.
                    t.record_stream(stream)
                plan.table.enqueue_moves(plan)
                plan.read_sizes_later()
            ticket.device_event = stream.record_event()
        ticket.host_pending = True
        self._device_moves_unsynced = True
        self.device_tickets += 1

    @torch.no_grad()
    def run(self, ticket: Ticket) -> None:
        if self.runs_on_issue(ticket):
            self._enqueue_on_device(ticket)
            return
        stream = self.copy_stream
        if self._device_moves_unsynced:
            # Kernels of earlier device tickets write host tiers this ticket may read on the host.
            stream.synchronize()
            self._device_moves_unsynced = False
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            self._wait_for_plans(stream, ticket)
            for plan in ticket.plans:
                if plan.planned_on_device:
                    # The plan's sizes and row lists were computed on the owner stream; this
                    # stream waited for them, and this worker thread may block on them.
                    plan.resolve_sizes()
            for plan in ticket.plans:
                plan.table.begin_moves(plan)  # (on disk: its rows have arrived in the host cache)
                self._write_back(plan)
                plan.stage = "written_back"
            for plan in ticket.plans:
                self._fill(plan)
                self._stage_overflow(plan)
                # "done" means enqueued on the copy stream: a later CUDA error surfaces at
                # the consumer's event wait, not as a partial move the store could undo.
                plan.stage = "done"
                # The host side of its moves is over: fills were gathered into staging and
                # write-backs scattered after a synchronize.
                plan.table.end_moves(plan)
            ticket.device_event = stream.record_event()

    @staticmethod
    def _wait_for_plans(stream: Any, ticket: Ticket) -> None:
        """The copy stream waits for the owner stream's work up to the issue, and for each
        plan made on the planner's own stream (store/plan_stream.py) - on the GPU."""
        stream.wait_event(ticket.ready_event)
        for plan in ticket.plans:
            if plan.planned_event is not None:
                stream.wait_event(plan.planned_event)

    def begin_wait(self, ticket: Ticket) -> None:
        # The stall starts where the waiting stream asks for the rows, before the host blocks
        # on the worker (an event recorded after that would miss the time the host sat there).
        before = torch.cuda.current_stream(self.device).record_event(torch.cuda.Event(enable_timing=True))
        self._wait_started.setdefault(ticket.seq, before)

    def complete(self, ticket: Ticket) -> None:
        before = self._wait_started.pop(ticket.seq, None)
        if ticket.device_event is None:
            return
        stream = torch.cuda.current_stream(self.device)
        if before is None:
            before = stream.record_event(torch.cuda.Event(enable_timing=True))
        stream.wait_event(ticket.device_event)
        after = stream.record_event(torch.cuda.Event(enable_timing=True))
        for plan in ticket.plans:
            over = plan._overflow_weight  # noqa: SLF001 - (staged here, or not at all: never read it in)
            if over is not None and over.device.type == "cuda":
                # Allocated on the copy stream, read by this one: the allocator must not hand
                # its memory to the copy stream again before this stream's lookup has run.
                over.record_stream(stream)
        self._stall_events.append((before, after))
        self._harvest_stalls()

    def _harvest_stalls(self) -> None:
        while self._stall_events and self._stall_events[0][1].query():
            before, after = self._stall_events.popleft()
            self.gpu_stall_ms += before.elapsed_time(after)

    @property
    def gpu_stall_s(self) -> float:
        self._harvest_stalls()
        return self.gpu_stall_ms / 1e3

    @staticmethod
    def _caches(plan: Any) -> List[torch.Tensor]:
        """The cache's tensors (weight, then each optimizer state), as ``[slots, elements]``,
        in the order the store's ``gather_host`` / ``put_host`` take the host tier's."""
        t = plan.table
        return [c.view(c.shape[0], -1) for c in [t.cache_weight, *t.cache_state.values()]]

    def _chunks(self, plan: Any, slots: torch.Tensor, rows: torch.Tensor, n: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        """The first ``n`` (slots on the device, rows on the host) of a plan's move list, in
        pieces of at most ``CHUNK_BYTES`` of staging; the staging is free for each piece."""
        if plan.planned_on_device:  # lists on the device, sizes resolved in run()
            # Allocated on the owner stream, read here on the copy stream: a plan rolled back
            # or released while these copies are queued must not hand their memory back to
            # the owner stream before the copy stream has read them.
            slots.record_stream(self.copy_stream)
            slots, rows = slots.narrow(0, 0, n), rows.narrow(0, 0, n).to("cpu")
        else:
            slots = slots.to(self.device, non_blocking=True)
        step = max(1, CHUNK_BYTES // max(plan.table.row_bytes, 1))
        for start in range(0, n, step):
            size = min(step, n - start)
            self._reuse_staging()
            yield slots.narrow(0, start, size), rows.narrow(0, start, size)

    def _reuse_staging(self) -> None:
        """Moves to the other staging side and waits (on the worker) until the last
        host-to-device copy out of *that* side has run; the copy out of the side just used
        keeps running while the next chunk is gathered."""
        self._side ^= 1
        last = self._last_h2d[self._side]
        if last is not None:
            last.synchronize()
            self._last_h2d[self._side] = None
        self.staging.begin(self._side)

    def _copied(self) -> None:
        """Records the end of the copies out of the current staging side."""
        self._last_h2d[self._side] = self.copy_stream.record_event()

    def _write_back(self, plan: Any) -> None:
        n = plan.num_writebacks
        if n == 0:
            return
        caches = self._caches(plan)
        for chunk_slots, chunk_rows in self._chunks(plan, plan.writeback_slots, plan.writeback_rows, n):
            staged = []
            for cache in caches:
                part = self.staging.get(chunk_rows.shape[0], cache.shape[1], cache.dtype)
                part.copy_(cache.index_select(0, chunk_slots), non_blocking=True)
                staged.append(part)
            self.copy_stream.synchronize()  # the host scatter below reads `staged`
            # Through the store: a table on disk writes its host cache (its slots were
            # claimed when the plan was made), a table in DRAM its host tensors.
            plan.table.put_host(chunk_rows, staged)

    def _fill(self, plan: Any) -> None:
        n = plan.num_fills
        if n == 0:
            return
        # A table on disk preloads (a device cache as large as the table) through its host
        # cache in chunks, by itself: more rows than its host cache holds at once.
        first = plan.table.fill_preloaded(plan)
        if n == first:
            return
        slots, rows = plan.fill_slots.narrow(0, first, n - first), plan.fill_rows.narrow(0, first, n - first)
        caches = self._caches(plan)
        for chunk_slots, chunk_rows in self._chunks(plan, slots, rows, n - first):
            staged = [self.staging.get(chunk_rows.shape[0], c.shape[1], c.dtype) for c in caches]
            plan.table.gather_host(chunk_rows, out=staged)
            for cache, part in zip(caches, staged):
                cache.index_copy_(0, chunk_slots, part.to(self.device, non_blocking=True))
            self._copied()

    def _stage_overflow(self, plan: Any) -> None:
        """The overflow rows of a device plan, read from the host tier for its lookup (the
        batch's own rows: bounded by its ids, never the cache)."""
        if not plan.planned_on_device or not plan.num_overflow:
            return
        rows = plan.overflow_rows.narrow(0, 0, plan.num_overflow).to("cpu")  # type: ignore[union-attr]
        host = plan.table.host_weight
        out = torch.empty((rows.shape[0], plan.table.dim), dtype=host.dtype, device=self.device)
        # In chunks of at most CHUNK_BYTES of staging, as fills: staging never grows to
        # the overflow (an arena is kept for the transport's life).
        step = max(1, CHUNK_BYTES // max(plan.table.row_bytes, 1))
        for start in range(0, rows.shape[0], step):
            chunk = rows.narrow(0, start, min(step, rows.shape[0] - start))
            self._reuse_staging()
            staged = self.staging.get(chunk.shape[0], plan.table.dim, host.dtype)
            torch.index_select(host, 0, chunk, out=staged)
            out.narrow(0, start, chunk.shape[0]).copy_(staged, non_blocking=True)
            self._copied()
        plan.overflow_weight = out

    def describe(self) -> Dict[str, Any]:
        return {"kind": self.kind, "device": str(self.device), "pinned_allocations": self.staging.allocations,
                "gpu_stall_s": self.gpu_stall_s, "moves_on_device": self._moves_on_device,
                "device_tickets": self.device_tickets}
