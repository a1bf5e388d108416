"""A ``ProactiveEmbeddingBag`` built directly, without a sharded module: one group of
pooled tables on one (gloo, single-rank) process group, for tests of the kernel's own path
(``prepare_batch`` -> ``plan_prepared`` -> ``forward``) on the device planner."""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, GroupedEmbeddingConfig, ShardedEmbeddingTable
from torchrec.modules.embedding_configs import DataType, PoolingType

from torchrec_proactive.fetch import FetchEngine
from torchrec_proactive.integration.embedding_kernel import ProactiveEmbeddingBag
from torchrec_proactive.integration.options import ProactiveOptions


def single_rank_group() -> dist.ProcessGroup:
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    return dist.group.WORLD


def grouped_config(tables: Sequence[Tuple[str, int]], dim: int,
                   fused_params: Optional[Sequence[Optional[Dict[str, Any]]]] = None) -> GroupedEmbeddingConfig:
    """TorchRec's group config of ``(name, rows)`` tables (one feature each, ``f_<name>``),
    whole on rank 0, planned ``fused_uvm_caching``; ``fused_params`` per table (e.g. the
    ``cache_load_factor`` a plan's ``CacheParams`` give it)."""
    configs = []
    for i, (name, rows) in enumerate(tables):
        shard = ShardMetadata(shard_offsets=[0, 0], shard_sizes=[rows, dim], placement="rank:0/cpu")
        meta = ShardedTensorMetadata(shards_metadata=[shard], size=torch.Size([rows, dim]),
                                     tensor_properties=TensorProperties())
        configs.append(ShardedEmbeddingTable(
            num_embeddings=rows, embedding_dim=dim, name=name, feature_names=[f"f_{name}"], local_rows=rows,
            local_cols=dim, pooling=PoolingType.SUM, compute_kernel=EmbeddingComputeKernel.FUSED_UVM_CACHING,
            local_metadata=shard, global_metadata=meta, fused_params=(fused_params or [None] * len(tables))[i]))
    return GroupedEmbeddingConfig(data_type=DataType.FP32, pooling=PoolingType.SUM, is_weighted=False,
                                  has_feature_processor=False,
                                  compute_kernel=EmbeddingComputeKernel.FUSED_UVM_CACHING, embedding_tables=configs)


def device_kernel(tables: Sequence[Tuple[str, int]], dim: int = 8, slots: int = 50, device: str = "cpu",
                  optimizer: str = "exact_sgd", host: torch.Tensor = None) -> ProactiveEmbeddingBag:
    """One group of ``(name, rows)`` tables (one feature each, ``f_<name>``) planned on the
    device planner, ``slots`` cache slots per table."""
    config = grouped_config(tables, dim)
    total = sum(rows for _, rows in tables)
    buffer = host.reshape(-1) if host is not None else torch.randn(total * dim, generator=torch.Generator().manual_seed(0))
    views, start = [], 0
    for _, rows in tables:
        views.append(buffer[start * dim: (start + rows) * dim].view(rows, dim))
        start += rows
    options = ProactiveOptions(planner="device", num_slots={name: slots for name, _ in tables})
    build = lambda: ProactiveEmbeddingBag(config, views, buffer, options,  # noqa: E731
                                          {"optimizer": optimizer, "learning_rate": 0.1}, FetchEngine(),
                                          pg=single_rank_group(), device=torch.device(device))
    if torch.device(device).type == "cpu":
        return build()
    # On fake CUDA tensors (sync_detector.fake_cuda): TorchRec's fused optimizer flushes the
    # (still empty) cache when it is built, through the CPU transport, which reads the
    # plan's sizes - values a fake tensor does not have. Nothing is cached yet, so the
    # flush is skipped while building; every step after it runs the kernel's own code.
    with mock.patch.object(ProactiveEmbeddingBag, "flush", lambda self: None):
        return build()
