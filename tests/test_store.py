"""The tiered store against a plain resident table: exactness, invariants, errors."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from torchrec_proactive.fetch import EmulatedLinkTransport, FetchEngine, InlineTransport, LinkModel
from torchrec_proactive.fetch.lookahead import run_lookahead
from torchrec_proactive.store import (
    CacheCapacityError,
    IdOutOfRangeError,
    InvalidInputError,
    OptimizerConfig,
    OptimType,
    StoreStateError,
    TieredTable,
    apply_row_update,
    plan_table_batch,
    pooled_lookup,
    unique_rows,
)

ROWS, DIM, BAGS, MAX_LEN = 200, 8, 12, 4
OPTIMS = [
    OptimizerConfig(OptimType.EXACT_SGD, learning_rate=0.1),
    OptimizerConfig(OptimType.EXACT_ADAGRAD, learning_rate=0.1),
    # (weight decay reaches row-wise Adagrad only through FBGEMM's weight_decay_mode)
    OptimizerConfig(OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.1, weight_decay=0.01, weight_decay_mode=1),
    OptimizerConfig(OptimType.ADAM, learning_rate=0.01, weight_decay=0.01),
]


def zipf_batches(n: int, seed: int, rows: int = ROWS, alpha: float = 1.1, weighted: bool = False):
    g = torch.Generator().manual_seed(seed)
    probs = torch.arange(1, rows + 1, dtype=torch.float64).pow(-alpha)
    out = []
    for _ in range(n):
        lengths = torch.randint(0, MAX_LEN + 1, (BAGS,), generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        values = torch.multinomial(probs, int(lengths.sum()), replacement=True, generator=g)
        psw = torch.rand(values.numel(), generator=g) if weighted else None
        grad = torch.randn(BAGS, DIM, generator=g)
        out.append((values, offsets, psw, grad))
    return out


class ResidentReference:
    """A plain resident table trained with the same row-sparse optimizer rules."""

    def __init__(self, weight: torch.Tensor, cfg: OptimizerConfig) -> None:
        self.weight = weight.clone()
        self.cfg = cfg
        self.state = {k: torch.zeros((ROWS, *s)) for k, s in cfg.state_shapes(DIM).items()}
        self.step = 0

    def forward_backward(self, values, offsets, psw, grad, mode="sum") -> torch.Tensor:
        w = self.weight.clone().requires_grad_(True)
        out = F.embedding_bag(values, w, offsets, mode=mode, per_sample_weights=psw, include_last_offset=True)
        out.backward(grad)
        rows = torch.unique(values)
        self.step += 1
        weight = self.weight[rows]
        state = {k: v[rows] for k, v in self.state.items()}
        apply_row_update(self.cfg, weight, w.grad[rows], state, self.step)
        self.weight[rows] = weight
        for k, v in state.items():
            self.state[k][rows] = v
        return out.detach()


def train_store(table: TieredTable, engine: FetchEngine, batches, depth: int, mode: str = "sum",
                check: bool = True) -> List[torch.Tensor]:
    """Runs the batches with fetches issued ``depth`` batches ahead (0 = at lookup time)."""
    anchor = torch.empty(0, requires_grad=True)
    outs = []

    def consume(i, tb, batch):
        _, _, psw, grad = batch
        out = pooled_lookup(tb, anchor, psw)
        out.backward(grad)
        outs.append(out.detach())
        if check:
            table.check_invariants()

    run_lookahead(table, engine, [(v, o, p, g) for v, o, p, g in batches], depth, consume, mode)
    engine.drain()
    table.check_invariants(expect_drained=True)
    return outs


def max_working_set(batches) -> int:
    return max(int(torch.unique(b[0]).numel()) for b in batches)


@pytest.mark.parametrize("cfg", OPTIMS, ids=lambda c: c.optim.value)
@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("cache", ["tiny", "10pct", "full"])
def test_exact_vs_resident_and_bitwise_across_depths(cfg, policy, cache):
    batches = zipf_batches(12, seed=7, weighted=cfg.optim is OptimType.EXACT_SGD)
    torch.manual_seed(0)
    init = torch.randn(ROWS, DIM)
    results: Dict[int, Tuple] = {}
    for depth in (0, 1, 2, 4):
        ws = max_working_set(batches)
        slots = {"tiny": (depth + 1) * ws, "10pct": max((depth + 1) * ws, ROWS // 10), "full": ROWS}[cache]
        table = TieredTable("t", init.clone(), cfg, num_slots=slots, policy=policy)
        outs = train_store(table, FetchEngine(InlineTransport()), batches, depth)
        FetchEngine().flush([table])
        results[depth] = (outs, table.host_weight.clone(), {k: v.clone() for k, v in table.host_state.items()})
    ref = ResidentReference(init, cfg)
    ref_outs = [ref.forward_backward(*b) for b in batches]
    outs0, w0, s0 = results[0]
    for depth, (outs, w, s) in results.items():
        assert all(torch.equal(a, b) for a, b in zip(outs, outs0)), f"outputs differ at depth {depth}"
        assert torch.equal(w, w0), f"weights differ at depth {depth}"
        assert all(torch.equal(s[k], s0[k]) for k in s0)
    for a, b in zip(outs0, ref_outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w0, ref.weight, rtol=1e-5, atol=1e-6)
    for k in ref.state:
        torch.testing.assert_close(s0[k], ref.state[k], rtol=1e-5, atol=1e-6)


def test_mean_pooling_matches_embedding_bag():
    batches = zipf_batches(6, seed=3)
    init = torch.randn(ROWS, DIM)
    cfg = OptimizerConfig(OptimType.EXACT_ADAGRAD, learning_rate=0.05)
    table = TieredTable("t", init.clone(), cfg, num_slots=3 * max_working_set(batches))
    outs = train_store(table, FetchEngine(InlineTransport()), batches, depth=2, mode="mean")
    ref = ResidentReference(init, cfg)
    for out, b in zip(outs, batches):
        torch.testing.assert_close(out, ref.forward_backward(*b, mode="mean"), rtol=1e-5, atol=1e-6)
    FetchEngine().flush([table])
    torch.testing.assert_close(table.host_weight, ref.weight, rtol=1e-5, atol=1e-6)


def _cpu_tbe(optim: OptimType, pooling: str = "sum"):
    """FBGEMM's CPU TBE over one ROWS x DIM table (lr 0.1, eps 1e-3): the kernel stock uses."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    return SplitTableBatchedEmbeddingBagsCodegen(
        [(ROWS, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU)], optimizer=EmbOptimType(optim.value),
        learning_rate=0.1, eps=1e-3, pooling_mode=PoolingMode.MEAN if pooling == "mean" else PoolingMode.SUM,
    )


