"""A store serving several tables with per-table slot budgets (``segment_slots``): each
table's rows live only in its own slot range, so a planned small cache cannot grow by
taking a big table's slots, and results stay exact at any depth."""

from __future__ import annotations

from typing import Dict, List

import numpy as np
import pytest
import torch

from torchrec_proactive.fetch import FetchEngine, InlineTransport
from torchrec_proactive.store import (
    CacheCapacityError,
    InvalidInputError,
    OptimizerConfig,
    OptimType,
    Segment,
    StoreStateError,
    TieredTable,
)

from .test_store import DIM, ROWS, ResidentReference, train_store, zipf_batches


def _group(budgets=None, rows=(100, 200), policy="lru", hot_rows=None) -> TieredTable:
    """Tables A and B (in that order) in one store; ``budgets``: their slots, or None for
    today's one shared cache of the summed slots (10 + 100)."""
    segments = [Segment("A", 0, rows[0]), Segment("B", rows[0], rows[1])]
    slots = sum(budgets) if budgets else 110
    return TieredTable("A+B", torch.randn(sum(rows), 4), OptimizerConfig(), num_slots=slots, policy=policy,
                       segments=segments, segment_slots=budgets, hot_rows=hot_rows)


def _stream(table: TieredTable, batches: List[torch.Tensor]) -> int:
    """Plans, moves and releases each batch in turn; the hits of the last one."""
    engine = FetchEngine(InlineTransport())
    hits = 0
    for rows in batches:
        plan = table.plan(rows)
        engine.run([plan])
        hits = plan.num_hits
        table.release(plan)
        table.check_invariants(expect_drained=True)
    return hits


def _a_then_b(table: TieredTable) -> "tuple[int, int]":
    """B's 100 rows, then A's 100 rows 5 at a time, then B's rows again: A's resident rows
    before B comes back, and B's hits then."""
    b_rows = torch.arange(100, 200)
    _stream(table, [b_rows, *[torch.arange(5 * i, 5 * i + 5) for i in range(20)]])
    a_resident = int((table.resident_rows() < 100).sum())
    return a_resident, _stream(table, [b_rows])


def test_shared_cache_lets_a_small_tables_rows_take_the_big_tables_slots():
    # Today's group store: one cache of 10 + 100 slots, so A's stream evicts B's rows.
    a_resident, b_hits = _a_then_b(_group(None))
    assert a_resident > 10 and b_hits < 100


def test_budgets_keep_each_tables_rows_in_its_own_slots():
    table = _group([10, 100])
    assert table.segment_slot_ranges() == [(0, 10), (10, 110)]
    a_resident, b_hits = _a_then_b(table)
    assert a_resident == 10 and b_hits == 100  # B's budget held all of B's rows: A never took a slot of it
    resident = table.resident_rows()
    assert int((resident < 100).sum()) == 10
    occupied = torch.nonzero(table.planner.slot_to_row >= 0).flatten()
    rows = table.planner.slot_to_row[occupied]
    assert bool(((rows < 100) == (occupied < 10)).all())  # A's rows in slots [0, 10), B's in [10, 110)
    assert table.stats.rows_fetched == 100 + 100 + 0


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_batch_too_big_for_its_tables_budget_names_the_table_and_changes_nothing(policy):
    table = _group([10, 100], policy=policy)
    held = table.plan(torch.arange(100, 150))  # B: 50 of its 100 slots pinned
    hands = list(table.planner.ranking.hands)
    before = (table.planner.row_to_slot.clone(), table.planner.slot_to_row.clone(), table.planner.pins.clone())
    rows = torch.cat([torch.arange(0, 20), torch.arange(150, 160)])  # A: 20 rows > 10 slots
    with pytest.raises(CacheCapacityError) as info:
        table.plan(rows, depth_hint=1)
    msg = str(info.value)
    assert "table 'A'" in msg and "10 slots" in msg and "misses 20 rows" in msg, msg
    assert "'B'" not in msg, msg
    assert table.planner.ranking.hands == hands
    assert all(torch.equal(a, b) for a, b in zip(before, (table.planner.row_to_slot, table.planner.slot_to_row, table.planner.pins)))
    # With overflow: A's first 10 misses take A's slots, its last 10 are served from the host
    # tier; B's rows are cached as usual.
    plan = table.plan(rows, overflow=True)
    assert plan.num_overflow == 10 and torch.equal(plan.overflow_rows, torch.arange(10, 20))
    assert plan.num_fills == 20
    FetchEngine().run([plan])
    table.release(plan)
    table.release(held)
    table.check_invariants(expect_drained=True)
    assert int((table.resident_rows() < 100).sum()) == 10


