"""Eviction policies: which unpinned cache slots give way to missing rows.

A policy only *ranks* slots. The store decides which slots are eligible (not pinned by an
in-flight batch, not permanently hot) and asks the policy for the ``n`` lowest-ranked ones.
Empty slots always go first. Which slots are chosen never changes the math, only the
hit rate: lookups and updates are defined on rows, not on slots.
"""

from __future__ import annotations

import enum
from typing import Optional

import torch

_NEVER = torch.iinfo(torch.int64).max


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
        self._tick = 0
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
        self, n: int, eligible: torch.Tensor, slot_to_row: torch.Tensor
    ) -> torch.Tensor:
        """The ``n`` eligible slots to evict (caller checked there are at least ``n``)."""
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        if self.row_freq is None:
            score = self.last_used.clone()
        else:
            occupied = slot_to_row >= 0
            freq = torch.zeros_like(self.last_used)
            freq[occupied] = self.row_freq[slot_to_row[occupied]].long()
            # Frequency first, recency breaks ties; empty slots (-1) stay first.
            score = torch.where(occupied, freq * (self._tick + 2) + self.last_used + 1, -1)
        score = score.masked_fill(~eligible, _NEVER)
        return torch.topk(score, n, largest=False, sorted=False).indices
