"""One training step on one rank, reactive or proactive, from the costs of its stages.

A step of batch ``N`` on one rank runs, on the main thread::

    input a2a (ids of N+k+1) | forward N | output a2a N | backward N (+ grad a2a) | all-reduce N

and, on the copy engine, the host -> device copy of the rows some batch misses (behind it,
for a table on NVMe, the disk reads of those rows). Reactive (depth 0) plans and copies
batch N's rows inside ``forward N``: both sit on the critical path::

    S(0) = S0 + plan + D + F + W         D: the batch's disk reads, F: its copy,
                                         W: the lookup's own wait for its copy (hand-off)

A pipeline that fetches ``k`` batches ahead issues the copy of batch ``N + k`` at ``a``
seconds into step N and needs batch N's rows ``b`` seconds into step N (:meth:`StageCosts.window`):

* ``proactive`` (this product): planned during the output all-to-all of N (only planning
  that outlasts it shows), the copy issued when the planning ends: ``a = b + forward +
  plan``; rows needed at the lookup, after the input all-to-all: ``b = input a2a``.
* ``torchrec`` (``PrefetchTrainPipelineSparseDist``, k = 1 only): ``progress()`` runs the
  forward of batch i, *then* ``_prefetch(batch i+1)`` on the prefetch stream (its planning,
  FBGEMM's cache lookup, is device work in the same stream), and waits for that stream at
  the start of the next ``progress()`` (``_wait_for_batch``): ``a = input a2a + forward +
  output a2a + plan``, ``b = 0``. Its window is the backward and the optimizer step.

With one copy engine per rank moving one batch at a time, a constant copy ``F`` gives the
steady step (:func:`step_s`)::

    S(k) = max(S0', F, (a - b + F) / k)   S0' = S0 + max(0, plan - output a2a)  (proactive)

and with per-batch, per-rank loads :func:`schedule_step_s` runs the schedule itself (max-plus:
a copy starts when it is issued and the engine is free, a lookup waits for its rows, a
synchronous step for the slowest rank's): a burst that outlasts its window stalls the steps
behind it, a heavy rank stalls everyone, and a depth-1 copy cannot borrow idle engine time
from before its issue (a rolling mean over 2 steps would). With a disk hop ``Dk`` queued
``Kd >= k`` batches ahead, ``S(k) >= max(Dk, (a - b + Dk + F) / Kd)`` too.

``k`` is the *effective* depth: when the cache cannot hold ``k + 1`` batches' rows,
prefetches wait for pins and the counted mean lead is what counts; a mean lead between two
depths mixes their step times in proportion (the batches that waited ran shallower).

:func:`null_step_s` is the model this one must beat in its validation: no parameters, no
schedule (proactive = ``max(100%-cache step, copy x straggler factor)``, reactive =
``100%-cache step + copy``).

:func:`gpu_stage_costs` fills the stages for a GPU system from TorchRec's planner cost model
(lookup bandwidth of a ``fused`` kernel, the backward multiplier, the all-to-all and
all-reduce bandwidth rules), the host link shared with the NIC, host DRAM shared by the GPUs
of a node, and, for NVMe, reads bounded by reads in flight and their latency. Nothing here
measures time.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import numpy as np

from .hardware import GB, HardwareProfile, collective_bandwidth

__all__ = ["StageCosts", "step_s", "schedule_step_s", "null_step_s", "PIPELINES", "DLRMShape", "gpu_stage_costs",
           "GpuRates", "gpu_rates", "window_means", "expected_max", "straggler_factor", "disk_read_s",
           "HOST_TRAFFIC_PER_BYTE"]

#: The pipelines a step can run: this product's lookahead, and TorchRec's prefetch pipeline (depth 1).
PIPELINES = ("proactive", "torchrec")

#: Host DRAM bytes moved per byte copied, by how the rows move. ``staged``: the host
#: planner's CUDA transport (``fetch/cuda.py``) gathers missing rows on the host into pinned
#: staging (read the row, write the staging) and DMAs the staging (read it); a write-back DMAs
#: into staging and scatters it (write, read, write): 3 per byte each way. ``mapped``: the
#: DevicePlanner's row moves (``store/row_moves.py``: a kernel reading and writing the
#: host-mapped tier over PCIe, no staging) and FBGEMM's UVM cache under TorchRec's prefetch
#: pipeline: 1.
HOST_TRAFFIC_PER_BYTE = {"staged": 3.0, "mapped": 1.0}


@dataclass(frozen=True)
class StageCosts:
    """Seconds one rank spends per step in each stage (``copy_s``: one batch's rows on the
    copy engine; ``plan_s``: planning one batch; ``wait_s``: what a lookup that waits for its
    own copy pays on top of it - waking the waiting thread, binding the rows - which a
    prefetched batch never pays; ``disk_s``: one batch's disk reads, for a table on NVMe)."""

    input_a2a_s: float
    forward_s: float
    output_a2a_s: float
    backward_s: float
    allreduce_s: float
    copy_s: float
    plan_s: float = 0.0
    wait_s: float = 0.0
    disk_s: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"StageCosts.{f.name} must be finite and >= 0, got {v!r}")

    @property
    def issue_after_lookup_s(self) -> float:
        """From a step's lookup to the issue of the copy ``k`` batches ahead (this product):
        the rest of the forward, then planning (in the output all-to-all)."""
        return self.forward_s + self.plan_s

    @property
    def main_s(self) -> float:
        """The main thread's step without planning or copies (``S0``)."""
        return self.input_a2a_s + self.forward_s + self.output_a2a_s + self.backward_s + self.allreduce_s

    def window(self, pipeline: str = "proactive") -> Tuple[float, float]:
        """``(a, b)``: seconds into step N at which the pipeline issues the copy of batch
        ``N + k``, and at which batch N needs its own rows (module docstring)."""
        if pipeline == "proactive":
            return self.input_a2a_s + self.forward_s + self.plan_s, self.input_a2a_s
        if pipeline == "torchrec":
            return self.input_a2a_s + self.forward_s + self.output_a2a_s + self.plan_s, 0.0
        raise ValueError(f"pipeline must be one of {PIPELINES}, got {pipeline!r}")

    def prefetched_main_s(self, pipeline: str = "proactive") -> float:
        """The main thread's step when batches are fetched ahead: this product's planning
        shows where it outlasts the output all-to-all; TorchRec's is in the prefetch stream."""
        if pipeline == "torchrec":
            return self.main_s
        return self.main_s + max(0.0, self.plan_s - self.output_a2a_s)

    def to_dict(self) -> Dict[str, float]:
        return asdict(self)


