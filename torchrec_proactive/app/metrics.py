"""Evaluation (AUROC, log loss) and the throughput/stall window used in logs."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, Optional

import torch
import torch.distributed as dist
from torch.nn import functional as F
from tqdm import tqdm

_STAT_KEYS = ("stall_s", "rows_requested", "hits", "rows_fetched", "bytes_moved", "rows_fetched_at_lookup",
              "deferred_batches", "overflow_rows", "host_deferred_batches", "host_overflow_batches")


class EvalMetrics:
    """AUROC and log loss over every rank's held-out predictions (synced at ``compute``)."""

    def __init__(self) -> None:
        # (imported here: torchmetrics costs a rank ~0.6 s to import, and a run without
        # evaluation never needs it)
        from torchmetrics import MeanMetric
        from torchmetrics.classification import BinaryAUROC

        self.auroc = BinaryAUROC()
        self.logloss = MeanMetric()
        self.samples = 0

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        logits, labels = logits.detach().float().cpu(), labels.detach().float().cpu()
        self.auroc.update(torch.sigmoid(logits), labels.int())
        self.logloss.update(F.binary_cross_entropy_with_logits(logits, labels, reduction="none"))
        self.samples += int(labels.numel())

    def compute(self) -> Dict[str, float]:
        n = torch.tensor([self.samples], dtype=torch.int64)
        dist.all_reduce(n)
        return {"auroc": float(self.auroc.compute()), "logloss": float(self.logloss.compute()), "samples": int(n)}


@dataclass
class Window:
    """Global (all-rank) samples/s, stall per step and hit rate between two marks, and the
    signs that prefetching fell back: rows fetched at their lookup (on the critical path),
    prefetches that waited for cache room (``deferred_batches``, a count over every rank's
    modules) and rows served from the host tier (``overflow_rows_per_step``).

    Times come from the caller's clock (seconds spent in training steps), so pauses for
    evaluation or checkpoints do not count.
    """

    world_size: int
    batch_size: int
    start_clock: float = 0.0
    start_step: int = 0
    start_stats: Dict[str, float] = field(default_factory=dict)

    def reset(self, step: int, stats: Dict[str, float], clock: float) -> None:
        self.start_clock, self.start_step, self.start_stats = clock, step, dict(stats)

    def read(self, step: int, stats: Dict[str, float], clock: float) -> Dict[str, float]:
        """Collective: every rank must call it at the same step."""
        delta = [stats.get(k, 0.0) - self.start_stats.get(k, 0.0) for k in _STAT_KEYS]
        t = torch.tensor(delta + [clock - self.start_clock], dtype=torch.float64)
        dist.all_reduce(t)
        (stall, requested, hits, fetched, moved, at_lookup, deferred, overflow, host_deferred, host_overflow,
         elapsed_sum) = t.tolist()
        steps = max(step - self.start_step, 1)
        wall = elapsed_sum / self.world_size  # mean over ranks
        return {
            "steps": step - self.start_step,
            "from_step": self.start_step,  # the window is steps (from_step, from_step + steps]
            "samples_per_s": steps * self.batch_size * self.world_size / max(wall, 1e-9),
            "step_ms": wall / steps * 1e3,
            "stall_ms_per_step": stall / self.world_size / steps * 1e3,
            "hit_rate": hits / requested if requested else 1.0,
            "rows_fetched_per_step": fetched / self.world_size / steps,
            "rows_fetched_at_lookup_per_step": at_lookup / self.world_size / steps,
            "deferred_batches": int(deferred),
            "host_deferred_batches": int(host_deferred),  # (of those: a disk table's host cache was full)
            "host_overflow_batches": int(host_overflow),  # (a batch alone outgrew a host cache)
            "overflow_rows_per_step": overflow / self.world_size / steps,
            "mb_moved_per_step": moved / self.world_size / steps / 1e6,
        }


def evaluate(pipeline: Any, model: torch.nn.Module, loader: Any, max_batches: Optional[int],
             progress: bool = False) -> Dict[str, float]:
    """AUROC and log loss of ``model`` over ``loader`` (all ranks), through the pipeline
    (which runs the forward under ``no_grad`` in eval mode)."""
    model.eval()
    metrics = EvalMetrics()
    batches: Iterator[Any] = iter(loader)
    total = len(loader)
    if max_batches:
        batches, total = itertools.islice(batches, max_batches), min(total, max_batches)
    with tqdm(total=total, unit="batch", desc="eval", leave=False, dynamic_ncols=True, mininterval=1.0,
              disable=None if progress else True) as bar:  # None: on a terminal only
        def on_step(out: Any) -> None:
            _, logits, labels = out
            metrics.update(logits, labels)
            bar.update(1)

        run_pipeline(pipeline, batches, on_step)
    model.train()
    return metrics.compute()


def run_pipeline(pipeline: Any, batches: Iterator[Any], on_step: Optional[Any] = None) -> int:
    """Drives ``pipeline`` over ``batches`` until it is drained; returns the step count."""
    steps = 0
    while True:
        try:
            out = pipeline.progress(batches)
        except StopIteration:
            return steps
        steps += 1
        if on_step is not None:
            on_step(out)
