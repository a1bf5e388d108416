"""The embedding kernel TorchRec's grouped lookup calls for proactive tables.

It stands where TorchRec would put a ``BatchedFusedEmbeddingBag`` (one per group of tables
with the same kernel, dim and fused params) and keeps that kernel's contract:
``forward(KJT) -> [B, sum(dims)]`` in feature order, ``state_dict``/``named_parameters`` over
the full local shards, a ``fused_optimizer``. Underneath, the whole group is one
:class:`TieredTable` over a linearized row space (each table's rows at an offset, as FBGEMM
numbers a TBE's rows), so a batch costs one plan, one fetch ticket, one pooled lookup and
one fused update, whatever the number of tables. On CPU its host tier *is* the stock
kernel's host weight storage (taken over, not copied), so TorchRec's ``ShardedTensor`` views
keep pointing at the right bytes after a flush.

Data path of one batch: ``plan_batch`` (ids -> store rows, plan, pin) -> the fetch engine
moves the rows -> ``bind`` -> ``forward`` (one ``embedding_bag`` over the cache) -> backward
(one fused update, all or nothing). A forward that nothing was bound for (a plain
``model(batch)``, an eval loop, depth 0) plans and fetches at lookup time, as stock TorchRec
does. Every data move, flushes included, goes through the module's one fetch engine.
"""

from __future__ import annotations

import copy
import functools
import warnings
import weakref
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import numpy as np
import torch
from torch import nn
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from torchrec.distributed.batched_embedding_kernel import (
    BaseBatchedEmbeddingBag,
    BatchedFusedEmbeddingBag,
    EmbeddingFusedOptimizer,
)
from torchrec.distributed.composable.table_batched_embedding_slice import TableBatchedEmbeddingSlice
from torchrec.distributed.embedding_kernel import get_state_dict
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.optim.fused import EmptyFusedOptimizer, FusedOptimizer, FusedOptimizerModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ..fetch import FetchEngine
from ..store import (
    EvictionPolicy,
    IdOutOfRangeError,
    InvalidInputError,
    NotPrefetchedError,
    OptimizerConfig,
    OptimType,
    RowMapping,
    Segment,
    StoreStateError,
    TableBatch,
    TieredTable,
    load_factor_advice,
    plan_device_batch,
    plan_unique_rows,
    unique_rows,
    pooled_lookup_group,
)
from ..store import host_memory
from ..store.row_moves import device_alias
from ..store.row_space import device_store_rows  # noqa: F401 - (re-exported: tests import it here)
from .disk_tier import ScratchDirectory, group_host_cache_bytes, host_cache_advice, resolve_directory
from .host_views import LiveTableSlice, can_be_live, live_view, register_host_storage
from .options import ProactiveOptions


