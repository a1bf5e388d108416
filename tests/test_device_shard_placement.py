"""What the TorchRec kernel hands TorchRec on CUDA is on the placement's device (issue 44,
"GPU path v3").

On a GPU TorchRec places a ``fused_uvm_caching`` shard on ``rank:r/cuda:r`` (``sharding_plan.
placement``), and every ``ShardedTensor`` it builds over the kernel's tensors checks that
each local shard's tensor is on its placement's device (``Shard.__post_init__``): the
fused optimizer's weights and state (``EmbeddingFusedOptimizer.__init__``, when the kernel is
built), ``state_dict()`` (``embedding_kernel.get_state_dict``, also called by the sharded
module's ``_initialize_torch_state``) and so DCP. Stock FBGEMM hands ``cuda:r`` tensors (its
host-mapped UVM rows are CUDA tensors). The kernel used to hand CPU aliases of the same
bytes, which fails the check at the first one: building the kernel.

Run here on fake CUDA tensors through the real ``from_stock``, FBGEMM's host-mapped rows
modelled (``store.host_memory.fake_host_mapped``), with TorchRec's GPU placement
``rank:0/cuda:0``. The tensors handed out must also be the one host allocation (the rows
FBGEMM holds, the state allocated host-mapped once), not a copy.
"""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig

from torchrec_proactive.fetch import FetchEngine
from torchrec_proactive.integration.embedding_kernel import ProactiveEmbeddingBag
from torchrec_proactive.integration.host_tier_probe import _grouped_config
from torchrec_proactive.integration.options import ProactiveOptions
from torchrec_proactive.store.host_memory import HostBytes, fake_host_mapped

from .device_kernel_fixture import single_rank_group

TABLES = (("a", 300), ("b", 100))
DIM = 8


def _config() -> GroupedEmbeddingConfig:
    return _grouped_config(TABLES, DIM)  # (placed as TorchRec places a shard on a GPU: rank:0/cuda:0)


