"""Miss-ratio curves of one table (or shard) from batch-granular reuse distances, in one pass.

The store plans a batch's distinct rows together: its hits are the rows already cached, its
misses are filled, and victims come from the rows no batch in flight holds. With batches
planned in arrival order, the rows of the ``k + 1`` batches in flight are the most recently
planned ones, so as long as the cache holds those ``k + 1`` batches' rows (``pinned_rows``)
eviction of the least recently planned row is plain LRU over *batches*, and an LRU cache of
``C`` slots after batch ``b - 1`` holds exactly the ``C`` most recently planned rows. A row
of batch ``b`` whose previous use was at flattened position ``s`` therefore hits iff fewer
than ``C`` distinct rows were planned after ``s`` up to the end of batch ``b - 1`` - its
*reuse distance* ``d``: ``hit <=> d < C``. (Rows of one batch are ordered by id; that order
breaks the ties between rows last used in the same batch.) One pass with a Fenwick tree over
positions (a mark at each row's latest position) gives every ``d``, hence the curve for every
cache size at once. Below ``pinned_rows`` batches cannot be planned ahead (they wait for
pins or are served from the host tier): the curve says 1.0 there.

The store's device planner (``TieredTable(planner="device")``, CUDA) pins more: until a
batch's sizes come back to the host it counts the batch as pinning one slot per id (repeats
included), so its floor is ``pinned_ids``, the most ids of any ``k + 1`` consecutive batches
(at most the table's rows). :meth:`MissRatioCurve.for_planner` gives the curve with the
floor of the planner a run uses.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Dict, List, Sequence

import numpy as np
from torchrec.distributed.types import CacheStatistics

__all__ = ["reuse_distances", "pinned_rows", "pinned_ids", "MissRatioCurve"]

#: At most this many points are kept per curve (exact for tables up to this many rows).
MAX_POINTS = 4097


def _fenwick_add(tree: np.ndarray, index: np.ndarray, value: int) -> None:
    """Adds ``value`` at every (1-based) ``index``, all levels vectorised."""
    index = index.copy()
    while index.size:
        np.add.at(tree, index, value)
        index = index + (index & -index)
        index = index[index < tree.size]


def _fenwick_prefix(tree: np.ndarray, index: np.ndarray) -> np.ndarray:
    """Sum of marks at positions ``1..index`` for every (1-based) ``index``."""
    out = np.zeros(index.shape, dtype=np.int64)
    index = index.copy()
    while True:
        live = index > 0
        if not live.any():
            return out
        out[live] += tree[index[live]]
        index[live] = index[live] - (index[live] & -index[live])


def reuse_distances(steps: Sequence[np.ndarray]) -> List[np.ndarray]:
    """Per batch, the reuse distance of each of its distinct rows (sorted by id), ``-1`` for a
    row never planned before (a cold miss at every cache size)."""
    batches = [np.unique(np.asarray(ids, dtype=np.int64)) for ids in steps]
    total = sum(b.size for b in batches)
    tree = np.zeros(total + 1, dtype=np.int64)  # marks at 1-based flattened positions
    last_pos = np.zeros(0, dtype=np.int64)  # by row id: latest 1-based position, 0 = never
    distinct, end = 0, 0
    out: List[np.ndarray] = []
    for rows in batches:
        if rows.size and rows[-1] >= last_pos.size:
            grown = np.zeros(max(int(rows[-1]) + 1, 2 * last_pos.size), dtype=np.int64)
            grown[: last_pos.size] = last_pos
            last_pos = grown
        prev = last_pos[rows] if rows.size else np.zeros(0, dtype=np.int64)
        seen = prev > 0
        d = np.full(rows.size, -1, dtype=np.int64)
        # distinct rows planned after `prev`, up to the end of the previous batch
        d[seen] = distinct - _fenwick_prefix(tree, prev[seen])
        out.append(d)
        _fenwick_add(tree, prev[seen], -1)
        pos = end + 1 + np.arange(rows.size, dtype=np.int64)
        _fenwick_add(tree, pos, 1)
        last_pos[rows] = pos
        distinct += int((~seen).sum())
        end += rows.size
    return out


def pinned_rows(steps: Sequence[np.ndarray], depth: int) -> int:
    """Most distinct rows of any ``depth + 1`` consecutive batches: what the cache must hold
    for the pipeline to plan ``depth`` batches ahead (their rows are pinned until backward)."""
    if depth < 0:
        raise ValueError(f"depth must be >= 0, got {depth!r}")
    batches = [np.unique(np.asarray(ids, dtype=np.int64)) for ids in steps]
    width = min(depth + 1, len(batches))
    return max((np.unique(np.concatenate(batches[t:t + width])).size
                for t in range(len(batches) - width + 1)), default=0)


def pinned_ids(steps: Sequence[np.ndarray], depth: int) -> int:
    """Most ids (repeats included) of any ``depth + 1`` consecutive batches: the slots the
    device planner counts those batches as pinning while their sizes are not back yet."""
    if depth < 0:
        raise ValueError(f"depth must be >= 0, got {depth!r}")
    counts = np.array([np.asarray(ids).size for ids in steps], dtype=np.int64)
    width = min(depth + 1, counts.size)
    if not width:
        return 0
    sums = np.convolve(counts, np.ones(width, dtype=np.int64), mode="valid")
    return int(sums.max())


@dataclass(frozen=True)
class MissRatioCurve(CacheStatistics):
    """TorchRec's ``CacheStatistics`` for one table (or shard) at one prefetch depth.

    ``hits[i]`` warm accesses of the measured batches hit a cache of ``sizes[i]`` slots
    (``sizes`` increasing from 0 to ``num_rows``; between points the curve is interpolated
    linearly, exact when every size is a point). ``accesses`` counts distinct rows per
    batch, summed; ``expected_lookups`` is its mean per batch (TorchRec's "distinct values in
    a global batch"). Invariant: ``0 <= hits <= accesses``, non-decreasing in size.
    """

    num_rows: int
    depth: int
    num_batches: int
    accesses: int
    pinned_rows: int
    sizes: tuple = field(repr=False)
    hits: tuple = field(repr=False)
    pinned_ids: int = -1  # -1: not measured (a curve made before it was): taken as pinned_rows

    def __post_init__(self) -> None:
        if self.pinned_ids < 0:
            object.__setattr__(self, "pinned_ids", self.pinned_rows)

    @classmethod
    def from_steps(cls, steps: Sequence[np.ndarray], num_rows: int, depth: int = 0, warmup: int = 0,
                   max_points: int = MAX_POINTS) -> "MissRatioCurve":
        """The curve of one table's per-batch ids (``steps[t]``: ids of global batch ``t``);
        batches before ``warmup`` only fill the cache (they are not counted)."""
        if num_rows < 1:
            raise ValueError(f"num_rows must be >= 1, got {num_rows!r}")
        if not 0 <= warmup < max(len(steps), 1):
            raise ValueError(f"warmup must be in [0, {len(steps)}) batches, got {warmup!r}")
        top = max((int(np.max(ids)) for ids in steps if len(ids)), default=0)
        low = min((int(np.min(ids)) for ids in steps if len(ids)), default=0)
        if top >= num_rows or low < 0:
            raise ValueError(f"ids must lie in [0, num_rows={num_rows}), got ids in [{low}, {top}]")
        counted = reuse_distances(steps)[warmup:]
        d = np.concatenate(counted) if counted else np.zeros(0, dtype=np.int64)
        warm = np.sort(d[d >= 0])
        sizes = np.unique(np.linspace(0, num_rows, min(max_points, num_rows + 1)).round().astype(np.int64))
        hits = np.searchsorted(warm, sizes, side="left")  # distances < size
        return cls(num_rows=int(num_rows), depth=int(depth), num_batches=len(counted), accesses=int(d.size),
                   pinned_rows=pinned_rows(steps, depth), sizes=tuple(int(s) for s in sizes),
                   hits=tuple(int(h) for h in hits), pinned_ids=min(pinned_ids(steps, depth), int(num_rows)))

    @classmethod
    def combine_shards(cls, shards: Sequence["MissRatioCurve"], max_points: int = MAX_POINTS) -> "MissRatioCurve":
        """The table's curve when each (row-wise) shard caches ``clf x`` its own rows: hits
        summed over the shards at every load factor; the table's ``min_load_factor`` is the
        largest shard's, since every shard must hold its own pinned rows."""
        if not shards or len({s.num_batches for s in shards}) != 1 or len({s.depth for s in shards}) != 1:
            raise ValueError("combine_shards needs curves of the same batches and depth")
        num_rows = sum(s.num_rows for s in shards)
        clfs = np.unique(np.concatenate([np.asarray(s.sizes, dtype=np.float64) / s.num_rows for s in shards]))
        if clfs.size > max_points:
            clfs = np.unique(np.concatenate([clfs[np.linspace(0, clfs.size - 1, max_points).round().astype(int)]]))
        floor = max(s.min_load_factor for s in shards)
        id_floor = max(s.pinned_ids / s.num_rows for s in shards)
        hits = [sum(s.hit_rows(c * s.num_rows) for s in shards) if c >= floor else 0.0 for c in clfs]
        sizes = [c * num_rows for c in clfs]
        return cls(num_rows=num_rows, depth=shards[0].depth, num_batches=shards[0].num_batches,
                   accesses=sum(s.accesses for s in shards), pinned_rows=int(np.ceil(floor * num_rows - 1e-9)),
                   sizes=tuple(float(x) for x in sizes), hits=tuple(float(h) for h in hits),
                   pinned_ids=min(num_rows, int(np.ceil(id_floor * num_rows - 1e-9))))

    def for_planner(self, on_device: bool) -> "MissRatioCurve":
        """This curve with the floor of the store's planner: ``pinned_rows`` on the host
        planner (itself), ``max(pinned_rows, pinned_ids)`` on the device planner (which
        counts a batch by its ids until its sizes come back)."""
        if not on_device or self.pinned_ids <= self.pinned_rows:
            return self
        return dataclasses.replace(self, pinned_rows=min(self.num_rows, self.pinned_ids))

    # -- TorchRec's CacheStatistics -----------------------------------------------------------

    @property
    def expected_lookups(self) -> float:
        return self.accesses / self.num_batches if self.num_batches else 0.0

    # (The planners call these a few hundred thousand times: the points are made arrays once.)
    @cached_property
    def _points(self) -> "tuple[np.ndarray, np.ndarray]":
        return np.asarray(self.sizes, dtype=np.float64), np.asarray(self.hits, dtype=np.float64)

    def hit_rows(self, num_slots: float) -> float:
        """Warm accesses a cache of ``num_slots`` slots hits (0 below ``pinned_rows``)."""
        if num_slots < self.pinned_rows:
            return 0.0
        sizes, hits = self._points
        return float(np.interp(num_slots, sizes, hits))

    def expected_miss_rate(self, clf: float) -> float:
        """Misses per distinct row looked up with ``clf x num_rows`` slots: 1 at 0, 0 at 1
        (TorchRec's contract: a load factor of 1 is the table resident, nothing fetched).
        1.0 also below ``min_load_factor``: a cache that cannot hold the rows ``depth + 1``
        batches pin cannot be planned ahead, and the planner never sizes one there."""
        if clf >= 1.0:
            return 0.0
        if clf <= 0.0 or not self.accesses:
            return 1.0 if clf <= 0.0 else 0.0
        return 1.0 - self.hit_rows(clf * self.num_rows) / self.accesses

    @cached_property
    def cacheability(self) -> float:
        """Area under the miss-ratio curve over load factors 0..1 (0: trivially cacheable,
        1: every lookup misses at any size), as TorchRec's ``EmbeddingOffloadStats`` defines it."""
        # the mean over load factors in [0, 1) (the cold misses stay up to the end)
        if not self.accesses:
            return 0.0
        clfs = (np.arange(256) + 0.5) / 256
        sizes, hits = self._points
        slots = clfs * self.num_rows
        hit = np.where(slots < self.pinned_rows, 0.0, np.interp(slots, sizes, hits))
        return float(np.mean(1.0 - hit / self.accesses))

    @property
    def min_load_factor(self) -> float:
        """The smallest load factor that holds the pinned rows of ``depth + 1`` batches."""
        return min(1.0, self.pinned_rows / self.num_rows)

    # -- JSON ---------------------------------------------------------------------------------

    def to_dict(self) -> Dict[str, Any]:
        return {"num_rows": self.num_rows, "depth": self.depth, "num_batches": self.num_batches,
                "accesses": self.accesses, "pinned_rows": self.pinned_rows, "pinned_ids": self.pinned_ids,
                "sizes": list(self.sizes), "hits": list(self.hits)}

    @classmethod
    def from_dict(cls, doc: Dict[str, Any]) -> "MissRatioCurve":
        c = cls(num_rows=int(doc["num_rows"]), depth=int(doc["depth"]), num_batches=int(doc["num_batches"]),
                accesses=int(doc["accesses"]), pinned_rows=int(doc["pinned_rows"]),
                sizes=tuple(doc["sizes"]), hits=tuple(doc["hits"]), pinned_ids=int(doc.get("pinned_ids", -1)))
        if len(c.sizes) != len(c.hits) or not c.sizes or any(h > c.accesses for h in c.hits):
            raise ValueError("cache profile: a curve's sizes and hits do not match")
        return c

    def __hash__(self) -> int:  # (frozen dataclass of tuples: hashable; CacheParams hashes without it)
        return hash((self.num_rows, self.depth, self.accesses, self.pinned_rows, self.pinned_ids))


def shard_steps(steps: Sequence[np.ndarray], lo: int, hi: int) -> List[np.ndarray]:
    """The ids of row range ``[lo, hi)`` of each batch, local to the shard (row-wise shards)."""
    out = []
    for ids in steps:
        ids = np.asarray(ids, dtype=np.int64)
        out.append(ids[(ids >= lo) & (ids < hi)] - lo)
    return out


def clf_bytes(load_factor: float, num_rows: int, row_bytes: int) -> int:
    """Device bytes of a cache of ``load_factor x num_rows`` slots, rounded as the store rounds."""
    return max(1, int(round(load_factor * num_rows))) * row_bytes if load_factor > 0 else 0