@dataclass(frozen=True)
class VbeLayout:
    """Where a variable-batch (VBE) group's pooled bags go in TorchRec's VBE output: one
    flat tensor, rank-major (rank r: feature f's ``B[f][r]`` bags, features in order), as
    FBGEMM's TBE writes it. Bags come out of the lookup feature-major (the KJT's order);
    ``order`` lists them rank-major."""

    order: torch.Tensor  # bag indices in output order
    strides: Tuple[Tuple[int, ...], ...]  # B[f][r]: bags of feature f from rank r

    @staticmethod
    def of(strides: List[List[int]], device: torch.device) -> "VbeLayout":
        first = np.cumsum([0] + [sum(per_rank) for per_rank in strides])[:-1]  # each feature's first bag
        within = [np.cumsum([0] + list(per_rank))[:-1] for per_rank in strides]  # rank r's first bag in f
        ranks = len(strides[0]) if strides else 0
        parts = [np.arange(first[f] + within[f][r], first[f] + within[f][r] + strides[f][r])
                 for r in range(ranks) for f in range(len(strides))]
        order = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return VbeLayout(torch.from_numpy(order.astype(np.int64)).to(device),
                         tuple(tuple(int(b) for b in per_rank) for per_rank in strides))

    def place(self, flat: torch.Tensor, dim: int, output: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """``output`` (TorchRec's preallocated VBE output of several groups) with this
        group's ``flat`` segments copied where ``offsets[r][f]`` says (out of place, so
        autograd sees every group's part). The positions are built on ``output``'s device from
        the offsets where they are: no host read of a device tensor (the segments' lengths
        are the host's own batch sizes)."""
        ranks = len(self.strides[0]) if self.strides else 0
        lengths = [self.strides[f][r] * dim for r in range(ranks) for f in range(len(self.strides))]
        total = sum(lengths)
        device = output.device
        seg = torch.tensor(lengths, dtype=torch.int64, device=device)
        starts = offsets.reshape(-1).to(device=device, dtype=torch.int64)  # [r][f], rank-major as ``lengths``
        first = torch.cumsum(seg, 0) - seg  # each segment's first value in ``flat``
        within = torch.arange(total, device=device) - torch.repeat_interleave(first, seg, output_size=total)
        index = torch.repeat_interleave(starts, seg, output_size=total) + within
        return output.index_copy(0, index, flat.to(output.dtype))


@dataclass
class PreparedBatch:
    """A group's share of a batch reduced to what planning needs, before any store state is
    touched: the store rows (unique, sorted) and, per id, its row. Computing it has no side
    effects, so a batch whose plan must wait for pins keeps it for the retry."""

    rows: torch.Tensor
    inverse: torch.Tensor
    offsets: torch.Tensor
    one_per_bag: bool
    stride: int
    num_values: int
    weights: Optional[torch.Tensor]
    sample_major: bool
    vbe: Optional[VbeLayout] = None


@dataclass
class PlannedGroup:
    """A batch planned on one kernel: the group's one :class:`TableBatch`."""

    kernel: "ProactiveEmbeddingBag"
    batch: TableBatch
    stride: int
    num_values: int
    weights: Optional[torch.Tensor]
    # The batch's bags were reordered sample-major (one id per bag): the pooled rows are
    # already TorchRec's [B, sum(dims)] layout and need no transpose.
    sample_major: bool = False
    vbe: Optional[VbeLayout] = None  # a variable-batch batch: its output layout

    @property
    def table_batches(self) -> List[TableBatch]:
        return [self.batch]

    @property
    def plans(self) -> list:
        return [self.batch.plan]


# FBGEMM's names for each optimizer's state, in the order TorchRec lists them (TorchRec's
# fused optimizer calls the first one "momentum1" and keeps FBGEMM's names for the rest).
_FBGEMM_STATE_NAMES = {
    OptimType.EXACT_SGD: (),
    OptimType.EXACT_ADAGRAD: (("sum", "momentum1"),),
    OptimType.EXACT_ROWWISE_ADAGRAD: (("sum", "momentum1"),),
    OptimType.ADAM: (("exp_avg", "momentum1"), ("exp_avg_sq", "momentum2")),
}


class ProactiveFusedOptimizer(EmbeddingFusedOptimizer):
    """TorchRec's own fused optimizer over the host tier, so ``state_dict()`` has stock's
    keys, ``ShardedTensor`` types and shapes (``{table}.momentum1`` ...).

    Updates happen in backward, so ``step`` only syncs the learning rate from
    ``param_groups`` (LR schedulers work). Reading ``state`` first writes every dirty cached
    row back through the fetch engine (behind any queued ticket), so the host tensors it
    returns are current at any moment between batches; ``post_load_state_dict`` (TorchRec's
    hook, called after a load) drops the caches so the next batch sees the loaded values.
    Adam's step counter follows FBGEMM: not in the state dict, set with ``set_optimizer_step``.
    """

    def __init__(self, kernel: "ProactiveEmbeddingBag", pg: Optional[Any]) -> None:
        self._kernel = kernel
        super().__init__(
            kernel.handed_config, kernel, pg,  # type: ignore[arg-type]
            embedding_weights_by_table=kernel.split_embedding_weights(),
            all_optimizer_states=kernel.get_optimizer_state(),
        )

    @property  # type: ignore[override]
    def state(self) -> Dict[Any, Any]:
        self._kernel.flush()
        return self._state

    @state.setter
    def state(self, value: Dict[Any, Any]) -> None:
        self._state = value

    def post_load_state_dict(self) -> None:
        super().post_load_state_dict()
        self._kernel.invalidate()


class ProactiveEmbeddingBag(BaseBatchedEmbeddingBag[torch.Tensor], FusedOptimizerModule):
    """Serves one TorchRec group of tables from one tiered store. Built by :meth:`from_stock`.

    Pooled groups (an ``EmbeddingBagCollection``'s) return ``[B, sum(dims)]`` as
    ``BatchedFusedEmbeddingBag`` does. Sequence groups (an ``EmbeddingCollection``'s, pooling
    ``NONE``) return ``[num_ids, dim]``, each id's row in the KJT's order, as
    ``BatchedFusedEmbedding`` does: to the store they are bags of one id each, so both take
    the same plan, fetch, lookup and fused update."""

    def __init__(
        self,
        config: GroupedEmbeddingConfig,
        host_weights: List[torch.Tensor],
        host_buffer: torch.Tensor,
        options: ProactiveOptions,
        user_fused_params: Mapping[str, Any],
        engine: FetchEngine,
        pg: Optional[Any] = None,
        device: Optional[torch.device] = None,
        sharding_type: Optional[Any] = None,
        pooling_mode: Optional[PoolingMode] = None,
        host_buffer_on_device: Optional[torch.Tensor] = None,
        disk: Optional["_DiskPlace"] = None,
    ) -> None:
        super().__init__(config, pg, device, sharding_type)
        if pooling_mode is not None:
            self._pooling = pooling_mode
        self._device = device or torch.device("cpu")
        self._engine = engine
        self.optimizer_config = OptimizerConfig.from_fused_params(user_fused_params)
        cfg = self.optimizer_config
        if self._device.type == "cpu" and cfg.optim is OptimType.EXACT_ROWWISE_ADAGRAD and cfg.decay_rule in (
                "l2", "decoupled"):
            warnings.warn(
                f"tables {[t.name for t in config.embedding_tables]}: weight_decay={cfg.weight_decay} with "
                f"weight_decay_mode={cfg.weight_decay_mode.name} is applied as FBGEMM's CUDA kernels apply it; "
                f"FBGEMM's CPU kernel skips it for FP32 tables read by one feature (its fast path passes "
                f"weight_decay=0), so stock TorchRec on CPU trains those tables without decay and their results "
                f"differ from ours (see docs/optimizers.md)",
                stacklevel=2,
            )
        # TorchRec's choice for this sharding type: row-wise shardings pool mean as a sum
        # here and divide after the output all-to-all, when all of a bag's rows are summed.
        self._mode = "mean" if self._pooling == PoolingMode.MEAN else "sum"
        self._sequence = self._pooling == PoolingMode.NONE
        tables = config.embedding_tables
        self._host_buffer, self._host_views = host_buffer, list(host_weights)
        # On the device (CUDA by default) a batch is planned with fixed-shape tensor ops and
        # the training thread never reads the ids on the host (the store's DevicePlanner).
        # A group on disk is planned on the host on any device: the disk hop reads a batch's
        # rows when it is planned, on the host (a device plan would be read back for it).
        self._on_device = options.plans_on_device(self._device) and (disk is None or options.planner == "device")
        budgets = [_num_slots(t, options) for t in tables]
        self._disk_place = disk
        if disk is not None:
            host_weight = torch.empty(sum(t.local_rows for t in tables), _group_dim(config), device="meta")
        else:
            host_weight = _group_host_tier(config, host_buffer, self._host_views)
        extra: Dict[str, Any] = {}
        if disk is not None:
            if self._on_device:
                raise NotImplementedError(f"tables {config.table_names()}: a group on disk is planned on the host "
                                          f"(the sharder's planner='host' or 'auto'), got planner={options.planner!r}")
            extra = {"disk_directory": disk.scratch.path, "host_cache_bytes": disk.host_cache_bytes}
        elif self._on_device and host_buffer_on_device is not None:
            # The GPU addresses the host tier itself (FBGEMM's host-mapped UVM), optimizer
            # state included: the device planner's moves are kernels the issuing thread
            # enqueues, with no host read (store/row_moves.py, fetch/cuda.py).
            extra = _host_mapped_tier(host_weight, host_buffer, host_buffer_on_device,
                                      self.optimizer_config.state_shapes(int(host_weight.shape[1])))
        self.store = _build_store(
            planner="device" if self._on_device else "host",
            name="+".join(dict.fromkeys(t.name for t in tables)),  # column shards of a table: once
            host_weight=host_weight,
            **extra,
            optimizer=self.optimizer_config,
            num_slots=sum(budgets),
            device=self._device,
            policy=EvictionPolicy.parse((tables[0].fused_params or {}).get("cache_algorithm", options.eviction_policy)),
            hot_rows=_group_hot_rows(tables, options),
            segments=_segments(tables),
            # TorchRec groups tables whatever their load factors (its grouping key drops
            # cache_load_factor): tables planned with different ones keep one store, one
            # plan and one lookup, each table's rows in its own share of the slots. Equal
            # load factors keep one shared cache (unchanged choices; its LRU moves slots
            # to the hotter tables by itself). See ``table_budgets``.
            segment_slots=budgets if _per_table_budgets(tables, options, self._on_device) else None,
        )
        # An update whose plan's pins ended early (see ``forward``) moves its rows again
        # through this module's engine, in their turn behind every queued move.
        self.store.move_now = functools.partial(engine.run, tag="late update")
        # The training lookup whose backward has not come yet. Its pins end at that backward,
        # or at this kernel's next training forward, flush, load or reset, whichever comes
        # first - a rule that needs no garbage collector (see ``forward``).
        self._awaiting_backward: Optional[TableBatch] = None
        # Per feature (in the group's KJT order): where its table's rows start in the store.
        self._feature_start = np.array(
            [seg.start for seg, t in zip(self.store.segments, tables) for _ in range(t.num_features())],
            dtype=np.int64,
        )
        self._num_features = int(self._feature_start.shape[0])
        self._feature_start_device = torch.tensor(self._feature_start.tolist(), dtype=torch.int64, device=self._device)
        # Per feature, its own table's rows: on the device planner ids are checked against
        # them there (the input dist's validator runs only for host ids). One table needs
        # no such check: the store's own bounds are that table's.
        feature_rows = [seg.num_rows for seg, t in zip(self.store.segments, tables) for _ in range(t.num_features())]
        self._feature_rows_device = (torch.tensor(feature_rows, dtype=torch.int64, device=self._device)
                                     if self._on_device and len(self.store.segments) > 1 else None)
        self._orders: Dict[int, torch.Tensor] = {}  # stride -> sample-major order of values
        self._vbe_layouts: Dict[Any, VbeLayout] = {}  # VBE batch sizes -> output layout
        # Connects our custom autograd function to the graph; never receives a gradient.
        self._anchor = torch.empty(0, device=self._device, requires_grad=True)
        self._bound: Optional[PlannedGroup] = None
        self._warned_overflow = False
        self._warned_host_overflow = False
        self._warned_stale_write = False
        # Written through a live view (or its bytes handed out) since the last lookup.
        self._host_written = False
        # The optimizer state TorchRec is handed (``get_optimizer_state``), per store key.
        self._handed_state: Dict[str, torch.Tensor] = self.store.exposed_state
        # On CUDA, TorchRec places the group's shards on the device (``rank:r/cuda:r``) and
        # checks that every tensor it is handed is there (``Shard``): it is handed the host
        # tier as the GPU addresses it - the same bytes, no copy (``_device_handout``).
        self._handed_on_device = False
        if disk is None and self._device.type == "cuda":
            self._hand_out_on_device(config, host_buffer, host_buffer_on_device)
        # What TorchRec hands out (state_dict, named_parameters, the optimizer's state) is
        # live: a read writes the cache back first, a write is taken by the cache (see
        # host_views.py; on disk, disk_views.py). The store itself reads and writes through
        # plain aliases.
        if disk is None:
            register_host_storage(host_buffer, self)
            for state in self.store.exposed_state.values():
                register_host_storage(state, self)
            if self._handed_on_device:
                register_host_storage(self._host_buffer, self)
                for state in self._handed_state.values():
                    register_host_storage(state, self)
            self._host_views = [live_view(v) for v in self._host_views]
        else:
            self._host_views = [self._disk_view(0, seg.start, seg.num_rows) for seg in self.store.segments]
            # The group's file and its directory are scratch: gone when the module is.
            self._closer = weakref.finalize(self, _close_disk, self.store, disk.scratch)
        self._uvm_owner: Optional[torch.Tensor] = None  # set by from_stock on CUDA
        self.prefetch_depth = 0
        #: The config whose shard metadata TorchRec's sharded tensors of this group are built
        #: from (``state_dict``, the fused optimizer's state): the plan's, or for a group on
        #: disk a copy placed on the CPU, where its handed-out rows are on any device.
        self.handed_config = _cpu_placed(config) if disk is not None else config
        self._optim = ProactiveFusedOptimizer(self, pg)

    # ------------------------------------------------------------------ construction
    def _hand_out_on_device(self, config: GroupedEmbeddingConfig, host_buffer: torch.Tensor,
                            device_buffer: Optional[torch.Tensor]) -> None:
        """On CUDA, makes what TorchRec is handed (the tables' weights, their optimizer state)
        the host tier as the GPU addresses it: CUDA tensors over the very bytes of the host
        tier (FBGEMM's host-mapped rows, ``device_buffer``, and the store's host-mapped state,
        its ``host_on_device``), as stock FBGEMM hands its UVM rows. TorchRec places the
        shards on ``cuda:r`` and its ``Shard`` refuses a CPU tensor there (the fused
        optimizer's, ``state_dict``'s and the sharded module's sharded tensors).

        Where no such view exists (the rows are a copy, or the state is not addressable by
        the GPU) the CPU tensors stay, and a shard placed on a CUDA device is refused here
        in one line rather than in TorchRec's check."""
        handout = _device_handout(host_buffer, device_buffer, self._host_views, self.store)
        if handout is None:
            placed = sorted({str(t.local_metadata.placement.device()) for t in config.embedding_tables
                             if t.local_metadata is not None and t.local_metadata.placement is not None})
            if any(torch.device(p).type == "cuda" for p in placed):
                raise NotImplementedError(
                    f"tables {config.table_names()}: TorchRec places their shards on {placed} and needs the tensors "
                    f"it is handed there, but no CUDA view of their host tier could be made (its rows are a copy "
                    f"of FBGEMM's, or its optimizer state is not host memory the GPU addresses)")
            return
        self._host_buffer, self._host_views, self._handed_state = handout
        self._handed_on_device = True

    @classmethod
    def from_stock(
        cls,
        stock: BatchedFusedEmbeddingBag,
        options: ProactiveOptions,
        user_fused_params: Mapping[str, Any],
        engine: FetchEngine,
        pg: Optional[Any],
        device: Optional[torch.device],
    ) -> "ProactiveEmbeddingBag":
        """Takes over the host weight storage of a stock fused kernel (same initialisation).

        On CPU the stock kernel's host buffer *is* the host tier (no copy). On CUDA the
        stock kernel holds its rows in host-mapped UVM (the sharded module asks FBGEMM for
        ``uvm_host_mapped``: ``malloc`` + ``cudaHostRegister``, exact size), which becomes
        the host tier in place through a CPU alias of the same bytes
        (``store.host_memory.cpu_alias``: FBGEMM's ``uvm_to_cpu`` refuses host-mapped
        storage); the optimizer state is host-mapped at its exact size too
        (``_host_mapped_tier``), so rows and state are each held once
        (``integration/host_tier_probe.py`` counts it). TorchRec, which places the shards on
        ``cuda:r``, is handed CUDA views of those same bytes (``_hand_out_on_device``). Where
        no alias can be made the rows are copied once, said in a warning. ``user_fused_params`` are the group's
        fused params as the user gave them (the stock kernel was built with plain SGD, see
        the sharded module)."""
        views = [w.detach() for w in stock.split_embedding_weights()]
        emb = stock.emb_module
        buffer = emb.weights_host if emb.weights_host.numel() else emb.weights_uvm
        keep_alive = None
        if buffer.device.type != "cpu":
            host = _host_alias(buffer)
            if host is None:
                host = _pinned_copy(buffer, stock.config.table_names())
            else:
                keep_alive = buffer  # (the alias shares the UVM allocation)
            base = buffer.storage_offset()
            views = [host[v.storage_offset() - base: v.storage_offset() - base + v.numel()].view(v.shape)
                     for v in views]
            buffer = host
        kernel = cls(stock.config, views, buffer, options, user_fused_params, engine, pg, device,
                     # (as TorchRec chose it for this sharding; a sequence kernel does not pool)
                     pooling_mode=getattr(stock, "_pooling", PoolingMode.NONE),
                     host_buffer_on_device=keep_alive)
        kernel._uvm_owner = keep_alive
        return kernel

    @classmethod
    def on_disk(
        cls,
        config: GroupedEmbeddingConfig,
        options: ProactiveOptions,
        user_fused_params: Mapping[str, Any],
        engine: FetchEngine,
        pg: Optional[Any],
        device: Optional[torch.device],
        sharding_type: Optional[Any] = None,
        rank: int = 0,
        local_rank: int = 0,
    ) -> "ProactiveEmbeddingBag":
        """A group planned ``key_value``: its rows in a file under the plan's directory (a
        fresh sub-directory, removed with the module), behind a DRAM host cache
        (``disk_tier.group_host_cache_bytes``). Built in the place of TorchRec's kernel,
        which would allocate every row. The rows start at zero; the sharded module's
        ``reset_parameters`` initialises them, in chunks, with each table's ``init_fn``."""
        tables = config.embedding_tables
        specs = {t.name: options.disk[t.name] for t in tables}
        host_cache = group_host_cache_bytes(specs)
        parent = resolve_directory(next(iter(specs.values())).directory, local_rank)
        scratch = ScratchDirectory(parent, "+".join(dict.fromkeys(t.name for t in tables)), rank)
        try:
            kernel = cls(config, [], torch.empty(0), options, user_fused_params, engine, pg, device,
                         sharding_type=sharding_type, disk=_DiskPlace(scratch, host_cache))
        except BaseException:
            scratch.remove()
            raise
        file = kernel.store.disk.file
        if not file.o_direct:
            warnings.warn(f"tables {kernel.table_names()}: {file.fallback_reason} (the page cache then serves "
                          f"reads: disk timings are not an SSD's)", stacklevel=2)
        return kernel

    @property
    def on_disk_tier(self) -> bool:
        """Whether the group's host tier is a file behind a DRAM cache (planned ``key_value``)."""
        return self._disk_place is not None

    def _disk_view(self, component: int, start: int, num_rows: int) -> torch.Tensor:
        from .disk_views import disk_view

        return disk_view(self, self.store, component, start, num_rows)

    @torch.no_grad()
    def initialize_disk_rows(self, chunk_rows: int = 65536) -> None:
        """Writes each table's initial weights (its ``init_fn``, chunk by chunk: the table
        is never whole in DRAM) and zero optimizer state. Stock TorchRec's
        ``reset_parameters`` runs ``init_fn`` on the whole local shard; a chunk at a time
        draws the same distribution, not the same numbers."""
        self.flush()
        self._engine.drain()
        states = list(self.store.host_state.values())
        for seg, t in zip(self.store.segments, self._config.embedding_tables):
            for at in range(0, seg.num_rows, chunk_rows):
                n = min(chunk_rows, seg.num_rows - at)
                weight = torch.empty(n, self.store.dim, dtype=self.store.host_weight.dtype)
                if t.init_fn is not None:
                    t.init_fn(weight)
                else:
                    weight.uniform_(-(1.0 / t.num_embeddings) ** 0.5, (1.0 / t.num_embeddings) ** 0.5)
                zeros = [torch.zeros(n, *v.shape[1:], dtype=v.dtype) for v in states]
                self.store.write_host_rows(seg.start + at, [weight, *zeros])
        self.store.invalidate()

    def close(self) -> None:
        """Stops a disk group's I/O and removes its file and directory (idempotent; also
        done when the module is collected or the process exits). No-op in DRAM."""
        closer = getattr(self, "_closer", None)
        if closer is not None:
            self.flush()
            closer()

    # ------------------------------------------------------------------ TorchRec contract
    @property
    def emb_module(self) -> "ProactiveEmbeddingBag":  # type: ignore[override]
        # BaseBatchedEmbeddingBag reads split weights through `emb_module`.
        return self

    def state_dict(self, destination: Optional[Dict[str, Any]] = None, prefix: str = "",  # type: ignore[override]
                   keep_vars: bool = False) -> Dict[str, Any]:
        """TorchRec's state dict (one ``ShardedTensor`` per table), its shards placed as
        :attr:`handed_config` says."""
        self.flush()
        return get_state_dict(self.handed_config.embedding_tables, self.split_embedding_weights(), self._pg,
                              destination, prefix)

    def split_embedding_weights(self) -> List[torch.Tensor]:  # type: ignore[override]
        return list(self._host_views)

    def get_optimizer_state(self) -> List[Dict[str, torch.Tensor]]:
        """Per table, the host-tier optimizer state under FBGEMM's names (``sum``, ``exp_avg`` ...)."""
        names = _FBGEMM_STATE_NAMES[self.optimizer_config.optim]
        if self._disk_place is not None:
            order = list(self.store.host_state)
            return [{fbgemm: self._disk_view(1 + order.index(ours), seg.start, seg.num_rows) for fbgemm, ours in names}
                    for seg in self.store.segments]
        return [
            {fbgemm: live_view(self._handed_state[ours].narrow(0, seg.start, seg.num_rows))
             for fbgemm, ours in names}
            for seg in self.store.segments
        ]

    def get_learning_rate(self) -> float:
        return self.optimizer_config.learning_rate

    def set_learning_rate(self, lr: float) -> None:
        self.update_hyper_parameters({"learning_rate": lr})

    def update_hyper_parameters(self, params_dict: Mapping[str, float]) -> None:
        """FBGEMM's names: ``learning_rate``/``lr``, ``eps``, ``beta1``, ``beta2``, ``weight_decay``."""
        known = {"learning_rate", "eps", "beta1", "beta2", "weight_decay"}
        changes = {("learning_rate" if k == "lr" else k): float(v) for k, v in params_dict.items()}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"tables {self.table_names()}: unknown hyper-parameters {unknown}; known: {sorted(known)}")
        if all(getattr(self.optimizer_config, k) == v for k, v in changes.items()):
            return
        self.optimizer_config = replace(self.optimizer_config, **changes)
        self.store.optimizer = self.optimizer_config

    def set_optimizer_step(self, step: int) -> None:
        """Sets the optimizer step (Adam's bias correction), as FBGEMM does."""
        self.store.step = int(step)

    def table_names(self) -> List[str]:
        """The group's tables, each once (several column shards of a table share a group)."""
        return list(dict.fromkeys(seg.name for seg in self.store.segments))

    @property
    def fused_optimizer(self) -> FusedOptimizer:
        return self._optim

    @property
    def _param_per_table(self) -> Dict[str, TableBatchedEmbeddingSlice]:  # type: ignore[override]
        # One slice per table over the shared host buffer; several column shards of one
        # table on this rank are adjacent in the buffer and share one slice (as in TorchRec).
        if self._disk_place is not None:
            return self._disk_param_per_table()
        spans: Dict[str, Tuple[int, int, int]] = {}
        base = self._host_buffer.storage_offset()
        for cfg, view in zip(self._config.embedding_tables, self._host_views):
            start = view.storage_offset() - base
            end = start + view.numel()
            lo, hi, _ = spans.get(cfg.name, (start, end, view.shape[1]))
            spans[cfg.name] = (min(lo, start), max(hi, end), view.shape[1])
        out: Dict[str, TableBatchedEmbeddingSlice] = {}
        for name, (start, end, dim) in spans.items():
            sl = (LiveTableSlice if can_be_live(self._host_buffer) else TableBatchedEmbeddingSlice)(
                data=self._host_buffer, start_offset=start, end_offset=end,
                num_embeddings=-1, embedding_dim=dim,
            )
            sl._in_backward_optimizers = [self._optim]  # type: ignore[attr-defined]
            out[name] = sl
        return out

    def _disk_param_per_table(self) -> Dict[str, nn.Parameter]:
        """Per table, one parameter over its rows in the store (its column shards on this
        rank are separate segments of one dim; the first is registered, as TorchRec
        registers one slice per table)."""
        out: Dict[str, nn.Parameter] = {}
        for seg in self.store.segments:
            if seg.name in out:
                continue
            param = nn.Parameter(self._disk_view(0, seg.start, seg.num_rows), requires_grad=False)
            param._in_backward_optimizers = [self._optim]  # type: ignore[attr-defined]
            out[seg.name] = param
        return out

    @_param_per_table.setter
    def _param_per_table(self, value: Any) -> None:
        pass  # the base class assigns an empty dict in __init__; ours is derived

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
        # Fused parameters are not buffers (TorchRec's convention for fused kernels).
        yield from ()

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator[Tuple[str, nn.Parameter]]:
        for name, tensor in self.named_split_embedding_weights(prefix, recurse, remove_duplicate):
            param = nn.Parameter(tensor, requires_grad=False)
            # Marks the parameter as updated in backward, so dense optimizers skip it.
            param._in_backward_optimizers = [EmptyFusedOptimizer()]  # type: ignore[attr-defined]
            yield name, param

    def named_tables(self) -> Iterator[Tuple[str, TieredTable]]:
        """The group's store, named after its tables."""
        yield self.store.name, self.store

    def flush(self) -> None:
        """Writes dirty cached rows back to the host tier, behind every queued fetch.

        A training lookup whose backward has not come loses its pins here (its backward,
        if it still comes, finds its rows again). Rows the user wrote in place since the
        last lookup are not overwritten: that write is applied to the cache first."""
        self.end_pins_awaiting_backward()
        self._apply_host_writes()
        self._engine.flush([self.store])

    def purge(self) -> None:
        """TorchRec calls this before a load: no trained row may be dropped, so flush first."""
        self.flush()
        self.invalidate()

    def invalidate(self) -> None:
        """Makes the cache match a host tier that was just rewritten (a load, a re-init).

        With no batch in flight the cached rows are dropped. With batches in flight (a load
        between two steps of a running pipeline) every cached row is copied again from the
        host tier, in its turn behind every queued fetch, so those batches read the loaded
        values - what stock TorchRec's lookups would read. Either way the whole load applies."""
        self.end_pins_awaiting_backward()
        self._engine.drain()
        store = self.store
        store.external_writes()  # (the load's own writes: applied by this call)
        if not store.in_flight:
            store.invalidate()
        else:
            for plan in store.plan_refresh():  # (one ticket per chunk: bounded staging)
                self._engine.run([plan], tag="refresh")

    def end_pins_awaiting_backward(self) -> None:
        """Ends the pins of the last training lookup if its backward has not come (the pin
        rule: see ``forward``); a backward that still comes finds its rows again."""
        batch, self._awaiting_backward = self._awaiting_backward, None
        if batch is not None:
            batch.table.release(batch.plan)  # (idempotent: a no-op after its backward)

    def before_host_access(self) -> None:
        """A live view (``host_views.py``) is about to read or write the host tier: the cache
        is written back first, so the view sees the table as training left it. On disk the
        fetch engine is drained too: a view's write goes straight to the host tier, and no
        queued move may come after it (with batches in flight too)."""
        self.flush()
        if self._disk_place is not None:
            self._engine.drain()

    def after_host_write(self) -> None:
        """A live view wrote the host tier: the next lookup (or flush) has the cache take the
        rows written. On CUDA the views handed out are device tensors, whose writes are
        kernels still queued: they land before the host reads the tier again."""
        self._host_written = True
        if self._handed_on_device and torch.cuda.is_available():
            torch.cuda.synchronize(self._device)

    def adopt_host_writes(self) -> None:
        """Makes the cache take what was written in place into the host tier (after a
        re-initialisation, or writes through ``.data`` or NumPy, which the version counters
        do not see), row by row: see ``TieredTable.adopt_host_writes``."""
        self._apply_host_writes(always=True)

    def _apply_host_writes(self, always: bool = False) -> None:
        """Makes the cache take what was written in place into the host tier since the last
        check, row by row (``TieredTable.adopt_host_writes``): the rows and tensors (weight,
        each state) written take the written values, every other cached row keeps its
        updates. Training is never discarded by a write.

        Writes are seen two ways: a live view (``host_views.py``: what TorchRec hands out)
        says so itself, after writing the cache back first, so the write started from the
        live table; and the version counter of the host tier's tensors moved (a write through
        another view of them: one integer compare per tensor at each plan, lookup and flush).
        A write the cache could not check (rows with updates not yet written back, written
        through a tensor that is not live) is said once, naming the tables. ``always``:
        compare even when neither says so."""
        store = self.store
        written, self._host_written = self._host_written, False
        if not store.external_writes() and not written and not always:
            return
        # No move may run while the cache compares itself with the host tier: every queued
        # fill has landed (and recorded what it read) before the comparison.
        self._engine.drain()
        taken, behind = store.adopt_host_writes()
        if behind and not self._warned_stale_write:
            self._warned_stale_write = True
            warnings.warn(
                f"tables {self.table_names()}: their host tier was written in place through a tensor that is not "
                f"one this module hands out (those write the cache back first), while {behind} cached row(s) held "
                f"updates not yet written back; those rows kept their cached values (a write to them cannot be told "
                f"from their old values), {taken} other row(s) took the written values. Write through state_dict(), "
                f"named_parameters() or the optimizer's state_dict() tensors (said once per table group)",
                stacklevel=3,
            )

    # ------------------------------------------------------------------ data path
    def plan_batch(self, features: KeyedJaggedTensor, overflow: bool = False) -> PlannedGroup:
        """Maps the group's ids to store rows, plans (and pins) them; issues nothing.

        Raises ``CacheCapacityError`` changing nothing when the rows do not fit beside the
        in-flight batches' pins, unless ``overflow`` (see ``TieredTable.plan``).
        """
        return self.plan_prepared(self.prepare_batch(features), overflow)

    def prepare_batch(self, features: KeyedJaggedTensor) -> PreparedBatch:
        """The group's ids as unique store rows (no store state is read or written)."""
        if self._on_device:
            return self._prepare_on_device(features)
        stride = features.stride()
        values = features.values()
        if self._sequence:
            # Every id is its own bag; ids stay in the KJT's order, which is the output's.
            ids = values.cpu().numpy()
            rows = torch.from_numpy(store_rows(ids, self._feature_start, stride, features.length_per_key(),
                                               False, False))
            unique, inverse = unique_rows(rows)
            return PreparedBatch(unique, inverse, self._one_id_bags(ids.shape[0], values.device), True, stride,
                                 int(ids.shape[0]), None, False)
        weights = features.weights_or_none()
        # Ids were checked against their table's size in the sharded module's input dist,
        # before bucketisation (where the error can still name the sample), so here they
        # only need moving into the store's row space; the store refuses rows outside it.
        # (Host-side index arithmetic in NumPy: a few small vector ops, cheaper than torch's.)
        ids = values.cpu().numpy()  # int32 or int64; a view unless the ids are on an accelerator
        num_features = self._num_features
        # As many ids as bags and no bag empty: every bag holds exactly one id (Criteo's
        # shape), so feature f's ids are the f-th block of `stride`. (Not with a variable
        # batch per feature (VBE): each feature has a stride of its own.)
        vbe = self._vbe_layout(features)
        lengths = features.lengths()
        num_ids = ids.shape[0]
        one_per_bag = 0 < num_ids == lengths.numel() and int(lengths.cpu().numpy().min()) >= 1
        per_feature: List[int] = [] if one_per_bag and vbe is None else features.length_per_key()
        # Otherwise the ids may still come in blocks of `stride` per feature.
        blocks = vbe is None and (one_per_bag or (stride > 0 and all(n == stride for n in per_feature)))
        # One id per bag and several features: hand the store the ids sample by sample
        # (value f * B + b of TorchRec's feature-major order goes to b * F + f), so that the
        # pooled rows come out in TorchRec's [B, sum(dims)] layout with no transpose in
        # forward or backward. Done before planning: the plan's lookup recipe is then in
        # that order already. The sums per row run in the new order: deterministic.
        sample_major = one_per_bag and num_features > 1 and vbe is None
        if sample_major and weights is not None:
            weights = weights.index_select(0, self._sample_major_order(stride).to(weights.device))
        rows = torch.from_numpy(store_rows(ids, self._feature_start, stride, per_feature, blocks, sample_major))
        unique, inverse = unique_rows(rows)
        return PreparedBatch(unique, inverse, features.offsets(), one_per_bag, stride, int(values.numel()),
                             weights, sample_major, vbe)

    def _prepare_on_device(self, features: KeyedJaggedTensor) -> PreparedBatch:
        """The group's ids as they come, on their device: moving them into the store's row
        space is part of the plan (``_row_mapping``), so that it runs inside the plan's graph."""
        values = features.values()
        offsets = self._one_id_bags(int(values.shape[0]), values.device) if self._sequence else features.offsets()
        return PreparedBatch(values, None, offsets, False, features.stride(),  # type: ignore[arg-type]
                             int(values.shape[0]), features.weights_or_none(), False,
                             None if self._sequence else self._vbe_layout(features))

    def _vbe_layout(self, features: KeyedJaggedTensor) -> Optional[VbeLayout]:
        """A variable-batch KJT's output layout (cached per batch-size pattern), else None."""
        if self._sequence or not features.variable_stride_per_key():
            return None
        strides = features.stride_per_key_per_rank()
        key = tuple(tuple(per_rank) for per_rank in strides)
        layout = self._vbe_layouts.get(key)
        if layout is None:
            if len(self._vbe_layouts) >= 64:  # (bounded: batch-size patterns can be many)
                self._vbe_layouts.clear()
            layout = self._vbe_layouts[key] = VbeLayout.of(strides, self._device)
        return layout

    @staticmethod
    def _one_id_bags(num_ids: int, device: torch.device) -> torch.Tensor:
        """Offsets of ``num_ids`` bags of one id each: a sequence lookup as a pooled one."""
        return torch.arange(num_ids + 1, dtype=torch.int64, device=device)

    def _row_mapping(self, prepared: PreparedBatch) -> RowMapping:
        """Each id plus the first row of its feature's table, the feature found from the
        KJT's offsets (one ``searchsorted``, no host read), checked against its own table's
        rows (``device_store_rows``)."""
        stride = prepared.stride
        rows = functools.partial(self._device_rows, stride=stride)
        return RowMapping(rows, prepared.offsets, (id(self), stride))

    def _device_rows(self, values: torch.Tensor, offsets: torch.Tensor, stride: int) -> torch.Tensor:
        return device_store_rows(values, offsets, stride, self._feature_start, self._feature_start_device,
                                 self._feature_rows_device)

    def plan_prepared(self, prepared: PreparedBatch, overflow: bool = False) -> PlannedGroup:
        """Plans (and pins) a prepared batch; see ``plan_batch``."""
        p = prepared
        self._apply_host_writes()
        if self._on_device:
            self._report_device_checks()
            batch = plan_device_batch(self.store, p.rows, p.offsets, self._mode,  # type: ignore[arg-type]
                                      self.prefetch_depth or None, overflow=overflow, mapping=self._row_mapping(p))
        else:
            batch = plan_unique_rows(self.store, p.rows, p.inverse, p.offsets, self._mode, self.prefetch_depth or None,
                                     overflow=overflow, one_per_bag=p.one_per_bag)
        if batch.plan.through_host_cache and not self._warned_host_overflow:
            self._warned_host_overflow = True
            reason = self.store.host_overflow_reason
            warnings.warn(
                f"tables {self.table_names()}: {reason}; this batch's rows were moved through the host cache a chunk "
                f"at a time instead (exact, but its disk reads on the critical path; said once per table group): "
                f"{host_cache_advice(reason)}",
                stacklevel=2,
            )
        if batch.plan.num_overflow and not self._warned_overflow:
            self._warned_overflow = True
            plan, store = batch.plan, self.store
            who, need, slots, rows = f"tables {self.table_names()}", plan.num_rows, store.num_slots, store.num_rows
            held = store.pinned_slots() - (plan.num_rows - plan.num_overflow)  # (this batch's own excluded)
            ranges = None if self._on_device else store.segment_slot_ranges()
            if ranges is not None:  # each table has its budget: speak of the one that overflowed
                seg = store.segment_of(int(plan.overflow_rows[0]))  # type: ignore[index]
                part = store.segments.index(seg)
                lo, hi = ranges[part]
                in_seg = int(((plan.rows >= seg.start) & (plan.rows < seg.start + seg.num_rows)).sum())
                over = int(((plan.overflow_rows >= seg.start) & (plan.overflow_rows < seg.start + seg.num_rows)).sum())
                who = f"table '{seg.name}' (its budget of the store of tables {self.table_names()})"
                need, slots, rows = in_seg, hi - lo, seg.num_rows
                held = store.planner.pinned_in(lo, hi) - (in_seg - over)
            if need > slots:
                why = f"one batch needs {need} distinct rows but the device cache has {slots} slots"
            else:
                why = (f"a batch needs {need} distinct rows and the device cache has {slots} "
                       f"slots, but {held} of them were held by batches still in flight (prefetched by another "
                       f"pipeline, or looked up by forwards whose backward has not come yet)")
            warnings.warn(
                f"{who}: {why}; {plan.num_overflow} rows were served from the host "
                f"tier (exact, but on the critical path; said once per table group). A cache of at least "
                f"{need + max(held, 0)} slots "
                f"({load_factor_advice(need + max(held, 0), rows)}) serves this batch beside "
                f"them; batches with more distinct rows and prefetching need more.",
                stacklevel=2,
            )
        return PlannedGroup(self, batch, p.stride, p.num_values, p.weights, p.sample_major, p.vbe)

    def _report_device_checks(self) -> None:
        """Raises for what the device-side checks found at earlier batches (read without a
        wait, so up to a step or so late: see ``AsyncCount``)."""
        checks = self.store.planner
        bad = checks.bad_ids.poll()  # type: ignore[union-attr]
        if bad:
            raise IdOutOfRangeError(
                f"tables {self.table_names()}: {bad} id(s) of a recent batch were outside their own table's rows "
                f"(ids must lie in [0, num_embeddings) of their table); they were looked up from a scratch row and trained no real row. "
                f"On CUDA ids are checked on the device and reported at the next batch; run with the sharder's "
                f"planner='host' to have them named before the all-to-all"
            )
        skipped = checks.poll_skipped()  # type: ignore[union-attr]
        if skipped:
            raise InvalidInputError(
                f"tables {self.table_names()}: a non-finite gradient reached {skipped} recent update(s); each "
                f"was skipped for the whole group, which is unchanged by it"
            )
        unplaced = checks.unplaced.poll()  # type: ignore[union-attr]
        if unplaced:
            raise StoreStateError(
                f"tables {self.table_names()}: {unplaced} row(s) of a recent batch found no cache slot although "
                f"its plan was made as surely fitting (the store's in-flight bound fell short: a bug); they were "
                f"read from and trained in a scratch slot. Please report it, with the sharder's options"
            )

    def _sample_major_order(self, stride: int) -> torch.Tensor:
        """Value ``f * B + b`` (TorchRec's feature-major KJT order) goes to row ``b * F + f``."""
        order = self._orders.get(stride)
        if order is None:
            order = torch.arange(self._num_features * stride).view(self._num_features, stride).t().reshape(-1)
            self._orders[stride] = order
        return order

    def unplan(self, planned: PlannedGroup) -> None:
        """Undoes a plan whose fetch was never issued (nothing moved yet): bookkeeping back,
        pins released. Used when a batch cannot be planned on every kernel at once."""
        self.store.rollback(planned.batch.plan)
        self.store.release(planned.batch.plan)

    def bind(self, planned: PlannedGroup) -> None:
        """Hands a planned (and transferred) batch to the next ``forward``."""
        self._bound = planned

    def unbind(self) -> None:
        """Forgets a bound batch that will not be looked up (its plans are released elsewhere)."""
        self._bound = None

    def forward(self, features: KeyedJaggedTensor, *args: Any, vbe_output: Optional[torch.Tensor] = None,  # type: ignore[override]
                vbe_output_offsets: Optional[torch.Tensor] = None, **kwargs: Any) -> torch.Tensor:
        """The group's lookup: ``[B, sum(dims)]`` (pooled), ``[num_ids, dim]`` (sequence), or
        for a variable batch per feature TorchRec's flat VBE output - this group's alone, or
        written into ``vbe_output`` at ``vbe_output_offsets`` when TorchRec merges several
        groups' outputs (as FBGEMM's TBE takes them)."""
        planned, self._bound = self._bound, None
        # A forward with grad enabled may be trained on, whatever the module's mode: FBGEMM
        # updates the tables in backward in eval mode too (users freeze dropout that way).
        # Under no_grad (an evaluation pipeline's choice) the lookup is read-only and
        # releases its pins at once.
        train = torch.is_grad_enabled()
        if train:
            # Pin rule: the previous training lookup's backward had its chance. Its pins end
            # now, so a forward whose loss was dropped holds nothing past the next one (no
            # garbage collector involved); a backward that still comes plans again.
            self.end_pins_awaiting_backward()
        self._apply_host_writes()
        if planned is None:
            # Nothing prefetched this batch (plain forward, eval loop): fetch now, on the
            # critical path, in its turn behind any queued ticket. No later batch is planned
            # on this path, so rows that do not fit may be served from the host tier.
            planned = self.plan_batch(features, overflow=True)
            try:
                self._engine.run(planned.plans, tag="lookup")
            except BaseException:
                self._release(planned)
                raise
        if features.stride() != planned.stride or features.values().numel() != planned.num_values:
            self._release(planned)
            raise NotPrefetchedError(
                f"tables {self.table_names()}: the prefetched batch (stride {planned.stride}, "
                f"{planned.num_values} ids) is not the batch being looked up (stride {features.stride()}, "
                f"{features.values().numel()} ids)"
            )
        # FBGEMM's TBE advances its step counter (Adam's bias correction) on every forward,
        # training or not; the batch's update uses the value of its own forward.
        self.store.count_forward(planned.batch.plan)
        pooled = pooled_lookup_group([planned.batch], self._anchor, [planned.weights], train=train)[0]
        if train:
            self._awaiting_backward = planned.batch
        if self._sequence:
            return pooled  # [num_ids, dim]: each id's row, in the KJT's order
        if planned.vbe is not None:
            flat = pooled.index_select(0, planned.vbe.order).reshape(-1)
            if vbe_output is None:
                return flat
            return planned.vbe.place(flat, int(pooled.shape[1]), vbe_output, vbe_output_offsets)  # type: ignore[arg-type]
        stride = planned.stride
        if planned.sample_major:
            return pooled.view(stride, -1)
        # [features * B, dim] -> TorchRec's [B, sum(dims)], features side by side.
        return pooled.view(-1, stride, pooled.shape[1]).transpose(0, 1).reshape(stride, -1)

    @staticmethod
    def _release(planned: PlannedGroup) -> None:
        planned.batch.table.release(planned.batch.plan)

    def check_invariants(self, expect_drained: bool = False) -> None:
        self.store.check_invariants(expect_drained)


