"""One training step on one rank, reactive or proactive, from the costs of its stages.

A step of batch ``N`` on one rank runs, on the main thread::

    input a2a (ids of N+k+1) | forward N | output a2a N | backward N (+ grad a2a) | all-reduce N

and, on the copy engine, the host -> device copy of the rows some batch misses. Reactive
(depth 0) plans and copies batch N's rows inside ``forward N``: both sit on the critical
path. Proactive at depth ``k`` plans batch ``N+k`` while batch N's output all-to-all is in
flight (only planning that outlasts it shows) and copies its rows behind the next ``k``
steps. With ``S0`` the main thread's step and ``F`` one batch's copy::

    S(0) = S0 + plan + F + W            W: the lookup's own wait for its copy (hand-off)
    S(k) = max(S0', F, (L + F) / k)    S0' = S0 + max(0, plan - output a2a)
                                       L   = forward + plan

The copy of batch ``N+k`` is issued ``L`` after batch N's lookup (the rest of forward N,
then planning) and must land by the lookup of ``N+k``, ``k`` steps later: ``k S >= L + F``.
The copy engine moves one batch at a time (``S >= F``), and a copy that outlasts its window
lengthens those very steps (a stall before each lookup; max-plus algebra of the schedule;
the emulated link of the CPU bench is such an engine). At depth 1 the window is the step
less ``L``: a copy that fills a step without its issue delay still stalls, which is why
depth 2 pays where one batch's copy is about as long as a step (the skewed straggler runs).
``k`` is the *effective* depth: when the cache cannot hold ``k + 1`` batches' rows,
prefetches wait for pins and the mean lead of a batch (measured by :mod:`.cache_replay`) is
what counts; a lead of 0 is reactive, and a mean lead between two depths mixes their step
times in proportion (the batches that waited ran reactive).

Stragglers: a synchronous step waits for the rank with the most rows to copy. Reactive pays
the per-step maximum over ranks of their copies, depth ``k`` the maximum of ``k + 1``-step
means (:func:`straggler_factor`); callers scale the copy by that factor.

:func:`gpu_stage_costs` fills the stages for a GPU system from TorchRec's planner cost
model (lookup bandwidth of a ``fused`` kernel, the backward multiplier, the all-to-all and
all-reduce bandwidth rules) and counted workload figures. Nothing here measures time.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from .hardware import GB, HardwareProfile, collective_bandwidth

__all__ = ["StageCosts", "step_s", "DLRMShape", "gpu_stage_costs", "window_means", "expected_max",
           "straggler_factor"]


@dataclass(frozen=True)
class StageCosts:
    """Seconds one rank spends per step in each stage (``copy_s``: one batch's rows on the
    copy engine; ``plan_s``: planning one batch on the host; ``wait_s``: what a lookup that
    waits for its own copy pays on top of it - waking the waiting thread, binding the
    rows - which a prefetched batch never pays)."""

    input_a2a_s: float
    forward_s: float
    output_a2a_s: float
    backward_s: float
    allreduce_s: float
    copy_s: float
    plan_s: float = 0.0
    wait_s: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"StageCosts.{f.name} must be finite and >= 0, got {v!r}")

    @property
    def issue_after_lookup_s(self) -> float:
        """From a step's lookup to the issue of the copy ``k`` batches ahead: the rest of the
        forward, then planning (in the output all-to-all; the copy is issued when it ends)."""
        return self.forward_s + self.plan_s

    @property
    def main_s(self) -> float:
        """The main thread's step without planning or copies (``S0``)."""
        return self.input_a2a_s + self.forward_s + self.output_a2a_s + self.backward_s + self.allreduce_s

    def to_dict(self) -> Dict[str, float]:
        return asdict(self)


def step_s(costs: StageCosts, depth: float) -> float:
    """Steady-state step time at (effective, possibly mean) prefetch ``depth``; 0 = reactive."""
    if depth < 0:
        raise ValueError(f"depth must be >= 0, got {depth!r}")
    lo = math.floor(depth)
    if depth != lo:
        # A mean lead between two integers: that share of batches ran one depth deeper than
        # the rest (steps mix, they do not average their leads: at a mean lead of 0.1 nine
        # batches in ten are reactive).
        return (lo + 1 - depth) * step_s(costs, lo) + (depth - lo) * step_s(costs, lo + 1)
    if depth == 0:
        return costs.main_s + costs.plan_s + costs.copy_s + costs.wait_s
    main = costs.main_s + max(0.0, costs.plan_s - costs.output_a2a_s)
    return max(main, costs.copy_s, (costs.issue_after_lookup_s + costs.copy_s) / depth)


# --------------------------------------------------------------------------------------------
# stragglers: a synchronous step waits for the rank with the most rows to copy


