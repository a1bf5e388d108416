"""Workload figures that no hardware changes: rows per step and cache hits, by cache size and depth.

The scaling study needs, per id looked up, how many distinct rows a rank asks for, how many
cross the host link, how many bytes that is (write-backs of dirty victims included) and how
far ahead of its lookup each batch could be planned. All of these depend on the data, the
cache size and the prefetch depth only. They are counted here by replaying batches through
the real store (:class:`~torchrec_proactive.store.TieredTable`, one per table) in the order
the pipeline drives it at depth ``k``:

1. batch ``t + k`` arrives and is planned if its rows fit beside the pins in flight
   (batches are planned in arrival order: a batch that does not fit waits, and so do the
   batches behind it);
2. the lookup of batch ``t``: a batch still unplanned is planned now, on the critical path
   (rows that do not fit in the whole cache are served from the host tier, "overflow");
3. during batch ``t``'s output all-to-all the waiting batches are tried again;
4. backward of ``t`` updates its rows (they become dirty) and releases its pins.

The planning time per id is the one figure here that is a time (the host CPU's): it is
reported for the study, and no test asserts it.
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..store import CacheCapacityError, OptimizerConfig, TieredTable

__all__ = ["CachePoint", "replay_table", "replay", "zipf_id_stream", "zipf_fill", "criteo_id_stream"]

#: The replay's row width: bytes scale with it, counts do not (reported per row).
_REPLAY_DIM = 8


@dataclass(frozen=True)
class CachePoint:
    """Counts of one (data, cache fraction, depth) replay, per id looked up unless named otherwise."""

    source: str
    cache_fraction: float
    depth: int
    ids_per_step: float  # ids looked up per step, all tables
    unique_rows_per_id: float  # distinct rows asked for
    fetched_rows_per_id: float  # rows copied host -> cache
    fetched_rows_at_lookup_per_id: float  # of those, copied while the lookup waited
    written_back_rows_per_id: float  # dirty victims copied cache -> host
    overflow_rows_per_id: float  # rows served from the host tier (cache smaller than a batch)
    hit_rate: float  # hits / distinct rows asked for
    deferred_per_step: float  # prefetches that waited for pins
    mean_lead: float  # how many steps ahead of its lookup a batch was planned (k when none waits)
    plan_s_per_id: float  # host CPU seconds of planning per id (a measurement)
    #: rows moved (fetched + written back) for each counted batch, per table: the per-rank,
    #: per-step load the straggler model takes its distribution from
    moved_rows_by_table: Tuple[Tuple[float, ...], ...] = ()
    #: did the cache run full during the replay (more distinct rows than slots: it evicted)?
    #: If not, nothing was written back and the hit rate is a cold-start one
    cache_filled: bool = True
    cache_rows_per_table: float = 0.0  # slots, absolute (fraction x the table's real rows)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


class _TableReplay:
    """One table's store driven in pipeline order (module docstring)."""

    def __init__(self, num_rows: int, num_slots: int, depth: int, warmup: int) -> None:
        self.table = TieredTable("replay", torch.zeros(num_rows, _REPLAY_DIM), OptimizerConfig(learning_rate=0.0),
                                 num_slots=num_slots)
        self.depth = depth
        self.warmup = warmup  # batches before this index are not counted (the cache fills)
        self.waiting: Deque[Tuple[int, torch.Tensor]] = deque()
        self.planned: Dict[int, Any] = {}
        self.totals: Dict[str, float] = dict.fromkeys(
            ("unique_rows", "hits", "fetched", "fetched_at_lookup", "written_back", "overflow", "leads", "batches",
             "plan_s"), 0.0)
        self.deferred: set = set()
        self.moved: Dict[int, float] = {}  # batch index -> rows fetched + written back

    def _issue(self, index: int, rows: torch.Tensor, now: int, overflow: bool) -> None:
        """Plans and moves one batch; a batch planned in its own step (lead 0) is copied on
        the critical path: nothing runs between its plan and its lookup but the input
        all-to-all of a later batch."""
        t0 = time.perf_counter()
        plan = self.table.plan(rows, overflow=overflow)
        plan_s = time.perf_counter() - t0
        self.table.transfer(plan)
        self.planned[index] = plan
        if index < self.warmup:
            return
        fetched = plan.num_fills - plan.num_preloaded
        self.moved[index] = float(fetched + plan.num_writebacks)
        for key, value in (("unique_rows", plan.num_rows), ("hits", plan.num_hits), ("fetched", fetched),
                           ("fetched_at_lookup", fetched if index == now else 0),
                           ("written_back", plan.num_writebacks), ("overflow", plan.num_overflow),
                           ("leads", index - now), ("batches", 1), ("plan_s", plan_s)):
            self.totals[key] += value

    def plan_waiting(self, now: int) -> None:
        while self.waiting:
            index, rows = self.waiting[0]
            try:
                self._issue(index, rows, now, overflow=False)
            except CacheCapacityError:
                if index >= self.warmup:
                    self.deferred.add(index)  # (the pipeline counts a batch once, when it first waits)
                return
            self.waiting.popleft()

    def lookup(self, index: int, rows: torch.Tensor) -> None:
        if index in self.planned:
            return
        # Not planned ahead (depth 0, or it waited for pins until now): planned now, and
        # rows that do not fit in the whole cache are served from the host tier.
        if self.waiting and self.waiting[0][0] == index:
            self.waiting.popleft()
        self._issue(index, rows, index, overflow=True)

    def backward(self, index: int) -> None:
        plan = self.planned.pop(index)
        self.table.apply_gradients(plan, torch.zeros(plan.rows.numel(), _REPLAY_DIM))