def _pinned_copy(uvm: torch.Tensor, tables: List[str]) -> torch.Tensor:
    """The rows copied once into host memory at their exact size, where no CPU alias of
    FBGEMM's buffer can be made (``store.host_memory.cpu_alias``): said once, since the rows
    are held twice while the stock kernel's buffer lives, and the copy is not addressable
    by the GPU (its moves then go through pinned staging, fetch/cuda.py). Not pinned: the
    caching host allocator would round it up to a power of two."""
    nbytes = uvm.numel() * uvm.element_size()
    warnings.warn(
        f"tables {tables}: no CPU alias of FBGEMM's host-mapped rows could be made here, so the host tier is "
        f"a copy of the {nbytes / 2**20:.0f} MiB of rows (held twice while the stock kernel's buffer lives; "
        f"its moves go through pinned staging)",
        stacklevel=3,
    )
    host = torch.empty(uvm.shape, dtype=uvm.dtype)
    host.copy_(uvm)
    return host


def _host_mapped_tier(host_weight: torch.Tensor, host_buffer: torch.Tensor, device_buffer: torch.Tensor,
                      state_shapes: Mapping[str, Tuple[int, ...]]) -> Dict[str, Any]:
    """The store's host tier as the GPU addresses it: the group's rows within FBGEMM's
    host-mapped buffer (``device_buffer``, the same bytes as ``host_buffer``), and optimizer
    state allocated host-mapped too, zeroed, at its exact size (``store.host_memory.
    mapped_zeros``: FBGEMM's ``new_host_mapped_tensor`` and a CPU alias of it, where pinned
    tensors from PyTorch's caching host allocator are rounded up to a power of two). Empty
    where that cannot be made (the store then allocates the state, and the moves may use
    staging)."""
    start = host_weight.storage_offset() - host_buffer.storage_offset()
    weight = device_buffer.view(-1).narrow(0, start, host_weight.numel()).view(host_weight.shape)
    state: Dict[str, torch.Tensor] = {}
    on_device = [weight]
    for key, shape in state_shapes.items():
        made = host_memory.mapped_zeros([int(host_weight.shape[0]), *shape], torch.float32, device_buffer.device)
        if made is None:
            return {}
        state[key] = made[0]
        on_device.append(made[1])
    return {"host_state": state, "host_on_device": on_device}


