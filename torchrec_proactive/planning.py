"""Building sharding plans and sharded models the same way for every run (example, bench, tests).

Plans cover every ``EmbeddingBagCollection`` and ``EmbeddingCollection`` that a sharder given
shards (stock's or ours: one sharder per collection type).

``sharding`` names one of TorchRec's sharding types for all tables (``table_wise``,
``row_wise``, ``column_wise``, ``table_row_wise``, ``data_parallel``), a per-table mapping of
them, or ``auto`` for TorchRec's planner. ``kernel`` is the compute kernel of every
non-data-parallel table; ``fused_uvm_caching`` makes a table proactive under our sharder.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import HardwareConfig, KernelConfig, TopologyFactory, TrainerConfig
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.types import CacheParams, KeyValueParams, ShardingEnv, ShardingPlan
from torchrec.distributed.types import ModuleSharder
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")
KERNELS = ("fused", "fused_uvm_caching", "dense", "key_value")
#: The kernels our sharder serves proactively (``key_value``: with a disk tier, on CPU).
PROACTIVE_KERNELS = ("fused_uvm_caching", "key_value")


def _generator(sharding: str, table_index: int, world_size: int, local_size: int) -> Callable[..., Any]:
    if sharding == "table_wise":
        return table_wise(rank=table_index % world_size)
    if sharding == "row_wise":
        return row_wise()
    if sharding == "column_wise":
        return column_wise(ranks=list(range(world_size)))
    if sharding == "table_row_wise":
        return table_row_wise(host_index=(table_index % max(world_size // local_size, 1)))
    if sharding == "data_parallel":
        return data_parallel()
    raise ValueError(f"unknown sharding type {sharding!r}; choose from {SHARDING_TYPES} or 'auto'")


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage().splitlines()[0][:200])


@contextlib.contextmanager
def planner_warnings() -> Iterator[List[str]]:
    """Collects the warnings TorchRec's planner logs (advice for its own callers, e.g. on
    dry runs) instead of printing them, for a one-line summary; restores its logger after."""
    logger = logging.getLogger("torchrec.distributed.planner")
    handler, propagate = _Collect(), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def find_ebcs(model: nn.Module) -> Dict[str, EmbeddingBagCollection]:
    return {name: m for name, m in model.named_modules() if isinstance(m, EmbeddingBagCollection)}


Sharders = Union[ModuleSharder[nn.Module], Sequence[ModuleSharder[nn.Module]]]


def as_sharders(sharder: Sharders) -> List[ModuleSharder[nn.Module]]:
    """One sharder or several (one per collection type), as a list."""
    return [sharder] if isinstance(sharder, ModuleSharder) else list(sharder)


def table_configs(module: nn.Module) -> List[Any]:
    """An embedding collection's table configs (``EmbeddingBagConfig`` or ``EmbeddingConfig``)."""
    if isinstance(module, EmbeddingCollection):
        return list(module.embedding_configs())
    return list(module.embedding_bag_configs())  # type: ignore[operator]


def find_collections(model: nn.Module, sharders: Sharders) -> Dict[str, "tuple[nn.Module, ModuleSharder[nn.Module]]"]:
    """``{fqn: (collection, its sharder)}`` for every module of ``model`` a sharder shards."""
    by_type = {s.module_type: s for s in as_sharders(sharders)}
    return {name: (m, by_type[type(m)]) for name, m in model.named_modules() if type(m) in by_type}


