"""Per-table cache load factors from TorchRec's planner, measured curves and a device budget.

TorchRec's ``EmbeddingOffloadScaleupProposer`` (Embedding Offloading, RecSys'24) spends the
device memory left after the other tables on the caches whose misses cost most, using the
``CacheStatistics`` in each table's ``CacheParams``. Here it runs with TorchRec's other
proposers inside TorchRec's own ``EmbeddingShardingPlanner``; what proactive fetching changes
goes in through the planner's extension points (its estimator list), not a copy of it:

* :class:`ProactivePerfEstimator`: TorchRec's perf estimate, with a cached shard's
  ``prefetch_compute`` (the copy of its missing rows) cut to the part the step model
  (:func:`~torchrec_proactive.model.step_model.step_s`) cannot hide behind the shard's own
  communication and compute of the ``k`` batches ahead; at depth 0 it is all charged.
* :class:`ProactiveStorageEstimator`: TorchRec's storage estimate of a cache never below the
  rows the ``k + 1`` batches in flight pin (the curve's ``pinned_rows``).

The cache *sizes* are planned on a device topology whose device memory is the budget
(``hbm_cap``): on CUDA the memory left over, on CPU - where TorchRec plans no device memory -
``cache.budget_bytes``, so the same planning runs in CI. The chosen sizes leave this module
as slots per table (:attr:`CachePlan.slots`), each at least the curve's floor by
construction: the planner's load factor turned into slots as the store turns it
(``ProactiveOptions.slots_for``), then raised to the floor - an integer, never a factor that
rounds below it. The load factors (at most 0.999, as TorchRec's planner takes them) go into
the run's own plan; the slots go to the sharder (``num_slots``, which wins over them).

A budget is checked before TorchRec's planner runs: :func:`minimum_budget_bytes` is the
smallest budget per device at which TorchRec's own partitioner places every table's cache at
its floor, as TorchRec's storage model counts it (a budget that many bytes has a plan);
anything less is refused in one line naming it.
The curves measure whole tables, so the tables are planned table- or column-wise (every
shard holds every row, and with it the table's floor); pass ``sharding_types`` with
row-wise curves (``MissRatioCurve.combine_shards``) to let the planner split rows.
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.distributed.planner.constants import BATCH_SIZE
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.partitioners import GreedyPerfPartitioner
from torchrec.distributed.planner.proposers import (EmbeddingOffloadScaleupProposer, GreedyProposer,
                                                    UniformProposer)
from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator, EmbeddingStorageEstimator
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import (KernelConfig, PlannerError, ShardingOption, Topology,
                                                TopologyFactory, TrainerConfig)
from torchrec.distributed.types import CacheAlgorithm, CacheParams, ShardingPlan

from ..model.step_model import StageCosts, step_s
from ..integration.options import ProactiveOptions
from ..planning import Sharders, as_sharders, find_collections, planner_warnings, table_configs
from .curve import MissRatioCurve
from .proposer import MissCurveProposer

__all__ = ["CachePlan", "CacheBudgetError", "ProactivePerfEstimator", "ProactiveStorageEstimator",
           "plan_cache_sizes", "minimum_budget_bytes", "planned_slots", "budget_refusal", "WHOLE_ROW_SHARDINGS"]

_CACHED = EmbeddingComputeKernel.FUSED_UVM_CACHING.value
#: TorchRec's planner takes cache load factors strictly below 1; a table the proposer
#: promotes to resident (``fused``) gets this one (every row but rounding).
MAX_PLANNED_LOAD_FACTOR = 0.999
#: Sharding types whose every shard holds all of its table's rows (so a whole-table curve's
#: floor is each shard's): what the app's profiles, which measure whole tables, plan.
WHOLE_ROW_SHARDINGS = ("table_wise", "column_wise")
LOG = logging.getLogger("torchrec_proactive.cacheplan")


class CacheBudgetError(ValueError):
    """The device budget cannot hold the pinned rows of ``depth + 1`` batches."""

    def __init__(self, message: str, minimum_bytes: Optional[int] = None) -> None:
        super().__init__(message)
        self.minimum_bytes = minimum_bytes


def _curve(option: ShardingOption) -> Optional[MissRatioCurve]:
    stats = option.cache_params.stats if option.cache_params is not None else None
    return stats if isinstance(stats, MissRatioCurve) else None


class ProactivePerfEstimator(EmbeddingPerfEstimator):
    """TorchRec's perf estimator; a cached shard's fetch is charged only where it shows.

    The copy of batch ``N + k``'s missing rows runs behind the ``k`` steps ahead of it. With
    the shard's estimated stages as the step model's (input dist, forward, output comms,
    backward), the step grows by ``step_s(costs, k) - main_s``: zero while the fetch fits
    in the window, the whole fetch at depth 0.
    """

    def __init__(self, topology: Topology, constraints: Optional[Dict[str, ParameterConstraints]] = None,
                 *, prefetch_depth: int) -> None:
        super().__init__(topology, constraints)
        if prefetch_depth < 0:
            raise ValueError(f"prefetch_depth must be >= 0, got {prefetch_depth!r}")
        self.prefetch_depth = prefetch_depth

    def estimate(self, sharding_options: List[ShardingOption], sharder_data_map: object) -> None:  # type: ignore[override]
        super().estimate(sharding_options, sharder_data_map)  # type: ignore[arg-type]
        for option in sharding_options:
            if option.compute_kernel != _CACHED:
                continue
            for shard in option.shards:
                p = shard.perf
                if p is None or p.prefetch_compute <= 0:
                    continue
                costs = StageCosts(input_a2a_s=p.input_dist_comms, forward_s=p.fwd_compute, output_a2a_s=p.fwd_comms,
                                   backward_s=p.bwd_compute + p.bwd_comms, allreduce_s=0.0,
                                   copy_s=p.prefetch_compute)
                p.prefetch_compute = max(0.0, step_s(costs, self.prefetch_depth) - costs.main_s)


class ProactiveStorageEstimator(EmbeddingStorageEstimator):
    """TorchRec's storage estimator, with each cache at least the rows ``k + 1`` batches pin.

    The load factor a proposer tries is raised to the curve's ``min_load_factor`` for the
    estimate only (the proposal keeps its own number; the plan's factors are raised after)."""

    def estimate(self, sharding_options: List[ShardingOption], sharder_data_map: object) -> None:  # type: ignore[override]
        saved = []
        for option in sharding_options:
            curve = _curve(option)
            lf = option.cache_params.load_factor if option.cache_params is not None else None
            if option.compute_kernel == _CACHED and curve is not None and lf is not None and lf < curve.min_load_factor:
                saved.append((option, lf))
                option.cache_params.load_factor = min(curve.min_load_factor, MAX_PLANNED_LOAD_FACTOR)  # type: ignore[union-attr]
        try:
            super().estimate(sharding_options, sharder_data_map)  # type: ignore[arg-type]
        finally:
            for option, lf in saved:
                option.cache_params.load_factor = lf  # type: ignore[union-attr]


@dataclass(frozen=True)
class CachePlan:
    """The planner's per-table cache sizes under one budget (bytes per device).

    ``slots[t]``: the rows table ``t``'s cache holds (in each shard; every shard of a table-
    or column-wise plan holds all its rows), never below the curve's floor ``min_slots[t]``;
    give them to the sharder (``num_slots``), which takes them as they are.
    ``load_factors[t]``: the same size as a load factor for TorchRec's plan (``slots / rows``,
    at most 0.999, which is all TorchRec's planner takes: a whole-table cache is 0.999 there
    and every row in ``slots``). ``min_budget_bytes``: :func:`minimum_budget_bytes`.
    """

    budget_bytes: int
    prefetch_depth: int
    load_factors: Dict[str, float]
    cache_bytes: Dict[str, int]  # device bytes of each table's cache rows (all shards)
    slots: Dict[str, int] = field(default_factory=dict)
    min_slots: Dict[str, int] = field(default_factory=dict)
    min_budget_bytes: int = 0

    def describe(self) -> str:
        """The plan log's one line."""
        shown = ", ".join(f"{t}={self.slots[t]}" if t in self.slots else f"{t}={lf:.3f}"
                          for t, lf in sorted(self.load_factors.items()))
        return (f"cache plan (TorchRec planner, EmbeddingOffloadScaleup + miss-curve proposers, depth {self.prefetch_depth}, budget "
                f"{self.budget_bytes} bytes/device, at least {self.min_budget_bytes}): cache rows "
                f"{sum(self.cache_bytes.values())} bytes on all devices; slots {shown}")


def _row_bytes(option_or_cfg: object) -> int:
    return int(option_or_cfg.embedding_dim) * 4  # type: ignore[attr-defined]  # fp32 rows


def planned_slots(curve: MissRatioCurve, load_factor: Optional[float], name: str = "") -> int:
    """The slots of a cache the planner gave ``load_factor`` (``None``: promoted to resident,
    the whole table): the load factor turned into slots as the store turns it
    (``ProactiveOptions.slots_for``), raised to the curve's floor ``pinned_rows`` - an
    integer comparison, so a factor that rounds below the floor cannot leave it there."""
    rows = curve.num_rows
    by_factor = rows if load_factor is None else ProactiveOptions().slots_for(name, rows, min(1.0, load_factor))
    return min(rows, max(by_factor, curve.pinned_rows))


def _floor_load_factor(curve: MissRatioCurve) -> float:
    """The floor as TorchRec's planner takes a load factor (in ``(0, 0.999]``)."""
    return min(max(curve.min_load_factor, 1.0 / curve.num_rows), MAX_PLANNED_LOAD_FACTOR)


def _planner_parts(model: nn.Module, sharder: Sharders, curves: Mapping[str, MissRatioCurve],
                   budget_bytes: int, prefetch_depth: int, world_size: int, local_size: int, device_type: str,
                   batch_size: Optional[int], sharding_types: Optional[Sequence[str]]):
    # Per table, the sharding types its collection's sharder offers for the cached kernel
    # (sequence tables: no table-row-wise).
    types_of: Dict[str, List[str]] = {}
    for module, s in find_collections(model, sharder).values():
        offered = [t for t in s.sharding_types(device_type) if _CACHED in s.compute_kernels(t, device_type)
                   and (sharding_types is None or t in sharding_types)]
        for cfg in table_configs(module):
            types_of[cfg.name] = offered
    types = sorted({t for name in curves for t in types_of.get(name, [])})
    if not types or any(not types_of.get(name) for name in curves):
        raise ValueError(f"sharding_types={list(sharding_types or [])} leaves no sharding type the sharder offers "
                         f"for {_CACHED} on {device_type}")
    constraints: Dict[str, ParameterConstraints] = {}
    for name, curve in curves.items():
        constraints[name] = ParameterConstraints(
            sharding_types=types_of[name], compute_kernels=[_CACHED],
            cache_params=CacheParams(algorithm=CacheAlgorithm.LRU, load_factor=_floor_load_factor(curve), stats=curve))
    topology = TopologyFactory.create_topology(
        TrainerConfig(world_size=world_size, local_world_size=local_size, hbm_cap_bytes=int(budget_bytes)),
        kernel_config=KernelConfig(compute_device="cuda"),
    )
    enumerator = EmbeddingEnumerator(
        topology=topology, batch_size=batch_size or BATCH_SIZE, constraints=constraints,
        estimator=[ProactivePerfEstimator(topology, constraints, prefetch_depth=prefetch_depth),
                   ProactiveStorageEstimator(topology, constraints)])
    return types, constraints, topology, enumerator


def _floor_proposal(model: nn.Module, sharder: Sharders, curves: Mapping[str, MissRatioCurve],
                    enumerator: EmbeddingEnumerator, types: Sequence[str]) -> List[ShardingOption]:
    """Every table's cache at its floor, as TorchRec's ``UniformProposer`` proposes it: the
    table-wise option of each (when the planner may shard table-wise; else each table's
    option of least device bytes), with TorchRec's storage estimates."""
    options = enumerator.enumerate(model, as_sharders(sharder))  # type: ignore[arg-type]
    out: List[ShardingOption] = []
    for name in curves:
        mine = [o for o in options if o.name == name and o.compute_kernel == _CACHED]
        if "table_wise" in types:
            mine = [o for o in mine if o.sharding_type == "table_wise"] or mine
        out.append(min(mine, key=lambda o: (sum(s.storage.hbm for s in o.shards),  # type: ignore[union-attr]
                                            max(s.perf.total for s in o.shards))))  # type: ignore[union-attr]
    return out


def _places(proposal: Sequence[ShardingOption], capacity: int, world_size: int, local_size: int) -> bool:
    """Whether TorchRec's planner's partitioner places ``proposal`` on devices of ``capacity``
    device bytes each."""
    topology = TopologyFactory.create_topology(
        TrainerConfig(world_size=world_size, local_world_size=local_size, hbm_cap_bytes=int(capacity)),
        kernel_config=KernelConfig(compute_device="cuda"))
    try:
        GreedyPerfPartitioner().partition(copy.deepcopy(list(proposal)), topology)
    except PlannerError:
        return False
    return True


def minimum_budget_bytes(proposal: Sequence[ShardingOption], world_size: int, local_size: Optional[int] = None,
                         reserve: float = 0.0) -> int:
    """The smallest budget per device at which TorchRec's planner places ``proposal`` (every
    cache at its floor: :func:`_floor_proposal`) with its own partitioner, found by bisection
    and checked: a budget of this many bytes has a plan. Between the bounds every placement
    needs (the largest shard; an even share) and one that always has one (any order of
    placing shards on a device they fit: ``(total - s) / W + s`` for every shard ``s``).
    Divided by ``1 - reserve`` (the share a budget keeps back)."""
    local_size = local_size or world_size
    sizes = [int(s.storage.hbm) for o in proposal for s in o.shards]  # type: ignore[union-attr]
    if not sizes:
        return 1
    total, largest = sum(sizes), max(sizes)
    lo = max(largest, math.ceil(total / world_size)) - 1  # does not place (or is the bound's own -1)
    hi = max(lo + 1, math.ceil((total - largest) / world_size + largest))
    while not _places(proposal, hi, world_size, local_size):  # (the bound places whatever the order)
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _places(proposal, mid, world_size, local_size):
            hi = mid
        else:
            lo = mid
    return max(1, math.ceil(hi / (1.0 - reserve)))


def budget_refusal(budget_bytes: object, minimum: int, floors: Mapping[str, int], depth: int,
                   world_size: int, what: str = "") -> CacheBudgetError:
    """The one line that refuses ``budget_bytes`` below ``minimum`` (``floors``: each
    table's floor in slots)."""
    worst = sorted(floors.items(), key=lambda kv: -kv[1])
    shown = ", ".join(f"{t}: {n}" for t, n in worst[:4]) + (f" and {len(worst) - 4} more" if len(worst) > 4 else "")
    return CacheBudgetError(
        f"cache.budget_bytes={budget_bytes} is below the minimum of {minimum} bytes per device for prefetch depth "
        f"{depth}: each table's cache must hold the rows {depth + 1} batches in flight pin ({sum(floors.values())} "
        f"slots in all; {shown}), which TorchRec's storage model counts with optimizer state and I/O buffers, placed "
        f"on {world_size} device(s){what}; give cache.budget_bytes >= {minimum} (profile-cache prints it)",
        minimum_bytes=minimum)


def plan_cache_sizes(
    model: nn.Module,
    sharder: Sharders,
    curves: Mapping[str, MissRatioCurve],
    budget_bytes: Optional[int],
    prefetch_depth: int,
    world_size: int,
    local_size: Optional[int] = None,
    device_type: str = "cpu",
    batch_size: Optional[int] = None,
    pg: Optional[dist.ProcessGroup] = None,
    sharding_types: Optional[Sequence[str]] = WHOLE_ROW_SHARDINGS,
    minimum_only: bool = False,
) -> CachePlan:
    """Cache sizes for every table in ``curves`` (the model's other tables are planned as
    usual), chosen by TorchRec's planner on a device topology of ``budget_bytes`` per device.

    ``budget_bytes=None`` (CUDA only): the device's memory, less TorchRec's usual 15% for the
    dense part - the HBM the other tables leave is what the caches get.

    ``sharding_types``: those the planner may use (default: table- and column-wise, whose
    shards hold every row, as whole-table curves measure them; ``None``: every type the
    sharder offers, for curves of row-wise shards). ``minimum_only``: only the check, an
    empty plan with ``min_budget_bytes`` (what ``profile-cache`` prints without a budget).

    Raises :class:`CacheBudgetError` (one line naming ``cache.budget_bytes``, its value and
    the minimum in bytes, also in ``.minimum_bytes``) when the budget is below
    :func:`minimum_budget_bytes` of the caches at their floors.
    """
    reserve = 0.0  # a given budget is for the embedding tables alone: nothing reserved
    given = budget_bytes
    if budget_bytes is None:
        if device_type != "cuda" or not torch.cuda.is_available():
            raise ValueError("cache.budget_bytes=-1 (the device memory left over) needs a CUDA device; "
                             "on CPU give the budget in bytes")
        budget_bytes, reserve = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory, 0.15
    if budget_bytes < 1:
        raise ValueError(f"cache.budget_bytes must be >= 1, got {budget_bytes!r}")
    configs = {c.name: c for module, _ in find_collections(model, sharder).values() for c in table_configs(module)}
    unknown = sorted(set(curves) - set(configs))
    if unknown:
        raise ValueError(f"cache profile names tables {unknown} that the model does not have (it has {sorted(configs)})")
    for name, c in curves.items():
        if c.num_rows != configs[name].num_embeddings:
            raise ValueError(f"cache profile: table '{name}' has {c.num_rows} rows in the profile but "
                             f"{configs[name].num_embeddings} in the model (profile again)")
    local_size = local_size or world_size
    types, constraints, topology, enumerator = _planner_parts(
        model, sharder, curves, int(budget_bytes * (1 - reserve)), prefetch_depth, world_size, local_size,
        device_type, batch_size, sharding_types)
    minimum = minimum_budget_bytes(_floor_proposal(model, sharder, curves, enumerator, types), world_size, local_size,
                                   reserve)
    floors = {t: c.pinned_rows for t, c in curves.items()}
    if minimum_only:
        return CachePlan(budget_bytes=int(budget_bytes), prefetch_depth=prefetch_depth, load_factors={},
                         cache_bytes={}, min_slots=floors, min_budget_bytes=minimum)
    shown_budget = budget_bytes if given is not None else f"-1 (the device memory left over: {budget_bytes})"
    if budget_bytes < minimum:
        raise budget_refusal(shown_budget, minimum, floors, prefetch_depth, world_size)
    planner = EmbeddingShardingPlanner(
        topology=topology, batch_size=batch_size, constraints=constraints, enumerator=enumerator,
        storage_reservation=FixedPercentageStorageReservation(0.0),
        # TorchRec's proposers, and ours that splits the budget along the measured curves;
        # the planner keeps the plan its perf model (proactive costs) rates best
        proposer=[GreedyProposer(), UniformProposer(), EmbeddingOffloadScaleupProposer(), MissCurveProposer()],
    )
    try:
        with planner_warnings():
            plan = (planner.collective_plan(model, as_sharders(sharder), pg) if pg is not None
                    else planner.plan(model, as_sharders(sharder)))
    except PlannerError as e:  # (the minimum has a placement; a larger budget is not expected to have none)
        raise CacheBudgetError(
            f"cache.budget_bytes={shown_budget}: TorchRec's planner found no placement of the caches at their floors "
            f"(at least {minimum} bytes per device; its partitioner placed them at that budget): "
            f"{str(e).splitlines()[0][:160]}", minimum_bytes=minimum) from None
    out = _read_plan(plan, curves, configs, int(budget_bytes), prefetch_depth)
    return CachePlan(budget_bytes=out.budget_bytes, prefetch_depth=prefetch_depth, load_factors=out.load_factors,
                     cache_bytes=out.cache_bytes, slots=out.slots, min_slots=floors, min_budget_bytes=minimum)


def _read_plan(plan: ShardingPlan, curves: Mapping[str, MissRatioCurve], configs: Mapping[str, object],
               budget_bytes: int, depth: int) -> CachePlan:
    slots: Dict[str, int] = {}
    for module_plan in plan.plan.values():
        for name, ps in module_plan.items():  # type: ignore[union-attr]
            if name not in curves:
                continue
            lf = ps.cache_params.load_factor if ps.cache_params is not None else None
            # promoted to resident (fused) by the proposer: the whole table
            slots[name] = planned_slots(curves[name], None if ps.compute_kernel != _CACHED else lf, name)
    factors = {t: min(n / curves[t].num_rows, MAX_PLANNED_LOAD_FACTOR) for t, n in slots.items()}
    cache_bytes = {t: n * _row_bytes(configs[t]) for t, n in slots.items()}
    return CachePlan(budget_bytes=int(budget_bytes), prefetch_depth=depth, load_factors=factors,
                     cache_bytes=cache_bytes, slots=slots)
