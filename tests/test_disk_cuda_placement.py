"""A group on disk in a CUDA job: TorchRec places its shards on ``rank:r/cuda:r`` and torch's
``Shard`` refuses a local tensor on another device, but the rows of a table on disk are
never on the GPU - what TorchRec is handed for them (``disk_views.DiskRowsView``) is a CPU
tensor on any device. As stock TorchRec does for ``key_value`` tables (its
``KeyValueEmbeddingBag`` and ``KeyValueEmbeddingFusedOptimizer`` hand out shards placed on
the CPU), the kernel hands TorchRec CPU-placed copies of the shards' metadata.

Nothing of ours reads a disk group's placement, and its handed-out tensors are CPU tensors
whatever the cache's device, so building the kernel on this CPU machine from a config
placed as TorchRec places it on a GPU runs TorchRec's own ``Shard`` checks against exactly
the tensors a CUDA job would hand it."""

from __future__ import annotations

import pytest
import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor

from torchrec_proactive.fetch import FetchEngine
from torchrec_proactive.integration.disk_tier import DiskTierSpec
from torchrec_proactive.integration.embedding_kernel import ProactiveEmbeddingBag
from torchrec_proactive.integration.host_tier_probe import _grouped_config
from torchrec_proactive.integration.options import ProactiveOptions

from .device_kernel_fixture import single_rank_group


@pytest.mark.parametrize("optimizer, states", [("exact_row_wise_adagrad", {"momentum1"}),
                                               ("adam", {"momentum1", "exp_avg_sq"})])
def test_a_group_on_disk_placed_on_a_gpu_hands_torchrec_cpu_placed_shards(tmp_path, optimizer, states):
    config = _grouped_config((("a", 300), ("b", 100)), 8)  # shards on rank:0/cuda:0, as TorchRec plans them on a GPU
    options = ProactiveOptions(planner="auto", num_slots={"a": 10, "b": 10},
                               disk={n: DiskTierSpec(str(tmp_path), 1 << 16, None) for n in ("a", "b")})
    kernel = ProactiveEmbeddingBag.on_disk(config, options, {"optimizer": optimizer, "learning_rate": 0.1},
                                           FetchEngine(), pg=single_rank_group(), device=torch.device("cpu"))
    try:
        assert kernel.store.planner.__class__.__name__ == "HostPlanner"  # a group on disk plans on the host
        weights = kernel.state_dict()
        assert sorted(weights) == ["a.weight", "b.weight"]
        for value in weights.values():
            assert isinstance(value, ShardedTensor)
            assert [str(s.metadata.placement) for s in value.local_shards()] == ["rank:0/cpu"]
        optim = kernel.fused_optimizer.state_dict()["state"]
        handed = {name: t for per in optim.values() for name, t in per.items() if isinstance(t, ShardedTensor)}
        assert {name.split(".")[-1] for name in handed} == states, sorted(handed)
        assert all(str(t.local_shards()[0].metadata.placement) == "rank:0/cpu" for t in handed.values())
        # The values are the table's: a read through the handed-out shard reads the file.
        assert torch.equal(weights["b.weight"].local_shards()[0].tensor.clone(), torch.zeros(100, 8))
    finally:
        kernel.close()
    # The plan itself is not changed (TorchRec's sharding and other ranks read it).
    assert all(str(t.local_metadata.placement) == "rank:0/cuda:0" for t in config.embedding_tables)
    assert all(str(t.global_metadata.shards_metadata[0].placement) == "rank:0/cuda:0" for t in config.embedding_tables)


def test_the_sharder_serves_key_value_tables_on_a_cuda_topology():
    """TorchRec's planner on a GPU topology plans ``key_value`` (stock's SSD TBE, which
    FBGEMM's published wheels lack); the proactive sharder takes those tables into its disk
    tier on CUDA ranks as on CPU ones, each with its directory and host cache."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import CacheParams, KeyValueParams

    from torchrec_proactive import ProactiveEmbeddingBagCollectionSharder

    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=16, num_embeddings=50_000, feature_names=[f"f{i}"])
        for i in range(2)], device=torch.device("meta"))
    kv = KeyValueParams(ssd_storage_directory="/mnt/nvme/tier@local_rank", l2_cache_size=1)
    constraints = {"t0": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["key_value"],
                                              cache_params=CacheParams(load_factor=0.1), key_value_params=kv)}
    sharder = ProactiveEmbeddingBagCollectionSharder()
    topology = Topology(world_size=2, compute_device="cuda", ssd_cap=1 << 40)
    plan = EmbeddingShardingPlanner(topology=topology, constraints=constraints).plan(ebc, [sharder])
    params = plan.plan[""]
    assert params["t0"].compute_kernel == "key_value"
    assert "key_value" in sharder.compute_kernels("table_wise", "cuda")

    class Env:
        rank = 1

    marked, options = sharder._prepare_plan(ebc, params, Env(), torch.device("cuda", 0))
    assert sorted(options.disk) == ["t0"] and options.disk["t0"].directory == "/mnt/nvme/tier@local_rank"
    assert options.disk["t0"].l2_cache_gb == 1
    assert marked["t0"].compute_kernel == "fused_uvm_caching" and marked["t0"].cache_params.prefetch_pipeline
    assert params["t0"].compute_kernel == "key_value"  # (the user's plan is not changed)
    assert marked["t1"].compute_kernel == params["t1"].compute_kernel  # (the other table: as planned)