def window_means(loads: Sequence[float], depth: int) -> np.ndarray:
    """Means of ``depth + 1`` consecutive per-step loads of one rank (``depth`` 0: the loads).

    A prefetch ``depth`` steps ahead has ``depth`` steps of slack: a heavy batch's copy can
    borrow the idle copy-engine time of its neighbours, so what delays the step is the
    mean over ``depth + 1`` batches, not one batch's load (a rolling-mean approximation of
    the copy engine's queue)."""
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
    ``ranks`` None, the ranks given are the job's: ``mean_t max_r`` of their window means
    (:func:`window_means`). With ``ranks`` = n, every given series is one draw of a rank's
    load and the job has n such ranks (independent batches): ``E[max]`` of n window means.
    Reactive (depth 0) pays the per-step maximum; depth ``k`` the maximum of ``k + 1``-step
    means, which falls towards the heaviest rank's mean as ``k`` grows. >= 1 when every rank
    has the same mean; 1 for one rank at any depth only if its load never varies."""
    series = [np.asarray(s, dtype=float) for s in per_rank_loads]
    mean = float(np.mean([s.mean() for s in series])) if series else 0.0
    if mean <= 0:
        return 1.0
    windows = [window_means(s, depth) for s in series]
    if ranks is None:
        length = min(w.size for w in windows)
        return float(np.mean(np.max(np.stack([w[:length] for w in windows]), axis=0)) / mean)
    return expected_max(np.concatenate(windows), ranks) / mean


@dataclass(frozen=True)
class DLRMShape:
    """The model a GPU projection trains (per GPU, weak scaling: the batch per GPU is fixed).

    Default: the DLRM reference configuration for Criteo Terabyte (facebookresearch/dlrm:
    26 sparse features of dim 128, bottom MLP 13-512-256-128, top MLP 1024-1024-512-256-1,
    dot interaction), at 4096 samples per GPU.
    """

    batch_per_gpu: int = 4096
    num_features: int = 26
    ids_per_feature: float = 1.0
    embedding_dim: int = 128
    bottom_mlp: Tuple[int, ...] = (13, 512, 256, 128)
    top_mlp: Tuple[int, ...] = (1024, 1024, 512, 256, 1)

    def __post_init__(self) -> None:
        if self.bottom_mlp[-1] != self.embedding_dim:
            raise ValueError(f"bottom_mlp must end in embedding_dim={self.embedding_dim}, got {self.bottom_mlp}")

    def _layers(self) -> Sequence[Tuple[int, int]]:
        n = self.num_features + 1  # the sparse features and the bottom MLP's output
        top_in = self.embedding_dim + n * (n - 1) // 2
        top = (top_in, *self.top_mlp)
        return list(zip(self.bottom_mlp, self.bottom_mlp[1:])) + list(zip(top, top[1:]))

    @property
    def dense_param_bytes(self) -> float:
        return 4.0 * sum(i * o + o for i, o in self._layers())

    @property
    def dense_flops_per_sample(self) -> float:
        """Forward multiply-adds of the MLPs, as FLOPs (the interaction is negligible)."""
        return 2.0 * sum(i * o for i, o in self._layers())

    @property
    def ids_per_step(self) -> float:
        return self.batch_per_gpu * self.num_features * self.ids_per_feature

    def to_dict(self) -> Dict[str, Any]:
        return {**asdict(self), "dense_param_bytes": self.dense_param_bytes,
                "dense_flops_per_sample": self.dense_flops_per_sample}


def gpu_stage_costs(profile: HardwareProfile, shape: DLRMShape, world_size: int, fetched_rows_per_id: float,
                    written_back_rows_per_id: float, plan_s_per_id: float, copy_factor: float = 1.0) -> StageCosts:
    """One rank's stage costs on ``world_size`` GPUs of ``profile``.

    Weak scaling with the tables spread evenly: each rank looks up ``shape.ids_per_step``
    ids a step and sends/receives that many ids and pooled rows. TorchRec's planner rules:
    lookups at the ``fused`` kernel's device bandwidth (``kernel_bw_lookup``), backward =
    ``BWD_COMPUTE_MULTIPLIER`` x forward, collectives at ``comms_bandwidths.get_bw`` (on the
    profile's achievable network figure). The profile's fixed ``step_overhead_s`` is added
    to the forward. The copy: fetches and write-backs at the achievable host-link figure,
    concurrently when ``full_duplex``; where the NIC shares the GPU's host link, the link
    loses the NIC's bandwidth for the share of the step the inter-node collectives keep it
    busy. ``copy_factor``: the slowest rank's copy over the mean rank's (stragglers,
    :func:`straggler_factor`); the copy's bytes are multiplied by it.
    """
    from torchrec.distributed.planner.constants import BWD_COMPUTE_MULTIPLIER, kernel_bw_lookup

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r}")
    if not copy_factor >= 1.0:
        raise ValueError(f"copy_factor must be >= 1 (the slowest rank over the mean), got {copy_factor!r}")
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
    forward = lookup_s + dense_fwd_s + profile.step_overhead_s
    backward = BWD_COMPUTE_MULTIPLIER * (lookup_s + dense_fwd_s) + output_a2a  # + the gradients' a2a
    row_bytes = shape.embedding_dim * 4 + 4  # fp32 row + its row-wise Adagrad state
    fetch_b = ids * fetched_rows_per_id * row_bytes * copy_factor
    back_b = ids * written_back_rows_per_id * row_bytes * copy_factor
    moved = max(fetch_b, back_b) if profile.full_duplex else fetch_b + back_b
    link_bw = profile.copy_gbps * GB
    if profile.nic_shares_host_link and world_size > profile.gpus_per_node:
        # GPUDirect RDMA of the inter-node collectives crosses the same x16 link as the copies:
        # for the share of the step the NIC is busy, the copies get what it leaves.
        main = input_a2a + forward + output_a2a + backward + allreduce
        nic_busy = min(1.0, (input_a2a + 2 * output_a2a + allreduce) / main) if main else 0.0
        link_bw = max(0.1 * link_bw, link_bw - nic_busy * profile.nic_gbps * GB)
    copy = (profile.host_link_latency_s + moved / link_bw) if moved else 0.0
    return StageCosts(
        input_a2a_s=input_a2a, forward_s=forward, output_a2a_s=output_a2a, backward_s=backward,
        allreduce_s=allreduce, copy_s=copy, plan_s=ids * plan_s_per_id,
    )
