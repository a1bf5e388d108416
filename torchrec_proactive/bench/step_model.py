"""One training step on one rank, reactive or proactive, from the costs of its stages.

A step of batch ``N`` on one rank runs, on the main thread::

    input a2a (ids of N+k+1) | forward N | output a2a N | backward N (+ grad a2a) | all-reduce N

and, on the copy engine, the host -> device copy of the rows some batch misses. Reactive
(depth 0) plans and copies batch N's rows inside ``forward N``: both sit on the critical
path. Proactive at depth ``k`` plans batch ``N+k`` while batch N's output all-to-all is in
flight (only planning that outlasts it shows) and copies its rows behind the next ``k``
steps. With ``S0`` the main thread's step and ``F`` one batch's copy::

    S(0) = S0 + plan + F
    S(k) = max(S0', F, (S0' + F + L) / (k + 1))    S0' = S0 + max(0, plan - output a2a)
                                                   L   = forward + plan

The copy of batch ``N+k`` is issued ``L`` after batch N's lookup (the rest of forward N,
then planning) and must land by the lookup of ``N+k``; the copy engine moves one batch at a
time (at most one batch per ``F``), and a copy that outlasts its window lengthens those very
steps: the stall ``x`` solves ``x = max(0, L + F - k (S0' + x))`` (max-plus algebra of the
schedule; the emulated link of the CPU bench is such an engine). ``k`` is the *effective* depth: when the cache cannot hold
``k + 1`` batches' rows, prefetches wait for pins and the mean lead of a batch (measured by
:mod:`.cache_replay`) is what counts; a lead of 0 is reactive.

:func:`gpu_stage_costs` fills the stages for a GPU system from TorchRec's planner cost
model (lookup bandwidth of a ``fused`` kernel, the backward multiplier, the all-to-all and
all-reduce bandwidth rules) and counted workload figures. Nothing here measures time.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, Sequence, Tuple

from .hardware import GB, HardwareProfile, collective_bandwidth

__all__ = ["StageCosts", "step_s", "DLRMShape", "gpu_stage_costs"]


@dataclass(frozen=True)
class StageCosts:
    """Seconds one rank spends per step in each stage (``copy_s``: one batch's rows on the
    copy engine; ``plan_s``: planning one batch on the host)."""

    input_a2a_s: float
    forward_s: float
    output_a2a_s: float
    backward_s: float
    allreduce_s: float
    copy_s: float
    plan_s: float = 0.0

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
    if depth == 0:
        return costs.main_s + costs.plan_s + costs.copy_s
    main = costs.main_s + max(0.0, costs.plan_s - costs.output_a2a_s)
    return max(main, costs.copy_s, (main + costs.copy_s + costs.issue_after_lookup_s) / (depth + 1))


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
                    written_back_rows_per_id: float, plan_s_per_id: float) -> StageCosts:
    """One rank's stage costs on ``world_size`` GPUs of ``profile``.

    Weak scaling with the tables spread evenly: each rank looks up ``shape.ids_per_step``
    ids a step and sends/receives that many ids and pooled rows. TorchRec's planner rules:
    lookups at the ``fused`` kernel's device bandwidth (``kernel_bw_lookup``), backward =
    ``BWD_COMPUTE_MULTIPLIER`` x forward, collectives at ``comms_bandwidths.get_bw``.
    """
    from torchrec.distributed.planner.constants import BWD_COMPUTE_MULTIPLIER, kernel_bw_lookup

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r}")
    per_ms = GB / 1e3
    lookup_bw = kernel_bw_lookup("cuda", "fused", profile.hbm_gbps * per_ms, profile.hbm_gbps * per_ms,
                                 profile.host_link_gbps * per_ms) * 1e3  # bytes/ms -> bytes/s
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
    row_bytes = shape.embedding_dim * 4 + 4  # fp32 row + its row-wise Adagrad state
    moved = ids * (fetched_rows_per_id + written_back_rows_per_id) * row_bytes
    copy = (profile.host_link_latency_s + moved / (profile.host_link_gbps * GB)) if moved else 0.0
    return StageCosts(
        input_a2a_s=input_a2a, forward_s=lookup_s + dense_fwd_s, output_a2a_s=output_a2a,
        backward_s=BWD_COMPUTE_MULTIPLIER * (lookup_s + dense_fwd_s) + output_a2a,  # + the gradients' a2a
        allreduce_s=allreduce, copy_s=copy, plan_s=ids * plan_s_per_id,
    )