def replay_table(steps: Sequence[np.ndarray], num_rows: int, cache_fraction: float, depth: int,
                 warmup: int = 0, fill: Optional[np.ndarray] = None) -> Dict[str, float]:
    """Replays one table's per-step ids (``steps[t]``: the ids of batch ``t``); totals over
    the steps after ``warmup``, and ``moved_by_step`` (rows fetched + written back per
    counted batch).

    The cache holds ``cache_fraction x num_rows`` rows of the *real* table, however few of
    its rows the steps touch: the ids are compacted to the rows seen (order kept, so the
    store's choices are the same), which lets a 40M-row table replay in the memory of its
    touched rows.

    ``fill``: ids of earlier training (same distribution, any number) looked up and updated
    before the steps, in chunks of half the cache, so that a cache far larger than the
    steps' rows starts full and dirty, as in steady state; nothing of it is counted."""
    if not 0 < cache_fraction <= 1:
        raise ValueError(f"cache_fraction must be in (0, 1], got {cache_fraction!r}")
    if depth < 0:
        raise ValueError(f"depth must be >= 0, got {depth!r}")
    if not 0 <= warmup < len(steps):
        raise ValueError(f"warmup must be in [0, {len(steps)}) steps, got {warmup!r}")
    arrays = [np.asarray(ids, dtype=np.int64) for ids in steps]
    pre = np.asarray(fill if fill is not None else [], dtype=np.int64)
    seen, inverse = np.unique(np.concatenate([pre, *arrays]), return_inverse=True)
    pre_inverse, inverse = inverse[:len(pre)], inverse[len(pre):]
    slots = max(1, int(cache_fraction * num_rows))
    # One row more than it touches, so that a cache at least as large as the rows seen is not
    # taken for one that holds the whole table (the store preloads such a cache): it starts
    # empty and never evicts, as the real cache would over these steps.
    # (A cache of the whole real table does hold every row from the start, as the store's.)
    holds_all = slots >= num_rows
    r = _TableReplay(len(seen) + (0 if holds_all else 1), min(slots, len(seen)), depth, warmup)
    bounds = np.cumsum([0] + [len(a) for a in arrays])
    batches = [torch.unique(torch.from_numpy(inverse[bounds[t]:bounds[t + 1]])) for t in range(len(arrays))]
    chunk = max(1, min(slots, len(seen)) // 2)
    for start in range(0, len(pre_inverse), chunk):
        rows = torch.unique(torch.from_numpy(pre_inverse[start:start + chunk]))
        plan = r.table.plan(rows, overflow=True)
        r.table.transfer(plan)
        r.table.apply_gradients(plan, torch.zeros(plan.rows.numel(), _REPLAY_DIM))
    for j in range(min(depth, len(batches))):  # the prologue: batches 0..k-1 arrive first
        r.waiting.append((j, batches[j]))
    r.plan_waiting(0)
    for t, rows in enumerate(batches):
        if depth > 0 and t + depth < len(batches):
            r.waiting.append((t + depth, batches[t + depth]))
        r.plan_waiting(t)
        r.lookup(t, rows)
        r.plan_waiting(t)  # in batch t's output all-to-all
        r.backward(t)
    return {"ids": float(sum(len(x) for x in steps[warmup:])), "steps": float(len(steps) - warmup),
            "deferred": float(len(r.deferred)), **r.totals,
            "moved_by_step": [r.moved.get(t, 0.0) for t in range(warmup, len(steps))],
            "cache_filled": len(seen) > slots, "cache_rows": float(slots)}


def replay(source: str, tables: Sequence[Tuple[int, Sequence[np.ndarray]]], cache_fraction: float,
           depth: int, warmup: int = 0, fills: Optional[Sequence[Optional[np.ndarray]]] = None) -> CachePoint:
    """Replays every ``(num_rows, per-step ids)`` table (after its ``fills[i]``, see
    :func:`replay_table`) and sums their counts into one point."""
    total: Dict[str, float] = {}
    moved: List[Tuple[float, ...]] = []
    filled, cache_rows = True, []
    for i, (num_rows, steps) in enumerate(tables):
        one = replay_table(steps, num_rows, cache_fraction, depth, warmup, None if fills is None else fills[i])
        moved.append(tuple(one.pop("moved_by_step")))
        filled = filled and bool(one.pop("cache_filled"))
        cache_rows.append(one.pop("cache_rows"))
        for k, v in one.items():
            total[k] = total.get(k, 0.0) + v
    ids, num_steps = total["ids"], total["steps"] / len(tables)
    return CachePoint(
        source=source, cache_fraction=cache_fraction, depth=depth, ids_per_step=ids / num_steps,
        unique_rows_per_id=total["unique_rows"] / ids, fetched_rows_per_id=total["fetched"] / ids,
        fetched_rows_at_lookup_per_id=total["fetched_at_lookup"] / ids,
        written_back_rows_per_id=total["written_back"] / ids, overflow_rows_per_id=total["overflow"] / ids,
        hit_rate=total["hits"] / total["unique_rows"] if total["unique_rows"] else 1.0,
        deferred_per_step=total["deferred"] / num_steps, mean_lead=total["leads"] / total["batches"],
        plan_s_per_id=total["plan_s"] / ids, moved_rows_by_table=tuple(moved), cache_filled=filled,
        cache_rows_per_table=float(np.mean(cache_rows)),
    )


def zipf_id_stream(num_tables: int, rows_per_table: int, batch_size: int, num_steps: int, alpha: float,
                   seed: int = 0) -> List[Tuple[int, List[np.ndarray]]]:
    """The bench's own ids (Zipf ranks, one id per sample and table), per table and step."""
    from ..data.criteo_synth import sample_zipf_ranks

    rng = np.random.default_rng(seed)
    return [(rows_per_table, [sample_zipf_ranks(rng, rows_per_table, alpha, batch_size) for _ in range(num_steps)])
            for _ in range(num_tables)]


def zipf_fill(rows_per_table: int, alpha: float, num_ids: int, seed: int = 1) -> np.ndarray:
    """``num_ids`` earlier ids of one Zipf table (same distribution as :func:`zipf_id_stream`'s):
    the history that fills a large cache before a replay (``replay_table(fill=...)``)."""
    from ..data.criteo_synth import sample_zipf_ranks

    return sample_zipf_ranks(np.random.default_rng(seed), rows_per_table, alpha, num_ids).astype(np.int64)


def criteo_id_stream(work_dir: Any, batch_size: int, num_steps: int, num_tables: int = 26,
                     max_cardinality: int = 20_000, seed: int = 0) -> List[Tuple[int, List[np.ndarray]]]:
    """Ids of generated Criteo-format TSV (Kaggle layout) after the project's preprocessing
    (frequency-thresholded, contiguous ids), the ``num_tables`` largest tables."""
    from pathlib import Path

    from ..data.criteo import iter_rows, preprocess
    from ..data.criteo_synth import SyntheticCriteoSpec, generate

    out = Path(work_dir)
    spec = SyntheticCriteoSpec(layout="kaggle", num_samples=batch_size * num_steps, max_cardinality=max_cardinality,
                               seed=seed)
    # Every id kept (threshold 1): a few thousand generated samples see most ids only once or
    # twice, and TorchRec's threshold of 3 would fold them into one row.
    with warnings.catch_warnings():  # torch's datapipes warn about the preprocessing's local functions
        warnings.filterwarnings("ignore", message="Local function is not supported by pickle", category=UserWarning)
        pre = preprocess(generate(spec, out / "tsv", progress=False), out / "npy", progress=False,
                         frequency_threshold=1)
    sparse = np.concatenate([s for _, s, _ in iter_rows(pre)])
    largest = sorted(range(len(pre.cardinalities)), key=lambda f: -pre.cardinalities[f])[:num_tables]
    return [(int(pre.cardinalities[f]),
             [sparse[t * batch_size:(t + 1) * batch_size, f] for t in range(num_steps)]) for f in largest]
