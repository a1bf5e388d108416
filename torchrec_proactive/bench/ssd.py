"""``torchrec-proactive bench --tier ssd``: a table larger than host memory, on this machine's
real disk, at several lookahead depths of its two hops, against the same table in DRAM.

The store is driven directly (``TieredTable.on_disk`` and ``fetch.lookahead.run_lookahead``,
one table; the TorchRec path serves ``key_value`` tables through the same store): a file
per table on disk (``O_DIRECT`` where the filesystem allows it), a bounded host cache in
DRAM, a device cache of ``--cache-load-factor`` of the rows, and the host->device copies on a
worker thread, as a copy stream runs them. The device's step is emulated by a sleep of
``--step-ms`` between the lookup and the backward (labelled so everywhere): the GPU's
compute, during which the host thread waits and the disk keeps reading.

Configurations, all on the same table (ids, initial weights, optimizer):

* ``reactive`` - depth 0: a batch's disk reads and copies on its own critical path;
* ``depth_1`` - both hops one batch ahead (FBGEMM's SSD TBE and TorchRec's prefetch pipeline);
* ``depth_K_disk_KD`` - host->device copies K batches ahead, disk reads KD batches ahead
  (``--ssd-depths``; where the store's lookahead has no separate disk depth, KD = K);
* ``best`` - the fastest of the disk configurations above (a copy of its figures);
* ``dram`` - the same table with every row in DRAM, at the host->device depth of the
  fastest disk configuration of the first round.

Ids: Zipf ranks drawn as the default bench draws them (``sample_zipf_ranks``), mapped to
rows by a fixed random permutation, so hot rows lie all over the file as hashed ids do.

Method. Two tables live through the whole run, one on disk and one in DRAM, so that their
caches are in a steady state rather than cold at every configuration: before the rounds
both device caches are filled with the most popular rows and the host cache with the next
most popular (as after a long run), then one untimed run warms them. Every run trains
a fresh set of batches (a batch set never comes twice, so no configuration finds the
previous one's rows cached); the other table then trains the same batches untimed, so the
two tables always hold the same training history. After every run the rows it touched
(and a random sample of the others) are compared bit for bit between the two tables, and
at the end every row: ``bit_identical`` is all of these.

Each run: ``--warmup`` steps (plus the configuration's deepest depth, while its pipeline
fills), ``--steps`` timed steps, and as many steps after them as the deepest depth, so that
every timed step has its pipeline full. The rate of a run is its timed samples over the
timed steps' wall time (throughput: a disk that falls behind stalls some steps, and the
median step would hide them). Rounds run every configuration once, in rotated order;
from 6 rounds on, rates and ratios get 95% intervals from the per-round figures
(``noise.py``), fewer rounds give none and no verdicts. Past 6 rounds, rounds stop where the
next would end the run after ``--time-budget-min``.

JSON (``--json F``: ``F["ssd"]``): ``table_bytes``, ``host_cache_bytes``, ``o_direct`` (and
``o_direct_fallback``: what was used instead), ``io_backend`` (``aio`` or ``threads``: see
``store/row_file.py``), ``bit_identical`` (and ``bit_identity``: what
was compared, runs that differed), the workload (``rows``, ``dim``, ``ids_per_step``,
``step_ms_emulated``, ...), ``disk_probe``, ``best``, ``ratios`` (best / depth_1, reactive,
dram: value, interval, verdict), ``targets`` (met: true / false / null = not judged),
``notes``, ``phases_s`` and ``configs``: per configuration ``name``, ``depth`` (host->device),
``disk_depth``, ``samples_per_s`` with ``samples_per_s_interval`` (null under 6 rounds) and
``samples_per_s_rounds``, ``stall_ms`` (per step) and ``stall_ms_by_phase`` (disk / copy),
``plan_ms``, ``disk_rows_per_step``, ``disk_reads_per_step``, ``disk_reads_per_s``,
``mb_per_s``, ``reads_in_flight`` (time mean) / ``reads_in_flight_max`` /
``reads_in_flight_at_start`` (the store's mean over reads), ``read_latency_ms``, each hop's
lead (``lead_batches`` / ``lead_ms``: host->device; ``disk_lead_batches`` /
``disk_lead_ms``: disk reads queued ahead of use; ``disk_ready_before_use_ms``: landed ahead
of use), hit rates, ``bit_identical``; ``best`` repeats the fastest disk configuration's
figures (``best_of`` names it).
"""

from __future__ import annotations

import inspect
import os
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..data.criteo_synth import sample_zipf_ranks
from ..fetch import FetchEngine, Ticket, Transport
from ..fetch.lookahead import run_lookahead
from ..store import OptimizerConfig, OptimType, TieredTable, pooled_lookup
from ..store.disk_host_tier import Component, record_layout
from ..store.row_file import BLOCK, PageLayout, aligned_buffer
from .noise import MIN_PAIRED_ROUNDS, format_ratio, paired_ratio, rate_interval

__all__ = ["SsdSettings", "SsdConfig", "Geometry", "quick_settings", "default_depths", "disk_depth_supported",
           "configs_for", "fit_to_machine", "run_ssd_bench", "format_ssd_summary", "write_ssd_timeline",
           "TARGETS"]

MB = 2 ** 20
GB = 2 ** 30

#: The issue's targets for one default run: (key, label, threshold).
TARGETS = (("best_vs_depth_1", "best >= 1.3x depth_1", 1.3),
           ("best_vs_reactive", "best >= 1.5x reactive", 1.5),
           ("best_vs_dram", "best not significantly below 0.9 of dram (the interval's upper end reaches 0.9)", 0.9))


# --------------------------------------------------------------------------------------------
# settings


@dataclass(frozen=True)
class SsdSettings:
    """What ``bench --tier ssd`` runs (see the module docstring)."""

    table_bytes: int = 2 * GB           # the table's file (rounded down to whole pages)
    host_cache_bytes: int = 256 * MB    # DRAM cache of the file's rows
    dim: int = 64
    ids_per_step: int = 4096            # one id per sample: samples = ids
    zipf_alpha: float = 1.05
    device_cache_fraction: float = 0.05
    step_ms: float = 10.0               # the device's step, emulated by a sleep
    io_threads: int = 64                # disk reads in flight at most
    depths: Tuple[Tuple[int, int], ...] = ()  # deeper (K, KD) pairs; () = default_depths()
    warmup_steps: int = 8
    timed_steps: int = 32
    rounds: int = 12
    learning_rate: float = 0.05
    seed: int = 0
    quick: bool = False


def quick_settings(s: SsdSettings) -> SsdSettings:
    """``--quick``: a table of at most 8 MB behind a 1 MB host cache, 256 ids a step, a 2 ms
    step, 2 + 6 steps, one deeper configuration, one round: seconds, and no claims."""
    return replace(s, table_bytes=min(s.table_bytes, 8 * MB), host_cache_bytes=min(s.host_cache_bytes, 1 * MB),
                   ids_per_step=min(s.ids_per_step, 256), step_ms=min(s.step_ms, 2.0),
                   io_threads=min(s.io_threads, 16), warmup_steps=min(s.warmup_steps, 2),
                   timed_steps=min(s.timed_steps, 6), rounds=1,
                   depths=s.depths[:1] or default_depths(disk_depth_supported())[:1], quick=True)


def disk_depth_supported() -> bool:
    """Whether the store's lookahead takes a disk depth of its own (``run_lookahead(...,
    disk_depth=)``); without it the disk hop is as many batches ahead as the plan."""
    return "disk_depth" in inspect.signature(run_lookahead).parameters


def default_depths(separate_disk_depth: bool) -> Tuple[Tuple[int, int], ...]:
    """The deeper configurations of a default run."""
    if separate_disk_depth:
        # The host->device hop is a copy within DRAM here, so beyond one batch its depth
        # matters little: the disk hop's does.
        return ((1, 4), (2, 8), (4, 16))
    return ((2, 2), (4, 4), (8, 8))


@dataclass(frozen=True)
class SsdConfig:
    """One configuration: host->device depth, disk depth (None in DRAM) and where rows live."""

    name: str
    depth: int
    disk_depth: Optional[int]
    tier: str = "disk"

    @property
    def lookahead(self) -> int:
        """How many batches past the current one the run plans at most."""
        return max(self.depth, self.disk_depth or 0)


def config_name(k: int, kd: int) -> str:
    if k == 0:
        return "reactive"
    if k == 1 and kd == 1:
        return "depth_1"
    return f"depth_{k}_disk_{kd}"