def _check(depth: float, pipeline: str) -> None:
    if depth < 0:
        raise ValueError(f"depth must be >= 0, got {depth!r}")
    if pipeline not in PIPELINES:
        raise ValueError(f"pipeline must be one of {PIPELINES}, got {pipeline!r}")
    if pipeline == "torchrec" and depth > 1:
        raise ValueError(f"TorchRec's prefetch pipeline fetches one batch ahead; depth {depth!r} is not its schedule")


def step_s(costs: StageCosts, depth: float, pipeline: str = "proactive", disk_depth: Optional[int] = None) -> float:
    """Steady-state step time at (effective, possibly mean) prefetch ``depth``; 0 = reactive.
    Every batch costs the same (``costs.copy_s``, ``costs.disk_s``); :func:`schedule_step_s`
    takes per-batch, per-rank loads. ``disk_depth``: batches ahead the disk reads are queued
    (default: ``depth``)."""
    _check(depth, pipeline)
    lo = math.floor(depth)
    if depth != lo:
        # A mean lead between two integers: that share of batches ran one depth deeper than
        # the rest (steps mix, they do not average their leads: at a mean lead of 0.1 nine
        # batches in ten are reactive).
        return (lo + 1 - depth) * step_s(costs, lo, pipeline, disk_depth) + (depth - lo) * step_s(
            costs, lo + 1, pipeline, disk_depth)
    if depth == 0:
        return costs.main_s + costs.plan_s + costs.disk_s + costs.copy_s + costs.wait_s
    a, b = costs.window(pipeline)
    kd = max(int(depth), int(disk_depth or depth))
    f, d = costs.copy_s, costs.disk_s
    bound = max(costs.prefetched_main_s(pipeline), f, d, (a - b + f) / depth)
    if d:
        bound = max(bound, (a - b + d + f) / kd)
    return bound


