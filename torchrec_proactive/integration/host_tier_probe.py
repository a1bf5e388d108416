"""What the TorchRec path allocates on the host for a group's tier, counted on any machine.

``ProactiveEmbeddingBag.from_stock`` takes over the rows a stock FBGEMM kernel holds in
host-mapped memory (``uvm_host_mapped``) and adds the optimizer state. On a GPU a copy of
the rows, or pinned memory rounded up to a power of two, would cost tens of GB (issue 44,
item 1). Here the stock kernel's buffer is a fake CUDA tensor of modelled host-mapped
memory (``store.host_memory.fake_host_mapped``: FBGEMM's ``uvm_to_cpu`` refuses it, as on a
GPU), the kernel is built on fake CUDA tensors by the real ``from_stock``, and
``store.host_memory.HostBytes`` counts every host byte it allocates.

``host_tier_bytes_ratio`` = (the rows FBGEMM holds + the host bytes ``from_stock``
allocates) / (rows + optimizer state at their exact size): 1.0 when each is held once.
Used by ``tests/test_device_host_tier.py`` and ``benchmarks/gpu_check.py``.

The shards' placement is TorchRec's on a GPU, ``rank:0/cuda:0``: the kernel hands TorchRec
CUDA views of its host tier (the same bytes; ``Shard`` refuses a CPU tensor for a ``cuda``
placement, see ``tests/test_device_shard_placement.py``), built by ``from_stock`` with the
rest, so a copy made for them would be counted here.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Dict, Sequence, Tuple
from unittest import mock

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from ..store.host_memory import HostBytes, fake_host_mapped
from ..store.optimizers import OptimizerConfig


def _single_rank_group() -> Any:
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    return dist.group.WORLD


def _grouped_config(tables: Sequence[Tuple[str, int]], dim: int) -> Any:
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
    from torchrec.distributed.embedding_types import (
        EmbeddingComputeKernel,
        GroupedEmbeddingConfig,
        ShardedEmbeddingTable,
    )
    from torchrec.modules.embedding_configs import DataType, PoolingType

    configs = []
    for name, rows in tables:
        shard = ShardMetadata(shard_offsets=[0, 0], shard_sizes=[rows, dim], placement="rank:0/cuda:0")  # (TorchRec's on a GPU)
        meta = ShardedTensorMetadata(shards_metadata=[shard], size=torch.Size([rows, dim]),
                                     tensor_properties=TensorProperties())
        configs.append(ShardedEmbeddingTable(
            num_embeddings=rows, embedding_dim=dim, name=name, feature_names=[f"f_{name}"], local_rows=rows,
            local_cols=dim, pooling=PoolingType.SUM, compute_kernel=EmbeddingComputeKernel.FUSED_UVM,
            local_metadata=shard, global_metadata=meta))
    return GroupedEmbeddingConfig(data_type=DataType.FP32, pooling=PoolingType.SUM, is_weighted=False,
                                  has_feature_processor=False, compute_kernel=EmbeddingComputeKernel.FUSED_UVM,
                                  embedding_tables=configs)


def from_stock_host_bytes(optimizer: str = "adam", tables: Sequence[Tuple[str, int]] = (("a", 30_000), ("b", 10_000)),
                          dim: int = 64) -> Dict[str, Any]:
    """Builds a group's kernel with ``from_stock`` from a stock kernel whose rows are in
    (modelled) host-mapped memory, on fake CUDA tensors, and counts the host bytes.

    Returns ``host_tier_bytes_ratio``, the bytes behind it, and ``host_on_device`` (whether
    the store's moves address the host tier in place, as on a GPU they would)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode

    from ..fetch import FetchEngine
    from .embedding_kernel import ProactiveEmbeddingBag
    from .options import ProactiveOptions

    config = _grouped_config(tables, dim)
    rows = sum(r for _, r in tables)
    state_width = sum(max(1, int(torch.Size(s).numel())) for s in
                      OptimizerConfig.from_fused_params({"optimizer": optimizer}).state_shapes(dim).values())
    table_bytes, state_bytes = rows * dim * 4, rows * state_width * 4
    pg = _single_rank_group()
    counter = HostBytes()
    with FakeTensorMode(allow_non_fake_inputs=True), fake_host_mapped(counter) as mapped:
        device = torch.device("cuda")
        # The stock kernel's rows, allocated by FBGEMM before from_stock (not counted there).
        uvm = mapped.new(torch.empty(0, device=device), [rows * dim], count=False)
        views, start = [], 0
        for _, r in tables:
            views.append(uvm.narrow(0, start * dim, r * dim).view(r, dim))
            start += r
        stock = SimpleNamespace(
            config=config, _pooling=PoolingMode.SUM, split_embedding_weights=lambda: views,
            emb_module=SimpleNamespace(weights_host=torch.empty(0), weights_uvm=uvm))
        options = ProactiveOptions(planner="device", num_slots={name: max(1, r // 10) for name, r in tables})
        # (TorchRec's fused optimizer flushes the empty cache when it is built, through the
        # CPU transport, which reads sizes a fake tensor does not have: nothing to flush yet.)
        # CUDA counts as available, as on the GPU this models (what pins, what maps).
        with mock.patch.object(ProactiveEmbeddingBag, "flush", lambda self: None), \
                mock.patch.object(torch.cuda, "is_available", lambda: True), counter:
            kernel = ProactiveEmbeddingBag.from_stock(stock, options, {"optimizer": optimizer, "learning_rate": 0.1},
                                                      FetchEngine(), pg=pg, device=device)
        host_on_device = kernel.store.host_on_device is not None
    held = table_bytes + counter.total
    return {"host_tier_bytes_ratio": held / (table_bytes + state_bytes), "table_bytes": table_bytes,
            "state_bytes": state_bytes, "allocated_cpu": counter.cpu, "allocated_pinned": counter.pinned,
            "allocated_host_mapped": counter.mapped, "host_on_device": host_on_device, "optimizer": optimizer,
            "rows": rows, "dim": dim,
            "how": "from_stock on fake CUDA tensors, FBGEMM's host-mapped rows modelled (uvm_to_cpu refuses them)"}
