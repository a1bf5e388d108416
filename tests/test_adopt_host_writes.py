"""``TieredTable.adopt_host_writes``: after the host tier's owner wrote it in place, the cache
takes exactly the rows (and tensors: weight, each optimizer state) written and keeps every
other row; rows holding updates not yet written back cannot be compared and are counted.
And the live views TorchRec is handed (integration/host_views.py) write the cache back
before any value access, so their writes are always comparable."""

from __future__ import annotations

import torch

from torchrec_proactive.store import OptimizerConfig, OptimType, TieredTable


def _trained_table(planner: str) -> TieredTable:
    torch.manual_seed(0)
    table = TieredTable("t", torch.randn(50, 4), OptimizerConfig(OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.1),
                        num_slots=20, planner=planner)
    plan = table.plan(torch.arange(0, 20))
    table.transfer(plan)
    table.apply_gradients(plan, torch.ones(20, 4))  # every cached row now dirty
    return table


def _slot_of(table: TieredTable) -> dict:
    slots, rows, _ = table.planner.resident()
    return dict(zip(rows.tolist(), slots.tolist()))


def test_dirty_rows_are_not_compared_and_clean_rows_take_exactly_what_was_written():
    for planner in ("host", "device"):
        table = _trained_table(planner)
        table.exposed_weight[3].fill_(7.0)
        # Dirty rows: their host copies are behind, a write cannot be told from them.
        assert table.adopt_host_writes() == (0, 20), planner
        for plan in table.plan_flush():  # (what the kernel's live views do before a write)
            table.transfer(plan)
        slot_of = _slot_of(table)
        trained_w, trained_s = table.cache_weight.clone(), table.cache_state["momentum1"].clone()
        assert table.adopt_host_writes() == (0, 0), planner  # clean, nothing written
        table.exposed_weight[3].fill_(7.0)            # a weight row
        table.exposed_state["momentum1"][5] = 0.0     # a state row (its weight untouched)
        table.exposed_weight[40].fill_(9.0)           # an uncached row: the host is its truth
        assert table.adopt_host_writes() == (2, 0), planner
        w, s = table.cache_weight, table.cache_state["momentum1"]
        assert torch.equal(w[slot_of[3]], torch.full((4,), 7.0))
        assert float(s[slot_of[5]]) == 0.0 and torch.equal(w[slot_of[5]], trained_w[slot_of[5]])
        for row in set(range(20)) - {3, 5}:
            assert torch.equal(w[slot_of[row]], trained_w[slot_of[row]]), (planner, row)
            assert torch.equal(s[slot_of[row]], trained_s[slot_of[row]]), (planner, row)
        # Bits, not values: -0.0 over +0.0 is a write.
        table.exposed_state["momentum1"][5] = -0.0
        assert table.adopt_host_writes() == (1, 0), planner
