"""Checkpoint on SIGTERM: what a scheduler sends before it takes the nodes away.

Slurm sends SIGTERM to every process of a job it preempts, requeues (``scontrol requeue``)
or cancels (``scancel``), and SIGKILL ``KillWait`` seconds later (30 s by default);
torchrun forwards SIGTERM to its workers when it is itself stopped. A trainer that
checkpoints in that window loses nothing: the requeued or resubmitted job resumes from the
step it stopped at (``train.resume=true``).

The handler only raises a flag; the trainer asks :meth:`StopOnSignal.agreed` at steps every
rank reaches together, so that all ranks stop after the same step and save one consistent,
collective checkpoint, whichever rank the signal reached first.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import torch
import torch.distributed as dist

EXIT_CODE = 128 + signal.SIGTERM  # what a process killed by SIGTERM reports (143)


class StopOnSignal:
    """Traps SIGTERM while installed (main thread only: Python delivers signals there)."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.received = False
        self._previous: Any = None
        self._installed = threading.current_thread() is threading.main_thread()
        if self._installed:
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = True

    def agreed(self) -> bool:
        """Collective (all ranks, same step): True on every rank once any rank got SIGTERM."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.received
        flag = torch.tensor([1 if self.received else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def close(self) -> None:
        """Puts the previous handler back."""
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False
