"""Hardware profiles of real GPU systems, with their published figures and sources.

A profile holds what the scaling study needs of a machine: memory and link bandwidths, the
GPUs per node, dense throughput, host memory (its size per GPU and the bandwidth the GPUs of
one host memory share) and, for an NVMe tier, the drive's read latency, the reads in flight
the store keeps and the drive's ceiling. Each figure is a vendor's or an operator's published
one and says where it comes from (``sources``); what no datasheet gives is named in
``assumptions``. Published peaks are upper bounds: the model runs on the *achievable* figures
next to them (``host_link_achievable_gbps``, ``network_achievable_gbps``, ``host_dram_gbps``,
each with its source or marked assumed), copies run full duplex (fetches host -> device and
write-backs device -> host on separate copy engines), and where the topology puts the GPU
and its NIC behind one PCIe switch (``nic_shares_host_link``: DGX H100/H200) the inter-node
collectives and the row copies share the link's capacity (``host_link_capacity_gbps``).
``bands`` gives each uncertain input a (low, high) range; the study reports every speed-up
over them.

Profiles (:data:`PROFILES`): DGX H100, DGX H200, a GH200 node as JUPITER's Booster has it
(4x GH200 with 120 GB LPDDR5X each and an NDR200 NIC per GPU), and DGX H100 with the rows on
its internal NVMe behind a DRAM host cache.

The communication rules are TorchRec's own: :func:`topology` builds the planner's
``Topology`` (``TopologyFactory`` with the profile as its ``HardwareConfig``), and
:func:`collective_bandwidth` asks its ``comms_bandwidths`` for an all-to-all or all-reduce
bandwidth at a given scale, as TorchRec's shard estimators do.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import asdict, dataclass, field, replace
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
    #: dense matmul throughput the MLPs run at (BF16 tensor cores, dense, peak)
    dense_tflops: float
    #: device memory size, bytes
    hbm_bytes: float
    #: per-transfer latency of the copy engine, seconds (assumption, see ``assumptions``)
    host_link_latency_s: float = 10e-6
    #: fixed latency of one collective, seconds (assumption)
    collective_latency_s: float = 20e-6
    #: share of the dense peak the model's compute reaches; the study calibrates it per
    #: workload so that the resident step matches a published MLPerf step time
    dense_efficiency: float = 0.3
    #: what a copy / an all-to-all achieves, GB/s per direction (0: the peak)
    host_link_achievable_gbps: float = 0.0
    network_achievable_gbps: float = 0.0
    #: what the host link achieves for all its users together (copies and, where it shares
    #: the link, the NIC); 0: the copy figure. An override of the copy figure leaves it.
    host_link_capacity_gbps: float = 0.0
    #: fetches and write-backs run at the same time, one per direction (separate copy engines)
    full_duplex: bool = True
    #: the GPU's host link also carries its NIC's GPUDirect traffic (one PCIe switch)
    nic_shares_host_link: bool = False
    #: fixed cost of every training step beyond the sourced step (TorchRec's eager pipeline
    #: over a graph-captured MLPerf step: launches, the Python pipeline, host syncs), split a
    #: third to the forward, two thirds to the backward; the study's sensitivity axis
    step_overhead_s: float = 0.0
    #: achievable host DRAM bandwidth of one host memory (a node's sockets, or one Grace), GB/s
    host_dram_gbps: float = 0.0
    #: GPUs copying through that one host memory
    gpus_per_host_memory: int = 1
    #: host memory a GPU's host tier may use, bytes (the host's memory over its GPUs, less the OS's share)
    host_memory_bytes_per_gpu: float = 0.0
    #: where the tables' rows live beyond the device cache: "dram" (host memory), "nvme"
    #: (a file per shard on the node's NVMe drives, behind a host DRAM cache)
    tier: str = "dram"
    #: NVMe: read latency (one 4 KiB page), reads in flight a GPU's store keeps (the store's
    #: I/O threads), the drive's random-read ceiling, and its capacity per GPU
    nvme_latency_s: float = 0.0
    nvme_reads_in_flight: float = 0.0
    nvme_max_reads_per_s: float = 0.0
    nvme_bytes_per_gpu: float = 0.0
    #: (field, low, high) for the uncertain inputs; the projection reports speed-ups at their corners
    bands: Tuple[Tuple[str, float, float], ...] = field(default_factory=tuple)
    sources: Tuple[str, ...] = field(default_factory=tuple)
    assumptions: Tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("gpus_per_node", "hbm_gbps", "nvlink_gbps", "network_gbps", "host_link_gbps",
                     "dense_tflops", "hbm_bytes", "dense_efficiency"):
            if not getattr(self, name) > 0:
                raise ValueError(f"hardware profile {self.name!r}: {name} must be > 0, got {getattr(self, name)!r}")
        if self.tier not in ("dram", "nvme"):
            raise ValueError(f"hardware profile {self.name!r}: tier must be 'dram' or 'nvme', got {self.tier!r}")
        if self.tier == "nvme" and not (self.nvme_latency_s > 0 and self.nvme_reads_in_flight > 0):
            raise ValueError(f"hardware profile {self.name!r}: an nvme tier needs nvme_latency_s and "
                             f"nvme_reads_in_flight > 0")

    @property
    def short_name(self) -> str:
        return self.name.split(" (")[0]

    @property
    def key(self) -> str:
        """The name ``--scaling-profile`` takes (``dgx_h100``, ``dgx_h100_nvme``, ...)."""
        return self.short_name.lower().replace(" + ", "_").replace(" ", "_").replace("-", "_")

    @property
    def copy_gbps(self) -> float:
        """The host link's bandwidth the model uses (achievable, else the peak)."""
        return self.host_link_achievable_gbps or self.host_link_gbps

    @property
    def nic_gbps(self) -> float:
        """The NIC's bandwidth the model uses (achievable, else the peak)."""
        return self.network_achievable_gbps or self.network_gbps

    def to_dict(self) -> Dict[str, Any]:
        return {**asdict(self), "key": self.key}


