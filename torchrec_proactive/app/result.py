"""The result of a training run: one JSON object that ``torchrec-proactive train`` and
``examples/dlrm_criteo/train.py`` print as the last line on stdout (rank 0 only), and that
rank 0 writes to ``<train.output_dir>/result.json``.

    torchrec-proactive train experiment=ci_tiny | tail -n 1 | python -m json.tool

The keys are the fields of :class:`TrainResult`, in order; a missing value is ``null``
(never ``NaN``, which is not JSON).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
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
    rows_fetched_per_step: Optional[float] = None
    """Steady-state rows copied from the host tier into the caches per step, per rank."""
    rows_fetched_at_lookup_per_step: Optional[float] = None
    """Of those, rows copied while their lookup waited (on the critical path): all of them at
    depth 0; at depth >= 1 only the first batch after each drain (epoch end, evaluation,
    checkpoint) and batches whose prefetch waited for cache room until their lookup. Close
    to ``rows_fetched_per_step`` at depth >= 1: the run fell back to reactive fetching (a
    warning says so, and which setting to change)."""
    deferred_batches: Optional[int] = None
    """Steady-state prefetches that waited for cache room (the rows ``depth + 1`` batches pin
    did not fit), counted by every rank's modules; 0 when prefetching kept its depth."""
    overflow_rows_per_step: Optional[float] = None
    """Steady-state rows per step and rank served from the host tier because a batch did not
    fit in the cache even at its lookup."""
    fell_back: bool = False
    """``true`` when a run meant to prefetch (depth >= 1) fetched more than 5% of its
    steady-state rows at their lookup because prefetches waited for cache room: it ran
    mostly reactive, whatever ``prefetch_depth`` says (the run's warning names the fix)."""
    cache_slots: Dict[str, int] = field(default_factory=dict)
    """Per proactive table, the rows its cache holds (all ranks: row-wise shards summed)."""
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
            rows_fetched_per_step=_number(steady.get("rows_fetched_per_step")),
            rows_fetched_at_lookup_per_step=_number(steady.get("rows_fetched_at_lookup_per_step")),
            deferred_batches=None if steady.get("deferred_batches") is None else int(steady["deferred_batches"]),
            overflow_rows_per_step=_number(steady.get("overflow_rows_per_step")),
            fell_back=bool(steady.get("fell_back", False)),
            cache_slots={str(k): int(v) for k, v in (summary.get("cache_slots") or {}).items()},
            evals=[{k: _clean(v) for k, v in e.items()} for e in summary.get("evals") or []],
            checkpoint=summary.get("last_checkpoint"),
            output_dir=summary.get("output_dir"), resumed_from=summary.get("resumed_from"),
            already_finished=bool(summary.get("already_finished", False)),
        )

    def to_json(self) -> str:
        """One line of strict JSON (``allow_nan=False``: missing values are ``null``)."""
        return json.dumps(asdict(self), allow_nan=False, default=str)

    def write(self, run_dir: Any) -> Path:
        """``<run_dir>/result.json`` (written whole, then renamed: never half a file)."""
        path = Path(run_dir) / RESULT_FILE
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(self.to_json() + "\n")
        tmp.replace(path)
        return path


#: The run directory's copy of the result line.
RESULT_FILE = "result.json"
