"""A counter kept on the device and read on the host without waiting for it.

Device-side checks (non-finite gradients, ids out of range) cannot raise where they run
without a host read, which would stall the training thread. They add to an
:class:`AsyncCount` instead; ``poll()`` returns what reached the host since the last poll.
On CUDA the count is copied into pinned memory behind the work already queued on the
current stream, and that copy is read at a later poll once its event has passed, so a
problem is reported a step or so late and never costs a wait.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch


def _pinned_scalar() -> torch.Tensor:
    return torch.empty((), dtype=torch.int64, pin_memory=True)


def _record_event(device: torch.device) -> Any:
    return torch.cuda.current_stream(device).record_event()


class AsyncCount:
    """An int64 count on ``device``; ``add`` is a device op, ``poll`` never blocks.

    On CUDA one pinned host scalar, allocated at the first poll, receives every read-back:
    a new copy is queued only once the previous one has been read, so it is never
    overwritten under a pending copy, and polling allocates nothing (``allocations``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.value = torch.zeros((), dtype=torch.int64, device=self.device)
        self._seen = 0
        self._copy: Optional[Tuple[torch.Tensor, Any]] = None
        self._buffer: Optional[torch.Tensor] = None
        self.allocations = 0
        # Read back through events (CUDA) rather than directly (CPU); fake tensors: neither.
        self._evented = self.device.type == "cuda" and torch.cuda.is_available()

    def add(self, amount: torch.Tensor) -> None:
        self.value.add_(amount)  # (a bool or integer amount: added as int64, no cast of its own)

    def poll(self) -> int:
        """How much the count grew since the last poll, as far as the host can tell now."""
        if self._evented:
            total = self._seen
            if self._copy is not None and self._copy[1].query():
                total = int(self._copy[0])
                self._copy = None
            if self._copy is None:
                if self._buffer is None:
                    self._buffer = _pinned_scalar()
                    self.allocations += 1
                self._buffer.copy_(self.value, non_blocking=True)
                self._copy = (self._buffer, _record_event(self.device))
        elif self.device.type == "cpu":
            total = int(self.value)
        else:  # fake tensors (sync_detector): there is nothing to read
            return 0
        grown, self._seen = total - self._seen, total
        return grown