def _device_handout(host_buffer: torch.Tensor, device_buffer: Optional[torch.Tensor], views: List[torch.Tensor],
                    store: TieredTable) -> Optional[Tuple[torch.Tensor, List[torch.Tensor], Dict[str, torch.Tensor]]]:
    """``(buffer, per-table weights, state per store key)`` as CUDA tensors over the bytes of
    the host tier: ``device_buffer`` is ``host_buffer`` as the GPU addresses it (FBGEMM's
    host-mapped UVM, whose CPU alias ``host_buffer`` is: same allocation, same layout), so
    each table's view is at its own offset there; the state is the store's ``host_on_device``
    (weight, then each state, over the host tier's bytes), else each state's device alias
    (pinned or registered host memory, ``row_moves.device_alias``). None where one is missing."""
    if device_buffer is None or device_buffer.device.type != "cuda":
        return None
    tier = store.host_on_device
    if tier is not None and len(tier) == 1 + len(store.host_state):
        state = dict(zip(store.host_state, tier[1:]))
    else:
        state = {key: device_alias(t, device_buffer.device) for key, t in store.host_state.items()}
    if any(t is None or t.device.type != "cuda" for t in state.values()):
        return None
    shift = device_buffer.storage_offset() - host_buffer.storage_offset()
    weights = [device_buffer.as_strided(tuple(v.shape), tuple(v.stride()), v.storage_offset() + shift) for v in views]
    return device_buffer, weights, state