ArrayLike = Union[float, np.ndarray]


def schedule_step_s(costs: StageCosts, depth: float, loads: Optional[np.ndarray] = None,
                    disk_loads: Optional[np.ndarray] = None, waits: Optional[np.ndarray] = None,
                    pipeline: str = "proactive", disk_depth: Optional[int] = None, main_s: ArrayLike = None,
                    window: Optional[Tuple[ArrayLike, ArrayLike]] = None, passes: int = 3) -> ArrayLike:
    """Mean step time of the pipeline's schedule over per-batch, per-rank loads.

    ``loads[..., r, t]``: seconds rank ``r``'s copy of batch ``t`` takes on its copy engine
    (its latency included; default ``costs.copy_s``); ``disk_loads``: its disk reads (default
    ``costs.disk_s``); ``waits``: a reactive lookup's hand-off (default ``costs.wait_s``).
    Leading dimensions (corners of an uncertainty band) broadcast with ``main_s`` and
    ``window`` when given (defaults from ``costs``). The series repeats ``passes`` times and
    the last pass is measured (steady state, the schedule's own warm-up left out).

    Depth k: the copy of batch t is issued at ``T[t-k] + a`` and starts when the engine is
    free and (NVMe) its disk reads, issued at ``T[t-Kd] + a``, are done; step t's lookup at
    ``T[t] + b`` waits for the slowest rank's copy, and the next lookup comes ``S0'`` after
    it; the issue of a copy follows its step's lookup by ``a - b`` (a stall moves both).
    Reactive: ``S0 + plan + max_r(D + F + W)`` per step. With constant loads this equals
    :func:`step_s` (tested)."""
    _check(depth, pipeline)
    lo = math.floor(depth)
    if depth != lo:
        kw = dict(loads=loads, disk_loads=disk_loads, waits=waits, pipeline=pipeline, disk_depth=disk_depth,
                  main_s=main_s, window=window, passes=passes)
        return (lo + 1 - depth) * schedule_step_s(costs, lo, **kw) + (depth - lo) * schedule_step_s(costs, lo + 1, **kw)
    f = np.asarray(costs.copy_s if loads is None else loads, dtype=float)
    if f.ndim < 2:
        f = f.reshape(f.shape + (1,) * (2 - f.ndim))
    d = np.broadcast_to(np.asarray(costs.disk_s if disk_loads is None else disk_loads, dtype=float), f.shape)
    if depth == 0:
        w = np.broadcast_to(np.asarray(costs.wait_s if waits is None else waits, dtype=float), f.shape)
        base = costs.main_s + costs.plan_s if main_s is None else np.asarray(main_s) + costs.plan_s
        return np.asarray(base) + np.mean(np.max(d + f + w, axis=-2), axis=-1)
    k = int(depth)
    kd = max(k, int(disk_depth or k))
    main = np.asarray(costs.prefetched_main_s(pipeline) if main_s is None else main_s, dtype=float)
    a, b = (costs.window(pipeline) if window is None else window)
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    lead_shape = f.shape[:-2]
    steps = f.shape[-1]
    total = passes * steps
    has_disk = bool(np.any(d))
    gap = a - b  # from a lookup to the issue of the copy k batches ahead (a stall moves both)
    look = np.zeros(lead_shape + (total + 1,))  # lookup of batch t
    look[..., 0] = b
    engine = np.zeros(f.shape[:-1])  # per rank: when its copy engine is free
    disk = np.zeros(f.shape[:-1])
    for t in range(total):
        col = t % steps
        issue = (look[..., t - k] if t >= k else np.zeros(lead_shape)) + gap
        if has_disk:
            d_issue = (look[..., t - kd] if t >= kd else np.zeros(lead_shape)) + gap
            disk = np.maximum(disk, d_issue[..., None]) + d[..., col]
            engine = np.maximum(np.maximum(engine, issue[..., None]), disk) + f[..., col]
        else:
            engine = np.maximum(engine, issue[..., None]) + f[..., col]
        nominal = look[..., t] if t == 0 else look[..., t - 1] + main
        look[..., t] = np.maximum(nominal, np.max(engine, axis=-1))
        look[..., t + 1] = look[..., t] + main
    out = (look[..., total - 1] - look[..., total - 1 - steps]) / steps
    return float(out) if np.ndim(out) == 0 else out


