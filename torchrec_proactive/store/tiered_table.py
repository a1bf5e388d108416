"""One embedding table (or one local shard of it) split across a host tier and a device cache.

Data path, top to bottom:

1. ``plan(rows)``      - which of the batch's unique rows hit, which miss, which slots the
                         misses evict (and which of those are dirty and must be written back).
                         Pins every slot the batch will read. Pure bookkeeping on the host.
2. ``transfer(plan)``  - moves the data the plan asks for: write back dirty victims to the host
                         tier, then copy the missing rows (and their optimizer state) into their
                         slots. The fetch engine runs this asynchronously, in ticket order.
3. ``lookup(...)``     - pooled bags read through ``row -> slot`` (``pooled_lookup`` in lookup.py).
4. ``apply_gradients`` - the fused optimizer updates the slots in backward, marks them dirty,
                         and releases the batch's pins.
5. ``plan_flush()``    - a write-back of every dirty slot, so the host tier equals a resident table.

Every byte moved between the tiers (fills, write-backs, the preload folded into the first
plan, flushes) is described by a ``FetchPlan`` and moved by ``transfer`` when the fetch engine
runs its ticket: the engine is the one owner of the order of data moves. A failed move is
undone with ``rollback``.

Invariants (checked by ``check_invariants``):

* ``row_to_slot`` and ``slot_to_row`` are inverse on occupied slots.
* A pinned slot (referenced by an issued batch that has not applied its update) is never
  chosen as a victim; pins return to 0 when every batch has been released.
* A dirty row evicted to the host is written back before any later fetch reads it: both are
  data moves of tickets, and tickets execute in issue order.
* Rows of a planned batch are resident from the end of its transfer until its release.
* With per-table budgets (``segment_slots``), every cached row is in its own table's slot
  range, so no table holds more rows than its budget.

Nothing here imports TorchRec; the host tier may be a view of someone else's storage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .errors import CacheCapacityError, IdOutOfRangeError, InvalidInputError, StoreStateError
from .eviction import EvictionPolicy, SlotRanking
from .optimizers import OptimizerConfig, update_rows


@dataclass
class FetchPlan:
    """What one batch needs from one table. Produced by ``TieredTable.plan``.

    ``rows`` are the batch's unique rows (sorted) and ``slots[i]`` holds ``rows[i]`` once the
    transfer is done. ``fill_*`` are the misses, ``writeback_*`` the dirty victims.
    """

    table: "TieredTable"
    rows: torch.Tensor
    slots: torch.Tensor
    fill_rows: torch.Tensor
    fill_slots: torch.Tensor
    writeback_rows: torch.Tensor
    writeback_slots: torch.Tensor
    released: bool = False
    # Rows that did not fit in the cache (only when planned with ``overflow=True``): they are
    # read from and updated in the host tier. ``slots`` gives them ids past the cache
    # (``num_slots + j`` for ``overflow_rows[j]``) so one lookup serves both kinds.
    overflow_rows: Optional[torch.Tensor] = None
    preload: bool = False  # the fills include the rows resident from the start
    # The table's step counter as this batch's forward advanced it (0: no forward counted it,
    # the update then advances the counter itself). See ``TieredTable.count_forward``.
    optimizer_step: int = 0
    num_preloaded: int = 0  # how many of the fills those are
    # How far the data moves got: "planned" -> "written_back" -> "done". Set by whoever
    # moves the bytes (a transport); read by ``TieredTable.rollback`` after a failure.
    stage: str = "planned"
    # Sizes as plain ints (the hot path reads them; tensor .numel() calls add up).
    num_rows: int = -1
    num_fills: int = -1
    num_writebacks: int = -1
    _device_slots: Optional[torch.Tensor] = field(default=None, repr=False)
    _overflow_weight: Optional[torch.Tensor] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.num_rows < 0:
            self.num_rows = int(self.rows.numel())
            self.num_fills = int(self.fill_rows.numel())
            self.num_writebacks = int(self.writeback_rows.numel())

    def device_slots(self) -> torch.Tensor:
        """``slots`` on the cache's device (copied once per plan)."""
        if self._device_slots is None:
            self._device_slots = self.slots.to(self.table.device)
        return self._device_slots

    @property
    def num_overflow(self) -> int:
        return 0 if self.overflow_rows is None else int(self.overflow_rows.numel())

    @property
    def cache_slots(self) -> torch.Tensor:
        """The slots this plan pins (``slots`` without the overflow ids)."""
        if not self.num_overflow:
            return self.slots
        return self.slots[self.slots < self.table.num_slots]

    def lookup_weight(self) -> torch.Tensor:
        """What ``slots`` below ``overflow_base`` index: the cache."""
        return self.table.cache_weight

    @property
    def overflow_base(self) -> int:
        """Slot ids from here on name overflow rows: ``overflow_base + j`` is ``overflow_rows[j]``."""
        return self.table.num_slots

    @property
    def overflow_weight(self) -> Optional[torch.Tensor]:
        """The overflow rows' weights on the cache's device, read from the host tier at the
        first call (nobody else holds those rows: see ``TieredTable.plan``); the batch's own
        rows only, never a copy of the cache."""
        if not self.num_overflow:
            return None
        if self._overflow_weight is None:
            self._overflow_weight = self.table.host_weight.index_select(0, self.overflow_rows).to(self.table.device)
        return self._overflow_weight

    @property
    def num_hits(self) -> int:
        """The batch's rows already in the cache (preloaded rows count as hits: they are
        moved, but not because this batch missed them)."""
        return self.num_rows - (self.num_fills - self.num_preloaded) - self.num_overflow

    @property
    def bytes_to_move(self) -> int:
        return self.table.row_bytes * (self.num_fills + self.num_writebacks)


@dataclass
class TableStats:
    """Running counters of one table; plain ints so reading them costs nothing."""

    lookups_rows: int = 0  # unique rows asked for, summed over batches
    hits: int = 0
    rows_fetched: int = 0
    rows_written_back: int = 0
    bytes_moved: int = 0
    updates: int = 0
    overflow_rows: int = 0  # rows served from the host tier because the cache was full
    # Updates whose plan's pins had ended before their backward came (see ``apply_gradients``).
    late_updates: int = 0
    # In-place writes of the host tier by its owner seen by ``external_writes``.
    external_writes: int = 0

    def hit_rate(self) -> float:
        return self.hits / self.lookups_rows if self.lookups_rows else 1.0

    def as_dict(self) -> Dict[str, float]:
        d = dict(self.__dict__)
        d["hit_rate"] = self.hit_rate()
        return d


