"""Hardware profiles of real GPU systems, with their published figures and sources.

A profile holds what the scaling study needs of a machine: memory and link bandwidths, the
GPUs per node, dense throughput. Each figure is a vendor's published peak and says where it
comes from (``sources``); the few that no datasheet gives are named in ``assumptions``.
Published peaks are upper bounds: the model runs on the *achievable* figures next to them
(``host_link_achievable_gbps``, ``network_achievable_gbps``, each with its source), copies
run full duplex (fetches host -> device and write-backs device -> host on separate copy
engines), and where the topology puts the GPU and its NIC behind one PCIe switch
(``nic_shares_host_link``: DGX H100/H200) the inter-node collectives and the row copies
share the GPU's PCIe link. ``bands`` gives each uncertain input a (low, high) range; the
study reports every speed-up at the corners of those ranges.

The communication rules are TorchRec's own: :func:`topology` builds the planner's
``Topology`` (``TopologyFactory`` with the profile as its ``HardwareConfig``), and
:func:`collective_bandwidth` asks its ``comms_bandwidths`` for an all-to-all or all-reduce
bandwidth at a given scale, as TorchRec's shard estimators do.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Tuple

GB = 1e9  # vendors quote decimal GB/s and TFLOPS

__all__ = ["HardwareProfile", "PROFILES", "profile_named", "topology", "collective_bandwidth"]


@dataclass(frozen=True)
class HardwareProfile:
    """One GPU of a named system. Bandwidths are per GPU and per direction, in GB/s."""

    name: str
    #: GPUs per node (one NVLink domain)
    gpus_per_node: int
    #: device memory bandwidth
    hbm_gbps: float
    #: GPU <-> GPU inside a node (NVLink, per direction)
    nvlink_gbps: float
    #: GPU <-> GPU across nodes (the NIC serving this GPU, per direction)
    network_gbps: float
    #: host memory -> device memory (the copy engine's link: PCIe or NVLink-C2C)
    host_link_gbps: float
    #: dense matmul throughput the MLPs run at (TF32 tensor cores, dense, peak)
    dense_tflops: float
    #: device memory size, bytes
    hbm_bytes: float
    #: per-transfer latency of the copy engine, seconds (assumption, see ``assumptions``)
    host_link_latency_s: float = 10e-6
    #: fixed latency of one collective, seconds (assumption)
    collective_latency_s: float = 20e-6
    #: share of the dense peak that DLRM's small MLPs reach (assumption)
    dense_efficiency: float = 0.3
    #: what a copy / an all-to-all achieves, GB/s per direction (0: the peak)
    host_link_achievable_gbps: float = 0.0
    network_achievable_gbps: float = 0.0
    #: fetches and write-backs run at the same time, one per direction (separate copy engines)
    full_duplex: bool = True
    #: the GPU's host link also carries its NIC's GPUDirect traffic (one PCIe switch)
    nic_shares_host_link: bool = False
    #: fixed cost of every training step on the main thread: kernel launches, the Python
    #: pipeline, host syncs (assumption, see ``assumptions``)
    step_overhead_s: float = 2e-3
    #: (field, low, high) for the uncertain inputs; the projection reports speed-ups at their corners
    bands: Tuple[Tuple[str, float, float], ...] = field(default_factory=tuple)
    sources: Tuple[str, ...] = field(default_factory=tuple)
    assumptions: Tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("gpus_per_node", "hbm_gbps", "nvlink_gbps", "network_gbps", "host_link_gbps",
                     "dense_tflops", "hbm_bytes", "dense_efficiency"):
            if not getattr(self, name) > 0:
                raise ValueError(f"hardware profile {self.name!r}: {name} must be > 0, got {getattr(self, name)!r}")

    @property
    def copy_gbps(self) -> float:
        """The host link's bandwidth the model uses (achievable, else the peak)."""
        return self.host_link_achievable_gbps or self.host_link_gbps

    @property
    def nic_gbps(self) -> float:
        """The NIC's bandwidth the model uses (achievable, else the peak)."""
        return self.network_achievable_gbps or self.network_gbps

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


_COMMON_ASSUMPTIONS = (
    "copy-engine latency 10 us per transfer and 20 us per collective (small-message latencies; no datasheet "
    "gives them)",
    "MLPs reach 30% of the TF32 dense peak (DLRM's layers are small); band 20-40%",
    "a fixed 2 ms per step for kernel launches, TorchRec's Python pipeline and its host syncs (no source "
    "publishes TorchRec's per-step overhead; MLPerf DLRM-dcnv2 steps of well under 1 ms use fused, graph-"
    "captured code that TorchRec's pipeline is not); band 1-4 ms: measure yours with `bench` on a GPU",
)

