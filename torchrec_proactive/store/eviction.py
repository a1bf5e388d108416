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
        # -1 = never used: empty slots sort first.
        self.last_used = torch.full((num_slots,), -1, dtype=torch.int64)
        # LFU counts accesses per *row*, so a row that comes back keeps its history.
        self.row_freq: Optional[torch.Tensor] = (
            torch.zeros(num_rows, dtype=torch.int32) if policy is EvictionPolicy.LFU else None
        )

    def touch(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Records one access of ``rows`` held in ``slots`` (one batch = one tick)."""
        self._tick += 1
        self.last_used[slots] = self._tick
        if self.row_freq is not None:
            self.row_freq[rows] += 1

    def pick_victims(
        self, n: int, pins: torch.Tensor, permanent: torch.Tensor, slot_to_row: torch.Tensor
    ) -> torch.Tensor:
        """Up to ``n`` evictable slots, lowest rank first; exactly ``n`` whenever the cache
        has that many (fewer means the whole cache was scanned and that is all there is)."""
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        size = min(self.num_slots, max(WINDOW_FACTOR * n, MIN_WINDOW))
        if size < self.num_slots:
            start, end = self._hand, self._hand + size
            free = self._evictable(pins, permanent, start, min(end, self.num_slots))
            if end > self.num_slots:  # the window wraps around the end of the cache
                free = torch.cat([free, self._evictable(pins, permanent, 0, end - self.num_slots)])
            if free.numel() >= n:
                self._hand = end % self.num_slots
                return self._lowest(free, n, slot_to_row)
        free = torch.nonzero((pins == 0) & ~permanent).flatten()
        if free.numel() <= n:
            return free
        return self._lowest(free, n, slot_to_row)

    @staticmethod
    def _evictable(pins: torch.Tensor, permanent: torch.Tensor, start: int, end: int) -> torch.Tensor:
        return torch.nonzero((pins[start:end] == 0) & ~permanent[start:end]).flatten().add_(start)

    def _lowest(self, candidates: torch.Tensor, n: int, slot_to_row: torch.Tensor) -> torch.Tensor:
        if candidates.numel() == n:
            return candidates
        score = self.last_used.index_select(0, candidates)
        if self.row_freq is not None:
            rows = slot_to_row.index_select(0, candidates)
            occupied = rows >= 0
            freq = self.row_freq.index_select(0, rows.clamp(min=0)).long()
            # Frequency first, recency breaks ties; empty slots (-1) stay first.
            score = torch.where(occupied, freq * (self._tick + 2) + score + 1, -1)
        return candidates.index_select(0, torch.topk(score, n, largest=False, sorted=False).indices)