def null_step_s(full_step_s: float, copy_s: float, lead: float) -> float:
    """The parameter-free model the step model must beat: reactive = the run's 100%-cache
    step + one batch's copy; a prefetched batch = the larger of the two (a copy hides
    entirely behind the step, or the engine bounds it). ``copy_s``: the slowest rank's copy
    (the counted straggler factor applied by the caller). A mean lead below 1 mixes them."""
    reactive, ahead = full_step_s + copy_s, max(full_step_s, copy_s)
    if lead <= 0:
        return reactive
    share = min(1.0, lead)
    return (1.0 - share) * reactive + share * ahead


# --------------------------------------------------------------------------------------------
# stragglers: a synchronous step waits for the rank with the most rows to copy


def window_means(loads: Sequence[float], depth: int) -> np.ndarray:
    """Means of ``depth + 1`` consecutive per-step loads of one rank (``depth`` 0: the loads).

    The null model's straggler factor and the reports use it; the step model itself runs
    the schedule (:func:`schedule_step_s`), where a copy cannot start before its issue."""
    x = np.asarray(loads, dtype=float)
    if depth < 0:
        raise ValueError(f"depth must be >= 0, got {depth!r}")
    w = int(depth) + 1
    if x.size < w:
        return np.array([x.mean()]) if x.size else np.zeros(1)
    c = np.concatenate([[0.0], np.cumsum(x)])
    return (c[w:] - c[:-w]) / w


def expected_max(samples: Sequence[float], n: int) -> float:
    """``E[max]`` of ``n`` independent draws from the empirical distribution of ``samples``
    (exact: ``sum_i x_(i) (F(x_(i))^n - F(x_(i-1))^n)``). ``n`` = 1 gives the mean; it grows
    with ``n`` up to the largest sample (the replay shows nothing beyond it)."""
    x = np.sort(np.asarray(samples, dtype=float))
    if n < 1 or x.size == 0:
        raise ValueError(f"expected_max needs n >= 1 and samples, got n={n!r}, {x.size} samples")
    cdf = np.arange(1, x.size + 1) / x.size
    prev = np.concatenate([[0.0], cdf[:-1]])
    return float(np.sum(x * (cdf ** n - prev ** n)))


def straggler_factor(per_rank_loads: Sequence[Sequence[float]], depth: int, ranks: Optional[int] = None) -> float:
    """The slowest rank's copy per step over the mean rank's, at prefetch ``depth``.

    ``per_rank_loads[r][t]``: bytes (or rows) rank ``r`` copies for batch ``t``. With
    ``ranks`` None, the ranks given are the job's: ``mean_t max_r`` of their ``depth + 1``-step
    means (:func:`window_means`). With ``ranks`` = n, every given series is one draw of a
    rank's load and the job has n such ranks: ``E[max]`` of n window means. >= 1 when every
    rank has the same mean."""
    series = [np.asarray(s, dtype=float) for s in per_rank_loads]
    mean = float(np.mean([s.mean() for s in series])) if series else 0.0
    if mean <= 0:
        return 1.0
    windows = [window_means(s, depth) for s in series]
    if ranks is None:
        length = min(w.size for w in windows)
        return float(np.mean(np.max(np.stack([w[:length] for w in windows]), axis=0)) / mean)
    return expected_max(np.concatenate(windows), ranks) / mean


# --------------------------------------------------------------------------------------------
# a GPU system's stages


