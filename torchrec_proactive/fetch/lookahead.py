"""A k-deep prefetch loop over one tiered table, without TorchRec.

The same schedule as the TorchRec pipeline, reduced to one table: the fetch of batch
``i + depth`` is issued before batch ``i`` is consumed; ``depth == 0`` fetches at use time.
Used by the store tests, the GPU check and anything that drives a store directly.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Deque, Optional, Sequence, Tuple

import torch

from ..store import TableBatch, TieredTable, plan_table_batch
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

    ``consume`` must look the batch up (``pooled_lookup``) and, with grad, run backward, so
    the batch's pins are released before the loop moves on.
    """
    if depth < 0:
        raise ValueError(f"depth must be >= 0, got {depth}")
    in_flight: Deque[Tuple[TableBatch, Ticket]] = deque()

    def issue(i: int) -> None:
        values, offsets, _, _ = batches[i]
        tb = plan_table_batch(table, values, offsets, mode, depth_hint=depth)
        in_flight.append((tb, engine.issue([tb.plan], tag=i)))

    for i in range(min(depth, len(batches))):
        issue(i)
    for i in range(len(batches)):
        if depth == 0:
            issue(i)
        elif i + depth < len(batches):
            issue(i + depth)
        tb, ticket = in_flight.popleft()
        engine.wait(ticket)
        consume(i, tb, batches[i])