_PCIE5_ACHIEVABLE = ("PCIe Gen5 x16 achievable host <-> device copy about 50-55 GB/s per direction (pinned "
                     "memory; e.g. NVIDIA nvbandwidth / CUDA bandwidthTest on H100 PCIe Gen5 hosts); 52 used")
_NDR_ACHIEVABLE = ("NDR 400 Gb/s InfiniBand achievable about 45-48 GB/s per direction for large messages "
                   "(nccl-tests busbw on DGX H100 SuperPODs); 46 used")
_PCIE_BANDS = (("host_link_achievable_gbps", 50.0, 55.0), ("network_achievable_gbps", 45.0, 48.0),
               ("step_overhead_s", 1e-3, 4e-3), ("dense_efficiency", 0.2, 0.4))

# DGX H100: 8 x H100 SXM5, NVLink 4 through NVSwitch, one 400 Gb/s ConnectX-7 per GPU.
H100_SXM = HardwareProfile(
    name="DGX H100 (8x H100 SXM, NVLink 4, 400 Gb/s IB per GPU, PCIe Gen5 host link)",
    gpus_per_node=8, hbm_gbps=3350, nvlink_gbps=450, network_gbps=50, host_link_gbps=64,
    dense_tflops=494.7, hbm_bytes=80e9, host_link_achievable_gbps=52, network_achievable_gbps=46,
    nic_shares_host_link=True, bands=_PCIE_BANDS,
    sources=(
        "NVIDIA H100 Tensor Core GPU datasheet: H100 SXM 80 GB HBM3 at 3.35 TB/s, TF32 989 TFLOPS with sparsity "
        "(494.7 dense), NVLink 900 GB/s (450 GB/s each way), PCIe Gen5 128 GB/s (64 GB/s each way)",
        "NVIDIA DGX H100 datasheet: 8x H100 SXM5, 8x single-port ConnectX-7 400 Gb/s (50 GB/s) InfiniBand",
        "NVIDIA DGX H100 user guide, system topology: each GPU and its ConnectX-7 sit behind one PCIe Gen5 "
        "switch, so GPUDirect RDMA traffic and host <-> device copies share the GPU's x16 link",
        _PCIE5_ACHIEVABLE, _NDR_ACHIEVABLE,
    ),
    assumptions=_COMMON_ASSUMPTIONS,
)

H200_SXM = HardwareProfile(
    name="DGX H200 (8x H200 SXM, NVLink 4, 400 Gb/s IB per GPU, PCIe Gen5 host link)",
    gpus_per_node=8, hbm_gbps=4800, nvlink_gbps=450, network_gbps=50, host_link_gbps=64,
    dense_tflops=494.7, hbm_bytes=141e9, host_link_achievable_gbps=52, network_achievable_gbps=46,
    nic_shares_host_link=True, bands=_PCIE_BANDS,
    sources=(
        "NVIDIA H200 Tensor Core GPU datasheet: H200 SXM 141 GB HBM3e at 4.8 TB/s, TF32 989 TFLOPS with sparsity "
        "(494.7 dense), NVLink 900 GB/s, PCIe Gen5 128 GB/s",
        "NVIDIA DGX H200 datasheet: 8x H200 SXM, 8x single-port ConnectX-7 400 Gb/s InfiniBand",
        "DGX H200 uses the DGX H100 board topology (GPU and NIC behind one PCIe Gen5 switch)",
        _PCIE5_ACHIEVABLE, _NDR_ACHIEVABLE,
    ),
    assumptions=_COMMON_ASSUMPTIONS,
)

