"""The device-side store (``TieredTable(planner="device")``): planning with fixed-shape ops, exact for any
cache size and depth, deterministic backward, and no host read of device data - the last
proven on this CPU-only machine by running the training-thread path on fake CUDA tensors."""

from __future__ import annotations

import math

import pytest
import torch

from torchrec_proactive.fetch import FetchEngine
from torchrec_proactive.fetch.lookahead import run_lookahead
from torchrec_proactive.store import (
    OptimizerConfig,
    OptimType,
    Segment,
    TieredTable,
    plan_device_batch,
    unique_rows,
    pooled_lookup,
    pooled_lookup_group,
)
from torchrec_proactive.store import lookup as lookup_module
from torchrec_proactive.store.plan import FetchPlan
from torchrec_proactive.store.fixed_shape import compact, padded_unique, segment_cuts, segment_sum, sum_segments
from torchrec_proactive.store.sync_detector import HostSyncError, fake_cuda


def device_table(*args, **kwargs) -> TieredTable:
    """A table planned on its device (``TieredTable(planner="device")``)."""
    return TieredTable(*args, planner="device", **kwargs)


# ---------------------------------------------------------------------- fixed-shape ops
@pytest.mark.parametrize("n", [0, 1, 7, 2000])
def test_fixed_shape_ops_equal_their_data_dependent_versions(n):
    g = torch.Generator().manual_seed(n)
    values = torch.randint(0, 97, (n,), generator=g)
    unique, inverse, count = padded_unique(values, pad=-5)
    ref_unique, ref_inverse = torch.unique(values, sorted=True, return_inverse=True)
    assert int(count) == ref_unique.numel() and unique.shape == (n,)
    assert torch.equal(unique[: int(count)], ref_unique) and bool((unique[int(count):] == -5).all())
    assert torch.equal(inverse, ref_inverse)
    mask = torch.rand(n, generator=g) < 0.3
    kept, doubled, num = compact(mask, -1, values, values * 2)
    assert int(num) == int(mask.sum()) and torch.equal(kept[: int(num)], values[mask])
    assert torch.equal(doubled[: int(num)], 2 * values[mask]) and bool((kept[int(num):] == -1).all())
    grads = torch.randn(n, 8, generator=g)
    # The sums index_add_ gives (in pieces, so not bit for bit), the same on every call.
    expected = torch.zeros(97, 8, dtype=torch.float64).index_add_(0, values, grads.double())
    assert torch.allclose(segment_sum(values, grads, 97).double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(segment_sum(values, grads, 97), segment_sum(values, grads, 97))


# ---------------------------------------------------------------------- exactness
ROWS, DIM = 3000, 8


def _batches(steps=10, bags=64, per_bag=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        # Zipf-ish: a hot head and a cold tail, with repeats inside a batch.
        hot = torch.randint(0, 50, (bags * per_bag // 2,), generator=g)
        cold = torch.randint(0, ROWS, (bags * per_bag - hot.numel(),), generator=g)
        values = torch.cat([hot, cold])[torch.randperm(bags * per_bag, generator=g)]
        lengths = torch.randint(0, 2 * per_bag, (bags,), generator=g)
        lengths[-1] = 0
        lengths[-1] = bags * per_bag - int(lengths.sum()) if int(lengths.sum()) < bags * per_bag else 0
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)]).clamp(max=values.numel())
        offsets[-1] = values.numel()
        out.append((values, offsets, None, torch.randn(bags, DIM, generator=g)))
    return out


def _train(table_cls, slots, depth, optim, batches, cuts=False, narrow=True):
    torch.manual_seed(0)
    init = torch.randn(ROWS, DIM)
    cfg = OptimizerConfig(optim, learning_rate=0.05)
    segments = [Segment("a", 0, 1000), Segment("b", 1000, ROWS - 1000)]
    table = table_cls("a+b", init.clone(), cfg, num_slots=slots, segments=segments)
    if cuts:
        table.planner.plans_grad_cuts = True  # (the GPU's gradient sums, on the CPU)
        table.planner.narrow_updates = narrow
    engine = FetchEngine()
    anchor = torch.empty(0, requires_grad=True)
    outs = []

    def consume(i, tb, batch):
        out = pooled_lookup(tb, anchor)
        out.backward(batch[3])
        outs.append(out.detach())

    run_lookahead(table, engine, batches, depth, consume)
    if table.plans_on_device:
        for plan in table.plan_flush(chunk=700):
            engine.run([plan])
        table.check_invariants(expect_drained=True)
    else:
        engine.flush([table])
    return outs, table


@pytest.mark.parametrize("optim", [OptimType.EXACT_ROWWISE_ADAGRAD, OptimType.ADAM])
def test_device_planner_is_bit_identical_to_the_host_planner_for_any_cache_and_depth(optim):
    batches = _batches()
    ref_outs, ref = _train(TieredTable, ROWS, 0, optim, batches)  # every row resident, host planner
    # 30 slots: smaller than one batch's rows (overflow); 400: prefetches wait; 3000: all.
    for slots in (30, 400, ROWS):
        for depth in (0, 1, 4):
            outs, table = _train(device_table, slots, depth, optim, batches)
            assert all(torch.equal(a, b) for a, b in zip(outs, ref_outs)), (slots, depth)
            assert torch.equal(table.host_weight, ref.host_weight), (slots, depth)
            for k, v in ref.host_state.items():
                assert torch.equal(table.host_state[k], v), (slots, depth, k)
            if slots == 30:
                assert table.stats.overflow_rows > 0 and table.planner.host_syncs > 0
                # (bounded: only a batch's own plan at its lookup overflows, one host read each)
                assert table.planner.overflow_plans == table.planner.host_syncs <= len(batches)
            else:
                assert table.stats.overflow_rows == 0 and table.planner.host_syncs == 0
            if slots < ROWS:
                assert table.stats.rows_written_back > 0


def test_gradients_summed_by_planned_cuts_are_bit_identical_for_any_cache_and_depth():
    """What a GPU runs - row gradients summed in pieces cut by the plan, at the bucket's
    piece length - forced on the CPU: every cache size (the overflow path, planned eagerly
    at the batch's own length, included) and depth gives the same bits, and the sums are
    ``index_add_``'s up to rounding. (250 ids a batch: padded to a bucket of 256, whose
    pieces are longer than the batch's own would be.)"""
    batches = _batches(bags=50, per_bag=5)
    ref_outs, ref = _train(TieredTable, ROWS, 0, OptimType.EXACT_ROWWISE_ADAGRAD, batches)
    first = None
    for slots in (30, 400, ROWS):
        for depth in (0, 2):
            outs, table = _train(device_table, slots, depth, OptimType.EXACT_ROWWISE_ADAGRAD, batches, cuts=True)
            assert (table.stats.overflow_rows > 0) == (slots == 30)
            if first is None:
                first = outs, table
                assert not torch.equal(table.host_weight, ref.host_weight)  # (other sums: the cuts ran)
                assert torch.allclose(table.host_weight, ref.host_weight, rtol=1e-4, atol=1e-5)
                continue
            assert all(torch.equal(a, b) for a, b in zip(outs, first[0])), (slots, depth)
            assert torch.equal(table.host_weight, first[1].host_weight), (slots, depth)
            for k, v in first[1].host_state.items():
                assert torch.equal(table.host_state[k], v), (slots, depth, k)


@pytest.mark.parametrize("optim", [OptimType.EXACT_ROWWISE_ADAGRAD, OptimType.ADAM])
def test_an_update_over_its_unique_rows_gives_the_padded_updates_bits(optim, monkeypatch):
    """The GPU's update covers a plan's unique rows once their number reached the host (a
    depth of 1 or more) and the padded length otherwise: both give the same bits at every
    cache size (overflow included) and depth."""
    batches = _batches(bags=50, per_bag=5)
    lengths = []
    real = lookup_module.update_length
    monkeypatch.setattr(lookup_module, "update_length", lambda b: lengths.append((real(b), b.plan.n)) or real(b))
    first = None
    for narrow in (False, True):
        for slots, depth in ((30, 0), (400, 2), (ROWS, 1)):
            lengths.clear()
            outs, table = _train(device_table, slots, depth, optim, batches, cuts=True, narrow=narrow)
            assert all((m < n) == narrow for m, n in lengths), (narrow, lengths)
            if first is None:
                first = outs, table
                continue
            assert all(torch.equal(a, b) for a, b in zip(outs, first[0])), (narrow, slots, depth)
            assert torch.equal(table.host_weight, first[1].host_weight), (narrow, slots, depth)
            for k, v in first[1].host_state.items():
                assert torch.equal(table.host_state[k], v), (narrow, slots, depth, k)


def test_sums_of_the_first_segments_are_those_of_all_segments():
    g = torch.Generator().manual_seed(3)
    n, padded, segments = 300, 320, 330
    index = torch.cat([torch.zeros(100, dtype=torch.int64), torch.randint(0, 90, (200,), generator=g)])
    index = index[torch.randperm(n, generator=g)]
    tail = torch.randint(0, segments, (padded - n,), generator=g)
    skip = torch.arange(padded) >= n
    cuts = segment_cuts(torch.cat([index, tail]), segments, skip=skip, piece=math.isqrt(padded))
    bags = torch.randint(0, 40, (n,), generator=g)
    src = torch.randn(40, 6, generator=g)
    full = sum_segments(cuts, src.index_select(0, bags))
    for first in (1, 17, 90, 91):
        assert torch.equal(sum_segments(cuts, src, first, n, rows_of=bags), full[:first]), first


def test_cuts_planned_at_a_buckets_length_sum_a_batch_as_at_its_own():
    g = torch.Generator().manual_seed(2)
    n, padded, segments = 100, 112, 130
    index = torch.cat([torch.zeros(40, dtype=torch.int64), torch.randint(0, 60, (60,), generator=g)])
    index = index[torch.randperm(n, generator=g)]
    src = torch.randn(n, 5, generator=g)
    piece = math.isqrt(padded)
    own = sum_segments(segment_cuts(index, segments, piece=piece), src)
    tail = torch.randint(0, segments, (padded - n,), generator=g)  # (whatever the padding maps to)
    skip = torch.arange(padded) >= n
    bucketed = sum_segments(segment_cuts(torch.cat([index, tail]), segments, skip=skip, piece=piece), src)
    assert torch.equal(own, bucketed)
    expected = torch.zeros(segments, 5).index_add_(0, index, src)
    assert torch.allclose(own, expected, atol=1e-5)


def test_the_in_flight_bound_is_kept_per_ticket_and_a_plan_dropped_unreleased_keeps_its_share():
    """Keyed by ``id(plan)``, a plan dropped without its release let the next plan at the same
    address overwrite its entry: the bound fell short of the pins still held on the device."""
    import gc

    table = device_table("t", torch.randn(ROWS, DIM), OptimizerConfig(), num_slots=1000)
    kept = []
    for i in range(6):
        plan = table.plan_ids(torch.arange(50 * i, 50 * i + 40))
        if i % 2:
            kept.append(plan)
        del plan  # (the others are dropped unreleased: their pins stay on the device)
        gc.collect()
    assert table.planner.pinned_bound == 6 * 40 == int(table.planner.d_pins.narrow(0, 0, 1000).sum())
    assert len({p.bound_key for p in kept}) == 3


def test_a_miss_that_finds_no_victim_is_counted_and_never_reads_slot_minus_one(monkeypatch):
    """Were the host's bound ever short (as it was when a dropped plan's entry was
    overwritten), a miss without a victim kept slot -1: an out-of-bounds read on a GPU.
    Now it takes a trash slot and is counted (the TorchRec kernel raises for it)."""
    table = device_table("t", torch.randn(ROWS, DIM), OptimizerConfig(), num_slots=100)
    first = table.plan_ids(torch.arange(0, 80))  # pins 80 of 100 slots
    monkeypatch.setattr(type(table.planner), "pinned_bound", property(lambda self: 0))  # (a short bound)
    second = table.plan_ids(torch.arange(500, 560))  # 60 misses, 20 victims at most
    slots = second.slots[: 60]
    assert int(slots.min()) >= 0 and bool((slots < table.planner.cache_rows).all())
    assert table.planner.unplaced.poll() == 40
    table.release(first)
    table.release(second)


def test_the_bound_counts_a_plan_at_its_unique_rows_once_its_sizes_land(monkeypatch):
    """A plan is counted at its id count until its sizes reach the host, then at its unique
    rows. With room for the new batch's ids plus two batches' unique rows but not their ids,
    depth 2 defers only while sizes have not landed - the counters say which it was."""
    batches = _batches(steps=10, bags=64, per_bag=3)  # 192 ids, ~120 unique rows a batch
    n = 192
    runs = {}
    for landed in (True, False):
        if not landed:
            monkeypatch.setattr(FetchPlan, "poll_sizes", lambda self: self.sizes is not None)
        _, table = _train(device_table, n + 2 * 130 + 40, 2, OptimType.EXACT_ROWWISE_ADAGRAD, batches)
        p = table.planner
        runs[landed] = (p.deferrals, p.unsized_in_flight_max, p.overflow_plans, p.preload_plans)
    assert runs[True][0] == 0 and runs[True][1] <= 1, runs
    assert runs[False][0] > 0 and runs[False][1] >= 1, runs
    assert runs[True][2] == runs[False][2] == 0 and runs[True][3] == runs[False][3] == 1, runs


def test_a_prefetch_that_may_not_fit_waits_and_says_why():
    table = device_table("t", torch.randn(ROWS, DIM), OptimizerConfig(), num_slots=100)
    first = plan_device_batch(table, torch.arange(60), torch.arange(61))
    assert table.planner.pinned_bound == 60 and table.planner.surely_fits(40) and not table.planner.surely_fits(41)
    with pytest.raises(Exception, match=r"table 't': a batch of 41 ids may need 41 slots and 1 in-flight batch\(es\) "
                                        r"may pin up to 60 more \(101 in all\), but the device cache has 100 slots"):
        plan_device_batch(table, torch.arange(100, 141), torch.arange(42), depth_hint=1)
    FetchEngine().run([first.plan])
    # Once the fetch has read the plan's sizes back, the bound is the exact unique count.
    table.release(first.plan)
    assert table.planner.pinned_bound == 0
    table.check_invariants(expect_drained=True)


def test_a_non_finite_gradient_skips_the_group_update_and_is_reported_later():
    table = device_table("t", torch.randn(ROWS, DIM), OptimizerConfig(OptimType.ADAM), num_slots=500)
    engine = FetchEngine()
    tb = plan_device_batch(table, torch.tensor([3, 5, 3]), torch.tensor([0, 2, 3]))
    engine.run([tb.plan])
    before = table.cache_weight.clone(), {k: v.clone() for k, v in table.cache_state.items()}
    out = pooled_lookup_group([tb], torch.empty(0, requires_grad=True))[0]
    out.backward(torch.full_like(out, float("nan")))  # no exception on the training thread ...
    # No slot changed (the skipped update went to the trash slots past them: scratch rows).
    real = slice(0, table.num_slots)
    assert torch.equal(table.cache_weight[real], before[0][real])
    assert all(torch.equal(table.cache_state[k][real], v[real]) for k, v in before[1].items())
    assert table.planner.poll_skipped() == 1 and table.planner.poll_skipped() == 0  # ... reported once, later
    table.check_invariants(expect_drained=True)


# ---------------------------------------------------------------------- no host syncs
def _steady_state_steps(table, steps=3, n=256):
    """What the training thread does per step on a device table: plan a batch (ids already on
    the device), look it up, backward with the fused update. Moving bytes is the fetch
    worker's job, not this thread's."""
    for step in range(steps):
        ids = torch.randint(0, table.num_rows, (n,), device=table.device)
        offsets = torch.arange(0, n + 1, 4, device=table.device)
        tb = plan_device_batch(table, ids, offsets)
        # The two halves of the lookup's autograd node, called directly: autograd's engine
        # cannot run fake CUDA tensors on a CPU-only build (it only routes the calls).
        out = lookup_module.pool_group([tb], [None])[0]
        lookup_module.update_group([tb], [None], [torch.ones_like(out)], [])
        table.planner.poll_skipped()


@pytest.mark.parametrize("optim", list(OptimType))
def test_the_training_thread_never_reads_device_data(optim):
    host = torch.randn(ROWS, DIM)
    with fake_cuda() as guard:
        table = device_table("t", host, OptimizerConfig(optim), num_slots=1000, device="cuda")
        assert table.cache_weight.device.type == "cuda"
        _steady_state_steps(table)
    ops = set(guard.ops)
    # It really ran the planner, the lookup and the fused update on the (fake) device.
    for op in ("aten.sort.stable", "embedding_bag", "aten.index_add_.default", "aten.index_copy_.default"):
        assert any(op in name for name in ops), (op, sorted(ops))


def test_the_detector_catches_a_planted_item_in_the_lookup(monkeypatch):
    real = lookup_module._pool

    def reads_a_value(batch, weights):
        int(batch.slot_ids.max().item())  # the kind of line that would stall a GPU step
        return real(batch, weights)

    monkeypatch.setattr(lookup_module, "_pool", reads_a_value)
    with fake_cuda():
        table = device_table("t", torch.randn(ROWS, DIM), OptimizerConfig(), num_slots=1000, device="cuda")
        ids = torch.randint(0, ROWS, (64,), device="cuda")
        tb = plan_device_batch(table, ids, torch.arange(0, 65, device="cuda"), one_per_bag=True)
        with pytest.raises(HostSyncError, match="_local_scalar_dense"):
            lookup_module.pool_group([tb], [None])


@pytest.mark.parametrize("line", ["cpu", "bool", "unique"])
def test_the_detector_catches_other_host_reads(line):
    with fake_cuda():
        t = torch.randint(0, 9, (16,), device="cuda")
        with pytest.raises(HostSyncError):
            {"cpu": lambda: t.cpu(), "bool": lambda: bool((t > 3).any()), "unique": lambda: torch.unique(t)}[line]()


def test_the_host_planner_would_not_pass_the_detector():
    """The detector is not vacuous: the host planner starts by bringing the ids to the host."""
    with fake_cuda():
        ids = torch.randint(0, ROWS, (64,), device="cuda")
        with pytest.raises(HostSyncError, match="copied to the host"):
            unique_rows(ids)


@pytest.mark.parametrize("table_type", [TieredTable, device_table])
def test_a_host_tier_loaded_mid_flight_is_what_the_cache_serves_next(table_type):
    """A load between two steps (batches planned and fetched, not looked up yet): refreshing
    copies every cached row - pinned ones included - from the loaded host tier."""
    table = table_type("t", torch.randn(ROWS, DIM), OptimizerConfig(OptimType.EXACT_ADAGRAD), num_slots=300)
    engine = FetchEngine()
    ids = torch.tensor([4, 9, 4, 2999])
    planned = lookup_module.plan_table_batch(table, ids, torch.tensor([0, 2, 4]))
    engine.run([planned.plan])
    table.host_weight.fill_(0.25)  # the load (the engine is idle: a load flushes first)
    table.host_state["momentum1"].fill_(3.0)
    for plan in table.plan_refresh(chunk=128):
        engine.run([plan])
    pooled = pooled_lookup_group([planned], torch.empty(0, requires_grad=True), train=False)[0]
    assert torch.equal(pooled, torch.full((2, DIM), 0.5))  # two rows of 0.25 per bag
    slots = planned.plan.slots[: 3] if table.plans_on_device else planned.plan.slots
    assert bool((table.cache_state["momentum1"][slots] == 3.0).all())
    table.check_invariants(expect_drained=True)


def test_the_kernel_maps_ids_to_store_rows_on_the_device_without_host_reads():
    """The TorchRec kernel's one step before planning (ids -> the group's row space) on the
    device: equal to the host mapping on CPU, and free of host reads on fake CUDA tensors."""
    import numpy as np

    from torchrec_proactive.integration.embedding_kernel import device_store_rows, store_rows

    g = torch.Generator().manual_seed(0)
    feature_start = np.array([0, 100, 100, 250], dtype=np.int64)  # a table read by two features
    stride = 6
    lengths = torch.randint(0, 4, (4 * stride,), generator=g)
    lengths[:stride] = 0  # an empty feature
    values = torch.randint(0, 100, (int(lengths.sum()),), generator=g, dtype=torch.int32)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
    per_feature = [int(n) for n in lengths.view(4, stride).sum(1)]
    expected = store_rows(values.numpy(), feature_start, stride, per_feature, blocks=False, sample_major=False)
    got = device_store_rows(values, offsets, stride, feature_start, torch.from_numpy(feature_start))
    assert torch.equal(got, torch.from_numpy(expected))
    with fake_cuda():
        rows = device_store_rows(torch.randint(0, 100, (60,), device="cuda"), torch.arange(0, 61, 2.5, device="cuda").long(),
                                 stride, feature_start, torch.zeros(4, dtype=torch.int64, device="cuda"))
        assert rows.device.type == "cuda" and rows.shape == (60,)


def test_fp16_tables_train_the_same_on_both_planners():
    """FP16 storage, FP32 update rounded once (FBGEMM's rule): the device planner's masked,
    fixed-shape update rounds exactly as the host planner's does."""
    batches = _batches(steps=6)
    results = []
    for table_type, slots, depth in ((TieredTable, ROWS, 0), (device_table, 400, 2), (device_table, 30, 1)):
        torch.manual_seed(0)
        table = table_type("t", torch.randn(ROWS, DIM).half(), OptimizerConfig(OptimType.EXACT_ROWWISE_ADAGRAD,
                                                                               learning_rate=0.05), num_slots=slots)
        engine = FetchEngine()
        anchor = torch.empty(0, requires_grad=True)
        run_lookahead(table, engine, batches, depth, lambda i, tb, b: pooled_lookup(tb, anchor).backward(b[3]))
        engine.flush([table])
        results.append(table.host_weight.clone())
    assert results[0].dtype == torch.float16
    assert all(torch.equal(r, results[0]) for r in results[1:])


def test_segment_sum_of_a_hot_row_adds_in_short_chains(monkeypatch):
    """One row repeated 20,000 times (Zipf's head at GPU batch sizes): ``embedding_bag`` sums a
    bag serially (one thread per row and column), so no bag may be that long; the sum is
    taken in fixed pieces, then the pieces per row, in the same order on every run."""
    from torchrec_proactive.store import fixed_shape

    bags = []
    real = fixed_shape.F.embedding_bag

    def recording(index, weight, offsets, *args, **kwargs):
        bags.append(int(torch.diff(offsets).max()))
        return real(index, weight, offsets, *args, **kwargs)

    monkeypatch.setattr(fixed_shape.F, "embedding_bag", recording)
    g = torch.Generator().manual_seed(0)
    index = torch.cat([torch.zeros(20_000, dtype=torch.int64), torch.randint(0, 50, (5_000,), generator=g)])
    index = index[torch.randperm(index.numel(), generator=g)]
    src = torch.randn(index.numel(), 4, generator=g)
    out = segment_sum(index, src, 50)
    assert bags and max(bags) <= 2 * int(index.numel() ** 0.5) + 2, bags  # 318, not 20,000
    expected = torch.zeros(50, 4, dtype=torch.float64).index_add_(0, index, src.double())
    assert torch.allclose(out.double(), expected, rtol=1e-5, atol=1e-4)
    assert torch.equal(out, segment_sum(index, src, 50))  # deterministic


class _ScatterMultiplicity(torch.utils._python_dispatch.TorchDispatchMode):
    """Per scatter (index_add_/index_copy_/index_fill_), how many entries hit its most-hit
    address: on a GPU those entries contend for one address (atomics, or one row rewritten
    by many threads)."""

    SCATTERS = {"index_add_", "index_copy_", "index_fill_"}

    def __init__(self):
        super().__init__()
        self.worst = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in self.SCATTERS and args[2].numel():
            most = int(torch.bincount(args[2].flatten()).max())
            self.worst[name] = max(self.worst.get(name, 0), most)
        return func(*args, **(kwargs or {}))


def test_no_address_absorbs_a_plans_padding_or_a_hot_rows_duplicates():
    """Zipf at GPU batch sizes: few unique rows, one very hot. The plan is padded to the id
    count; padding and duplicates must be spread, so no scatter sends more than a few
    entries to one address (today's trash slot took every padding entry)."""
    n = 20_000
    g = torch.Generator().manual_seed(0)
    rows = 100_000
    ids = torch.cat([torch.zeros(n * 9 // 10, dtype=torch.int64), torch.randint(0, rows, (n // 10,), generator=g)])
    ids = ids[torch.randperm(n, generator=g)]
    table = device_table("t", torch.randn(rows, DIM), OptimizerConfig(OptimType.EXACT_ROWWISE_ADAGRAD),
                              num_slots=25_000)
    engine = FetchEngine()
    mode = _ScatterMultiplicity()
    for step in range(2):
        with mode:
            tb = plan_device_batch(table, ids, torch.arange(n + 1))
        engine.run([tb.plan])
        with mode:
            table.count_forward(tb.plan)
            table.apply_gradients(tb.plan, torch.ones(tb.plan.n, DIM), checked=True, ok=torch.tensor(True))
    bound = 2 * -(-tb.plan.n // 1024) + 2  # (plan.n: the ids padded to their bucket)
    assert mode.worst and max(mode.worst.values()) <= bound, (mode.worst, bound)
    table.check_invariants(expect_drained=True)


@pytest.mark.parametrize("operation", ["release", "rollback", "plan_flush", "plan_refresh", "invalidate"])
def test_every_operation_on_the_cache_checks_its_owner_stream(monkeypatch, operation):
    """The cache belongs to the stream of its first plan; releasing, rolling back, flushing,
    refreshing or invalidating it from another stream would race with that stream's kernels.
    (Streams are stand-ins here: the check is a host-side comparison.)"""
    from torchrec_proactive.store import StoreStateError

    current = {"stream": "compute"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current["stream"])
    table = device_table("t", torch.randn(ROWS, DIM), OptimizerConfig(), num_slots=500)
    tb = plan_device_batch(table, torch.tensor([1, 2, 3]), torch.tensor([0, 3]))
    table.planner.owner_stream = "compute"  # what the first plan on a CUDA table records
    monkeypatch.setattr(table.planner, "device", torch.device("cuda"))  # (the check looks at the device type only)
    current["stream"] = "side"
    call = {"release": lambda: table.release(tb.plan), "rollback": lambda: table.rollback(tb.plan),
            "plan_flush": lambda: table.plan_flush(), "plan_refresh": lambda: table.plan_refresh(),
            "invalidate": lambda: table.invalidate()}[operation]
    with pytest.raises(StoreStateError, match="planned on CUDA stream side but its cache belongs to stream compute"):
        call()


@pytest.mark.parametrize("policy,per_row", [("lru", 4), ("lfu", 8)])
def test_per_row_device_maps_cost_four_bytes_each(policy, per_row):
    """The device maps with an entry per store row (row -> slot; LFU's access counts): int32
    (slot ids and counts fit), not int64."""
    from torchrec_proactive.store import EvictionPolicy

    small, large = (device_table("t", torch.randn(rows, DIM), OptimizerConfig(), num_slots=500,
                                      policy=EvictionPolicy.parse(policy)) for rows in (10_000, 20_000))
    assert (large.bookkeeping_bytes() - small.bookkeeping_bytes()) / 10_000 == per_row


def test_lfu_on_the_device_planner_is_bit_identical_too():
    from torchrec_proactive.store import EvictionPolicy

    batches = _batches(steps=6)
    _, ref = _train(TieredTable, ROWS, 0, OptimType.EXACT_ROWWISE_ADAGRAD, batches)
    for slots, depth in ((400, 0), (400, 2), (30, 1)):
        lfu = lambda *a, **k: device_table(*a, policy=EvictionPolicy.LFU, **k)  # noqa: E731
        _, table = _train(lfu, slots, depth, OptimType.EXACT_ROWWISE_ADAGRAD, batches)
        assert table.planner.d_row_freq is not None and int(table.planner.d_row_freq.sum()) > 0
        assert torch.equal(table.host_weight, ref.host_weight), (slots, depth)


def test_polling_a_device_count_reuses_one_pinned_buffer(monkeypatch):
    """The CUDA branch of AsyncCount (events and a pinned read-back) with stand-ins for the
    two CUDA calls: counts arrive a poll late, and polling allocates one buffer in all."""
    from torchrec_proactive.store import async_count

    class Event:
        def __init__(self):
            self.polls = 0

        def query(self):  # passes at the poll after the one that recorded it
            self.polls += 1
            return self.polls > 1

    events = []
    monkeypatch.setattr(async_count, "_pinned_scalar", lambda: torch.empty((), dtype=torch.int64))
    monkeypatch.setattr(async_count, "_record_event", lambda device: events.append(Event()) or events[-1])
    count = async_count.AsyncCount(torch.device("cpu"))
    count._evented = True  # (what a CUDA device sets)
    seen = []
    for step in range(6):
        count.add(torch.tensor(2))
        seen.append(count.poll())
    assert seen[0] == 0 and sum(seen) < 12  # a step or so late ...
    assert sum(seen) + sum(count.poll() for _ in range(4)) == 12  # ... never lost
    assert count.allocations == 1 and len(events) >= 3


def test_overflow_rows_are_updated_on_the_tables_device_not_in_the_host_tier(monkeypatch):
    """An overflowing batch's rows live in the host tier; their update must run with the
    device's arithmetic (gathered rows, updated by the cache's own ops, written back), never
    in place on the host tier, whose CPU arithmetic differs on a GPU in the last bits."""
    from torchrec_proactive.store import tiered_table

    updated = []
    real = tiered_table.update_rows

    def recording(cfg, weight, state, index, grad, step, stochastic_rows=None, **kwargs):
        updated.append(weight)
        return real(cfg, weight, state, index, grad, step, stochastic_rows, **kwargs)

    monkeypatch.setattr(tiered_table, "update_rows", recording)
    table = device_table("t", torch.randn(ROWS, DIM), OptimizerConfig(OptimType.ADAM), num_slots=30)
    engine = FetchEngine()
    tb = plan_device_batch(table, torch.arange(100), torch.arange(101), overflow=True)
    assert tb.plan.num_overflow > 0
    engine.run([tb.plan])
    out = pooled_lookup_group([tb], torch.empty(0, requires_grad=True))[0]
    out.backward(torch.ones_like(out))
    assert len(updated) == 2 and not any(w is table.host_weight for w in updated)


@pytest.mark.parametrize("permanent", [False, True])
def test_every_miss_of_a_batch_that_surely_fits_finds_a_victim_in_its_window(permanent):
    """The victim window (``pinned_bound + n`` slots, not the whole cache) still holds an
    evictable slot for every miss: random batches, random lifetimes in flight, a cache just
    big enough for what may be pinned; no planned row is ever left without a slot."""
    g = torch.Generator().manual_seed(1)
    hot = torch.arange(40) if permanent else None
    table = device_table("t", torch.randn(ROWS, DIM), OptimizerConfig(), num_slots=340, hot_rows=hot)
    engine = FetchEngine()
    in_flight = []
    for step in range(300):
        n = int(torch.randint(1, 120, (1,), generator=g))
        if not table.planner.surely_fits(n):
            table.release(in_flight.pop(0))
            continue
        ids = torch.randint(0, ROWS, (n,), generator=g)
        tb = plan_device_batch(table, ids, torch.tensor([0, n]))
        engine.run([tb.plan])
        real = tb.plan.slots[: tb.plan.num_rows]
        assert bool((real >= 0).all()) and bool((real < table.num_slots).all()), step
        in_flight.append(tb.plan)
        while len(in_flight) > int(torch.randint(0, 4, (1,), generator=g)):
            table.release(in_flight.pop(0))
    for plan in in_flight:
        table.release(plan)
    table.check_invariants(expect_drained=True)
