"""What TorchRec's planner needs to place proactive (``fused_uvm_caching``) tables on CPU.

TorchRec's hardware-aware perf estimator knows no ``fused_uvm_caching`` bandwidth for the
``cpu`` device (stock TorchRec has no UVM caching on CPU) and raises on it, so a planner -
or ``DistributedModelParallel`` planning internally - dies on the first cached table. Our
sharder serves such tables on CPU, so it tells the estimator what they cost, with the
estimator's own extension point (``@device_bw(device=..., compute_kernel=...)``, TorchRec's
per-kernel bandwidth table) rather than by replacing another kernel in the plan:

* lookups read the cache, which on CPU lives in host DRAM: the bandwidth of ``fused`` on CPU
  (``1 x DDR_MEM_BW``, TorchRec's value);
* memory: TorchRec's storage estimator already puts ``load_factor x`` the table in device
  memory (the cache) and the whole table in host memory (the host tier) on CUDA
  topologies; a CPU topology has no device memory, so there everything is host memory;
* the fetch of missing rows: TorchRec's estimator already charges it as ``prefetch`` cost
  (expected misses x row bytes / host-to-device bandwidth) when the plan's ``CacheParams``
  carry cache statistics.

The same holds for ``key_value`` (a table on disk behind a DRAM host cache: its lookups read
the same device cache). TorchRec plans ``key_value`` only where the topology has SSD
(``Topology(ssd_cap=...)``): without it the planner refuses the table, as stock does.

Only the missing ``(cpu, fused_uvm_caching)`` and ``(cpu, key_value)`` entries are added, to
every registered estimator config that lacks them; no existing entry or plan changes.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional

from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner.constants import DDR_MEM_BW
from torchrec.distributed.planner.estimator.annotations import device_bw
from torchrec.distributed.planner.estimator.estimator import EmbeddingPerfEstimatorFactory
from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator
from torchrec.distributed.planner.types import ParameterConstraints, ShardEstimator, ShardingOption, Storage, Topology

from .disk_tier import DEFAULT_HOST_CACHE_BYTES

CACHED_KERNEL = EmbeddingComputeKernel.FUSED_UVM_CACHING.value
KEY_VALUE_KERNEL = EmbeddingComputeKernel.KEY_VALUE.value
CPU_CACHED_LOOKUP_BW = 1.0 * DDR_MEM_BW  # bytes/ms, as TorchRec rates `fused` on CPU


def register_cpu_cached_kernel() -> None:
    """Adds the ``(cpu, fused_uvm_caching)`` and ``(cpu, key_value)`` bandwidths to TorchRec's
    estimator configs (idempotent)."""
    for kernel in (CACHED_KERNEL, KEY_VALUE_KERNEL):
        for config_cls in list(EmbeddingPerfEstimatorFactory._registry.values()):  # noqa: SLF001 - no public list
            if ("cpu", kernel) not in (getattr(config_cls, "kernel_device_bandwidths", None) or {}):
                device_bw(bandwidth=CPU_CACHED_LOOKUP_BW, device="cpu", compute_kernel=kernel)(config_cls)


class DiskTierStorageEstimator(ShardEstimator):
    """TorchRec's storage estimate (``EmbeddingStorageEstimator``), with the DRAM a ``key_value``
    table on the proactive disk tier takes on a CPU topology counted in ``ddr``.

    For ``key_value`` TorchRec counts the shard's rows on SSD and, on CPU, nothing in DRAM
    (its caches are GPU ones), so a planner would put any number of such tables on one
    rank's DRAM. Each shard here also holds its device cache (the plan's load factor x its
    rows; on CPU the "device" is DRAM) and a host cache of ``host_cache_bytes[table]`` where
    given (the sharder's, e.g. ``cacheplan.plan_host_caches``'s), else at most
    ``l2_cache_size`` GB (``disk_tier.DEFAULT_HOST_CACHE_BYTES`` when unset), and at most its
    rows - counted per shard, so tables that share a group's host cache are counted high,
    never low. The SSD
    figure is TorchRec's (the whole shard). Other kernels and devices: TorchRec's unchanged.
    """

    def __init__(self, topology: Topology, constraints: Optional[Dict[str, ParameterConstraints]] = None,
                 default_load_factor: float = 0.2, host_cache_bytes: Optional[Mapping[str, int]] = None) -> None:
        self._topology = topology
        self._host_cache_bytes = dict(host_cache_bytes or {})
        self._stock = EmbeddingStorageEstimator(topology, constraints)
        self._default_load_factor = default_load_factor

    def estimate(self, sharding_options: List[ShardingOption],  # type: ignore[override]
                 sharder_data_map: Optional[Dict[str, Any]] = None) -> None:
        self._stock.estimate(sharding_options, sharder_data_map=sharder_data_map)
        if self._topology.compute_device != "cpu":
            return
        for option in sharding_options:
            if option.compute_kernel != KEY_VALUE_KERNEL:
                continue
            load_factor = option.cache_load_factor
            load_factor = self._default_load_factor if load_factor is None else load_factor
            kv = option.key_value_params
            host_cap = int(kv.l2_cache_size * (1 << 30)) if kv is not None and kv.l2_cache_size else \
                DEFAULT_HOST_CACHE_BYTES
            host_cap = int(self._host_cache_bytes.get(option.name, host_cap))
            element = option.tensor.element_size()
            for shard in option.shards:
                rows, cols = int(shard.size[0]), int(shard.size[1])
                row_bytes = cols * element
                extra = math.ceil(load_factor * rows) * row_bytes + min(host_cap, rows * row_bytes)
                storage = shard.storage
                assert storage is not None
                shard.storage = Storage(hbm=storage.hbm, ddr=storage.ddr + extra, ssd=storage.ssd)