def configs_for(s: SsdSettings, separate_disk_depth: bool) -> List[SsdConfig]:
    """``reactive``, ``depth_1`` and the deeper disk configurations (``dram`` is added once
    the first round has named the fastest)."""
    pairs = [(0, 0), (1, 1)] + [p for p in (s.depths or default_depths(separate_disk_depth)) if p != (1, 1)]
    out: List[SsdConfig] = []
    for k, kd in pairs:
        c = SsdConfig(config_name(k, kd), k, kd)
        if c.name not in {x.name for x in out}:
            out.append(c)
    return out


@dataclass(frozen=True)
class Geometry:
    """The table as the store lays it out: rows, record and page sizes, cache sizes."""

    rows: int
    dim: int
    record_bytes: int
    rows_per_page: int
    page_bytes: int
    host_cache_rows: int
    device_cache_rows: int

    @classmethod
    def of(cls, s: SsdSettings) -> "Geometry":
        _, record = record_layout(_components(_optimizer(s), s.dim))
        layout = PageLayout(record)
        pages = max(1, s.table_bytes // layout.page_bytes)
        rows = pages * layout.rows_per_page
        return cls(rows=rows, dim=s.dim, record_bytes=record, rows_per_page=layout.rows_per_page,
                   page_bytes=layout.page_bytes, host_cache_rows=max(1, s.host_cache_bytes // record),
                   device_cache_rows=max(1, int(round(s.device_cache_fraction * rows))))

    @property
    def file_bytes(self) -> int:
        return -(-self.rows // self.rows_per_page) * self.page_bytes

    @property
    def dram_table_bytes(self) -> int:
        """The ``dram`` configuration's table in memory (weights and optimizer state)."""
        return self.rows * (self.dim + 1) * 4


def _optimizer(s: SsdSettings) -> OptimizerConfig:
    return OptimizerConfig(OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=s.learning_rate)


def _components(optim: OptimizerConfig, dim: int) -> List[Component]:
    """A row's record as ``TieredTable.on_disk`` lays it out: the weight, then each
    optimizer state (for the sizes only)."""
    return [Component("weight", torch.float32, dim)] + [
        Component(key, torch.float32, int(np.prod(shape)) if len(shape) else 1)
        for key, shape in optim.state_shapes(dim).items()]


def _mem_available() -> Optional[int]:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def fit_to_machine(s: SsdSettings, free_disk: int, mem_available: Optional[int] = None) -> Tuple[SsdSettings, List[str]]:
    """``s`` shrunk where this machine lacks room, with a note saying so: the file must
    fit in half the disk's free bytes, and the ``dram`` table (the whole table in memory)
    in half the memory available. The host cache shrinks with the table, so the table
    stays as many times larger than it."""
    notes: List[str] = []
    mem = _mem_available() if mem_available is None else mem_available
    g = Geometry.of(s)
    limits = [("disk", free_disk // 2, g.file_bytes)]
    if mem is not None:
        limits.append(("memory", mem // 2, g.dram_table_bytes + s.host_cache_bytes))
    scale = min(1.0, *[room / need for _, room, need in limits if need > 0])
    if scale < 1.0:
        why = [f"{what}: {need / GB:.2f} GB needed, {room / GB:.2f} GB usable"
               for what, room, need in limits if room < need]
        smaller = replace(s, table_bytes=max(64 * BLOCK, int(s.table_bytes * scale * 0.95)),
                          host_cache_bytes=max(BLOCK, int(s.host_cache_bytes * scale * 0.95)))
        notes.append(f"sized down to a {Geometry.of(smaller).file_bytes / GB:.2f} GB table and a "
                     f"{smaller.host_cache_bytes / MB:.0f} MB host cache (asked: {g.file_bytes / GB:.2f} GB and "
                     f"{s.host_cache_bytes / MB:.0f} MB): this machine lacks room ({'; '.join(why)})")
        s = smaller
    g = Geometry.of(s)
    ratio = g.file_bytes / max(1, g.host_cache_rows * g.record_bytes)
    if ratio < 4:
        notes.append(f"the table is only {ratio:.1f}x its host cache (the issue asks for at least 4x): most reads "
                     f"hit DRAM, little of the disk tier is measured")
    return s, notes


# --------------------------------------------------------------------------------------------
# instrumentation (measurement only: nothing here changes what the store does)


class _CopyWorker(Transport):
    """Host->device copies on a worker thread, in ticket order, as a copy stream runs them
    (the CPU's inline transport would make the training thread wait for the disk at issue).
    Records, per ticket, when it started waiting for its disk reads, when they were in
    DRAM and when its copies were done."""

    kind = "worker"
    asynchronous = True

    def __init__(self) -> None:
        self.records: Dict[int, Tuple[float, float, float]] = {}

    def run(self, ticket: Ticket) -> None:
        t0 = time.perf_counter()
        for plan in ticket.plans:
            # (transfer waits for the same disk ticket: waiting here first only times it)
            disk_ticket = getattr(plan, "disk_ticket", None)
            if disk_ticket is not None and plan.table.disk is not None:
                plan.table.disk.wait(disk_ticket)
        t1 = time.perf_counter()
        for plan in ticket.plans:
            plan.table.transfer(plan)
        self.records[ticket.seq] = (t0, t1, time.perf_counter())

    def describe(self) -> Dict[str, Any]:
        return {"kind": self.kind}


class _TimedEngine(FetchEngine):
    """A fetch engine that notes, per batch, its ticket, how many batches ahead of its use it
    was issued, its disk ticket and how long its lookup waited."""

    def __init__(self, transport: _CopyWorker) -> None:
        super().__init__(transport)
        self.copy = transport
        self.next_use = 0  # the batch whose lookup comes next (set by the consumer)
        self.issued: Dict[int, Tuple[Ticket, int, Optional[int]]] = {}
        self.waits: Dict[int, Tuple[float, float]] = {}

    def issue(self, plans: Sequence[Any], tag: Any = None) -> Ticket:
        ticket = super().issue(plans, tag)
        if isinstance(tag, int):
            disk = next((p.disk_ticket.seq for p in plans if getattr(p, "disk_ticket", None) is not None), None)
            self.issued[tag] = (ticket, tag - self.next_use, disk)
        return ticket

    def wait(self, ticket: Ticket) -> float:
        t0 = time.perf_counter()
        try:
            return super().wait(ticket)
        finally:
            if isinstance(ticket.tag, int):
                self.waits[ticket.tag] = (t0, time.perf_counter())


class _DiskWatch:
    """Times the disk tier's work from outside, for the timeline and the read figures: when
    each disk ticket was queued (and its kind), when its I/O ran, and each read request's
    span (reads in flight, read latency). Wraps methods of this one instance, each where it
    exists (``timed`` names those found): the store's own counters need none of this."""

    def __init__(self, disk: Any) -> None:
        self.queued: Dict[int, Tuple[float, str, Any]] = {}  # seq -> (time, kind, ticket)
        self._io: List[Tuple[int, float, float, int]] = []  # (seq, start, end, rows read) per task
        # Per call moving reads: (start, end, reads in flight during it, reads it moved).
        self.reads: List[Tuple[float, float, int, int]] = []
        self.timed: List[str] = []
        self.cap: Optional[int] = None  # reads in flight at most (the file's in_flight_limit), where calls overlap
        queued, io, reads = self.queued, self._io, self.reads
        prefetch = getattr(disk, "prefetch", None)
        if prefetch is not None:
            def timed_prefetch(*args: Any, **kwargs: Any) -> Any:
                t = time.perf_counter()
                ticket = prefetch(*args, **kwargs)
                queued[ticket.seq] = (t, str(getattr(ticket, "kind", kwargs.get("kind", "batch"))), ticket)
                return ticket

            disk.prefetch = timed_prefetch
            self.timed.append("disk tickets queued")
        # A ticket's I/O: the tasks that run its requests (one owner thread, or shares of
        # them on the I/O pool); its span is the first start to the last end.
        for name in ("_do_share", "_move"):
            work = getattr(disk, name, None)
            if work is None:
                continue

            def timed_work(ticket: Any, *args: Any, _work: Any = work) -> Any:
                t0 = time.perf_counter()
                try:
                    return _work(ticket, *args)
                finally:
                    io.append((ticket.seq, t0, time.perf_counter(), int(ticket.read_rows.size)))

            setattr(disk, name, timed_work)
            self.timed.append("disk tickets' I/O")
            break
        file = disk.file
        # A call moves a share of a ticket's reads: all in flight together with the aio
        # backend (up to the file's in-flight limit), one after another with threads.
        together = file.io_backend == "aio"
        lanes = self.cap = file.in_flight_limit
        read_runs = file.read_runs

        def timed_reads(buffer: Any, runs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return read_runs(buffer, runs)
            finally:
                n = len(runs)
                if n:
                    reads.append((t0, time.perf_counter(), min(n, lanes) if together else 1, n))

        file.read_runs = timed_reads
        self.timed.append("read requests")

    @property
    def ok(self) -> bool:
        return "read requests" in self.timed

    def io_spans(self) -> Dict[int, Tuple[float, float, int]]:
        """Per disk ticket that did I/O: (first start, last end, rows it read)."""
        out: Dict[int, Tuple[float, float, int]] = {}
        for seq, a, b, rows in list(self._io):
            if seq in out:
                a0, b0, r0 = out[seq]
                out[seq] = (min(a, a0), max(b, b0), max(rows, r0))
            else:
                out[seq] = (a, b, rows)
        return out

    def reset(self) -> None:
        self.queued.clear()
        del self._io[:]
        del self.reads[:]


def _in_flight(spans: Sequence[Tuple[float, float, int, int]], t0: float, t1: float,
               cap: Optional[int] = None) -> Dict[str, Optional[float]]:
    """Reads in flight over ``[t0, t1]``: the time mean (Little's law) and the most at once,
    never above ``cap``; and the latency of the reads that began inside. A span is a call
    moving ``n`` reads with ``c`` in flight from its start to its end: each read's latency
    is taken as the call's time x ``c / n`` (exact for one read a call)."""
    inside = [(max(a, t0), min(b, t1), c) for a, b, c, _ in spans if b > t0 and a < t1]
    if not inside or t1 <= t0:
        return {"mean": 0.0, "max": 0, "latency_ms_mean": None, "latency_ms_p90": None}
    events = sorted([(a, c) for a, _, c in inside] + [(b, -c) for _, b, c in inside], key=lambda e: (e[0], e[1]))
    limit = cap if cap else float("inf")
    now = peak = 0
    busy, last = 0.0, events[0][0]
    for at, d in events:
        busy += min(now, limit) * (at - last)
        last = at
        now += d
        peak = max(peak, min(now, limit))
    lat = sorted(x for a, b, c, n in spans if t0 <= a < t1 for x in [(b - a) * c / n] * n)
    return {"mean": busy / (t1 - t0), "max": peak,
            "latency_ms_mean": 1e3 * statistics.fmean(lat) if lat else None,
            "latency_ms_p90": 1e3 * lat[min(len(lat) - 1, int(round(0.9 * (len(lat) - 1))))] if lat else None}


#: Disk-tier figures that are not running sums (a difference of two means nothing).
_LEVELS = ("orphan_rows",)


def _counters(table: TieredTable) -> Dict[str, float]:
    """Running counters of the table and its disk tier: sums, whose differences are what a
    window did, and (``level_*``) maxima, means and levels, read as they are."""
    c: Dict[str, float] = {f"table_{k}": float(v) for k, v in table.stats.as_dict().items() if k != "hit_rate"}
    if table.disk is not None:
        for k, v in table.disk.stats().items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            level = k.startswith("max_") or k.endswith(("_max", "_mean")) or k in _LEVELS
            c[f"{'level' if level else 'disk'}_{k}"] = float(v)
        f = table.disk.file
        c.update(file_reads=f.reads, file_bytes_read=f.bytes_read, file_writes=f.writes,
                 file_bytes_written=f.bytes_written)
        # (the mean over reads of the reads in flight as each started, as a sum: it subtracts)
        mean = c.get("level_reads_in_flight_mean")
        if mean is not None:
            c["reads_in_flight_sum"] = mean * c.get("disk_read_requests", f.reads)
    return c


# --------------------------------------------------------------------------------------------
# the workload


class _Workload:
    """Batches of Zipf ids over the table's rows; batch set ``n`` is the same on both tables."""

    def __init__(self, s: SsdSettings, rows: int) -> None:
        self.s, self.rows = s, rows
        # Rank -> row: hot rows spread over the file, as hashed ids are.
        self.perm = np.random.default_rng([s.seed, 1]).permutation(rows).astype(np.int64)
        self.offsets = torch.arange(s.ids_per_step + 1, dtype=torch.int64)

    def batches(self, n: int, count: int) -> List[Tuple[torch.Tensor, torch.Tensor, None, torch.Tensor]]:
        rng = np.random.default_rng([self.s.seed, 2, n])
        g = torch.Generator().manual_seed(int(rng.integers(2 ** 62)))
        out = []
        for _ in range(count):
            ranks = sample_zipf_ranks(rng, self.rows, self.s.zipf_alpha, self.s.ids_per_step)
            values = torch.from_numpy(self.perm[ranks])
            out.append((values, self.offsets, None, torch.randn(self.s.ids_per_step, self.s.dim, generator=g)))
        return out

    def hottest(self, count: int) -> np.ndarray:
        return self.perm[:count]


def _initial_weights(rows: int, dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.empty(rows, dim)
    for a in range(0, rows, 1 << 20):  # (in chunks: no second whole-table temporary)
        b = min(rows, a + (1 << 20))
        w[a:b] = torch.randn(b - a, dim, generator=g).mul_(0.01)
    return w


# --------------------------------------------------------------------------------------------
# runs


def _lookahead(table: TieredTable, engine: FetchEngine, batches: Sequence[Any], cfg: SsdConfig,
               consume: Callable[[int, Any, Any], None], separate: bool) -> Any:
    """``run_lookahead`` at the configuration's depths; returns its report (None from a
    store without one)."""
    if separate and cfg.disk_depth is not None:
        return run_lookahead(table, engine, batches, cfg.depth, consume,  # type: ignore[call-arg,func-returns-value]
                             disk_depth=cfg.disk_depth if table.disk is not None else cfg.depth)
    return run_lookahead(table, engine, batches, cfg.depth, consume)  # type: ignore[func-returns-value]


def _replay(table: TieredTable, batches: Sequence[Any], cfg: SsdConfig, separate: bool) -> None:
    """Trains ``batches`` on ``table`` untimed (no emulated step): the other table's run, so
    both keep one history."""
    engine = FetchEngine(_CopyWorker())
    anchor = torch.empty(0, requires_grad=True)
    try:
        _lookahead(table, engine, batches, cfg,
                   lambda i, tb, batch: pooled_lookup(tb, anchor).backward(batch[3]), separate)
        engine.drain()
    finally:
        engine.close()


def _timed_run(table: TieredTable, batches: Sequence[Any], cfg: SsdConfig, s: SsdSettings, warm: int,
               watch: Optional[_DiskWatch], separate: bool, trace: bool) -> Dict[str, Any]:
    """One run of ``cfg``: per-step timings of the timed window ``[warm, warm + timed_steps)``,
    the counters' change over it, and (``trace``) its timeline events."""
    engine = _TimedEngine(_CopyWorker())
    anchor = torch.empty(0, requires_grad=True)
    n = len(batches)
    first, last = warm, warm + s.timed_steps
    assert last < n, "a run needs a step after its timed window"
    starts, ends = [0.0] * n, [0.0] * n
    snaps: Dict[int, Dict[str, float]] = {}
    step_s = s.step_ms / 1e3
    if watch is not None:
        watch.reset()
    staged = _watch_stages(table, batches)

    def consume(i: int, tb: Any, batch: Any) -> None:
        starts[i] = time.perf_counter()
        if i in (first, last):
            snaps[i] = _counters(table)
        out = pooled_lookup(tb, anchor)
        time.sleep(step_s)  # the device's step, emulated: the host waits, the disk reads
        out.backward(batch[3])
        ends[i] = time.perf_counter()
        engine.next_use = i + 1

    try:
        report = _lookahead(table, engine, batches, cfg, consume, separate)
        engine.drain()
    finally:
        engine.close()
        table.__dict__.pop("stage_rows", None)  # (the wrapper of _watch_stages)
    t0, t1 = starts[first], starts[last]
    steps_ms = [1e3 * (starts[i + 1] - starts[i]) for i in range(first, last)]
    delta = {k: (v if k.startswith("level_") else v - snaps[first].get(k, 0.0)) for k, v in snaps[last].items()}
    disk_of = {i: staged.get(i, []) + ([rec[2]] if rec[2] is not None else []) for i, rec in engine.issued.items()}
    io = watch.io_spans() if watch is not None else {}
    waited = range(first + 1, last + 1)  # the waits inside the window: before lookups first+1 .. last
    # When the copy worker sat waiting for disk reads (one worker: disjoint intervals). A
    # lookup's wait is "disk" while it did, "copy" otherwise (copying this batch or earlier).
    blocked = sorted((r[0], r[1]) for r in engine.copy.records.values() if r[1] > r[0])
    stall = disk_stall = plan = 0.0
    leads_b, disk_leads_b, leads_ms, slack_ms, disk_lead_ms, disk_ready_ms = [], [], [], [], [], []
    for i in waited:
        w0, w1 = engine.waits.get(i, (starts[i], starts[i]))
        stall += w1 - w0
        plan += max(0.0, (starts[i] - ends[i - 1]) - (w1 - w0))
        ticket, lead = engine.issued[i][:2]
        disk_stall += sum(max(0.0, min(w1, b) - max(w0, a)) for a, b in blocked if a < w1 and b > w0)
        planned_at = getattr(report, "planned_at", {})
        if i in planned_at:  # (the lookahead's own account of each hop's lead)
            lead = i - planned_at[i]
            disk_leads_b.append(i - report.staged_at.get(i, planned_at[i]))
        leads_b.append(lead)
        leads_ms.append(1e3 * (starts[i] - ticket.issued_at))
        if ticket.completed_at is not None:
            slack_ms.append(1e3 * (starts[i] - ticket.completed_at))
        seqs = disk_of.get(i, [])
        queued = [watch.queued[q][0] for q in seqs if watch is not None and q in watch.queued]
        if queued:
            disk_lead_ms.append(1e3 * (starts[i] - min(queued)))
        landed = [io[q][1] for q in seqs if q in io and io[q][2]]
        if landed:
            disk_ready_ms.append(1e3 * (starts[i] - max(landed)))
    out: Dict[str, Any] = {
        "elapsed_s": t1 - t0, "steps_ms": steps_ms, "stall_s": stall, "disk_stall_s": disk_stall, "plan_s": plan,
        "counters": delta, "lead_batches": _mean(leads_b), "lead_ms": _mean(leads_ms),
        "ready_before_use_ms": _mean(slack_ms), "disk_lead_ms": _mean(disk_lead_ms),
        "disk_ready_before_use_ms": _mean(disk_ready_ms),
        "disk_lead_batches": (_mean(disk_leads_b) if disk_leads_b else _mean(leads_b))
        if table.disk is not None else None,
        "stages_waited": getattr(report, "stages_waited", None), "stages_dropped": getattr(report, "stages_dropped", None),
    }
    if watch is not None and watch.ok and table.disk is not None:
        out["reads"] = _in_flight(watch.reads, t0, t1, watch.cap)
    if trace:
        out["events"] = _events(engine, watch, disk_of, io, starts, ends)
    return out


def _watch_stages(table: TieredTable, batches: Sequence[Any]) -> Dict[int, List[int]]:
    """Per batch, the disk tickets that staged it ahead (filled as the run goes): the table's
    ``stage_rows`` is wrapped, on this instance, until the run's end."""
    out: Dict[int, List[int]] = {}
    stage_rows = getattr(table, "stage_rows", None)
    if table.disk is None or stage_rows is None:
        return out
    index = {id(b[0]): i for i, b in enumerate(batches)}

    def watched(rows: Any, *args: Any, **kwargs: Any) -> Any:
        stage = stage_rows(rows, *args, **kwargs)
        i = index.get(id(rows))
        if i is not None and getattr(stage, "ticket", None) is not None:
            out.setdefault(i, []).append(stage.ticket.seq)
        return stage

    table.stage_rows = watched  # type: ignore[method-assign]
    return out


def _mean(values: Sequence[float]) -> Optional[float]:
    return statistics.fmean(values) if values else None


def _events(engine: _TimedEngine, watch: Optional[_DiskWatch], disk_of: Dict[int, List[int]],
            io: Dict[int, Tuple[float, float, int]], starts: Sequence[float],
            ends: Sequence[float]) -> List[Dict[str, Any]]:
    """Timeline events of a run (bench/timeline.py's lanes): each batch's disk reads, its
    host->device copies, its step and its lookup's wait."""
    ev: List[Dict[str, Any]] = []
    disk: List[Dict[str, Any]] = []
    for i, (s0, s1) in enumerate(zip(starts, ends)):
        ev.append({"lane": "compute", "name": f"step b{i}", "batch": i, "start_s": s0, "end_s": s1})
        w = engine.waits.get(i)
        if w is not None and w[1] - w[0] > 20e-6:
            ev.append({"lane": "stall", "name": f"wait b{i}", "batch": i, "start_s": w[0], "end_s": w[1]})
        ticket = engine.issued[i][0] if i in engine.issued else None
        rec = engine.copy.records.get(ticket.seq) if ticket is not None else None
        if rec is not None:
            ev.append({"lane": "fetch", "name": f"copy b{i}", "batch": i, "start_s": rec[1], "end_s": rec[2]})
        for seq in disk_of.get(i, []):
            if seq in io and io[seq][2]:
                kind = watch.queued[seq][1] if watch is not None and seq in watch.queued else "batch"
                disk.append({"lane": "disk", "name": f"{'stage' if kind == 'stage' else 'read'} b{i}", "batch": i,
                             "start_s": io[seq][0], "end_s": io[seq][1]})
    # Disk tickets whose reads overlap go on rows of their own ("disk", "disk:2", ...), so
    # that reads in flight together are seen together.
    row_ends: List[float] = []
    for e in sorted(disk, key=lambda e: e["start_s"]):
        row = next((k for k, end in enumerate(row_ends) if end <= e["start_s"]), None)
        if row is None:
            row = min(len(row_ends), _DISK_ROWS - 1)
            if row == len(row_ends):
                row_ends.append(0.0)
        row_ends[row] = max(row_ends[row], e["end_s"])
        ev.append({**e, "lane": "disk" if row == 0 else f"disk:{row + 1}"})
    return ev


#: Rows of the timeline's disk lane at most (more overlapping tickets share the last).
_DISK_ROWS = 6


# --------------------------------------------------------------------------------------------
# exactness


def _settle(table: TieredTable) -> None:
    """The device cache written back: the host tier (and on disk, its host cache and file)
    then holds every row's value."""
    engine = FetchEngine()
    try:
        engine.flush([table])
    finally:
        engine.close()


def _host_rows(table: TieredTable, rows: torch.Tensor) -> List[torch.Tensor]:
    """Weight and optimizer state of ``rows`` as ``[n, width]`` int32 bit patterns."""
    if table.disk is not None:
        parts = table.disk.read_rows(rows)
    else:
        parts = table.gather_host(rows)
    return [p.reshape(p.shape[0], -1).contiguous().view(torch.int32) for p in parts]


def _same(a: TieredTable, b: TieredTable, rows: torch.Tensor) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_host_rows(a, rows), _host_rows(b, rows)))


def _check_rows(disk: TieredTable, dram: TieredTable, batches: Sequence[Any], rng: np.random.Generator) -> bool:
    """After a run on both tables: the rows it touched and a random sample of the others,
    bit for bit."""
    _settle(disk)
    _settle(dram)
    touched = np.unique(torch.cat([b[0] for b in batches]).numpy())
    sample = rng.choice(disk.num_rows, size=min(2048, disk.num_rows), replace=False)
    rows = torch.from_numpy(np.union1d(touched, sample).astype(np.int64))
    return _same(disk, dram, rows)


def _check_file(disk: TieredTable, dram: TieredTable, chunk_pages: int = 4096) -> bool:
    """Every row, at the end: both device caches written back and the host cache flushed,
    the table's file is the whole table; it is read page by page (large sequential reads,
    outside the host cache) and each record compared, bit for bit, with the DRAM table."""
    _settle(disk)
    _settle(dram)
    disk.flush_to_disk()
    tier = disk.disk
    f = tier.file
    rpp, record, page = tier.rows_per_page, tier.record, tier.page_bytes
    hosts = [dram.host_weight, *dram.host_state.values()]
    buf = aligned_buffer(chunk_pages * page)
    for p0 in range(0, f.num_pages, chunk_pages):
        n = min(chunk_pages, f.num_pages - p0)
        f.read_pages(np.arange(p0, p0 + n), buf).wait()
        r0 = p0 * rpp
        r1 = min(tier.num_rows, r0 + n * rpp)
        records = buf[: n * page].reshape(n, page)[:, : rpp * record].reshape(n * rpp, record)[: r1 - r0]
        for c, off, host in zip(tier.components, tier.offsets, hosts):
            want = host[r0:r1].contiguous().view(torch.uint8).reshape(r1 - r0, -1).numpy()
            if not np.array_equal(records[:, off: off + want.shape[1]], want):
                return False
    return True


# --------------------------------------------------------------------------------------------
# warm caches and the disk's own figures


def _prefill(disk: TieredTable, dram: TieredTable, work: _Workload, g: Geometry) -> None:
    """Caches as after a long run: each device cache holds the most popular rows, the host
    cache the next most popular (a row the device cache keeps is not looked up in the host
    cache, whose LRU lets it go), the hottest of each the most recently used.

    Rows come off the disk in row order (ranks are spread over the file: in rank order every
    row would be a read of its own, in row order the pages of a chunk run together), and
    the LRU order is set afterwards by touching them again, coldest first (hits: no I/O)."""
    tier = disk.disk
    step = max(1, min(1 << 16, tier.num_slots // 2))

    def touch(rows: np.ndarray) -> None:
        for hi in range(rows.size, 0, -step):
            ticket = tier.prefetch(rows[max(0, hi - step):hi])
            try:
                tier.wait(ticket)
            finally:
                tier.release(ticket)

    m = min(g.device_cache_rows, g.rows)
    device_rows = work.hottest(m)
    touch(np.sort(device_rows)[::-1])  # (into the host cache, for the disk table's device fills)
    chunk = max(1, g.device_cache_rows // 2)
    for table in (disk, dram):
        engine = FetchEngine()
        try:
            for hi in range(m, 0, -chunk):
                plan = table.plan(torch.from_numpy(np.sort(device_rows[max(0, hi - chunk):hi])))
                try:
                    engine.run([plan])
                finally:
                    table.release(plan)
        finally:
            engine.close()
    host_rows = work.hottest(min(g.rows, m + tier.num_slots))[m:]
    touch(np.sort(host_rows)[::-1])
    touch(host_rows)  # (coldest first: the hottest end up the most recently used)


def _probe_disk(file: Any, in_flight: int, seconds: float, seed: int = 0) -> Dict[str, Any]:
    """Random single-page reads of the table's file, outside the store: latency at one read
    in flight, reads/s at ``in_flight``. What the disk gives, for comparison with what the
    runs reached."""
    rng = np.random.default_rng(seed)
    out: Dict[str, Any] = {"in_flight": in_flight}
    half = max(1, file.num_pages // 2)
    file.read_pages(np.arange(0, 2 * min(in_flight, half), 2), aligned_buffer(in_flight * BLOCK)).wait()  # (threads up)
    for depth, key in ((1, "one"), (in_flight, "many")):
        buf = aligned_buffer(depth * BLOCK)
        done, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds or done == 0:
            # distinct pages far enough apart that no two merge into one request
            pages = np.sort(rng.choice(half, size=min(depth, half), replace=False) * 2)
            file.read_pages(pages, buf).wait()
            done += pages.size
        dt = time.perf_counter() - t0
        out[f"reads_per_s_{key}"] = done / dt
        if depth == 1:
            out["latency_us_one"] = 1e6 * dt / done
    return out


# --------------------------------------------------------------------------------------------
# the bench


def run_ssd_bench(s: SsdSettings, directory: os.PathLike | str, notes: Sequence[str] = (),
                  progress: Optional[Callable[[str, int], None]] = None, trace: bool = False,
                  budget_s: Optional[float] = None) -> Dict[str, Any]:
    """Runs ``bench --tier ssd`` with its table file in ``directory`` (which the caller
    removes); returns the report (``F["ssd"]`` of ``--json F``, see the module docstring).

    ``progress(description, runs_done)`` is called as it goes. ``trace`` keeps the first
    round's timeline events (``report["_events"]``, not JSON: :func:`write_ssd_timeline`).
    ``budget_s``: past ``MIN_PAIRED_ROUNDS`` rounds, no round starts that would end the run
    (its final check included) later than this many seconds after its start."""
    return _Bench(s, directory, list(notes), progress, trace, budget_s).run()


class _Bench:
    """The state of one ``bench --tier ssd`` run (see :func:`run_ssd_bench`)."""

    def __init__(self, s: SsdSettings, directory: os.PathLike | str, notes: List[str],
                 progress: Optional[Callable[[str, int], None]], trace: bool, budget_s: Optional[float]) -> None:
        self.s, self.directory, self.notes, self.trace, self.budget_s = s, directory, notes, trace, budget_s
        self.say = progress or (lambda desc, done: None)
        self.separate = disk_depth_supported()
        self.g = Geometry.of(s)
        self.configs = configs_for(s, self.separate)
        self.deepest = max(self.configs, key=lambda c: (c.lookahead, c.depth))
        self.work = _Workload(s, self.g.rows)
        self.checks: List[Dict[str, Any]] = []
        self.runs: Dict[str, List[Dict[str, Any]]] = {c.name: [] for c in self.configs}
        self.events: Dict[str, List[Dict[str, Any]]] = {}
        self.phases: Dict[str, float] = {}
        self.run_index = 0
        self.done = 0
        self.rng = np.random.default_rng([s.seed, 3])
        # A batch set the DRAM table trained timed and the disk table has yet to train: the
        # next disk run trains it (timed), so neither table replays a dram run's batches.
        self.shared: Optional[Tuple[List[Any], Dict[str, Any]]] = None

    def _phase(self, name: str, t0: float) -> float:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - t0
        return now

    def run(self) -> Dict[str, Any]:
        s, g = self.s, self.g
        t_start = time.perf_counter()
        self.say("making the initial weights", 0)
        init = _initial_weights(g.rows, g.dim, s.seed)
        t = self._phase("initial weights", t_start)
        disk = dram = None
        try:
            self.say(f"writing the table file ({g.file_bytes / GB:.2f} GB)", 0)
            optim = _optimizer(s)
            disk = TieredTable.on_disk("t", g.rows, g.dim, optim, num_slots=g.device_cache_rows,
                                       directory=self.directory, host_cache_bytes=s.host_cache_bytes,
                                       initial_weight=init, io_threads=s.io_threads)
            dram = TieredTable("t", init, optim, num_slots=g.device_cache_rows)  # (trains init in place)
            del init
            self.disk, self.dram = disk, dram
            file = disk.disk.file
            self.watch = _DiskWatch(disk.disk)
            t = self._phase("writing the table file", t)
            self.say("probing the disk", 0)
            probe = _probe_disk(file, s.io_threads, 0.2 if s.quick else 1.5, s.seed)
            t = self._phase("disk probe", t)
            self.say("warming the caches with the most popular rows", 0)
            _prefill(disk, dram, self.work, g)
            # One untimed run on both tables: dirty rows and LRU order as in a running job.
            self.say("warm-up run", 0)
            batches = self.work.batches(self._next_index(), s.warmup_steps + s.timed_steps)
            _replay(disk, batches, self.deepest, self.separate)
            _replay(dram, batches, self.deepest, self.separate)
            self.checks.append({"run": "warm-up", "identical": _check_rows(disk, dram, batches, self.rng)})
            t = self._phase("warm caches", t)
            dram_cfg = self._rounds(t_start)
            t = time.perf_counter()
            self.say("comparing every row of the two tables", self.done)
            every_row = _check_file(disk, dram)
            self._phase("comparing every row", t)
            o_direct, fallback = bool(file.o_direct), file.fallback_reason
            io_backend = file.io_backend
            table_bytes, host_bytes = int(file.size), int(disk.disk.num_slots * disk.disk.record)
        finally:
            for table in (disk, dram):
                if table is not None:
                    table.close()
        report = _report(s, g, self.configs + [dram_cfg], self.runs, self.checks, every_row, self.separate, probe,
                         self.notes)
        report.update(table_bytes=table_bytes, host_cache_bytes=host_bytes, o_direct=o_direct,
                      o_direct_fallback=fallback, io_backend=io_backend, wall_s=time.perf_counter() - t_start,
                      phases_s=self.phases, rounds_asked=s.rounds, dram_depth=dram_cfg.depth, timed_from_outside=self.watch.timed)
        if self.trace:
            report["_events"] = _picked_events(self.events, report)
        return report

    def _next_index(self) -> int:
        self.run_index += 1
        return self.run_index - 1

    def _rounds(self, t_start: float) -> SsdConfig:
        """Every round: every configuration once, in rotated order (the first round: the disk
        configurations, then dram at the fastest one's depth). Returns dram's configuration."""
        s = self.s
        dram_cfg: Optional[SsdConfig] = None
        # (the final check reads the file once, as writing it read and wrote it)
        final = 0.6 * self.phases.get("writing the table file", 0.0)
        for r in range(s.rounds):
            t_round = time.perf_counter()
            if r == 0:
                order = list(self.configs)
            else:
                order = list(self.configs) + [dram_cfg]  # type: ignore[list-item]
                order = order[r % len(order):] + order[:r % len(order)]
            for cfg in order:
                self._one_run(cfg, r)
            if r == 0:
                fastest = max(self.configs, key=lambda c: _run_rate(self.runs[c.name][0], s))
                dram_cfg = SsdConfig("dram", fastest.depth, None, tier="dram")
                self.runs["dram"] = []
                self._one_run(dram_cfg, r)
            now = self._phase("rounds", t_round)
            per_round = self.phases["rounds"] / (r + 1)
            # (a round may take longer than the mean so far: some margin)
            if (self.budget_s is not None and r + 1 >= MIN_PAIRED_ROUNDS and r + 1 < s.rounds
                    and now - t_start + 1.2 * per_round + final > self.budget_s):
                self.notes.append(f"stopped after {r + 1} of {s.rounds} rounds, to end within the time budget of "
                                  f"{self.budget_s / 60:.0f} min (a round took {per_round:.0f} s)")
                break
        if self.shared is not None:  # (the last run was dram's: the disk table trains its batches too)
            batches, rec = self.shared
            self.shared = None
            _replay(self.disk, batches, self.deepest, self.separate)
            rec["identical"] = _check_rows(self.disk, self.dram, batches, self.rng)
            self.checks.append({"run": rec["_name"], "identical": rec["identical"]})
        assert dram_cfg is not None
        return dram_cfg

    def _batch_count(self, cfg: SsdConfig) -> int:
        return self.s.warmup_steps + cfg.lookahead + self.s.timed_steps + max(1, cfg.lookahead)

    def _one_run(self, cfg: SsdConfig, r: int) -> None:
        """One timed run of ``cfg`` on its table; its batches trained by the other table too
        (a dram run's by the next disk run, timed), then the bit check of the two."""
        s = self.s
        self.say(f"round {r + 1}/{s.rounds}: {cfg.name}", self.done)
        if cfg.tier == "dram":
            # Batches for any disk run: the next one trains them (with more warm-up steps
            # when it is shallower than the deepest).
            batches = self.work.batches(self._next_index(), self._batch_count(self.deepest))
            warm = len(batches) - s.timed_steps - max(1, cfg.lookahead)
            rec = _timed_run(self.dram, batches, cfg, s, warm, None, self.separate, False)
            rec["_name"] = f"round {r + 1} {cfg.name}"
            self.shared = (batches, rec)
            self.runs[cfg.name].append(rec)
            self.done += 1
            return
        shared, self.shared = self.shared, None
        batches = shared[0] if shared else self.work.batches(self._next_index(), self._batch_count(cfg))
        warm = len(batches) - s.timed_steps - max(1, cfg.lookahead)
        rec = _timed_run(self.disk, batches, cfg, s, warm, self.watch, self.separate, self.trace and r == 0)
        if shared is None:
            _replay(self.dram, batches, cfg, self.separate)
        rec["identical"] = _check_rows(self.disk, self.dram, batches, self.rng)
        self.checks.append({"run": f"round {r + 1} {cfg.name}", "identical": rec["identical"]})
        if shared is not None:  # (the dram run of the same batches: checked by the same comparison)
            shared[1]["identical"] = rec["identical"]
            self.checks.append({"run": shared[1]["_name"], "identical": rec["identical"]})
        if "events" in rec:
            self.events[cfg.name] = rec.pop("events")
        self.runs[cfg.name].append(rec)
        self.done += 1


def _run_rate(rec: Dict[str, Any], s: SsdSettings) -> float:
    return s.timed_steps * s.ids_per_step / rec["elapsed_s"]


# --------------------------------------------------------------------------------------------
# the report


def _config_report(cfg: SsdConfig, recs: List[Dict[str, Any]], s: SsdSettings) -> Dict[str, Any]:
    steps = s.timed_steps * len(recs)
    elapsed = sum(r["elapsed_s"] for r in recs)
    rate = steps * s.ids_per_step / elapsed
    per_round = [_run_rate(r, s) for r in recs]
    interval = rate_interval(rate, per_round)
    tot = {k: sum(r["counters"].get(k, 0.0) for r in recs) for k in recs[0]["counters"]}
    all_steps = sorted(x for r in recs for x in r["steps_ms"])
    stall = sum(r["stall_s"] for r in recs)
    disk_stall = sum(r["disk_stall_s"] for r in recs)
    c: Dict[str, Any] = {
        "name": cfg.name, "tier": cfg.tier, "depth": cfg.depth, "disk_depth": cfg.disk_depth,
        "samples_per_s": rate, "samples_per_s_interval": interval, "samples_per_s_rounds": per_round,
        "noise_pct": None if interval is None else 100 * (interval[1] - interval[0]) / 2 / rate,
        "rounds": len(recs), "steps_measured": steps,
        "step_ms_mean": 1e3 * elapsed / steps, "step_ms_median": statistics.median(all_steps),
        "step_ms_p90": all_steps[min(len(all_steps) - 1, int(round(0.9 * (len(all_steps) - 1))))],
        "stall_ms": 1e3 * stall / steps,
        # Stall by phase: waiting while the batch's disk reads (or earlier batches', ahead of
        # them in the disk's queue) were not done, then for its host->device copies.
        "stall_ms_by_phase": {"disk": 1e3 * disk_stall / steps, "copy": 1e3 * (stall - disk_stall) / steps},
        "plan_ms": 1e3 * sum(r["plan_s"] for r in recs) / steps,
        "device_rows_fetched_per_step": tot.get("table_rows_fetched", 0.0) / steps,
        "device_hit_rate": (tot.get("table_hits", 0.0) / tot["table_lookups_rows"]) if tot.get("table_lookups_rows")
        else None,
        "overflow_rows_per_step": tot.get("table_overflow_rows", 0.0) / steps,
        "lead_batches": _mean([r["lead_batches"] for r in recs if r["lead_batches"] is not None]),
        "lead_ms": _mean([r["lead_ms"] for r in recs if r["lead_ms"] is not None]),
        "ready_before_use_ms": _mean([r["ready_before_use_ms"] for r in recs if r["ready_before_use_ms"] is not None]),
        "bit_identical": all(r["identical"] for r in recs),
        "step_ms_per_round": [r["steps_ms"] for r in recs],
    }
    if cfg.tier == "disk":
        reads = [r["reads"] for r in recs if "reads" in r]
        lat = [x["latency_ms_mean"] for x in reads if x["latency_ms_mean"] is not None]
        c.update({
            "disk_rows_per_step": tot.get("disk_rows_read", 0.0) / steps,
            "disk_pages_per_step": tot.get("disk_pages_read", 0.0) / steps,
            "disk_reads_per_step": tot.get("file_reads", 0.0) / steps,
            "disk_reads_per_s": tot.get("file_reads", 0.0) / elapsed,
            "disk_pages_per_s": tot.get("disk_pages_read", 0.0) / elapsed,
            "mb_per_s": tot.get("file_bytes_read", 0.0) / elapsed / 1e6,
            "disk_rows_written_per_step": tot.get("disk_rows_written", 0.0) / steps,
            "disk_write_mb_per_s": tot.get("file_bytes_written", 0.0) / elapsed / 1e6,
            "host_cache_hit_rate": (tot.get("disk_row_hits", 0.0)
                                    / (tot.get("disk_row_hits", 0.0) + tot.get("disk_row_misses", 0.0)))
            if tot.get("disk_row_hits", 0.0) + tot.get("disk_row_misses", 0.0) else None,
            # Little's law over the timed windows: busy read time / wall time.
            "reads_in_flight": (sum(x["mean"] * r["elapsed_s"] for x, r in zip(reads, recs)) / elapsed)
            if reads else None,
            "reads_in_flight_max": max((x["max"] for x in reads), default=None),
            # the store's own count: mean over reads of the reads in flight as each started
            "reads_in_flight_at_start": (tot["reads_in_flight_sum"] / tot["disk_read_requests"])
            if tot.get("disk_read_requests") and "reads_in_flight_sum" in tot else None,
            "stage_rows_read_per_step": tot["disk_stage_rows_read"] / steps if "disk_stage_rows_read" in tot else None,
            # rows a batch's plan still had to read itself (not staged ahead, or not landed)
            "plan_rows_missed_per_step": tot["disk_plan_rows_missed"] / steps if "disk_plan_rows_missed" in tot
            else None,
            "stages_waited": sum(r.get("stages_waited") or 0 for r in recs),
            "stages_dropped": sum(r.get("stages_dropped") or 0 for r in recs),
            "read_latency_ms": _mean(lat),
            "disk_lead_batches": recs[0]["disk_lead_batches"],
            "disk_lead_ms": _mean([r["disk_lead_ms"] for r in recs if r["disk_lead_ms"] is not None]),
            "disk_ready_before_use_ms": _mean([r["disk_ready_before_use_ms"] for r in recs
                                               if r["disk_ready_before_use_ms"] is not None]),
        })
    else:
        c.update({"disk_rows_per_step": 0.0, "disk_reads_per_s": 0.0, "mb_per_s": 0.0, "reads_in_flight": 0.0})
    return c


def _report(s: SsdSettings, g: Geometry, configs: List[SsdConfig], runs: Dict[str, List[Dict[str, Any]]],
            checks: List[Dict[str, Any]], every_row: bool, separate: bool, probe: Dict[str, Any],
            notes: Sequence[str]) -> Dict[str, Any]:
    out = [_config_report(c, runs[c.name], s) for c in configs]
    by = {c["name"]: c for c in out}
    disk_configs = [c for c in out if c["tier"] == "disk"]
    best = max(disk_configs, key=lambda c: c["samples_per_s"])
    out.insert(len(disk_configs), {**best, "name": "best", "best_of": best["name"]})
    ratios = {key: _ratio(best, by[other]) for key, other in
              (("best_vs_depth_1", "depth_1"), ("best_vs_reactive", "reactive"), ("best_vs_dram", "dram"))}
    identical = every_row and all(c["identical"] for c in checks)
    rounds = min(c["rounds"] for c in out)
    report: Dict[str, Any] = {
        "bit_identical": identical,
        "bit_identity": {
            "every_row_at_the_end": every_row, "runs_checked": len(checks),
            "runs_differing": [c["run"] for c in checks if not c["identical"]],
            "what": "after every run, the rows it touched and 2048 random others (read through the host cache); "
                    "at the end every row, read from the table's file (weights and optimizer state, bit for bit, "
                    "disk table vs the table in DRAM)"},
        "rows": g.rows, "dim": g.dim, "record_bytes": g.record_bytes, "rows_per_page": g.rows_per_page,
        "page_bytes": g.page_bytes, "host_cache_rows": g.host_cache_rows, "device_cache_rows": g.device_cache_rows,
        "device_cache_fraction": s.device_cache_fraction, "optimizer": "exact row-wise Adagrad",
        "ids_per_step": s.ids_per_step, "samples_per_step": s.ids_per_step, "zipf_alpha": s.zipf_alpha,
        "step_ms_emulated": s.step_ms, "io_threads": s.io_threads, "rounds": rounds,
        "warmup_steps": s.warmup_steps, "timed_steps": s.timed_steps, "quick": s.quick,
        "disk_depth_separate": separate, "disk_probe": probe,
        "configs": out, "best": best["name"], "ratios": ratios,
        "targets": _targets(ratios, identical, rounds), "notes": list(notes),
        "method": ("rate = timed samples / timed wall time per run; intervals: 95% t-interval of the per-round "
                   "rates (ratios: of the per-round ratios, paired), widened to include the figure; none with "
                   f"fewer than {MIN_PAIRED_ROUNDS} rounds"),
    }
    report["auto_disk_depth"] = _auto_disk_depth(report)
    report["notes"] += _diagnosis(report)
    return report


def _auto_disk_depth(report: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """What the store's automatic choice (``fetch.disk_depth.choose_disk_depth``) makes of
    this run's figures: ``depth_1``'s read latency, reads per step and step without its
    stall, and the probe's reads/s at the most reads in flight."""
    try:
        from ..fetch.disk_depth import choose_disk_depth
    except ImportError:  # (a store without it)
        return None
    c = next((c for c in report["configs"] if c["name"] == "depth_1"), None)
    probe = report["disk_probe"]
    if c is None or not c.get("read_latency_ms") or not probe.get("reads_per_s_many"):
        return None
    step_s = max(1e-4, (c["step_ms_mean"] - c["stall_ms"]) / 1e3)
    choice = choose_disk_depth(c["read_latency_ms"] / 1e3, probe["reads_per_s_many"], c["disk_reads_per_step"],
                               step_s, depth=1, max_in_flight=report["io_threads"],
                               host_cache_rows=report["host_cache_rows"], rows_per_step=report["ids_per_step"])
    return {"disk_depth": choice.disk_depth, "disk_bound": choice.disk_bound, "reads_per_s": choice.reads_per_s,
            "batch_read_ms": 1e3 * choice.batch_read_s, "stall_ms_per_step": 1e3 * choice.stall_per_step_s,
            "capped_by": choice.capped_by,
            "from": "depth_1's read latency, reads a step and step without stall; the probe's reads/s"}


def _ratio(a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, Any]:
    ra, rb = a["samples_per_s_rounds"], b["samples_per_s_rounds"]
    paired = [x / y for x, y in zip(ra, rb)] if len(ra) == len(rb) else []
    return paired_ratio(a["samples_per_s"] / b["samples_per_s"], paired)


def _targets(ratios: Dict[str, Dict[str, Any]], identical: bool, rounds: int) -> List[Dict[str, Any]]:
    out = []
    for key, label, threshold in TARGETS:
        r = ratios[key]
        judged = r["interval"] is not None
        if key == "best_vs_dram":
            met = (r["interval"][1] >= threshold) if judged else None
        else:
            met = (r["value"] >= threshold) if judged else None
        out.append({"target": label, "ratio": key, "threshold": threshold, "value": r["value"],
                    "interval": r["interval"], "met": met,
                    "why_not_judged": None if judged else f"{rounds} round(s): a verdict needs {MIN_PAIRED_ROUNDS}"})
    out.append({"target": "final parameters bit-identical across every disk configuration and dram",
                "met": identical, "value": identical, "interval": None, "threshold": None, "ratio": None,
                "why_not_judged": None})
    return out


def _diagnosis(report: Dict[str, Any]) -> List[str]:
    """Where the time of the fastest disk configuration goes, in the disk's own terms."""
    best = next(c for c in report["configs"] if c["name"] == "best")
    probe = report["disk_probe"]
    lines = [f"the disk (probe, random {BLOCK // 1024} KiB reads of the table's file before the runs): "
             f"{probe['latency_us_one']:.0f} us a read at 1 in flight ({probe['reads_per_s_one']:.0f} reads/s), "
             f"{probe['reads_per_s_many']:.0f} reads/s at {probe['in_flight']} in flight"]
    parts = best["stall_ms_by_phase"]
    line = (f"best ({best['best_of']}): stall {best['stall_ms']:.2f} ms/step ({parts['disk']:.2f} waiting for disk "
            f"reads, {parts['copy']:.2f} for host->device copies), planning {best['plan_ms']:.2f} ms/step on the "
            f"training thread; {best['disk_rows_per_step']:.0f} rows read a step in {best['disk_reads_per_step']:.0f} "
            f"reads = {best['disk_reads_per_s']:.0f} reads/s, {best['mb_per_s']:.1f} MB/s")
    if best.get("reads_in_flight") is not None:
        line += (f", {best['reads_in_flight']:.1f} reads in flight on average (at most "
                 f"{best['reads_in_flight_max']})")
    if probe.get("reads_per_s_many"):
        line += f": {100 * best['disk_reads_per_s'] / probe['reads_per_s_many']:.0f}% of the probe's reads/s"
    lines.append(line)
    dram = next((c for c in report["configs"] if c["name"] == "dram"), None)
    if dram is not None and best.get("disk_reads_per_step"):
        steps_per_s = dram["samples_per_s"] / report["samples_per_step"]
        need = best["disk_reads_per_step"] * steps_per_s
        lines.append(f"dram's pace ({steps_per_s:.1f} steps/s) would need {need:.0f} disk reads/s at best's "
                     f"{best['disk_reads_per_step']:.0f} reads a step; "
                     + (f"more than the probe's {probe['reads_per_s_many']:.0f} at {probe['in_flight']} in flight: "
                        f"this disk cannot give it" if need > probe["reads_per_s_many"] else
                        f"within the probe's {probe['reads_per_s_many']:.0f} at {probe['in_flight']} in flight"))
    auto = report.get("auto_disk_depth")
    if auto:
        lines.append(f"the store's automatic choice on these figures: disk depth {auto['disk_depth']} at depth 1 "
                     f"(one batch's reads {auto['batch_read_ms']:.0f} ms at {auto['reads_per_s']:.0f} reads/s"
                     + (f"; disk-bound: about {auto['stall_ms_per_step']:.1f} ms/step of stall whatever the depth"
                        if auto["disk_bound"] else "") + ")")
    if best["plan_ms"] > best["stall_ms"]:
        lines.append(f"best's training thread spends more on its own disk-tier work ({best['plan_ms']:.2f} ms/step: "
                     f"planning, staging, bookkeeping, sharing the cores and the GIL with {report['io_threads']} I/O "
                     f"threads) than waiting for rows ({best['stall_ms']:.2f} ms/step)")
    return lines


def _picked_events(events: Dict[str, List[Dict[str, Any]]], report: Dict[str, Any]) -> Dict[str, Any]:
    """The timeline's configurations: reactive, depth_1 and the fastest, or, where the
    fastest is one of those two, the fastest deeper one."""
    picked = ["reactive", "depth_1", report["best"]]
    if report["best"] in ("reactive", "depth_1"):
        deeper = [c for c in report["configs"] if c["tier"] == "disk" and c["name"] not in ("reactive", "depth_1", "best")]
        if deeper:
            picked.append(max(deeper, key=lambda c: c["samples_per_s"])["name"])
    return {name: events[name] for name in dict.fromkeys(picked) if name in events}


# --------------------------------------------------------------------------------------------
# output


def format_ssd_summary(report: Dict[str, Any]) -> str:
    """The summary a user reads (stdout)."""
    r = report
    host_mb = r["host_cache_bytes"] / MB
    lines = [
        f"ssd tier: one table of {r['rows']:,} rows x {r['dim']} ({r['optimizer']}; {r['record_bytes']}-byte records, "
        f"{r['rows_per_page']} a {r['page_bytes'] // 1024} KiB page): a {r['table_bytes'] / GB:.2f} GB file, "
        f"{r['table_bytes'] / max(1, r['host_cache_bytes']):.1f}x its {host_mb:.0f} MB host cache; device cache "
        f"{r['device_cache_fraction']:.0%} ({r['device_cache_rows']:,} rows)",
        f"disk: {'O_DIRECT' if r['o_direct'] else 'NO O_DIRECT - ' + str(r['o_direct_fallback'])}, "
        f"{r['io_threads']} reads in flight at most"
        + (f" ({r['io_backend']} I/O)" if r.get("io_backend") else "") + f", under {r.get('tier_dir', '?')}"
        + (f" ({r['filesystem']})" if r.get("filesystem") else ""),
        f"workload: {r['ids_per_step']} Zipf({r['zipf_alpha']:g}) ids a step (one per sample), the device's step "
        f"EMULATED by a {r['step_ms_emulated']:g} ms sleep; {r['timed_steps']} timed steps x {r['rounds']} round(s) "
        f"per configuration; dram at depth {r['dram_depth']}; caches warm (filled by popularity: the device's with "
        f"the hottest rows, the host's with the next, then an untimed run)",
    ]
    if not r["disk_depth_separate"]:
        lines.append("the store's lookahead has no separate disk depth yet: the disk hop is as deep as the "
                     "host->device hop (disk_depth = depth)")
    if r["quick"] or r["rounds"] < MIN_PAIRED_ROUNDS:
        lines.append(f"{'--quick' if r['quick'] else str(r['rounds']) + ' round(s)'}: a smoke test, not a "
                     f"measurement - no intervals, no verdicts, no claims (they need at least {MIN_PAIRED_ROUNDS} "
                     f"rounds)")
    lines.append(f"{'config':<18}{'depth':>6}{'disk':>5}{'samples/s':>11}{'interval':>17}{'stall ms':>9}"
                 f"{'disk/copy':>12}{'plan ms':>8}{'rows/step':>10}{'reads/s':>9}{'MB/s':>7}{'in flight':>11}"
                 f"{'lead':>11}{'bits':>6}")
    for c in r["configs"]:
        iv = c["samples_per_s_interval"]
        interval = "-" if iv is None else f"[{iv[0]:.0f}-{iv[1]:.0f}]"
        ph = c["stall_ms_by_phase"]
        disk = c["disk_depth"] if c["disk_depth"] is not None else "-"
        if c["tier"] == "disk":
            flight = "-" if c.get("reads_in_flight") is None else f"{c['reads_in_flight']:.1f}/{c['reads_in_flight_max']}"
            lead = (f"{c['lead_batches']:.1f}/{c['disk_lead_batches']}" if c["lead_batches"] is not None else "-")
            io = (f"{c['disk_rows_per_step']:>10.0f}{c['disk_reads_per_s']:>9.0f}{c['mb_per_s']:>7.1f}"
                  f"{flight:>11}{lead:>11}")
        else:
            lead = f"{c['lead_batches']:.1f}/-" if c["lead_batches"] is not None else "-"
            io = f"{'-':>10}{'-':>9}{'-':>7}{'-':>11}{lead:>11}"
        lines.append(f"{c['name']:<18}{c['depth']:>6}{disk!s:>5}{c['samples_per_s']:>11.0f}{interval:>17}"
                     f"{c['stall_ms']:>9.2f}{ph['disk']:>6.1f}/{ph['copy']:<5.1f}{c['plan_ms']:>8.2f}{io}"
                     f"{'ok' if c['bit_identical'] else 'DIFF':>6}")
    lines.append(f"best = {r['best']}")
    for key, label in (("best_vs_depth_1", "best / depth_1"), ("best_vs_reactive", "best / reactive"),
                       ("best_vs_dram", "best / dram")):
        lines.append(f"{label} = {format_ratio(r['ratios'][key], unit='x' if key != 'best_vs_dram' else '')}")
    for t in r["targets"]:
        if t["ratio"] is None:
            continue
        verdict = {True: "MET", False: "NOT MET", None: "not judged"}[t["met"]]
        fig = f"{t['value']:.2f}" + (f" [{t['interval'][0]:.2f}-{t['interval'][1]:.2f}]" if t["interval"] else "")
        extra = f" ({t['why_not_judged']})" if t["why_not_judged"] else ""
        lines.append(f"target {t['target']}: {verdict}: {fig}{extra}")
    bi = r["bit_identity"]
    lines.append(f"final parameters bit-identical across every disk configuration and dram: "
                 f"{'yes' if r['bit_identical'] else 'NO'} ({bi['runs_checked']} runs checked after each, every row at "
                 f"the end{'' if not bi['runs_differing'] else '; differing: ' + ', '.join(bi['runs_differing'])})")
    for n in r["notes"]:
        lines.append(f"note: {n}")
    if r.get("dram_depth") is not None:
        best = next(c for c in r["configs"] if c["name"] == "best")
        if best["depth"] != r["dram_depth"]:
            lines.append(f"note: dram ran at depth {r['dram_depth']} (the first round's fastest); over all rounds the "
                         f"fastest is {best['best_of']} (depth {best['depth']})")
    lines.append("columns: stall ms = the lookup's wait per timed step, split disk/copy (waiting for disk reads, "
                 "then for host->device copies); plan ms = planning on the training thread; rows/step = rows read "
                 "from disk; reads/s and MB/s over the timed steps; in flight = read requests in flight, mean/max; "
                 "lead = batches ahead of use, host->device/disk; bits = bit-identical to the table in DRAM")
    if "files_removed" in r:
        lines.append(f"tier files removed: {'yes' if r['files_removed'] else 'NO - ' + str(r.get('tier_dir'))}")
    return "\n".join(lines)


def write_ssd_timeline(report: Dict[str, Any], out_dir: os.PathLike | str) -> List[str]:
    """``ssd_timeline.png`` (and its Chrome trace) of the first round's ``reactive``,
    ``depth_1`` and fastest runs: each batch's disk reads, host->device copies, step and
    wait, 8 timed steps of each."""
    from pathlib import Path

    from .timeline import render_timeline_png, write_chrome_trace

    events = report.get("_events") or {}
    if not events:
        return []
    by = {c["name"]: c for c in report["configs"]}
    labels = {}
    for name in events:
        c = by[name]
        labels[name] = (f"{name} (depth {c['depth']}, disk {c['disk_depth']})" if c["tier"] == "disk"
                        else f"{name} (depth {c['depth']})")
    evs = {labels[n]: e for n, e in events.items()}
    figures = {labels[n]: {"step_ms": by[n]["step_ms_median"], "stall_ms_per_step": by[n]["stall_ms"],
                           "steps": by[n]["steps_measured"], "rounds": by[n]["rounds"]} for n in events}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    skip = report["warmup_steps"] + max(by[n]["depth"] for n in events)
    png = render_timeline_png(
        evs, out / "ssd_timeline.png", max_batches=8, skip_batches=skip, figures=figures,
        title=(f"ssd tier: {report['table_bytes'] / GB:.2f} GB table, {report['host_cache_bytes'] / MB:.0f} MB host "
               f"cache, {report['ids_per_step']} ids/step; device step EMULATED ({report['step_ms_emulated']:g} ms "
               f"sleep); first round, as traced"))
    trace = write_chrome_trace(evs, out / "ssd_timeline.trace.json")
    return [str(png), str(trace)]


def public(report: Dict[str, Any]) -> Dict[str, Any]:
    """The report without what is not JSON (the traced events)."""
    return {k: v for k, v in report.items() if not k.startswith("_")}