@dataclass(frozen=True)
class DLRMShape:
    """The model a GPU projection trains (per GPU, weak scaling: the batch per GPU is fixed).

    Default: the DLRM reference configuration for Criteo Terabyte (facebookresearch/dlrm:
    26 sparse features of dim 128, bottom MLP 13-512-256-128, top MLP 1024-1024-512-256-1,
    dot interaction), at 4096 samples per GPU. ``interaction="dcn"``: DLRM-dcnv2 (MLPerf
    Training's recommendation benchmark since v3.0): a low-rank DCN v2 cross network of
    ``dcn_layers`` layers of rank ``dcn_rank`` over the concatenated features, then the top
    MLP. ``ids_per_feature``: the mean multi-hot size."""

    batch_per_gpu: int = 4096
    num_features: int = 26
    ids_per_feature: float = 1.0
    embedding_dim: int = 128
    bottom_mlp: Tuple[int, ...] = (13, 512, 256, 128)
    top_mlp: Tuple[int, ...] = (1024, 1024, 512, 256, 1)
    interaction: str = "dot"
    dcn_layers: int = 3
    dcn_rank: int = 512

    def __post_init__(self) -> None:
        if self.bottom_mlp[-1] != self.embedding_dim:
            raise ValueError(f"bottom_mlp must end in embedding_dim={self.embedding_dim}, got {self.bottom_mlp}")
        if self.interaction not in ("dot", "dcn"):
            raise ValueError(f"interaction must be 'dot' or 'dcn', got {self.interaction!r}")

    @property
    def _concat(self) -> int:
        return (self.num_features + 1) * self.embedding_dim

    def _layers(self) -> Sequence[Tuple[int, int]]:
        n = self.num_features + 1  # the sparse features and the bottom MLP's output
        if self.interaction == "dot":
            top_in = self.embedding_dim + n * (n - 1) // 2
            cross: list = []
        else:
            top_in = self._concat
            # each low-rank cross layer: V (d -> r) then U (r -> d)
            cross = [(self._concat, self.dcn_rank), (self.dcn_rank, self._concat)] * self.dcn_layers
        top = (top_in, *self.top_mlp)
        return list(zip(self.bottom_mlp, self.bottom_mlp[1:])) + cross + list(zip(top, top[1:]))

    @property
    def dense_param_bytes(self) -> float:
        return 4.0 * sum(i * o + o for i, o in self._layers())

    @property
    def dense_flops_per_sample(self) -> float:
        """Forward multiply-adds of the MLPs (and cross layers), as FLOPs (the interaction's
        element-wise work is negligible)."""
        return 2.0 * sum(i * o for i, o in self._layers())

    @property
    def ids_per_step(self) -> float:
        return self.batch_per_gpu * self.num_features * self.ids_per_feature

    def to_dict(self) -> Dict[str, Any]:
        return {**asdict(self), "dense_param_bytes": self.dense_param_bytes,
                "dense_flops_per_sample": self.dense_flops_per_sample}


@dataclass(frozen=True)
class GpuRates:
    """Per-row costs of one rank's copies and disk reads (what a batch's load turns into):
    a copy of ``n`` rows takes ``copy_latency_s + n * copy_s_per_row`` on the copy engine (a
    fetched row and its write-back counted together: ``rows`` are fetched rows, each evicting
    ``writeback_per_fetch`` dirty rows); ``n`` disk reads take :func:`disk_read_s`."""

    copy_latency_s: float
    copy_s_per_row: float
    #: what bounds the copy: "link" (the host link, less what the NIC takes), "host DRAM"
    copy_bound: str
    link_gbps: float
    dram_gbps_per_gpu: float
    disk_latency_s: float = 0.0
    disk_reads_in_flight: float = 0.0
    disk_max_reads_per_s: float = 0.0

    def copy_s(self, rows: ArrayLike) -> ArrayLike:
        rows = np.asarray(rows, dtype=float)
        out = np.where(rows > 0, self.copy_latency_s + rows * self.copy_s_per_row, 0.0)
        return float(out) if out.ndim == 0 else out

    def disk_s(self, reads: ArrayLike) -> ArrayLike:
        return disk_read_s(reads, self.disk_latency_s, self.disk_reads_in_flight, self.disk_max_reads_per_s)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def disk_read_s(reads: ArrayLike, latency_s: float, in_flight: float, max_reads_per_s: float) -> ArrayLike:
    """Seconds for ``reads`` random page reads queued together, with at most ``in_flight``
    outstanding: Little's law, ``reads`` in ``ceil(reads / q)`` waves of one latency each,
    ``q = min(reads, in_flight)``, never faster than the device's ``max_reads_per_s``. A tier
    whose reads are latency- and reads/s-bound (NVMe: a 4 KiB read for a 516-byte row) is
    modelled by reads in flight, not by bandwidth."""
    r = np.asarray(reads, dtype=float)
    if latency_s <= 0 or in_flight <= 0:
        out = np.zeros_like(r)
    else:
        waves = np.ceil(np.maximum(r, 0.0) / in_flight)
        out = np.where(r > 0, np.maximum(waves * latency_s, r / max_reads_per_s if max_reads_per_s else 0.0), 0.0)
    return float(out) if out.ndim == 0 else out


