"""Evaluation metrics (AUROC, log loss) and the throughput/stall window used in logs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, Optional

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torchmetrics import MeanMetric
from torchmetrics.classification import BinaryAUROC

_STAT_KEYS = ("stall_s", "rows_requested", "hits", "rows_fetched", "bytes_moved")


class EvalMetrics:
    """AUROC and log loss over every rank's held-out predictions (synced at ``compute``)."""

    def __init__(self) -> None:
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
    """Global (all-rank) samples/s, stall per step and hit rate between two marks."""

    world_size: int
    batch_size: int
    start_time: float = field(default_factory=time.perf_counter)
    start_step: int = 0
    start_stats: Dict[str, float] = field(default_factory=dict)

    def reset(self, step: int, stats: Dict[str, float]) -> None:
        self.start_time, self.start_step, self.start_stats = time.perf_counter(), step, dict(stats)

    def read(self, step: int, stats: Dict[str, float]) -> Dict[str, float]:
        """Collective: every rank must call it at the same step."""
        elapsed = time.perf_counter() - self.start_time
        delta = [stats.get(k, 0.0) - self.start_stats.get(k, 0.0) for k in _STAT_KEYS]
        t = torch.tensor(delta + [elapsed], dtype=torch.float64)
        dist.all_reduce(t)
        stall, requested, hits, fetched, moved, elapsed_sum = t.tolist()
        steps = max(step - self.start_step, 1)
        wall = elapsed_sum / self.world_size
        return {
            "steps": step - self.start_step,
            "samples_per_s": steps * self.batch_size * self.world_size / max(wall, 1e-9),
            "step_ms": wall / steps * 1e3,
            "stall_ms_per_step": stall / self.world_size / steps * 1e3,
            "hit_rate": hits / requested if requested else 1.0,
            "rows_fetched_per_step": fetched / steps,
            "mb_moved_per_step": moved / steps / 1e6,
        }


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