def test_pins_of_one_table_do_not_block_another():
    table = _group([10, 100])
    a = table.plan(torch.arange(0, 10))  # A's every slot pinned
    b = table.plan(torch.arange(100, 190))  # B still has room
    with pytest.raises(CacheCapacityError, match=r"table 'A'.*10 slots.*pinned by 2 in-flight"):
        table.plan(torch.tensor([11]))
    table.release(a)
    table.release(b)
    table.check_invariants(expect_drained=True)


def test_hot_rows_go_to_their_own_tables_slots():
    table = _group([10, 100], hot_rows=torch.tensor([1, 2, 150]))
    _stream(table, [torch.tensor([1, 150, 160])])
    assert int(table.planner.row_to_slot[1]) < 10 and int(table.planner.row_to_slot[2]) < 10
    assert 10 <= int(table.planner.row_to_slot[150]) < 110
    with pytest.raises(CacheCapacityError, match=r"table 'A'.*10 permanently hot rows.*10 slots"):
        _group([10, 100], hot_rows=torch.arange(10))


def test_bad_budgets_are_refused_in_one_line():
    with pytest.raises(InvalidInputError, match=r"table 'A\+B': segment_slots has 3 entries for 2 segments"):
        _group([10, 50, 50])
    with pytest.raises(InvalidInputError, match=r"table 'A\+B': segment_slots\['B'\]=0 must be >= 1"):
        _group([10, 0])
    with pytest.raises(InvalidInputError, match=r"segment_slots sum to 110 but num_slots=120"):
        TieredTable("A+B", torch.randn(300, 4), OptimizerConfig(), num_slots=120,
                    segments=[Segment("A", 0, 100), Segment("B", 100, 200)], segment_slots=[10, 100])


def test_check_invariants_finds_a_row_outside_its_tables_range():
    table = _group([10, 100])
    _stream(table, [torch.tensor([3, 120])])
    slot = int(table.planner.row_to_slot[120])
    # move B's row 120 into A's range by hand
    table.planner.slot_to_row[slot] = -1
    table.planner.slot_to_row[9] = 120
    table.planner.row_to_slot[120] = 9
    with pytest.raises(StoreStateError, match=r"row 120 of table 'B' is in slot 9, outside its slots \[10, 110\)"):
        table.check_invariants()


def test_budgets_equal_to_the_rows_preload_every_row():
    table = _group([100, 200])
    assert table.holds_every_row
    plan = table.plan(torch.tensor([1, 150]))
    assert plan.num_preloaded == 300 and torch.equal(table.planner.row_to_slot[:300].long(), torch.arange(300))


