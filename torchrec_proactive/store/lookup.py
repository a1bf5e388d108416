"""Pooled lookups through the cache, with the fused optimizer applied in backward.

The forward reads only cache slots (``F.embedding_bag`` over ``cache_weight`` with values
remapped ``row -> slot``), so its output is identical to ``F.embedding_bag`` on the full
table. The backward sums the gradient per unique row (in row order, so the result does not
depend on which slot holds a row) and hands it to ``TieredTable.apply_gradients``. No
gradient ever flows to a weight tensor: the update is "fused", like FBGEMM's TBE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .errors import InvalidInputError
from .tiered_table import FetchPlan, TieredTable, unique_rows


@dataclass
class TableBatch:
    """One table's share of a batch: bags of values, and the plan that made them resident.

    ``offsets`` has ``num_bags + 1`` entries; ``inverse[i]`` indexes ``plan.rows`` for value ``i``.
    """

    plan: FetchPlan
    inverse: torch.Tensor
    offsets: torch.Tensor
    mode: str = "sum"
    # Derived once per batch at plan time (prefetch), not in forward/backward.
    slot_ids: Optional[torch.Tensor] = None
    bag_of_value: Optional[torch.Tensor] = None
    lengths: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if self.slot_ids is None:
            self.slot_ids = self.plan.device_slots()[self.inverse]
            self.lengths = self.offsets[1:] - self.offsets[:-1]
            self.bag_of_value = torch.repeat_interleave(
                torch.arange(self.lengths.numel(), device=self.offsets.device), self.lengths,
                output_size=int(self.inverse.numel()),
            )

    @property
    def table(self) -> TieredTable:
        return self.plan.table

    @property
    def num_bags(self) -> int:
        return int(self.offsets.numel()) - 1


def plan_table_batch(
    table: TieredTable,
    values: torch.Tensor,
    offsets: torch.Tensor,
    mode: str = "sum",
    depth_hint: Optional[int] = None,
) -> TableBatch:
    """Validates a bag batch, plans its rows on ``table`` and returns the lookup recipe."""
    if values.dim() != 1 or offsets.dim() != 1 or offsets.numel() < 1:
        raise InvalidInputError(
            f"table '{table.name}': values and offsets must be 1-D (got {tuple(values.shape)} and "
            f"{tuple(offsets.shape)})"
        )
    if values.is_floating_point():
        raise InvalidInputError(f"table '{table.name}': ids must be integers, got {values.dtype}")
    if int(offsets[-1]) != values.numel() or int(offsets[0]) != 0:
        raise InvalidInputError(
            f"table '{table.name}': offsets end at {int(offsets[-1])} but there are {values.numel()} ids"
        )
    if mode not in ("sum", "mean"):
        raise InvalidInputError(f"table '{table.name}': pooling mode must be 'sum' or 'mean', got {mode!r}")
    rows, inverse = unique_rows(values)
    plan = table.plan(rows, depth_hint=depth_hint)
    device = table.device
    return TableBatch(plan, inverse.to(device), offsets.to(device=device, dtype=torch.int64), mode)


class _PooledLookup(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        anchor: torch.Tensor,
        batch: TableBatch,
        per_sample_weights: Optional[torch.Tensor],
    ) -> torch.Tensor:
        table = batch.table
        slot_ids = batch.slot_ids
        out = F.embedding_bag(
            slot_ids, table.cache_weight, batch.offsets, mode=batch.mode,
            per_sample_weights=per_sample_weights, include_last_offset=True,
        )
        # The cache is deliberately not saved with save_for_backward: the fetch engine
        # writes other slots of it while this batch is in flight, and those writes must not
        # trip autograd's version check. Our own slots are pinned until backward is done.
        ctx.batch = batch
        ctx.slot_ids = slot_ids
        ctx.psw = per_sample_weights
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:  # type: ignore[override]
        batch: TableBatch = ctx.batch  # type: ignore[attr-defined]
        psw: Optional[torch.Tensor] = ctx.psw  # type: ignore[attr-defined]
        table = batch.table
        lengths, bag_of_value = batch.lengths, batch.bag_of_value
        g = grad_out.index_select(0, bag_of_value)
        if batch.mode == "mean":
            g = g / lengths[bag_of_value].clamp(min=1).unsqueeze(1).to(g.dtype)
        grad_psw = None
        if psw is not None:
            if ctx.needs_input_grad[2]:
                grad_psw = (g * table.cache_weight[ctx.slot_ids]).sum(dim=1)  # type: ignore[attr-defined]
            g = g * psw.unsqueeze(1)
        row_grads = torch.zeros(batch.plan.rows.numel(), table.dim, dtype=g.dtype, device=g.device)
        row_grads.index_add_(0, batch.inverse, g)
        table.apply_gradients(batch.plan, row_grads)
        return None, None, grad_psw


def pooled_lookup(
    batch: TableBatch,
    anchor: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``[num_bags, dim]`` pooled embeddings of a planned (and transferred) batch.

    With grad enabled, backward applies the table's fused optimizer and releases the plan;
    without grad (evaluation) the plan is released right away so no pin outlives the call.
    ``anchor`` is any tensor with ``requires_grad=True``; it only connects the graph.
    """
    if per_sample_weights is not None and batch.mode != "sum":
        raise InvalidInputError(f"table '{batch.table.name}': per-sample weights need 'sum' pooling")
    if torch.is_grad_enabled():
        return _PooledLookup.apply(anchor, batch, per_sample_weights)
    with torch.no_grad():
        table = batch.table
        out = F.embedding_bag(
            batch.slot_ids, table.cache_weight, batch.offsets,
            mode=batch.mode, per_sample_weights=per_sample_weights, include_last_offset=True,
        )
    table.release(batch.plan)
    return out