_COMMON_ASSUMPTIONS = (
    "copy-engine latency 10 us per transfer and 20 us per collective (small-message latencies; no datasheet "
    "gives them)",
    "compute: the share of the BF16 dense peak the model reaches is calibrated per workload so that the resident "
    "step on 8 GPUs of a DGX H100 is the one MLPerf Training's DLRM-dcnv2 result implies (workloads.py); the same "
    "share on every profile",
    "step overhead: TorchRec's eager pipeline over the graph-captured MLPerf step costs an unknown fixed time a "
    "step; 0 ms in the headline (the sourced step, the shortest, where copies weigh most), band 0-4 ms, and the "
    "sensitivity list goes to 8 ms; a third falls in the forward, two thirds in the backward and optimizer",
    "host DRAM: rows planned on the device move by a kernel over the host-mapped tier (store/row_moves.py), as "
    "FBGEMM's UVM cache under TorchRec's depth 1 does: 1 DRAM byte per byte copied; planned on the host they go "
    "through pinned staging (fetch/cuda.py): 3 each way. The capped move kernel's PCIe bandwidth is not measured yet "
    "(gpu_check on a GPU): the link's achievable copy figure is used",
)

_PCIE5_ACHIEVABLE = ("PCIe Gen5 x16 achievable host <-> device copy about 50-55 GB/s per direction (pinned "
                     "memory; e.g. NVIDIA nvbandwidth / CUDA bandwidthTest on H100 PCIe Gen5 hosts); 52 used, also as "
                     "the link's capacity shared with the NIC")
_NDR_ACHIEVABLE = ("NDR 400 Gb/s InfiniBand achievable about 45-48 GB/s per direction for large messages "
                   "(nccl-tests busbw on DGX H100 SuperPODs); 46 used")
_SPR_DRAM = ("DGX H100/H200 datasheets: 2x Intel Xeon Platinum 8480C, 2 TB DDR5; Intel's 8480C/8480+ specification: 8 "
             "DDR5-4800 channels per socket = 307 GB/s, 614 GB/s for the node (peak); achievable ASSUMED 75% "
             "(STREAM-like), 460 GB/s, band 400-500, shared by the node's 8 GPUs")
