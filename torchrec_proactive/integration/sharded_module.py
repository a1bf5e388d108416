"""The proactive half of a sharded embedding module, shared by bags and sequences.

:class:`ProactiveShardedModule` is mixed into TorchRec's ``ShardedEmbeddingBagCollection``
(``sharded_ebc.py``) and ``ShardedEmbeddingCollection`` (``sharded_ec.py``). Only TorchRec's
documented hooks are overridden:

* ``prefetch(dist_input, forward_stream, ctx)`` - called by the pipeline as soon as a batch's
  ids are local (after its input all-to-all): plans every proactive table and issues one
  fetch ticket for the batch. Returns at once; the copy runs behind the caller.
* ``compute_and_output_dist(ctx, dist_input)`` - waits for that batch's ticket (the stall),
  binds the planned batch to the kernels, then runs TorchRec's lookup + output all-to-all.
* ``create_context`` - a context that carries the batch's fetch from one hook to the other.

and one construction step, ``_create_lookups``, to put :class:`ProactiveEmbeddingBag` where
TorchRec put its fused kernel for the cached tables (see the comment there). The two
collections differ only in how TorchRec names their shardings, lookups and stock kernels
(the class attributes and small methods each subclass sets).

Tables planned with other kernels stay stock; so do data-parallel tables.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, KJTList
from torchrec.distributed.types import LazyAwaitable, ShardingEnv
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ..fetch import FetchEngine, FetchFailedError, Ticket, make_transport
from ..store import CacheCapacityError, NotPrefetchedError, StoreStateError
from ..store.disk_host_tier import HostCacheCapacityError
from .disk_tier import GROUP_KEY, host_cache_advice
from .embedding_kernel import PlannedGroup, PreparedBatch, ProactiveEmbeddingBag
from .validation import InputValidator
from .options import ProactiveOptions


def is_proactive_group(config: Any) -> bool:
    """A group is ours when every table in it is a UVM-cached table marked for prefetch.

    TorchRec already groups such tables apart from others (``prefetch_pipeline`` is part of
    its grouping key), so a mixed group cannot occur.
    """
    tables = config.embedding_tables
    return bool(tables) and all(
        t.compute_kernel == EmbeddingComputeKernel.FUSED_UVM_CACHING
        and bool((t.fused_params or {}).get("prefetch_pipeline", False))
        for t in tables
    )


def _owner(ctx: Any) -> Any:
    return getattr(ctx, "owner", None)


def _local_grouped_configs(sharding: Any) -> List[Any]:
    """This rank's lookup groups of a TorchRec embedding sharding, before its lookup exists.

    TorchRec keeps them in ``_grouped_embedding_configs`` (TW/RW/CW/DP) or per rank in
    ``_grouped_embedding_configs_per_rank`` (TWRW, grid); there is no public accessor.
    """
    configs: List[Any] = []
    per_rank = getattr(sharding, "_grouped_embedding_configs_per_rank", None)
    rank = getattr(sharding, "_rank", None)
    if per_rank is not None and rank is not None and rank < len(per_rank):
        configs.extend(per_rank[rank])
    configs.extend(getattr(sharding, "_grouped_embedding_configs", None) or [])
    unique: Dict[int, Any] = {id(c): c for c in configs}
    return list(unique.values())


@dataclass
class BatchFetch:
    """One batch's fetch: the ticket and the planned groups it makes resident."""

    ticket: Ticket
    groups: List[PlannedGroup]
    index: Optional[int] = None
    # Issued by the batch's own lookup (reactive, a plain forward, or a prefetch that
    # waited until its lookup): its rows were copied on the critical path.
    at_lookup: bool = False
    owner: Any = None  # the prefetching pipeline (see ProactiveContextFields.owner)
    # The module's lookups done when the fetch was issued; at the batch's lookup, its lead
    # (how many lookups ahead it was issued: k at depth k, 0 at lookup) follows from it.
    issued_after_lookups: int = 0
    lead: int = 0

    @property
    def released(self) -> bool:
        return all(tb.plan.released for g in self.groups for tb in g.table_batches)


@dataclass
class ProactiveContextFields:
    """What a proactive module's batch context carries (mixed into TorchRec's context of
    each collection): the batch's fetch, from ``prefetch`` to ``compute_and_output_dist``;
    ``prefetch_expected`` is set by a pipeline that promised to prefetch this batch.

    ``plan_in_output_dist`` is set by a pipeline that runs an earlier batch's forward
    between this batch's ``prefetch`` and its lookup: the plan is then made right after that
    forward's output all-to-all is launched, while it is in flight (the paper's idea, applied
    to planning), and at the latest at this batch's lookup.
    """

    fetch: Optional[BatchFetch] = None
    prefetch_expected: bool = False
    plan_in_output_dist: bool = False
    # Who prefetched this batch: a weak reference to the pipeline, set by it. Several
    # pipelines may take turns on one model (training, and validation mid-epoch); each owns
    # its in-flight batches, and none plans, waits for or frees another's.
    owner: Any = None


@dataclass
class BatchRecord:
    """Per-batch instrumentation (kept only while ``ProactiveStats.keep_records``)."""

    index: Optional[int]
    stall_s: float
    rows_requested: int
    hits: int
    rows_fetched: int
    rows_written_back: int
    bytes_moved: int
    fetch_issued_at: float
    fetch_started_at: Optional[float]
    fetch_completed_at: Optional[float]
    lookup_started_at: float


