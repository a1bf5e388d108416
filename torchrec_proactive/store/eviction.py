"""Eviction policies: which unpinned cache slots give way to missing rows.

A policy only *ranks* slots. A slot is evictable when no in-flight batch pins it and it is
not permanently hot; the store pins a batch's own hits before it asks for victims, so they
are never chosen. Empty slots always go first. Which slots are chosen never changes the
math, only the hit rate: lookups and updates are defined on rows, not on slots.

Victims are searched in a window of the cache that a clock hand moves around it (sampled
LRU/LFU, as in Redis; FBGEMM's cache is set-associative for the same reason): a batch costs
a few tensor ops over about ``WINDOW_FACTOR x`` its misses, not over every slot. Only when a
window holds too few evictable slots is the whole cache scanned, so a victim is found
whenever one exists.
"""

from __future__ import annotations

import enum
from typing import Optional

import torch

#: Candidates examined per victim needed (the window size, before clamping to the cache).
WINDOW_FACTOR = 4
#: Smallest window, so that tiny batches still choose among a fair sample.
MIN_WINDOW = 1024


class EvictionPolicy(str, enum.Enum):
    LRU = "lru"
    LFU = "lfu"

    @classmethod
    def parse(cls, value: object) -> "EvictionPolicy":
        """Accepts the string, this enum or FBGEMM's ``CacheAlgorithm`` (``LRU``/``LFU``)."""
        raw = getattr(value, "name", value)
        try:
            return cls(str(raw).lower())
        except ValueError:
            raise ValueError(f"unknown eviction policy {value!r}; use 'lru' or 'lfu'") from None


class SlotRanking:
    """Per-slot recency (and per-row frequency for LFU) bookkeeping on the host."""

    def __init__(self, policy: EvictionPolicy, num_slots: int, num_rows: int) -> None:
        self.policy = policy
        self.num_slots = num_slots
        self._tick = 0
        self._hand = 0  # where the next victim window starts
        # 0 = never used (ticks start at 1): empty slots sort first.
        self.last_used = torch.zeros(num_slots, dtype=torch.int64)
        # LFU counts accesses per *row*, so a row that comes back keeps its history.
        self.row_freq: Optional[torch.Tensor] = (
            torch.zeros(num_rows, dtype=torch.int32) if policy is EvictionPolicy.LFU else None
        )

    def touch(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Records one access of ``rows`` held in ``slots`` (one batch = one tick)."""
        self._tick += 1
        self.last_used.index_fill_(0, slots, self._tick)
        if self.row_freq is not None:
            self.row_freq[rows] += 1

    def pick_victims(
        self, n: int, pins: torch.Tensor, permanent: Optional[torch.Tensor], slot_to_row: torch.Tensor
    ) -> torch.Tensor:
        """Up to ``n`` evictable slots, lowest rank first; exactly ``n`` whenever the cache
        has that many (fewer means the whole cache was scanned and that is all there is).
        ``permanent`` may be None when no slot is permanently hot (one mask op fewer)."""
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        size = min(self.num_slots, max(WINDOW_FACTOR * n, MIN_WINDOW))
        if size < self.num_slots:
            start, end = self._hand, self._hand + size
            if end <= self.num_slots:
                victims = self._lowest(n, pins, permanent, slot_to_row, start, end)
            else:  # the window wraps around the end of the cache
                victims = self._lowest(n, pins, permanent, slot_to_row, start, self.num_slots, 0, end - self.num_slots)
            if victims is not None:
                self._hand = end % self.num_slots
                return victims
        return self._lowest_of_all(n, pins, permanent, slot_to_row)

    def _scores(self, pins: torch.Tensor, permanent: Optional[torch.Tensor], slot_to_row: torch.Tensor,
                start: int, end: int) -> torch.Tensor:
        """Rank of each slot in ``[start, end)``; at least ``_UNEVICTABLE`` for pinned or
        permanent slots."""
        if self.row_freq is None:
            # LRU: recency plus _UNEVICTABLE per pin, in one op (ticks stay below it: one
            # tick per batch; pins count in-flight batches, so the sum cannot overflow).
            score = torch.add(self.last_used[start:end], pins[start:end], alpha=_UNEVICTABLE)
            if permanent is not None:
                score.add_(permanent[start:end], alpha=_UNEVICTABLE)
            return score
        blocked = pins[start:end] != 0
        if permanent is not None:
            blocked |= permanent[start:end]
        rows = slot_to_row[start:end]
        freq = self.row_freq.index_select(0, rows.clamp(min=0)).long()
        # Frequency first, recency breaks ties; empty slots (-1) stay first.
        score = torch.where(rows >= 0, freq * (self._tick + 2) + self.last_used[start:end] + 1, -1)
        return score.clamp_(max=_UNEVICTABLE - 1).masked_fill_(blocked, _UNEVICTABLE)

    def _lowest(self, n: int, pins: torch.Tensor, permanent: Optional[torch.Tensor], slot_to_row: torch.Tensor,
                start: int, end: int, start2: int = 0, end2: int = 0) -> Optional[torch.Tensor]:
        """The ``n`` lowest-ranked evictable slots of ``[start, end)`` (+ ``[start2, end2)``),
        or None when those ranges hold fewer than ``n``. One ``topk`` over the ranges, no
        ``nonzero``: the blocked slots rank last, so a blocked slot among the chosen means
        there were not enough."""
        score = self._scores(pins, permanent, slot_to_row, start, end)
        if end2 > start2:
            score = torch.cat([score, self._scores(pins, permanent, slot_to_row, start2, end2)])
        values, index = torch.topk(score, n, largest=False, sorted=False)
        if int(values.max()) >= _UNEVICTABLE:
            return None
        if end2 > start2:
            # Positions past the first range belong to the second one.
            first = end - start
            return torch.where(index < first, index + start, index - first + start2)
        return index.add_(start)

    def _lowest_of_all(self, n: int, pins: torch.Tensor, permanent: Optional[torch.Tensor],
                       slot_to_row: torch.Tensor) -> torch.Tensor:
        score = self._scores(pins, permanent, slot_to_row, 0, self.num_slots)
        free = int((score < _UNEVICTABLE).sum())
        return torch.topk(score, min(n, free), largest=False, sorted=False).indices


#: A slot ranked this high or higher may not be evicted (it is pinned or permanently hot).
#: Above every real rank (LRU ticks, one per batch, never reach 2**40; LFU ranks are
#: clamped to it), yet small enough that a few pins' worth of it still fits in an int64.
_UNEVICTABLE = 2**40