@pytest.mark.parametrize(
    "optim", [OptimType.EXACT_SGD, OptimType.EXACT_ADAGRAD, OptimType.EXACT_ROWWISE_ADAGRAD]
)
def test_update_rules_match_fbgemm_cpu_tbe(optim):
    """Same batches through FBGEMM's CPU TBE and through the store give the same table."""
    tbe = _cpu_tbe(optim)
    init = tbe.split_embedding_weights()[0].detach().clone()
    cfg = OptimizerConfig(optim, learning_rate=0.1, eps=1e-3)
    table = TieredTable("t", init.clone(), cfg, num_slots=60)
    batches = zipf_batches(8, seed=11)
    train_store(table, FetchEngine(InlineTransport()), batches, depth=1)
    for values, offsets, _, grad in batches:
        tbe(values, offsets).backward(grad)
    FetchEngine().flush([table])
    torch.testing.assert_close(table.host_weight, tbe.split_embedding_weights()[0].detach(), rtol=1e-5, atol=1e-6)
    if optim is not OptimType.EXACT_SGD:
        torch.testing.assert_close(
            table.host_state["momentum1"].view(-1), tbe.split_optimizer_states()[0][0].view(-1), rtol=1e-5, atol=1e-7
        )


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_weighted_bags_match_fbgemm_cpu_tbe(pooling):
    """Per-id weights with either pooling, forward and fused update, against FBGEMM's CPU
    TBE (a weighted mean is sum(w * row) / length there, and stock TorchRec hands a KJT's
    weights to it for mean-pooled tables too)."""
    tbe = _cpu_tbe(OptimType.EXACT_ROWWISE_ADAGRAD, pooling)
    init = tbe.split_embedding_weights()[0].detach().clone()
    cfg = OptimizerConfig(OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.1, eps=1e-3)
    table = TieredTable("t", init.clone(), cfg, num_slots=60)
    batches = [(v, o, p.requires_grad_(), g) for v, o, p, g in zipf_batches(8, seed=13, weighted=True)]
    outs = train_store(table, FetchEngine(InlineTransport()), batches, depth=1, mode=pooling)
    for out, (values, offsets, psw, grad) in zip(outs, batches):
        tbe_psw = psw.detach().clone().requires_grad_()
        want = tbe(values, offsets, per_sample_weights=tbe_psw)
        torch.testing.assert_close(out, want.detach(), rtol=1e-5, atol=1e-6)
        want.backward(grad)
        torch.testing.assert_close(psw.grad, tbe_psw.grad, rtol=1e-5, atol=1e-6)
    FetchEngine().flush([table])
    torch.testing.assert_close(table.host_weight, tbe.split_embedding_weights()[0].detach(), rtol=1e-5, atol=1e-6)


