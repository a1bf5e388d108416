"""A TorchRec ``Proposer`` that spends the device budget where the measured curves say it saves most fetches.

TorchRec's ``EmbeddingOffloadScaleupProposer`` shares the budget in proportion to each
table's ``cacheability x expected_lookups`` (its expected misses), whatever a byte more
buys there. With a whole measured curve per table the best split is known instead: give
each next byte to the table whose curve gains most hits per byte there (the greedy walk
over each curve's upper concave hull is optimal for concave pieces). This proposer does
that, through TorchRec's own interfaces: its ``load``/``propose``/``feedback`` protocol, the
budget and affine storage model of ``EmbeddingOffloadScaleupProposer`` (its static helpers)
and the enumerator's estimates. It runs *beside* TorchRec's proposers; the planner keeps
whichever plan its (proactive) perf model rates best.
"""

from __future__ import annotations

import copy
from typing import Dict, List, Optional, Sequence, Tuple

from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner.proposers import EmbeddingOffloadScaleupProposer
from torchrec.distributed.planner.types import Enumerator, Proposer, ShardingOption, Topology

from .curve import MissRatioCurve

__all__ = ["MissCurveProposer", "allocate_by_curves"]

_CACHED = EmbeddingComputeKernel.FUSED_UVM_CACHING.value


def _upper_hull(points: Sequence[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """The upper concave envelope of ``(x, y)`` points sorted by ``x`` (monotone chain)."""
    hull: List[Tuple[float, float]] = []
    for p in points:
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if (y2 - y1) * (p[0] - x1) <= (p[1] - y1) * (x2 - x1):  # hull[-1] under the chord
                hull.pop()
            else:
                break
        hull.append(p)
    return hull


def allocate_by_curves(curves: Sequence[MissRatioCurve], bytes_per_clf: Sequence[float], start: Sequence[float],
                       budget: float, max_clf: float) -> List[float]:
    """Load factors from ``start`` up, spending at most ``budget`` bytes (``bytes_per_clf[i]``
    bytes per unit load factor of table ``i``) on the largest gain in hits per batch per byte."""
    segments: List[Tuple[float, int, float, float]] = []  # (slope, table, clf from, clf to)
    for i, (c, a, s) in enumerate(zip(curves, bytes_per_clf, start)):
        if a <= 0 or not c.num_batches:
            continue
        clfs = sorted({s, max_clf, *[x / c.num_rows for x in c.sizes if s < x / c.num_rows < max_clf]})
        pts = [(lf * a, c.hit_rows(lf * c.num_rows) / c.num_batches) for lf in clfs]
        hull = _upper_hull(pts)
        for (x0, y0), (x1, y1) in zip(hull, hull[1:]):
            if x1 > x0 and y1 > y0:
                segments.append(((y1 - y0) / (x1 - x0), i, x0 / a, x1 / a))
    out = list(start)
    left = float(budget)
    # (each table's hull segments have decreasing slopes, so taking them by slope keeps each
    # table's segments in order)
    for slope, i, lo, hi in sorted(segments, key=lambda seg: -seg[0]):
        if left <= 0:
            break
        cost = (hi - lo) * bytes_per_clf[i]
        take = min(1.0, left / cost)
        out[i] = lo + take * (hi - lo)
        left -= take * cost
        if take < 1.0:
            # The budget ends inside this segment. (Rounding can leave `left` a hair above 0:
            # going on would set a table's factor to the start of a later segment of its own,
            # past the bytes of the one it is in - spending more than the budget.)
            break
    return out


class MissCurveProposer(Proposer):
    """Proposes the starting plan, then (given the budget in ``feedback``) the plan whose
    cached tables split that budget by :func:`allocate_by_curves`. TorchRec's storage model
    is only affine in the load factor between estimates, so a proposal the partitioner
    cannot place is tried again with less of the budget (``fractions``); then nothing more."""

    def __init__(self, max_load_factor: float = 0.999, fractions: Sequence[float] = (1.0, 0.97, 0.9, 0.8, 0.6)) -> None:
        self.max_load_factor = max_load_factor
        self.fractions = tuple(fractions)
        self.enumerator: Optional[Enumerator] = None
        self.start: List[ShardingOption] = []
        self.proposal: Optional[List[ShardingOption]] = None
        self.budget: Optional[int] = None
        self.tries = 0

    def load(self, search_space: List[ShardingOption], enumerator: Optional[Enumerator] = None) -> None:
        self.enumerator = enumerator
        by_fqn: Dict[str, List[ShardingOption]] = {}
        for option in search_space:
            by_fqn.setdefault(option.fqn, []).append(option)
        proposal = []
        for options in by_fqn.values():
            options.sort(key=lambda o: max(s.perf.total for s in o.shards))  # type: ignore[union-attr]
            proposal.append(next((o for o in options if o.compute_kernel == _CACHED), options[0]))
        self.start = copy.deepcopy(proposal)
        self.proposal = copy.deepcopy(proposal)
        self.budget, self.tries = None, 0

    def propose(self) -> Optional[List[ShardingOption]]:
        return self.proposal

    def feedback(self, partitionable: bool, plan: Optional[List[ShardingOption]] = None,
                 perf_rating: Optional[float] = None, storage_constraint: Optional[Topology] = None) -> None:
        if self.budget is None:  # feedback on the starting plan: it gives the budget
            if not partitionable or plan is None or storage_constraint is None or self.enumerator is None:
                self.proposal = None
                return
            self.budget = EmbeddingOffloadScaleupProposer.get_budget(plan, storage_constraint)
        elif partitionable or self.tries >= len(self.fractions):
            self.proposal = None  # placed (the planner has rated it), or out of tries
            return
        self.proposal = self._scaled(self.budget * self.fractions[self.tries])
        self.tries += 1

    def _scaled(self, budget: float) -> Optional[List[ShardingOption]]:
        proposal = copy.deepcopy(self.start)
        tables = [o for o in proposal if o.compute_kernel == _CACHED and o.cache_params is not None
                  and isinstance(o.cache_params.stats, MissRatioCurve) and o.cache_params.load_factor is not None]
        if budget <= 0 or not tables or self.enumerator is None:
            return None
        model, _ = EmbeddingOffloadScaleupProposer.build_affine_storage_model(tables, self.enumerator)
        clfs = allocate_by_curves([o.cache_params.stats for o in tables],  # type: ignore[union-attr,misc]
                                  [float(a) for a in model[:, 0]],
                                  [float(o.cache_params.load_factor) for o in tables],  # type: ignore[union-attr,arg-type]
                                  budget, self.max_load_factor)
        for option, clf in zip(tables, clfs):
            option.cache_params.load_factor = clf  # type: ignore[union-attr]
        self.enumerator.populate_estimates(tables)
        return proposal
