"""The device planner's own CUDA stream (issue 44, item 3).

A plan is ~145 graph nodes, three of them full 64-bit sorts. On the compute stream they
would run in line with the forward and backward of the batches before it; FBGEMM runs its
prefetch on a stream of its own. So the device planner plans on its own stream ``P``,
ordered by events, never by a device-wide wait::

    1. M  plan(N+k): P.wait_stream(C) - everything the compute stream C queued so far (the
          updates, dirty marks and unpins of released batches) precedes the plan, so the
          plan sees the pins and dirty flags the host counted on.
    2. P  the plan (one graph replay), then the batch's lookup recipe (its slots per id);
          an event E_plan recorded on P. Its outputs are handed to C (``record_stream``):
          the allocator does not reuse them while C may still read them.
    3. X  the copy stream waits for E_plan before the plan's moves (fetch/cuda.py), and C
          waits for the moves (E_done) before the lookup: C reads the plan's outputs only
          after E_plan, transitively.
    4. C  the forward and backward of batches N..N+k-1 (queued after the plan, on the host)
          run while P plans N+k; what they write of the bookkeeping (unpins: atomic adds;
          dirty marks of slots the plan cannot pick, being pinned) commutes with it.
    5. C  anything else that reads or writes the bookkeeping (a release, a rollback, a
          flush, a refresh, a reset, a host read of it) first waits for E_plan of its plan,
          or for the last plan on P (``DevicePlanner.after_planning``).

:class:`StreamOps` are the few stream operations this needs; tests replace them with a
model that records which stream each op ran on (there is no CUDA on a CPU machine).
"""

from __future__ import annotations

from typing import Any

import torch


class StreamOps:
    """CUDA's stream operations, as the planner uses them."""

    def applies_to(self, ids: torch.Tensor) -> bool:
        """Whether a plan of ``ids`` runs on the planning stream: not for fake tensors (a
        counting run on a GPU machine: nothing to order)."""
        from torch._subclasses.fake_tensor import FakeTensor

        return not isinstance(ids, FakeTensor)

    def current(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def new(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device=device)

    def use(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def wait_stream(self, waiter: Any, waitee: Any) -> None:
        waiter.wait_stream(waitee)

    def record(self, stream: Any) -> Any:
        return stream.record_event()

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def hand_over(self, tensor: torch.Tensor, stream: Any) -> None:
        """``tensor``, made on another stream, is used on ``stream`` from now on."""
        tensor.record_stream(stream)
