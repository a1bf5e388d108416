"""CUDA transport: a dedicated copy stream, reused pinned staging, events.

A ticket's data moves in three parts, all FIFO on one worker thread and one copy stream:

1. *write back* dirty victims: gather their cache rows on the copy stream into a device
   staging buffer, copy it into pinned host staging, synchronise, scatter into the host tier;
2. *gather* the missing rows on the host into pinned staging (a CPU ``index_select``);
3. *fill*: copy the staging to the device (async) and scatter into the victim slots.

Stream fences, as a timeline (compute stream C, copy stream X, worker thread W, main M)::

    1. M  plan(N+k): picks victims - slots no in-flight batch pins.
    2. M  issue: records event E_ready on C. Every kernel that last updated a victim slot
          (the backward of an earlier batch) was enqueued on C before E_ready.
    3. W  X.wait_event(E_ready): the write-back gather cannot read a victim slot before its
          last update ran, nor can the fill overwrite it.
    4. W  write back (synchronise X: the host scatter needs the bytes), gather, H2D, scatter;
          record E_done on X. The pinned staging of ticket t is rewritten only after the
          H2D of ticket t-1 completed (W synchronises on it first), so no copy reads a
          half-overwritten buffer.
    5. M  forward(N+k): C.wait_event(E_done) before the lookup reads the slots.
    6. M  backward(N+k) updates the slots on C; the slots stay pinned until then, so no
          later ticket picks them as victims (step 1) while those kernels are pending.

Nothing here imports TorchRec.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from .engine import Ticket, Transport


class _PinnedStaging:
    """Pinned host arenas, one per (dtype, row width), reused across tickets.

    ``begin()`` starts a ticket; each ``get`` returns a slice that does not overlap the
    slices handed out since, so several tables' copies can be in flight at once. An arena
    that must grow is replaced; the old one stays alive for copies still reading it
    (PyTorch's pinned allocator records the streams that use a block).
    """

    def __init__(self) -> None:
        self._arenas: Dict[Any, torch.Tensor] = {}
        self._cursor: Dict[Any, int] = {}
        self.allocations = 0

    def begin(self) -> None:
        self._cursor.clear()

    def get(self, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        key = (dtype, width)
        start = self._cursor.get(key, 0)
        arena = self._arenas.get(key)
        if arena is None or arena.shape[0] < start + rows:
            capacity = max(start + rows, 2 * (0 if arena is None else arena.shape[0]), 1024)
            arena = torch.empty((capacity, width), dtype=dtype, pin_memory=True)
            self._arenas[key] = arena
            self.allocations += 1
            start = 0
        self._cursor[key] = start + rows
        return arena[start: start + rows]


class CudaStreamTransport(Transport):
    """Copies on a dedicated CUDA stream (see the module docstring for the fences)."""

    kind = "cuda"
    asynchronous = True

    def __init__(self, device: torch.device) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaStreamTransport needs CUDA")
        self.device = torch.device(device)
        self.copy_stream = torch.cuda.Stream(device=self.device)
        self.staging = _PinnedStaging()
        self._last_h2d: Optional[torch.cuda.Event] = None

    def prepare(self, ticket: Ticket) -> None:
        ticket.ready_event = torch.cuda.current_stream(self.device).record_event()

    @torch.no_grad()
    def run(self, ticket: Ticket) -> None:
        stream = self.copy_stream
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            stream.wait_event(ticket.ready_event)
            if self._last_h2d is not None:
                self._last_h2d.synchronize()  # the previous ticket's H2D still reads staging
            self.staging.begin()
            for plan in ticket.plans:
                self._write_back(plan)
                plan.stage = "written_back"
            self.staging.begin()  # write-backs were synchronous: their staging is free
            for plan in ticket.plans:
                self._fill(plan)
                # "done" means enqueued on the copy stream: a later CUDA error surfaces at
                # the consumer's event wait, not as a partial move the store could undo.
                plan.stage = "done"
            self._last_h2d = stream.record_event()
            ticket.device_event = self._last_h2d

    def complete(self, ticket: Ticket) -> None:
        if ticket.device_event is not None:
            torch.cuda.current_stream(self.device).wait_event(ticket.device_event)

    def _tensors(self, plan: Any) -> List[tuple]:
        t = plan.table
        pairs = [(t.host_weight, t.cache_weight)]
        pairs += [(t.host_state[k], t.cache_state[k]) for k in t.host_state]
        return pairs

    def _write_back(self, plan: Any) -> None:
        n = int(plan.writeback_slots.numel())
        if n == 0:
            return
        slots = plan.writeback_slots.to(self.device, non_blocking=True)
        for host, cache in self._tensors(plan):
            flat = cache.view(cache.shape[0], -1)
            staged = self.staging.get(n, flat.shape[1], flat.dtype)
            staged.copy_(flat.index_select(0, slots), non_blocking=True)
            self.copy_stream.synchronize()  # the host scatter below reads `staged`
            host.view(host.shape[0], -1)[plan.writeback_rows] = staged

    def _fill(self, plan: Any) -> None:
        n = int(plan.fill_rows.numel())
        if n == 0:
            return
        slots = plan.fill_slots.to(self.device, non_blocking=True)
        for host, cache in self._tensors(plan):
            hflat = host.view(host.shape[0], -1)
            staged = self.staging.get(n, hflat.shape[1], hflat.dtype)
            torch.index_select(hflat, 0, plan.fill_rows, out=staged)
            rows = staged.to(self.device, non_blocking=True)
            cache.view(cache.shape[0], -1).index_copy_(0, slots, rows)

    def describe(self) -> Dict[str, Any]:
        return {"kind": self.kind, "device": str(self.device), "pinned_allocations": self.staging.allocations}