def _parts(profile: HardwareProfile, shape: DLRMShape, world_size: int, overhead_s: Optional[float]) -> Dict[str, float]:
    from torchrec.distributed.planner.constants import BWD_COMPUTE_MULTIPLIER, kernel_bw_lookup

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r}")
    per_ms = GB / 1e3
    lookup_bw = kernel_bw_lookup("cuda", "fused", profile.hbm_gbps * per_ms, profile.hbm_gbps * per_ms,
                                 profile.copy_gbps * per_ms) * 1e3  # bytes/ms -> bytes/s
    ids = shape.ids_per_step
    pooled_bytes = shape.batch_per_gpu * shape.num_features * shape.embedding_dim * 4
    lookup_s = ids * shape.embedding_dim * 4 / lookup_bw
    dense_fwd_s = shape.batch_per_gpu * shape.dense_flops_per_sample / (profile.dense_tflops * 1e12 * profile.dense_efficiency)
    if world_size > 1:
        a2a_bw = collective_bandwidth(profile, world_size, "all_to_all")
        share = (world_size - 1) / world_size  # what leaves the rank
        input_a2a = profile.collective_latency_s + share * ids * 16 / a2a_bw  # int64 ids + lengths
        output_a2a = profile.collective_latency_s + share * pooled_bytes / a2a_bw
        ar_bw = collective_bandwidth(profile, world_size, "all_reduce")
        allreduce = profile.collective_latency_s + 2 * share * shape.dense_param_bytes / ar_bw
    else:
        input_a2a = output_a2a = allreduce = 0.0
    overhead = profile.step_overhead_s if overhead_s is None else overhead_s
    # The fixed per-step cost (launches, the Python pipeline, host syncs) falls where the
    # kernels are launched: a third in the forward, two thirds in the backward and the
    # optimizer step (BWD_COMPUTE_MULTIPLIER = 2 kernels' worth), not all before the lookup.
    fwd_share = 1.0 / (1.0 + BWD_COMPUTE_MULTIPLIER)
    forward = lookup_s + dense_fwd_s + fwd_share * overhead
    backward = BWD_COMPUTE_MULTIPLIER * (lookup_s + dense_fwd_s) + output_a2a + (1 - fwd_share) * overhead
    return {"input_a2a_s": input_a2a, "forward_s": forward, "output_a2a_s": output_a2a, "backward_s": backward,
            "allreduce_s": allreduce, "lookup_s": lookup_s, "dense_fwd_s": dense_fwd_s}


