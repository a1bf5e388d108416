"""The fetch engine: moves planned rows between the host tier and the device cache.

A fetch is a typed :class:`Ticket` holding the plans of one batch (one per table). Tickets
execute strictly in issue order (one FIFO, one copy link), which is what makes the store's
write-back-before-refetch invariant hold: a dirty row evicted by ticket ``t`` is on the host
before any ticket issued after ``t`` reads it.

Transports decide *how* the bytes move:

* :class:`InlineTransport`    - CPU, copies synchronously when the ticket is issued.
* :class:`EmulatedLinkTransport` - CPU, a worker thread performs the real copy and completes
  no earlier than a copy-engine model (``latency + bytes / bandwidth``, one transfer at a time)
  says. Figures measured with it are labelled ``link="emulated"``.
* ``CudaStreamTransport`` (fetch/cuda.py) - a dedicated copy stream: device plans' moves
  enqueued by the issuing thread itself, others through pinned staging on the worker.

A transport may run a ticket *on issue* (``runs_on_issue``): its moves are only enqueued
on a device queue, so issuing them costs the issuing thread no wait. The engine does so
whenever the worker has nothing left to run, which keeps one order: a ticket never starts
before one issued earlier has. Such a ticket is done when issued; the sizes of its plans
may reach the host later (``poll_sizes``), and the engine's byte and row counts take them
in then.

The engine knows nothing of TorchRec.
"""

from __future__ import annotations

import abc
import itertools
import queue
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Optional, Sequence

from ..store.errors import NotPrefetchedError, StoreStateError
from ..store.tiered_table import FetchPlan


class Ticket:
    """One batch's fetch across tables. Created only by :meth:`FetchEngine.issue`."""

    __slots__ = (
        "seq", "tag", "plans", "issued_at", "started_at", "completed_at",
        "waited", "_done", "_error", "_engine", "device_event", "ready_event", "host_pending",
    )

    def __init__(self, engine: "FetchEngine", seq: int, tag: Any, plans: List[FetchPlan]) -> None:
        self._engine = engine
        self.seq = seq
        self.tag = tag
        self.plans = plans
        self.issued_at = time.perf_counter()
        self.started_at: Optional[float] = None
        self.completed_at: Optional[float] = None
        self.waited = False
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        # CUDA only: the copy stream records `device_event` when the rows are in place;
        # `ready_event` is recorded on the compute stream at issue time (see fetch/cuda.py).
        self.device_event: Any = None
        self.ready_event: Any = None
        # The moves may still be running on the device, writing the host tier (see ``settle``).
        self.host_pending = False

    @property
    def done(self) -> bool:
        return self._done.is_set()

    # Sizes are read from the plans when asked: a plan made on a device learns them only
    # when the transport has read them back (by the time the ticket is done).
    def sizes_known(self) -> bool:
        """Whether every plan's sizes are on the host (reading them where that is free)."""
        return all(p.poll_sizes() for p in self.plans)

    def resolve_sizes(self) -> None:
        """Reads every plan's sizes, waiting for them if need be (only where waiting is free)."""
        for p in self.plans:
            p.resolve_sizes()

    @property
    def num_bytes(self) -> int:
        return sum(p.bytes_to_move for p in self.plans)

    @property
    def num_rows(self) -> int:
        return sum(p.num_fills for p in self.plans)

    def _finish(self, error: Optional[BaseException] = None) -> None:
        self._error = error
        self.completed_at = time.perf_counter()
        self._done.set()

    def __repr__(self) -> str:
        state = "done" if self.done else "in flight"
        if not self.sizes_known():
            return f"Ticket(seq={self.seq}, tag={self.tag!r}, sizes on the device, {state})"
        return f"Ticket(seq={self.seq}, tag={self.tag!r}, rows={self.num_rows}, bytes={self.num_bytes}, {state})"


