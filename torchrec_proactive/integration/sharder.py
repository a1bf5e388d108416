"""The sharders users swap in for TorchRec's ``EmbeddingBagCollectionSharder`` and
``EmbeddingCollectionSharder``: one plan vocabulary, one store, one set of options."""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections import Counter
from typing import Any, Dict, List, Mapping, Optional

import torch
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.types import CacheParams, ParameterSharding, ShardingEnv, ShardingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from ..fetch import LinkModel
from .options import ProactiveOptions
from .disk_tier import KEY_VALUE, DiskTierSpec, resolve_directory, spec_from_plan
from .planner_support import register_cpu_cached_kernel
from .sharded_ebc import ProactiveShardedEmbeddingBagCollection
from .sharded_ec import ProactiveShardedEmbeddingCollection

# TorchRec's planner must be able to rate the cached kernel on CPU (see planner_support).
register_cpu_cached_kernel()
_LOG = logging.getLogger(__name__)

_CACHED = EmbeddingComputeKernel.FUSED_UVM_CACHING.value
# The sharding types proven exact against stock TorchRec by the 2-rank tests.
_SUPPORTED_SHARDING = frozenset(
    t.value for t in (ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.COLUMN_WISE, ShardingType.TABLE_ROW_WISE)
)
# Stock TorchRec shards sequence tables table-, row- and column-wise (and data-parallel).
_SUPPORTED_SEQUENCE_SHARDING = frozenset(
    t.value for t in (ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.COLUMN_WISE)
)


