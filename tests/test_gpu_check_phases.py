"""benchmarks/gpu_check.py cannot report a false result (issue 44, item 5): each of its phases
run on the CPU with the counters it reads, against a model of what a GPU does where a CPU
cannot show it."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest
import torch

from torchrec_proactive.store.plan import FetchPlan

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_sync_count_covers_the_steps_and_not_the_drain_after_them(gpu_check, monkeypatch):
    """A GPU's sizes arrive from a copy the host polls (never waits for); only a read that
    waits - ``resolve_sizes``, as a drain does - is a synchronisation. Modelled here: polls
    find nothing landed and every wait warns as CUDA's sync debug mode would. A healthy step
    waits for nothing, so the count must be 0; counting the drain after the loop (what the
    check did) reported 0.125 or more per step and failed the run."""
    real = FetchPlan.resolve_sizes
    waits = []

    def resolve(self):
        if self.sizes is None:
            waits.append(1)
            warnings.warn("called a synchronizing CUDA operation")
        return real(self)

    monkeypatch.setattr(FetchPlan, "poll_sizes", lambda self: self.sizes is not None)
    monkeypatch.setattr(FetchPlan, "resolve_sizes", resolve)
    res = gpu_check.count_syncs(torch.device("cpu"), gpu_check.SyncCounter(cuda=False), steps=6, warm=3)
    assert waits, "the model must see the drain's waits (else the test proves nothing)"
    assert res["host_syncs_per_step"] == 0 and res["window_closed_before_flush"], res


def test_the_fetches_are_issued_inside_the_timed_matmuls(gpu_check):
    """Planned before the clock, issued after it starts: the moves run while the matmuls do
    (issued before, they finished first and the slow-down read about 0 whatever happened)."""
    res = gpu_check.interference(torch.device("cpu"), quick=True)
    assert res["tickets"] == 6 and res["fetches_issued_in_timed_region"] == res["tickets"], res


def test_counting_on_fake_tensors_never_captures_a_graph(gpu_check):
    """On a GPU machine PlanGraphs captures (CUDA is available) - under fake tensors that
    would replay an empty graph from the second plan of a shape on, and count nothing. A
    table whose graphs capture (as there) counts on fake tensors what one that never
    captures counts."""
    from torchrec_proactive.store import OptimizerConfig, OptimType, TieredTable
    from torchrec_proactive.store.cost_counter import CostCounter
    from torchrec_proactive.store.sync_detector import fake_cuda

    counts = []
    for capture in (False, True):
        counter = CostCounter()
        with fake_cuda() as guard:
            with guard.setup():
                table = TieredTable("t", torch.empty(100_000, 8), OptimizerConfig(OptimType.EXACT_ROWWISE_ADAGRAD),
                                    num_slots=20_000, device="cuda", planner="device")
                table.planner.graphs.capture = capture  # (True: what a GPU machine sets)
            with counter:
                for _ in range(3):
                    counter.reset()
                    with counter.phase("plan"):
                        plan = table.plan_ids(torch.empty(4096, dtype=torch.int64, device="cuda"))
                    table.release(plan)
        counts.append((counter.phases["plan"].graph_kernels, counter.phases["plan"].bytes))
        assert table.planner.graphs.captures == 0
    assert counts[0] == counts[1] and counts[0][0] > 30, counts
    # The check counts with capture off, whatever the machine.
    phases, table = gpu_check._counted_steps(4096, 8, 1_000_000, 100_000, OptimType.EXACT_ROWWISE_ADAGRAD)
    assert not table.planner.graphs.capture and phases["plan"].graph_kernels > 30
