"""Training one ``TieredTable`` (in DRAM or on disk) on skewed pooled batches through
``run_lookahead``, and reading every row back: the shared set-up of the disk tier's tests."""

from __future__ import annotations

from typing import Any, List, Optional

import torch

from torchrec_proactive.fetch import FetchEngine
from torchrec_proactive.fetch.lookahead import LookaheadReport, run_lookahead
from torchrec_proactive.store import TieredTable, pooled_lookup


def skewed_batches(rows: int, dim: int, steps: int, bags: int, per_bag: int, seed: int = 0) -> List[Any]:
    """``steps`` batches of ``bags`` bags of ``per_bag`` ids, skewed towards row 0 (the
    square of a uniform draw), each with the gradient of its pooled output."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        values = (torch.rand(bags * per_bag, generator=g) ** 2 * rows).long()
        out.append((values, torch.arange(0, bags * per_bag + 1, per_bag), None, torch.randn(bags, dim, generator=g)))
    return out


def train(table: TieredTable, batches: List[Any], depth: int, disk_depth: Optional[int] = None,
          engine: Optional[FetchEngine] = None) -> LookaheadReport:
    """Trains ``table`` on ``batches`` at ``depth`` (and ``disk_depth``), flushes it and
    checks its invariants, drained."""
    engine = engine or FetchEngine()
    anchor = torch.empty(0, requires_grad=True)
    report = run_lookahead(table, engine, batches, depth,
                           lambda i, tb, batch: pooled_lookup(tb, anchor).backward(batch[3]), disk_depth=disk_depth)
    engine.flush([table])
    table.check_invariants(expect_drained=True)
    return report


def every_row(table: TieredTable) -> List[torch.Tensor]:
    """Every row's weight and optimizer state, read through the host tier (on disk: through
    its host cache, a chunk at a time)."""
    table.flush_to_disk()  # (on disk: the file holds every row from here; off disk nothing)
    return table.read_host_rows(0, table.num_rows)


def trained_in_dram(init: torch.Tensor, optimizer: Any, slots: int, batches: List[Any],
                    depth: int) -> TieredTable:
    """The reference: the same table with every row in DRAM, trained on the CPU transport."""
    table = TieredTable("t", init.clone(), optimizer, num_slots=slots)
    train(table, batches, depth)
    return table


def same_rows(a: List[torch.Tensor], b: List[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