class Transport(abc.ABC):
    """Executes the data moves of a ticket's plans."""

    kind: str = "abstract"
    asynchronous: bool = False

    def prepare(self, ticket: Ticket) -> None:
        """Called on the issuing thread before the ticket is queued (stream fences)."""

    def runs_on_issue(self, ticket: Ticket) -> bool:
        """Whether ``run`` only enqueues device work for ``ticket`` (no host wait), so the
        issuing thread may run it itself when the worker has nothing queued."""
        return False

    def settle(self, ticket: Ticket) -> None:
        """Waits until the host tier holds what ``ticket`` wrote back (only where the host
        reads it next: a flush, a drain, a synchronous move)."""

    @abc.abstractmethod
    def run(self, ticket: Ticket) -> None:
        """Moves the data. On asynchronous transports this runs on the engine's worker."""

    def begin_wait(self, ticket: Ticket) -> None:
        """Called on the waiting thread before it blocks for ``ticket`` (stall timing)."""

    def complete(self, ticket: Ticket) -> None:
        """Called on the waiting thread once the ticket is done (device-side fences)."""

    def describe(self) -> Dict[str, Any]:
        return {"kind": self.kind}


class InlineTransport(Transport):
    """Synchronous in-process copy (CPU device, or any device without a copy engine)."""

    kind = "inline"

    def run(self, ticket: Ticket) -> None:
        for plan in ticket.plans:
            plan.table.transfer(plan)


@dataclass(frozen=True)
class LinkModel:
    """An emulated host-to-device link for CPU runs: one transfer at a time, each taking
    ``latency_us + bytes / bandwidth``. Pass it as the sharder's ``link=`` so that cold-row
    fetches cost time on CPU as they do over PCIe (the copies are real; each completes no
    earlier than the model says). Ignored on CUDA, where the copy stream is the link.

    Args:
        bandwidth_gbps: the link's bandwidth in GB/s (1e9 bytes per second), > 0. PCIe 4.0
            x16 moves about 25; the default 2.0 makes a CPU run's fetches visibly costly.
        latency_us: fixed cost of each transfer in microseconds, >= 0: one per fetch (a
            batch's fills and write-backs go together); a fetch that moves nothing costs
            nothing.
    """

    bandwidth_gbps: float = 2.0  # GB/s (1e9 bytes per second)
    latency_us: float = 50.0

    def __post_init__(self) -> None:
        if self.bandwidth_gbps <= 0:
            raise ValueError(f"link bandwidth must be > 0 GB/s, got {self.bandwidth_gbps}")
        if self.latency_us < 0:
            raise ValueError(f"link latency must be >= 0 us, got {self.latency_us}")

    def seconds(self, num_bytes: int) -> float:
        return self.latency_us * 1e-6 + num_bytes / (self.bandwidth_gbps * 1e9)


class EmulatedLinkTransport(Transport):
    """Real copies on a worker thread, completing no earlier than :class:`LinkModel` says.

    The worker handles one ticket at a time, so tickets queue behind each other exactly as
    they would on a single DMA engine. Tickets that move no bytes still pay no latency.
    """

    kind = "emulated"
    asynchronous = True

    def __init__(self, link: LinkModel) -> None:
        self.link = link

    def run(self, ticket: Ticket) -> None:
        start = time.perf_counter()
        for plan in ticket.plans:
            plan.table.transfer(plan)
        if ticket.num_bytes:
            remaining = start + self.link.seconds(ticket.num_bytes) - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)

    def describe(self) -> Dict[str, Any]:
        return {"kind": self.kind, "bandwidth_gbps": self.link.bandwidth_gbps, "latency_us": self.link.latency_us}


@dataclass
class EngineStats:
    tickets: int = 0
    bytes_moved: int = 0
    rows_fetched: int = 0
    stall_s: float = 0.0  # time callers spent blocked in `wait`
    busy_s: float = 0.0  # time the link spent moving data
    # `wait` calls that found their ticket not done yet and blocked the caller: a count, not
    # a clock, so tests can assert that a batch prefetched ahead never made its caller wait.
    blocking_waits: int = 0

    def as_dict(self) -> Dict[str, float]:
        return dict(self.__dict__)


_STOP = object()


class FetchFailedError(StoreStateError):
    """A ticket's data moves failed, or were cancelled because an earlier ticket failed."""


def _work(work_queue: "queue.Queue[Any]", execute: Any) -> None:
    # A plain function holding only the queue and a weak handle on the engine, so that a
    # dropped engine is collected (its finalizer then stops this thread).
    while True:
        item = work_queue.get()
        if item is _STOP:
            return
        engine = execute()
        if engine is None:
            item._finish(FetchFailedError("fetch engine was dropped with tickets queued"))
        else:
            engine._execute(item)
        # Nothing of the engine may stay in this frame while it waits for the next ticket.
        del engine, item