GH200 = HardwareProfile(
    name="GH200 (Grace Hopper, NVLink-C2C host link, 4 per node, 400 Gb/s per superchip)",
    gpus_per_node=4, hbm_gbps=4000, nvlink_gbps=450, network_gbps=50, host_link_gbps=450,
    dense_tflops=494.7, hbm_bytes=96e9, host_link_achievable_gbps=380, network_achievable_gbps=46,
    bands=(("host_link_achievable_gbps", 300.0, 420.0), ("network_achievable_gbps", 40.0, 48.0),
           ("step_overhead_s", 1e-3, 4e-3), ("dense_efficiency", 0.2, 0.4)),
    sources=(
        "NVIDIA GH200 Grace Hopper Superchip datasheet: 96 GB HBM3 at 4 TB/s, TF32 989 TFLOPS with sparsity "
        "(494.7 dense), NVLink-C2C 900 GB/s between Grace and Hopper (450 GB/s each way), Grace LPDDR5X up to "
        "512 GB/s, NVLink 900 GB/s GPU to GPU",
        _NDR_ACHIEVABLE,
    ),
    assumptions=_COMMON_ASSUMPTIONS + (
        "ASSUMED, not cited: 4 superchips per node joined by NVLink and one 400 Gb/s NDR NIC per superchip, "
        "attached to Grace over PCIe (not sharing NVLink-C2C); GH200 systems differ (e.g. NVL32 racks, "
        "single-superchip nodes): check your system's",
        "NVLink-C2C achievable host -> device copy 380 GB/s (band 300-420) of the 450 GB/s peak: published "
        "measurements of Grace Hopper report roughly 350-420 GB/s for pinned copies; no datasheet gives it",
    ),
)

#: The profiles the study projects to, in the order it reports them.
PROFILES: Tuple[HardwareProfile, ...] = (H100_SXM, H200_SXM, GH200)


def profile_named(prefix: str) -> HardwareProfile:
    """The profile whose name starts with ``prefix`` (case-insensitive)."""
    found = [p for p in PROFILES if p.name.lower().startswith(prefix.lower())
             or p.name.split(" (")[0].lower().replace(" ", "_") == prefix.lower()]
    if len(found) != 1:
        names = ", ".join(p.name.split(" (")[0].lower().replace(" ", "_") for p in PROFILES)
        raise ValueError(f"--scaling-profile {prefix!r}: no such hardware profile; expected one of {names} "
                         f"(or the start of one)")
    return found[0]


def topology(profile: HardwareProfile, world_size: int) -> Any:
    """TorchRec's planner ``Topology`` for ``world_size`` GPUs of ``profile`` (bytes/ms units)."""
    from torchrec.distributed.planner.types import HardwareConfig, KernelConfig, TopologyFactory, TrainerConfig

    per_ms = GB / 1e3
    hardware = HardwareConfig(
        hbm_cap_bytes=int(profile.hbm_bytes), intra_host_bw=profile.nvlink_gbps * per_ms,
        inter_host_bw=profile.nic_gbps * per_ms, hbm_mem_bw=profile.hbm_gbps * per_ms,
        hbm_to_ddr_mem_bw=profile.copy_gbps * per_ms,
    )
    # The factory logs a line per topology at INFO/WARNING; the study builds dozens.
    logging.getLogger("torchrec.distributed.planner.types").setLevel(logging.ERROR)
    return TopologyFactory.create_topology(
        TrainerConfig(world_size=world_size, local_world_size=min(world_size, profile.gpus_per_node)),
        hardware, KernelConfig(compute_device="cuda", use_hardware_based_bandwidth=True),
    )


def collective_bandwidth(profile: HardwareProfile, world_size: int, kind: str) -> float:
    """Bytes per second of an ``"all_to_all"`` or ``"all_reduce"`` over ``world_size`` GPUs,
    by TorchRec's rule (``BasicCommsBandwidths.get_bw``: NVLink inside a node, the NIC
    across nodes (achievable figure), one NIC per GPU for all-reduce)."""
    return _collective_bandwidth(profile.nvlink_gbps, profile.nic_gbps, profile.gpus_per_node, profile.hbm_gbps,
                                 profile.copy_gbps, profile.hbm_bytes, world_size, kind)


@functools.lru_cache(maxsize=4096)
def _collective_bandwidth(nvlink: float, nic: float, gpus_per_node: int, hbm: float, copy: float, hbm_bytes: float,
                          world_size: int, kind: str) -> float:
    # (cached: the uncertainty bands ask for the same topology many times, and building one is slow)
    from torchrec.distributed.planner.types import CollectiveType

    probe = HardwareProfile(name="probe", gpus_per_node=gpus_per_node, hbm_gbps=hbm, nvlink_gbps=nvlink,
                            network_gbps=nic, host_link_gbps=copy, dense_tflops=1.0, hbm_bytes=hbm_bytes)
    topo = topology(probe, world_size)
    per_ms = topo.comms_bandwidths.get_bw(local_world_size=topo.local_world_size, world_size=world_size,
                                          collective_type=CollectiveType(kind))
    return per_ms * 1e3