@dataclass
class ProactiveStats:
    """Cumulative counters (always on: a few integer adds per batch) and optional records."""

    batches: int = 0
    stall_s: float = 0.0
    rows_requested: int = 0
    hits: int = 0
    rows_fetched: int = 0
    # Of those, rows copied by fetches issued at the lookup that needs them (on the critical
    # path): every miss at depth 0, none at depth >= 1 while the cache has room. A count,
    # not a time, so it says whether prefetching worked on any machine, however loaded.
    rows_fetched_at_lookup: int = 0
    rows_written_back: int = 0
    bytes_moved: int = 0
    plan_s: float = 0.0  # wall time spent mapping ids and planning (all batches)
    # CPU time of the planning thread over the same spans. Planning runs while batch N's
    # output all-to-all is in flight, so its wall time also counts the CPU it shares with
    # the collective's threads; the CPU time is what planning itself costs.
    plan_cpu_s: float = 0.0
    deferred_batches: int = 0  # prefetches that waited for pins (effective depth dropped)
    host_deferred_batches: int = 0  # of those, tables on disk: waited for room in the host cache
    # Tables on disk: batches whose rows alone outgrew a host cache (moved through it a chunk
    # at a time at their lookup: no depth helps them, only a larger host cache).
    host_overflow_batches: int = 0
    overflow_rows: int = 0  # rows served from the host tier because one batch outgrew the cache
    # Sum over looked-up batches of their leads: how many lookups ahead of its own the fetch
    # was issued (0 at lookup, k at depth k; less for a batch that waited for pins). Divided
    # by ``batches``: the effective depth, counted rather than inferred from waits.
    prefetch_lead_lookups: int = 0
    # Tables on disk: batches whose rows were staged (disk reads queued ``disk_depth``
    # batches ahead, before their plan), and stagings skipped because the host cache was
    # full of pinned rows (the batch's reads then start at its plan: exact, later).
    staged_batches: int = 0
    stages_skipped: int = 0
    stages_yielded: int = 0  # stages dropped so that an earlier batch's plan fit the host cache
    keep_records: bool = False
    records: Deque[BatchRecord] = field(default_factory=lambda: deque(maxlen=100_000))

    def hit_rate(self) -> float:
        return self.hits / self.rows_requested if self.rows_requested else 1.0

    def snapshot(self) -> Dict[str, float]:
        return {
            "batches": self.batches, "stall_s": self.stall_s, "rows_requested": self.rows_requested,
            "hits": self.hits, "hit_rate": self.hit_rate(), "rows_fetched": self.rows_fetched,
            "rows_fetched_at_lookup": self.rows_fetched_at_lookup,
            "rows_written_back": self.rows_written_back, "bytes_moved": self.bytes_moved,
            "deferred_batches": self.deferred_batches, "host_deferred_batches": self.host_deferred_batches,
            "host_overflow_batches": self.host_overflow_batches,
            "overflow_rows": self.overflow_rows,
            "prefetch_lead_lookups": self.prefetch_lead_lookups,
            "plan_s": self.plan_s, "plan_cpu_s": self.plan_cpu_s,
            "staged_batches": self.staged_batches, "stages_skipped": self.stages_skipped,
            "stages_yielded": self.stages_yielded,
        }


