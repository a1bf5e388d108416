"""The embedding kernel TorchRec's grouped lookup calls for proactive tables.

It stands where TorchRec would put a ``BatchedFusedEmbeddingBag`` (one per group of tables
with the same kernel) and keeps that kernel's contract: ``forward(KJT) -> [B, sum(dims)]``
in feature order, ``state_dict``/``named_parameters`` over the full local shards, a
``fused_optimizer``. Underneath, each table shard is a :class:`TieredTable` whose host tier
*is* the stock kernel's host weight storage (taken over, not copied), so TorchRec's
``ShardedTensor`` views keep pointing at the right bytes after a flush.

The kernel never fetches on its own unless the module is in reactive mode: a batch is made
resident by ``plan_batch`` + the fetch engine, and ``bind`` hands the planned batch to the
next ``forward``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
from torch import nn
from torchrec.distributed.batched_embedding_kernel import BaseBatchedEmbeddingBag, BatchedFusedEmbeddingBag
from torchrec.distributed.composable.table_batched_embedding_slice import TableBatchedEmbeddingSlice
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.modules.embedding_configs import PoolingType
from torchrec.optim.fused import EmptyFusedOptimizer, FusedOptimizer, FusedOptimizerModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ..store import (
    EvictionPolicy,
    InvalidInputError,
    NotPrefetchedError,
    OptimizerConfig,
    TableBatch,
    TieredTable,
    plan_table_batch,
    pooled_lookup,
)
from .options import ProactiveOptions


@dataclass
class PlannedGroup:
    """A batch planned on one kernel: one :class:`TableBatch` per table, in config order."""

    kernel: "ProactiveEmbeddingBag"
    table_batches: List[TableBatch]
    stride: int
    num_values: int
    weights: Optional[torch.Tensor]
    value_ranges: List[Tuple[int, int]]  # each table's slice of the group's values

    @property
    def plans(self) -> list:
        return [tb.plan for tb in self.table_batches]


class ProactiveFusedOptimizer(FusedOptimizer):
    """The kernel's fused optimizer: updates happen in backward, so ``step`` only syncs the
    learning rate from ``param_groups`` (so LR schedulers work) into the tables.

    ``state`` maps each table's weight to its host-tier optimizer state (``momentum1``,
    ``momentum2``, ``step``): the very tensors the tables use, so TorchRec's
    ``CombinedOptimizer`` saves and loads them in place. Reading ``state`` first flushes
    dirty cached rows to the host tier; ``post_load_state_dict`` (TorchRec's hook, called
    after a load) drops the caches so the loaded values are what the next batch sees.
    """

    def __init__(self, kernel: "ProactiveEmbeddingBag") -> None:
        self._kernel = kernel
        params: Dict[str, torch.Tensor] = {}
        state: Dict[Any, Any] = {}
        for key, table in kernel.named_tables():
            params[f"{key}.weight"] = table.host_weight
            st = {f"{key}.{name}": tensor for name, tensor in table.host_state.items()}
            st[f"{key}.step"] = table.steps
            state[table.host_weight] = st
        opt = kernel.optimizer_config
        group = {"params": list(params.values()), "lr": opt.learning_rate, "eps": opt.eps, "optimizer": opt.optim.value}
        super().__init__(params, state, [group])

    @property  # type: ignore[override]
    def state(self) -> Dict[Any, Any]:
        self._kernel.flush()
        return self._state

    @state.setter
    def state(self, value: Dict[Any, Any]) -> None:
        self._state = value

    def step(self, closure: Any = None) -> None:
        self._kernel.set_learning_rate(float(self.param_groups[0]["lr"]))

    def zero_grad(self, set_to_none: bool = False) -> None:
        pass

    def post_load_state_dict(self) -> None:
        super().post_load_state_dict()
        self._kernel.invalidate()


class ProactiveEmbeddingBag(BaseBatchedEmbeddingBag[torch.Tensor], FusedOptimizerModule):
    """Serves one group of pooled tables from tiered stores. Built by :meth:`from_stock`."""

    def __init__(
        self,
        config: GroupedEmbeddingConfig,
        host_weights: List[torch.Tensor],
        host_buffer: torch.Tensor,
        options: ProactiveOptions,
        user_fused_params: Mapping[str, Any],
        pg: Optional[Any] = None,
        device: Optional[torch.device] = None,
        sharding_type: Optional[Any] = None,
    ) -> None:
        super().__init__(config, pg, device, sharding_type)
        self._device = device or torch.device("cpu")
        self._options = options
        self._host_buffer = host_buffer
        self.optimizer_config = OptimizerConfig.from_fused_params(user_fused_params)
        self._mode = "mean" if config.pooling == PoolingType.MEAN else "sum"
        self.tables: List[TieredTable] = []
        self._table_features: List[Tuple[int, int]] = []  # feature range of each table
        first = 0
        for t, (table_cfg, host) in enumerate(zip(config.embedding_tables, host_weights)):
            tfused = dict(table_cfg.fused_params or {})
            load_factor = float(tfused.get("cache_load_factor", options.cache_load_factor))
            num_slots = options.num_slots_for(table_cfg.name, table_cfg.local_rows, load_factor)
            policy = EvictionPolicy.parse(tfused.get("cache_algorithm", options.eviction_policy))
            row_offset = table_cfg.local_metadata.shard_offsets[0] if table_cfg.local_metadata else 0
            self.tables.append(
                TieredTable(
                    name=table_cfg.name,
                    host_weight=host,
                    optimizer=self.optimizer_config,
                    num_slots=num_slots,
                    device=self._device,
                    policy=policy,
                    hot_rows=options.hot_rows_for(table_cfg.name, row_offset, table_cfg.local_rows),
                    row_offset=row_offset,
                    global_rows=table_cfg.num_embeddings,
                )
            )
            n = table_cfg.num_features()
            self._table_features.append((first, first + n))
            first += n
        self._feature_names = config.feature_names()
        self._dims = [t.dim for t in self.tables]
        # Connects our custom autograd function to the graph; never receives a gradient.
        self._anchor = torch.empty(0, device=self._device, requires_grad=True)
        self._bound: Optional[PlannedGroup] = None
        self.prefetch_depth = 0
        self.reactive_engine: Any = None  # set by the sharded module; used only at depth 0
        self._optim = ProactiveFusedOptimizer(self)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_stock(
        cls,
        stock: BatchedFusedEmbeddingBag,
        options: ProactiveOptions,
        user_fused_params: Mapping[str, Any],
        pg: Optional[Any],
        device: Optional[torch.device],
    ) -> "ProactiveEmbeddingBag":
        """Takes over the host weight storage of a stock fused kernel (no copy, same init).

        ``user_fused_params`` are the table's fused params as the user gave them (the stock
        kernel was built with plain SGD, see the sharded module)."""
        views = [w.detach() for w in stock.split_embedding_weights()]
        emb = stock.emb_module
        buffer = emb.weights_host if emb.weights_host.numel() else emb.weights_uvm
        return cls(stock.config, views, buffer, options, user_fused_params, pg, device)

    # ------------------------------------------------------------------ TorchRec contract
    @property
    def emb_module(self) -> "ProactiveEmbeddingBag":  # type: ignore[override]
        # BaseBatchedEmbeddingBag reads split weights through `emb_module`.
        return self

    def split_embedding_weights(self) -> List[torch.Tensor]:  # type: ignore[override]
        return [t.host_weight for t in self.tables]

    @property
    def fused_optimizer(self) -> FusedOptimizer:
        return self._optim

    @property
    def _param_per_table(self) -> Dict[str, TableBatchedEmbeddingSlice]:  # type: ignore[override]
        # One slice per table over the shared host buffer; several column shards of one
        # table on this rank are adjacent in the buffer and share one slice (as in TorchRec).
        spans: Dict[str, Tuple[int, int, int]] = {}
        base = self._host_buffer.storage_offset()
        for cfg, table in zip(self._config.embedding_tables, self.tables):
            start = table.host_weight.storage_offset() - base
            end = start + table.host_weight.numel()
            lo, hi, _ = spans.get(cfg.name, (start, end, table.dim))
            spans[cfg.name] = (min(lo, start), max(hi, end), table.dim)
        out: Dict[str, TableBatchedEmbeddingSlice] = {}
        for name, (start, end, dim) in spans.items():
            sl = TableBatchedEmbeddingSlice(
                data=self._host_buffer, start_offset=start, end_offset=end,
                num_embeddings=-1, embedding_dim=dim,
            )
            sl._in_backward_optimizers = [self._optim]  # type: ignore[attr-defined]
            out[name] = sl
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
        seen: Dict[str, int] = {}
        for cfg, table in zip(self._config.embedding_tables, self.tables):
            n = seen.get(cfg.name, 0)
            seen[cfg.name] = n + 1
            yield (cfg.name if n == 0 else f"{cfg.name}@{n}"), table

    def flush(self) -> None:
        for t in self.tables:
            t.flush()

    def purge(self) -> None:
        self.invalidate()

    def invalidate(self) -> None:
        for t in self.tables:
            t.invalidate()

    def set_learning_rate(self, lr: float) -> None:
        if lr != self.optimizer_config.learning_rate:
            self.optimizer_config = replace(self.optimizer_config, learning_rate=lr)
            for t in self.tables:
                t.optimizer = self.optimizer_config

    # ------------------------------------------------------------------ data path
    def plan_batch(self, features: KeyedJaggedTensor) -> PlannedGroup:
        """Plans (and pins) every table's rows for ``features``; issues nothing."""
        if features.variable_stride_per_key():
            raise InvalidInputError(
                f"tables {[t.name for t in self.tables]}: variable batch size per feature is not supported"
            )
        stride = features.stride()
        offsets = features.offsets()
        values = features.values()
        weights = features.weights_or_none()
        batches: List[TableBatch] = []
        ranges: List[Tuple[int, int]] = []
        try:
            for table, (f0, f1) in zip(self.tables, self._table_features):
                lo, hi = int(offsets[f0 * stride]), int(offsets[f1 * stride])
                ranges.append((lo, hi))
                tab_offsets = offsets[f0 * stride: f1 * stride + 1] - lo
                batches.append(
                    plan_table_batch(table, values[lo:hi], tab_offsets, self._mode, self.prefetch_depth or None)
                )
        except Exception:
            # Nothing planned so far may stay pinned or half-mapped: move the data of what
            # was planned (keeps row_to_slot truthful) and unpin it, then re-raise.
            for tb in batches:
                tb.table.abandon(tb.plan)
            raise
        return PlannedGroup(self, batches, stride, int(values.numel()), weights, ranges)

    def bind(self, planned: PlannedGroup) -> None:
        """Hands a planned (and transferred) batch to the next ``forward``."""
        self._bound = planned

    def unbind(self) -> None:
        """Forgets a bound batch that will not be looked up (its plans are released elsewhere)."""
        self._bound = None

    def forward(self, features: KeyedJaggedTensor, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        planned, self._bound = self._bound, None
        if planned is None:
            if self.prefetch_depth != 0 or self.reactive_engine is None:
                raise NotPrefetchedError(
                    f"tables {[t.name for t in self.tables]}: lookup of a batch that was not prefetched "
                    f"(prefetch_depth={self.prefetch_depth}); run batches through ProactiveTrainPipeline "
                    f"or use prefetch_depth=0 (reactive)"
                )
            planned = self.plan_batch(features)
            self.reactive_engine.wait(self.reactive_engine.issue(planned.plans, tag="reactive"))
        if features.stride() != planned.stride or features.values().numel() != planned.num_values:
            for tb in planned.table_batches:
                tb.table.release(tb.plan)
            raise NotPrefetchedError(
                f"tables {[t.name for t in self.tables]}: the prefetched batch (stride {planned.stride}, "
                f"{planned.num_values} ids) is not the batch being looked up (stride {features.stride()}, "
                f"{features.values().numel()} ids)"
            )
        outputs = []
        weights = planned.weights
        stride = planned.stride
        for tb, (f0, f1), (lo, hi) in zip(planned.table_batches, self._table_features, planned.value_ranges):
            psw = None if weights is None else weights[lo:hi]
            pooled = pooled_lookup(tb, self._anchor, psw)  # [(f1 - f0) * B, dim]
            n_feat = f1 - f0
            # TorchRec's layout is [B, sum(dims)] with features side by side.
            outputs.append(pooled.view(n_feat, stride, -1).transpose(0, 1).reshape(stride, -1))
        if len(outputs) == 1:
            return outputs[0]
        return torch.cat(outputs, dim=1)

    def check_invariants(self, expect_drained: bool = False) -> None:
        for t in self.tables:
            t.check_invariants(expect_drained)