class _ProactiveSharding:
    """What the proactive sharders share, mixed in before TorchRec's sharder: the options,
    the kernels offered to the planner, the plan's cached tables marked for prefetch, and
    the announcement of which tables are proactive. A subclass names its collection's
    supported sharding types and whether ``key_value`` tables get the disk tier."""

    _supported_sharding: frozenset = _SUPPORTED_SHARDING
    _disk_tier: bool = True

    def __init__(
        self,
        fused_params: Optional[Dict[str, Any]] = None,
        qcomm_codecs_registry: Optional[Dict[str, Any]] = None,
        *,
        cache_load_factor: float = 0.2,
        eviction_policy: str = "lru",
        num_slots: Optional[Mapping[str, int]] = None,
        hot_rows: Optional[Mapping[str, torch.Tensor]] = None,
        link: Optional[LinkModel] = None,
        debug_checks: bool = False,
        planner: str = "auto",
        table_budgets: str = "auto",
        host_cache_bytes: Optional[Mapping[str, int]] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry,  # type: ignore[call-arg]
                         **kwargs)
        self.options = ProactiveOptions(
            cache_load_factor=cache_load_factor,
            num_slots=dict(num_slots or {}),
            eviction_policy=eviction_policy,
            hot_rows=dict(hot_rows or {}),
            link=link,
            debug_checks=debug_checks,
            planner=planner,
            table_budgets=table_budgets,
        )
        self.host_cache_bytes: Dict[str, int] = dict(host_cache_bytes or {})
        self._announced: set = set()
        hide_own_planner_notes()

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        """Stock's kernels, with ``fused_uvm_caching`` offered exactly for the sharding types
        proactive tables support (so the planner never picks a placement ``shard`` refuses)."""
        kernels = [k for k in super().compute_kernels(sharding_type, compute_device_type)  # type: ignore[misc]
                   if k != _CACHED]
        if sharding_type in self._supported_sharding:
            kernels.append(_CACHED)
            # (stock offers key_value on CUDA only; the disk tier serves it on any device)
            if self._disk_tier and KEY_VALUE not in kernels:
                kernels.append(KEY_VALUE)
        return kernels

    @staticmethod
    def _table_names(module: Any) -> List[str]:
        """The tables of the (unsharded) collection."""
        raise NotImplementedError

    def _prepare_plan(self, module: Any, params: Dict[str, ParameterSharding], env: ShardingEnv,
                      device: Optional[torch.device]) -> "tuple[Dict[str, ParameterSharding], ProactiveOptions]":
        """The plan as the sharded module takes it (see ``_mark_cached_tables``), and the
        options with the disk tier's tables; announced once per sharder, on rank 0."""
        # The disk tier serves key_value tables on CPU and CUDA ranks alike (its groups are
        # planned on the host; on CUDA the copy stream's worker moves their rows).
        disk: Optional[Dict[str, DiskTierSpec]] = {} if self._disk_tier else None
        marked = self._mark_cached_tables(module, params, disk)
        options = dataclasses.replace(self.options, disk=disk) if disk else self.options
        if id(module) not in self._announced and getattr(env, "rank", 0) == 0:
            self._announced.add(id(module))  # once per module it shards (several EBCs: each), on one rank
            self.announce(marked, options)
        return marked, options

    @staticmethod
    def announce(params: Mapping[str, ParameterSharding], options: Optional[ProactiveOptions] = None) -> int:
        """Says which tables of a plan are proactive, each with the rows its cache holds of
        its rows (one WARNING log line, so that it shows without any logging set up) and,
        when none is, why and what to change (a ``UserWarning``: the pipeline would
        otherwise run stock with nothing to prefetch, silently). Returns the number of
        proactive tables."""
        kernels = Counter(ps.compute_kernel for ps in params.values())
        proactive = kernels.get(_CACHED, 0)
        if proactive:
            sizes = _cache_rows(params, options or ProactiveOptions())
            shown = ", ".join(f"{name} {slots}/{rows}" for name, (slots, rows) in sizes.items())
            rest = len(params) - proactive
            disk = sorted((options.disk if options else {}) or {})
            where = options.disk[disk[0]].directory if disk and options else ""
            if "@local_rank" in where:  # (TorchRec's placeholder: each rank's local rank)
                where += f" (@local_rank: each rank's local rank, e.g. {resolve_directory(where, 0)})"
            on_disk = (f"; on disk ({KEY_VALUE}: a file under {where} behind a DRAM host "
                       f"cache): {', '.join(disk)}" if disk and options else "")
            planned = f"{_CACHED} or {KEY_VALUE}" if disk else _CACHED
            _LOG.warning("torchrec-proactive: %d of %d table(s) are proactive (planned %s: a host tier, and a device "
                         "cache its rows are fetched into ahead of their lookup); cache rows / table rows: %s%s%s",
                         proactive, len(params), planned, shown, on_disk,
                         f"; the other {rest} stay stock TorchRec" if rest else "")
            return proactive
        if params:
            shown = ", ".join(f"{n} {k}" for k, n in sorted(kernels.items()))
            warnings.warn(
                f"torchrec-proactive: none of the {len(params)} table(s) is proactive: the plan put them in "
                f"device memory ({shown}), and only {_CACHED} tables get a host tier and prefetching; plan the "
                f"tables to tier with ParameterConstraints(compute_kernels=[\"{_CACHED}\"], "
                f"cache_params=CacheParams(load_factor=...))",
                UserWarning, stacklevel=2)
        return 0

    def _mark_cached_tables(
        self, module: Any, params: Dict[str, ParameterSharding], disk: Optional[Dict[str, DiskTierSpec]] = None,
    ) -> Dict[str, ParameterSharding]:
        """Copies the plan, turning on ``CacheParams.prefetch_pipeline`` for cached tables.

        That flag is TorchRec's own marker for "this cache is filled ahead of the lookup"; it
        also keeps these tables in their own lookup groups. A ``key_value`` table becomes a
        cached table whose host tier is on disk: its spec goes to ``disk``. The user's plan
        is not mutated.
        """
        collection = type(module).__name__
        known = set(self._table_names(module))
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(
                f"sharding plan names tables {unknown} that the {collection} does not have "
                f"(it has {sorted(known)})"
            )
        out: Dict[str, ParameterSharding] = {}
        for name, ps in params.items():
            if (ps.compute_kernel == _CACHED or (ps.compute_kernel == KEY_VALUE and disk is not None)) \
                    and ps.sharding_type not in self._supported_sharding:
                raise ValueError(
                    f"table '{name}': sharding type {ps.sharding_type!r} is not supported for proactive "
                    f"({ps.compute_kernel}) tables of an {collection}; supported: {sorted(self._supported_sharding)}"
                )
            if ps.compute_kernel == KEY_VALUE and disk is not None:
                disk[name] = spec_from_plan(name, ps.key_value_params, self.host_cache_bytes.get(name))
                ps = dataclasses.replace(ps, compute_kernel=_CACHED)
            if ps.compute_kernel == _CACHED:
                cache = ps.cache_params or CacheParams()
                cache = dataclasses.replace(
                    cache,
                    prefetch_pipeline=True,
                    load_factor=cache.load_factor if cache.load_factor is not None else self.options.cache_load_factor,
                )
                ps = dataclasses.replace(ps, cache_params=cache)
            elif ps.compute_kernel not in {k.value for k in EmbeddingComputeKernel}:
                raise ValueError(f"table '{name}': unknown compute kernel {ps.compute_kernel!r}")
            out[name] = ps
        self._check_host_cache_bytes(module, disk)
        return out

    def _check_host_cache_bytes(self, module: Any, disk: Optional[Dict[str, DiskTierSpec]]) -> None:
        """Warns (once per collection) when ``host_cache_bytes`` is given but names none of a
        disk table's entries - a typo, or a table left out, would otherwise size its group's
        host cache from ``l2_cache_size`` (1 GiB unset), silently."""
        if not self.host_cache_bytes or not disk:
            return
        without = sorted(t for t in disk if t not in self.host_cache_bytes)
        if without:
            unused = sorted(set(self.host_cache_bytes) - set(self._table_names(module)))
            warnings.warn(
                f"host_cache_bytes has no entry for the key_value table(s) {without}"
                + (f" (it names {unused}, which this {type(module).__name__} does not have)" if unused else "")
                + ": their groups' host caches come from l2_cache_size (1 GiB unset) instead", stacklevel=3)


