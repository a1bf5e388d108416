"""One embedding table (or one local shard of it) split across a host tier and a device cache.

Data path, top to bottom:

1. ``plan(rows)`` / ``plan_ids(ids)`` - which of the batch's unique rows hit, which miss,
   which slots the misses evict (and which of those are dirty and must be written back).
   Pins every slot the batch will read. Pure bookkeeping, by the table's *planner*.
2. ``transfer(plan)``  - moves the data the plan asks for: write back dirty victims to the host
   tier, then copy the missing rows (and their optimizer state) into their slots. The fetch
   engine runs this (or a transport's equivalent) asynchronously, in ticket order.
3. ``lookup(...)``     - pooled bags read through ``row -> slot`` (``pooled_lookup`` in lookup.py).
4. ``apply_gradients`` - the fused optimizer updates the slots in backward, marks them dirty,
   and releases the batch's pins.
5. ``plan_flush()``    - write-backs of every dirty slot, so the host tier equals a resident table.

One table, two planners. The only thing that differs between a CPU run and a GPU run is
where the residency bookkeeping lives and how a plan is computed: ``HostPlanner``
(``host_planner.py``: NumPy on the host, exact lists) or ``DevicePlanner``
(``device_planner.py``: fixed-shape tensor ops on the cache's device, padded lists, sizes
learnt later). Both hand back the one plan type (``plan.py``); the data, its moves, the
fused update, the step counter, the statistics and every rule about pins live here, once.

Every byte moved between the tiers (fills, write-backs, the preload folded into the first
plan, flushes) is described by a ``FetchPlan`` and moved when the fetch engine runs its
ticket: the engine is the one owner of the order of data moves. A failed move is undone
with ``rollback``.

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

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .device_planner import DevicePlanner, RowMapping
from .disk_host_tier import Component, DiskHostTier, HostCacheCapacityError, record_layout
from .errors import CacheCapacityError, IdOutOfRangeError, InvalidInputError, StoreStateError
from .eviction import EvictionPolicy
from .host_memory import mapped_zeros
from .host_planner import HostPlanner, load_factor_advice, load_factor_text, unique_rows
from .optimizers import OptimizerConfig, update_rows
from .plan import FetchPlan
from .row_file import RowFile
from .row_moves import device_alias, move_rows_

__all__ = ["FetchPlan", "Segment", "Stage", "TableStats", "TieredTable", "disk_record_bytes", "load_factor_advice",
           "load_factor_text", "unique_rows"]

#: The planners a table can use (``TieredTable(planner=...)``).
PLANNERS = {"host": HostPlanner, "device": DevicePlanner}


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
    # On disk: batches whose rows did not fit the host cache, moved through it in chunks.
    host_overflow_plans: int = 0

    def hit_rate(self) -> float:
        return self.hits / self.lookups_rows if self.lookups_rows else 1.0

    def as_dict(self) -> Dict[str, float]:
        d = dict(self.__dict__)
        d["hit_rate"] = self.hit_rate()
        return d


@dataclass(eq=False)
class Stage:
    """A future batch's rows pinned in a table's host cache, their disk reads queued
    (``TieredTable.stage_rows``); ``TieredTable.unstage`` drops it. ``rows``: rows staged
    (those the device cache held are left out); ``ticket``: the disk tier's (None off
    disk)."""

    table: str
    rows: int
    ticket: Optional[Any] = None
    released: bool = False


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


def _disk_components(dim: int, optimizer: OptimizerConfig, dtype: torch.dtype) -> List[Component]:
    """A file record's parts: the row's weights, then each optimizer state (fp32)."""
    return [Component("weight", dtype, dim)] + [
        Component(key, torch.float32, int(np.prod(shape)) if len(shape) else 1)
        for key, shape in optimizer.state_shapes(dim).items()]


def disk_record_bytes(dim: int, optimizer: OptimizerConfig, dtype: torch.dtype = torch.float32) -> int:
    """Bytes one row of a table on disk takes in its file and in its host cache (its weights
    and optimizer state, aligned): what a host cache budget buys rows with. ``optimizer``:
    this store's :class:`OptimizerConfig` - from TorchRec's fused params,
    ``OptimizerConfig.from_fused_params(fused_params)``."""
    return record_layout(_disk_components(dim, optimizer, dtype))[1]


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
            every segment, as if the store were one table. The host planner only.
        planner: ``"host"`` (``HostPlanner``: NumPy bookkeeping, ids read on the host) or
            ``"device"`` (``DevicePlanner``: fixed-shape bookkeeping on ``device``, no host
            read on the training thread). Everything else is the same code for both.
        host_on_device: the host tier (weight, then each optimizer state) as ``device``
            addresses it, for moves the device runs itself (default: the tensors themselves
            off CUDA, pinned tensors' device views on CUDA, else None).
        disk: a table larger than host memory: its host tier is this bounded DRAM cache of
            the table's file (``disk_host_tier.py``; build both with :meth:`on_disk`), and
            ``host_weight`` is a ``meta`` tensor giving only the shape and dtype. Each batch
            plan queues the disk moves of its rows when it is made, so they run while the
            batches before it train (the disk hop is as many batches ahead as the plan);
            its fills wait for them, its write-backs need no read. :meth:`stage_rows` reads
            a batch's rows further ahead still (the disk hop's own depth). Host planner;
            a CPU or CUDA device (on CUDA the copy stream's worker stages the rows in
            pinned memory, fetch/cuda.py).

    Attributes a user reads: ``planner`` (``HostPlanner`` or ``DevicePlanner``: the
    bookkeeping, and the device planner's ``bad_ids`` / ``skipped_updates`` counts),
    ``stats`` (``TableStats``), ``host_weight`` / ``host_state`` (the host tier: current
    after a flush) and ``cache_weight`` / ``cache_state`` (the cache).

    Use: ``plan`` / ``plan_ids`` (or ``lookup.plan_table_batch``) -> ``FetchEngine.issue``
    and ``wait`` -> ``lookup.pooled_lookup`` -> backward (the fused update; pins released)
    -> ``FetchEngine.flush`` before reading the host tier.
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
        planner: str = "host",
        host_on_device: Optional[Sequence[torch.Tensor]] = None,
        disk: Optional[DiskHostTier] = None,
    ) -> None:
        if host_weight.dim() != 2:
            raise InvalidInputError(
                f"table '{name}': host weight must be 2-D [rows, dim], got shape {tuple(host_weight.shape)}"
            )
        if not host_weight.is_floating_point():
            raise InvalidInputError(f"table '{name}': host weight must be floating point, got {host_weight.dtype}")
        if num_slots < 1:
            raise CacheCapacityError(f"table '{name}': cache needs at least 1 slot, got num_slots={num_slots}")
        if planner not in PLANNERS:
            raise InvalidInputError(f"table '{name}': planner={planner!r}; use one of {sorted(PLANNERS)}")
        if planner == "device" and segment_slots is not None:
            # The device planner's victim window and ``pinned_bound`` cover one slot range.
            raise InvalidInputError(
                f"table '{name}': per-table cache budgets in one store (segment_slots={list(segment_slots)}) "
                f"are planned on the host only; use the sharder's planner='host', or one store per table "
                f"(TorchRec's use_one_tbe_per_table fused param)"
            )
        if disk is not None and (planner != "host" or host_weight.device.type != "meta"):
            # The disk hop reads a batch's rows on the host when it is planned, so its plan is
            # made there too (on CUDA as on the CPU: a device plan would be read back for it).
            raise InvalidInputError(
                f"table '{name}': a table on disk is planned on the host (planner='host'), and its host_weight "
                f"is a meta tensor giving its shape (got planner={planner!r}, host_weight on "
                f"{host_weight.device}); build it with TieredTable.on_disk"
            )
        self.disk = disk
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
        self._mapped_state: Dict[str, torch.Tensor] = {}  # state allocated host-mapped here: its device views
        for key, shape in optimizer.state_shapes(self.dim).items():
            given = (host_state or {}).get(key)
            want = (self.num_rows, *shape)
            if given is not None and tuple(given.shape) != want:
                raise InvalidInputError(
                    f"table '{name}': optimizer state '{key}' has shape {tuple(given.shape)}, expected {want}"
                )
            if given is None and disk is not None:
                given = torch.empty(want, dtype=torch.float32, device="meta")  # (on disk: shape only)
            elif given is None:
                # On CUDA the GPU addresses it (its moves need no bounce buffer): host-mapped
                # at its exact size (FBGEMM's allocation, host_memory.mapped_zeros), else
                # pinned (PyTorch's caching host allocator: rounded up to a power of two).
                cuda = self.device.type == "cuda" and torch.cuda.is_available()
                made = mapped_zeros(want, torch.float32, self.device) if cuda else None
                if made is not None:
                    given, self._mapped_state[key] = made
                else:
                    given = torch.zeros(want, dtype=torch.float32, pin_memory=cuda)
            self.exposed_state[key] = given
            self.host_state[key] = given.data
        # (A table on disk hands no host tensor out: nobody writes its host tier in place.)
        self._exposed = [] if disk is not None else [self.exposed_weight, *self.exposed_state.values()]
        self._seen_versions = [t._version for t in self._exposed]
        # Set by the owner of the data moves (the fetch engine's ``run``): moves plans in their
        # turn behind every queued move and waits. Only an update that comes after its plan's
        # pins ended needs it (see ``apply_gradients``).
        self.move_now: Optional[Callable[[List[FetchPlan]], Any]] = None
        # The table's optimizer step counter (FBGEMM's TBE ``iter``: Adam's bias correction,
        # and the step that keys stochastic rounding). As in FBGEMM it advances on every
        # forward, eval included (``count_forward``); an update no forward counted advances it
        # itself. ``steps`` is the tensor a checkpoint holds; the count is kept on the host
        # too, so that counting reads no tensor (see ``step_count``).
        self.steps = torch.zeros((), dtype=torch.int64)
        self._host_step: Optional[int] = 0
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
        self.policy = EvictionPolicy.parse(policy)
        self.hot_rows = None if hot_rows is None else torch.unique(hot_rows.to(torch.int64))
        if self.hot_rows is not None:
            self.validate_rows(self.hot_rows)
            self._check_hot_rows_per_segment()
            if self.hot_rows.numel() >= self.num_slots:
                raise CacheCapacityError(
                    f"table '{name}': {self.hot_rows.numel()} permanently hot rows leave no slot for cold "
                    f"rows in a cache of {self.num_slots} slots"
                )
        self.stats = TableStats()
        self._in_flight = 0  # plans issued and not yet released
        # On disk, the one plan in flight whose rows did not fit the host cache: its host
        # tier is read and written through the cache a chunk at a time (see ``_issue``).
        self._chunked_plan: Optional[FetchPlan] = None
        self.host_overflow_reason = ""
        self.planner: HostPlanner | DevicePlanner = PLANNERS[planner](self)
        dtype = self.host_weight.dtype
        rows = self.planner.cache_rows
        self.cache_weight = torch.zeros(rows, self.dim, dtype=dtype, device=self.device)
        self.cache_state = {k: torch.zeros((rows, *v.shape[1:]), dtype=v.dtype, device=self.device)
                            for k, v in self.host_state.items()}
        #: Slot ids from here on name a plan's overflow rows (past every cache row).
        self.overflow_base = rows
        self.row_bytes = self.dim * host_weight.element_size() + sum(
            v[0].numel() * v.element_size() for v in self.host_state.values() if v.shape[0]
        )
        self.host_on_device = self._host_on_device(host_on_device)

    @classmethod
    def on_disk(cls, name: str, num_rows: int, dim: int, optimizer: OptimizerConfig, num_slots: int,
                directory: str | Path, host_cache_bytes: int, initial_weight: Optional[torch.Tensor] = None,
                dtype: torch.dtype = torch.float32, io_threads: int = 64, file_name: Optional[str] = None,
                **kwargs: Any) -> "TieredTable":
        """A table whose rows live in a file under ``directory`` (``file_name``, default
        ``<name>.rows``; removed at :meth:`close`), served through a host cache of ``host_cache_bytes`` and a device
        cache of ``num_slots`` rows. ``initial_weight`` (``[num_rows, dim]``, streamed in;
        default zeros) and zero optimizer state are written to the file first.
        ``io_threads``: disk requests in flight at most (this machine's disk reaches its
        reads/s with about 64). A directory that cannot hold the file is one
        ``DiskTierError`` naming the table and the file."""
        components = _disk_components(dim, optimizer, dtype)
        _, record = record_layout(components)
        file = RowFile(Path(directory) / (file_name or f"{name}.rows"), num_rows, record, table=name,
                       io_threads=io_threads)
        try:
            disk = DiskHostTier(file, components, max(1, int(host_cache_bytes) // record))
            if initial_weight is not None:
                rows = torch.arange(num_rows)
                state = [torch.zeros(num_rows, c.width) for c in components[1:]]
                disk.write_rows(rows, [initial_weight.to(dtype), *state])
            return cls(name, torch.empty(num_rows, dim, dtype=dtype, device="meta"), optimizer, num_slots,
                       disk=disk, **kwargs)
        except BaseException:
            file.close()
            raise

    def _host_on_device(self, given: Optional[Sequence[torch.Tensor]]) -> Optional[List[torch.Tensor]]:
        """The host tier (weight, then each optimizer state, as ``gather_host`` orders them)
        as the cache's device addresses it: the tensors themselves off CUDA; on CUDA, FBGEMM
        host-mapped UVM views over the same bytes, given by the owner, or pinned tensors'
        device views, or None (then moves go through pinned staging, see fetch/cuda.py)."""
        hosts = [self.host_weight, *self.host_state.values()]
        if self.disk is not None:
            return None
        if given is None and self.device.type != "cuda":
            return hosts
        if given is None:
            aliases = [device_alias(self.host_weight, self.device)]
            aliases += [self._mapped_state.get(key) if key in self._mapped_state else device_alias(t, self.device)
                        for key, t in self.host_state.items()]
            return None if any(a is None for a in aliases) else aliases
        given = list(given)
        # (device types, not devices: the table's ``cuda`` and its tensors' ``cuda:0`` are one)
        if [tuple(t.shape) for t in given] != [tuple(t.shape) for t in hosts] or any(
                t.device.type != self.device.type for t in given):
            raise InvalidInputError(
                f"table '{self.name}': host_on_device must be the host tier's {len(hosts)} tensors "
                f"(weight, then {list(self.host_state)}) as {self.device} addresses them"
            )
        return given

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

    def segment_slot_ranges(self) -> Optional[List[Tuple[int, int]]]:
        """Per segment, the slot range ``[lo, hi)`` its rows live in (``segment_slots``);
        None when every segment shares the whole cache."""
        return None if self._slot_ranges is None else list(self._slot_ranges)

    def _check_hot_rows_per_segment(self) -> None:
        if self._slot_ranges is None or self.hot_rows is None:
            return
        hot = self.hot_rows.numpy()
        for seg, (lo, hi) in zip(self.segments, self._slot_ranges):
            k = int(np.count_nonzero((hot >= seg.start) & (hot < seg.start + seg.num_rows)))
            if k and k >= hi - lo and hi - lo < seg.num_rows:
                raise CacheCapacityError(
                    f"table '{seg.name}' (store '{self.name}'): {k} permanently hot rows leave no slot for cold "
                    f"rows in its cache of {hi - lo} slots"
                )

    @property
    def plans_on_device(self) -> bool:
        """Whether this table's planner keeps its bookkeeping on the cache's device."""
        return self.planner.on_device

    @property
    def owner_stream(self) -> Optional[object]:
        """The CUDA stream that owns the cache and its bookkeeping (device planner), if any."""
        return self.planner.owner_stream

    # ------------------------------------------------------------------ the step counter
    def count_forward(self, plan: FetchPlan) -> None:
        """A forward looks up ``plan``: advance the step counter, as FBGEMM's TBE does on
        every forward (training or not), and keep the value for the plan's update."""
        plan.optimizer_step = self._advance_step()

    def _advance_step(self) -> int:
        # Counted on the host: no tensor read (under the sync detector, host tensors are
        # fake too).
        self._host_step = self.step_count() + 1
        self.steps.fill_(self._host_step)
        return self._host_step

    def step_count(self) -> int:
        """Optimizer steps taken; re-read from ``steps`` after a load (``invalidate``)."""
        if self._host_step is None:
            self._host_step = int(self.steps)
        return self._host_step

    @property
    def step(self) -> int:
        """The optimizer step counter (settable, e.g. when a checkpoint is loaded)."""
        return self.step_count()

    @step.setter
    def step(self, value: int) -> None:
        self.steps.fill_(int(value))
        self._host_step = int(value)

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
        """
        self._check_plan_rows(rows)
        return self._plan(rows, depth_hint, overflow)

    def _plan(self, rows: torch.Tensor, depth_hint: Optional[int], overflow: bool) -> FetchPlan:
        """``plan`` for rows that are unique and sorted by construction (``unique_rows``)."""
        return self._issue(self.planner.plan_rows(rows, depth_hint, overflow), overflow)

    def plan_ids(self, ids: torch.Tensor, depth_hint: Optional[int] = None, overflow: bool = False,
                 check_ids: bool = True, mapping: Optional[RowMapping] = None) -> FetchPlan:
        """Plans and pins the rows of ``ids`` (store rows in any order, duplicates allowed; or
        ids that ``mapping`` turns into store rows). ``plan.inverse`` maps each id to its
        entry of ``plan.rows``. The device planner reads nothing on the host here (bad ids
        are counted on the device: ``planner.bad_ids``); the host planner refuses them."""
        return self._issue(self.planner.plan_ids(ids, depth_hint, overflow, check_ids, mapping), overflow)

    def _issue(self, plan: FetchPlan, overflow: bool = False) -> FetchPlan:
        """A plan the planner made is in flight until ``release``. On disk, the disk moves
        that bring its rows into the host cache are queued now, ahead of its fills; a host
        cache too small for them refuses the plan, changing nothing - unless the plan may
        overflow and nothing else is in flight or pinned there: then its rows pass through
        the host cache a chunk at a time (:meth:`_through_host_cache`), so a host cache of
        any size serves any batch, exactly, as the device cache's overflow does."""
        self._in_flight += 1
        if self.disk is not None:
            try:
                plan.disk_ticket = self.disk.prefetch(*self._disk_rows(plan))
            except HostCacheCapacityError as e:
                if not (overflow and self._in_flight == 1 and self.disk.pinned_rows() == 0):
                    self._refuse(plan)
                    raise
                self._chunked_plan = plan
                plan.through_host_cache = True
                self.stats.host_overflow_plans += 1
                #: Why the last such plan did not fit (the refusal it would have been), for messages.
                self.host_overflow_reason = str(e).removesuffix(". Nothing changed")
            except BaseException:
                self._refuse(plan)
                raise
        return plan

    def _refuse(self, plan: FetchPlan) -> None:
        """Undoes a plan the disk tier refused, its counts included (the host planner counted
        it when it made it): a batch deferred and planned again counts once."""
        self.rollback(plan)
        self.release(plan)
        self._count(plan, -1)

    def _disk_rows(self, plan: FetchPlan) -> Tuple[np.ndarray, np.ndarray]:
        """The rows the plan reads in the host tier (its fills, its overflow rows) and those
        it only writes whole (its write-backs: no read from the file)."""
        _, nf, nwb, no = plan.resolve_sizes()
        # (A preload - every row of a device cache as large as the table, or its hot rows -
        # is read through the host cache in chunks at transfer, not pinned there at once.)
        pre = plan.num_preloaded
        parts = [plan.fill_rows.narrow(0, pre, nf - pre)]
        if plan.overflow_rows is not None:
            parts.append(plan.overflow_rows.narrow(0, 0, no))
        reads = torch.cat([p.to("cpu", torch.int64) for p in parts]).numpy()
        return reads, plan.writeback_rows.narrow(0, 0, nwb).to("cpu", torch.int64).numpy()

    def stage_rows(self, rows: torch.Tensor | np.ndarray, skip_cached: bool = True) -> "Stage":
        """Stages a future batch: pins its ``rows`` (store rows, any order, duplicates
        allowed) in the host cache and queues their disk reads now, so that the disk hop
        runs further ahead than the host->device hop. Plan the batch later (its disk moves
        then find the rows read or on their way) and :meth:`unstage` after planning it.

        Staging changes only which rows are where, never a value: the table trains
        bit-identically whatever is staged, and a stage never unstaged only holds host
        cache. ``skip_cached``: rows the device cache holds now are not staged (their fill,
        should they be evicted before the plan, is read at plan time). Off disk it does
        nothing. Raises ``CacheCapacityError``, changing nothing, when the host cache cannot
        hold the rows beside those pinned by batches in flight and staged (one line: the
        table, the rows needed, the host cache it would take)."""
        r = rows.to("cpu", torch.int64).numpy() if isinstance(rows, torch.Tensor) else np.asarray(rows, np.int64)
        r = np.unique(r.reshape(-1))
        if r.size:
            self.validate_rows(torch.from_numpy(r[[0, -1]]))
        if self.disk is None:
            return Stage(self.name, int(r.size), None)
        if skip_cached and r.size and not self.holds_every_row:
            r = r[self.planner.row_to_slot.numpy()[r] < 0]
        return Stage(self.name, int(r.size), self.disk.prefetch(r, kind="stage"))

    def unstage(self, stage: "Stage") -> None:
        """Drops a stage's pins (idempotent). Its rows stay in the host cache until evicted;
        reads still landing land first."""
        if stage.ticket is not None and not stage.released and self.disk is not None:
            self.disk.release(stage.ticket)
        stage.released = True

    def _disk_ready(self, plan: FetchPlan) -> None:
        """Waits until the plan's rows are in the host cache (a plan made without disk moves
        - flush, refresh - queues them now, in their turn; it fails only for its own reads:
        the fetch engine's flush marks every dirty row clean up front, so a fault of earlier
        moves must not stop its chunks midway; ``flush_to_disk`` raises it)."""
        if self.disk is None or plan is self._chunked_plan:
            return
        if plan.disk_ticket is None:
            plan.disk_ticket = self.disk.prefetch(*self._disk_rows(plan), kind="bulk")
            self.disk.wait(plan.disk_ticket, report_faults=False)
            return
        self.disk.wait(plan.disk_ticket)

    def _disk_release(self, plan: FetchPlan, keep_overflow: bool = False) -> None:
        """Unpins the plan's pages in the host cache - after its moves, or, for a plan with
        overflow rows (read at lookup, updated in backward there), at its release."""
        if self.disk is None or plan.disk_ticket is None:
            return
        if keep_overflow and plan.overflow_rows is not None and plan.num_overflow:
            return
        self.disk.release(plan.disk_ticket)

    def _sizes_known(self, plan: FetchPlan) -> None:
        """A plan's sizes reached the host (at once for the host planner, later for the
        device planner's): the statistics count them, once per plan."""
        self.planner.sizes_known(plan)
        self._count(plan, 1)

    def _count(self, plan: FetchPlan, sign: int) -> None:
        st = self.stats
        st.lookups_rows += sign * plan.num_rows
        st.hits += sign * plan.num_hits
        st.rows_fetched += sign * plan.num_fills
        st.rows_written_back += sign * plan.num_writebacks
        st.bytes_moved += sign * plan.bytes_to_move
        st.overflow_rows += sign * plan.num_overflow

    @property
    def in_flight(self) -> int:
        """Plans made and not yet released."""
        return self._in_flight

    def pinned_slots(self) -> int:
        """Slots pinned now by batches in flight (for messages; the device planner reads the
        device)."""
        return self.planner.pinned_slots()

    # ------------------------------------------------------------------ data moves
    @torch.no_grad()
    def transfer(self, plan: FetchPlan) -> None:
        """Executes the plan's data moves at once (the CPU transports call this).

        Order matters: dirty victims are written back before the misses overwrite their slots.
        ``plan.stage`` records progress so that a failure can be rolled back exactly. A plan
        whose sizes the host does not know yet moves with ``enqueue_moves`` (its padding
        entries do nothing), so that nothing is read back for it.
        """
        if plan.sizes is None and plan.overflow_rows is None and self.host_on_device is not None:
            self.enqueue_moves(plan)
            return
        _, num_fills, num_wb, _ = plan.resolve_sizes()
        self.begin_moves(plan)
        if num_wb:
            self.write_back(plan.writeback_slots.narrow(0, 0, num_wb), plan.writeback_rows.narrow(0, 0, num_wb))
        plan.stage = "written_back"
        first = self.fill_preloaded(plan)
        if num_fills > first:
            self.fill(plan.fill_slots.narrow(0, first, num_fills - first),
                      self.gather_host(plan.fill_rows.narrow(0, first, num_fills - first).to("cpu")))
        plan.stage = "done"
        self.end_moves(plan)

    # The host-tier side of a plan's moves, for every transport (``transfer`` above, and the
    # CUDA copy stream's worker, fetch/cuda.py): between ``begin_moves`` and ``end_moves`` it
    # reads the host tier with ``gather_host`` and writes it with ``put_host``, never the
    # tensors themselves - a table on disk has none (its rows pass through its host cache).
    def begin_moves(self, plan: FetchPlan) -> None:
        """Before a plan's write-backs: its rows are in the host tier (on disk: read into the
        host cache, and its write-backs' records have their slots there)."""
        self._disk_ready(plan)

    def end_moves(self, plan: FetchPlan) -> None:
        """After a plan's fills were gathered: the host cache may evict its rows again (those
        of its overflow stay pinned until its release: they are read at lookup)."""
        self._disk_release(plan, keep_overflow=True)

    def fill_preloaded(self, plan: FetchPlan) -> int:
        """Fills the plan's first ``num_preloaded`` fills (a device cache as large as the table,
        or its hot rows) on disk, read through the host cache a chunk at a time: more rows than
        it holds at once. Returns how many it filled (0 off disk: they are fills like any)."""
        if self.disk is None or not plan.num_preloaded:
            return 0
        first = plan.num_preloaded
        self._fill_from_disk(plan.fill_slots.narrow(0, 0, first), plan.fill_rows.narrow(0, 0, first).to("cpu"))
        return first

    def _fill_from_disk(self, slots: torch.Tensor, rows: torch.Tensor, chunk: int = 65536) -> None:
        """Fills ``slots`` with ``rows`` read through the host cache a chunk at a time (a
        preload may be the whole table: more rows than the host cache holds)."""
        step = self._host_chunk(chunk)
        for at in range(0, rows.shape[0], step):
            part = rows[at: at + step]
            weight, *state = self.disk.read_rows(part)
            self.fill(slots[at: at + step],
                      [weight] + [p.reshape(p.shape[0], *v.shape[1:]) for p, v in zip(state, self.host_state.values())])

    @torch.no_grad()
    def enqueue_moves(self, plan: FetchPlan) -> None:
        """The plan's write-backs, then its fills, as ``move_rows_`` ops on the current
        stream: one per tensor and direction, at the plan's padded length, their padding
        entries (sentinel rows) doing nothing. Reads nothing on the host, so whoever issues
        the plan enqueues its moves and goes on (see fetch/cuda.py). Needs
        ``host_on_device``; a plan with overflow goes through :meth:`transfer`."""
        if self.host_on_device is None:
            raise StoreStateError(f"table '{self.name}': its host tier is not addressable from {self.device}")
        caches = [self.cache_weight, *self.cache_state.values()]
        R = self.num_rows
        for cache, host in zip(caches, self.host_on_device):
            move_rows_(_as_rows(host), plan.writeback_rows, _as_rows(cache), plan.writeback_slots,
                       plan.writeback_rows, R)
        plan.stage = "written_back"
        for cache, host in zip(caches, self.host_on_device):
            move_rows_(_as_rows(cache), plan.fill_slots, _as_rows(host), plan.fill_rows, plan.fill_rows, R)
        plan.stage = "done"

    def gather_host(self, rows: torch.Tensor, out: Optional[Sequence[torch.Tensor]] = None) -> List[torch.Tensor]:
        """The host tier's weight and state rows ``rows`` (host indices), in that order (on
        disk: rows in the host cache, pinned by their plan). ``out``: 2-D ``[len(rows),
        elements per row]`` tensors to gather into (e.g. pinned staging), returned as they are."""
        if self._chunked_plan is not None:
            parts = self._through_host_cache(rows)
            if out is None:
                return parts
            for o, part in zip(out, parts):
                o.copy_(part.reshape(o.shape))
            return list(out)
        if out is not None:
            if self.disk is not None:
                return self.disk.gather(rows, out=out)
            for host, o in zip([self.host_weight, *self.host_state.values()], out):
                torch.index_select(host.view(host.shape[0], -1), 0, rows, out=o)
            return list(out)
        if self.disk is not None:
            weight, *state = self.disk.gather(rows)
            return [weight] + [p.reshape(p.shape[0], *v.shape[1:]) for p, v in zip(state, self.host_state.values())]
        return [self.host_weight.index_select(0, rows)] + [v.index_select(0, rows) for v in self.host_state.values()]

    def _through_host_cache(self, rows: torch.Tensor) -> List[torch.Tensor]:
        """``gather_host`` for the plan whose rows do not fit the host cache: read through it
        a chunk at a time (each chunk's reads queued in their turn behind every earlier disk
        move, so a row written back before is read as written)."""
        weight, *state = self.disk.read_rows(rows.to(torch.int64))
        return [weight] + [p.reshape(p.shape[0], *v.shape[1:]) for p, v in zip(state, self.host_state.values())]

    def put_host(self, rows: torch.Tensor, parts: Sequence[torch.Tensor]) -> None:
        """Writes the host tier's rows ``rows`` (weight, then each state, on the host; any
        shape with ``len(rows)`` rows of the right elements)."""
        if self._chunked_plan is not None:
            self.disk.write_rows(rows.to(torch.int64), [p.reshape(p.shape[0], -1) for p in parts])
            return
        if self.disk is not None:
            self.disk.scatter(rows, parts)
            return
        for host, part in zip([self.host_weight, *self.host_state.values()], parts):
            host.index_copy_(0, rows, part.view(part.shape[0], *host.shape[1:]))

    def fill(self, slots: torch.Tensor, parts: List[torch.Tensor]) -> None:
        """Writes rows (weight, then each state, as ``gather_host`` orders them) into ``slots``."""
        slots = slots.to(self.device)
        for cache, part in zip([self.cache_weight, *self.cache_state.values()], parts):
            cache.index_copy_(0, slots, part.to(cache.device, non_blocking=True))

    def write_back(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Copies the cache's ``slots`` into the host tier's ``rows`` (weight and state)."""
        slots, host_rows = slots.to(self.device), rows.to("cpu")
        self.put_host(host_rows, [cache.index_select(0, slots).to("cpu")
                                   for cache in [self.cache_weight, *self.cache_state.values()]])

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
        self.planner.rollback(plan)
        plan.stage = "done"

    # ------------------------------------------------------------------ backward
    @torch.no_grad()
    def apply_gradients(self, plan: FetchPlan, row_grads: torch.Tensor, checked: bool = False,
                        ok: Optional[torch.Tensor] = None, consume: bool = False) -> None:
        """Applies the fused optimizer to the plan's rows and releases the plan.

        ``row_grads[i]`` is the gradient of ``plan.rows[i]`` summed over the batch (a device
        plan's padding rows have zero gradients and live in the trash slots). A device plan
        whose sizes the host knows may be given its unique rows' gradients only (the first
        ``plan.num_rows`` rows: the padding's are zero), so the update touches those rows and
        no padding (``lookup.update_length``). Non-finite gradients are refused before
        anything is written (``checked``: the caller already verified that they are finite).
        ``ok`` (a 0-d device bool; device planner) skips the update without a host read when
        False: every row keeps its value and state. ``consume``: ``row_grads`` is the
        caller's scratch, which the update may overwrite (fewer bytes moved).
        """
        self.planner.check_owner()
        m = int(row_grads.shape[0]) if row_grads.dim() == 2 else -1
        unique_only = plan.planned_on_device and plan.sizes is not None and plan.sizes[0] <= m < plan.n
        if row_grads.dim() != 2 or int(row_grads.shape[1]) != self.dim or (m != plan.n and not unique_only):
            raise InvalidInputError(
                f"table '{self.name}': gradient shape {tuple(row_grads.shape)} does not match ({plan.n}, {self.dim})"
            )
        # One reduction instead of an elementwise mask: NaN and Inf propagate through a sum.
        if ok is None and not checked and not bool(torch.isfinite(row_grads.sum())):
            self.release(plan)
            raise InvalidInputError(
                f"table '{self.name}': non-finite gradient reached the store; "
                f"the update was skipped and the table is unchanged"
            )
        step = plan.optimizer_step or self._advance_step()  # (looked up without a counted forward)
        if plan.released:
            if unique_only:  # (the slow path plans the plan's n rows again: the padding's gradients are zero)
                row_grads = torch.cat([row_grads, row_grads.new_zeros(plan.n - m, self.dim)])
            plan, row_grads = self._plan_again(plan, row_grads)
            consume = True
        slots, grads, rows, over_rows, over_grads = self.planner.split_overflow(plan, row_grads)
        # A skipped update (``ok`` False) is computed all the same and written to the trash
        # slots: fixed-shape, no host decision, and no copy of the rows to select from.
        target = None if ok is None else torch.where(ok, slots, self.planner.trash_slots(int(slots.shape[0])))
        # The gradients stay FP32 whatever the table's dtype: FBGEMM computes the update in
        # FP32 and rounds the new row once (``update_rows``).
        update_rows(self.optimizer, self.cache_weight, self.cache_state, slots, grads, step,
                    self._stochastic_rows(rows, self.device), target=target,
                    scratch_grad=consume or grads is not row_grads)
        if over_rows is not None:
            self._update_overflow(over_rows, over_grads, step, ok)  # type: ignore[arg-type]
        self.planner.mark_dirty(plan)
        self.stats.updates += 1
        self.release(plan)

    def _plan_again(self, plan: FetchPlan, row_grads: torch.Tensor) -> Tuple[FetchPlan, torch.Tensor]:
        """A plan whose pins ended before its update came (its owner's next training forward
        came first): its rows may have been evicted or be about to move. They are planned
        again (rows that do not fit are updated in the host tier) and moved in their turn
        behind every queued move, so the update lands where each row is - the same result
        as an update while pinned, on the critical path. The gradients follow their rows."""
        if self.move_now is None:
            raise StoreStateError(
                f"table '{self.name}': the update of a batch came after its rows were released, and this "
                f"store has no fetch engine to bring them back (set move_now)"
            )
        again, row_grads = self.planner.replan(plan, row_grads)
        self._issue(again)
        try:
            self.move_now([again])
        except BaseException:
            self.release(again)
            raise
        self.stats.late_updates += 1
        return again, row_grads

    def _update_overflow(self, rows: torch.Tensor, grads: torch.Tensor, step: int,
                         ok: Optional[torch.Tensor]) -> None:
        """The fused update of overflow rows (held only in the host tier): gathered onto the
        cache's device and updated there by the same ops as the cache's rows, then written
        back. On CUDA the host's arithmetic would differ from the device's in the last bits,
        so a row would train differently depending on whether it overflowed: the cache size
        would change results. (On the CPU this is the in-place update, bit for bit.)"""
        host_rows = rows.to("cpu")
        dev = self.device
        old = dict(zip(["weight", *self.host_state], (p.to(dev, non_blocking=True) for p in self.gather_host(host_rows))))
        new = {k: v.clone() for k, v in old.items()}
        weight = new.pop("weight")
        local = torch.arange(host_rows.shape[0], device=dev)
        update_rows(self.optimizer, weight, new, local, grads.to(dev), step, self._stochastic_rows(rows, dev))
        new["weight"] = weight
        self.put_host(host_rows, [(new[key] if ok is None else torch.where(ok, new[key], old[key])).to("cpu")
                                   for key in ["weight", *self.host_state]])

    def _stochastic_rows(self, rows: torch.Tensor, where: torch.device) -> Optional[torch.Tensor]:
        """The row ids keying stochastic rounding when FBGEMM's CUDA kernels would round the
        table's updates stochastically (FP16 tables with ``stochastic_rounding`` on a CUDA
        device); None where FBGEMM rounds to nearest (its CPU kernel ignores the flag)."""
        if not (self.device.type == "cuda" and self.optimizer.stochastic_rounding
                and self.cache_weight.dtype == torch.float16):
            return None
        return rows.to(where)

    def release(self, plan: FetchPlan) -> None:
        """Unpins the plan's slots (idempotent)."""
        if plan.released:
            return
        self.planner.unpin(plan)
        self._disk_release(plan)
        if plan is self._chunked_plan:
            self._chunked_plan = None
        plan.released = True
        self._in_flight -= 1

    # ------------------------------------------------------------------ host tier
    def plan_flush(self, chunk: int = 65536) -> List[FetchPlan]:
        """Plans that write every dirty slot back (no fills, no pins; the device planner's in
        chunks of ``chunk`` slots, for bounded staging); the slots are clean from now on, so
        the write-backs must be executed (by the fetch engine, in order). On disk, chunks
        of at most half the host cache's rows, so that each chunk's pages fit it."""
        return self.planner.flush_plans(self._host_chunk(chunk))

    def _host_chunk(self, chunk: int) -> int:
        if self.disk is None:
            return chunk
        return max(1, min(chunk, self.disk.num_slots // 2))

    def flush_to_disk(self) -> None:
        """Writes the host cache's dirty pages to the table's file (after a flush of the
        device cache, the file is then the whole table). No-op off disk."""
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        """Stops the disk tier's I/O and removes its file (a table on disk; else nothing)."""
        if self.disk is not None:
            self.disk.close()

    def plan_refresh(self, chunk: int = 65536) -> List[FetchPlan]:
        """Plans that copy every cached row from the host tier again, for a host tier that
        was loaded while batches are in flight: their pinned rows then hold the loaded values,
        as a resident table's would. No victims, no pins; every slot is clean afterwards (the
        dirty rows were flushed before the load, and the host tier is now the truth)."""
        return self.planner.refresh_plans(self._host_chunk(chunk))

    def has_dirty(self) -> bool:
        """Whether some cached row holds an update the host tier lacks."""
        return self.planner.has_dirty()

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

    @torch.no_grad()
    def adopt_host_writes(self, chunk: int = 65536) -> Tuple[int, int]:
        """Makes the cache take what the host tier's owner wrote in place, row by row.

        A clean cached row equals its host copy bit for bit until someone writes that copy,
        so each clean row (weight, and each optimizer state, on its own) whose host copy
        differs was written, and the cache takes that tensor's row from the host; every
        other row keeps its value. A dirty row's host copy is behind its cache, so a write
        there cannot be told from the old value: it keeps its cached value and is counted.
        Write the cache back (a flush) before writing, as the TorchRec kernel's live views
        do, and there is none.

        Returns ``(rows taken, dirty rows not compared)``. O(cached rows), on a write only;
        call it with no move queued (the fetch engine drained)."""
        self.planner.check_owner(claim=False)
        if self.disk is not None:
            return 0, 0  # (nobody holds its host tier: nothing was written behind the cache)
        slots, rows, dirty = self.planner.resident()
        behind = int(dirty.sum())
        slots, rows = slots[~dirty], rows[~dirty]
        hosts = [self.host_weight, *self.host_state.values()]
        caches = [self.cache_weight, *self.cache_state.values()]
        taken = torch.zeros(rows.shape[0], dtype=torch.bool)
        for start in range(0, rows.shape[0], chunk):
            part = slice(start, start + chunk)
            s_dev, r = slots[part].to(self.device), rows[part]
            for host, cache in zip(hosts, caches):
                now = host.index_select(0, r)
                changed = _bits(now).ne(_bits(cache.index_select(0, s_dev).to("cpu"))).any(1)
                if bool(changed.any()):
                    cache.index_copy_(0, s_dev[changed.to(self.device)], now[changed].to(self.device))
                    taken[part] |= changed
        return int(taken.sum()), behind

    @torch.no_grad()
    def read_host_rows(self, start: int, count: int) -> List[torch.Tensor]:
        """Rows ``[start, start + count)`` of the host tier (weight, then each optimizer
        state, as ``gather_host`` orders them): fresh tensors, read through the host cache on
        disk. Current after a flush of the device cache (the caller's job: the kernel's
        ``before_host_access``); no plan need be in flight."""
        self._check_range(start, count)
        rows = torch.arange(start, start + count, dtype=torch.int64)
        if self.disk is not None:
            weight, *state = self.disk.read_rows(rows)
            return [weight] + [p.reshape(p.shape[0], *v.shape[1:]) for p, v in zip(state, self.host_state.values())]
        return [t.narrow(0, start, count).clone() for t in (self.host_weight, *self.host_state.values())]

    @torch.no_grad()
    def write_host_rows(self, start: int, parts: Sequence[Optional[torch.Tensor]]) -> None:
        """Writes rows ``[start, start + n)`` of the host tier: per tensor (weight, then each
        optimizer state), its new rows, or None to keep that tensor's rows. Cached copies of
        those rows take the new values too, so the next lookup sees them - pinned rows of
        batches in flight included, as a resident table's would. Needs a clean cache and no
        move queued (flush and drain the fetch engine first: a queued write-back would
        overwrite the write)."""
        count = next(int(p.shape[0]) for p in parts if p is not None)
        self._check_range(start, count)
        if self.has_dirty():
            raise StoreStateError(f"table '{self.name}': rows are written to the host tier only with a clean cache; "
                                  f"flush it first (the TorchRec kernel's views do)")
        rows = torch.arange(start, start + count, dtype=torch.int64)
        hosts = [self.host_weight, *self.host_state.values()]
        if self.disk is not None:
            old = self.read_host_rows(start, count) if any(p is None for p in parts) else [None] * len(parts)
            full = [(p if p is not None else o).reshape(count, -1) for p, o in zip(parts, old)]
            self.disk.write_rows(rows, full)
        else:
            for host, part in zip(hosts, parts):
                if part is not None:
                    host.narrow(0, start, count).copy_(part.reshape(host.narrow(0, start, count).shape))
        slots, resident, _ = self.planner.resident()
        hit = (resident >= start) & (resident < start + count)
        if bool(hit.any()):
            s_dev = slots[hit].to(self.device)
            for cache, part in zip([self.cache_weight, *self.cache_state.values()], parts):
                if part is not None:
                    vals = part.reshape(count, *cache.shape[1:]).index_select(0, resident[hit] - start)
                    cache.index_copy_(0, s_dev, vals.to(self.device, cache.dtype))

    def _check_range(self, start: int, count: int) -> None:
        if start < 0 or count < 0 or start + count > self.num_rows:
            raise InvalidInputError(f"table '{self.name}': rows [{start}, {start + count}) are not in its rows "
                                    f"[0, {self.num_rows})")

    def invalidate(self) -> None:
        """Drops every cached row without writing back (after the host tier was overwritten).

        Dirty rows are lost by design here: flush them first (through the fetch engine) when
        they matter, as ``purge`` in the TorchRec kernel does."""
        self.planner.check_owner(claim=False)
        if self.in_flight:
            raise StoreStateError(
                f"table '{self.name}': cannot invalidate the cache while {self._in_flight} "
                f"batch(es) are in flight; drain the pipeline first"
            )
        self.planner.clear()
        self._host_step = None  # the host tier (and ``steps``) may have been loaded

    def bookkeeping_bytes(self) -> int:
        """Bytes of maps, pins, flags and eviction state (not the cache or the host tier)."""
        return self.planner.bookkeeping_bytes()

    def host_tier_bytes(self) -> int:
        return self.num_rows * self.row_bytes

    def resident_rows(self) -> torch.Tensor:
        """Rows currently mapped to a slot."""
        return self.planner.resident_rows()

    # ------------------------------------------------------------------ debugging
    def check_invariants(self, expect_drained: bool = False) -> None:
        """Verifies maps, pins and dirty state; raises ``StoreStateError`` on the first breach."""
        problems = self.planner.check_invariants(expect_drained)
        if self.disk is not None:
            self.disk.check_invariants(expect_drained)
        if expect_drained and self._in_flight != 0:
            problems.append(f"{self._in_flight} plans left after drain")
        if problems:
            raise StoreStateError(f"table '{self.name}': " + "; ".join(problems))

    def __repr__(self) -> str:
        return (
            f"TieredTable(name={self.name!r}, rows={self.num_rows}, dim={self.dim}, slots={self.num_slots}, "
            f"planner={'device' if self.plans_on_device else 'host'}, policy={self.policy.value}, "
            f"optim={self.optimizer.optim.value})"
        )


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Rows as integers of their elements' bits ``[n, width]`` (a bitwise comparison: NaNs
    equal, -0 and +0 not)."""
    flat = t.reshape(t.shape[0], -1)
    return flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """A host-tier or cache tensor as ``[rows, width]`` (row-wise optimizer state is 1-D)."""
    return t.view(t.shape[0], -1)
