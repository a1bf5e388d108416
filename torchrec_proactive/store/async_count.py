"""A counter kept on the device and read on the host without waiting for it.

Device-side checks (non-finite gradients, ids out of range) cannot raise where they run
without a host read, which would stall the training thread. They add to an
:class:`AsyncCount` instead; ``poll()`` returns what reached the host since the last poll.
On CUDA the count is copied into pinned memory behind the work already queued on the
current stream, and that copy is read at a later poll once its event has passed, so a
problem is reported a step or so late and never costs a wait.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch


class AsyncCount:
    """An int64 count on ``device``; ``add`` is a device op, ``poll`` never blocks."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.value = torch.zeros((), dtype=torch.int64, device=self.device)
        self._seen = 0
        self._copy: Optional[Tuple[torch.Tensor, object]] = None

    def add(self, amount: torch.Tensor) -> None:
        self.value.add_(amount.to(torch.int64))

    def poll(self) -> int:
        """How much the count grew since the last poll, as far as the host can tell now."""
        if self.device.type == "cpu":
            total = int(self.value)
        elif self.device.type == "cuda" and torch.cuda.is_available():
            total = self._seen
            if self._copy is not None and self._copy[1].query():  # type: ignore[attr-defined]
                total = int(self._copy[0])
                self._copy = None
            if self._copy is None:
                buffer = torch.empty((), dtype=torch.int64, pin_memory=True)
                buffer.copy_(self.value, non_blocking=True)
                self._copy = (buffer, torch.cuda.current_stream(self.device).record_event())
        else:  # fake tensors (sync_detector): there is nothing to read
            return 0
        grown, self._seen = total - self._seen, total
        return grown