def _host_alias(uvm: torch.Tensor) -> Optional[torch.Tensor]:
    """A CPU tensor over the same bytes as a UVM tensor (managed or host-mapped; see
    ``store.host_memory.cpu_alias``), or None where none can be made."""
    return host_memory.cpu_alias(uvm)


def _load_factor(table: Any, options: ProactiveOptions) -> float:
    """The table's cache load factor: its plan's (``CacheParams``, in its fused params) or the sharder's."""
    return float((table.fused_params or {}).get("cache_load_factor", options.cache_load_factor))


def _per_table_budgets(tables: List[Any], options: ProactiveOptions, on_device: bool) -> bool:
    """Whether a group's store gives each table its own share of the slots (``table_budgets``).
    ``auto`` never does on the device planner, which does not partition its cache yet (an
    explicit ``per_table`` there is refused by ``TieredTable(planner="device")``, in one line)."""
    if len(tables) < 2 or options.table_budgets == "shared":
        return False
    if options.table_budgets == "per_table":
        return True
    return not on_device and len({_load_factor(t, options) for t in tables}) > 1


def _num_slots(table: Any, options: ProactiveOptions) -> int:
    return min(options.num_slots_for(table.name, table.local_rows, _load_factor(table, options)), table.local_rows)


def _segments(tables: List[Any]) -> List[Segment]:
    out, start = [], 0
    for t in tables:
        offset = t.local_metadata.shard_offsets[0] if t.local_metadata else 0
        out.append(Segment(t.name, start, t.local_rows, offset, t.num_embeddings))
        start += t.local_rows
    return out