class ProactiveShardedModule:
    """Proactive cold-row fetching for a TorchRec sharded embedding module (a mixin, first
    among the bases: see ``ProactiveShardedEmbeddingBagCollection`` and
    ``ProactiveShardedEmbeddingCollection``).

    Made by the proactive sharders; users do not build it directly. ``prefetch_depth`` is
    set by :class:`ProactiveTrainPipeline`; at depth 0 (the default, and what a plain
    ``model(batch)`` call uses) rows are fetched at lookup time.

    A subclass names what differs between TorchRec's collections: ``_stock_kernel_type``
    (the fused kernel TorchRec builds for a group), ``_lookup_type`` (the grouped lookup
    that builds it), ``_data_parallel_type`` (the sharding without one), and
    :meth:`_shardings` and :meth:`_table_configs`.
    """

    _stock_kernel_type: type
    _lookup_type: type
    _data_parallel_type: type

    def _shardings(self) -> List[Any]:
        """The module's embedding shardings, in the order of its lookups."""
        raise NotImplementedError

    def _table_configs(self) -> List[Any]:
        """The module's table configs (``EmbeddingBagConfig`` or ``EmbeddingConfig``)."""
        raise NotImplementedError

    def __init__(self, *args: Any, proactive_options: Optional[ProactiveOptions] = None, **kwargs: Any) -> None:
        # Needed by _create_lookups, which the parent constructor calls. The module's one
        # fetch engine owns the order of every data move of every proactive kernel.
        self._proactive_options = proactive_options or ProactiveOptions()
        self._proactive_kernels: List[ProactiveEmbeddingBag] = []
        self._user_fused_params: Dict[int, Dict[str, Any]] = {}  # id(group config) -> user's params
        self._disk_groups: Dict[int, Any] = {}  # id(group config) -> config, for groups on disk
        device = kwargs.get("device") or torch.device("cpu")
        self._fetch_engine = FetchEngine(make_transport(device, self._proactive_options.link))
        super().__init__(*args, **kwargs)
        self.prefetch_depth = 0
        self._stats = ProactiveStats()
        # Looked-up batches whose plans' sizes are still on the device (device planner on
        # CUDA: they reach the host without a wait, a step or so later), in lookup order.
        self._unaccounted: Deque[Tuple[BatchFetch, float, float]] = deque()
        self._consumed: List[BatchFetch] = []
        # Batches prefetched but not planned yet (their rows did not fit), in arrival order,
        # and batches planned by a prefetch whose lookup has not come yet.
        self._waiting: Deque[Tuple[Any, KJTList]] = deque()
        self._prefetched: List[BatchFetch] = []
        self._staged: List[Any] = []  # contexts of batches staged on disk and not yet planned
        self._lookups_consumed = 0  # lookups that consumed a fetch (for ProactiveStats.prefetch_lead_lookups)
        self._validator = InputValidator(self._table_configs())
        self._warned_deferral = False
        # Set by the pipeline for the batch it is running; a forward of such a batch whose
        # fetch is missing is a pipeline bug, not a plain forward.
        # TorchRec's own pre-load hook purges the kernels (flush, then drop: see the kernel);
        # a load of only some keys (strict=False) therefore keeps every trained row.
        self.register_load_state_dict_pre_hook(lambda *a, **k: self.flush_cache())
        self.register_load_state_dict_post_hook(lambda *a, **k: self.invalidate_cache())

    # ------------------------------------------------------------------ construction
    def _create_lookups(self) -> None:
        # A group on disk may be larger than host memory, so TorchRec must not build a stock
        # kernel for it (that allocates every row): while the lookups are built, the one
        # method that builds a group's kernel builds ours for those groups (see
        # ``_disk_kernels_built_here``).
        with _disk_kernels_built_here(self._lookup_type, self._disk_groups, self._build_disk_kernel):
            super()._create_lookups()  # type: ignore[misc]
        # TorchRec has no public hook to choose the kernel class of a lookup group, so the
        # stock fused kernel of each proactive group is replaced here, right after the
        # lookups are built and before the fused optimizers and state-dict views are
        # collected from them. The replacement takes over the stock kernel's host weight
        # storage (same initialisation, no second copy) and the stock kernel is dropped.
        # Per lookup, also record how its KJT splits into groups and which groups are ours:
        # the hot path reads this instead of walking the lookups.
        self._group_layout: List[Tuple[List[int], List[Optional[ProactiveEmbeddingBag]]]] = []
        for lookup, sharding in zip(self._lookups, self._shardings()):
            if isinstance(sharding, self._data_parallel_type):
                self._group_layout.append(([], []))
                continue
            modules = lookup._emb_modules  # noqa: SLF001 - see comment above
            for g, config in enumerate(lookup.grouped_configs):
                if id(config) not in self._user_fused_params:  # marked in create_embedding_bag_sharding
                    continue
                stock = modules[g]
                if isinstance(stock, ProactiveEmbeddingBag):  # (a group on disk: built as ours)
                    self._proactive_kernels.append(stock)
                    continue
                if not isinstance(stock, self._stock_kernel_type):
                    raise NotImplementedError(
                        f"tables {config.table_names()}: proactive caching needs the fused kernel, "
                        f"TorchRec built {type(stock).__name__}"
                    )
                user_fused = self._user_fused_params[id(config)]
                kernel = ProactiveEmbeddingBag.from_stock(
                    stock, self._proactive_options, user_fused, self._fetch_engine,
                    pg=stock._pg, device=self._device,
                )
                modules[g] = kernel
                self._proactive_kernels.append(kernel)
            splits = [c.num_features() for c in lookup.grouped_configs]
            kernels = [m if isinstance(m, ProactiveEmbeddingBag) else None for m in modules]
            self._group_layout.append((splits, kernels))

    def _build_disk_kernel(self, config: Any, device: Optional[torch.device], pg: Any,
                           sharding_type: Any) -> ProactiveEmbeddingBag:
        return ProactiveEmbeddingBag.on_disk(
            config, self._proactive_options, self._user_fused_params[id(config)], self._fetch_engine,
            pg=pg, device=device, sharding_type=sharding_type, rank=self._env.rank,
            local_rank=int(os.environ.get("LOCAL_RANK", self._env.rank)),
        )

    def _mark_disk_tables(self, sharding_infos: List[EmbeddingShardingInfo]) -> None:
        """Before TorchRec groups the tables of a sharding: a table on disk carries its
        directory into TorchRec's grouping key, so that a group never mixes tables on disk
        with tables in DRAM (one store per group, one host tier)."""
        disk = self._proactive_options.disk
        for info in sharding_infos:
            spec = disk.get(info.embedding_config.name)
            if spec is not None:
                info.fused_params = {**(info.fused_params or {}), GROUP_KEY: spec.directory}

    def _claim_proactive_groups(self, sharding: Any, device: Optional[torch.device]) -> Any:
        """After TorchRec grouped the tables of a sharding (by their fused params: per-table
        optimizers stay in separate groups, exactly as stock), each proactive group's copy
        of its params is changed: the stock fused kernel TorchRec builds for it only lends
        us its host weight storage, so it is built with plain SGD (no optimizer state to
        allocate, and supported on every FBGEMM backend, unlike e.g. Adam on CPU); the
        user's params go to ProactiveEmbeddingBag. (TorchRec calls its sharding factory
        through the instance, which is what lets us keep per-module state.)"""
        on_cuda = device is not None and torch.device(device).type == "cuda"
        for config in _local_grouped_configs(sharding):
            if is_proactive_group(config) and id(config) not in self._user_fused_params:
                fused = dict(config.fused_params or {})
                if fused.pop(GROUP_KEY, None) is not None:
                    self._disk_groups[id(config)] = config
                self._user_fused_params[id(config)] = dict(fused)
                fused["optimizer"] = EmbOptimType.EXACT_SGD
                # The stock kernel caches nothing for us: FBGEMM's default policy, since its
                # TBE refuses LFU with the prefetch_pipeline flag that marks our groups
                # (the user's policy stays in the tables' params, where our store reads it).
                fused.pop("cache_algorithm", None)
                config.fused_params = fused
                if on_cuda:
                    # Not FBGEMM's UVM cache: it would allocate an HBM cache nobody reads.
                    # Plain UVM rows, host-mapped (malloc + cudaHostRegister: pinned, with no
                    # power-of-two rounding), become the store's host tier in place
                    # (ProactiveEmbeddingBag.from_stock): the rows are held once.
                    fused["uvm_host_mapped"] = True
                    for table in config.embedding_tables:
                        table.compute_kernel = EmbeddingComputeKernel.FUSED_UVM
        return sharding

    def reset_parameters(self) -> None:
        """TorchRec re-initialises the weights (the host tier) in place, e.g. for meta-built
        models: the cached rows take the new weights and keep their optimizer state, as
        stock's tables do (the reset writes weights only). Tables on disk are initialised
        by their kernels, a chunk at a time (``initialize_disk_rows``); TorchRec skips them
        as it skips its own ``key_value`` tables."""
        kernels = getattr(self, "_proactive_kernels", [])
        on_disk = [k for k in kernels if k.on_disk_tier]
        with _planned_key_value(self.module_sharding_plan, {t for k in on_disk for t in k.table_names()}):
            super().reset_parameters()  # type: ignore[misc]
        if self._device is not None and self._device.type == "meta":
            return
        for kernel in kernels:
            if kernel.on_disk_tier:
                kernel.initialize_disk_rows()
            else:
                kernel.adopt_host_writes()

    def close(self) -> None:
        """Removes the files of this module's tables on disk (also done when it is collected
        or the process exits); the module is unusable for them afterwards."""
        for kernel in getattr(self, "_proactive_kernels", []):
            kernel.close()

    # ------------------------------------------------------------------ hooks
    def input_dist(self, ctx: Any, features: KeyedJaggedTensor) -> Any:
        """Validates the batch on the rank that owns it, then TorchRec's input all-to-all.

        Bad ids must be caught before they are bucketised and sent: after the all-to-all
        the receiving rank no longer knows which feature or sample they came from.
        """
        if isinstance(features, KeyedJaggedTensor) and features.values().device.type == "cpu":
            # (Ids on a GPU are checked by the device planner instead, without a host read,
            # and reported a batch later: see ProactiveEmbeddingBag._report_device_checks.)
            self._validator.check(features)
        return super().input_dist(ctx, features)  # type: ignore[misc]

    def prefetch(
        self,
        dist_input: KJTList,
        forward_stream: Optional[torch.Stream] = None,
        ctx: Optional[Any] = None,
    ) -> None:
        """Plans the batch on every proactive kernel and issues its fetch (non-blocking).

        Batches are planned strictly in arrival order. One whose rows do not fit beside the
        pins of the batches in flight waits, and the batches behind it with it (their
        effective depth drops; counted in ``deferred_batches``); they are planned as soon as
        backward passes release enough pins, at the latest at their own forward.
        """
        if ctx is None:
            raise ValueError(f"{type(self).__name__}.prefetch needs the batch context")
        if forward_stream is not None:
            # TorchRec's PrefetchTrainPipelineSparseDist prefetches on a side stream that never
            # waits for the fused updates on the compute stream; our cache has one owner, the
            # stream that plans, looks up and updates it (see DevicePlanner).
            raise NotImplementedError(
                "proactive tables are prefetched by ProactiveTrainPipeline (it plans batch N+k while batch N "
                "communicates); TorchRec's PrefetchTrainPipelineSparseDist prefetches on another stream than "
                "the one that updates the cache, which would race with the fused updates. Use "
                "ProactiveTrainPipeline (or TrainPipelineSparseDist / EvalPipelineSparseDist, which fetch at lookup)"
            )
        ctx.fetch = None  # type: ignore[attr-defined]
        if not self._proactive_kernels:
            return
        self._waiting.append((ctx, dist_input))
        if not getattr(ctx, "plan_in_output_dist", False):
            self._plan_waiting(owner=getattr(ctx, "owner", None))

    def stage(self, dist_input: KJTList, ctx: Any) -> None:
        """Tables on disk: queues the disk reads of a batch that will be planned later (the
        pipeline's ``disk_depth`` batches ahead, while its plan is ``prefetch_depth``
        ahead), pinning its rows in the host caches until it is planned. Only where rows
        are changes: the batch trains the same whether staged or not. A host cache without
        room skips the staging (counted in ``stages_skipped``): its reads then start at
        its plan. The prepared rows are kept for the plan (computed once)."""
        if not any(k.on_disk_tier for k in self._proactive_kernels):
            return
        prepared = self._prepare(dist_input)
        ctx.prepared = prepared  # type: ignore[attr-defined]
        stages = []
        for kernel, batch in prepared:
            if not kernel.on_disk_tier:
                continue
            try:
                stages.append((kernel.store, kernel.store.stage_rows(batch.rows)))
            except CacheCapacityError:
                self._stats.stages_skipped += 1
        ctx.stages = stages  # type: ignore[attr-defined]
        self._staged.append(ctx)
        self._stats.staged_batches += 1

    def _unstage(self, ctx: Any) -> None:
        """Drops a batch's stages (once it is planned, or abandoned)."""
        for store, stage in getattr(ctx, "stages", None) or []:
            store.unstage(stage)
        if getattr(ctx, "stages", None) is not None:
            ctx.stages = None
            self._staged = [c for c in self._staged if c is not ctx]

    def compute_and_output_dist(self, ctx: Any, input: KJTList) -> LazyAwaitable:  # type: ignore[override]
        if torch.is_grad_enabled():
            # The pin rule (see ProactiveEmbeddingBag.forward): the previous training
            # lookup's backward had its chance; its pins end before this batch plans.
            for kernel in self._proactive_kernels:
                kernel.end_pins_awaiting_backward()
        if self._proactive_kernels and getattr(ctx, "fetch", None) is None:
            ctx.fetch = self._fetch_at_lookup(ctx, input)  # type: ignore[attr-defined]
            ctx.fetch.at_lookup = True  # type: ignore[attr-defined]
        fetch: Optional[BatchFetch] = getattr(ctx, "fetch", None)
        if fetch is not None:
            ctx.fetch = None  # type: ignore[attr-defined]
            self._prefetched = [f for f in self._prefetched if f is not fetch]
            self._consumed = [f for f in self._consumed if not f.released] + [fetch]
            fetch.lead = 0 if fetch.at_lookup else self._lookups_consumed - fetch.issued_after_lookups + 1
            self._lookups_consumed += 1
            lookup_started = time.perf_counter()
            try:
                stall = self._fetch_engine.wait(fetch.ticket)
            except BaseException:
                self._release_fetch(fetch)
                raise
            self._unaccounted.append((fetch, stall, lookup_started))
            self._account_known()
            for group in fetch.groups:
                group.kernel.bind(group)
        out = super().compute_and_output_dist(ctx, input)  # type: ignore[misc]
        if self._proactive_options.debug_checks:
            self.check_invariants()
        owner = getattr(ctx, "owner", None)
        if any(_owner(c) is owner for c, _ in self._waiting):
            # Later batches of this pipeline wait to be planned: plan them now, while this
            # output all-to-all (launched above) is in flight. Here, not in a wrapper of the
            # awaitable run at its wait: whether a rank has batches waiting differs between
            # ranks, and an awaitable wrapped on some ranks only put the ranks' backward
            # all-to-alls in different orders (gloo hung; tests/test_integration.py).
            self._plan_waiting(owner=owner)
        return out

    # ------------------------------------------------------------------ internals
    def _waiting_of(self, owner: Any) -> List[Tuple[Any, KJTList]]:
        return [(c, d) for c, d in self._waiting if _owner(c) is owner]

    def _plan_waiting(self, until: Optional[Any] = None, owner: Any = None) -> None:
        """Plans ``owner``'s waiting batches in arrival order, up to and including ``until``
        when it is one of them (the rest are planned in its output all-to-all)."""
        queue = self._waiting_of(owner)
        if until is not None and not any(c is until for c, _ in queue):
            until = None
        for ctx, dist_input in queue:
            try:
                fetch = self._issue(dist_input, getattr(ctx, "batch_index", None), overflow=False, ctx=ctx)
            except CacheCapacityError as e:  # does not fit yet: wait for pins to be released
                if not getattr(ctx, "deferred", False):
                    ctx.deferred = True  # type: ignore[attr-defined]
                    self._stats.deferred_batches += 1
                    self._stats.host_deferred_batches += isinstance(e, HostCacheCapacityError)
                    self._warn_deferral_once(getattr(ctx, "batch_index", None), e)
                return
            self._forget_waiting(ctx)
            fetch.owner = owner
            ctx.fetch = fetch  # type: ignore[attr-defined]
            self._prefetched.append(fetch)
            if ctx is until:
                return

    def _forget_waiting(self, ctx: Any) -> None:
        self._waiting = deque((c, d) for c, d in self._waiting if c is not ctx)

    def _fetch_at_lookup(self, ctx: Any, input: KJTList) -> Optional[BatchFetch]:
        """The fetch of a batch that reaches its lookup without one."""
        owner = getattr(ctx, "owner", None)
        self._plan_waiting(until=ctx, owner=owner)  # backward passes since the last try may have released pins
        if getattr(ctx, "fetch", None) is not None:
            return ctx.fetch  # type: ignore[attr-defined]
        index = getattr(ctx, "batch_index", None)
        queue = self._waiting_of(owner)
        if queue and queue[0][0] is ctx:
            # Still does not fit: every earlier batch of this pipeline is done and no later
            # one is planned (arrival order), so the rows that do not fit can be served from
            # the host tier (other pipelines plan nothing until this one's step is over).
            self._forget_waiting(ctx)
            return self._issue(input, index, overflow=True, ctx=ctx)
        if any(c is ctx for c, _ in queue):
            raise StoreStateError(
                f"{self._module_fqn or 'embedding module'}: batch {index} reached its lookup before "
                f"{len(queue)} earlier prefetched batch(es); batches must be looked up in prefetch order"
            )
        if getattr(ctx, "prefetch_expected", False):
            raise NotPrefetchedError(
                f"{self._module_fqn or 'embedding module'}: batch {index} was promised a prefetch by the "
                f"pipeline (prefetch_depth={self.prefetch_depth}) but none was issued"
            )
        # A plain forward (eval loop, after pipeline.detach(), no pipeline): fetch now.
        return self._issue(input, index, overflow=True, ctx=ctx)

    def _issue(self, dist_input: KJTList, index: Optional[int], overflow: bool,
               ctx: Optional[Any] = None) -> BatchFetch:
        """Plans the batch on every proactive kernel and issues one ticket for all of them.

        Without ``overflow``, raises ``CacheCapacityError`` (changing nothing) when some
        kernel's cache cannot hold the batch beside the pins in flight. The batch's prepared
        rows (ids -> unique store rows, no store state) are kept on ``ctx`` until it is
        issued, so a retry only redoes the store's part. Planning time counts every attempt."""
        groups: List[PlannedGroup] = []
        prepared: Optional[List[Tuple[ProactiveEmbeddingBag, PreparedBatch]]] = getattr(ctx, "prepared", None)
        t0, cpu0 = time.perf_counter(), time.thread_time()
        try:
            if prepared is None:
                prepared = self._prepare(dist_input)
                if ctx is not None:
                    ctx.prepared = prepared  # type: ignore[attr-defined]
            for attempt in range(2):
                try:
                    for kernel, batch in prepared:
                        groups.append(kernel.plan_prepared(batch, overflow=overflow))
                    break
                except HostCacheCapacityError:
                    # Stages yield to plans: later batches' staged rows fill the host cache,
                    # so they let go (their rows stay until evicted) and this batch plans again.
                    others = [c for c in self._staged if c is not ctx]
                    if attempt or not others:
                        raise
                    for group in reversed(groups):
                        group.kernel.unplan(group)
                    groups = []
                    for other in others:
                        self._unstage(other)
                    self._stats.stages_yielded += len(others)
        except BaseException:
            # Nothing was issued, so nothing moved: undo the plans made so far exactly.
            for group in reversed(groups):
                group.kernel.unplan(group)
            raise
        finally:
            self._stats.plan_s += time.perf_counter() - t0
            self._stats.plan_cpu_s += time.thread_time() - cpu0
        if ctx is not None:
            ctx.prepared = None  # type: ignore[attr-defined]
            self._unstage(ctx)  # (its plans pin its rows now)
        plans = [p for g in groups for p in g.plans]
        try:
            ticket = self._fetch_engine.issue(plans, tag=index)
        except BaseException:
            for group in groups:
                group.kernel._release(group)
            raise
        return BatchFetch(ticket, groups, index, owner=_owner(ctx), issued_after_lookups=self._lookups_consumed)

    def _prepare(self, dist_input: KJTList) -> List[Tuple[ProactiveEmbeddingBag, PreparedBatch]]:
        """Per proactive kernel, the batch's ids as its store's rows (no store state)."""
        prepared: List[Tuple[ProactiveEmbeddingBag, PreparedBatch]] = []
        for (splits, kernels), features in zip(self._group_layout, dist_input):
            if not any(k is not None for k in kernels):
                continue
            # (One kernel for all the features needs no split: it costs a KJT copy.)
            parts = [features] if len(splits) == 1 else features.split(splits)
            for kernel, group_features in zip(kernels, parts):
                if kernel is not None:
                    prepared.append((kernel, kernel.prepare_batch(group_features)))
        return prepared

    def _warn_deferral_once(self, index: Optional[int], why: CacheCapacityError) -> None:
        if self._warned_deferral:
            return
        self._warned_deferral = True
        text = str(why)
        if isinstance(why, HostCacheCapacityError):  # a group on disk: its host cache had no room
            text = text.removesuffix(". Nothing changed") + "; " + host_cache_advice(text)
            served = ("rows that still do not fit move through the host cache a chunk at a time; exact; counted in "
                      "deferred_batches and host_deferred_batches")
        else:
            served = "rows that still do not fit are served from the host tier; exact; counted in deferred_batches"
        warnings.warn(
            f"{self._module_fqn or 'embedding module'}: batch {index}'s fetch waits for cache room (earlier batches "
            f"release rows; at its lookup, {served}; said once). {text}",
            stacklevel=3,
        )

    @staticmethod
    def _release_fetch(fetch: BatchFetch) -> None:
        for group in fetch.groups:
            for tb in group.table_batches:
                tb.table.release(tb.plan)

    @property
    def proactive_stats(self) -> ProactiveStats:
        """Cumulative counters of this module's batches (every looked-up batch counted: on
        CUDA reading them waits for the sizes of the last batches' plans)."""
        self._account_known(block=True)
        return self._stats

    def table_stats(self) -> Dict[str, Dict[str, float]]:
        """Each of this rank's proactive stores' counters (the store's ``TableStats``), keyed
        by the tables it serves: ``"t2"``, or ``"t0+t1"`` for a TorchRec group of several
        tables, which one store serves and counts together (``use_one_tbe_per_table=True`` in
        the fused params makes one store per table). Keys as in :meth:`ProactiveStats.snapshot`
        where they mean the same: ``rows_requested``, ``hits``, ``hit_rate``, ``rows_fetched``,
        ``rows_written_back``, ``bytes_moved``, ``overflow_rows``; and ``updates`` (fused
        updates applied), ``late_updates``, ``external_writes``. Stores on disk (``key_value``)
        add their disk tier's: ``disk_rows_read`` / ``disk_rows_written`` (rows that came from
        or went to the file, since the store was made or :meth:`reset_proactive_stats`: the
        initial rows count once they reach the file - rows still dirty in the host cache
        count when they are evicted or flushed), ``disk_read_requests``, ``disk_pages_read``
        (read-modify-writes included), ``host_cache_rows`` (the host cache's size) and
        ``host_overflow_plans`` (batches whose rows outgrew the host cache: moved through it a
        chunk at a time)."""
        self._account_known(block=True)  # (on CUDA: the stores count a plan once its sizes are known)
        out: Dict[str, Dict[str, float]] = {}
        for kernel in self._proactive_kernels:
            counts = {("rows_requested" if k == "lookups_rows" else k): v
                      for k, v in kernel.store.stats.as_dict().items() if k != "hit_rate"}
            disk = kernel.store.disk
            if disk is None:
                counts.pop("host_overflow_plans")
            else:
                d = disk.stats()
                counts.update(disk_rows_read=d["rows_read"], disk_rows_written=d["rows_written"],
                              disk_read_requests=d["read_requests"], disk_pages_read=d["pages_read"],
                              host_cache_rows=disk.num_slots)
            mine = out.setdefault(kernel.store.name, dict.fromkeys(counts, 0))
            for key, value in counts.items():
                mine[key] = mine.get(key, 0) + value
        for mine in out.values():
            mine["hit_rate"] = mine["hits"] / mine["rows_requested"] if mine["rows_requested"] else 1.0
        return out

    def reset_proactive_stats(self) -> None:
        """Zeroes this module's counters (:attr:`proactive_stats`, its records) and its stores'
        (:meth:`table_stats`); batches looked up before are counted first, so none lands in
        the new count. The pins, the cache and the depth are untouched."""
        self._account_known(block=True)
        for f in dataclasses.fields(self._stats):
            if f.name == "keep_records":
                continue
            if f.name == "records":
                self._stats.records.clear()
            else:
                setattr(self._stats, f.name, f.default)
        for kernel in self._proactive_kernels:
            stats = kernel.store.stats
            for f in dataclasses.fields(stats):
                setattr(stats, f.name, f.default)
            if kernel.store.disk is not None:
                kernel.store.disk.reset_stats()

    def _account_known(self, block: bool = False) -> None:
        """Counts looked-up batches, in order, whose plans' sizes the host knows (``block``:
        all of them, waiting for their sizes)."""
        while self._unaccounted:
            fetch, stall, lookup_started = self._unaccounted[0]
            if block:
                self._fetch_engine.resolve(fetch.ticket)
            elif not fetch.ticket.sizes_known():
                return
            self._unaccounted.popleft()
            self._account(fetch, stall, lookup_started)

    def _account(self, fetch: BatchFetch, stall: float, lookup_started: float) -> None:
        st = self._stats
        requested = hits = written_back = 0
        through_host_cache = False
        for group in fetch.groups:
            for tb in group.table_batches:
                plan = tb.plan
                requested += plan.num_rows
                hits += plan.num_hits
                written_back += plan.num_writebacks
                st.overflow_rows += plan.num_overflow
                through_host_cache |= plan.through_host_cache
        st.host_overflow_batches += through_host_cache
        st.batches += 1
        st.prefetch_lead_lookups += fetch.lead
        st.stall_s += stall
        st.rows_requested += requested
        st.hits += hits
        st.rows_fetched += fetch.ticket.num_rows
        if fetch.at_lookup:
            st.rows_fetched_at_lookup += fetch.ticket.num_rows
        st.rows_written_back += written_back
        st.bytes_moved += fetch.ticket.num_bytes
        if st.keep_records:
            t = fetch.ticket
            st.records.append(
                BatchRecord(fetch.index, stall, requested, hits, t.num_rows, written_back, t.num_bytes,
                            t.issued_at, t.started_at, t.completed_at, lookup_started)
            )

    # ------------------------------------------------------------------ public helpers
    def release_unfinished(self, owner: Any = None) -> int:
        """Unpins the rows of ``owner``'s batches whose lookup ran but whose update never
        will (an exception between forward and the end of backward), and drops its batches
        still waiting to be planned. Returns the plans released."""
        released = 0
        mine = [f for f in self._consumed if f.owner is owner]
        for fetch in mine:
            for group in fetch.groups:
                for tb in group.table_batches:
                    if not tb.plan.released:
                        tb.table.release(tb.plan)
                        released += 1
        self._consumed = [f for f in self._consumed if f.owner is not owner and not f.released]
        self._waiting = deque((c, d) for c, d in self._waiting if _owner(c) is not owner)  # never planned
        for ctx in [c for c in self._staged if _owner(c) is owner]:
            self._unstage(ctx)
        for kernel in self._proactive_kernels:
            kernel.unbind()
        return released

    def abandon_prefetched(self, owner: Any = None) -> int:
        """Forgets ``owner``'s prefetched batches whose lookup has not come (a pipeline that
        was reset): their moves complete in order, their pins are released, and its batches
        still waiting are dropped. Other pipelines' batches are untouched. Returns the
        batches abandoned."""
        return self._abandon(lambda o: o is owner)

    def abandon_orphans(self) -> int:
        """Forgets the prefetched batches of pipelines that no longer exist (dropped without
        ``reset()``, e.g. one pipeline per epoch), as ``abandon_prefetched`` does."""
        return self._abandon(lambda o: o is not None and o() is None)

    def _abandon(self, matches: Any) -> int:
        fetches = [f for f in self._prefetched if matches(f.owner)]
        n = len(fetches) + sum(1 for c, _ in self._waiting if matches(_owner(c)))
        for fetch in fetches:
            try:
                self._fetch_engine.wait(fetch.ticket)
            except FetchFailedError:
                pass  # rolled back by the engine
            finally:
                self._release_fetch(fetch)
        self._prefetched = [f for f in self._prefetched if not matches(f.owner)]
        self._waiting = deque((c, d) for c, d in self._waiting if not matches(_owner(c)))
        self._consumed = [f for f in self._consumed if not (matches(f.owner) and f.released)]
        for ctx in [c for c in self._staged if matches(_owner(c))]:
            self._unstage(ctx)
        return n

    def holds_batches_of_others(self, owner: Any) -> bool:
        """Whether batches prefetched by pipelines other than ``owner`` are in flight here."""
        return any(f.owner is not owner for f in self._prefetched) or any(
            _owner(c) is not owner for c, _ in self._waiting)

    @property
    def fetch_engine(self) -> FetchEngine:
        return self._fetch_engine

    @property
    def proactive_kernels(self) -> List[ProactiveEmbeddingBag]:
        return list(self._proactive_kernels)

    def planners(self) -> Dict[str, str]:
        """Where each of this rank's proactive table groups plans its batches:
        ``{"t0+t1": "device" | "host"}`` (see the sharder's ``planner`` option)."""
        return {kernel.store.name: ("device" if kernel.store.plans_on_device else "host")
                for kernel in self._proactive_kernels}

    def cache_sizes(self) -> Dict[str, Dict[str, Any]]:
        """Each of this rank's proactive stores: ``{"num_slots", "num_rows", "load_factor"}``
        (the load factor the plan - e.g. the cache planner's - gave its tables, as slots/rows).
        A store whose tables have budgets of their own (planned with different load factors)
        also has ``"tables": {table: {"num_slots", "num_rows", "load_factor"}}``."""
        out: Dict[str, Dict[str, Any]] = {}
        for kernel in self._proactive_kernels:
            store = kernel.store
            entry: Dict[str, Any] = {"num_slots": store.num_slots, "num_rows": store.num_rows,
                                     "load_factor": store.num_slots / max(store.num_rows, 1)}
            ranges = store.segment_slot_ranges()
            if ranges is not None:
                tables: Dict[str, Dict[str, float]] = {}
                for seg, (lo, hi) in zip(store.segments, ranges):
                    t = tables.setdefault(seg.name, {"num_slots": 0, "num_rows": 0})  # (column shards: summed)
                    t["num_slots"] += hi - lo
                    t["num_rows"] += seg.num_rows
                for t in tables.values():
                    t["load_factor"] = t["num_slots"] / max(t["num_rows"], 1)
                entry["tables"] = tables
            out[store.name] = entry
        return out

    def set_prefetch_depth(self, depth: int) -> None:
        """Depth ``k`` of the pipeline driving this module (0 = reactive)."""
        if depth < 0:
            raise ValueError(f"prefetch_depth must be >= 0, got {depth}")
        self.prefetch_depth = depth
        for kernel in self._proactive_kernels:
            kernel.prefetch_depth = depth

    def flush_cache(self) -> None:
        """Writes dirty cached rows back to the host tier (the state-dict storage), behind
        every queued fetch."""
        for kernel in self._proactive_kernels:
            kernel.flush()

    def invalidate_cache(self) -> None:
        """Drops cached rows (after the host tier was loaded); needs no batch in flight."""
        for kernel in self._proactive_kernels:
            kernel.invalidate()

    def check_invariants(self, expect_drained: bool = False) -> None:
        for kernel in self._proactive_kernels:
            kernel.check_invariants(expect_drained)

    def state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:  # type: ignore[override]
        self.flush_cache()
        return super().state_dict(*args, **kwargs)  # type: ignore[misc]

    def named_tables(self) -> Dict[str, Any]:
        """``{table shard name: TieredTable}`` of this rank's proactive tables."""
        out: Dict[str, Any] = {}
        for kernel in self._proactive_kernels:
            for name, table in kernel.named_tables():
                key = name
                n = 1
                while key in out:
                    key = f"{name}#{n}"
                    n += 1
                out[key] = table
        return out