@dataclass(frozen=True)
class Segment:
    """One table's rows inside a store's linearized row space (FBGEMM-style: a store serving
    several tables numbers their rows ``start .. start + num_rows``). ``shard_row_offset`` and
    ``global_rows`` place a shard in the user's global table; they only shape messages."""

    name: str
    start: int
    num_rows: int
    shard_row_offset: int = 0
    global_rows: Optional[int] = None

    def describe_bad_id(self, local: int) -> str:
        if self.global_rows is not None and (self.shard_row_offset or self.global_rows != self.num_rows):
            return (
                f"table '{self.name}': id {local + self.shard_row_offset} is out of range [0, {self.global_rows}) "
                f"(local id {local} in the shard of rows [{self.shard_row_offset}, "
                f"{self.shard_row_offset + self.num_rows}))"
            )
        return f"table '{self.name}': id {local} is out of range [0, {self.num_rows})"


class TieredTable:
    """A table whose rows live in ``host_weight`` and are served from a ``num_slots`` cache.

    Args:
        name: table name used in every message.
        host_weight: ``[num_rows, dim]`` host tier (kept by reference, never reallocated).
        optimizer: fused optimizer applied to cached rows in backward.
        num_slots: cache size in rows (``1 <= num_slots``; more than ``num_rows`` is clamped).
        device: where the cache lives (``cpu`` or ``cuda``).
        policy: eviction policy for unpinned slots.
        hot_rows: rows loaded at start and never evicted (e.g. from a hotness profile).
        host_state: optimizer state host tensors (allocated zeroed when not given).
        row_offset / global_rows: position of this shard in the global table (messages).
        segments: the tables whose rows make up the store's row space, in order (a store
            per TorchRec group serves all its tables); default: one table, ``name``.
        segment_slots: per segment, its slot budget (each clamped to its rows; they sum to
            ``num_slots``). The slots are then partitioned: segment i owns a contiguous
            slot range (``segment_slot_ranges``), its rows live only there and its victims
            come only from there, so a table never caches more rows than its budget (a
            TorchRec group keeps one store, one plan and one lookup while the cache planner
            sizes each table). A batch whose misses do not fit in one segment's range is
            refused (``CacheCapacityError`` naming that table) or overflows, as a batch
            that does not fit an unpartitioned store. Default None: one cache shared by
            every segment, as if the store were one table.
    """

    def __init__(
        self,
        name: str,
        host_weight: torch.Tensor,
        optimizer: OptimizerConfig,
        num_slots: int,
        device: torch.device | str = "cpu",
        policy: EvictionPolicy | str = EvictionPolicy.LRU,
        hot_rows: Optional[torch.Tensor] = None,
        host_state: Optional[Dict[str, torch.Tensor]] = None,
        row_offset: int = 0,
        global_rows: Optional[int] = None,
        segments: Optional[Sequence[Segment]] = None,
        segment_slots: Optional[Sequence[int]] = None,
    ) -> None:
        if host_weight.dim() != 2:
            raise InvalidInputError(
                f"table '{name}': host weight must be 2-D [rows, dim], got shape {tuple(host_weight.shape)}"
            )
        if not host_weight.is_floating_point():
            raise InvalidInputError(f"table '{name}': host weight must be floating point, got {host_weight.dtype}")
        if num_slots < 1:
            raise CacheCapacityError(f"table '{name}': cache needs at least 1 slot, got num_slots={num_slots}")
        self.name = name
        self.device = torch.device(device)
        self.optimizer = optimizer
        self.num_rows, self.dim = int(host_weight.shape[0]), int(host_weight.shape[1])
        self.num_slots = max(1, min(int(num_slots), self.num_rows)) if self.num_rows else 1
        self.holds_every_row = self.num_slots >= self.num_rows
        # The host tier is shared with its owner (TorchRec's state-dict tensors are views of
        # it), who may write it in place. The store reads and writes it only through
        # aliases with a version counter of their own (``Tensor.data``: same bytes, separate
        # counter), so the counter of the tensors it was given counts the owner's in-place
        # writes and nothing else: ``external_writes`` compares it, one integer per tensor.
        self.exposed_weight = host_weight
        self.host_weight = host_weight.data
        self.exposed_state: Dict[str, torch.Tensor] = {}
        self.host_state: Dict[str, torch.Tensor] = {}
        for key, shape in optimizer.state_shapes(self.dim).items():
            given = (host_state or {}).get(key)
            want = (self.num_rows, *shape)
            if given is not None and tuple(given.shape) != want:
                raise InvalidInputError(
                    f"table '{name}': optimizer state '{key}' has shape {tuple(given.shape)}, expected {want}"
                )
            if given is None:
                # Pinned on CUDA so the copy stream can move rows without a bounce buffer.
                pin = self.device.type == "cuda" and torch.cuda.is_available()
                given = torch.zeros(want, dtype=torch.float32, pin_memory=pin)
            self.exposed_state[key] = given
            self.host_state[key] = given.data
        self._exposed = [self.exposed_weight, *self.exposed_state.values()]
        self._seen_versions = [t._version for t in self._exposed]
        # Set by the owner of the data moves (the fetch engine's ``run``): moves plans in their
        # turn behind every queued move and waits. Only an update that comes after its plan's
        # pins ended needs it (see ``apply_gradients``).
        self.move_now: Optional[Callable[[List["FetchPlan"]], Any]] = None
        # The table's optimizer step counter (FBGEMM's TBE ``iter``: Adam's bias correction,
        # and the step that keys stochastic rounding). As in FBGEMM it advances on every
        # forward, eval included (``count_forward``); an update no forward counted advances it
        # itself. A tensor, so that whoever hands it out *is* the counter, never a copy of it.
        self.steps = torch.zeros((), dtype=torch.int64)
        self.segments: List[Segment] = list(segments or [Segment(name, 0, self.num_rows, row_offset, global_rows)])
        if sum(seg.num_rows for seg in self.segments) != self.num_rows:
            raise InvalidInputError(
                f"table '{name}': segments cover {sum(seg.num_rows for seg in self.segments)} rows, "
                f"the host tier has {self.num_rows}"
            )
        self._segment_ends = torch.tensor([seg.start + seg.num_rows for seg in self.segments], dtype=torch.int64)
        # Per segment, its slot range [lo, hi) when the slots are partitioned; None: shared.
        self._slot_ranges: Optional[List[Tuple[int, int]]] = None
        if segment_slots is not None:
            self._partition_slots(list(segment_slots), int(num_slots))

        self._allocate_cache(self.num_slots)
        self.row_bytes = self.dim * host_weight.element_size() + sum(
            v[0].numel() * v.element_size() for v in self.host_state.values() if v.shape[0]
        )

        self.policy = EvictionPolicy.parse(policy)
        self._allocate_bookkeeping()
        self.stats = TableStats()
        self._in_flight = 0  # plans issued and not yet released
        self._hot_rows = None if hot_rows is None else torch.unique(hot_rows.to(torch.int64))
        if self._hot_rows is not None:
            self.validate_rows(self._hot_rows)
            self._check_hot_rows_per_segment()
            if self._hot_rows.numel() >= self.num_slots:
                raise CacheCapacityError(
                    f"table '{name}': {self._hot_rows.numel()} permanently hot rows leave no slot for cold "
                    f"rows in a cache of {self.num_slots} slots"
                )
        # Rows that are resident from the start (hot rows, or every row of a full cache) are
        # copied in at the first plan, not now: the host tier may still be loaded (weights,
        # then optimizer state) before training starts, and the cache must see the result.
        self._preload_pending = True

    def _partition_slots(self, budgets: List[int], num_slots: int) -> None:
        """Checks ``segment_slots`` and gives each segment its contiguous slot range."""
        if len(budgets) != len(self.segments):
            raise InvalidInputError(
                f"table '{self.name}': segment_slots has {len(budgets)} entries for {len(self.segments)} segments "
                f"({[seg.name for seg in self.segments]})"
            )
        for seg, n in zip(self.segments, budgets):
            if int(n) < 1 and seg.num_rows:
                raise InvalidInputError(f"table '{self.name}': segment_slots['{seg.name}']={n} must be >= 1 "
                                        f"(its segment has {seg.num_rows} rows)")
        if sum(int(n) for n in budgets) != num_slots:
            raise InvalidInputError(f"table '{self.name}': segment_slots sum to {sum(int(n) for n in budgets)} "
                                    f"but num_slots={num_slots}")
        ranges, lo = [], 0
        for seg, n in zip(self.segments, budgets):
            hi = lo + max(0, min(int(n), seg.num_rows))  # (clamped to the segment, as num_slots is)
            ranges.append((lo, hi))
            lo = hi
        self._slot_ranges = ranges
        self.num_slots = max(lo, 1)
        self.holds_every_row = self.num_slots >= self.num_rows
        self._row_starts = np.array([seg.start for seg in self.segments[1:]], dtype=np.int64)
        self._slot_ends = np.array([hi for _, hi in ranges], dtype=np.int64)

    def segment_slot_ranges(self) -> Optional[List[Tuple[int, int]]]:
        """Per segment, the slot range ``[lo, hi)`` its rows live in (``segment_slots``);
        None when every segment shares the whole cache."""
        return None if self._slot_ranges is None else list(self._slot_ranges)

    def _check_hot_rows_per_segment(self) -> None:
        if self._slot_ranges is None or self._hot_rows is None:
            return
        hot = self._hot_rows.numpy()
        for seg, (lo, hi) in zip(self.segments, self._slot_ranges):
            k = int(np.count_nonzero((hot >= seg.start) & (hot < seg.start + seg.num_rows)))
            if k and k >= hi - lo and hi - lo < seg.num_rows:
                raise CacheCapacityError(
                    f"table '{seg.name}' (store '{self.name}'): {k} permanently hot rows leave no slot for cold "
                    f"rows in its cache of {hi - lo} slots"
                )

    def _allocate_cache(self, rows: int) -> None:
        dtype = self.host_weight.dtype
        self.cache_weight = torch.zeros(rows, self.dim, dtype=dtype, device=self.device)
        self.cache_state = {
            k: torch.zeros((rows, *v.shape[1:]), dtype=v.dtype, device=self.device)
            for k, v in self.host_state.items()
        }

    def _allocate_bookkeeping(self) -> None:
        # Bookkeeping lives on the host whatever the device: it is consulted by the planner.
        # The one per-host-row map is int32 (4 bytes a row, 1.6% of a 64-dim fp32 row): the
        # cache has far fewer than 2**31 slots. Slot ids leave it as int64 (index dtype).
        self.row_to_slot = torch.full((self.num_rows,), -1, dtype=torch.int32)
        self.slot_to_row = torch.full((self.num_slots,), -1, dtype=torch.int64)
        self.pins = torch.zeros(self.num_slots, dtype=torch.int32)
        self.dirty = torch.zeros(self.num_slots, dtype=torch.bool)
        self.permanent = torch.zeros(self.num_slots, dtype=torch.bool)
        self.ranking = SlotRanking(self.policy, self.num_slots, self.num_rows, self._slot_ranges)
        # NumPy views of the maps for the hot path (the tensors stay the owners: never
        # reassign them, only write into them).
        self._row_to_slot, self._slot_to_row = self.row_to_slot.numpy(), self.slot_to_row.numpy()
        self._pins, self._dirty, self._permanent = self.pins.numpy(), self.dirty.numpy(), self.permanent.numpy()

    @property
    def step(self) -> int:
        return int(self.steps)

    @step.setter
    def step(self, value: int) -> None:
        self.steps.fill_(int(value))

    def count_forward(self, plan: FetchPlan) -> None:
        """A forward looks up ``plan``: advance the step counter, as FBGEMM's TBE does on
        every forward (training or not), and keep the value for the plan's update."""
        self.steps += 1
        plan.optimizer_step = int(self.steps)

    # ------------------------------------------------------------------ planning
    def validate_rows(self, rows: torch.Tensor) -> None:
        """Raises ``IdOutOfRangeError`` naming the table, the offending id and the limit."""
        if rows.numel() == 0:
            return
        lo, hi = int(rows.min()), int(rows.max())
        if lo >= 0 and hi < self.num_rows:
            return
        bad = lo if lo < 0 else hi
        seg = self.segments[0] if bad < 0 else self.segments[-1]
        raise IdOutOfRangeError(seg.describe_bad_id(bad - seg.start))

    def segment_of(self, row: int) -> Segment:
        """The table a row of the store's row space belongs to."""
        return self.segments[int(torch.searchsorted(self._segment_ends, torch.tensor(row), right=True))]

    def _check_plan_rows(self, rows: torch.Tensor) -> None:
        """``plan`` needs unique, sorted int64 host rows: duplicates would map one row to two
        slots. One comparison pass; cheap next to the planning it protects."""
        if rows.dtype != torch.int64 or rows.dim() != 1 or rows.device.type != "cpu":
            raise InvalidInputError(
                f"table '{self.name}': rows to plan must be a 1-D int64 CPU tensor, got "
                f"{rows.dtype} of shape {tuple(rows.shape)} on {rows.device}"
            )
        if rows.numel() > 1 and not bool(torch.all(rows[1:] > rows[:-1])):
            steps = rows[1:] - rows[:-1]
            i = int(torch.nonzero(steps <= 0)[0])
            raise InvalidInputError(
                f"table '{self.name}': rows to plan must be unique and sorted; row {int(rows[i + 1])} "
                f"follows row {int(rows[i])} at position {i + 1} (use unique_rows())"
            )

    def plan(self, rows: torch.Tensor, depth_hint: Optional[int] = None, overflow: bool = False) -> FetchPlan:
        """Plans the residency of ``rows`` (unique, sorted, int64, on the host) and pins them.

        When the misses do not fit in the slots that no in-flight batch pins, raises
        ``CacheCapacityError`` changing nothing - or, with ``overflow``, fills the free
        slots and serves the remaining misses straight from the host tier (read at lookup,
        updated there in backward). That is exact only while no other planned batch can
        fetch those rows into the cache before this batch's update: the caller plans
        overflow batches only when no later batch is planned. ``depth_hint`` only improves
        the error message.

        Cost: a handful of NumPy vector ops over the batch's rows and over a victim window
        of twice its misses (see ``SlotRanking``), never over the whole cache while the
        window finds enough evictable slots (a plan whose misses are a large share of the
        cache counts its evictable slots first, so one that cannot fit fails fast).
        """
        self._check_plan_rows(rows)
        return self._plan(rows, depth_hint, overflow)

    def _plan(self, rows: torch.Tensor, depth_hint: Optional[int], overflow: bool) -> FetchPlan:
        """``plan`` for rows that are unique and sorted by construction (``unique_rows``).

        The bookkeeping runs on NumPy views of the store's tensors: a plan is some twenty
        small vector ops, and NumPy's cost per op is a fraction of eager PyTorch's."""
        r = rows.numpy()
        num_rows = r.shape[0]
        # Sorted rows: the first and the last bound them all.
        if num_rows and (r[0] < 0 or r[-1] >= self.num_rows):
            self.validate_rows(rows)  # names the table, the id and the limit
        preloading = self._preload_pending
        preload_rows, preload_slots = self._map_preload() if preloading else (None, None)
        r2s, s2r, pins, dirty = self._row_to_slot, self._slot_to_row, self._pins, self._dirty
        slots = r2s[r].astype(np.int64)
        tracked = not self.holds_every_row  # (a cache holding every row never evicts: pins protect nothing)
        overflow_rows: Optional[np.ndarray] = None
        n_miss = 0
        if tracked:
            # Pin the batch's hits first: the victim search then cannot choose them.
            miss = slots < 0
            hits = slots[~miss]
            pins[hits] += 1  # (a batch's slots are unique: a buffered fancy add is exact)
            fill_rows = r[miss]
            n_miss = fill_rows.shape[0]
        if n_miss == 0:  # steady state of a warm cache: no victims to look for
            fill_rows = victims = writeback_rows = writeback_slots = _EMPTY
        elif self._slot_ranges is not None:
            permanent = self._permanent if self._hot_rows is not None else None
            victims, overflow_rows = self._victims_by_segment(
                r, miss, hits, fill_rows, pins, permanent, s2r, overflow, depth_hint,
                (preload_rows, preload_slots) if preloading else None)
            if overflow_rows is not None:
                fill_rows = r[miss]  # (``_victims_by_segment`` took the overflow rows out of ``miss``)
                n_miss = fill_rows.shape[0]
        else:
            permanent = self._permanent if self._hot_rows is not None else None
            short = False
            if not overflow and 4 * n_miss > self.num_slots:
                # The misses are a large share of the cache, so it may be short: count the
                # evictable slots first (the victim search would find as many), so that a
                # plan that cannot fit - a prefetch that waits for pins - fails fast.
                n_free = self.ranking.count_evictable(pins, permanent)
                short = n_free < n_miss
            if short:
                victims = _EMPTY
            else:
                victims = self.ranking.pick_victims(n_miss, pins, permanent, s2r)
                n_free = victims.shape[0]
            if n_free < n_miss:
                if not overflow:
                    pins[hits] -= 1
                    if preloading:  # leave no trace: the preload waits for a plan that moves it
                        self._unmap_preload(preload_rows, preload_slots)
                    self._raise_capacity(num_rows, n_miss, n_free, depth_hint)
                # The last misses (in row order, so the choice is deterministic) overflow.
                overflow_rows, fill_rows = fill_rows[n_free:], fill_rows[:n_free]
                miss[np.flatnonzero(miss)[n_free:]] = False
                n_miss = n_free
        if n_miss or overflow_rows is not None:  # (the batch missed rows)
            victim_rows = s2r[victims]
            occupied = victim_rows >= 0
            wb = occupied & dirty[victims]
            writeback_slots, writeback_rows = victims[wb], victim_rows[wb]
            r2s[victim_rows[occupied]] = -1
            s2r[victims] = fill_rows
            r2s[fill_rows] = victims
            # The victim's dirty bit now describes the incoming row, which is clean.
            dirty[victims] = False
            pins[victims] += 1
            slots[miss] = victims
            if overflow_rows is not None:
                slots[slots < 0] = self.num_slots + np.arange(overflow_rows.shape[0], dtype=np.int64)
        if tracked:
            if overflow_rows is None:
                self.ranking.touch(slots, r)
            else:
                cached = slots[slots < self.num_slots]
                self.ranking.touch(cached, s2r[cached])
        self._in_flight += 1
        n_preload = 0 if preload_rows is None else int(preload_rows.numel())
        if n_preload:
            # Rows resident from the start travel with the first batch's fills, in the same
            # ticket, so even the preload follows the engine's one order.
            fill_rows = np.concatenate([preload_rows.numpy(), fill_rows])
            victims = np.concatenate([preload_slots.numpy(), victims])
            n_miss = fill_rows.shape[0]

        plan = FetchPlan(self, rows, torch.from_numpy(slots), torch.from_numpy(fill_rows), torch.from_numpy(victims),
                         torch.from_numpy(writeback_rows), torch.from_numpy(writeback_slots),
                         overflow_rows=None if overflow_rows is None else torch.from_numpy(overflow_rows),
                         preload=bool(n_preload), num_preloaded=n_preload,
                         num_rows=num_rows, num_fills=n_miss, num_writebacks=writeback_rows.shape[0])
        st = self.stats
        st.lookups_rows += plan.num_rows
        st.hits += plan.num_hits
        st.rows_fetched += n_miss
        st.rows_written_back += plan.num_writebacks
        st.bytes_moved += plan.bytes_to_move
        st.overflow_rows += plan.num_overflow
        return plan

    def _victims_by_segment(self, r: np.ndarray, miss: np.ndarray, hits: np.ndarray, fill_rows: np.ndarray,
                            pins: np.ndarray, permanent: Optional[np.ndarray], s2r: np.ndarray, overflow: bool,
                            depth_hint: Optional[int], preload: Optional[Tuple[torch.Tensor, torch.Tensor]],
                            ) -> Tuple[np.ndarray, Optional[np.ndarray]]:
        """Victims of a partitioned store: each segment's misses (``fill_rows`` is sorted, so
        they are contiguous) from its own slot range. Returns the victims in row order and
        the overflow rows (None when none): a segment whose range cannot take all its misses
        raises ``CacheCapacityError`` naming it, changing nothing (clock hands included) -
        or, with ``overflow``, its last misses (row order) overflow and leave ``miss``."""
        cuts = np.searchsorted(fill_rows, self._row_starts).tolist()
        bounds = [0, *cuts, fill_rows.shape[0]]
        hands = list(self.ranking.hands)
        chosen: List[np.ndarray] = []
        spill: List[Tuple[int, int]] = []  # (first, end) positions in fill_rows that overflow
        for part, (lo, hi) in enumerate(self._slot_ranges or ()):
            a, b = bounds[part], bounds[part + 1]
            m = b - a
            if m == 0:
                continue
            short = False
            if not overflow and 4 * m > hi - lo:  # (as in ``_plan``: a plan that cannot fit fails fast)
                n_free = self.ranking.count_evictable(pins, permanent, part)
                short = n_free < m
            if short:
                victims = _EMPTY
            else:
                victims = self.ranking.pick_victims(m, pins, permanent, s2r, part)
                n_free = victims.shape[0]
            if n_free < m:
                if not overflow:
                    self.ranking.hands[:] = hands
                    pins[hits] -= 1
                    if preload is not None:
                        self._unmap_preload(*preload)
                    seg = self.segments[part]
                    in_seg = int(np.count_nonzero((r >= seg.start) & (r < seg.start + seg.num_rows)))
                    self._raise_capacity(in_seg, m, n_free, depth_hint, part)
                spill.append((a + n_free, b))
            chosen.append(victims)
        victims = np.concatenate(chosen) if len(chosen) > 1 else chosen[0]
        if not spill:
            return victims, None
        keep = np.ones(fill_rows.shape[0], dtype=bool)
        for first, end in spill:
            keep[first:end] = False
        miss[np.flatnonzero(miss)[~keep]] = False
        return victims, fill_rows[~keep]

    def _unmap_preload(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        self.row_to_slot[rows] = -1
        self.slot_to_row[slots] = -1
        self.permanent[slots] = False
        self._preload_pending = True

    def _raise_capacity(self, n_rows: int, n_miss: int, n_free: int, depth: Optional[int],
                        part: Optional[int] = None) -> None:
        """``n_rows``, ``n_miss``, ``n_free``: the batch's rows, misses and the victims found -
        in segment ``part``'s slot range when the store is partitioned (the message then
        names that table and its budget)."""
        # (Raised on every try of a prefetch that waits for pins: kept cheap.)
        label, num_slots, table_rows, lo, hi = f"table '{self.name}'", self.num_slots, self.num_rows, 0, self.num_slots
        if part is not None and self._slot_ranges is not None:
            seg = self.segments[part]
            lo, hi = self._slot_ranges[part]
            num_slots, table_rows = hi - lo, seg.num_rows
            label = f"table '{seg.name}' (its budget in store '{self.name}')"
        permanent = int(np.count_nonzero(self._permanent[lo:hi])) if self._hot_rows is not None else 0
        # Slots that must hold distinct rows at once: this batch's misses beside every slot
        # that cannot give way - pinned by an in-flight batch (this batch's own hits were
        # pinned first, so they are among them) or holding a permanently hot row.
        held = num_slots - n_free
        needed = n_miss + held
        if held == 0:
            msg = (f"{label}: this batch alone misses {n_miss} rows but the device cache has "
                   f"{num_slots} slots")
        else:
            own = n_rows - n_miss  # this batch's hits: pinned before the victims were sought
            msg = (
                f"{label}: the device cache has {num_slots} slots but {needed} rows must be "
                f"resident at once: this batch's {n_miss} missing rows and {held} slots that cannot give way "
                f"(pinned by {self._in_flight} in-flight batch(es)"
                + (f" or by this batch's {own} cached rows" if own else "")
                + (f", or holding {permanent} permanently hot rows" if permanent else "")
                + ")"
            )
        if depth is not None:
            fits = max(num_slots - permanent, 0) // max(n_rows, 1) - 1
            want = (depth + 1) * n_rows
            msg += (
                f"; with prefetch_depth={depth} about {want} slots are needed (depth + 1 batches of "
                f"~{n_rows} rows: {load_factor_advice(want, table_rows)}). "
                + (
                    f"prefetch_depth <= {fits} would fit this cache"
                    if fits >= 0
                    else "no prefetch depth fits: raise the cache size (CacheParams.load_factor)"
                )
            )
        raise CacheCapacityError(msg)

    # ------------------------------------------------------------------ data moves
    @torch.no_grad()
    def transfer(self, plan: FetchPlan) -> None:
        """Executes the plan's data moves synchronously (the CPU transports call this).

        Order matters: dirty victims are written back before the misses overwrite their slots.
        ``plan.stage`` records progress so that a failure can be rolled back exactly.
        """
        if plan.num_writebacks:
            wb_slots = plan.writeback_slots.to(self.device)
            _move(self.cache_weight, wb_slots, self.host_weight, plan.writeback_rows)
            for k, host in self.host_state.items():
                _move(self.cache_state[k], wb_slots, host, plan.writeback_rows)
        plan.stage = "written_back"
        if plan.num_fills:
            fill_slots = plan.fill_slots.to(self.device)
            _move(self.host_weight, plan.fill_rows, self.cache_weight, fill_slots)
            for k, host in self.host_state.items():
                _move(host, plan.fill_rows, self.cache_state[k], fill_slots)
        plan.stage = "done"

    def rollback(self, plan: FetchPlan) -> None:
        """Undoes the bookkeeping of a plan whose data moves did not all happen.

        Called (on the planning thread, newest plan first) for a failed ticket and for the
        tickets queued behind it, which never ran. Afterwards ``row_to_slot`` only points at
        slots that really hold their row: rows whose fill did not complete are unmapped
        (their host copy is current), and dirty victims whose write-back did not happen are
        mapped back to their slot, which still holds them. Pins are left to ``release``.
        """
        if plan.stage == "done":
            return
        if plan.num_fills:
            mapped = self.row_to_slot[plan.fill_rows].long() == plan.fill_slots
            rows, slots = plan.fill_rows[mapped], plan.fill_slots[mapped]
            self.row_to_slot[rows] = -1
            self.slot_to_row[slots] = -1
            self.dirty[slots] = False
            self.permanent[slots] = False
        if plan.stage == "planned" and plan.num_writebacks:
            self.slot_to_row[plan.writeback_slots] = plan.writeback_rows
            self.row_to_slot[plan.writeback_rows] = plan.writeback_slots.to(torch.int32)
            self.dirty[plan.writeback_slots] = True
        if plan.preload:
            self._preload_pending = True  # the next plan carries the preload again
        plan.stage = "done"

    def plan_flush(self) -> FetchPlan:
        """A plan that writes every dirty slot back (no fills, no pins); the slots are clean
        from now on, so the write-back must be executed (by the fetch engine, in order)."""
        slots = torch.nonzero(self.dirty).flatten()
        rows = self.slot_to_row[slots]
        self.dirty[slots] = False
        empty = rows[:0]
        plan = FetchPlan(self, empty, empty, empty, empty, rows, slots, released=True)
        self.stats.rows_written_back += plan.num_writebacks
        return plan

    def plan_refresh(self) -> FetchPlan:
        """A plan that copies every cached row from the host tier again, for a host tier that
        was loaded while batches are in flight: their pinned rows then hold the loaded values,
        as a resident table's would. No victims, no pins; every slot is clean afterwards (the
        dirty rows were flushed before the load, and the host tier is now the truth)."""
        slots = torch.nonzero(self.slot_to_row >= 0).flatten()
        rows = self.slot_to_row[slots]
        self.dirty[slots] = False
        empty = rows[:0]
        return FetchPlan(self, empty, empty, rows, slots, empty, empty, released=True)

    # ------------------------------------------------------------------ backward
    @torch.no_grad()
    def apply_gradients(self, plan: FetchPlan, row_grads: torch.Tensor, checked: bool = False) -> None:
        """Applies the fused optimizer to the plan's rows and releases the plan.

        ``row_grads[i]`` is the gradient of ``plan.rows[i]`` summed over the batch.
        Non-finite gradients are refused before anything is written (``checked``: the
        caller already verified that they are finite).
        """
        if row_grads.shape != (plan.rows.numel(), self.dim):
            raise InvalidInputError(
                f"table '{self.name}': gradient shape {tuple(row_grads.shape)} does not match "
                f"({plan.rows.numel()}, {self.dim})"
            )
        # One reduction instead of an elementwise mask: NaN and Inf propagate through a sum.
        if not checked and not bool(torch.isfinite(row_grads.sum())):
            self.release(plan)
            raise InvalidInputError(
                f"table '{self.name}': non-finite gradient reached the store; "
                f"the update was skipped and the table is unchanged"
            )
        step = plan.optimizer_step
        if not step:  # looked up without a counted forward (store-level callers)
            self.steps += 1
            step = int(self.steps)
        if plan.released:
            plan, row_grads = self._plan_again(plan, row_grads)
        if not plan.num_overflow:
            self._update_cache(plan.device_slots(), row_grads, step, plan.rows)
            self._dirty[plan.slots.numpy()] = True
        else:
            in_cache = plan.slots < self.num_slots
            self._update_cache(plan.slots[in_cache].to(self.device), row_grads[in_cache.to(row_grads.device)], step,
                               plan.rows[in_cache])
            self.dirty[plan.slots[in_cache]] = True
            self._update_host(plan.overflow_rows, row_grads[(~in_cache).to(row_grads.device)], step)
        self.stats.updates += 1
        self.release(plan)

    def _plan_again(self, plan: FetchPlan, row_grads: torch.Tensor) -> "tuple[FetchPlan, torch.Tensor]":
        """A plan whose pins ended before its update came (its owner's next training forward
        came first): its rows may have been evicted or be about to move. They are planned
        again (rows that do not fit are updated in the host tier) and moved in their turn
        behind every queued move, so the update lands where each row is - the same result
        as an update while pinned, on the critical path. (The same rows, in the same order:
        the gradients stay as they are.)"""
        self._require_mover()
        again = self._plan(plan.rows, None, overflow=True)
        try:
            self.move_now([again])  # type: ignore[misc]
        except BaseException:
            self.release(again)
            raise
        self.stats.late_updates += 1
        return again, row_grads

    def _require_mover(self) -> None:
        if self.move_now is None:
            raise StoreStateError(
                f"table '{self.name}': the update of a batch came after its rows were released, and this "
                f"store has no fetch engine to bring them back (set move_now)"
            )

    def has_dirty(self) -> bool:
        """Whether some cached row holds an update the host tier lacks."""
        return bool(self._dirty.any())

    def external_writes(self) -> bool:
        """Whether the host tier's owner wrote it in place since the last call: PyTorch's
        version counter of the tensors the store was given (weights, optimizer state) moved.
        The store's own moves do not count (see ``__init__``). Writes that bypass the
        counter (through ``.data``, NumPy or raw pointers) are not seen."""
        now = [t._version for t in self._exposed]
        if now == self._seen_versions:
            return False
        self._seen_versions = now
        self.stats.external_writes += 1
        return True

    def _update_cache(self, slots: torch.Tensor, grads: torch.Tensor, step: int, rows: torch.Tensor) -> None:
        # The gradients stay FP32 whatever the table's dtype: FBGEMM computes the update in
        # FP32 and rounds the new row once (``update_rows``).
        update_rows(self.optimizer, self.cache_weight, self.cache_state, slots, grads, step,
                    self._stochastic_rows(rows, self.device))

    def _update_host(self, rows: torch.Tensor, grads: torch.Tensor, step: int) -> None:
        # Overflow rows live only in the host tier until this update: the same rule, there,
        # rounded as the cache would round them (so the cache size never changes a result).
        update_rows(self.optimizer, self.host_weight, self.host_state, rows,
                    grads.to(self.host_weight.device), step, self._stochastic_rows(rows, self.host_weight.device))

    def _stochastic_rows(self, rows: torch.Tensor, where: torch.device) -> Optional[torch.Tensor]:
        """The row ids keying stochastic rounding when FBGEMM's CUDA kernels would round the
        table's updates stochastically (FP16 tables with ``stochastic_rounding`` on a CUDA
        device); None where FBGEMM rounds to nearest (its CPU kernel ignores the flag)."""
        if not (self.device.type == "cuda" and self.optimizer.stochastic_rounding
                and self.cache_weight.dtype == torch.float16):
            return None
        return rows.to(where)

    def pinned_slots(self) -> int:
        """Slots pinned now by batches in flight (for messages)."""
        return int(np.count_nonzero(self._pins)) if not self.holds_every_row else 0

    @property
    def in_flight(self) -> int:
        """Plans made and not yet released."""
        return self._in_flight

    def release(self, plan: FetchPlan) -> None:
        """Unpins the plan's slots (idempotent)."""
        if plan.released:
            return
        plan.released = True
        if not self.holds_every_row:
            self._pins[plan.cache_slots.numpy()] -= 1  # (unique slots: a buffered fancy add is exact)
        self._in_flight -= 1

    # ------------------------------------------------------------------ host tier
    def invalidate(self) -> None:
        """Drops every cached row without writing back (after the host tier was overwritten).

        Dirty rows are lost by design here: flush them first (through the fetch engine) when
        they matter, as ``purge`` in the TorchRec kernel does."""
        if self.in_flight:
            raise StoreStateError(
                f"table '{self.name}': cannot invalidate the cache while {self._in_flight} "
                f"batch(es) are in flight; drain the pipeline first"
            )
        self.row_to_slot.fill_(-1)
        self.slot_to_row.fill_(-1)
        self.dirty.fill_(False)
        self.permanent.fill_(False)
        self._preload_pending = True

    def _map_preload(self) -> "tuple[torch.Tensor, torch.Tensor]":
        """Maps the rows that are resident from the start and returns them with their slots;
        the bytes move with the plan that called this."""
        self._preload_pending = False
        empty = torch.empty(0, dtype=torch.int64)
        if self.num_slots >= self.num_rows and self.num_rows:
            # A cache as large as the table holds every row from the start (row i in slot
            # i), as a resident table would: no compulsory misses, no victim search.
            rows = torch.arange(self.num_rows, dtype=torch.int64)
            self.slot_to_row.copy_(rows)
            self.row_to_slot.copy_(rows)  # (copy_ converts to int32)
            return rows, rows.clone()
        if self._slot_ranges is not None:
            return self._map_preload_by_segment()
        if self._hot_rows is None or self._hot_rows.numel() == 0:
            return empty, empty
        hot = self._hot_rows
        slots = torch.arange(hot.numel(), dtype=torch.int64)
        self.slot_to_row[slots] = hot
        self.row_to_slot[hot] = slots.to(torch.int32)
        self.permanent[slots] = True
        return hot, slots

    def _map_preload_by_segment(self) -> "tuple[torch.Tensor, torch.Tensor]":
        """``_map_preload`` of a partitioned store, per table: a budget as large as the
        table holds all its rows from the start (row ``start + i`` in slot ``lo + i``, as a
        store of its own would); otherwise its hot rows, permanently, at the start of its
        range."""
        hot = self._hot_rows
        rows: List[torch.Tensor] = []
        slots: List[torch.Tensor] = []
        for seg, (lo, hi) in zip(self.segments, self._slot_ranges or ()):
            if seg.num_rows and hi - lo >= seg.num_rows:
                rows.append(torch.arange(seg.start, seg.start + seg.num_rows, dtype=torch.int64))
                slots.append(torch.arange(lo, hi, dtype=torch.int64))
            elif hot is not None:
                h = hot[(hot >= seg.start) & (hot < seg.start + seg.num_rows)]
                s = torch.arange(lo, lo + h.numel(), dtype=torch.int64)
                self.permanent[s] = True
                rows.append(h)
                slots.append(s)
        if not rows:
            empty = torch.empty(0, dtype=torch.int64)
            return empty, empty
        all_rows, all_slots = torch.cat(rows), torch.cat(slots)
        self.slot_to_row[all_slots] = all_rows
        self.row_to_slot[all_rows] = all_slots.to(torch.int32)
        return all_rows, all_slots

    def bookkeeping_bytes(self) -> int:
        """Bytes of maps, pins, flags and eviction state (not the cache or the host tier)."""
        tensors = [self.row_to_slot, self.slot_to_row, self.pins, self.dirty, self.permanent, self.ranking.last_used]
        if self.ranking.row_freq is not None:
            tensors.append(self.ranking.row_freq)
        return sum(t.numel() * t.element_size() for t in tensors)

    def host_tier_bytes(self) -> int:
        return self.num_rows * self.row_bytes

    def resident_rows(self) -> torch.Tensor:
        """Rows currently mapped to a slot."""
        return self.slot_to_row[self.slot_to_row >= 0]

    # ------------------------------------------------------------------ debugging
    def check_invariants(self, expect_drained: bool = False) -> None:
        """Verifies maps, pins and dirty state; raises ``StoreStateError`` on the first breach."""
        occ = torch.nonzero(self.slot_to_row >= 0).flatten()
        rows = self.slot_to_row[occ]
        problems = []
        if rows.numel() != torch.unique(rows).numel():
            problems.append("a row is mapped to two slots")
        if not torch.equal(self.row_to_slot[rows].long(), occ):
            problems.append("row_to_slot and slot_to_row disagree")
        if int((self.row_to_slot >= 0).sum()) != occ.numel():
            problems.append("row_to_slot maps rows to empty slots")
        if bool((self.pins < 0).any()):
            problems.append("a pin count went negative")
        if bool((self.dirty & (self.slot_to_row < 0)).any()):
            problems.append("an empty slot is marked dirty")
        if self._slot_ranges is not None and occ.numel():
            # Partitioned: every row lives in its own segment's slot range.
            row_part = torch.searchsorted(self._segment_ends, rows, right=True)
            slot_part = torch.from_numpy(np.searchsorted(self._slot_ends, occ.numpy(), side="right"))
            wrong = torch.nonzero(row_part != slot_part).flatten()
            if wrong.numel():
                i = int(wrong[0])
                seg = self.segments[int(row_part[i])]
                lo, hi = self._slot_ranges[int(row_part[i])]
                problems.append(f"row {int(rows[i])} of table '{seg.name}' is in slot {int(occ[i])}, "
                                f"outside its slots [{lo}, {hi})")
        if expect_drained and (int(self.pins.sum()) != 0 or self._in_flight != 0):
            problems.append(f"{int(self.pins.sum())} pins / {self._in_flight} plans left after drain")
        if problems:
            raise StoreStateError(f"table '{self.name}': " + "; ".join(problems))

    def __repr__(self) -> str:
        return (
            f"TieredTable(name={self.name!r}, rows={self.num_rows}, dim={self.dim}, "
            f"slots={self.num_slots}, policy={self.policy.value}, optim={self.optimizer.optim.value})"
        )


_EMPTY = np.empty(0, dtype=np.int64)  # (never written: empty)


def load_factor_text(slots: int, rows: int) -> str:
    """``slots`` as a cache load factor of ``rows``, for messages (rounded up to 0.001, at most 1)."""
    return f"{min(1.0, math.ceil(1000 * slots / max(rows, 1)) / 1000):g}"


def load_factor_advice(slots: int, rows: int) -> str:
    """How to ask for a cache of ``slots`` of the ``rows`` a store holds on this rank, for
    messages: a plan's ``CacheParams.load_factor``, or - when every row is needed, which the
    planner refuses (it takes only load factors below 1) - the sharder's own option."""
    if slots < rows:
        return f"CacheParams.load_factor >= {load_factor_text(slots, rows)} of the {rows} rows this store holds on this rank"
    return (f"every one of the {rows} rows this store holds on this rank: the sharder's cache_load_factor=1.0, "
            f"with no CacheParams.load_factor in the plan, as the planner takes only load factors below 1")


def _move(src: torch.Tensor, src_index: torch.Tensor, dst: torch.Tensor, dst_index: torch.Tensor) -> None:
    """``dst[dst_index] = src[src_index]`` across devices (one gather, one copy, one scatter;
    index_select/index_copy_ are cheaper than advanced indexing)."""
    dst.index_copy_(0, dst_index, src.index_select(0, src_index).to(dst.device))


def unique_rows(values: torch.Tensor) -> "tuple[torch.Tensor, torch.Tensor]":
    """Sorted unique rows of ``values`` and, for each value, the index of its row.

    The same result as ``torch.unique(values, sorted=True, return_inverse=True)`` on the
    host, in about 40% of its time for a batch's ids: each value is packed with its
    position into one int64 (``value << p | position``) and the keys are sorted without an
    index (NumPy's vectorised sort, several times faster than ``torch.sort`` on CPU), so
    one plain sort gives both the order and where each value came from. Equal values get
    the same row whatever order the sort leaves them in, so the result is deterministic.
    Values too large to pack fall back to ``torch.unique``.
    """
    if values.dtype != torch.int64 or values.device.type != "cpu":
        values = values.to(device="cpu", dtype=torch.int64)
    n = int(values.numel())
    if n == 0:
        return values.clone(), values.clone()
    a = values.numpy()  # (a strided view is fine: the first op below copies)
    shift = max(n - 1, 1).bit_length()
    limit = 1 << (62 - shift)  # |value| < limit: value << shift fits in an int64 with its sign
    if not (-limit < int(a.min()) and int(a.max()) < limit):
        rows, inverse = torch.unique(values, sorted=True, return_inverse=True)
        return rows, inverse
    keys = np.left_shift(a, shift)
    keys |= np.arange(n, dtype=np.int64)
    keys.sort()
    sorted_values = keys >> shift  # (arithmetic shift: negative values come back intact)
    position = keys & ((1 << shift) - 1)
    first = np.empty(n, dtype=bool)
    first[0] = True
    np.not_equal(sorted_values[1:], sorted_values[:-1], out=first[1:])
    row_of_sorted = np.cumsum(first, dtype=np.int64)
    row_of_sorted -= 1
    inverse = np.empty(n, dtype=np.int64)
    inverse[position] = row_of_sorted
    return torch.from_numpy(sorted_values[first]), torch.from_numpy(inverse)

