"""Per-table cache load factors from TorchRec's planner, measured curves and a device budget.

TorchRec's ``EmbeddingOffloadScaleupProposer`` (Embedding Offloading, RecSys'24) spends the
device memory left after the other tables on the caches whose misses cost most, using the
``CacheStatistics`` in each table's ``CacheParams``. Here it runs with TorchRec's other
proposers inside TorchRec's own ``EmbeddingShardingPlanner``; what proactive fetching changes
goes in through the planner's extension points (its estimator list), not a copy of it:

* :class:`ProactivePerfEstimator`: TorchRec's perf estimate, with a cached shard's
  ``prefetch_compute`` (the copy of its missing rows) cut to the part the step model
  (:func:`~torchrec_proactive.bench.step_model.step_s`) cannot hide behind the shard's own
  communication and compute of the ``k`` batches ahead; at depth 0 it is all charged.
* :class:`ProactiveStorageEstimator`: TorchRec's storage estimate of a cache never below the
  rows the ``k + 1`` batches in flight pin (the curve's ``pinned_rows``).

The cache *sizes* are planned on a device topology whose device memory is the budget
(``hbm_cap``): on CUDA the memory left over, on CPU - where TorchRec plans no device memory -
``cache.budget_bytes``, so the same planning runs in CI. Only the chosen load factors leave
this module; the run's own plan is then built as before, with those factors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.distributed.planner.constants import BATCH_SIZE
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.proposers import (EmbeddingOffloadScaleupProposer, GreedyProposer,
                                                    UniformProposer)
from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator, EmbeddingStorageEstimator
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import (KernelConfig, PlannerError, ShardingOption, Topology,
                                                TopologyFactory, TrainerConfig)
from torchrec.distributed.types import CacheAlgorithm, CacheParams, ShardingPlan

from ..bench.step_model import StageCosts, step_s
from ..planning import find_ebcs, planner_warnings
from .curve import MissRatioCurve
from .proposer import MissCurveProposer

__all__ = ["CachePlan", "CacheBudgetError", "ProactivePerfEstimator", "ProactiveStorageEstimator",
           "plan_cache_sizes"]

_CACHED = EmbeddingComputeKernel.FUSED_UVM_CACHING.value
#: TorchRec's planner takes cache load factors strictly below 1; a table the proposer
#: promotes to resident (``fused``) gets this one (every row but rounding).
MAX_PLANNED_LOAD_FACTOR = 0.999
LOG = logging.getLogger("torchrec_proactive.cacheplan")


class CacheBudgetError(ValueError):
    """The device budget cannot hold the pinned rows of ``depth + 1`` batches."""


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
    """The planner's per-table cache load factors under one budget (bytes per device)."""

    budget_bytes: int
    prefetch_depth: int
    load_factors: Dict[str, float]
    cache_bytes: Dict[str, int]  # device bytes of each table's cache rows (all shards)

    def describe(self) -> str:
        """The plan log's one line."""
        shown = ", ".join(f"{t}={lf:.3f}" for t, lf in sorted(self.load_factors.items()))
        return (f"cache plan (TorchRec planner, EmbeddingOffloadScaleup + miss-curve proposers, depth {self.prefetch_depth}, budget "
                f"{self.budget_bytes} bytes/device): cache rows {sum(self.cache_bytes.values())} bytes on all devices; "
                f"load factors {shown}")


def _row_bytes(option_or_cfg: object) -> int:
    return int(option_or_cfg.embedding_dim) * 4  # type: ignore[attr-defined]  # fp32 rows