_DGX_BANDS = (("host_link_achievable_gbps", 50.0, 55.0), ("network_achievable_gbps", 45.0, 48.0),
              ("host_dram_gbps", 400.0, 500.0), ("step_overhead_s", 0.0, 4e-3))
#: TorchRec's planner reserves 15% of device memory by default (HeuristicalStorageReservation);
#: host memory: the OS, the data loader and pinned staging take ASSUMED 20%.
HBM_USABLE, HOST_USABLE = 0.85, 0.8

# DGX H100: 8 x H100 SXM5, NVLink 4 through NVSwitch, one 400 Gb/s ConnectX-7 per GPU.
H100_SXM = HardwareProfile(
    name="DGX H100 (8x H100 SXM, NVLink 4, 400 Gb/s IB per GPU, PCIe Gen5 host link, DDR5 host tier)",
    gpus_per_node=8, hbm_gbps=3350, nvlink_gbps=450, network_gbps=50, host_link_gbps=64,
    dense_tflops=989.4, hbm_bytes=80e9, host_link_achievable_gbps=52, network_achievable_gbps=46,
    host_link_capacity_gbps=52, nic_shares_host_link=True, host_dram_gbps=460, gpus_per_host_memory=8,
    host_memory_bytes_per_gpu=HOST_USABLE * 2e12 / 8, bands=_DGX_BANDS,
    sources=(
        "NVIDIA H100 Tensor Core GPU datasheet: H100 SXM 80 GB HBM3 at 3.35 TB/s, BF16 1,979 TFLOPS with sparsity "
        "(989.4 dense), NVLink 900 GB/s (450 GB/s each way), PCIe Gen5 128 GB/s (64 GB/s each way)",
        "NVIDIA DGX H100 datasheet: 8x H100 SXM5, 8x single-port ConnectX-7 400 Gb/s (50 GB/s) InfiniBand, "
        "2 TB system memory, 8x 3.84 TB NVMe U.2 internal storage",
        "NVIDIA DGX H100 user guide, system topology: each GPU and its ConnectX-7 sit behind one PCIe Gen5 "
        "switch, so GPUDirect RDMA traffic and host <-> device copies share the GPU's x16 link",
        _PCIE5_ACHIEVABLE, _NDR_ACHIEVABLE, _SPR_DRAM,
    ),
    assumptions=_COMMON_ASSUMPTIONS,
)

H200_SXM = HardwareProfile(
    name="DGX H200 (8x H200 SXM, NVLink 4, 400 Gb/s IB per GPU, PCIe Gen5 host link, DDR5 host tier)",
    gpus_per_node=8, hbm_gbps=4800, nvlink_gbps=450, network_gbps=50, host_link_gbps=64,
    dense_tflops=989.4, hbm_bytes=141e9, host_link_achievable_gbps=52, network_achievable_gbps=46,
    host_link_capacity_gbps=52, nic_shares_host_link=True, host_dram_gbps=460, gpus_per_host_memory=8,
    host_memory_bytes_per_gpu=HOST_USABLE * 2e12 / 8, bands=_DGX_BANDS,
    sources=(
        "NVIDIA H200 Tensor Core GPU datasheet: H200 SXM 141 GB HBM3e at 4.8 TB/s, BF16 1,979 TFLOPS with sparsity "
        "(989.4 dense), NVLink 900 GB/s, PCIe Gen5 128 GB/s",
        "NVIDIA DGX H200 datasheet: 8x H200 SXM, 8x single-port ConnectX-7 400 Gb/s InfiniBand, 2 TB system memory",
        "DGX H200 uses the DGX H100 board topology (GPU and NIC behind one PCIe Gen5 switch)",
        _PCIE5_ACHIEVABLE, _NDR_ACHIEVABLE, _SPR_DRAM,
    ),
    assumptions=_COMMON_ASSUMPTIONS,
)