@pytest.mark.parametrize("optimizer", ["adam", "exact_row_wise_adagrad"])
def test_from_stock_on_cuda_hands_torchrec_cuda_tensors_over_the_one_host_allocation(optimizer):
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode

    config = _config()
    rows = sum(r for _, r in TABLES)
    pg = single_rank_group()
    counter = HostBytes()
    with FakeTensorMode(allow_non_fake_inputs=True), fake_host_mapped(counter) as mapped, \
            mock.patch.object(ProactiveEmbeddingBag, "flush", lambda self: None):
        # (flush: the CPU transport reads sizes a fake tensor does not have; nothing is cached)
        # The stock kernel's rows: FBGEMM's host-mapped UVM, a cuda tensor (weights_uvm).
        uvm = mapped.new(torch.empty(0, device="cuda"), [rows * DIM], count=False)
        views, start = [], 0
        for _, r in TABLES:
            views.append(uvm.narrow(0, start * DIM, r * DIM).view(r, DIM))
            start += r
        stock = SimpleNamespace(config=config, _pooling=PoolingMode.SUM, split_embedding_weights=lambda: views,
                                emb_module=SimpleNamespace(weights_host=torch.empty(0), weights_uvm=uvm))
        options = ProactiveOptions(planner="device", num_slots={name: 10 for name, _ in TABLES})
        # Building the kernel builds TorchRec's fused optimizer (a ShardedTensor per table
        # over split_embedding_weights and the state): on main, ValueError "Local shard
        # tensor device does not match with local Shard's placement ... cpu ... cuda:0".
        with mock.patch.object(torch.cuda, "is_available", lambda: True), counter:
            kernel = ProactiveEmbeddingBag.from_stock(stock, options, {"optimizer": optimizer, "learning_rate": 0.1},
                                                      FetchEngine(), pg=pg, device=torch.device("cuda"))
        cuda0 = torch.device("cuda:0")
        handing = HostBytes()
        with handing:
            weights, states = kernel.split_embedding_weights(), kernel.get_optimizer_state()
        assert handing.total == 0  # (views: no host memory)

        # The weights TorchRec is handed: on cuda:0, over FBGEMM's one allocation of rows.
        assert [w.device for w in weights] == [cuda0, cuda0]
        assert [tuple(w.shape) for w in weights] == [(r, DIM) for _, r in TABLES]
        assert all(mapped._base_of(w)[0] is uvm for w in weights)
        assert [w.storage_offset() for w in weights] == [v.storage_offset() for v in views]
        for w, t in zip(weights, config.embedding_tables):
            Shard(w, t.local_metadata)  # TorchRec's check (Shard.__post_init__)

        # The optimizer state: on cuda:0, over the host-mapped state the store holds (one
        # allocation per state, the one its moves address).
        store_state = kernel.store.host_on_device[1:]
        assert len(store_state) == len(kernel.store.host_state) >= 1
        backings = [mapped.pointer(t) for t in store_state]
        assert None not in backings and len(set(backings)) == len(backings)  # one allocation per state
        start = 0
        for per_table, (_, r) in zip(states, TABLES):
            assert len(per_table) == len(store_state)
            for s, backing in zip(per_table.values(), backings):
                assert s.device == cuda0 and s.shape[0] == r
                assert mapped.pointer(s) == backing  # the bytes the store's host tier holds
                assert s.storage_offset() == start * (s.numel() // r)
            start += r

        # What TorchRec builds over them: the kernel's state_dict (get_state_dict, also what
        # the sharded module's _initialize_torch_state collects) and the fused optimizer's.
        sd = kernel.state_dict()
        assert sorted(sd) == ["a.weight", "b.weight"]
        for key, st in sd.items():
            assert isinstance(st, ShardedTensor)
            assert [s.tensor.device for s in st.local_shards()] == [cuda0]
        optim_sd = kernel.fused_optimizer.state_dict()["state"]
        tensors = [v for per in optim_sd.values() for v in per.values() if isinstance(v, ShardedTensor)]
        assert tensors and all(s.tensor.device == cuda0 for v in tensors for s in v.local_shards())

    # The host tier is held once: the rows are FBGEMM's, each state one exact-size
    # host-mapped allocation, nothing pinned.
    assert counter.mapped == rows * sum(
        max(1, int(torch.Size(s).numel())) for s in kernel.optimizer_config.state_shapes(DIM).values()) * 4
    assert counter.pinned == 0 and counter.cpu < rows * DIM * 4 // 10


def test_without_a_cuda_view_of_the_host_tier_a_cuda_placement_is_refused_in_one_line():
    """Where the rows could only be copied (no CPU alias of FBGEMM's buffer), no CUDA tensor
    over the host tier exists: the kernel says so, naming the tables and the placement,
    instead of TorchRec's shard check failing inside its fused optimizer."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode

    from torchrec_proactive.store import host_memory

    config = _config()
    rows = sum(r for _, r in TABLES)
    with FakeTensorMode(allow_non_fake_inputs=True), fake_host_mapped() as mapped, \
            mock.patch.object(ProactiveEmbeddingBag, "flush", lambda self: None), \
            mock.patch.object(host_memory, "cpu_alias", lambda t: None), \
            mock.patch.object(torch.cuda, "is_available", lambda: True):
        uvm = mapped.new(torch.empty(0, device="cuda"), [rows * DIM], count=False)
        views = [uvm.narrow(0, 0, 300 * DIM).view(300, DIM), uvm.narrow(0, 300 * DIM, 100 * DIM).view(100, DIM)]
        stock = SimpleNamespace(config=config, _pooling=PoolingMode.SUM, split_embedding_weights=lambda: views,
                                emb_module=SimpleNamespace(weights_host=torch.empty(0), weights_uvm=uvm))
        options = ProactiveOptions(planner="device", num_slots={name: 10 for name, _ in TABLES})
        with pytest.warns(UserWarning, match="a copy"), \
                pytest.raises(NotImplementedError, match=r"tables \['a', 'b'\]: TorchRec places their shards on "
                                                         r"\['cuda:0'\].*no CUDA view of their host tier"):
            ProactiveEmbeddingBag.from_stock(stock, options, {"optimizer": "adam", "learning_rate": 0.1},
                                             FetchEngine(), pg=single_rank_group(), device=torch.device("cuda"))