@contextlib.contextmanager
def _planned_key_value(plan: Dict[str, Any], tables: set) -> Iterator[None]:
    """While TorchRec's ``reset_parameters`` runs, the tables on disk read as planned
    ``key_value`` (as the user planned them), which it skips: their kernels initialise them
    a chunk at a time instead of one ``init_fn`` over the whole shard."""
    saved = {t: plan[t] for t in tables if t in plan}
    for t, ps in saved.items():
        plan[t] = dataclasses.replace(ps, compute_kernel=EmbeddingComputeKernel.KEY_VALUE.value)
    try:
        yield
    finally:
        plan.update(saved)


@contextlib.contextmanager
def _disk_kernels_built_here(lookup_type: type, groups: Dict[int, Any], build: Any) -> Iterator[None]:
    """While TorchRec builds the lookups of a module with groups on disk, its grouped lookup
    (``lookup_type``, the pooled one) builds :class:`ProactiveEmbeddingBag` for those groups
    (``build(config, device, pg, sharding_type)``) and its own kernel for every other group. TorchRec has no hook to
    choose a group's kernel class; this is the narrowest place: one method, one class, for
    the duration of one constructor call, restored whatever happens."""
    if not groups:
        yield
        return
    original = lookup_type._create_embedding_kernel

    def create(lookup: Any, config: Any, device: Any, pg: Any, sharding_type: Any, *args: Any, **kwargs: Any) -> Any:
        if id(config) in groups:
            return build(config, device, pg, sharding_type)
        return original(lookup, config, device, pg, sharding_type, *args, **kwargs)

    lookup_type._create_embedding_kernel = create  # type: ignore[method-assign]
    try:
        yield
    finally:
        lookup_type._create_embedding_kernel = original  # type: ignore[method-assign]
