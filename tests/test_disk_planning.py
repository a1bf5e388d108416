"""TorchRec's planner counts the DRAM of tables on the proactive disk tier: on a CPU topology
TorchRec's own estimate puts a ``key_value`` shard on SSD and nothing in DRAM; the estimator
``planning.build_plan`` uses adds each shard's device cache and host cache."""

from __future__ import annotations

import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator, EmbeddingStorageEstimator
from torchrec.distributed.types import CacheParams, KeyValueParams

from torchrec_proactive import ProactiveEmbeddingBagCollectionSharder
from torchrec_proactive.integration.disk_tier import DEFAULT_HOST_CACHE_BYTES
from torchrec_proactive.integration.planner_support import DiskTierStorageEstimator

ROWS, DIM = 100_000, 32


def _ddr_by_table(storage_estimator_cls, l2_gb):
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{i}"])
        for i in range(2)], device=torch.device("meta"))
    topology = Topology(world_size=1, compute_device="cpu", ssd_cap=1 << 40)
    kv = KeyValueParams(ssd_storage_directory="/tmp/unused", l2_cache_size=l2_gb)
    constraints = {f"t{i}": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["key_value"],
                                                 cache_params=CacheParams(load_factor=0.1), key_value_params=kv)
                   for i in range(2)}
    enumerator = EmbeddingEnumerator(topology=topology, batch_size=512, constraints=constraints,
                                     estimator=[EmbeddingPerfEstimator(topology, constraints),
                                                storage_estimator_cls(topology, constraints)])
    options = enumerator.enumerate(ebc, [ProactiveEmbeddingBagCollectionSharder()])
    return {o.name: (o.shards[0].storage.ddr, o.shards[0].storage.ssd) for o in options
            if o.compute_kernel == "key_value"}


def test_key_value_shards_count_their_caches_in_dram():
    stock = _ddr_by_table(EmbeddingStorageEstimator, l2_gb=0)
    ours = _ddr_by_table(DiskTierStorageEstimator, l2_gb=0)
    table_bytes = ROWS * DIM * 4
    for name in ("t0", "t1"):
        assert stock[name][1] >= table_bytes  # TorchRec: the rows on SSD ...
        assert stock[name][0] < table_bytes // 10  # ... and no cache in DRAM
        device_cache = int(0.1 * ROWS) * DIM * 4
        host_cache = min(DEFAULT_HOST_CACHE_BYTES, table_bytes)  # (l2_cache_size unset: the default)
        assert ours[name][0] - stock[name][0] == device_cache + host_cache
        assert ours[name][1] == stock[name][1]  # SSD: TorchRec's figure
    # l2_cache_size caps the host cache (GB, TorchRec's meaning); here more than the table
    capped = _ddr_by_table(DiskTierStorageEstimator, l2_gb=1)
    assert capped["t0"][0] - stock["t0"][0] == int(0.1 * ROWS) * DIM * 4 + table_bytes


def test_the_planner_refuses_more_disk_tables_than_dram_holds_their_caches():
    """Three key_value tables on two CPU ranks whose DRAM holds one table's caches each:
    TorchRec's own estimate plans them (it counts no DRAM for them); with the disk tier's
    estimate the planner finds no placement. ``planning.build_plan`` plans with it."""
    import pytest
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.types import PlannerError

    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{i}"])
        for i in range(3)], device=torch.device("meta"))
    kv = KeyValueParams(ssd_storage_directory="/tmp/unused", l2_cache_size=0)
    constraints = {f"t{i}": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["key_value"],
                                                 cache_params=CacheParams(load_factor=0.1), key_value_params=kv)
                   for i in range(3)}
    caches = int(0.1 * ROWS) * DIM * 4 + ROWS * DIM * 4  # device cache + host cache (the whole shard)
    topology = Topology(world_size=2, compute_device="cpu", ddr_cap=int(1.5 * caches), ssd_cap=1 << 40)
    sharders = [ProactiveEmbeddingBagCollectionSharder()]

    def planner(storage_estimator_cls):
        enumerator = EmbeddingEnumerator(topology=topology, batch_size=512, constraints=constraints,
                                         estimator=[EmbeddingPerfEstimator(topology, constraints),
                                                    storage_estimator_cls(topology, constraints)])
        return EmbeddingShardingPlanner(topology=topology, constraints=constraints, enumerator=enumerator)

    plan = planner(EmbeddingStorageEstimator).plan(ebc, sharders)
    assert {ps.compute_kernel for ps in plan.plan[""].values()} == {"key_value"}  # stock: planned
    with pytest.raises(PlannerError):
        planner(DiskTierStorageEstimator).plan(ebc, sharders)


def test_the_sharders_host_cache_bytes_are_what_the_planner_counts():
    """A table given ``host_cache_bytes`` (the sharder's, e.g. ``plan_host_caches``'s; what
    ``planning.build_plan`` passes) is counted in DRAM at that size, not at
    ``l2_cache_size``'s (a user trial: a DRAM cap that held the planned caches was refused as
    too small)."""
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{i}"])
        for i in range(2)], device=torch.device("meta"))
    topology = Topology(world_size=1, compute_device="cpu", ssd_cap=1 << 40)
    kv = KeyValueParams(ssd_storage_directory="/tmp/unused")
    constraints = {f"t{i}": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["key_value"],
                                                 cache_params=CacheParams(load_factor=0.1), key_value_params=kv)
                   for i in range(2)}
    host = {"t0": 123_456}
    sharder = ProactiveEmbeddingBagCollectionSharder(host_cache_bytes=host)

    def ddr(estimator):
        enumerator = EmbeddingEnumerator(topology=topology, batch_size=512, constraints=constraints,
                                         estimator=[EmbeddingPerfEstimator(topology, constraints), estimator])
        return {o.name: o.shards[0].storage.ddr for o in enumerator.enumerate(ebc, [sharder])
                if o.compute_kernel == "key_value"}

    stock = ddr(EmbeddingStorageEstimator(topology, constraints))
    ours = ddr(DiskTierStorageEstimator(topology, constraints, host_cache_bytes=host))
    device_cache = int(0.1 * ROWS) * DIM * 4
    assert ours["t0"] - stock["t0"] == device_cache + 123_456
    assert ours["t1"] - stock["t1"] == device_cache + min(DEFAULT_HOST_CACHE_BYTES, ROWS * DIM * 4)


def test_host_cache_bytes_without_a_disk_tables_entry_is_said():
    """A typo in ``host_cache_bytes`` (or a table left out) would size that table's group
    from ``l2_cache_size`` - 1 GiB unset - without a word: the sharder warns, naming both."""
    import pytest
    from torchrec.distributed.types import ParameterSharding

    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{i}"])
        for i in range(2)], device=torch.device("meta"))
    kv = KeyValueParams(ssd_storage_directory="/tmp/unused")
    params = {f"t{i}": ParameterSharding(sharding_type="table_wise", compute_kernel="key_value", ranks=[0],
                                         key_value_params=kv) for i in range(2)}
    sharder = ProactiveEmbeddingBagCollectionSharder(host_cache_bytes={"t0": 1 << 20, "t_1": 1 << 20})
    with pytest.warns(UserWarning, match=r"no entry for the key_value table\(s\) \['t1'\].*\['t_1'\]"):
        sharder._mark_cached_tables(ebc, params, {})
    every = ProactiveEmbeddingBagCollectionSharder(host_cache_bytes={"t0": 1 << 20, "t1": 1 << 20})
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        every._mark_cached_tables(ebc, params, {})
