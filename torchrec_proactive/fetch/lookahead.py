"""A k-deep prefetch loop over one tiered table, without TorchRec.

The same schedule as the TorchRec pipeline, reduced to one table: the fetch of batch
``i + depth`` is issued before batch ``i`` is consumed; ``depth == 0`` fetches at use time.
Used by the store tests, the GPU check and anything that drives a store directly.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Deque, Optional, Sequence, Tuple

import torch

from ..store import CacheCapacityError, TableBatch, TieredTable, plan_table_batch
from .engine import FetchEngine, Ticket

# (values, offsets, per-sample weights or None, anything the consumer needs)
LookaheadBatch = Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Any]


def run_lookahead(
    table: TieredTable,
    engine: FetchEngine,
    batches: Sequence[LookaheadBatch],
    depth: int,
    consume: Callable[[int, TableBatch, LookaheadBatch], None],
    mode: str = "sum",
) -> None:
    """Calls ``consume(i, planned_batch, batches[i])`` in order, each batch's rows resident.

    A batch whose rows do not fit beside the batches in flight waits (and the ones behind
    it), at the latest until its own use, where rows that still do not fit overflow to the
    host tier: any cache size works, exactly.

    ``consume`` must look the batch up (``pooled_lookup``) and, with grad, run backward, so
    the batch's pins are released before the loop moves on.
    """
    if depth < 0:
        raise ValueError(f"depth must be >= 0, got {depth}")
    in_flight: Deque[Tuple[TableBatch, Ticket]] = deque()
    next_to_issue = 0

    def issue(i: int, overflow: bool = False) -> bool:
        values, offsets, _, _ = batches[i]
        try:
            tb = plan_table_batch(table, values, offsets, mode, depth_hint=depth)
        except CacheCapacityError:
            if not overflow:
                return False  # does not fit beside the batches in flight yet: it waits, in order
            tb = plan_table_batch(table, values, offsets, mode, depth_hint=depth, overflow=True)
        in_flight.append((tb, engine.issue([tb.plan], tag=i)))
        return True

    for i in range(len(batches)):
        # Issue, in order, every batch up to i + depth that fits; batch i itself is issued
        # at its use at the latest, with overflow (nothing after it is issued yet).
        while next_to_issue <= min(i + depth, len(batches) - 1):
            if not issue(next_to_issue, overflow=next_to_issue == i):
                break
            next_to_issue += 1
        tb, ticket = in_flight.popleft()
        engine.wait(ticket)
        consume(i, tb, batches[i])
