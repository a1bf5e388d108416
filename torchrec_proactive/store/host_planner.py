"""The host planner: a table's residency bookkeeping in NumPy, planned on the host.

Why the host: at CPU batch sizes a plan is some twenty small vector ops over the batch's
unique rows, and NumPy's cost per op is a fraction of eager PyTorch's; the ids are on the
host already. ``device_planner.py`` is the same contract on a GPU.

The bookkeeping (``row_to_slot``, ``slot_to_row``, pins, dirty and permanent flags, the
eviction ranking) is plain tensors with NumPy views for the hot path. A plan's lists are
exact (no padding) and its sizes are known at once.

Invariants (``check_invariants``): ``row_to_slot`` and ``slot_to_row`` inverse on occupied
slots; a pinned slot is never a victim; pins return to 0 when every batch is released; with
per-table budgets, every cached row is in its own table's slot range.
"""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING, List, Optional, Tuple

import numpy as np
import torch

from .errors import CacheCapacityError, StoreStateError
from .eviction import SlotRanking
from .invariants import map_problems
from .plan import FetchPlan, PlanTable

if TYPE_CHECKING:
    from .device_planner import RowMapping

_EMPTY = np.empty(0, dtype=np.int64)  # (never written: empty)


class HostPlanner:
    """Plans a :class:`TieredTable`'s batches on the host: ``TieredTable(planner="host")``,
    the default, and what the sharder's ``planner="auto"`` picks on CPU.

    Keeps the table's residency bookkeeping (``row_to_slot``, ``slot_to_row``, ``pins``,
    ``dirty``, ``permanent``, the eviction ``ranking``) in host tensors with NumPy views. A
    plan's lists are exact and its sizes known at once; ids outside the table are refused
    at plan time (``IdOutOfRangeError``), before anything changes. The table calls it; a
    user reads it for debugging only (more in the module docstring)."""

    on_device = False
    owner_stream = None  # (the host planner has no stream of its own)

    def __init__(self, table: PlanTable) -> None:
        self._table = weakref.ref(table)  # (the table owns its planner: no reference cycle)
        self.name, self.num_rows, self.num_slots = table.name, table.num_rows, table.num_slots
        self.holds_every_row = table.holds_every_row
        self.segments = table.segments
        self._slot_ranges = table.segment_slot_ranges()
        self._hot_rows = table.hot_rows
        #: Rows resident from the start (hot rows, or every row of a full cache) are copied in
        #: with the first plan, not at construction: the host tier may still be loaded
        #: (weights, then optimizer state) before training starts, and the cache must see it.
        self.preload_pending = True
        if self._slot_ranges is not None:
            self._row_starts = np.array([seg.start for seg in self.segments[1:]], dtype=np.int64)
            self._slot_ends = np.array([hi for _, hi in self._slot_ranges], dtype=np.int64)
        # The one per-host-row map is int32 (4 bytes a row, 1.6% of a 64-dim fp32 row): the
        # cache has far fewer than 2**31 slots. Slot ids leave it as int64 (index dtype).
        self.row_to_slot = torch.full((self.num_rows,), -1, dtype=torch.int32)
        self.slot_to_row = torch.full((self.num_slots,), -1, dtype=torch.int64)
        self.pins = torch.zeros(self.num_slots, dtype=torch.int32)
        self.dirty = torch.zeros(self.num_slots, dtype=torch.bool)
        self.permanent = torch.zeros(self.num_slots, dtype=torch.bool)
        self.ranking = SlotRanking(table.policy, self.num_slots, self.num_rows, self._slot_ranges)
        # NumPy views of the maps for the hot path (the tensors stay the owners: never
        # reassign them, only write into them).
        self._row_to_slot, self._slot_to_row = self.row_to_slot.numpy(), self.slot_to_row.numpy()
        self._pins, self._dirty, self._permanent = self.pins.numpy(), self.dirty.numpy(), self.permanent.numpy()

    @property
    def table(self) -> PlanTable:
        return self._table()  # type: ignore[return-value]

    @property
    def cache_rows(self) -> int:
        """Rows the cache tensors need: one per slot."""
        return self.num_slots

    def check_owner(self, claim: bool = True) -> None:
        """(Nothing to check: the host planner's bookkeeping lives on the host.)"""

    # ------------------------------------------------------------------ planning
    def plan_ids(self, ids: torch.Tensor, depth_hint: Optional[int], overflow: bool, check_ids: bool = True,
                 mapping: Optional["RowMapping"] = None) -> FetchPlan:
        """``plan_rows`` of the ids' unique rows (read on the host); the plan's ``inverse``
        maps each id to its row."""
        ids = ids.to("cpu")
        rows = ids if mapping is None else mapping.rows(ids, mapping.offsets.to("cpu"))
        unique, inverse = unique_rows(rows)
        plan = self.plan_rows(unique, depth_hint, overflow)
        plan.inverse = inverse
        return plan

    def plan_rows(self, rows: torch.Tensor, depth_hint: Optional[int], overflow: bool) -> FetchPlan:
        """Plans ``rows`` (unique, sorted, int64, on the host) and pins them; see
        ``TieredTable.plan``. Returns a plan whose sizes are known.

        Cost: a handful of NumPy vector ops over the batch's rows and over a victim window
        of twice its misses (see ``SlotRanking``), never over the whole cache while the
        window finds enough evictable slots (a plan whose misses are a large share of the
        cache counts its evictable slots first, so one that cannot fit fails fast)."""
        r = rows.numpy()
        num_rows = r.shape[0]
        # Sorted rows: the first and the last bound them all.
        if num_rows and (r[0] < 0 or r[-1] >= self.num_rows):
            self.table.validate_rows(rows)  # names the table, the id and the limit
        preloading = self.preload_pending
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
        n_preload = 0 if preload_rows is None else int(preload_rows.numel())
        if n_preload:
            # Rows resident from the start travel with the first batch's fills, in the same
            # ticket, so even the preload follows the engine's one order.
            fill_rows = np.concatenate([preload_rows.numpy(), fill_rows])
            victims = np.concatenate([preload_slots.numpy(), victims])
            n_miss = fill_rows.shape[0]
        plan = FetchPlan(self.table, rows, torch.from_numpy(slots), torch.from_numpy(fill_rows),
                         torch.from_numpy(victims), torch.from_numpy(writeback_rows),
                         torch.from_numpy(writeback_slots),
                         overflow_rows=None if overflow_rows is None else torch.from_numpy(overflow_rows),
                         preload=bool(n_preload), num_preloaded=n_preload)  # (exact lists: sizes known)
        self.table._sizes_known(plan)  # noqa: SLF001 - known at once: counted at once
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
            if not overflow and 4 * m > hi - lo:  # (as in ``plan_rows``: a plan that cannot fit fails fast)
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

    def replan(self, plan: FetchPlan, row_grads: torch.Tensor) -> Tuple[FetchPlan, torch.Tensor]:
        """The plan's rows planned again with overflow allowed (see
        ``TieredTable.apply_gradients``): the same rows in the same order, so the gradients
        stay as they are."""
        return self.plan_rows(plan.rows, None, overflow=True), row_grads

    def _unmap_preload(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        self.row_to_slot[rows] = -1
        self.slot_to_row[slots] = -1
        self.permanent[slots] = False
        self.preload_pending = True

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
        cache = "its budget" if part is not None and self._slot_ranges is not None else "the device cache"
        if held == 0:
            msg = (f"{label}: this batch alone misses {n_miss} rows but {cache} has "
                   f"{num_slots} slots")
        else:
            own = n_rows - n_miss  # this batch's hits: pinned before the victims were sought
            msg = (
                f"{label}: {cache} has {num_slots} slots but {needed} rows must be "
                f"resident at once: this batch's {n_miss} missing rows and {held} slots that cannot give way "
                f"(pinned by {self.table.in_flight} in-flight batch(es)"
                + (f" or by this batch's {own} cached rows" if own else "")
                + (f", or holding {permanent} permanently hot rows" if permanent else "")
                + ")"
            )
        if depth is not None:
            fits = max(num_slots - permanent, 0) // max(n_rows, 1) - 1
            want = (depth + 1) * n_rows
            msg += (
                f"; with prefetch_depth={depth} about {want} slots are needed (depth + 1 batches of "
                f"~{n_rows} rows: {load_factor_advice(want, table_rows)}); "
                + (
                    f"prefetch_depth <= {fits} would fit this cache"
                    if fits >= 0
                    else "no prefetch depth fits: raise the cache size (CacheParams.load_factor)"
                )
            )
        else:
            msg += (f". Nothing changed: plan it again once earlier batches are released (their "
                    f"backward), or with overflow=True to serve the {needed - num_slots} rows that do not "
                    f"fit from the host tier (exact, on the critical path)" if held else
                    f". Nothing changed: plan with overflow=True to serve the rows that do not fit from the "
                    f"host tier (exact, on the critical path), or give the table at least {n_miss} slots")
        raise CacheCapacityError(msg)

    def sizes_known(self, plan: FetchPlan) -> None:
        """(The host planner's sizes are known when it plans.)"""

    # ------------------------------------------------------------------ after a plan
    def rollback(self, plan: FetchPlan) -> None:
        """Undoes the bookkeeping of a plan whose moves did not all happen (see
        ``TieredTable.rollback``)."""
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
            self.preload_pending = True  # the next plan carries the preload again

    def _cache_slots(self, plan: FetchPlan) -> torch.Tensor:
        """The slots the plan pins (``slots`` without the overflow ids)."""
        if not plan.num_overflow:
            return plan.slots
        return plan.slots[plan.slots < self.num_slots]

    def unpin(self, plan: FetchPlan) -> None:
        if not self.holds_every_row:
            self._pins[self._cache_slots(plan).numpy()] -= 1  # (unique slots: a buffered fancy add is exact)

    def split_overflow(self, plan: FetchPlan, row_grads: torch.Tensor) -> Tuple[
            torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(slots, grads, rows)`` of the plan's cached rows and ``(rows, grads)`` of its
        overflow rows (None without overflow): exact subsets on the host."""
        if not plan.num_overflow:
            return plan.device_slots(), row_grads, plan.rows, None, None
        in_cache = plan.slots < self.num_slots
        on_grads = in_cache.to(row_grads.device)
        return (plan.slots[in_cache].to(self.table.device), row_grads[on_grads], plan.rows[in_cache],
                plan.overflow_rows, row_grads[~on_grads])

    def trash_slots(self, n: int) -> torch.Tensor:
        raise StoreStateError(f"table '{self.name}': the host planner refuses a non-finite update before it "
                              f"is computed; it has no trash slots to write a skipped one to")

    def mark_dirty(self, plan: FetchPlan) -> None:
        """The plan's cached rows hold an update the host tier lacks."""
        self._dirty[self._cache_slots(plan).numpy()] = True

    # ------------------------------------------------------------------ the whole cache
    def flush_plans(self, chunk: int) -> List[FetchPlan]:
        """Plans that write every dirty slot back, ``chunk`` slots each (none when nothing is
        dirty); the slots are clean from now on, so the write-backs must be executed (by the
        fetch engine)."""
        if not self._dirty.any():
            return []
        slots = torch.nonzero(self.dirty).flatten()
        rows = self.slot_to_row[slots]
        self.dirty[slots] = False
        empty = rows[:0]
        return [self._whole_cache_plan(empty, empty, rows[i: i + chunk], slots[i: i + chunk])
                for i in range(0, slots.shape[0], max(1, chunk))]

    def refresh_plans(self, chunk: int) -> List[FetchPlan]:
        """Plans that copy every cached row from the host tier again, ``chunk`` slots each;
        every slot clean."""
        slots = torch.nonzero(self.slot_to_row >= 0).flatten()
        rows = self.slot_to_row[slots]
        self.dirty[slots] = False
        empty = rows[:0]
        return [self._whole_cache_plan(rows[i: i + chunk], slots[i: i + chunk], empty, empty)
                for i in range(0, max(1, slots.shape[0]), max(1, chunk))]

    def _whole_cache_plan(self, fill_rows: torch.Tensor, fill_slots: torch.Tensor, wb_rows: torch.Tensor,
                          wb_slots: torch.Tensor) -> FetchPlan:
        empty = fill_rows[:0]
        plan = FetchPlan(self.table, empty, empty, fill_rows, fill_slots, wb_rows, wb_slots, released=True)
        self.table._sizes_known(plan)  # noqa: SLF001
        return plan

    def clear(self) -> None:
        """Drops every cached row (see ``TieredTable.invalidate``)."""
        self.row_to_slot.fill_(-1)
        self.slot_to_row.fill_(-1)
        self.dirty.fill_(False)
        self.permanent.fill_(False)
        self.preload_pending = True

    def _map_preload(self) -> "tuple[torch.Tensor, torch.Tensor]":
        """Maps the rows that are resident from the start and returns them with their slots;
        the bytes move with the plan that called this."""
        self.preload_pending = False
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

    # ------------------------------------------------------------------ reading the state
    def has_dirty(self) -> bool:
        """Whether some cached row holds an update the host tier lacks."""
        return bool(self._dirty.any())

    def pinned_slots(self) -> int:
        """Slots pinned now by batches in flight."""
        return int(np.count_nonzero(self._pins)) if not self.holds_every_row else 0

    def pinned_in(self, lo: int, hi: int) -> int:
        """Slots of ``[lo, hi)`` pinned now (for messages)."""
        return int(np.count_nonzero(self._pins[lo:hi]))

    def resident_rows(self) -> torch.Tensor:
        """Rows mapped to a slot now."""
        return self.slot_to_row[self.slot_to_row >= 0]

    def resident(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Occupied slots, their rows and their dirty flags (host tensors)."""
        slots = torch.nonzero(self.slot_to_row >= 0).flatten()
        return slots, self.slot_to_row[slots], self.dirty[slots]

    def bookkeeping_bytes(self) -> int:
        """Bytes of maps, pins, flags and eviction state."""
        tensors = [self.row_to_slot, self.slot_to_row, self.pins, self.dirty, self.permanent, self.ranking.last_used]
        if self.ranking.row_freq is not None:
            tensors.append(self.ranking.row_freq)
        return sum(t.numel() * t.element_size() for t in tensors)

    def check_invariants(self, expect_drained: bool = False) -> List[str]:
        """The breaches found (empty: none)."""
        problems = map_problems(self.slot_to_row, self.row_to_slot, self.pins, self.dirty, expect_drained)
        occ = torch.nonzero(self.slot_to_row >= 0).flatten()
        rows = self.slot_to_row[occ]
        if self._slot_ranges is not None and occ.numel():
            # Partitioned: every row lives in its own segment's slot range.
            ends = torch.tensor([seg.start + seg.num_rows for seg in self.segments], dtype=torch.int64)
            row_part = torch.searchsorted(ends, rows, right=True)
            slot_part = torch.from_numpy(np.searchsorted(self._slot_ends, occ.numpy(), side="right"))
            wrong = torch.nonzero(row_part != slot_part).flatten()
            if wrong.numel():
                i = int(wrong[0])
                seg = self.segments[int(row_part[i])]
                lo, hi = self._slot_ranges[int(row_part[i])]
                problems.append(f"row {int(rows[i])} of table '{seg.name}' is in slot {int(occ[i])}, "
                                f"outside its slots [{lo}, {hi})")
        return problems


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