def _stop_worker(work_queue: "queue.Queue[Any]", worker: threading.Thread) -> None:
    work_queue.put(_STOP)
    if worker is not threading.current_thread():
        worker.join(timeout=30)


class FetchEngine:
    """Issues tickets, executes them in order, and waits for them.

    ``issue`` never blocks on data (for asynchronous transports); ``wait`` blocks until the
    ticket's rows are resident and returns how long it blocked (the stall).

    Failure contract: when a ticket's moves raise, that ticket and every ticket queued behind
    it fail (the later ones never run: they were planned on top of the failed one). The
    first ``wait``/``drain``/``issue`` on the planning thread then rolls their plans back,
    newest first (``TieredTable.rollback``), so the store is consistent again, and raises
    :class:`FetchFailedError`. The plans' pins stay until their owner releases them.
    """

    def __init__(self, transport: Optional[Transport] = None) -> None:
        self.transport = transport or InlineTransport()
        self.stats = EngineStats()
        self._seq = itertools.count()
        self._outstanding: Dict[int, Ticket] = {}
        self._queue: "queue.Queue[Any]" = queue.Queue()
        self._worker: Optional[threading.Thread] = None
        self._closed = False
        self._failure: Optional[BaseException] = None  # set by the executing thread
        # Done tickets not counted in ``stats`` yet (their sizes are still on the device).
        self._unsized: Deque[Ticket] = deque()
        self._recovered = True
        self._finalizer: Optional[weakref.finalize] = None
        if self.transport.asynchronous:
            self._worker = threading.Thread(
                target=_work, args=(self._queue, weakref.ref(self)), name="proactive-fetch", daemon=True
            )
            self._worker.start()
            self._finalizer = weakref.finalize(self, _stop_worker, self._queue, self._worker)

    # ------------------------------------------------------------------ issue / wait
    def issue(self, plans: Sequence[FetchPlan], tag: Any = None) -> Ticket:
        """Queues the data moves of ``plans`` (made by ``TieredTable.plan``/``plan_ids``) behind
        every ticket issued before, and returns their ticket; ``wait(ticket)`` before the
        batch's lookup. The order of a table's use: plan -> ``issue`` -> ``wait`` -> lookup
        (``pooled_lookup``) -> backward (fused update, pins released) -> ``flush`` before the
        host tier is read. A failed move rolls back the plans of its ticket and of every
        ticket behind it."""
        if self._closed:
            raise StoreStateError("fetch engine is closed")
        self._recover()
        ticket = Ticket(self, next(self._seq), tag, list(plans))
        try:
            self.transport.prepare(ticket)
        except BaseException:
            # Nothing was queued or moved: the ticket never existed.
            for plan in ticket.plans:
                plan.table.rollback(plan)
            raise
        inline = self._worker is None or (self.transport.runs_on_issue(ticket) and not self._worker_busy())
        self._outstanding[ticket.seq] = ticket
        self.stats.tickets += 1
        if inline:
            self._execute(ticket)
        else:
            self._queue.put(ticket)
        self._count_sized()
        return ticket

    def _worker_busy(self) -> bool:
        # Tickets finish in issue order, so the worker is idle once the newest one is done.
        return bool(self._outstanding) and not all(t.done for t in self._outstanding.values())

    def run(self, plans: Sequence[FetchPlan], tag: Any = None) -> float:
        """Issues ``plans`` and waits for them: a synchronous move that still takes its turn
        behind every ticket issued before it; the host tier is current afterwards. Returns
        the seconds spent blocked."""
        ticket = self.issue(plans, tag)
        stall = self.wait(ticket)
        self.transport.settle(ticket)
        return stall

    def flush(self, tables: Sequence[Any]) -> None:
        """Writes every dirty cached row of ``tables`` back to their host tier, in its turn
        behind every queued ticket; afterwards the host tiers equal resident tables."""
        plans = [(t, plan) for t in tables for plan in t.plan_flush()]
        for i, (_, plan) in enumerate(plans):  # (one ticket per chunk: the staging of one is all that is held)
            try:
                self.run([plan], tag="flush")
            except BaseException:
                # Planning the flush marked every chunk's rows clean; the failed chunk is rolled
                # back with its ticket, and the chunks that never ran keep their rows dirty, so
                # that nothing is lost and the next flush writes them.
                for table, later in reversed(plans[i + 1:]):
                    table.rollback(later)
                raise

    def wait(self, ticket: Ticket) -> float:
        """Blocks until ``ticket`` is done; returns the seconds spent blocked."""
        if not isinstance(ticket, Ticket) or ticket._engine is not self:
            raise NotPrefetchedError(f"{ticket!r} was not issued by this fetch engine")
        self.transport.begin_wait(ticket)
        if not ticket.done:
            self.stats.blocking_waits += 1
        t0 = time.perf_counter()
        ticket._done.wait()
        stall = time.perf_counter() - t0
        self._recover()  # before this ticket leaves the outstanding set it may need rolling back
        if not ticket.waited:
            ticket.waited = True
            self.stats.stall_s += stall
            self._outstanding.pop(ticket.seq, None)
        if ticket._error is not None:
            raise ticket._error
        # Every waiter's stream is fenced, not only the first one's (see fetch/cuda.py).
        self.transport.complete(ticket)
        self._count_sized()
        return stall

    def drain(self) -> None:
        """Waits for every issued ticket (errors of unwaited tickets are raised here); the
        host tier is current afterwards, and every ticket's sizes are counted."""
        first: Optional[BaseException] = None
        for ticket in sorted(self._outstanding.values(), key=lambda t: t.seq):
            try:
                self.wait(ticket)
            except FetchFailedError as e:
                first = first or e
        self._count_sized(block=True)
        if first is not None:
            raise first

    def resolve(self, ticket: Ticket) -> None:
        """Waits until the host knows ``ticket``'s sizes and holds what it wrote back (only
        where waiting is free: a drain, a statistics read)."""
        self.transport.settle(ticket)
        ticket.resolve_sizes()

    def _count_sized(self, block: bool = False) -> None:
        """Adds the bytes and rows of done tickets whose sizes have reached the host, in
        issue order (``block``: reads the rest, waiting for them)."""
        while self._unsized:
            ticket = self._unsized[0]
            if block:
                self.resolve(ticket)
            elif not ticket.sizes_known():
                return
            self._unsized.popleft()
            self.stats.bytes_moved += ticket.num_bytes
            self.stats.rows_fetched += ticket.num_rows

    @property
    def in_flight(self) -> int:
        return len(self._outstanding)

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def close(self) -> None:
        """Stops the worker thread (idempotent); issuing afterwards raises ``StoreStateError``."""
        if self._closed:
            return
        self._closed = True
        if self._finalizer is not None:
            self._finalizer()

    def describe(self) -> Dict[str, Any]:
        return self.transport.describe()

    # ------------------------------------------------------------------ failures
    def _recover(self) -> None:
        """Rolls back the plans of failed tickets once every one of them has finished."""
        if self._recovered or self._failure is None:
            return
        failed = sorted((t for t in self._outstanding.values() if t._error is not None or not t.done),
                        key=lambda t: t.seq)
        for ticket in failed:
            ticket._done.wait()
        for ticket in reversed(failed):
            for plan in reversed(ticket.plans):
                plan.table.rollback(plan)
        self._recovered = True
        self._failure = None

    # ------------------------------------------------------------------ worker
    def _execute(self, ticket: Ticket) -> None:
        ticket.started_at = time.perf_counter()
        if self._failure is not None:
            ticket._finish(FetchFailedError(
                f"fetch {ticket.seq} (batch {ticket.tag!r}) was cancelled: an earlier fetch failed "
                f"({self._failure})"
            ))
            return
        try:
            self.transport.run(ticket)
        except BaseException as e:  # surfaced to whoever waits on the ticket
            self._recovered = False
            self._failure = e
            err = FetchFailedError(f"fetch {ticket.seq} (batch {ticket.tag!r}) failed: {e!r}")
            err.__cause__ = e
            ticket._finish(err)
        else:
            self._unsized.append(ticket)  # counted by the planning thread (_count_sized)
            ticket._finish()
        self.stats.busy_s += ticket.completed_at - ticket.started_at  # type: ignore[operator]