def _two_table_batches(n: int, seed: int) -> List:
    """Batches over a store of two tables: A = rows [0, 40) (Zipf), B = rows [40, ROWS)."""
    out = []
    for values, offsets, psw, grad in zipf_batches(n, seed=seed, alpha=1.1):
        # odd ids go to B (shifted past A), even ones to A: both tables get hot rows
        v = torch.where(values % 2 == 0, (values // 2) % 40, 40 + values // 2)
        out.append((v, offsets, psw, grad))
    return out


@pytest.mark.parametrize("optim", [OptimType.EXACT_ROWWISE_ADAGRAD, OptimType.ADAM])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("budgets", [(4, 60), (12, 20), (40, 8)])
def test_partitioned_budgets_are_exact_across_depths_and_vs_resident(optim, policy, budgets):
    cfg = OptimizerConfig(optim, learning_rate=0.05)
    batches = _two_table_batches(14, seed=3)
    torch.manual_seed(0)
    init = torch.randn(ROWS, DIM)
    results: Dict[int, tuple] = {}
    for depth in (0, 1, 2, 4):
        table = TieredTable("A+B", init.clone(), cfg, num_slots=sum(budgets), policy=policy,
                            segments=[Segment("A", 0, 40), Segment("B", 40, ROWS - 40)], segment_slots=list(budgets))
        outs = train_store(table, FetchEngine(InlineTransport()), batches, depth)
        FetchEngine().flush([table])
        results[depth] = (outs, table.host_weight.clone(), {k: v.clone() for k, v in table.host_state.items()},
                          table.stats.overflow_rows)
    ref = ResidentReference(init, cfg)
    ref_outs = [ref.forward_backward(*b) for b in batches]
    outs0, w0, s0, _ = results[0]
    for depth, (outs, w, s, _) in results.items():
        assert all(torch.equal(a, b) for a, b in zip(outs, outs0)), depth
        assert torch.equal(w, w0) and all(torch.equal(s[k], s0[k]) for k in s0), depth
    for a, b in zip(outs0, ref_outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w0, ref.weight, rtol=1e-5, atol=1e-6)
    if budgets[0] == 4:
        assert results[0][3] > 0  # A's tiny budget really overflowed (the rule under test ran)


def test_without_budgets_a_group_store_is_unchanged():
    """No ``segment_slots``: the same victims and counters as one unsegmented store."""
    batches = _two_table_batches(14, seed=5)
    init = torch.randn(ROWS, DIM)
    cfg = OptimizerConfig(OptimType.EXACT_SGD, learning_rate=0.1)
    runs = []
    for segments in (None, [Segment("A", 0, 40), Segment("B", 40, ROWS - 40)]):
        table = TieredTable("t", init.clone(), cfg, num_slots=30, segments=segments)
        train_store(table, FetchEngine(), batches, 2)
        runs.append((table.planner.slot_to_row.clone(), table.stats.as_dict()))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]
    assert np.all(runs[0][0].numpy() >= 0)


def test_the_device_planner_refuses_per_table_budgets_in_one_line():

    with pytest.raises(InvalidInputError, match=r"^table 'A\+B': per-table cache budgets in one store "
                                                r"\(segment_slots=\[10, 100\]\) are planned on the host only"):
        TieredTable(planner="device", name="A+B", host_weight=torch.randn(300, 4), optimizer=OptimizerConfig(), num_slots=110,
                          segments=[Segment("A", 0, 100), Segment("B", 100, 200)], segment_slots=[10, 100])


# -- the kernel: which TorchRec groups partition their store ---------------------------------

def _kernel(load_factors: Dict[str, float], rows: int = 1000, planner: str = "host", table_budgets: str = "auto"):
    """A ``ProactiveEmbeddingBag`` of one TorchRec group of tables, each with the load factor
    its plan gave it (``CacheParams`` reach the kernel as the table's fused params)."""
    from torchrec_proactive.integration.embedding_kernel import ProactiveEmbeddingBag
    from torchrec_proactive.integration.options import ProactiveOptions

    from .device_kernel_fixture import grouped_config, single_rank_group

    dim = 4
    config = grouped_config([(name, rows) for name in load_factors], dim,
                            [{"cache_load_factor": lf} for lf in load_factors.values()])
    configs = config.embedding_tables
    buffer = torch.zeros(len(configs) * rows * dim)
    views = [buffer[i * rows * dim: (i + 1) * rows * dim].view(rows, dim) for i in range(len(configs))]
    options = ProactiveOptions(planner=planner, table_budgets=table_budgets)
    return ProactiveEmbeddingBag(config, views, buffer, options, {"optimizer": "exact_sgd", "learning_rate": 0.1},
                                 FetchEngine(), pg=single_rank_group(), device=torch.device("cpu"))


def test_a_group_with_different_load_factors_gives_each_table_its_budget():
    kernel = _kernel({"A": 0.01, "B": 0.1})
    assert kernel.store.num_slots == 110
    assert kernel.store.segment_slot_ranges() == [(0, 10), (10, 110)]
    # equal load factors (every default run): one shared cache, as before
    assert _kernel({"A": 0.2, "B": 0.2}).store.segment_slot_ranges() is None
    # the sharder's table_budgets decides when asked to
    assert _kernel({"A": 0.01, "B": 0.1}, table_budgets="shared").store.segment_slot_ranges() is None
    assert _kernel({"A": 0.2, "B": 0.2}, table_budgets="per_table").store.segment_slot_ranges() == [(0, 200), (200, 400)]


def test_the_device_planner_shares_by_default_and_refuses_asked_budgets():
    assert _kernel({"A": 0.01, "B": 0.1}, planner="device").store.segment_slot_ranges() is None
    with pytest.raises(InvalidInputError, match=r"table 'A\+B': per-table cache budgets in one store"):
        _kernel({"A": 0.01, "B": 0.1}, planner="device", table_budgets="per_table")
    with pytest.raises(ValueError, match=r"table_budgets must be 'auto', 'per_table' or 'shared', got 'x'"):
        _kernel({"A": 0.01}, table_budgets="x")


def test_overflow_warning_names_the_table_whose_budget_was_short():
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kernel = _kernel({"A": 0.01, "B": 0.1})  # A: 10 slots, B: 100
    # one bag per feature: A asks for 20 distinct rows, B for 5
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f_A", "f_B"], values=torch.cat([torch.arange(20), torch.arange(5)]),
                                              lengths=torch.tensor([20, 5]))
    with pytest.warns(UserWarning, match=r"table 'A' \(its budget of the store of tables \['A', 'B'\]\): one batch "
                                         r"needs 20 distinct rows but the device cache has 10 slots; 10 rows were "
                                         r"served from the host tier"):
        group = kernel.plan_prepared(kernel.prepare_batch(kjt), overflow=True)
    assert group.plans[0].num_overflow == 10
    kernel.unplan(group)
    kernel.store.check_invariants(expect_drained=True)


