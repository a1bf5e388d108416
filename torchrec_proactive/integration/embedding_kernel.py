"""The embedding kernel TorchRec's grouped lookup calls for proactive tables.

It stands where TorchRec would put a ``BatchedFusedEmbeddingBag`` (one per group of tables
with the same kernel) and keeps that kernel's contract: ``forward(KJT) -> [B, sum(dims)]``
in feature order, ``state_dict``/``named_parameters`` over the full local shards, a
``fused_optimizer``. Underneath, each table shard is a :class:`TieredTable` whose host tier
*is* the stock kernel's host weight storage (taken over, not copied), so TorchRec's
``ShardedTensor`` views keep pointing at the right bytes after a flush.

A batch is made resident by ``plan_batch`` + the fetch engine, and ``bind`` hands the
planned batch to the next ``forward``. A forward that nothing was bound for (a plain
``model(batch)``, an eval loop, depth 0) plans and fetches at lookup time, as stock TorchRec
does. Every data move, including flushes, goes through the module's one fetch engine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
from torch import nn
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from torchrec.distributed.batched_embedding_kernel import (
    BaseBatchedEmbeddingBag,
    BatchedFusedEmbeddingBag,
    EmbeddingFusedOptimizer,
)
from torchrec.distributed.composable.table_batched_embedding_slice import TableBatchedEmbeddingSlice
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.optim.fused import EmptyFusedOptimizer, FusedOptimizer, FusedOptimizerModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ..fetch import FetchEngine
from ..store import (
    EvictionPolicy,
    InvalidInputError,
    NotPrefetchedError,
    OptimizerConfig,
    OptimType,
    TableBatch,
    TieredTable,
    plan_table_batch,
    pooled_lookup_group,
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
            kernel.config, kernel, pg,  # type: ignore[arg-type]
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
    """Serves one group of pooled tables from tiered stores. Built by :meth:`from_stock`."""

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
    ) -> None:
        super().__init__(config, pg, device, sharding_type)
        if pooling_mode is not None:
            self._pooling = pooling_mode
        self._device = device or torch.device("cpu")
        self._options = options
        self._host_buffer = host_buffer
        self._engine = engine
        self.optimizer_config = OptimizerConfig.from_fused_params(user_fused_params)
        # TorchRec's choice for this sharding type: row-wise shardings pool mean as a sum
        # here and divide after the output all-to-all, when all of a bag's rows are summed.
        self._mode = "mean" if self._pooling == PoolingMode.MEAN else "sum"
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
        self._optim = ProactiveFusedOptimizer(self, pg)

    # ------------------------------------------------------------------ construction
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
        """Takes over the host weight storage of a stock fused kernel (no copy, same init).

        ``user_fused_params`` are the group's fused params as the user gave them (the stock
        kernel was built with plain SGD, see the sharded module)."""
        views = [w.detach() for w in stock.split_embedding_weights()]
        emb = stock.emb_module
        buffer = emb.weights_host if emb.weights_host.numel() else emb.weights_uvm
        return cls(stock.config, views, buffer, options, user_fused_params, engine, pg, device,
                   pooling_mode=stock._pooling)  # noqa: SLF001 - as TorchRec chose it for this sharding

    # ------------------------------------------------------------------ TorchRec contract
    @property
    def emb_module(self) -> "ProactiveEmbeddingBag":  # type: ignore[override]
        # BaseBatchedEmbeddingBag reads split weights through `emb_module`.
        return self

    def split_embedding_weights(self) -> List[torch.Tensor]:  # type: ignore[override]
        return [t.host_weight for t in self.tables]

    def get_optimizer_state(self) -> List[Dict[str, torch.Tensor]]:
        """Per table, the host-tier optimizer state under FBGEMM's names (``sum``, ``exp_avg`` ...)."""
        names = _FBGEMM_STATE_NAMES[self.optimizer_config.optim]
        return [{fbgemm: t.host_state[ours] for fbgemm, ours in names} for t in self.tables]

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
        for t in self.tables:
            t.optimizer = self.optimizer_config

    def set_optimizer_step(self, step: int) -> None:
        """Sets the optimizer step of every table (Adam's bias correction), as FBGEMM does."""
        for t in self.tables:
            t.step = int(step)

    def table_names(self) -> List[str]:
        return [t.name for t in self.tables]

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
        """Writes dirty cached rows back to the host tier, behind every queued fetch."""
        self._engine.flush(self.tables)

    def purge(self) -> None:
        """TorchRec calls this before a load: no trained row may be dropped, so flush first."""
        self.flush()
        self.invalidate()

    def invalidate(self) -> None:
        """Drops the cached rows (after the host tier was loaded); needs no batch in flight."""
        self._engine.drain()
        for t in self.tables:
            t.invalidate()

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
            # Nothing planned so far may stay pinned or half-mapped: the planned tables'
            # moves still run, in their turn on the engine (keeps row_to_slot truthful and
            # queued write-backs ahead of them), then their pins are released.
            self.abandon(batches)
            raise
        return PlannedGroup(self, batches, stride, int(values.numel()), weights, ranges)

    def abandon(self, batches: List[TableBatch]) -> None:
        """Gives up planned batches whose fetch was never issued and that will never be
        looked up: their moves still run, in their turn, then they are unpinned."""
        try:
            if batches:
                self._engine.run([tb.plan for tb in batches], tag="abandon")
        finally:
            for tb in batches:
                tb.table.release(tb.plan)

    def bind(self, planned: PlannedGroup) -> None:
        """Hands a planned (and transferred) batch to the next ``forward``."""
        self._bound = planned

    def unbind(self) -> None:
        """Forgets a bound batch that will not be looked up (its plans are released elsewhere)."""
        self._bound = None

    def forward(self, features: KeyedJaggedTensor, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        planned, self._bound = self._bound, None
        if planned is None:
            # Nothing prefetched this batch (plain forward, eval loop, depth 0): fetch now,
            # on the critical path, in its turn behind any queued ticket.
            planned = self.plan_batch(features)
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
        weights = planned.weights
        psw = [None if weights is None else weights[lo:hi] for lo, hi in planned.value_ranges]
        # Only a training forward may update the rows: in eval mode the lookup is read-only
        # and releases its pins at once, with or without torch.no_grad().
        pooled = pooled_lookup_group(planned.table_batches, self._anchor, psw, train=self.training)
        stride = planned.stride
        outputs = []
        for out, (f0, f1) in zip(pooled, self._table_features):
            # TorchRec's layout is [B, sum(dims)] with features side by side.
            outputs.append(out.view(f1 - f0, stride, -1).transpose(0, 1).reshape(stride, -1))
        if len(outputs) == 1:
            return outputs[0]
        return torch.cat(outputs, dim=1)

    @staticmethod
    def _release(planned: PlannedGroup) -> None:
        for tb in planned.table_batches:
            tb.table.release(tb.plan)

    def check_invariants(self, expect_drained: bool = False) -> None:
        for t in self.tables:
            t.check_invariants(expect_drained)