def test_emulated_link_gives_same_result_as_inline():
    batches = zipf_batches(10, seed=5)
    init = torch.randn(ROWS, DIM)
    cfg = OptimizerConfig(OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.1)
    ws = max_working_set(batches)
    a = TieredTable("a", init.clone(), cfg, num_slots=3 * ws)
    b = TieredTable("b", init.clone(), cfg, num_slots=3 * ws)
    engine = FetchEngine(EmulatedLinkTransport(LinkModel(bandwidth_gbps=0.05, latency_us=100)))
    try:
        outs_a = train_store(a, engine, batches, depth=2)
    finally:
        engine.close()
    outs_b = train_store(b, FetchEngine(InlineTransport()), batches, depth=2)
    assert all(torch.equal(x, y) for x, y in zip(outs_a, outs_b))
    FetchEngine().flush([a])
    FetchEngine().flush([b])
    assert torch.equal(a.host_weight, b.host_weight)


def test_dirty_victims_are_written_back_before_refetch():
    cfg = OptimizerConfig(OptimType.EXACT_SGD, learning_rate=1.0)
    host = torch.zeros(10, 2)
    table = TieredTable("t", host, cfg, num_slots=2)
    anchor = torch.empty(0, requires_grad=True)
    engine = FetchEngine()
    for ids in ([0], [1], [2], [0]):  # 0 is evicted dirty, then fetched again
        tb = plan_table_batch(table, torch.tensor(ids), torch.tensor([0, len(ids)]))
        engine.wait(engine.issue([tb.plan]))
        pooled_lookup(tb, anchor).backward(torch.ones(1, 2))
    assert host[0].tolist() == [-1.0, -1.0], "row 0's first update must have reached the host tier"
    assert table.stats.rows_written_back >= 1
    FetchEngine().flush([table])
    assert host[0].tolist() == [-2.0, -2.0] and host[1].tolist() == [-1.0, -1.0]


def test_pins_protect_in_flight_rows_and_return_to_zero():
    table = TieredTable("t", torch.randn(50, 4), OptimizerConfig(), num_slots=6)
    p1 = table.plan(torch.tensor([1, 2, 3]))
    p2 = table.plan(torch.tensor([3, 4, 5]))
    assert int(table.planner.pins.sum()) == 6
    with pytest.raises(CacheCapacityError) as err:
        table.plan(torch.tensor([7, 8]))  # only 1 unpinned slot left
    msg = str(err.value)
    assert "table 't'" in msg and "6 slots" in msg
    assert int(table.planner.pins.sum()) == 6, "a refused plan must not leave pins behind"
    table.release(p1)
    table.release(p2)
    table.release(p2)  # idempotent
    table.check_invariants(expect_drained=True)


def test_capacity_error_names_depth_that_fits():
    table = TieredTable("emb", torch.randn(100, 4), OptimizerConfig(), num_slots=25)
    table.plan(torch.arange(10))
    table.plan(torch.arange(10, 20))
    with pytest.raises(CacheCapacityError, match=r"prefetch_depth=2.*prefetch_depth <= 1 would fit"):
        table.plan(torch.arange(20, 30), depth_hint=2)