def _group_hot_rows(tables: List[Any], options: ProactiveOptions) -> Optional[torch.Tensor]:
    hot, start = [], 0
    for t in tables:
        offset = t.local_metadata.shard_offsets[0] if t.local_metadata else 0
        rows = options.hot_rows_for(t.name, offset, t.local_rows)
        if rows is not None:
            hot.append(rows + start)
        start += t.local_rows
    return torch.cat(hot) if hot else None


def _group_host_tier(config: GroupedEmbeddingConfig, buffer: torch.Tensor, views: List[torch.Tensor]) -> torch.Tensor:
    """The group's tables as one ``[sum(rows), dim]`` host tier over ``buffer`` (no copy).

    TorchRec groups prefetch-cached tables by dim, and FBGEMM lays a group's host tables out
    back to back in table order; both are checked, since the store relies on them."""
    dims = {int(v.shape[1]) for v in views}
    if len(dims) != 1:
        raise NotImplementedError(
            f"tables {config.table_names()}: one proactive group needs one embedding dim, got {sorted(dims)}"
        )
    dim = dims.pop()
    start = views[0].storage_offset() - buffer.storage_offset()
    expected = views[0].storage_offset()
    for v in views:
        if v.storage_offset() != expected or not v.is_contiguous():
            raise NotImplementedError(f"tables {config.table_names()}: host tables are not laid out back to back")
        expected += v.numel()
    total = sum(int(v.shape[0]) for v in views)
    return buffer[start: start + total * dim].view(total, dim)