class ProactiveEmbeddingBagCollectionSharder(_ProactiveSharding, EmbeddingBagCollectionSharder):
    """Shards ``EmbeddingBagCollection`` so that UVM-cached tables are fetched proactively.

    Drop-in for ``EmbeddingBagCollectionSharder``: it takes the same ``fused_params``
    (``optimizer``, ``learning_rate``, ``eps``, ...) and the same plans. Tables whose plan
    says ``fused_uvm_caching`` are served from a host tier + device cache whose size comes
    from the plan's ``CacheParams(load_factor=...)`` (or ``cache_load_factor`` here), tables
    planned ``key_value`` from the same store over a file (below); every other table stays
    stock TorchRec. On CPU, where TorchRec itself has no UVM, the planner
    is offered ``fused_uvm_caching`` by this sharder so cached tables can be planned too.

    Tables larger than host memory are planned as TorchRec offloads them to SSD: compute
    kernel ``key_value`` with ``ParameterConstraints(key_value_params=KeyValueParams(
    ssd_storage_directory=DIR, l2_cache_size=GB))`` (and a ``Topology(ssd_cap=...)``, which
    TorchRec's planner needs to place them). They get a third tier: the device cache (the
    plan's ``CacheParams(load_factor=...)``) over a DRAM host cache of ``l2_cache_size`` GB
    per group (or ``host_cache_bytes`` per table) over a file of the shard's rows under DIR,
    removed when the model is closed or collected. On CPU and CUDA ranks (on CUDA, where
    stock would use FBGEMM's SSD TBE, not in its published wheels): a group on disk is
    planned on the host, its rows moved by the copy stream's worker through pinned staging,
    and TorchRec is handed its shards placed on the CPU, as stock hands ``key_value`` shards.

    Args:
        fused_params: as for ``EmbeddingBagCollectionSharder``.
        cache_load_factor: default cache size as a fraction of each local shard's rows.
        eviction_policy: ``"lru"`` or ``"lfu"`` when the plan's ``CacheParams`` leaves it unset
            (sampled, like FBGEMM's set-associative cache: victims come from a window of twice
            the batch's misses; see ``torchrec_proactive.store.eviction``).
        num_slots: per-table cache sizes in rows (override any load factor).
        hot_rows: per-table global row ids kept permanently cached.
        link: on CPU, an emulated host-to-device link (bandwidth, latency) so the cost of
            cold fetches is visible; ``None`` copies in-process. Ignored on CUDA.
        debug_checks: verify store invariants after each lookup (tests, debugging).
        planner: ``"auto"`` (on the device on CUDA, with no host synchronisation; on the host
            on CPU), ``"device"`` or ``"host"``; see ``ProactiveOptions``.
        table_budgets: ``"auto"`` (a group's tables with different load factors each keep
            their own share of its store's cache), ``"per_table"`` or ``"shared"``; see
            ``ProactiveOptions``.
        host_cache_bytes: per ``key_value`` table, its host cache in bytes (finer than the
            plan's ``l2_cache_size``, which is whole GB per group), e.g. the
            ``host_cache_bytes`` of ``cacheplan.plan_host_caches``. The tables of one
            TorchRec group share one host cache of their sum; to hold a planned split per
            table, give each table a group of its own (TorchRec's ``use_one_tbe_per_table``
            fused param), as the app does with ``tier.host_budget_mb``.
    """

    def shard(
        self,
        module: EmbeddingBagCollection,
        params: Dict[str, ParameterSharding],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        module_fqn: Optional[str] = None,
    ) -> ProactiveShardedEmbeddingBagCollection:
        marked, options = self._prepare_plan(module, params, env, device)
        return ProactiveShardedEmbeddingBagCollection(
            module=module,
            table_name_to_parameter_sharding=marked,
            env=env,
            fused_params=self.fused_params,
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
            sharded_module_order_overwrite=self._sharded_module_order_overwrite,
            proactive_options=options,
        )

    @property
    def sharded_module_type(self) -> type:  # type: ignore[override]
        return ProactiveShardedEmbeddingBagCollection

    @staticmethod
    def _table_names(module: Any) -> List[str]:
        return [c.name for c in module.embedding_bag_configs()]