def test_capacity_message_adds_up():
    # Found by a user trial: "162 rows must be resident (57 rows for this batch, 113 slots
    # pinned ...)" did not add up, because the batch's own hits are among the pinned slots.
    import re

    table = TieredTable("emb", torch.randn(100, 4), OptimizerConfig(), num_slots=25)
    table.plan(torch.arange(10))
    table.plan(torch.arange(10, 20))
    with pytest.raises(CacheCapacityError) as info:
        table.plan(torch.arange(15, 30))  # 5 hits (pinned by the second batch too), 10 misses
    m = re.search(r"(\d+) rows must be resident at once: this batch's (\d+) missing rows and (\d+) slots that "
                  r"cannot give way \(pinned by 2 in-flight batch\(es\) or by this batch's (\d+) cached rows\)",
                  str(info.value))
    assert m, str(info.value)
    needed, missing, held, own = map(int, m.groups())
    assert (missing, held, own) == (10, 20, 5) and needed == missing + held
    # With nothing in flight, the batch alone is too big: said so, with no talk of pins.
    alone = TieredTable("emb", torch.randn(100, 4), OptimizerConfig(), num_slots=5)
    with pytest.raises(CacheCapacityError, match=r"this batch alone misses 10 rows but the device cache has 5 slots"):
        alone.plan(torch.arange(10))


def test_capacity_advice_never_asks_the_planner_for_a_load_factor_of_1():
    # Found by a user trial: a small table advised "CacheParams.load_factor >= 1", which
    # TorchRec's planner refuses for fused_uvm_caching (it takes only values below 1).
    table = TieredTable("cats", torch.randn(40, 4), OptimizerConfig(), num_slots=12)
    table.plan(torch.arange(10))
    with pytest.raises(CacheCapacityError) as info:
        table.plan(torch.arange(10, 20), depth_hint=4)  # depth 5 x 10 rows > 40 rows
    msg = str(info.value)
    assert "load_factor >= 1" not in msg and "cache_load_factor=1.0" in msg, msg
    with pytest.raises(CacheCapacityError, match=r"CacheParams.load_factor >= 0\.75 of the 40 rows"):
        table.plan(torch.arange(10, 20), depth_hint=2)  # 3 x 10 = 30 of 40 rows


@pytest.mark.parametrize("bad", [-1, 100, 12345])
@pytest.mark.parametrize("slots", [10, 100])  # 100: every row is preloaded by the first plan
def test_out_of_range_ids_are_refused_with_table_value_and_limit(bad, slots):
    table = TieredTable("users", torch.randn(100, 4), OptimizerConfig(), num_slots=slots)
    before = table.host_weight.clone()
    with pytest.raises(IdOutOfRangeError, match=rf"'users'.*id {bad} .*\[0, 100\)"):
        plan_table_batch(table, torch.tensor([1, bad]), torch.tensor([0, 2]))
    table.check_invariants(expect_drained=True)
    assert torch.equal(before, table.host_weight)
    # The refused plan left no trace: the next one still carries the preload, and reads it.
    tb = plan_table_batch(table, torch.tensor([1, 99]), torch.tensor([0, 2]), checked=True)
    FetchEngine().run([tb.plan])
    assert torch.equal(pooled_lookup(tb, torch.empty(0, requires_grad=True)), before[[1, 99]].sum(0, keepdim=True))
    table.release(tb.plan)
    table.check_invariants(expect_drained=True)


def test_shard_errors_report_global_ids():
    table = TieredTable("t", torch.randn(50, 4), OptimizerConfig(), num_slots=5, row_offset=50, global_rows=100)
    with pytest.raises(IdOutOfRangeError, match=r"id 100 is out of range \[0, 100\).*rows \[50, 100\)"):
        table.plan(torch.tensor([50]))


def test_malformed_inputs_are_refused():
    table = TieredTable("t", torch.randn(20, 4), OptimizerConfig(), num_slots=5)
    with pytest.raises(InvalidInputError, match="offsets end at 3 but there are 2 ids"):
        plan_table_batch(table, torch.tensor([1, 2]), torch.tensor([0, 3]))
    with pytest.raises(InvalidInputError, match="integers"):
        plan_table_batch(table, torch.tensor([1.0]), torch.tensor([0, 1]))
    with pytest.raises(InvalidInputError, match="2-D"):
        TieredTable("t", torch.randn(20), OptimizerConfig(), num_slots=5)
    with pytest.raises(CacheCapacityError, match="at least 1 slot"):
        TieredTable("t", torch.randn(20, 4), OptimizerConfig(), num_slots=0)


