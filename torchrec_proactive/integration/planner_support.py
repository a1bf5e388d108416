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

from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner.constants import DDR_MEM_BW
from torchrec.distributed.planner.estimator.annotations import device_bw
from torchrec.distributed.planner.estimator.estimator import EmbeddingPerfEstimatorFactory

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