class ProactiveEmbeddingCollectionSharder(_ProactiveSharding, EmbeddingCollectionSharder):
    """Shards ``EmbeddingCollection`` (sequence tables: one embedding per id, returned as a
    ``JaggedTensor`` per feature) so that UVM-cached tables are fetched proactively.

    Drop-in for ``EmbeddingCollectionSharder``, as :class:`ProactiveEmbeddingBagCollectionSharder`
    is for bags, with the same options (see there) and ``use_index_dedup`` passed to stock.
    Tables whose plan says ``fused_uvm_caching`` (table-, row- or column-wise, the sharding
    types stock supports for sequence tables) are served from a host tier + device cache,
    with the same lookahead, pins, write-backs and fused optimizers as bags; every other
    table stays stock TorchRec. ``ProactiveTrainPipeline`` drives models with either
    collection, or both. ``key_value`` tables stay stock's here (the disk tier serves bags
    for now).
    """

    _supported_sharding = _SUPPORTED_SEQUENCE_SHARDING
    _disk_tier = False

    def shard(
        self,
        module: EmbeddingCollection,
        params: Dict[str, ParameterSharding],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        module_fqn: Optional[str] = None,
    ) -> ProactiveShardedEmbeddingCollection:
        marked, options = self._prepare_plan(module, params, env, device)
        return ProactiveShardedEmbeddingCollection(
            module,
            marked,
            env,
            self.fused_params,
            device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            use_index_dedup=self._use_index_dedup,
            module_fqn=module_fqn,
            proactive_options=options,
        )

    @property
    def sharded_module_type(self) -> type:  # type: ignore[override]
        return ProactiveShardedEmbeddingCollection

    @staticmethod
    def _table_names(module: Any) -> List[str]:
        return [c.name for c in module.embedding_configs()]


class _OwnPlannerNotes(logging.Filter):
    """Drops the planner's "No available compute kernels" warning for ``table_column_wise``
    when the user's constraints ask only for ``fused_uvm_caching``: this sharder withholds
    that kernel from TCW (proactive tables do not support it), so the planner notes the gap
    for every such table - notes stock TorchRec, which offers the kernel there, never gives,
    and that need no action (the planner picks another sharding type)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not (text.startswith("No available compute kernels")
                    and f"Constrained compute kernels: ['{_CACHED}']" in text
                    and f"sharding type: {ShardingType.TABLE_COLUMN_WISE.value}." in text)


def _cache_rows(params: Mapping[str, ParameterSharding], options: ProactiveOptions) -> Dict[str, "tuple[int, int]"]:
    """Per proactive table of a plan, ``(rows its caches hold, its rows)``, as the kernels
    size each shard (``ProactiveOptions.slots_for``): row-wise shards summed, column shards
    of the same rows counted once."""
    out: Dict[str, "tuple[int, int]"] = {}
    for name, ps in params.items():
        if ps.compute_kernel != _CACHED or ps.sharding_spec is None:
            continue
        lf = ps.cache_params.load_factor if ps.cache_params is not None else None
        lf = options.cache_load_factor if lf is None else lf
        shards = {int(m.shard_offsets[0]): int(m.shard_sizes[0]) for m in ps.sharding_spec.shards}  # type: ignore[attr-defined]
        out[name] = (sum(options.slots_for(name, rows, lf) for rows in shards.values()), sum(shards.values()))
    return out


def hide_own_planner_notes() -> None:
    """Installs :class:`_OwnPlannerNotes` on TorchRec's enumerator logger (idempotent)."""
    logger = logging.getLogger("torchrec.distributed.planner.enumerators")
    if not any(isinstance(f, _OwnPlannerNotes) for f in logger.filters):
        logger.addFilter(_OwnPlannerNotes())