def test_non_finite_gradient_is_refused_and_table_untouched():
    table = TieredTable("t", torch.randn(20, 4), OptimizerConfig(learning_rate=1.0), num_slots=5)
    anchor = torch.empty(0, requires_grad=True)
    tb = plan_table_batch(table, torch.tensor([1, 2]), torch.tensor([0, 2]))
    table.transfer(tb.plan)
    before = table.cache_weight.clone()
    out = pooled_lookup(tb, anchor)
    with pytest.raises(InvalidInputError, match="non-finite gradient"):
        out.backward(torch.full((1, 4), float("nan")))
    assert torch.equal(before, table.cache_weight)
    table.check_invariants(expect_drained=True)


def test_no_grad_lookup_releases_pins():
    table = TieredTable("t", torch.randn(20, 4), OptimizerConfig(), num_slots=5)
    tb = plan_table_batch(table, torch.tensor([1, 2, 2]), torch.tensor([0, 1, 3]))
    table.transfer(tb.plan)
    with torch.no_grad():
        pooled_lookup(tb, torch.empty(0, requires_grad=True))
    table.check_invariants(expect_drained=True)


def test_hot_rows_stay_resident_and_invalidate_needs_drain():
    table = TieredTable("t", torch.randn(30, 4), OptimizerConfig(), num_slots=6, hot_rows=torch.tensor([0, 1]))
    engine = FetchEngine()

    def plan_and_move(rows):  # a plan's moves (the hot-row preload included) run as a ticket
        plan = table.plan(rows)
        engine.run([plan])
        return plan

    for start in range(2, 28, 4):
        table.release(plan_and_move(torch.arange(start, start + 4)))
    assert set(table.resident_rows().tolist()) >= {0, 1}
    p = table.plan(torch.tensor([5]))
    with pytest.raises(StoreStateError, match="in flight"):
        table.invalidate()
    table.release(p)
    table.invalidate()
    assert table.resident_rows().numel() == 0  # hot rows come back lazily, from the host tier
    table.host_weight[0] = 42.0  # e.g. a checkpoint loaded after the invalidation
    table.release(plan_and_move(torch.tensor([7])))
    assert set(table.resident_rows().tolist()) == {0, 1, 7}
    assert bool((table.cache_weight[table.planner.row_to_slot[0]] == 42.0).all())


def test_foreign_ticket_is_an_error():
    from torchrec_proactive.store import NotPrefetchedError

    table = TieredTable("t", torch.randn(20, 4), OptimizerConfig(), num_slots=5)
    a, b = FetchEngine(), FetchEngine()
    ticket = a.issue([table.plan(torch.tensor([1]))])
    with pytest.raises(NotPrefetchedError):
        b.wait(ticket)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    depth=st.sampled_from([0, 1, 2, 4]),
    extra_slots=st.integers(0, 60),
    policy=st.sampled_from(["lru", "lfu"]),
    alpha=st.floats(0.5, 2.0),
)
def test_property_any_stream_any_cache_equals_resident(seed, depth, extra_slots, policy, alpha):
    batches = zipf_batches(6, seed=seed, alpha=alpha)
    init = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(seed))
    cfg = OptimizerConfig(OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.1)
    slots = (depth + 1) * max(max_working_set(batches), 1) + extra_slots
    table = TieredTable("t", init.clone(), cfg, num_slots=slots, policy=policy)
    outs = train_store(table, FetchEngine(), batches, depth)
    ref = ResidentReference(init, cfg)
    for out, b in zip(outs, batches):
        torch.testing.assert_close(out, ref.forward_backward(*b), rtol=1e-5, atol=1e-6)
    FetchEngine().flush([table])
    torch.testing.assert_close(table.host_weight, ref.weight, rtol=1e-5, atol=1e-6)


def test_preloaded_rows_count_as_hits_not_misses():
    # A full cache moves every row in with the first plan: moved, but not missed.
    table = TieredTable("t", torch.randn(50, 4), OptimizerConfig(), num_slots=50)
    plan = table.plan(torch.tensor([3, 7, 9]))
    assert plan.num_fills == 50 and plan.num_preloaded == 50 and plan.num_hits == 3
    FetchEngine().run([plan])
    table.release(plan)
    assert table.stats.hit_rate() == 1.0


