"""Model, sharder, plan and optimizer factories."""

from __future__ import annotations

import dataclasses
import math
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.embedding_sharding import USE_ONE_TBE_PER_TABLE
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import KeyValueParams, ShardingPlan
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRMTrain
from torchrec.optim.keyed import CombinedOptimizer

from .. import ProactiveEmbeddingBagCollectionSharder, ProactiveEmbeddingCollectionSharder
from ..cacheplan.planner import WHOLE_ROW_SHARDINGS
from ..config.schema import NUM_DENSE_FEATURES, NUM_SPARSE_FEATURES, Config, ModelConfig, OptimizerConfig
from ..data.history import HISTORY_FEATURE
from ..fetch import LinkModel
from ..integration.disk_tier import resolve_directory
from ..planning import PROACTIVE_KERNELS, Sharders, as_sharders, build_plan, combined_optimizer, shard_model
from .env import RankEnv
from .sequence import build_sequence_model, history_table

FEATURES = [f"cat_{i}" for i in range(NUM_SPARSE_FEATURES)]  # keys of the Criteo loader's KJT
_EMB_OPT = {
    "sgd": EmbOptimType.EXACT_SGD,
    "adagrad": EmbOptimType.EXACT_ADAGRAD,
    "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    "adam": EmbOptimType.ADAM,
}


def table_configs(cfg: ModelConfig, cardinalities: Sequence[int]) -> List[EmbeddingBagConfig]:
    rows = list(cfg.num_embeddings_per_feature or cardinalities)
    return [
        EmbeddingBagConfig(name=f"t_{f}", embedding_dim=cfg.embedding_dim, num_embeddings=n, feature_names=[f])
        for f, n in zip(FEATURES, rows)
    ]


def model_tables(cfg: ModelConfig, cardinalities: Sequence[int]) -> List[Any]:
    """Every table of the model: the pooled ones (:func:`table_configs`) and, for
    ``arch=sequence``, the history's (an ``EmbeddingConfig``, last)."""
    tables: List[Any] = list(table_configs(cfg, cardinalities))
    return tables + [history_table(cfg)] if cfg.arch == "sequence" else tables


def build_model(cfg: ModelConfig, cardinalities: Sequence[int], device: torch.device) -> DLRMTrain:
    """``DLRMTrain(DLRM | DLRM_DCN | SequenceRecommender)``. The embedding tables are built
    on the meta device: sharding allocates (and initialises) only each rank's shards."""
    if cfg.arch == "sequence":
        return build_sequence_model(cfg, table_configs(cfg, cardinalities), device)
    ebc = EmbeddingBagCollection(tables=table_configs(cfg, cardinalities), device=torch.device("meta"))
    common = dict(
        embedding_bag_collection=ebc, dense_in_features=NUM_DENSE_FEATURES,
        dense_arch_layer_sizes=list(cfg.dense_arch_layer_sizes),
        over_arch_layer_sizes=list(cfg.over_arch_layer_sizes), dense_device=device,
    )
    if cfg.arch == "dcnv2":
        net: nn.Module = DLRM_DCN(dcn_num_layers=cfg.dcn_num_layers, dcn_low_rank_dim=cfg.dcn_low_rank_dim, **common)
    else:
        net = DLRM(**common)
    return DLRMTrain(net)


def fused_params(cfg: OptimizerConfig) -> Dict[str, object]:
    params: Dict[str, object] = {"optimizer": _EMB_OPT[cfg.embedding], "learning_rate": cfg.embedding_lr}
    if cfg.embedding != "sgd":
        params["eps"] = cfg.embedding_eps
    return params


def cache_slots(
    tables: Sequence[Any], cfg: Config, world_size: int, local_size: int, depth: int,
    shard_rows: Optional[Mapping[str, int]] = None,
) -> Tuple[Dict[str, int], List[str]]:
    """Per-table cache sizes for tables whose load-factor cache cannot hold the rows of
    ``depth + 1`` in-flight batches (the pipeline pins that many), plus a note for each.

    One batch brings at most ``world_size * batch_size`` ids per feature to a shard (one id
    per sample and feature in Criteo - ``data.multi_hot_sizes[f]`` in multi-hot data,
    ``model.history_length`` in the history of ``arch=sequence`` - whatever the sharding),
    so that bound - capped by the shard's rows - is what must fit, per batch. Tables that
    already fit are left to the load factor.

    ``shard_rows``: the rows of each table's largest shard in the plan (:func:`shard_rows`);
    tables it leaves out are not cached. Without it the rows are estimated from
    ``sharding.type`` - which, for ``auto``, cannot know the planner's choice per table.
    """
    if not cfg.cache.fit_depth or cfg.cache.budget_bytes:  # (planned sizes keep the measured pins)
        return {}, []
    batches = depth + 1
    ids_per_batch = world_size * cfg.train.batch_size
    # ids per sample of each feature: 1 in Criteo, data.multi_hot_sizes in MLPerf DLRM-v2's multi-hot data
    hot = dict(zip(FEATURES, cfg.data.multi_hot_sizes)) if cfg.data.multi_hot and cfg.data.multi_hot_sizes else {}
    if cfg.model.arch == "sequence":  # a history holds up to history_length ids per sample
        hot[HISTORY_FEATURE] = cfg.model.history_length
    divisor = {"row_wise": world_size, "table_row_wise": local_size, "auto": world_size}.get(cfg.sharding.type, 1)
    slots: Dict[str, int] = {}
    notes: List[str] = []
    for t in tables:
        if shard_rows is not None and t.name not in shard_rows:
            continue  # not a cached table in this plan
        local_rows = shard_rows[t.name] if shard_rows is not None else math.ceil(t.num_embeddings / divisor)
        by_factor = max(1, round(cfg.cache.load_factor * local_rows))
        need = min(local_rows, batches * ids_per_batch * sum(hot.get(f, 1) for f in t.feature_names))
        if by_factor < need:
            slots[t.name] = need
            whole = f" ({WHOLE_TABLE})" if need == local_rows else ""
            notes.append(f"{t.name}: {by_factor} -> {need} slots{whole}")
    return slots, notes