def _largest(need: Mapping[str, int], n: int = 6) -> str:
    worst = sorted(need.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{t}: {b}" for t, b in worst[:n]) + (f" and {len(worst) - n} more" if len(worst) > n else "")


def check_budget(curves: Mapping[str, MissRatioCurve], dims: Mapping[str, int], budget_bytes: int,
                 world_size: int, depth: int) -> None:
    """Refuses (one line) a budget that cannot hold the pinned rows of ``depth + 1`` batches."""
    need = {t: c.pinned_rows * dims[t] * 4 for t, c in curves.items()}
    total = sum(need.values())
    if total > budget_bytes * world_size:
        shown = _largest(need)
        raise CacheBudgetError(
            f"cache.budget_bytes={budget_bytes} x {world_size} device(s) = {budget_bytes * world_size} bytes cannot hold "
            f"the rows pinned by prefetch depth {depth} ({depth + 1} batches in flight): {total} bytes needed ({shown})")


def plan_cache_sizes(
    model: nn.Module,
    sharder: EmbeddingBagCollectionSharder,
    curves: Mapping[str, MissRatioCurve],
    budget_bytes: Optional[int],
    prefetch_depth: int,
    world_size: int,
    local_size: Optional[int] = None,
    device_type: str = "cpu",
    batch_size: Optional[int] = None,
    pg: Optional[dist.ProcessGroup] = None,
) -> CachePlan:
    """Load factors for every table in ``curves`` (the model's other tables are planned as
    usual), chosen by TorchRec's planner on a device topology of ``budget_bytes`` per device.

    ``budget_bytes=None`` (CUDA only): the device's memory, less TorchRec's usual 15% for the
    dense part - the HBM the other tables leave is what the caches get.

    Raises :class:`CacheBudgetError` (one line naming tables and bytes) when the budget
    cannot hold the rows of ``prefetch_depth + 1`` batches.
    """
    reserve = 0.0  # a given budget is for the embedding tables alone: nothing reserved
    if budget_bytes is None:
        if device_type != "cuda" or not torch.cuda.is_available():
            raise ValueError("cache.budget_bytes=-1 (the device memory left over) needs a CUDA device; "
                             "on CPU give the budget in bytes")
        budget_bytes, reserve = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory, 0.15
    if budget_bytes < 1:
        raise ValueError(f"cache.budget_bytes must be >= 1, got {budget_bytes!r}")
    configs = {c.name: c for ebc in find_ebcs(model).values() for c in ebc.embedding_bag_configs()}
    unknown = sorted(set(curves) - set(configs))
    if unknown:
        raise ValueError(f"cache profile names tables {unknown} that the model does not have (it has {sorted(configs)})")
    for name, c in curves.items():
        if c.num_rows != configs[name].num_embeddings:
            raise ValueError(f"cache profile: table '{name}' has {c.num_rows} rows in the profile but "
                             f"{configs[name].num_embeddings} in the model (profile again)")
    check_budget(curves, {t: configs[t].embedding_dim for t in curves}, int(budget_bytes * (1 - reserve)), world_size,
                 prefetch_depth)
    local_size = local_size or world_size
    types = [t for t in sharder.sharding_types(device_type) if _CACHED in sharder.compute_kernels(t, device_type)]
    constraints: Dict[str, ParameterConstraints] = {}
    for name, curve in curves.items():
        start = min(max(curve.min_load_factor, 1.0 / curve.num_rows), MAX_PLANNED_LOAD_FACTOR)
        constraints[name] = ParameterConstraints(
            sharding_types=types, compute_kernels=[_CACHED],
            cache_params=CacheParams(algorithm=CacheAlgorithm.LRU, load_factor=start, stats=curve))
    topology = TopologyFactory.create_topology(
        TrainerConfig(world_size=world_size, local_world_size=local_size, hbm_cap_bytes=int(budget_bytes)),
        kernel_config=KernelConfig(compute_device="cuda"),
    )
    enumerator = EmbeddingEnumerator(
        topology=topology, batch_size=batch_size or BATCH_SIZE, constraints=constraints,
        estimator=[ProactivePerfEstimator(topology, constraints, prefetch_depth=prefetch_depth),
                   ProactiveStorageEstimator(topology, constraints)])
    planner = EmbeddingShardingPlanner(
        topology=topology, batch_size=batch_size, constraints=constraints, enumerator=enumerator,
        storage_reservation=FixedPercentageStorageReservation(reserve),
        # TorchRec's proposers, and ours that splits the budget along the measured curves;
        # the planner keeps the plan its perf model (proactive costs) rates best
        proposer=[GreedyProposer(), UniformProposer(), EmbeddingOffloadScaleupProposer(), MissCurveProposer()],
    )
    try:
        with planner_warnings():
            plan = (planner.collective_plan(model, [sharder], pg) if pg is not None
                    else planner.plan(model, [sharder]))
    except PlannerError as e:
        need = {t: c.pinned_rows * configs[t].embedding_dim * 4 for t, c in curves.items()}
        raise CacheBudgetError(
            f"cache.budget_bytes={budget_bytes}: TorchRec's planner found no placement of the cached tables "
            f"at prefetch depth {prefetch_depth} (pinned rows need {sum(need.values())} bytes: {_largest(need)}; "
            f"TorchRec also counts optimizer state and I/O buffers): {str(e).splitlines()[0][:160]}") from None
    return _read_plan(plan, curves, configs, budget_bytes, prefetch_depth)


def _read_plan(plan: ShardingPlan, curves: Mapping[str, MissRatioCurve], configs: Mapping[str, object],
               budget_bytes: int, depth: int) -> CachePlan:
    factors: Dict[str, float] = {}
    for module_plan in plan.plan.values():
        for name, ps in module_plan.items():  # type: ignore[union-attr]
            if name not in curves:
                continue
            lf = ps.cache_params.load_factor if ps.cache_params is not None else None
            # promoted to resident (fused) by the proposer: the whole table
            lf = MAX_PLANNED_LOAD_FACTOR if (ps.compute_kernel != _CACHED or lf is None) else lf
            factors[name] = float(min(max(lf, curves[name].min_load_factor), MAX_PLANNED_LOAD_FACTOR))
    cache_bytes = {t: int(round(lf * configs[t].num_embeddings)) * _row_bytes(configs[t])  # type: ignore[attr-defined]
                   for t, lf in factors.items()}
    return CachePlan(budget_bytes=int(budget_bytes), prefetch_depth=depth, load_factors=factors,
                     cache_bytes=cache_bytes)

