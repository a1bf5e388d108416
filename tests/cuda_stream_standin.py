"""Synchronous CPU stand-ins for ``torch.cuda``'s streams and events, so that
``CudaStreamTransport``'s worker path (staging, chunks, write-backs, fills, overflow) runs on
a CPU-only machine through its own code, on CPU tensors.

On CPU every op completes when it returns, so a stream is a queue that is always empty:
``wait_event``, ``synchronize`` and ``record_event`` order nothing that is not already in
order. What this proves is the transport's data path - which rows it gathers, stages and
scatters, in which order relative to the store's own hooks, and that the bytes land bit
for bit - not its stream fences (a GPU run does: ``benchmarks/gpu_check.py``). Pinned
allocations become plain ones (a CPU-only torch cannot pin)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


class _Event:
    def __init__(self, enable_timing: bool = False) -> None:
        self.recorded = False

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: "_Event") -> float:
        return 0.0


class _Stream:
    def __init__(self, device: object = None) -> None:
        self.events = 0

    def record_event(self, event: "_Event | None" = None) -> _Event:
        self.events += 1
        event = event or _Event()
        event.recorded = True
        return event

    def wait_event(self, event: _Event) -> None:
        assert event.recorded, "a stream waits for an event nobody recorded"

    def synchronize(self) -> None:
        pass


@contextlib.contextmanager
def cpu_streams(monkeypatch) -> Iterator[None]:
    """Within the block, ``CudaStreamTransport(torch.device('cpu'))`` can be built and run."""
    from torchrec_proactive.fetch import cuda as cuda_transport

    current = _Stream()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(cuda_transport, "_pinned", lambda shape, dtype: torch.empty(shape, dtype=dtype))
    yield