def store_rows(ids: np.ndarray, feature_start: np.ndarray, stride: int, per_feature: List[int],
               blocks: bool, sample_major: bool) -> np.ndarray:
    """A group's KJT ids moved into its store's row space: each id plus the first row of its
    feature's table (``feature_start[f]``), as int64.

    ``per_feature`` holds each feature's id count (only read when not ``blocks``);
    ``blocks``: every feature holds ``stride`` ids. ``sample_major`` (needs ``blocks``):
    the id at TorchRec's feature-major position ``f * stride + b`` comes out at
    ``b * F + f``, the transpose and the offset done in one pass.
    """
    num_features = feature_start.shape[0]
    if sample_major:
        rows = np.empty((stride, num_features), dtype=np.int64)
        np.add(ids.reshape(num_features, stride).T, feature_start, out=rows)
        return rows.reshape(-1)
    if not feature_start.any():  # every feature reads a table at the store's row 0
        return ids.astype(np.int64, copy=False)
    if blocks:
        return (ids.reshape(num_features, stride) + feature_start[:, None]).reshape(-1)
    return ids + np.repeat(feature_start, per_feature)


@dataclass(frozen=True)
class _DiskPlace:
    """Where a group on disk keeps its file, and its host cache's bytes."""

    scratch: ScratchDirectory
    host_cache_bytes: int


