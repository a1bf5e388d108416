"""The result line of a training run: one JSON object that ``torchrec-proactive train`` and
``examples/dlrm_criteo/train.py`` print as the last line on stdout (rank 0 only).

    torchrec-proactive train experiment=ci_tiny | tail -n 1 | python -m json.tool

The keys are the fields of :class:`TrainResult`, in order; a missing value is ``null``
(never ``NaN``, which is not JSON).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Mapping, Optional


def _number(value: Any) -> Optional[float]:
    return None if value is None or (isinstance(value, float) and not math.isfinite(value)) else float(value)


def _clean(value: Any) -> Any:
    return _number(value) if isinstance(value, float) else value


@dataclass
class TrainResult:
    """What a training run reports; the schema of the final JSON line."""

    steps: int
    """Training steps done in total, counted across resumes in this run's steps (a checkpoint
    written on another world size counts as the samples it holds)."""
    prefetch_depth: int
    """Prefetch depth at the end (with ``prefetch=auto``: the depth it chose; 0 = reactive)."""
    train_loss: Optional[float]
    """Mean training loss over rank 0's last log window; ``null`` if no step was ever trained."""
    auroc: Optional[float]
    """AUROC on the held-out split at the last evaluation; ``null`` with ``train.eval=false``."""
    logloss: Optional[float]
    """Log loss on the held-out split at the last evaluation; ``null`` with ``train.eval=false``."""
    samples_per_s: Optional[float]
    """Steady-state training throughput, all ranks together (after the first steps)."""
    stall_ms_per_step: Optional[float]
    """Steady-state time per step spent waiting for embedding rows to arrive, per rank."""
    hit_rate: Optional[float]
    """Steady-state fraction of looked-up rows found in the device cache."""
    evals: List[Dict[str, Any]] = field(default_factory=list)
    """Every evaluation of the run: ``{"step", "epoch", "auroc", "logloss", "samples"}``."""
    checkpoint: Optional[str] = None
    """The last complete checkpoint directory (``<output_dir>/checkpoints/step_<n>``), if any."""
    output_dir: Optional[str] = None
    """The run directory (``train.output_dir``): logs, metrics, config and checkpoints."""
    resumed_from: Optional[str] = None
    """The checkpoint this run continued from (``train.resume=true``), else ``null``."""
    already_finished: bool = False
    """``true`` when ``train.resume=true`` found the run already complete: nothing was
    trained, and the figures above are that run's final ones."""

    @classmethod
    def from_summary(cls, summary: Mapping[str, Any]) -> "TrainResult":
        """From a rank's :class:`~torchrec_proactive.app.loop.Summary` (as a dict, which is
        what ranks return)."""
        last = summary["evals"][-1] if summary.get("evals") else {}
        steady = summary.get("steady") or {}
        return cls(
            steps=int(summary["steps"]), prefetch_depth=int(summary["depth"]),
            train_loss=_number(summary.get("train_loss")), auroc=_number(last.get("auroc")),
            logloss=_number(last.get("logloss")), samples_per_s=_number(steady.get("samples_per_s")),
            stall_ms_per_step=_number(steady.get("stall_ms_per_step")), hit_rate=_number(steady.get("hit_rate")),
            evals=[{k: _clean(v) for k, v in e.items()} for e in summary.get("evals") or []],
            checkpoint=summary.get("last_checkpoint"),
            output_dir=summary.get("output_dir"), resumed_from=summary.get("resumed_from"),
            already_finished=bool(summary.get("already_finished", False)),
        )

    def to_json(self) -> str:
        """One line of strict JSON (``allow_nan=False``: missing values are ``null``)."""
        return json.dumps(asdict(self), allow_nan=False, default=str)