def test_victim_window_falls_back_to_the_whole_cache_and_wraps():
    from torchrec_proactive.store.eviction import MIN_WINDOW, WINDOW_FACTOR, EvictionPolicy, SlotRanking

    slots = 4 * MIN_WINDOW
    ranking = SlotRanking(EvictionPolicy.LRU, slots, 10 * slots)
    # The ranking works on NumPy views of the store's tensors, as the store hands them.
    pins = np.zeros(slots, dtype=np.int32)
    permanent = np.zeros(slots, dtype=bool)
    slot_to_row = np.arange(slots)
    # The first window [0, MIN_WINDOW) is pinned but for 3 slots: 10 victims still come
    # back, from the rest of the cache, and none of them is pinned.
    pins[:MIN_WINDOW] = 1
    pins[[5, 7, 9]] = 0
    victims = ranking.pick_victims(10, pins, permanent, slot_to_row)
    assert victims.shape == (10,) and int(pins[victims].sum()) == 0
    assert np.unique(victims).shape == (10,)
    # Only 4 evictable slots in the whole cache: all of them, and no more.
    pins.fill(1)
    pins[[1, 2000, 3000, slots - 1]] = 0
    assert sorted(ranking.pick_victims(10, pins, permanent, slot_to_row).tolist()) == [1, 2000, 3000, slots - 1]
    # The hand moves on by one window per search and wraps around the end of the cache.
    pins.fill(0)
    ranking = SlotRanking(EvictionPolicy.LRU, slots, 10 * slots)
    n = 1200 // WINDOW_FACTOR  # a window of 1200 slots: the fourth one wraps
    windows = [(0, 1200), (1200, 2400), (2400, 3600)]
    for lo, hi in windows:
        v = ranking.pick_victims(n, pins, permanent, slot_to_row)
        assert v.shape == (n,) and bool(((v >= lo) & (v < hi)).all()), (lo, hi)
    v = ranking.pick_victims(n, pins, permanent, slot_to_row)
    assert v.shape == (n,) and bool(((v >= 3600) | (v < 1200 - (slots - 3600))).all())


def test_sampled_lru_keeps_the_hit_rate_of_exact_lru():
    import torchrec_proactive.store.eviction as eviction

    g = torch.Generator().manual_seed(0)
    probs = torch.arange(1, 50_001, dtype=torch.float64).pow(-1.05)
    batches = [torch.multinomial(probs, 2048, replacement=True, generator=g) for _ in range(120)]

    def hit_rate() -> "tuple[float, int]":
        # A cache several windows large (a batch misses ~1000 rows of 5000 slots), so
        # that the sampled search really samples.
        table = TieredTable("t", torch.zeros(50_000, 4), OptimizerConfig(), num_slots=5000)
        queue = []
        for i, values in enumerate(batches):
            rows, _ = unique_rows(values)
            if i == 40:
                table.stats.hits = table.stats.lookups_rows = 0
            queue.append(table.plan(rows))
            if len(queue) > 3:
                table.release(queue.pop(0))
        return table.stats.hit_rate(), table.planner.ranking.hands[0]

    sampled, hand = hit_rate()
    assert hand != 0, "the victim windows never moved: the test did not sample"
    old = eviction.MIN_WINDOW
    eviction.MIN_WINDOW = 10**9  # a window as large as the cache: exact LRU
    try:
        exact, _ = hit_rate()
    finally:
        eviction.MIN_WINDOW = old
    assert 0.2 < exact < 0.95 and sampled >= exact - 0.02, (sampled, exact)


@pytest.mark.parametrize(
    "values",
    [
        torch.tensor([], dtype=torch.int64),
        torch.tensor([7]),
        torch.tensor([3, 3, 3, 3]),
        torch.tensor([5, -2, 9, -2, 0, 5], dtype=torch.int32),  # negatives (refused later, by the store)
        torch.randint(0, 50, (4096,), generator=torch.Generator().manual_seed(1)),
        torch.randint(-10**12, 10**12, (3000,), generator=torch.Generator().manual_seed(2)),
        torch.tensor([2**62, 1, 2**62, -(2**62)]),  # too large to pack with a position: torch.unique
        torch.arange(100, 0, -1)[::2],  # not contiguous
    ],
    ids=["empty", "one", "all-equal", "negative-int32", "dense", "wide", "huge", "strided"],
)
def test_unique_rows_equals_torch_unique(values):
    rows, inverse = unique_rows(values)
    want_rows, want_inverse = torch.unique(values.to(torch.int64), sorted=True, return_inverse=True)
    assert rows.dtype == inverse.dtype == torch.int64
    assert torch.equal(rows, want_rows) and torch.equal(inverse, want_inverse)
