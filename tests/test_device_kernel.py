"""The TorchRec kernel on the device planner, through its own path (``prepare_batch`` ->
``plan_prepared`` -> ``forward``): checks that the input dist's host validator cannot make
for ids on a GPU."""

from __future__ import annotations

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_proactive.integration.embedding_kernel import device_store_rows
from torchrec_proactive.store import IdOutOfRangeError

from .device_kernel_fixture import device_kernel


def _kjt(a_ids, b_ids):
    values = torch.tensor(list(a_ids) + list(b_ids))
    return KeyedJaggedTensor.from_lengths_sync(["f_a", "f_b"], values, torch.ones(len(values), dtype=torch.int64))


def test_an_id_past_its_own_table_is_counted_on_the_device_and_trains_no_other_table():
    """Stores [0,100) = A, [100,300) = B: id 150 of A lies inside the group's row space (it
    is B's row 50), so only a per-table check catches it."""
    kernel = device_kernel([("a", 100), ("b", 200)])
    before = kernel.store.host_weight.clone()
    planned = kernel.plan_batch(_kjt([150, 3], [5, 199]))
    assert int(kernel.store.planner.bad_ids.value) == 1  # counted on the device, no host read
    rows = planned.batch.plan.rows[: 4]
    assert 250 not in rows.tolist()  # B's row 50 is not among the planned rows
    kernel._engine.run(planned.plans)  # noqa: SLF001
    kernel.bind(planned)
    out = kernel(_kjt([150, 3], [5, 199]))
    out.sum().backward()
    kernel.flush()
    assert torch.equal(kernel.store.host_weight[250], before[250])  # B's row 50 untrained
    # Reported at the next batch, as the other device-side checks are.
    with pytest.raises(IdOutOfRangeError, match=r"1 id\(s\)"):
        kernel.plan_batch(_kjt([1], [2]))


@pytest.mark.parametrize("a_id,b_id", [(-1, 0), (99, 200), (100, 5)])
def test_per_table_bounds_on_the_device_mapping(a_id, b_id):
    import numpy as np

    values = torch.tensor([a_id, 7, b_id, 0])
    offsets = torch.tensor([0, 1, 2, 3, 4])
    start = np.array([0, 100], dtype=np.int64)
    rows = device_store_rows(values, offsets, 2, start, torch.from_numpy(start), torch.tensor([100, 200]))
    expected = [a_id if 0 <= a_id < 100 else -1, 7, b_id + 100 if 0 <= b_id < 200 else -1, 100]
    assert rows.tolist() == expected


def test_per_table_bounds_need_no_host_read():
    import numpy as np

    from torchrec_proactive.store.sync_detector import fake_cuda

    start = np.array([0, 100], dtype=np.int64)
    with fake_cuda():
        rows = device_store_rows(torch.randint(0, 300, (60,), device="cuda"), torch.arange(0, 61, 2, device="cuda"),
                                 30, start, torch.zeros(2, dtype=torch.int64, device="cuda"),
                                 torch.zeros(2, dtype=torch.int64, device="cuda"))
        assert rows.device.type == "cuda" and rows.shape == (60,)


def test_a_copy_of_the_host_tier_is_said_once_and_held_at_its_exact_size():
    """Where no CPU alias of FBGEMM's host-mapped rows can be made the host tier is a copy:
    not silent, and not pinned (the caching host allocator would round it up to a power of
    two)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torchrec_proactive.integration import embedding_kernel
    from torchrec_proactive.store.host_memory import HostBytes

    rows = torch.randn(64, 8)
    counter = HostBytes()
    with pytest.warns(UserWarning, match=r"tables \['a'\]: no CPU alias of FBGEMM's host-mapped rows.*a copy"):
        with FakeTensorMode(allow_non_fake_inputs=True), counter:
            embedding_kernel._pinned_copy(rows, ["a"])
    assert counter.pinned == 0 and counter.cpu == rows.numel() * 4
    host = embedding_kernel._pinned_copy(rows, ["a"])
    assert torch.equal(host, rows)


def test_an_lfu_cache_plan_shards_and_plans_lfu():
    """CacheParams(algorithm=LFU) with the prefetch_pipeline flag the sharder sets: FBGEMM's
    TBE asserts "Only LRU cache policy supports prefetch_pipeline" if the stock kernel it
    builds for the group is given the policy; the store is the one that caches."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import CacheParams, ShardingEnv
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from torchrec_proactive.integration.sharder import ProactiveEmbeddingBagCollectionSharder
    from torchrec_proactive.store import EvictionPolicy

    from .device_kernel_fixture import single_rank_group

    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=100,
                                                            feature_names=["f"])], device=torch.device("cpu"))
    sharder = ProactiveEmbeddingBagCollectionSharder(fused_params={"optimizer": "exact_sgd", "learning_rate": 0.1})
    plan = construct_module_sharding_plan(
        ebc, per_param_sharding={"t": table_wise(rank=0, compute_kernel="fused_uvm_caching")}, sharder=sharder,
        local_size=1, world_size=1, device_type="cpu")
    plan["t"].cache_params = CacheParams(algorithm=CacheAlgorithm.LFU, load_factor=0.5)
    sharded = sharder.shard(ebc, plan, ShardingEnv.from_process_group(single_rank_group()), torch.device("cpu"))
    assert [k.store.policy for k in sharded._proactive_kernels] == [EvictionPolicy.LFU]