WHOLE_TABLE = "whole table"


def describe_growth(notes: Sequence[str], depth: int) -> str:
    """The one log line for :func:`cache_slots`'s notes; says when caches became whole
    tables (every row stays on the device: nothing is fetched, the hit rate is 1)."""
    whole = sum(n.endswith(f"({WHOLE_TABLE})") for n in notes)
    if whole == len(notes):
        what = (f"- every one of the {whole} table(s) whole (every row on the device: nothing is fetched, the hit "
                f"rate is 1, and a depth comparison compares nothing; use a smaller depth or a larger table)")
    elif whole:
        what = f"for {len(notes)} table(s), {whole} of them to the whole table"
    else:
        what = f"for {len(notes)} table(s)"
    shown = "; ".join(notes[:4]) + (" ..." if len(notes) > 4 else "")
    return f"cache.fit_depth: caches grown to hold {depth + 1} batches {what}: {shown}"


def build_sharder(cfg: Config, slots: Dict[str, int], tables: Sequence[Any] = ()) -> Sharders:
    """The proactive sharder of the model's collections, with the run's options: the EBC
    sharder, and for ``arch=sequence`` a list of the EC sharder and the EBC sharder, both
    with the same options (``planning.build_plan`` and ``shard_model`` take either)."""
    link = None
    if cfg.link.kind == "emulated":
        link = LinkModel(bandwidth_gbps=cfg.link.bandwidth_gbps, latency_us=cfg.link.latency_us)
    fused = fused_params(cfg.optimizer)
    if cfg.cache.budget_bytes and _plans_on_device(cfg):
        # Planned per-table sizes: on the host planner a group's store gives each table its
        # own share of its slots (the sharder's table_budgets="auto"). The device planner
        # does not partition its cache yet, so there each table gets a store of its own
        # (TorchRec: one TBE per table), else the group would share one cache.
        fused[USE_ONE_TBE_PER_TABLE] = True
    if cfg.tier.kind == "ssd" and cfg.tier.host_budget_mb:
        # Planned host caches: one store per table, else a group's tables would share the
        # sum of their sizes (one host cache per store) and the split would not hold.
        fused[USE_ONE_TBE_PER_TABLE] = True
    host_cache = ({t.name: int(cfg.tier.host_cache_mb * 2**20) for t in tables} if cfg.tier.kind == "ssd" else None)
    options: Dict[str, Any] = dict(cache_load_factor=cfg.cache.load_factor, eviction_policy=cfg.cache.eviction_policy,
                                   num_slots=slots, link=link)
    ebc = ProactiveEmbeddingBagCollectionSharder(fused_params=fused, host_cache_bytes=host_cache, **options)
    if cfg.model.arch != "sequence":
        return ebc
    # (tier=ssd is refused for this model at composition: the disk tier serves bags only)
    return [ProactiveEmbeddingCollectionSharder(fused_params=dict(fused), **options), ebc]


def _plans_on_device(cfg: Config) -> bool:
    """Whether this run's tables plan on the device (``TieredTable(planner="device")``): on CUDA."""
    return cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())


def plan(model: DLRMTrain, sharder: Sharders, cfg: Config, env: RankEnv,
         load_factors: Optional[Mapping[str, float]] = None) -> ShardingPlan:
    """The sharding plan of ``sharding.*`` (TorchRec's planner for ``auto``). ``load_factors``:
    per table (the cache planner's, whose sharding types the plan keeps to: table- and
    column-wise, whose shards hold every row), else ``cache.load_factor`` for all."""
    kernel, kv, ssd_cap = cfg.sharding.kernel, None, 0
    if cfg.tier.kind == "ssd":
        # TorchRec's words for a table larger than host memory (see the sharder): the host
        # cache is sized per table by the sharder (tier.host_cache_mb), finer than l2_cache_size.
        kernel, kv = "key_value", KeyValueParams(ssd_storage_directory=cfg.tier.dir)
        ssd_cap = shutil.disk_usage(tier_parent(cfg.tier.dir)).total
    return build_plan(
        model, sharder, cfg.sharding.type, kernel=kernel, world_size=env.world_size,
        local_size=env.local_world_size, device_type=env.device.type,
        cache_load_factor=(load_factors or cfg.cache.load_factor) if cfg.sharding.kernel == "fused_uvm_caching" else None,
        sharding_types=_whole_table_types(cfg, load_factors), key_value_params=kv, ssd_cap_bytes=ssd_cap,
    )