def build_plan(
    model: nn.Module,
    sharder: Sharders,
    sharding: Union[str, Mapping[str, str]],
    kernel: str = "fused_uvm_caching",
    world_size: Optional[int] = None,
    local_size: Optional[int] = None,
    device_type: str = "cpu",
    cache_load_factor: Optional[Union[float, Mapping[str, float]]] = None,
    pg: Optional[dist.ProcessGroup] = None,
    sharding_types: Optional[Sequence[str]] = None,
    key_value_params: Optional[KeyValueParams] = None,
    ssd_cap_bytes: int = 0,
) -> ShardingPlan:
    """A plan for every embedding collection in ``model`` that ``sharder`` (one, or one per
    collection type) shards.

    Hand-built (``construct_module_sharding_plan``) for explicit sharding types; TorchRec's
    planner for ``"auto"`` (constrained to ``kernel``, the cache load factor and, when given,
    ``sharding_types``: e.g. the cache planner's, whose whole-table floors hold only in shards
    that hold every row). ``cache_load_factor``: one for every table, or per table (e.g. the
    cache planner's). ``key_value``: tables larger than host memory, on disk as
    ``key_value_params`` says (TorchRec's SSD vocabulary); the planner needs a topology with
    SSD (``ssd_cap_bytes`` per rank) to place them.
    """
    if kernel not in KERNELS:
        raise ValueError(f"unknown compute kernel {kernel!r}; choose from {KERNELS}")
    world_size = world_size or dist.get_world_size()
    local_size = local_size or world_size
    collections = find_collections(model, sharder)
    if not collections:
        kinds = sorted({s.module_type.__name__ for s in as_sharders(sharder)})
        raise ValueError(f"the model has no {' or '.join(kinds)} to shard")
    if kernel == "key_value" and key_value_params is None:
        raise ValueError("kernel='key_value' needs key_value_params=KeyValueParams(ssd_storage_directory=...)")
    kv = key_value_params if kernel == "key_value" else None

    def cache_for(table: str) -> Optional[CacheParams]:
        lf = cache_load_factor.get(table) if isinstance(cache_load_factor, Mapping) else cache_load_factor
        return CacheParams(load_factor=lf) if lf is not None else None

    if sharding == "auto":
        # TorchRec's CPU perf estimators know no UVM caching (CPU has no UVM), so on CPU the
        # planner places the tables as `fused` and the placement is then marked cached.
        plan_kernel = "fused" if (device_type == "cpu" and kernel == "fused_uvm_caching") else kernel
        # Only the sharding types that can run `kernel` (the sharder says which: proactive
        # tables support fewer than stock's `fused` on CPU, and data_parallel tables are
        # dense - offering it made the planner warn once per table that no kernel fits).
        def types(s: Any) -> List[str]:
            return [t for t in s.sharding_types(device_type) if kernel in s.compute_kernels(t, device_type)
                    and (sharding_types is None or t in sharding_types)]

        constraints = {
            cfg.name: ParameterConstraints(sharding_types=types(s), compute_kernels=[plan_kernel],
                                           cache_params=cache_for(cfg.name), key_value_params=kv)
            for module, s in collections.values() for cfg in table_configs(module)
        }
        topology = TopologyFactory.create_topology(
            TrainerConfig(world_size=world_size, local_world_size=local_size),
            hardware_config=HardwareConfig(ssd_cap_bytes=ssd_cap_bytes) if ssd_cap_bytes else None,
            kernel_config=KernelConfig(compute_device=device_type),
        )
        # TorchRec's recommended reservation (its default heuristic one warns that it is
        # deprecated): 15% of each device's memory for the dense part, as the default.
        enumerator = None
        if kernel == "key_value":
            # TorchRec counts a key_value shard's DRAM as nothing on CPU: count its caches
            from torchrec.distributed.planner.constants import BATCH_SIZE, DEFAULT_PERF_ESTIMATOR
            from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
            from torchrec.distributed.planner.estimator.estimator import EmbeddingPerfEstimatorFactory

            from .integration.planner_support import DiskTierStorageEstimator

            host = {t: b for s in as_sharders(sharder)
                    for t, b in (getattr(s, "host_cache_bytes", None) or {}).items()}  # (the sharders' own)
            perf = EmbeddingPerfEstimatorFactory.create(DEFAULT_PERF_ESTIMATOR, topology=topology,
                                                        constraints=constraints)
            enumerator = EmbeddingEnumerator(topology=topology, batch_size=BATCH_SIZE, constraints=constraints,
                                             estimator=[perf, DiskTierStorageEstimator(topology, constraints,
                                                                                        host_cache_bytes=host)])
        planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints, enumerator=enumerator,
                                           storage_reservation=FixedPercentageStorageReservation(0.15))
        with planner_warnings() as heard:
            plan = planner.collective_plan(model, as_sharders(sharder), pg or dist.GroupMember.WORLD)
        if heard:  # one line (a run shows it in its log, in config words)
            warnings.warn(f"TorchRec's planner logged {len(heard)} warning(s); the first: {heard[0]}", stacklevel=2)
        if plan_kernel != kernel:
            for module_plan in plan.plan.values():
                for name, ps in module_plan.items():  # type: ignore[union-attr]
                    if ps.compute_kernel == plan_kernel:
                        ps.compute_kernel = kernel
                        ps.cache_params = cache_for(name)
        return plan
    plan: Dict[str, Any] = {}
    for fqn, (module, module_sharder) in collections.items():
        names = [c.name for c in table_configs(module)]
        if isinstance(sharding, Mapping):
            unknown = sorted(set(sharding) - set(names))
            if unknown:
                raise ValueError(f"sharding plan names unknown tables {unknown}; the model has {names}")
            per_table = {n: sharding.get(n, "table_wise") for n in names}
        else:
            per_table = {n: sharding for n in names}
        gens = {n: _generator(per_table[n], i, world_size, local_size) for i, n in enumerate(names)}
        module_plan = construct_module_sharding_plan(
            module, per_param_sharding=gens, sharder=module_sharder, local_size=local_size,
            world_size=world_size, device_type=device_type,
        )
        for name, ps in module_plan.items():
            if per_table[name] != "data_parallel":
                ps.compute_kernel = kernel
                if cache_for(name) is not None and kernel in PROACTIVE_KERNELS:
                    ps.cache_params = cache_for(name)
                if kv is not None:
                    ps.key_value_params = kv
        plan[fqn] = module_plan
    return ShardingPlan(plan)


def shard_model(
    model: nn.Module,
    sharder: Sharders,
    plan: ShardingPlan,
    device: torch.device,
    pg: Optional[dist.ProcessGroup] = None,
) -> DistributedModelParallel:
    """Wraps ``model`` in ``DistributedModelParallel`` with ``plan`` (weights not initialised again)."""
    return DistributedModelParallel(
        module=model,
        env=ShardingEnv.from_process_group(pg or dist.GroupMember.WORLD),
        device=device,
        plan=plan,
        sharders=as_sharders(sharder),
        init_data_parallel=True,
    )


def combined_optimizer(
    dmp: DistributedModelParallel, dense_factory: Callable[[List[torch.Tensor]], torch.optim.Optimizer]
) -> CombinedOptimizer:
    """Fused (embedding) optimizer + a dense optimizer over every non-fused parameter."""
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())), dense_factory)
    return CombinedOptimizer([dmp.fused_optimizer, dense])
