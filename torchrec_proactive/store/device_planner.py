"""The device planner: a table's residency bookkeeping on the cache's device, planned with
no host synchronisation (``TieredTable(planner="device")``; ``host_planner.py`` is the same
contract on the host).

Why: at GPU batch sizes host planning costs more than the step it must hide behind
(``unique`` + plan of 2M Zipf ids: ~100 ms on one core, where a DLRM step on H100s takes a
few ms), and it needs the ids on the host, which is itself a sync. So, as FBGEMM's UVM
cache does (``linearize_cache_indices -> lru_cache_find_uncached -> lru_cache_populate ->
lxu_cache_lookup``), the bookkeeping lives on the device and a plan is a fixed sequence of
tensor ops whose shapes depend only on the number of ids (``fixed_shape.py``). The
training thread enqueues them and moves on; nothing here reads device memory on the host
(``tests/test_device_store.py`` runs it on fake CUDA tensors under ``sync_detector``).

Layout. Slots ``trash + j = num_slots + j`` and rows ``sentinel + j = num_rows + j``
(``j < SPREAD``, ``fixed_shape.py``) are extra entries of every per-slot and per-row array:
padding entry ``i`` of a plan maps to the pair ``j = i % SPREAD``, so every scatter runs at
full length with no mask, and no single address absorbs the padding (at 2M Zipf ids,
~1.5M padding entries would otherwise contend for one slot: on a GPU, atomics on one
address, or one row rewritten by every padding thread). The pairs are bound to each other
forever and never evicted; the cache has ``num_slots + SPREAD`` rows for the same reason.

What the host still decides, without reading the device:

* *Does a prefetch surely fit?* ``pinned_bound`` adds up, over the batches in flight, the
  number of their rows the host knows (a batch's id count until its plan's sizes reach the
  host, then its exact number of unique rows). If that bound plus the new
  batch's id count exceeds the evictable slots, the prefetch waits (``CacheCapacityError``,
  as on the host planner); otherwise every miss is guaranteed a victim.
* *Overflow* (one batch larger than what the cache can give it) is planned only at a
  batch's own lookup, which is on the critical path anyway; that path reads the plan's
  sizes on the host (a synchronisation, counted in ``stats.host_syncs``).

Victims: sampled LRU (LFU: frequency, then recency) in a window of ``pinned_bound + n``
slots that a clock hand moves ``n`` slots per plan (``_window``), pinned and permanent slots
ranked last. Why a window and not exact LRU or FBGEMM's sets: an exact LRU sorts every slot
on every plan (O(cache): several ms per group per step at 50M slots), where the window's
size is known on the host, follows the ids in flight and never the cache, and still
guarantees a victim for every miss of a batch that ``surely_fits`` (so no host read decides
anything). FBGEMM's set-associative cache (32 ways, a row hashed to its set) is also O(ids)
but can run out of ways in one set while the cache has room; it needs no host read for
that - its forward kernel reads such a miss straight from host memory
(``kCacheLocationMissing``) and its backward updates it there - but a row then trains in
host memory or in the cache depending on its set's occupancy. Here a batch that surely fits
never overflows, and a miss that found no victim (the host's bound short, which it is not
meant to be) is counted in ``unplaced`` and takes a trash slot, never slot -1. The host planner (``SlotRanking``)
samples the same way. Which slot a row gets never changes the math, only the hit rate:
results stay bit-identical across cache sizes (``tests/test_device_store.py``), and the
costs per step are the same at 1M and 10M slots (``tests/test_device_cost.py``). A plan's
moves need no sizes on the host (``enqueue_moves``, ``row_moves.py``); its sizes (unique
rows, fills, write-backs) reach the host from a copy queued behind those moves, read when
it has landed (``FetchPlan.poll_sizes``), so waiting for them costs nobody.

Launches. The plan proper (``_plan_body``, the kernel's id mapping included) is about 115
fixed-shape ATen ops; eagerly each would be a kernel launch, ~1 ms of host time per group
per step. On a GPU it runs as one CUDA graph per batch shape (``plan_graphs.py``): a step
stages its ids and offsets, replays the graph and copies its outputs out, about 9 launches
per group per step with the lookup recipe, the same at 1M and 10M slots
(``tests/test_device_cost.py`` counts them on fake CUDA tensors; ``benchmarks/gpu_check.py``
reports ``plan_launches_per_group_step``). FBGEMM's cache path launches about 10 kernels
written for it. For that, ids are padded to a bucket (``plan.n`` entries, ``PAD_ID`` =
no id) and the body changes no Python state (the LRU clock and the window's hand live on
the device); off the GPU every plan is checked to repeat its shape's first one exactly
(``plan_graphs.ReplayCheck``), which is what makes a replay correct. The plan also cuts
the backward's gradient sums (``fixed_shape.segment_cuts``: they depend on the ids alone),
so the update is 15-28 launches by optimizer, with no sort.

Per-table budgets. ``TieredTable``'s ``segment_slots`` (a group's slots partitioned among
its tables) are refused here, in one line: the window and ``pinned_bound`` above cover one
slot range. A group planned on the device shares one cache among its tables.

Bookkeeping is owned by the stream that looks up and updates (the compute stream); on a
GPU the steady-state plans run on the planner's own stream, ordered against it by events
(``plan_stream.py``), so a plan's sorts overlap the forward and backward queued before it.
See ``fetch/cuda.py`` for how bytes move between the host tier and the cache.
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, Iterator, List, Optional, Tuple

import torch

from .async_count import AsyncCount
from .errors import CacheCapacityError, StoreStateError
from .eviction import EvictionPolicy
from .fixed_shape import SPREAD, SegmentCuts, compact, padded_unique, segment_cuts, spread
from .invariants import map_problems
from .plan import FetchPlan, PlanTable
from .plan_graphs import PAD_ID, PlanGraphs, bucket
from .plan_stream import StreamOps


_NEVER = torch.iinfo(torch.int64).max


@dataclass(frozen=True)
class RowMapping:
    """How a plan turns its ids into store rows, inside the plan (so that the mapping is
    part of its graph): ``rows(ids, offsets)`` (ids equal to ``PAD_ID`` may map anywhere:
    they are no id), with this batch's ``offsets``. ``key`` names whatever else the
    mapping's shapes and arguments depend on (the batch's stride, the kernel)."""

    rows: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    offsets: torch.Tensor
    key: Hashable


class DevicePlanner:
    """Plans a :class:`TieredTable`'s batches on its device: ``TieredTable(planner="device")``,
    and what the sharder's ``planner="auto"`` picks on CUDA. Runs on CPU too (bit-identical to
    the host planner), which is how it is tested without a GPU.

    Keeps the bookkeeping in device tensors (``d_row_to_slot``, ``d_slot_to_row``,
    ``d_pins``, ...) and plans with fixed-shape ops, so the training thread never reads the
    device. What differs for a user, against the host planner:

    * ids outside the table are not refused at plan time (that would be a host read): they
      are counted in ``bad_ids`` (an ``AsyncCount``: ``bad_ids.poll()``), read from a
      scratch slot (its value is meaningless: earlier bad ids' updates land there) and
      train no real row; the TorchRec kernel raises for them at its next batch, a store
      driven directly must poll. Skipped non-finite updates are counted in
      ``skipped_updates`` likewise;
    * a prefetch waits (``CacheCapacityError``) unless it *surely* fits: the host bounds
      the slots a batch pins by its id count until its sizes come back, so a deep prefetch
      needs more slots than on the host planner (``surely_fits``, ``pinned_bound``);
    * overflow (``overflow=True``) reads the plan's sizes on the host (``host_syncs``).

    A plan's lists have the batch's padded id count ``n`` as their length (padding entry
    ``i``: sentinel row and trash slot ``i % SPREAD``); its sizes stay on the device
    (``FetchPlan.counts``) until a copy behind its moves brings them to the host.

    Invariants (``check_invariants``, which reads the device and is for tests):
    ``d_row_to_slot``/``d_slot_to_row`` inverse on occupied slots; the trash slots and the
    sentinel rows bound to each other; pins never negative, zero when drained.
    """

    on_device = True

    def __init__(self, table: PlanTable) -> None:
        self._table = weakref.ref(table)  # (the table owns its planner: no reference cycle)
        self.name, self.device = table.name, table.device
        S, R, dev = table.num_slots, table.num_rows, table.device
        self.num_slots, self.num_rows, self.holds_every_row = S, R, table.holds_every_row
        self._hot_rows = table.hot_rows
        self._num_permanent = 0 if self._hot_rows is None else int(self._hot_rows.numel())
        self.preload_pending = True  # (as the host planner's)
        # Per plan in flight (keyed by its ticket, ``FetchPlan.bound_key``: a number never
        # reused, where an ``id`` of a plan dropped unreleased could be): the rows the host
        # counts it as pinning. A plan dropped unreleased keeps its entry - its pins stay too.
        self._bounds: Dict[int, int] = {}
        self._unsized: set = set()  # keys of the plans in flight still counted at their id count
        self._next_key = 0
        self.host_syncs = 0  # overflow plans read their sizes on the host
        # How often the rare paths run, and what the host's bound stood on (issue 44, item 4):
        self.overflow_plans = 0  # plans with overflow (each one host read: ``host_syncs``)
        self.preload_plans = 0  # plans carrying the preload (eager, after a reset)
        self.deferrals = 0  # prefetches refused until earlier batches are released
        self.unsized_in_flight_max = 0  # plans in flight counted at their id count at a plan
        # Checks that run on the device count here; the host learns of them without a wait
        # (a step or so late) and reports them: updates skipped for non-finite gradients,
        # and ids outside the row space (planned as the sentinel row, never looked up).
        self.skipped_updates = AsyncCount(dev)
        self.bad_ids = AsyncCount(dev)
        # Misses that found no victim in a plan without overflow: impossible while the host's
        # bound holds (``_window``); were it ever short, each is counted here and planned as
        # a trash pair (never slot -1, an out-of-bounds read on a GPU), and the TorchRec
        # kernel raises at its next batch.
        self.unplaced = AsyncCount(dev)
        self.owner_stream: Optional[object] = None  # see check_owner
        self.trash, self.sentinel = S, R
        # Row -> slot has an entry per store row (the largest map): int32 whenever slot ids
        # fit, half the device memory of int64 (FBGEMM's cache maps are int32 too).
        slot_dtype = torch.int32 if S + SPREAD < 2**31 else torch.int64
        self.d_row_to_slot = torch.full((R + SPREAD,), -1, dtype=slot_dtype, device=dev)
        self.d_slot_to_row = torch.full((S + SPREAD,), -1, dtype=torch.int64, device=dev)
        self.d_pins = torch.zeros(S + SPREAD, dtype=torch.int64, device=dev)
        self.d_dirty = torch.zeros(S + SPREAD, dtype=torch.bool, device=dev)
        self.d_blocked = torch.zeros(S + SPREAD, dtype=torch.bool, device=dev)  # permanent, and trash
        self.d_last_used = torch.zeros(S + SPREAD, dtype=torch.int64, device=dev)
        self.d_row_freq = (torch.zeros(R + SPREAD, dtype=torch.int32, device=dev)  # (as the host planner's)
                           if table.policy is EvictionPolicy.LFU else None)
        # The LRU clock and where the next plan's victim window starts (see _window): device
        # scalars, so that a plan's kernels take the same arguments every step (plan_graphs).
        self.d_tick = torch.zeros((), dtype=torch.int64, device=dev)
        self.d_hand = torch.zeros((), dtype=torch.int64, device=dev)
        self.graphs = PlanGraphs(dev)
        self._spread_buffer = torch.empty(0, dtype=torch.int64, device=dev)
        self._pad_buffers = (self._spread_buffer, self._spread_buffer)
        self._ones_buffer = torch.empty(0, dtype=torch.int64, device=dev)
        #: Whether plans carry the backward's cuts (``FetchPlan.grad_cuts``): on GPUs, where
        #: row gradients are summed in segments; the CPU sums them with ``index_add_``
        #: (deterministic there, and cheaper). Tests set it to run the GPU's sums on a CPU.
        self.plans_grad_cuts = dev.type == "cuda"
        #: Whether a plan's update covers its unique rows only once the host knows their
        #: number (``lookup.update_length``); off, every update covers the padded length
        #: (the same bits: tests compare the two).
        self.narrow_updates = True
        self.updates_unique = 0  # updates that covered their unique rows (the sizes had landed)
        self.updates_padded = 0  # updates that covered the padded length (they had not)
        # Plans run on the planner's own stream on a GPU, ordered by events (plan_stream.py).
        self.streams: Optional[StreamOps] = StreamOps() if dev.type == "cuda" and torch.cuda.is_available() else None
        self._plan_stream: Any = None
        self._last_planned: Any = None  # the event after the last plan on that stream
        self._bind_trash()

    @property
    def table(self) -> PlanTable:
        return self._table()  # type: ignore[return-value]

    @property
    def cache_rows(self) -> int:
        """Rows the cache tensors need: a slot each, and SPREAD trash slots (so that padded
        scatters need no mask)."""
        return self.num_slots + SPREAD

    def _bind_trash(self) -> None:
        # (narrow + copy_/fill_, not item assignment: see sync_detector on fake CUDA tensors)
        j = torch.arange(SPREAD, dtype=torch.int64, device=self.device)
        rows, slots = j + self.sentinel, j + self.trash
        self.d_row_to_slot.index_copy_(0, rows, slots.to(self.d_row_to_slot.dtype))
        self.d_slot_to_row.index_copy_(0, slots, rows)
        self.d_blocked.narrow(0, self.trash, SPREAD).fill_(True)
        self.d_dirty.narrow(0, self.trash, SPREAD).fill_(False)

    def _pads(self, n: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``spread = arange(n) % SPREAD`` and the padding pairs ``sentinel + spread`` (rows),
        ``trash + spread`` (slots) on the device, kept (grown when a batch is longer, narrowed
        otherwise): padding entry ``i`` of a plan is sentinel row ``sentinel + spread[i]``,
        read from and written to trash slot ``trash + spread[i]``."""
        if self._spread_buffer.shape[0] < n:
            size = max(n, 2 * self._spread_buffer.shape[0])
            self._spread_buffer = spread(size, self.device)
            self._pad_buffers = (self._spread_buffer + self.sentinel, self._spread_buffer + self.trash)
        return (self._spread_buffer.narrow(0, 0, n), self._pad_buffers[0].narrow(0, 0, n),
                self._pad_buffers[1].narrow(0, 0, n))

    # ------------------------------------------------------------------ the planning stream
    @contextlib.contextmanager
    def _plan_stream_scope(self, join: bool) -> Iterator[Any]:
        """Runs the block on the planning stream (``join``: after everything the owner
        stream queued so far); yields the owner stream; records ``_last_planned`` after."""
        ops = self.streams
        assert ops is not None
        owner = ops.current(self.device)
        if self._plan_stream is None:
            self._plan_stream = ops.new(self.device)
        if join:
            ops.wait_stream(self._plan_stream, owner)
        with ops.use(self._plan_stream):
            yield owner
        self._last_planned = ops.record(self._plan_stream)

    @contextlib.contextmanager
    def on_plan_stream(self, plan: FetchPlan) -> Iterator[Callable[..., None]]:
        """Runs the block (the batch's lookup recipe, made from the plan's outputs) on the
        stream that made ``plan``, after it; yields ``hand_over(*tensors)``, which hands the
        block's outputs to the owner stream. The plan's event then covers the block too.
        Off the planning stream (CPU, fake tensors, eager plans) it runs in place."""
        if plan.planned_event is None or self.streams is None:
            yield lambda *tensors: None
            return
        ops = self.streams
        with self._plan_stream_scope(join=False) as owner:
            yield lambda *tensors: [ops.hand_over(t, owner) for t in tensors if t is not None]
        plan.planned_event = self._last_planned

    def after_planning(self, plan: Optional[FetchPlan] = None) -> None:
        """The current stream waits (on the GPU, not the host) for ``plan`` on the planning
        stream, or for every plan made there: before it reads or writes what they did."""
        if self.streams is None or self._last_planned is None:
            return
        event = self._last_planned if plan is None else plan.planned_event
        if event is not None:
            self.streams.wait_event(self.streams.current(self.device), event)

    def check_owner(self, claim: bool = True) -> None:
        """One stream owns the cache and its bookkeeping: the one current at the first plan.
        Planning, lookups, updates, releases, rollbacks, flushes, refreshes and
        invalidations on another stream would race with it (its kernels are ordered only
        within their stream), so they are refused. A host-side check. ``claim``: the first
        caller becomes the owner (planning and updates); the others only check an owner."""
        if self.device.type != "cuda" or not torch.cuda.is_available():
            return
        stream = torch.cuda.current_stream(self.device)
        if self.owner_stream is None:
            if claim:
                self.owner_stream = stream
        elif stream != self.owner_stream:
            raise StoreStateError(
                f"table '{self.name}': planned on CUDA stream {stream} but its cache belongs to stream "
                f"{self.owner_stream} (the stream of its first batch); plan, look up and update a proactive "
                f"table on one stream (TrainPipelineSemiSync and PrefetchTrainPipelineSparseDist use side streams)"
            )

    # ------------------------------------------------------------------ planning
    @property
    def pinned_bound(self) -> int:
        """An upper bound on the slots pinned by batches in flight, known on the host."""
        return sum(self._bounds.values())

    def surely_fits(self, num_ids: int) -> bool:
        """True when a batch of ``num_ids`` ids fits beside the batches in flight whatever
        its ids are (so its plan needs no overflow)."""
        return self.holds_every_row or self.pinned_bound + num_ids <= self.num_slots - self._num_permanent

    def plan_rows(self, rows: torch.Tensor, depth_hint: Optional[int], overflow: bool) -> FetchPlan:
        """``plan_ids`` of host rows (unique and sorted, as ``TieredTable.plan`` takes them)."""
        return self.plan_ids(rows.to(self.device), depth_hint, overflow)

    def plan_ids(self, ids: torch.Tensor, depth_hint: Optional[int] = None,
                 overflow: bool = False, check_ids: bool = True,
                 mapping: Optional[RowMapping] = None) -> FetchPlan:
        """Plans and pins the rows of ``ids`` (store rows on the device, any order, duplicates
        allowed; or, with ``mapping``, ids that ``mapping`` turns into store rows inside the
        plan). With ``check_ids``, ids outside the row space are counted in ``bad_ids`` and
        planned as the sentinel row (read from and updated in the trash slot, never a real
        row), so a bad id costs no host read; the caller reports ``bad_ids.poll()``.

        Without ``overflow`` raises ``CacheCapacityError`` (changing nothing) unless the batch
        surely fits (``surely_fits``). With it, misses that find no victim are served from
        the host tier (a synchronisation: this path reads the plan's sizes).

        A steady-state plan (no overflow, no preload) is one CUDA graph launch per batch
        shape on a GPU (``plan_graphs.py``); its tensors are padded to ``bucket(len(ids))``
        entries (``plan.n``), of which the first ``len(ids)`` of ``plan.inverse`` are real."""
        self.check_owner()
        num_ids = int(ids.shape[0])
        if self.surely_fits(num_ids):
            overflow = False  # nothing can overflow: plan without reading any size back
        elif not overflow:
            self.deferrals += 1
            self._raise_wait(num_ids, depth_hint)
        self.unsized_in_flight_max = max(self.unsized_in_flight_max, len(self._unsized))
        preload = self._plan_preload() if self.preload_pending else None
        tracked = not self.holds_every_row
        inputs = [ids] if mapping is None else [ids, mapping.offsets]
        # The window's size is known here (it follows the ids in flight) and rounded up to a
        # bucket too, so that steady state replays a handful of graphs; a larger window only
        # offers more victims.
        span = self.num_slots - self._num_permanent
        window = min(span, bucket(self.pinned_bound + num_ids))
        map_rows = None if mapping is None else mapping.rows
        # The gradient's cuts use the bucket's piece length on every path, so that a batch
        # planned eagerly at its own length (overflow) sums its gradients as it would have
        # padded (the cache size never changes a result).
        piece = math.isqrt(bucket(num_ids)) if self.plans_grad_cuts else None
        body = functools.partial(self._plan_body, map_rows=map_rows, window=window,
                                 check_ids=check_ids, tracked=tracked, overflow=overflow, piece=piece)
        planned_event = None
        if overflow or preload is not None:
            # Rare paths (a batch larger than the cache can give it; the first plan after a
            # reset): planned eagerly, at the batch's own length, on the owner stream (after
            # the plans on the planning stream: it changes what they read).
            self.after_planning()
            staged = [ids.to(torch.int64), *inputs[1:]]
            outs = list(body(*staged))
        else:
            key = (map_rows is not None and mapping.key, window, check_ids)  # type: ignore[union-attr]
            if self.streams is not None and self.streams.applies_to(ids):
                with self._plan_stream_scope(join=True) as owner:
                    outs = self.graphs.run(key, body, inputs, bucket(num_ids))
                planned_event = self._last_planned
                for t in outs:
                    self.streams.hand_over(t, owner)
            else:
                outs = self.graphs.run(key, body, inputs, bucket(num_ids))
        rows, inverse, slots, fill_rows, fill_slots, wb_rows, wb_slots, counts = outs[:8]
        overflow_rows = outs[8] if overflow else None
        grad_cuts = SegmentCuts(*outs[-3:], piece=piece) if piece is not None else None
        num_preloaded = 0
        if preload is not None:
            p_rows, p_slots = preload
            num_preloaded = int(p_rows.shape[0])
            fill_rows, fill_slots = torch.cat([p_rows, fill_rows]), torch.cat([p_slots, fill_slots])
            counts.narrow(0, 1, 1).add_(num_preloaded)  # (counts is this plan's own tensor)
        plan = FetchPlan(self.table, rows, slots, fill_rows, fill_slots, wb_rows, wb_slots,
                         overflow_rows=overflow_rows, counts=counts, inverse=inverse.narrow(0, 0, num_ids),
                         grad_cuts=grad_cuts, preload=preload is not None, num_preloaded=num_preloaded,
                         planned_event=planned_event)
        plan.bound_key, self._next_key = self._next_key, self._next_key + 1
        self._bounds[plan.bound_key] = num_ids if tracked else 0
        if tracked:
            self._unsized.add(plan.bound_key)
        self.preload_plans += preload is not None
        if planned_event is not None and self.streams is not None:
            # The sizes' read-back right behind the plan on its stream, not behind its moves:
            # the host's bound takes the plan's unique rows as soon as the GPU has planned it.
            with self.streams.use(self._plan_stream):
                plan.read_sizes_later()
        if overflow:
            self.overflow_plans += 1
            plan.resolve_sizes()  # (the one place a plan's sizes are read where the caller waits)
            self.host_syncs += 1
        return plan

    def _plan_body(self, ids: torch.Tensor, *extra: torch.Tensor, map_rows: Optional[Callable[..., torch.Tensor]],
                   window: int, check_ids: bool, tracked: bool, overflow: bool,
                   piece: Optional[int] = None) -> Tuple[torch.Tensor, ...]:
        """The plan proper: fixed-shape tensor ops on the store's persistent buffers, whose
        shapes and arguments depend only on ``len(ids)`` and the keyword arguments (what
        ``plan_graphs`` captures). It changes no Python state: the LRU clock and the
        window's hand are device tensors. Entries of ``ids`` equal to ``PAD_ID`` are no id.

        Returns ``rows, inverse, slots, fill_rows, fill_slots, writeback_rows,
        writeback_slots, counts`` (and ``overflow_rows`` with ``overflow``; and the
        backward's ``SegmentCuts`` of the ids' gradients, pieces of ``piece``, when given)."""
        n = int(ids.shape[0])
        S, sentinel = self.num_slots, self.sentinel
        spare = spread(n, self.device)
        pad_rows, pad_slots = spare + sentinel, spare + self.trash  # (paired: row R + j <-> slot S + j)
        no_id = ids == PAD_ID
        padding = no_id
        rows = ids if map_rows is None else map_rows(ids, *extra)
        if check_ids:
            bad = ((rows < 0) | (rows >= self.num_rows)) & no_id.logical_not()
            self.bad_ids.add(bad.sum())
            no_id = no_id | bad
        rows = rows.masked_fill(no_id, sentinel)  # (masked_fill: no device scalar to make)
        rows, inverse, _ = padded_unique(rows, pad_rows, spare)
        # The distinct real rows come first; the sentinel (no id, bad ids) and the padding
        # pairs sort after them and are not counted.
        num_unique = (rows < sentinel).sum()
        slots = self.d_row_to_slot.index_select(0, rows).to(torch.int64)
        miss = slots < 0
        if tracked:
            # Pin the hits first, so that the victim search cannot choose them.
            self.d_pins.index_add_(0, torch.where(miss, pad_slots, slots), torch.ones_like(slots))
        # Victims: the slots of this plan's window ranked (blocked last), lowest first;
        # miss j takes the j-th. Never a pass over the whole cache (see _window).
        candidates = self._window(window, n)
        w = int(candidates.shape[0])
        rank = self._rank(candidates)
        ranked = candidates.index_select(0, torch.argsort(rank, stable=True))
        num_evictable = (rank < _NEVER).sum()
        miss_rank = torch.cumsum(miss, 0) - 1
        has_victim = miss & (miss_rank < num_evictable)
        victims = torch.where(has_victim, ranked.index_select(0, miss_rank.clamp(0, w - 1)), pad_slots)
        old_rows = self.d_slot_to_row.index_select(0, victims)
        evicts = has_victim & (old_rows >= 0)
        writes_back = evicts & self.d_dirty.index_select(0, victims)
        # Bookkeeping: the evicted rows leave, the missing rows take their slots.
        # (Entries with nothing to do write their own sentinel/trash pair: spread, and the
        # pair is what the binding holds anyway.)
        r2s = self.d_row_to_slot.dtype
        self.d_row_to_slot.index_copy_(0, torch.where(evicts, old_rows, pad_rows),
                                       pad_slots.masked_fill(evicts, -1).to(r2s))
        self.d_row_to_slot.index_copy_(0, torch.where(has_victim, rows, pad_rows), victims.to(r2s))
        self.d_slot_to_row.index_copy_(0, victims, torch.where(has_victim, rows, pad_rows))
        self.d_dirty.index_fill_(0, victims, False)  # (trash is never dirty: harmless)
        if tracked:
            self.d_pins.index_add_(0, victims, has_victim.to(torch.int64))
        overflows = miss & has_victim.logical_not()
        slots = torch.where(has_victim, victims, slots)
        outs: List[torch.Tensor] = []
        if overflow:
            over_rank = torch.cumsum(overflows, 0) - 1
            slots = torch.where(overflows, S + SPREAD + over_rank, slots)
            overflow_rows, num_overflow = compact(overflows, sentinel, rows, spare=spare)
            outs.append(overflow_rows)
        else:
            # No miss lacks a victim here while the host's bound holds; by construction none
            # keeps slot -1 either way: it is counted and takes its trash pair.
            self.unplaced.add(overflows.sum())
            slots = torch.where(overflows, pad_slots, slots)
            num_overflow = torch.zeros((), dtype=torch.int64, device=self.device)
        # Recency (and frequency) of the rows read from the cache: the clock is a device
        # tensor (a Python counter would be a kernel argument, frozen into a graph).
        self.d_tick.add_(1)
        cached = torch.where(overflows, pad_slots, slots)
        self.d_last_used.index_copy_(0, cached, self.d_tick.expand(n))
        if self.d_row_freq is not None:
            self.d_row_freq.index_add_(0, torch.where(overflows, pad_rows, rows), torch.ones_like(rows, dtype=torch.int32))
        fill_rows, fill_slots, num_fills = compact(has_victim, sentinel, rows, victims, spare=spare)
        fill_slots = torch.where(fill_rows == sentinel, pad_slots, fill_slots)
        wb_rows, wb_slots, num_wb = compact(writes_back, sentinel, old_rows, victims, spare=spare)
        wb_slots = torch.where(wb_rows == sentinel, pad_slots, wb_slots)
        counts = torch.stack([num_unique, num_fills, num_wb, num_overflow])
        if piece is not None:  # (the padding has no gradient rows: left out)
            outs.extend(segment_cuts(inverse, n, skip=padding, piece=piece)[:3])
        return (rows, inverse, slots, fill_rows, fill_slots, wb_rows, wb_slots, counts, *outs)

    def _window(self, size: int, n: int) -> torch.Tensor:
        """The ``size`` slots a plan of ``n`` ids searches for victims, from a clock hand that
        moves ``n`` slots per plan (sampled LRU/LFU, as the host planner's ``SlotRanking``;
        FBGEMM's cache is set-associative for the same reason), within the evictable range
        ``[num_permanent, num_slots)``. ``size`` is at least ``pinned_bound + n`` (or the
        whole range), known on the host; it follows the ids in flight, never the cache, so a
        plan costs O(ids). The hand is a device tensor (see ``_plan_body``).

        Why it always holds a victim for every miss of a batch that ``surely_fits``: at most
        ``pinned_bound`` of its slots are pinned by other batches and at most ``n - misses``
        by this batch's own hits, so ``pinned_bound + n`` slots leave ``misses`` evictable.
        (Permanent slots are the first ``num_permanent``, outside the range.)"""
        start, span = self._num_permanent, self.num_slots - self._num_permanent
        if size <= 0 or span <= 0:  # nothing evictable: one blocked candidate (the trash slot) keeps shapes valid
            return torch.full((1,), self.trash, dtype=torch.int64, device=self.device)
        window = torch.remainder(torch.arange(size, dtype=torch.int64, device=self.device) + self.d_hand, span)
        self.d_hand.add_(n).remainder_(span)
        return window + start if start else window

    def _rank(self, slots: torch.Tensor) -> torch.Tensor:
        """Per slot of ``slots``, its eviction rank (lower goes first); pinned, permanent and
        trash slots rank ``_NEVER``. Never-used slots have ``last_used == 0`` and go first."""
        rank = self.d_last_used.index_select(0, slots)
        if self.d_row_freq is not None:
            rows = self.d_slot_to_row.index_select(0, slots)
            freq = self.d_row_freq.index_select(0, rows.clamp(min=0)).to(torch.int64)
            rank = torch.where(rows >= 0, (freq << 32) + rank, rank)
        blocked = (self.d_pins.index_select(0, slots) > 0) | self.d_blocked.index_select(0, slots)
        return rank.masked_fill(blocked, _NEVER)

    def _plan_preload(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Maps the rows resident from the start (every row of a full cache, or the hot rows);
        they move with the first plan's fills."""
        self.preload_pending = False
        dev = self.device
        if self.holds_every_row and self.num_rows:
            rows = torch.arange(self.num_rows, dtype=torch.int64, device=dev)
            self.d_slot_to_row.narrow(0, 0, self.num_rows).copy_(rows)
            self.d_row_to_slot.narrow(0, 0, self.num_rows).copy_(rows)
            return rows, rows.clone()
        if self._hot_rows is None or self._hot_rows.numel() == 0:
            empty = torch.empty(0, dtype=torch.int64, device=dev)
            return empty, empty
        hot = self._hot_rows.to(dev, non_blocking=True)
        slots = torch.arange(hot.shape[0], dtype=torch.int64, device=dev)
        self.d_slot_to_row.index_copy_(0, slots, hot)
        self.d_row_to_slot.index_copy_(0, hot, slots.to(self.d_row_to_slot.dtype))
        self.d_blocked.index_fill_(0, slots, True)
        return hot, slots

    def _raise_wait(self, n: int, depth: Optional[int]) -> None:
        free = self.num_slots - self._num_permanent
        msg = (f"table '{self.name}': a batch of {n} ids may need {n} slots and {self.table.in_flight} in-flight "
               f"batch(es) may pin up to {self.pinned_bound} more ({n + self.pinned_bound} in all), but the device "
               f"cache has {free} slots that are not permanently hot")
        if depth is not None:
            msg += f" (prefetch_depth={depth}: about {(depth + 1) * n} slots avoid waiting)"
        if self.table.in_flight:
            msg += (". Nothing changed: plan it again once earlier batches are released (their backward), "
                    "or with overflow=True at its own lookup (rows that do not fit are served from the host tier)")
        else:
            # Nothing will be released: the bound is the id count, which this batch alone exceeds.
            msg += (". Nothing changed, and with no batch in flight waiting cannot help: plan it with "
                    "overflow=True (it reads the plan's sizes on the host, one sync; rows that do not fit, if "
                    f"any, are served from the host tier), or give the table at least {n} slots")
        raise CacheCapacityError(msg)

    def sizes_known(self, plan: FetchPlan) -> None:
        """A plan's sizes reached the host: it pins its unique rows, no longer its id count."""
        self._unsized.discard(plan.bound_key)
        if plan.bound_key in self._bounds and not plan.released:
            self._bounds[plan.bound_key] = plan.sizes[0] if not self.holds_every_row else 0  # type: ignore[index]

    def replan(self, plan: FetchPlan, row_grads: torch.Tensor) -> Tuple[FetchPlan, torch.Tensor]:
        """The plan's rows (padding included: sentinel rows, zero gradients) planned again with
        overflow allowed (see ``TieredTable.apply_gradients``); the gradients follow each row
        to its place in the new plan. A slow path (the overflow plan reads its sizes)."""
        again = self.plan_ids(plan.rows, None, overflow=True, check_ids=False)
        # Row i of the old plan is row inverse[i] of the new one (real rows are unique; the
        # padding's sentinel rows share one entry and carry zero gradients).
        moved = torch.zeros((again.n, row_grads.shape[1]), dtype=row_grads.dtype, device=row_grads.device)
        moved.index_add_(0, again.inverse, row_grads)  # type: ignore[arg-type]
        return again, moved

    # ------------------------------------------------------------------ after a plan
    def rollback(self, plan: FetchPlan) -> None:
        """Undoes the bookkeeping of a plan whose moves did not all happen (see
        ``TieredTable.rollback``); fixed-shape, on the device."""
        self.check_owner(claim=False)
        self.after_planning()
        sentinel = self.sentinel
        _, pad_rows, pad_slots = self._pads(int(plan.fill_rows.shape[0]))
        filled = plan.fill_rows < sentinel
        mapped = filled & (self.d_row_to_slot.index_select(0, plan.fill_rows) == plan.fill_slots)
        self.d_row_to_slot.index_copy_(0, torch.where(mapped, plan.fill_rows, pad_rows),
                                       torch.where(mapped, -1, pad_slots).to(self.d_row_to_slot.dtype))
        gone = torch.where(mapped, plan.fill_slots, pad_slots)
        self.d_slot_to_row.index_copy_(0, gone, torch.where(mapped, -1, pad_rows))
        self.d_blocked.index_fill_(0, gone, False)
        self._bind_trash()
        if plan.stage == "planned":
            _, pad_rows, pad_slots = self._pads(int(plan.writeback_rows.shape[0]))
            wb = plan.writeback_rows < sentinel
            wb_rows = torch.where(wb, plan.writeback_rows, pad_rows)
            wb_slots = torch.where(wb, plan.writeback_slots, pad_slots)
            self.d_slot_to_row.index_copy_(0, wb_slots, wb_rows)
            self.d_row_to_slot.index_copy_(0, wb_rows, wb_slots.to(self.d_row_to_slot.dtype))
            self.d_dirty.index_fill_(0, wb_slots, True)
            self._bind_trash()
        if plan.preload:
            self.preload_pending = True

    def unpin(self, plan: FetchPlan) -> None:
        """Unpins the plan's slots (fixed-shape, on the device)."""
        self.check_owner(claim=False)
        self.after_planning(plan)
        self._bounds.pop(plan.bound_key, None)
        self._unsized.discard(plan.bound_key)
        if not self.holds_every_row:
            self.d_pins.index_add_(0, self._cached_slots(plan), self._ones(plan.n), alpha=-1)

    def _cached_slots(self, plan: FetchPlan) -> torch.Tensor:
        """The plan's slots with its overflow entries (slots past the cache) sent to the
        trash pairs; without overflow the slots themselves (padding is in the trash already)."""
        if plan.overflow_rows is None:
            return plan.slots
        return torch.where(plan.slots < self.num_slots, plan.slots, self._pads(plan.n)[2])

    def _ones(self, n: int) -> torch.Tensor:
        """``n`` int64 ones, a view of a buffer kept for it (no fill per call)."""
        if self._ones_buffer.shape[0] < n:
            self._ones_buffer = torch.ones(max(n, 2 * int(self._ones_buffer.shape[0])), dtype=torch.int64,
                                           device=self.device)
        return self._ones_buffer.narrow(0, 0, n)

    def split_overflow(self, plan: FetchPlan, row_grads: torch.Tensor) -> Tuple[
            torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(slots, grads, rows)`` for the cache's update of the plan's first ``m =
        len(row_grads)`` rows (all ``n``, or its unique rows, which come first: see
        ``lookup.update_length``), its overflow entries sent to the trash with zero
        gradients, so the update has the shape it has without overflow (the cache size never
        changes a result); and ``(rows, grads)`` of the overflow rows, in their order (None
        without overflow)."""
        m = int(row_grads.shape[0])
        slots, rows = plan.slots.narrow(0, 0, m), plan.rows.narrow(0, 0, m)
        if plan.overflow_rows is None or plan.num_overflow == 0:
            return slots, row_grads, rows, None, None
        in_cache = slots < plan.overflow_base
        cached = torch.where(in_cache, slots, self._pads(m)[2])
        over = plan.overflow_rows.narrow(0, 0, plan.num_overflow)
        ranks = (slots - plan.overflow_base).clamp(min=0)
        order = torch.argsort(torch.where(in_cache, m, ranks), stable=True).narrow(0, 0, plan.num_overflow)
        return cached, row_grads * in_cache.unsqueeze(1), rows, over, row_grads.index_select(0, order)

    def trash_slots(self, n: int) -> torch.Tensor:
        """Where entries of a skipped update are written (the padding pairs' trash slots)."""
        return self._pads(n)[2]

    def mark_dirty(self, plan: FetchPlan) -> None:
        self.d_dirty.index_fill_(0, self._cached_slots(plan), True)
        self.d_dirty.narrow(0, self.trash, SPREAD).fill_(False)

    def note_update(self, ok: torch.Tensor) -> None:
        """Counts, on the device, an update skipped because ``ok`` (0-d bool) is False."""
        self.skipped_updates.add(ok.logical_not())

    def poll_skipped(self) -> int:
        """Updates skipped for non-finite gradients that the host learnt of since the last call
        (never waits: see ``AsyncCount``)."""
        return self.skipped_updates.poll()

    # ------------------------------------------------------------------ the whole cache
    def flush_plans(self, chunk: int) -> List[FetchPlan]:
        """Write-back plans of every dirty slot, ``chunk`` slots each (bounded staging), that
        leave those slots clean. Fixed-shape: a chunk with nothing dirty moves nothing."""
        return self._whole_cache_plans(chunk, fills=False)

    def refresh_plans(self, chunk: int) -> List[FetchPlan]:
        """Fills of every occupied slot from the host tier, ``chunk`` slots per plan; every
        slot clean afterwards."""
        return self._whole_cache_plans(chunk, fills=True)

    def _whole_cache_plans(self, chunk: int, fills: bool) -> List[FetchPlan]:
        self.check_owner(claim=False)
        self.after_planning()
        plans = []
        dev, sentinel, trash = self.device, self.sentinel, self.trash
        for start in range(0, self.num_slots, chunk):
            size = min(chunk, self.num_slots - start)
            slots = torch.arange(start, start + size, dtype=torch.int64, device=dev)
            rows = self.d_slot_to_row.narrow(0, start, size)
            moves = rows >= 0 if fills else self.d_dirty.narrow(0, start, size).clone()
            moved_rows, moved_slots, num = compact(moves, sentinel, rows, slots)
            moved = (moved_rows, torch.where(moved_rows == sentinel, trash, moved_slots))
            self.d_dirty.narrow(0, start, size).fill_(False)
            none = (torch.full((size,), sentinel, dtype=torch.int64, device=dev),
                    torch.full((size,), trash, dtype=torch.int64, device=dev))
            zero = torch.zeros((), dtype=torch.int64, device=dev)
            fill, write_back = (moved, none) if fills else (none, moved)
            counts = torch.stack([zero, num, zero, zero] if fills else [zero, zero, num, zero])
            plans.append(FetchPlan(self.table, none[0], none[1], *fill, *write_back, counts=counts, released=True))
        return plans

    def clear(self) -> None:
        """Drops every cached row (see ``TieredTable.invalidate``)."""
        self.check_owner(claim=False)
        self.after_planning()
        self.d_row_to_slot.fill_(-1)
        self.d_slot_to_row.fill_(-1)
        self.d_dirty.fill_(False)
        self.d_blocked.fill_(False)
        self._bind_trash()
        self.preload_pending = True

    # ------------------------------------------------------------------ reading the state
    def has_dirty(self) -> bool:
        """Whether a flush is needed (a host read: for state_dict time, not the step)."""
        self.after_planning()
        return bool(self.d_dirty.any())

    def pinned_slots(self) -> int:
        """Slots pinned now (a host read of the device: for messages on the overflow path,
        which reads the device anyway)."""
        self.after_planning()
        if self.holds_every_row:
            return 0
        return int((self.d_pins.narrow(0, 0, self.num_slots) > 0).sum())

    def pinned_in(self, lo: int, hi: int) -> int:
        self.after_planning()
        return int((self.d_pins.narrow(0, lo, hi - lo) > 0).sum())

    def resident_rows(self) -> torch.Tensor:
        self.after_planning()
        s2r = self.d_slot_to_row.narrow(0, 0, self.num_slots).cpu()
        return s2r[s2r >= 0]

    def resident(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Occupied slots, their rows and their dirty flags, read to the host (a sync: for
        a write by the host tier's owner, not the step)."""
        self.after_planning()
        s2r = self.d_slot_to_row.narrow(0, 0, self.num_slots).cpu()
        slots = torch.nonzero((s2r >= 0) & (s2r < self.num_rows)).flatten()
        return slots, s2r[slots], self.d_dirty.narrow(0, 0, self.num_slots).cpu()[slots]

    def bookkeeping_bytes(self) -> int:
        tensors = [self.d_row_to_slot, self.d_slot_to_row, self.d_pins, self.d_dirty, self.d_blocked, self.d_last_used]
        if self.d_row_freq is not None:
            tensors.append(self.d_row_freq)
        return sum(t.numel() * t.element_size() for t in tensors)

    def check_invariants(self, expect_drained: bool = False) -> List[str]:
        """The breaches found (empty: none). Reads the device (tests and debug checks only)."""
        self.after_planning()
        s2r = self.d_slot_to_row.cpu()
        r2s = self.d_row_to_slot.cpu().to(torch.int64)
        S, R = self.num_slots, self.num_rows
        j = torch.arange(SPREAD)
        problems = map_problems(s2r[:S], r2s[:R], self.d_pins.narrow(0, 0, S).cpu(), self.d_dirty.narrow(0, 0, S).cpu(),
                                expect_drained)
        if not (torch.equal(s2r[self.trash:], j + self.sentinel) and torch.equal(r2s[self.sentinel:], j + self.trash)):
            problems.insert(0, "the trash slots and the sentinel rows came apart")
        return problems