def _build_store(disk_directory: Optional[Path] = None, host_cache_bytes: int = 0, **kwargs: Any) -> TieredTable:
    """The group's store: in DRAM over the host weight given, or on disk (``TieredTable.on_disk``)."""
    if disk_directory is None:
        return TieredTable(**kwargs)
    host_weight = kwargs.pop("host_weight")
    name = kwargs.pop("name")
    # A group's name joins its tables' names: its file is named after the first (a file name
    # has at most 255 bytes; the group's own directory keeps files apart).
    tables = name.split("+")
    more = f"-and-{len(tables) - 1}-more" if len(tables) > 1 else ""
    return TieredTable.on_disk(name, int(host_weight.shape[0]), int(host_weight.shape[1]),
                               kwargs.pop("optimizer"), kwargs.pop("num_slots"), directory=disk_directory,
                               host_cache_bytes=host_cache_bytes, dtype=host_weight.dtype,
                               file_name=f"{tables[0][:200]}{more}.rows", **kwargs)


def _close_disk(store: TieredTable, scratch: ScratchDirectory) -> None:
    try:
        store.close()
    finally:
        scratch.remove()


def _cpu_placed(config: GroupedEmbeddingConfig) -> GroupedEmbeddingConfig:
    """A copy of ``config`` whose shards are placed on the CPU (``rank:r/cpu``), as stock
    TorchRec hands out ``key_value`` tables' shards: in a CUDA job TorchRec places them on
    ``cuda:r``, but a table on disk hands out CPU tensors (``disk_views.py``) and torch's
    ``Shard`` refuses a tensor off its placement. One deep copy of all the tables, so that
    each table's local metadata stays the very object of its entry in the global metadata
    (TorchRec keys the optimizer's shards by it); the plan's own metadata is untouched."""
    tables = copy.deepcopy(config.embedding_tables)
    for table in tables:
        shards = [table.local_metadata, *(table.global_metadata.shards_metadata if table.global_metadata else [])]
        for shard in shards:
            if shard is not None and shard.placement is not None:
                shard.placement._device = torch.device("cpu")  # (no setter; TorchRec rewrites it the same way)
    return replace(config, embedding_tables=tables)


def _group_dim(config: GroupedEmbeddingConfig) -> int:
    dims = {int(t.local_cols) for t in config.embedding_tables}
    if len(dims) != 1:
        raise NotImplementedError(
            f"tables {config.table_names()}: one proactive group needs one embedding dim, got {sorted(dims)}")
    return dims.pop()

