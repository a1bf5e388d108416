"""``prefetch=auto``: choose the prefetch depth from a few measured reactive steps.

A fetch issued for batch ``N+k`` during step ``N`` has about ``k`` steps of other work
(compute, all-to-alls, all-reduce) to hide behind before batch ``N+k``'s lookup waits for
it. Measured reactively, a step's stall is the whole fetch (``fetch_s``) and the rest of
the step is the work it can hide behind (``other_s``), so the smallest depth that hides it
is ``ceil(fetch_s / other_s)``, at least 1. The cache bounds it from above: ``k + 1``
batches' rows are pinned at once. If a fetch takes longer than a whole step of other work
the link is the bottleneck and no depth hides it fully; that is logged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict

import torch
import torch.distributed as dist

from ..integration.sharded_module import ProactiveShardedModule


@dataclass(frozen=True)
class DepthChoice:
    depth: int
    fetch_ms: float  # per step, measured reactively (max over ranks)
    other_ms: float  # the rest of a step (min over ranks)
    cache_limit: int  # deepest depth the caches can hold
    reason: str

    def as_dict(self) -> Dict[str, object]:
        return dict(self.__dict__)


def choose_depth(fetch_s: float, other_s: float, max_depth: int, cache_limit: int) -> DepthChoice:
    limit = max(1, min(max_depth, cache_limit))
    if fetch_s <= 0.0:
        want, reason = 1, "no measurable fetch stall: depth 1 suffices"
    else:
        want = max(1, math.ceil(fetch_s / max(other_s, 1e-9)))
        reason = f"fetch {fetch_s * 1e3:.2f} ms per step hides behind {want} step(s) of {other_s * 1e3:.2f} ms"
        if fetch_s > other_s:
            reason += "; the link is slower than a step, so some stall remains at any depth"
    depth = min(want, limit)
    if depth < want:
        bound = "the cache" if cache_limit < max_depth else "prefetch.max_depth"
        reason += f"; capped at {depth} by {bound}"
    return DepthChoice(depth, fetch_s * 1e3, other_s * 1e3, cache_limit, reason)


def cache_depth_limit(model: torch.nn.Module, ids_per_batch: int, cap: int = 64) -> int:
    """Deepest depth every proactive cache on this rank can hold: a table whose cache is
    smaller than its shard must fit ``depth + 1`` batches of at most ``ids_per_batch``
    distinct rows each. ``cap`` when nothing bounds it."""
    limit = cap
    for m in model.modules():
        if isinstance(m, ProactiveShardedModule):
            for table in m.named_tables().values():
                ranges = table.segment_slot_ranges()
                # (a store with per-table budgets: each table's budget must hold its batches)
                caches = ([(table.num_slots, table.num_rows)] if ranges is None else
                          [(hi - lo, seg.num_rows) for seg, (lo, hi) in zip(table.segments, ranges)])
                for slots, rows in caches:
                    if slots >= rows:
                        continue  # the whole shard is cached: any depth fits
                    per_batch = min(rows, ids_per_batch)
                    limit = min(limit, slots // max(per_batch, 1) - 1)
    return max(limit, 0)


def agree(fetch_s: float, other_s: float, cache_limit: int) -> "tuple[float, float, int]":
    """Every rank must run the same depth (collectives run in pipeline order): combine the
    ranks' measurements pessimistically - slowest fetch, shortest rest, smallest cache."""
    t = torch.tensor([fetch_s, -other_s, -float(cache_limit)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0]), float(-t[1]), int(-t[2])
