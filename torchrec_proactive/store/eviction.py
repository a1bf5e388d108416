"""Eviction policies: which unpinned cache slots give way to missing rows.

A policy only *ranks* slots. A slot is evictable when no in-flight batch pins it and it is
not permanently hot; the store pins a batch's own hits before it asks for victims, so they
are never chosen. Empty slots always go first. Which slots are chosen never changes the
math, only the hit rate: lookups and updates are defined on rows, not on slots.

Victims are searched in a window of the cache that a clock hand moves around it (sampled
LRU/LFU, as in Redis; FBGEMM's cache is set-associative for the same reason): a batch costs
a few vector ops over about ``WINDOW_FACTOR x`` its misses, not over every slot. Only when a
window holds too few evictable slots is the whole cache scanned, so a victim is found
whenever one exists.

A store serving several tables may split its slots into per-table ranges (``ranges``): a
table's victims then come only from its own range, each range with its own clock hand, so a
table's cache never holds more rows than its budget. Without ranges the whole cache is one
range and the choices are those of a single table's cache.
"""

from __future__ import annotations

import enum
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

#: Candidates examined per victim needed (the window size, before clamping to the cache).
WINDOW_FACTOR = 2
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
    """Per-slot recency (and per-row frequency for LFU) bookkeeping on the host.

    Works on NumPy arrays (the store hands it views of its bookkeeping tensors): a batch's
    ranking is a handful of small vector ops, where NumPy's per-op cost is a fraction of
    eager PyTorch's dispatch."""

    def __init__(self, policy: EvictionPolicy, num_slots: int, num_rows: int,
                 ranges: Optional[Sequence[Tuple[int, int]]] = None) -> None:
        self.policy = policy
        self.num_slots = num_slots
        self._tick = 0
        # Per slot range ``[lo, hi)``: where its next victim window starts. One range, the
        # whole cache, unless the store partitions its slots among its tables.
        self.ranges: List[Tuple[int, int]] = list(ranges) if ranges is not None else [(0, num_slots)]
        self.hands: List[int] = [lo for lo, _ in self.ranges]
        # 0 = never used (ticks start at 1): empty slots sort first.
        self.last_used = torch.zeros(num_slots, dtype=torch.int64)
        # LFU counts accesses per *row*, so a row that comes back keeps its history.
        self.row_freq: Optional[torch.Tensor] = (
            torch.zeros(num_rows, dtype=torch.int32) if policy is EvictionPolicy.LFU else None
        )
        self._last_used = self.last_used.numpy()  # views: the tensors stay the owners
        self._row_freq = None if self.row_freq is None else self.row_freq.numpy()

    def touch(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """Records one access of ``rows`` (unique) held in ``slots`` (one batch = one tick)."""
        self._tick += 1
        self._last_used[slots] = self._tick
        if self._row_freq is not None:
            self._row_freq[rows] += 1  # (unique rows: a buffered fancy add is exact)

    def count_evictable(self, pins: np.ndarray, permanent: Optional[np.ndarray], part: int = 0) -> int:
        """Slots of range ``part`` no in-flight batch pins and no permanently hot row holds:
        how many victims ``pick_victims`` can find there at most (one pass, no ranking)."""
        lo, hi = self.ranges[part]
        free = pins[lo:hi] == 0
        if permanent is not None:
            free &= ~permanent[lo:hi]
        return int(np.count_nonzero(free))

    def pick_victims(
        self, n: int, pins: np.ndarray, permanent: Optional[np.ndarray], slot_to_row: np.ndarray, part: int = 0
    ) -> np.ndarray:
        """Up to ``n`` evictable slots (int64) of range ``part``, lowest rank first; exactly
        ``n`` whenever the range has that many (fewer means the whole range was scanned and
        that is all there is). ``permanent`` may be None when no slot is permanently hot (one
        mask op fewer)."""
        if n == 0:
            return np.empty(0, dtype=np.int64)
        lo, hi = self.ranges[part]
        span = hi - lo
        size = min(span, max(WINDOW_FACTOR * n, MIN_WINDOW))
        if size < span:
            start = self.hands[part]
            end = start + size
            if end <= hi:
                victims = self._lowest(n, pins, permanent, slot_to_row, start, end)
            else:  # the window wraps around the end of the range
                victims = self._lowest(n, pins, permanent, slot_to_row, start, hi, lo, lo + end - hi)
            if victims is not None:
                self.hands[part] = lo + (end - lo) % span
                return victims
        return self._lowest_of_all(n, pins, permanent, slot_to_row, lo, hi)

    def _scores(self, pins: np.ndarray, permanent: Optional[np.ndarray], slot_to_row: np.ndarray,
                start: int, end: int) -> np.ndarray:
        """Rank of each slot in ``[start, end)``; at least ``_UNEVICTABLE`` for pinned or
        permanent slots."""
        if self._row_freq is None:
            # LRU: recency plus _UNEVICTABLE per pin (ticks stay below it: one tick per
            # batch; pins count in-flight batches, so the sum cannot overflow).
            score = pins[start:end].astype(np.int64)
            score *= _UNEVICTABLE
            score += self._last_used[start:end]
            if permanent is not None:
                score[permanent[start:end]] += _UNEVICTABLE
            return score
        blocked = pins[start:end] != 0
        if permanent is not None:
            blocked |= permanent[start:end]
        rows = slot_to_row[start:end]
        freq = self._row_freq[np.maximum(rows, 0)].astype(np.int64)
        # Frequency first, recency breaks ties; empty slots (-1) stay first.
        score = np.where(rows >= 0, freq * (self._tick + 2) + self._last_used[start:end] + 1, -1)
        np.minimum(score, _UNEVICTABLE - 1, out=score)
        score[blocked] = _UNEVICTABLE
        return score

    def _lowest(self, n: int, pins: np.ndarray, permanent: Optional[np.ndarray], slot_to_row: np.ndarray,
                start: int, end: int, start2: int = 0, end2: int = 0) -> Optional[np.ndarray]:
        """The ``n`` lowest-ranked evictable slots of ``[start, end)`` (+ ``[start2, end2)``),
        or None when those ranges hold fewer than ``n``. One partial sort over the ranges, no
        mask: the blocked slots rank last, so a blocked slot among the chosen means there
        were not enough."""
        score = self._scores(pins, permanent, slot_to_row, start, end)
        if end2 > start2:
            score = np.concatenate([score, self._scores(pins, permanent, slot_to_row, start2, end2)])
        index = _smallest(score, n)
        if score[index].max() >= _UNEVICTABLE:
            return None
        if end2 > start2:
            # Positions past the first range belong to the second one.
            first = end - start
            return np.where(index < first, index + start, index - first + start2)
        return index + start

    def _lowest_of_all(self, n: int, pins: np.ndarray, permanent: Optional[np.ndarray],
                       slot_to_row: np.ndarray, lo: int, hi: int) -> np.ndarray:
        score = self._scores(pins, permanent, slot_to_row, lo, hi)
        free = int(np.count_nonzero(score < _UNEVICTABLE))
        victims = _smallest(score, min(n, free))
        if lo:
            victims += lo
        return victims


def _smallest(score: np.ndarray, k: int) -> np.ndarray:
    """Positions (int64) of the ``k`` smallest scores, in no particular order."""
    if k >= score.shape[0]:
        return np.arange(score.shape[0], dtype=np.int64)
    if k == 0:
        return np.empty(0, dtype=np.int64)
    return np.argpartition(score, k - 1)[:k].astype(np.int64, copy=False)


#: A slot ranked this high or higher may not be evicted (it is pinned or permanently hot).
#: Above every real rank (LRU ticks, one per batch, never reach 2**40; LFU ranks are
#: clamped to it), yet small enough that a few pins' worth of it still fits in an int64.
_UNEVICTABLE = 2**40
