"""``FetchPlan``: what one batch (or one flush or refresh chunk) needs from one table.

One type whichever planner made it (``host_planner.py``: exact lists on the host;
``device_planner.py``: fixed-shape lists on the cache's device). Its lists are *compacted*:
the first ``num_fills`` entries of ``fill_rows``/``fill_slots`` are real, and so on; a device
plan pads the rest with sentinel rows (``>= table.num_rows``) that every move skips, a host
plan has no padding. A plan's sizes reach the host when its planner made them there (at
once), or later from a copy queued behind its moves (``poll_sizes``) - never by a wait on
the training thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, List, Optional, Protocol, Sequence, Tuple

import torch

from .errors import StoreStateError
from .fixed_shape import SegmentCuts

_SIZES_LOCK = threading.Lock()

#: A plan's sizes: unique rows, fills, write-backs, overflow rows.
Sizes = Tuple[int, int, int, int]


class PlanTable(Protocol):
    """What a plan and a planner use of the table they belong to (``TieredTable``, which
    imports this module: the protocol keeps the dependency one way)."""

    name: str
    device: torch.device
    num_rows: int
    num_slots: int
    holds_every_row: bool
    segments: Sequence[Any]
    hot_rows: Optional[torch.Tensor]
    policy: Any
    row_bytes: int
    overflow_base: int
    cache_weight: torch.Tensor
    host_weight: torch.Tensor

    @property
    def in_flight(self) -> int: ...

    def segment_slot_ranges(self) -> Optional[List[Tuple[int, int]]]: ...

    def validate_rows(self, rows: torch.Tensor) -> None: ...

    def _sizes_known(self, plan: "FetchPlan") -> None: ...

    def gather_host(self, rows: torch.Tensor) -> List[torch.Tensor]: ...


@dataclass(eq=False)
class FetchPlan:
    """One batch's rows on one table. Made by ``TieredTable.plan`` / ``plan_ids``.

    ``rows`` are the batch's unique rows (sorted; real ones first) and ``slots[i]`` holds
    ``rows[i]`` once the transfer is done. ``fill_*`` are the misses, ``writeback_*`` the
    dirty victims. ``overflow_rows`` (planned with ``overflow=True`` only) did not fit in
    the cache: they are read from and updated in the host tier, and ``slots`` names them
    ``overflow_base + j`` so that one lookup serves both kinds.

    ``stage`` says how far its data moves got: ``"planned"``, ``"written_back"`` (the dirty
    victims are in the host tier), ``"done"`` (the fills are in, or enqueued in order on the
    copy stream): a lookup needs ``"done"``. ``released``: its pins have ended.
    """

    table: PlanTable
    rows: torch.Tensor
    slots: torch.Tensor
    fill_rows: torch.Tensor
    fill_slots: torch.Tensor
    writeback_rows: torch.Tensor
    writeback_slots: torch.Tensor
    overflow_rows: Optional[torch.Tensor] = None
    #: The sizes on the host, once known; ``counts`` holds them on the device until then.
    sizes: Optional[Sizes] = None
    counts: Optional[torch.Tensor] = None
    #: Per id of the batch, its entry of ``rows`` (a device plan maps its ids itself; a host
    #: plan's caller keeps the inverse of its ``unique_rows``).
    inverse: Optional[torch.Tensor] = None
    #: Where the backward cuts the ids' gradients (``fixed_shape.segment_cuts``), planned with
    #: the ids on a GPU; None where row gradients are summed otherwise.
    grad_cuts: Optional[SegmentCuts] = None
    released: bool = False
    preload: bool = False  # the fills include the rows resident from the start
    num_preloaded: int = 0  # how many of the fills those are
    # The table's step counter as this batch's forward advanced it (0: no forward counted it,
    # the update then advances the counter itself). See ``TieredTable.count_forward``.
    optimizer_step: int = 0
    # How far the data moves got: "planned" -> "written_back" -> "done". Set by whoever
    # moves the bytes (a transport); read by ``TieredTable.rollback`` after a failure.
    stage: str = "planned"
    #: The disk tier's moves that bring the plan's rows into the host cache (a table on
    #: disk only: ``TieredTable(disk=...)``), issued when the plan is made.
    disk_ticket: Any = field(default=None, repr=False)
    #: On disk: its rows outgrew the host cache and move through it a chunk at a time
    #: (``TieredTable._issue``).
    through_host_cache: bool = False
    #: On a GPU, the event after the plan (and its lookup recipe) on the planner's own
    #: stream: whoever reads its outputs on another stream waits for it (plan_stream.py).
    planned_event: Any = field(default=None, repr=False)
    #: The planner's number for this plan in flight (the device planner's bound is kept by it).
    bound_key: Optional[int] = field(default=None, repr=False)
    _device_slots: Optional[torch.Tensor] = field(default=None, repr=False)
    _overflow_weight: Optional[torch.Tensor] = field(default=None, repr=False)
    _sizes_copy: Optional[torch.Tensor] = field(default=None, repr=False)  # pinned, behind the moves
    _sizes_event: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.sizes is None and self.counts is None:  # exact lists: their lengths are the sizes
            self.sizes = (int(self.rows.shape[0]), int(self.fill_rows.shape[0]), int(self.writeback_rows.shape[0]),
                          0 if self.overflow_rows is None else int(self.overflow_rows.shape[0]))

    @property
    def n(self) -> int:
        """The length of the plan's lists (padding included)."""
        return int(self.rows.shape[0])

    @property
    def planned_on_device(self) -> bool:
        """Whether the plan's lists live on the device and may carry padding."""
        return self.counts is not None

    # ------------------------------------------------------------------ sizes
    def take_sizes(self, sizes: Sizes) -> None:
        """Hands the plan's sizes to the host; the table counts them (once per plan, whichever
        thread gets them first: the training thread, the fetch worker, or autograd's device
        thread, where the backward asks for them - ``lookup.update_length``)."""
        with _SIZES_LOCK:
            if self.sizes is not None and self.counts is not None:
                return
            self.sizes = tuple(int(v) for v in sizes)  # type: ignore[assignment]
            self.table._sizes_known(self)  # noqa: SLF001 - the table's bookkeeping of its own plan

    def resolve_sizes(self) -> Sizes:
        """The plan's sizes, waiting for its planning on the device if need be (call it where
        waiting is free: the fetch worker, a drain, the overflow path)."""
        if self.sizes is None:
            self.take_sizes(tuple(self.counts.tolist()))  # type: ignore[union-attr,arg-type]
        return self.sizes  # type: ignore[return-value]

    def read_sizes_later(self) -> None:
        """Queues a copy of the sizes into pinned host memory on the current stream (the
        planner's, right after the plan; else the one that ran the plan's moves) and records
        when it lands; :meth:`poll_sizes` reads it. Once per plan."""
        if self.sizes is not None or self.counts is None or self.counts.device.type != "cuda" \
                or not torch.cuda.is_available() or self._sizes_event is not None:
            return
        self._sizes_copy = torch.empty(self.counts.shape, dtype=self.counts.dtype, pin_memory=True)
        self._sizes_copy.copy_(self.counts, non_blocking=True)
        self._sizes_event = torch.cuda.current_stream(self.counts.device).record_event()

    def poll_sizes(self) -> bool:
        """Whether the host knows the plan's sizes, reading them where that costs no wait: at
        once off CUDA, or once the copy of :meth:`read_sizes_later` has landed."""
        if self.sizes is not None:
            return True
        if self.counts.device.type == "cpu":  # type: ignore[union-attr]
            self.resolve_sizes()
            return True
        if self._sizes_event is None or not self._sizes_event.query():
            return False
        self.take_sizes(tuple(self._sizes_copy.tolist()))  # type: ignore[union-attr,arg-type]
        return True

    def _size(self, i: int) -> int:
        if self.sizes is None:
            raise StoreStateError(
                f"table '{self.table.name}': the sizes of a device plan are known once its fetch ran"
            )
        return self.sizes[i]

    @property
    def num_rows(self) -> int:
        """The batch's distinct rows (``StoreStateError`` until the sizes reached the host)."""
        return self._size(0)

    @property
    def num_fills(self) -> int:
        """Rows copied into the cache (misses, and the preload the first plan carries)."""
        return self._size(1)

    @property
    def num_writebacks(self) -> int:
        """Dirty victims copied back to the host tier."""
        return self._size(2)

    @property
    def num_overflow(self) -> int:
        """Rows served from the host tier because the cache could not take them."""
        return 0 if self.overflow_rows is None else self._size(3)

    @property
    def num_hits(self) -> int:
        """The batch's rows already in the cache (preloaded rows count as hits: they are
        moved, but not because this batch missed them)."""
        return self.num_rows - (self.num_fills - self.num_preloaded) - self.num_overflow

    @property
    def bytes_to_move(self) -> int:
        """Bytes of weights and optimizer state the fills and write-backs move."""
        return self.table.row_bytes * (self.num_fills + self.num_writebacks)

    # ------------------------------------------------------------------ lookup
    def device_slots(self) -> torch.Tensor:
        """``slots`` on the cache's device (a host plan's copied once)."""
        if self.slots.device.type == self.table.device.type:  # (types: ``cuda`` and ``cuda:0`` are one)
            return self.slots
        if self._device_slots is None:
            self._device_slots = self.slots.to(self.table.device)
        return self._device_slots

    def lookup_weight(self) -> torch.Tensor:
        """What ``slots`` below ``overflow_base`` index: the cache."""
        return self.table.cache_weight

    @property
    def overflow_base(self) -> int:
        """Slot ids from here on name overflow rows: ``overflow_base + j`` is ``overflow_rows[j]``."""
        return self.table.overflow_base

    @property
    def overflow_weight(self) -> Optional[torch.Tensor]:
        """The overflow rows' weights on the cache's device: staged by the transport, or read
        from the host tier at the first call (nobody else holds those rows: see
        ``TieredTable.plan``); the batch's own rows only, never a copy of the cache."""
        if self.overflow_rows is None or not self.num_overflow:
            return None
        if self._overflow_weight is None:
            rows = self.overflow_rows.narrow(0, 0, self.num_overflow).to("cpu")
            self._overflow_weight = self.table.gather_host(rows)[0].to(self.table.device)
        return self._overflow_weight

    @overflow_weight.setter
    def overflow_weight(self, value: Optional[torch.Tensor]) -> None:
        self._overflow_weight = value
