"""What the device path would cost a GPU, counted on fake CUDA tensors through the kernel's
own calls (``prepare_batch`` -> ``plan_prepared``, then the lookup node's forward and
backward halves: autograd's engine cannot run fake CUDA tensors on a CPU-only build).

Costs must follow the batch's ids, never the cache: the same ids planned on a 1M-slot and
a 10M-slot cache issue the same ops touching the same bytes (issue 30, item 11)."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_proactive.store import lookup as lookup_module
from torchrec_proactive.store.cost_counter import CostCounter
from torchrec_proactive.store.sync_detector import fake_cuda

from .device_kernel_fixture import device_kernel

ROWS_A, ROWS_B, DIM = 19_000_000, 1_000_000, 8


def _costs(slots_per_table: int, n: int = 4096, steps: int = 3, optimizer: str = "exact_row_wise_adagrad",
           dim: int = DIM, unique: Optional[int] = None):
    """Per phase, the costs of the last of ``steps`` steps (steady state) on a group of two
    tables with ``slots_per_table`` slots each. The host tier is fake too (no memory).
    ``unique``: the batch's unique rows, handed to each plan before its backward as the copy
    of its sizes hands them on a GPU once it has landed (``poll_sizes``: the steady state at
    a depth of 1 or more); None: the sizes never land (depth 0)."""
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 1000, (n,), generator=g) for _ in range(steps)]
    counter = CostCounter()
    with fake_cuda() as guard:
        with guard.setup():
            kernel = device_kernel([("a", ROWS_A), ("b", ROWS_B)], dim=dim, slots=slots_per_table, device="cuda",
                                   optimizer=optimizer, host=torch.empty((ROWS_A + ROWS_B) * dim))
        with counter:
            for _ in batches:
                counter.reset()
                # (fake tensors hold no values: the ids' shapes are what the costs depend on)
                values = torch.empty(n, dtype=torch.int64, device="cuda")
                kjt = KeyedJaggedTensor(keys=["f_a", "f_b"], values=values,
                                        offsets=torch.arange(0, n + 1, 2, device="cuda"), stride=n // 4)
                with counter.phase("plan"):
                    planned = kernel.plan_prepared(kernel.prepare_batch(kjt))
                with counter.phase("lookup"):
                    out = lookup_module.pool_group([planned.batch], [None])[0]
                grad_out = torch.ones_like(out)  # (autograd's, made before the backward runs)
                if unique is not None:
                    planned.batch.plan.take_sizes((unique, unique, 0, 0))
                with counter.phase("update"):
                    lookup_module.update_group([planned.batch], [None], [grad_out], [])
    return counter.phases


@pytest.fixture(scope="module")
def small_and_large():
    return _costs(500_000), _costs(5_000_000)  # 1M and 10M slots in the group


@pytest.mark.parametrize("phase", ["plan", "lookup", "update"])
def test_ops_and_bytes_per_step_do_not_depend_on_the_cache_size(small_and_large, phase):
    small, large = small_and_large[0][phase], small_and_large[1][phase]
    assert small.ops > 0 and small.bytes > 0
    assert small.names == large.names
    assert (small.ops, small.launches, small.bytes) == (large.ops, large.launches, large.bytes), [
        (name, a, b) for name, a, b in zip(small.launch_names, small.op_bytes, large.op_bytes) if a != b]


def test_the_largest_temporary_follows_the_ids(small_and_large):
    n = 4096
    row_bytes = DIM * 4
    for phases in small_and_large:
        for name, cost in phases.items():
            # A few id-long int64 vectors or one id-long block of rows, never the cache.
            assert cost.largest_temporary <= 4 * n * max(8, row_bytes), (name, cost.largest_temporary)
    twice = _costs(500_000, n=2 * n, steps=1)
    assert twice["plan"].largest_temporary <= 2 * small_and_large[0]["plan"].largest_temporary


PLAN_LAUNCH_BOUND = 30  # per group per step (issue 30); FBGEMM's UVM cache path launches about 10


def test_planning_launches_per_group_step_are_bounded(small_and_large):
    """The plan is one graph replay (plan_graphs): staging the ids and offsets, the replay,
    the copy of its outputs, and the lookup recipe; ~115 kernels run inside the graph."""
    plan = small_and_large[0]["plan"]
    assert plan.launches <= PLAN_LAUNCH_BOUND, plan.launch_names
    assert plan.launch_names.count("graph_replay") == 1, plan.launch_names
    assert plan.graph_kernels > 3 * PLAN_LAUNCH_BOUND  # (what eager planning would launch)


#: Per group per step. FBGEMM's backward (a sort of the ids, then its fused gradient-and-
#: optimizer kernels) launches on the order of ten; ours was 55-76 (SGD to Adam), now 15-28.
UPDATE_LAUNCH_BOUND = 30


@pytest.mark.parametrize("optimizer", ["exact_sgd", "exact_adagrad", "exact_row_wise_adagrad", "adam"])
def test_update_launches_per_group_step_are_bounded(optimizer):
    """The backward's segment cuts follow from the ids alone, so they are planned with them
    (inside the plan's graph) and the backward sorts nothing; the all-or-nothing rule costs
    one select over the slots, not a copy of every row it touches."""
    update = _costs(50_000, steps=2, optimizer=optimizer)["update"]
    assert update.launches <= UPDATE_LAUNCH_BOUND, update.launch_names
    assert not {"sort.stable", "sort.default", "clone.default", "cumsum.default"} & set(update.launch_names), \
        update.launch_names


def test_the_first_plan_of_a_shape_is_eager_and_checked_later_ones_replay():
    """Every plan of a shape must repeat the first one's ops, arguments and outside tensors,
    or a captured graph would replay stale ones: the check catches a Python counter baked
    into an argument (what the LRU clock was before it moved to the device)."""
    import torch
    from torchrec_proactive.store import OptimizerConfig, TieredTable
    from torchrec_proactive.store.plan_graphs import GraphReplayError

    table = TieredTable("t", torch.zeros(1000, 4), OptimizerConfig(), num_slots=200, planner="device")
    for step in range(3):
        table.release(table.plan_ids(torch.arange(step, 300 + step, 3)))
    assert len(table.planner.graphs) == 1
    clock = iter(range(10**6))
    original = table.planner._rank
    table.planner._rank = lambda slots: original(slots).masked_fill(slots < 0, next(clock))  # a baked-in Python counter
    table.release(table.plan_ids(torch.arange(200)))  # (another shape: recorded, nothing to compare)
    with pytest.raises(GraphReplayError, match="differs from the first plan"):
        table.plan_ids(torch.arange(200))


def test_the_int32_hash_gives_the_int64_hashs_bits():
    from torchrec_proactive.store.stochastic_rounding import _mix32, round_rows, rounding_bits, stochastic_round_fp16

    g = torch.Generator().manual_seed(0)
    rows = torch.cat([torch.randint(0, 2**40, (500,), generator=g), torch.arange(50)])
    x = torch.randn(rows.numel(), 16, generator=g) * 10
    for seed, step in ((0, 1), (2**31 + 5, 2**33 + 1)):
        bits = rounding_bits(seed, step, rows, 16)
        key = int(_mix32(_mix32(torch.tensor(step & 0xFFFFFFFF)) ^ (seed & 0xFFFFFFFF)))
        per_row = _mix32(_mix32((rows & 0xFFFFFFFF) ^ key) ^ ((rows >> 32) & 0xFFFFFFFF))
        columns = _mix32(torch.arange(16) * 0x9E3779B9 & 0xFFFFFFFF)
        assert torch.equal(bits, _mix32(per_row.unsqueeze(1) ^ columns))  # the int64 definition
        assert torch.equal(round_rows(x, torch.float16, rows, seed, step), stochastic_round_fp16(x, bits))


def _zipf_unique(rows: int, n: int, alpha: float = 1.05, seed: int = 0) -> int:
    """Unique rows among ``n`` Zipf ids over ``rows`` (benchmarks/gpu_check.py's draw)."""
    u = torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    e = 1.0 - alpha
    x = torch.exp(torch.log1p(u * ((rows + 1.0) ** e - 1.0)) / e)
    return int(torch.unique((x.floor().long() - 1).clamp_(0, rows - 1)).numel())


#: Bytes the backward with the fused update may touch per group per step at 2M ids x 128
#: (issue 44, item 2). It touched 16.8 GB (row-wise Adagrad) and 40.3 GB (Adam): every op ran
#: over the padded id count.
UPDATE_BYTES_BOUND = {"exact_row_wise_adagrad": 4e9, "adam": 10e9}


@pytest.mark.parametrize("optimizer", sorted(UPDATE_BYTES_BOUND))
def test_the_update_at_2m_ids_works_on_its_unique_rows(optimizer):
    """2M Zipf ids x dim 128 (25% unique): once the plan's sizes have landed, the gradient
    sums read each id's gradient once (its bag's row, gathered by the sums themselves) and
    every other op runs over the unique rows, not the padded ids."""
    n, dim = 2_000_000, 128
    unique = _zipf_unique(ROWS_A + ROWS_B, n)
    update = _costs(5_000_000, n=n, steps=3, optimizer=optimizer, dim=dim, unique=unique)["update"]
    assert update.bytes <= UPDATE_BYTES_BOUND[optimizer], (update.bytes / 1e9, unique)
    assert update.launches <= UPDATE_LAUNCH_BOUND, update.launch_names
    # What a GPU does where the sizes have not landed (depth 0): the padded length, the same bits.
    padded = _costs(5_000_000, n=n, steps=3, optimizer=optimizer, dim=dim)["update"]
    assert padded.bytes > 2 * update.bytes and padded.launches <= UPDATE_LAUNCH_BOUND


class _FakeGraph:
    """What a captured graph does, for a CPU: its replay reruns the body on the staged
    inputs into the memory its capture left its outputs in."""

    def __init__(self, entry, body):
        self.entry, self.body = entry, body

    def replay(self):
        outs = self.body(*self.entry.inputs)
        self.entry.packed.copy_(torch.cat([t.reshape(-1) for t in outs]))


def test_the_plan_graph_cache_is_bounded_and_captures_new_keys_at_their_first_plan(monkeypatch):
    """Entries (a graph and the buffers it reads) are freed least recently run first beyond
    ``max_entries`` or ``max_bytes``; once a graph exists, a new key's first plan is
    captured rather than run eagerly (~145 launches); results are those of eager runs."""
    from torchrec_proactive.store.plan_graphs import PlanGraphs

    captured = []

    def capture(self, entry, body):
        entry.packed = self._pack(entry, body(*entry.inputs))  # (what capture_end leaves)
        entry.graph, entry.graph_bytes = _FakeGraph(entry, body), 1000
        self.captures += 1
        captured.append(entry.inputs[0].shape[0])

    monkeypatch.setattr(PlanGraphs, "_capture", capture)
    graphs = PlanGraphs(torch.device("cpu"), capture=True, max_entries=2)
    body = lambda ids: (ids * 2, ids + 1)  # noqa: E731
    eager = lambda ids: [ids * 2, ids + 1]  # noqa: E731
    runs = []
    for n in (64, 64, 128, 64, 256, 128):
        ids = torch.arange(n)
        out = graphs.run("k", body, [ids], n)
        runs.append(out)
        assert all(torch.equal(a, b) for a, b in zip(out, eager(ids)))
    # 64: eager (the warm-up), then captured at its second plan; 128 and 256: captured at
    # their first; the third key evicts the least recently run (128), which comes back.
    assert captured == [64, 128, 256, 128] and graphs.replays == 5
    assert len(graphs) == 2 and graphs.evictions == 2
    assert graphs.memory_bytes() == sum(e.memory_bytes() for e in graphs._entries.values()) > 2000
    tight = PlanGraphs(torch.device("cpu"), capture=False, max_entries=16, max_bytes=64 * 8 * 3)
    for n in (64, 65, 128):
        tight.run("k", body, [torch.arange(n)], bucket_of(n))
    assert len(tight) == 1 and tight.evictions == 2


def bucket_of(n):
    from torchrec_proactive.store.plan_graphs import bucket

    return bucket(n)