def gpu_rates(profile: HardwareProfile, shape: DLRMShape, world_size: int, writeback_per_fetch: float = 1.0,
              moves: str = "mapped", overhead_s: Optional[float] = None) -> GpuRates:
    """Per-row copy and disk costs of one rank on ``world_size`` GPUs of ``profile``.

    The copy of a fetched row (``row_bytes``) and of the ``writeback_per_fetch`` dirty rows it
    evicts moves at the slowest of:

    * the host link: fetches and write-backs one per direction when ``full_duplex``, at the
      achievable copy figure, or what the link's capacity (``host_link_capacity_gbps``)
      leaves when the NIC shares it (DGX H100/H200 across nodes: GPUDirect RDMA of the
      inter-node collectives, for the share of the step they keep the NIC busy; an override
      of the copy figure alone is never cut below itself by it);
    * host DRAM shared by the GPUs on one memory (``gpus_per_host_memory``): every GPU of the
      node copies in the same steps, at :data:`HOST_TRAFFIC_PER_BYTE` DRAM bytes per byte of
      ``moves`` ("mapped": device-planned moves and FBGEMM's UVM cache; "staged": the host
      planner's transport through pinned staging).

    NVMe (``profile.nvme_latency_s``): reads of one page per row, at most
    ``nvme_reads_in_flight`` outstanding per GPU, at most ``nvme_max_reads_per_s`` per drive."""
    p = _parts(profile, shape, world_size, overhead_s)
    row_bytes = shape.embedding_dim * 4 + 4  # fp32 row + its row-wise Adagrad state
    fetch_b, back_b = row_bytes, row_bytes * writeback_per_fetch
    moved = max(fetch_b, back_b) if profile.full_duplex else fetch_b + back_b
    link = profile.copy_gbps * GB
    if profile.nic_shares_host_link and world_size > profile.gpus_per_node:
        main = sum(p[k] for k in ("input_a2a_s", "forward_s", "output_a2a_s", "backward_s", "allreduce_s"))
        nic_busy = min(1.0, (p["input_a2a_s"] + 2 * p["output_a2a_s"] + p["allreduce_s"]) / main) if main else 0.0
        capacity = (profile.host_link_capacity_gbps or profile.host_link_achievable_gbps or profile.host_link_gbps) * GB
        link = min(link, max(0.05 * capacity, capacity - nic_busy * profile.nic_gbps * GB))
    sharing = max(1, min(world_size, profile.gpus_per_host_memory))
    dram = profile.host_dram_gbps * GB / sharing if profile.host_dram_gbps else float("inf")
    per_row_link = moved / link
    if moves not in HOST_TRAFFIC_PER_BYTE:
        raise ValueError(f"moves must be one of {tuple(HOST_TRAFFIC_PER_BYTE)}, got {moves!r}")
    per_row_dram = (fetch_b + back_b) * HOST_TRAFFIC_PER_BYTE[moves] / dram
    return GpuRates(copy_latency_s=profile.host_link_latency_s, copy_s_per_row=max(per_row_link, per_row_dram),
                    copy_bound="host DRAM" if per_row_dram > per_row_link else "link", link_gbps=link / GB,
                    dram_gbps_per_gpu=dram / GB, disk_latency_s=profile.nvme_latency_s,
                    disk_reads_in_flight=profile.nvme_reads_in_flight, disk_max_reads_per_s=profile.nvme_max_reads_per_s)


def gpu_stage_costs(profile: HardwareProfile, shape: DLRMShape, world_size: int, fetched_rows_per_id: float,
                    written_back_rows_per_id: float, plan_s_per_id: float, copy_factor: float = 1.0,
                    moves: str = "mapped", overhead_s: Optional[float] = None,
                    disk_reads_per_id: float = 0.0) -> StageCosts:
    """One rank's stage costs on ``world_size`` GPUs of ``profile`` (mean loads).

    Weak scaling with the tables spread evenly: each rank looks up ``shape.ids_per_step``
    ids a step and sends/receives that many ids and pooled rows. TorchRec's planner rules:
    lookups at the ``fused`` kernel's device bandwidth (``kernel_bw_lookup``), backward =
    ``BWD_COMPUTE_MULTIPLIER`` x forward, collectives at ``comms_bandwidths.get_bw`` (on the
    profile's achievable network figure). The fixed per-step ``overhead_s`` (default: the
    profile's) is split a third to the forward, two thirds to the backward. The copy: see
    :func:`gpu_rates`. ``copy_factor``: the slowest rank's copy over the mean rank's."""
    if not copy_factor >= 1.0:
        raise ValueError(f"copy_factor must be >= 1 (the slowest rank over the mean), got {copy_factor!r}")
    p = _parts(profile, shape, world_size, overhead_s)
    ids = shape.ids_per_step
    wb = written_back_rows_per_id / fetched_rows_per_id if fetched_rows_per_id else 0.0
    rates = gpu_rates(profile, shape, world_size, wb, moves, overhead_s)
    rows = ids * fetched_rows_per_id * copy_factor
    if not fetched_rows_per_id and written_back_rows_per_id:
        rates = gpu_rates(profile, shape, world_size, 1.0, moves, overhead_s)
        rows = ids * written_back_rows_per_id * copy_factor
    copy = rates.copy_s(rows) if rows else 0.0
    disk = rates.disk_s(ids * disk_reads_per_id * copy_factor) if disk_reads_per_id else 0.0
    return StageCosts(input_a2a_s=p["input_a2a_s"], forward_s=p["forward_s"], output_a2a_s=p["output_a2a_s"],
                      backward_s=p["backward_s"], allreduce_s=p["allreduce_s"], copy_s=copy,
                      plan_s=ids * plan_s_per_id, disk_s=disk)