def test_a_budget_as_large_as_its_table_preloads_that_table():
    # as a store of its own would: B's rows are resident from the first plan, never missed
    table = _group([10, 200], hot_rows=torch.tensor([1]))
    plan = table.plan(torch.tensor([2, 150]))
    assert plan.num_preloaded == 201 and plan.num_fills == 202 and plan.num_hits == 1
    assert torch.equal(table.planner.row_to_slot[100:300].long(), torch.arange(10, 210))
    assert int(table.planner.row_to_slot[1]) == 0 and bool(table.planner.permanent[0]) and not bool(table.planner.permanent[10:].any())
    FetchEngine().run([plan])
    table.release(plan)
    table.check_invariants(expect_drained=True)


def test_auto_depth_is_bounded_by_each_tables_budget():
    from unittest import mock

    from torchrec_proactive.app import autodepth

    class FakeEbc(torch.nn.Module):
        def __init__(self, table):
            super().__init__()
            self.table = table

        def named_tables(self):
            return {"A+B": self.table}

    # shared 110 slots would fit 110 // 5 - 1 = 21 batches of 5 ids; A's 10 slots fit 1
    with mock.patch.object(autodepth, "ProactiveShardedModule", FakeEbc):
        assert autodepth.cache_depth_limit(FakeEbc(_group(None)), ids_per_batch=5) == 21
        assert autodepth.cache_depth_limit(FakeEbc(_group([10, 100])), ids_per_batch=5) == 1


BUDGET_DEPTHS = [0, 1, 3]


@pytest.fixture(scope="module")
def per_table_budget_runs():
    """Both shardings' matrices in one launch of 2 ranks (starting ranks costs more than a case)."""
    from . import exactness_worker
    from .cases_worker import launch_cases

    shardings = ["row_wise", "table_wise"]
    return launch_cases(exactness_worker.matrix, shardings, [
        dict(sharding=s, optimizers=["rowwise_adagrad"], depths=BUDGET_DEPTHS, caches=["per_table", "per_table_uneven"])
        for s in shardings])


@pytest.mark.multiprocess
@pytest.mark.parametrize("sharding", ["row_wise", "table_wise"])
def test_per_table_budgets_through_torchrec_are_exact_vs_stock(per_table_budget_runs, sharding):
    """Each rank's group store with per-table budgets (as small as fits, and one below a
    batch, which overflows): bit-identical across depths and budgets, stock TorchRec's
    parameters within fp32 tolerance (2 gloo ranks)."""
    from .cases_worker import ok
    from .test_integration import _check_matrix

    depths = BUDGET_DEPTHS
    results = _check_matrix(ok(per_table_budget_runs[sharding]), n_runs=2 * len(depths))
    overflow = sum(r["runs"][f"rowwise_adagrad/per_table_uneven/k{k}"]["overflow_rows"] for r in results for k in depths)
    assert overflow > 0  # the first table's budget really was below a batch
