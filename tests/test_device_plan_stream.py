"""On a GPU the device planner plans on its own stream, ordered by events (issue 44, item 3):
shown on fake CUDA tensors with a model of CUDA's streams that records which stream each op
ran on and every wait and event (``store/plan_stream.py``)."""

from __future__ import annotations

import contextlib
from typing import Any, List

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchrec_proactive.store import OptimizerConfig, OptimType, TieredTable, plan_device_batch
from torchrec_proactive.store import lookup as lookup_module
from torchrec_proactive.store.plan_graphs import graph_region
from torchrec_proactive.store.plan_stream import StreamOps
from torchrec_proactive.store.sync_detector import fake_cuda


class _Streams(StreamOps):
    def __init__(self) -> None:
        self.current_name = "compute"
        self.log: List[tuple] = []
        self.events = 0

    def applies_to(self, ids: torch.Tensor) -> bool:
        return True

    def current(self, device: Any) -> str:
        return self.current_name

    def new(self, device: Any) -> str:
        return "plan"

    @contextlib.contextmanager
    def use(self, stream: str):
        previous, self.current_name = self.current_name, stream
        try:
            yield
        finally:
            self.current_name = previous

    def wait_stream(self, waiter: str, waitee: str) -> None:
        self.log.append(("wait_stream", waiter, waitee))

    def record(self, stream: str) -> tuple:
        self.events += 1
        event = ("event", stream, self.events)
        self.log.append(("record", stream, event))
        return event

    def wait_event(self, stream: str, event: tuple) -> None:
        self.log.append(("wait_event", stream, event))

    def hand_over(self, tensor: torch.Tensor, stream: str) -> None:
        self.log.append(("hand_over", stream))


class _Ops(TorchDispatchMode):
    def __init__(self, streams: _Streams) -> None:
        super().__init__()
        self.streams = streams

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in torch.utils._pytree.tree_leaves(
                (args, kwargs, out))):
            self.streams.log.append(("op", self.streams.current_name, str(func), graph_region() is not None))
        return out


def test_plans_run_on_their_own_stream_ordered_by_events():
    streams = _Streams()
    with fake_cuda() as guard:
        with guard.setup():
            table = TieredTable("t", torch.empty(100_000, 8), OptimizerConfig(OptimType.EXACT_ROWWISE_ADAGRAD),
                                num_slots=20_000, device="cuda", planner="device")
        table.planner.streams = streams
        with _Ops(streams):
            steps = []
            for _ in range(3):
                start = len(streams.log)
                tb = plan_device_batch(table, torch.empty(4096, dtype=torch.int64, device="cuda"),
                                       torch.arange(0, 4097, 4, device="cuda"))
                planned = len(streams.log)
                out = lookup_module.pool_group([tb], [None])[0]
                lookup_module.update_group([tb], [None], [torch.ones_like(out)], [])
                steps.append((start, planned, tb.plan))
    log = streams.log
    # The first plan (the preload's) runs eagerly on the owner stream; the others on P.
    assert steps[0][2].planned_event is None
    ends = [start for start, _, _ in steps[1:]] + [len(log)]
    for (start, planned, plan), end in zip(steps[1:], ends[1:]):
        part = log[start:planned]
        ops = [e for e in part if e[0] == "op"]
        on_plan = [e for e in ops if e[1] == "plan"]
        # Every kernel of the plan's graph, and the lookup recipe after it, ran on P ...
        assert all(e[1] == "plan" for e in ops if e[3]) and len(on_plan) > 30
        assert all(e[1] == "plan" for e in ops if e[2] in ("aten.index_select.default", "aten.diff.default")), ops
        # ... after P waited for everything the owner stream had queued, ...
        first = next(i for i, e in enumerate(part) if e[0] == "op" and e[1] == "plan")
        assert ("wait_stream", "plan", "compute") in part[:first]
        # ... its outputs handed to the owner stream, and its event the last one recorded on P.
        assert sum(e == ("hand_over", "compute") for e in part) >= 8
        records = [e[2] for e in part if e[0] == "record"]
        assert records and plan.planned_event == records[-1]
        # The owner stream's lookup and update come after; the release waits for the plan's
        # event before it unpins (a release of a plan never waited for is ordered too).
        after = log[planned:end]
        assert all(e[1] == "compute" for e in after if e[0] == "op")
        assert ("wait_event", "compute", plan.planned_event) in after


def test_the_copy_stream_waits_for_the_plans_event():
    from types import SimpleNamespace

    from torchrec_proactive.fetch.cuda import CudaStreamTransport

    waited = []
    stream = SimpleNamespace(wait_event=waited.append)
    ticket = SimpleNamespace(ready_event="E_ready", plans=[SimpleNamespace(planned_event="E_plan"),
                                                            SimpleNamespace(planned_event=None)])
    CudaStreamTransport._wait_for_plans(stream, ticket)
    assert waited == ["E_ready", "E_plan"]