def _whole_table_types(cfg: Config, load_factors: Optional[Mapping[str, float]]) -> Optional[Sequence[str]]:
    """The sharding types a plan of planned caches keeps to: those whose shards hold every
    row (the curves measure whole tables); table-wise only for planned host caches, each of
    which one rank's budget pays for whole."""
    if cfg.tier.kind == "ssd" and cfg.tier.host_budget_mb:
        return ("table_wise",)
    return WHOLE_ROW_SHARDINGS if load_factors else None


def tier_parent(directory: str) -> Path:
    """The nearest existing directory at or above ``directory`` (where its disk is)."""
    path = resolve_directory(directory, local_rank=0).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def shard_rows(sharding_plan: ShardingPlan) -> Dict[str, int]:
    """Rows of the largest shard of each cached (``fused_uvm_caching``) table of the plan:
    what a rank's cache of that table is sized against (TorchRec's ``ShardMetadata``)."""
    rows: Dict[str, int] = {}
    for module_plan in sharding_plan.plan.values():
        for name, ps in module_plan.items():  # type: ignore[union-attr]
            if ps.compute_kernel in PROACTIVE_KERNELS and ps.sharding_spec is not None:
                rows[name] = max(int(shard.shard_sizes[0]) for shard in ps.sharding_spec.shards)
    return rows


def cache_slots_of(dmp: nn.Module) -> Dict[Tuple[str, int], int]:
    """The rows each proactive table shard's cache holds on this rank, by (table, first row),
    as its store was built (``ProactiveOptions.slots_for``: ``num_slots`` or the plan's load
    factor, at most the shard's rows). Tables of one store with equal load factors share
    its slots: each is given its own share here. :func:`table_slots` adds them up."""
    from ..integration.sharded_module import ProactiveShardedModule

    by_rows: Dict[Tuple[str, int], int] = {}
    for module in dmp.modules():
        if not isinstance(module, ProactiveShardedModule):
            continue
        options = module._proactive_options
        for kernel in module.proactive_kernels:
            for t in kernel._config.embedding_tables:
                lf = float((t.fused_params or {}).get("cache_load_factor", options.cache_load_factor))
                offset = int(t.local_metadata.shard_offsets[0]) if t.local_metadata else 0
                by_rows[(t.name, offset)] = options.slots_for(t.name, t.local_rows, lf)
    return by_rows


def table_slots(per_rank: Sequence[Mapping[Tuple[str, int], int]]) -> Dict[str, int]:
    """Per table, the rows its caches hold over every rank: row-wise shards summed, column
    shards of the same rows counted once."""
    merged: Dict[Tuple[str, int], int] = {}
    for shards in per_rank:
        merged.update(shards)
    out: Dict[str, int] = {}
    for (name, _), slots in sorted(merged.items()):
        out[name] = out.get(name, 0) + slots
    return out


def with_slots(sharder: Sharders, slots: Dict[str, int]) -> Sharders:
    """``sharder`` (one or a list) with per-table cache sizes (set after planning: they
    depend on the plan). Each sharder gets them all; it uses its own tables'."""
    for s in as_sharders(sharder):
        s.options = dataclasses.replace(s.options, num_slots=dict(slots))  # type: ignore[attr-defined]
    return sharder


def with_host_caches(sharder: Sharders, host_cache_bytes: Mapping[str, int]) -> Sharders:
    """``sharder`` (one or a list) with per-table host caches of tables on disk (planned
    after the sharding plan: they depend on where each table went)."""
    for s in as_sharders(sharder):
        if hasattr(s, "host_cache_bytes"):  # (the EBC sharder: the disk tier serves bags)
            s.host_cache_bytes = dict(host_cache_bytes)  # type: ignore[attr-defined]
    return sharder


def shard(model: DLRMTrain, sharder: Sharders, cfg: Config,
          env: RankEnv, sharding_plan: Optional[ShardingPlan] = None) -> DistributedModelParallel:
    return shard_model(model, sharder, sharding_plan or plan(model, sharder, cfg, env), env.device)


def _dense_factory(cfg: OptimizerConfig) -> Callable[[List[torch.Tensor]], torch.optim.Optimizer]:
    if cfg.dense == "sgd":
        return lambda params: torch.optim.SGD(params, lr=cfg.dense_lr)
    if cfg.dense == "adagrad":
        return lambda params: torch.optim.Adagrad(params, lr=cfg.dense_lr, eps=cfg.dense_eps)
    return lambda params: torch.optim.Adam(params, lr=cfg.dense_lr, eps=cfg.dense_eps)


def build_optimizer(dmp: DistributedModelParallel, cfg: OptimizerConfig) -> CombinedOptimizer:
    return combined_optimizer(dmp, _dense_factory(cfg))