# A real GH200 node: JUPITER Booster (Forschungszentrum Juelich), BullSequana XH3515.
GH200 = HardwareProfile(
    name="GH200 node (JUPITER Booster: 4x GH200, NVLink-C2C host link, 120 GB LPDDR5X each, NDR200 per GPU)",
    gpus_per_node=4, hbm_gbps=4000, nvlink_gbps=450, network_gbps=25, host_link_gbps=450,
    dense_tflops=989.4, hbm_bytes=96e9, host_link_achievable_gbps=380, network_achievable_gbps=23,
    host_dram_gbps=410, gpus_per_host_memory=1, host_memory_bytes_per_gpu=HOST_USABLE * 120e9,
    bands=(("host_link_achievable_gbps", 300.0, 420.0), ("network_achievable_gbps", 21.0, 24.0),
           ("host_dram_gbps", 350.0, 460.0), ("step_overhead_s", 0.0, 4e-3)),
    sources=(
        "JSC, JUPITER configuration (apps.fz-juelich.de/jsc/hps/jupiter/configuration.html): Booster node = 4x "
        "NVIDIA GH200; per superchip Grace with 120 GB LPDDR5X at 512 GB/s, Hopper with 96 GB HBM3 at 4 TB/s, "
        "NVLink-C2C 900 GB/s; NVLink 4 between GPU pairs at 150 GB/s per direction (450 to the other three); "
        "network 4x InfiniBand NDR200 (ConnectX-7), one per GPU",
        "NVIDIA GH200 Grace Hopper Superchip datasheet: BF16 1,979 TFLOPS with sparsity (989.4 dense), "
        "NVLink-C2C 900 GB/s (450 GB/s each way)",
    ),
    assumptions=_COMMON_ASSUMPTIONS + (
        "NDR200 achievable 23 GB/s (band 21-24) of 25, as NDR400's 46 of 50; the NICs attach to Grace over PCIe "
        "and do not share NVLink-C2C",
        "NVLink-C2C achievable host -> device copy 380 GB/s (band 300-420) of the 450 GB/s peak: published "
        "measurements of Grace Hopper report roughly 350-420 GB/s for pinned copies; no datasheet gives it",
        "LPDDR5X achievable 410 GB/s (band 350-460) of 512: ASSUMED 80% (STREAM-like); each Grace serves one GPU",
    ),
)

# The NVMe tier on a DGX H100: rows on the node's internal NVMe drives behind a DRAM host cache.
H100_NVME = replace(
    H100_SXM,
    name="DGX H100 + NVMe (8x H100 SXM, rows on the internal NVMe behind a DDR5 host cache)",
    tier="nvme", nvme_latency_s=90e-6, nvme_reads_in_flight=64, nvme_max_reads_per_s=1.4e6,
    nvme_bytes_per_gpu=3.84e12,
    bands=_DGX_BANDS + (("nvme_latency_s", 70e-6, 120e-6),),
    sources=H100_SXM.sources + (
        "NVIDIA DGX H100 datasheet: internal storage 8x 3.84 TB NVMe U.2 (one drive per GPU here)",
    ),
    assumptions=H100_SXM.assumptions + (
        "ASSUMED drive: the DGX H100 datasheet does not name it; a PCIe Gen4 U.2 datacenter drive of the class of "
        "KIOXIA CM6 / Samsung PM1733 (their datasheets: about 1.4-1.5 M random 4 KiB reads/s, read latency about "
        "80-100 us at low queue depth): 90 us (band 70-120), at most 1.4 M reads/s per drive",
        "reads in flight: the store's I/O threads (RowFile's pool, 64 by default: `bench --tier ssd --io-threads`), "
        "so a GPU reads at most 64 / 90 us = 0.71 M rows/s; one 4 KiB read per row (516-byte rows), and each dirty "
        "row the host cache evicts costs one more page I/O",
    ),
)

#: The profiles the study projects to, in the order it reports them.
PROFILES: Tuple[HardwareProfile, ...] = (H100_SXM, H200_SXM, GH200, H100_NVME)


def profile_named(prefix: str) -> HardwareProfile:
    """The profile whose key (``dgx_h100``, ``dgx_h200``, ``gh200_node``, ``dgx_h100_nvme``) is
    ``prefix``, or whose name or key starts with it (case-insensitive), if only one does."""
    want = prefix.lower()
    exact = [p for p in PROFILES if p.key == want]
    found = exact or [p for p in PROFILES if p.name.lower().startswith(want) or p.key.startswith(want)]
    if len(found) != 1:
        names = ", ".join(p.key for p in PROFILES)
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
