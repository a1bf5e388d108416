"""Pooled lookups through the cache, with the fused optimizer applied in backward.

The forward reads only cache slots (``F.embedding_bag`` over ``cache_weight`` with values
remapped ``row -> slot``), so its output is identical to ``F.embedding_bag`` on the full
table. The backward sums the gradient per unique row (in row order, so the result does not
depend on which slot holds a row) and hands it to ``TieredTable.apply_gradients``. No
gradient ever flows to a weight tensor: the update is "fused", like FBGEMM's TBE.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .errors import InvalidInputError, NotPrefetchedError
from .device_planner import RowMapping
from .fixed_shape import segment_sum, sum_segments
from .optimizers import clip_output_gradient
from .tiered_table import FetchPlan, TieredTable, unique_rows


@dataclass
class TableBatch:
    """One table's share of a batch: bags of values, and the plan that made them resident.

    ``offsets`` has ``num_bags + 1`` entries; ``inverse[i]`` indexes ``plan.rows`` for value ``i``.
    Everything the lookup and its backward need is derived here, once, at plan time.
    """

    plan: FetchPlan
    inverse: torch.Tensor
    offsets: torch.Tensor
    mode: str = "sum"
    # True when the caller knows that every bag holds exactly one value (checked otherwise).
    one_per_bag: Optional[bool] = None
    slot_ids: torch.Tensor = field(init=False)  # per value: where its row is at lookup
    # Per value, its bag, and per bag, its length; both None when every bag holds exactly
    # one value (one id per feature, as in Criteo): then a bag *is* its value, pooling is a
    # gather and no value needs mapping to its bag.
    bag_of_value: Optional[torch.Tensor] = field(init=False)
    lengths: Optional[torch.Tensor] = field(init=False)

    def __post_init__(self) -> None:
        if self.inverse.device.type == "cpu":  # (NumPy's gather: a fraction of torch's per-op cost)
            self.slot_ids = torch.from_numpy(self.plan.slots.numpy()[self.inverse.numpy()])
        else:
            self.slot_ids = self.plan.device_slots().index_select(0, self.inverse)
        num_values = int(self.inverse.numel())
        if self.one_per_bag is None:
            # n values in n bags with none empty: every bag holds exactly one.
            self.one_per_bag = num_values == self.num_bags and (
                num_values == 0 or int(torch.diff(self.offsets).min()) >= 1)
        if self.one_per_bag:
            self.bag_of_value = self.lengths = None
        else:
            self.lengths = torch.diff(self.offsets)
            self.bag_of_value = torch.repeat_interleave(
                torch.arange(self.lengths.numel(), device=self.offsets.device), self.lengths,
                output_size=num_values,
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
    overflow: bool = False,
    checked: bool = False,
    one_per_bag: Optional[bool] = None,
) -> TableBatch:
    """Validates a bag batch, plans its rows on ``table`` and returns the lookup recipe
    (``overflow``: see ``TieredTable.plan``). ``checked``: ``values``/``offsets`` come from a
    ``KeyedJaggedTensor`` that was already validated (non-negative lengths, integer ids),
    so the bag checks are skipped; the host planner still refuses rows outside its row
    space (the device planner counts them: see ``plan_device_batch``).
    ``one_per_bag``: the caller knows whether every bag holds exactly one value (None: check)."""
    if not checked and values.device.type == "cpu":
        _check_bags(table.name, values, offsets)
    if table.plans_on_device:
        return plan_device_batch(table, values, offsets, mode, depth_hint, overflow, bool(one_per_bag))
    rows, inverse = unique_rows(values)
    return plan_unique_rows(table, rows, inverse, offsets, mode, depth_hint, overflow, one_per_bag)


def plan_device_batch(
    table: TieredTable,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    mode: str = "sum",
    depth_hint: Optional[int] = None,
    overflow: bool = False,
    one_per_bag: bool = False,
    mapping: Optional[RowMapping] = None,
) -> TableBatch:
    """``plan_table_batch`` on a table that plans on its device: ``ids`` are store rows on
    the device (any order), or ids that ``mapping`` turns into store rows within the plan;
    nothing is read on the host, so ids outside the table are counted in
    ``table.planner.bad_ids`` rather than refused. ``one_per_bag`` cannot be checked without
    a host read: pass True only when every bag holds exactly one id (the default, False, is
    always correct)."""
    if mode not in ("sum", "mean"):
        raise InvalidInputError(f"table '{table.name}': pooling mode must be 'sum' or 'mean', got {mode!r}")
    plan = table.plan_ids(ids, depth_hint, overflow, mapping=mapping)
    # (on a GPU, on the planner's stream behind the plan: see plan_stream.py)
    with table.planner.on_plan_stream(plan) as hand_over:  # type: ignore[union-attr]
        if offsets.device.type != table.device.type or offsets.dtype != torch.int64:
            offsets = offsets.to(device=table.device, dtype=torch.int64, non_blocking=True)
        batch = TableBatch(plan, plan.inverse, offsets, mode, one_per_bag)  # type: ignore[arg-type]
        hand_over(offsets, batch.slot_ids, batch.bag_of_value, batch.lengths)
    return batch


def plan_unique_rows(
    table: TieredTable,
    rows: torch.Tensor,
    inverse: torch.Tensor,
    offsets: torch.Tensor,
    mode: str = "sum",
    depth_hint: Optional[int] = None,
    overflow: bool = False,
    one_per_bag: Optional[bool] = None,
) -> TableBatch:
    """``plan_table_batch`` for values already reduced by ``unique_rows`` (``rows`` sorted
    and unique, ``inverse`` per value): a caller that retries a plan that did not fit
    keeps that work instead of redoing it."""
    if mode not in ("sum", "mean"):
        raise InvalidInputError(f"table '{table.name}': pooling mode must be 'sum' or 'mean', got {mode!r}")
    # unique_rows' output is unique and sorted by construction: no need to check it again.
    plan = table._plan(rows, depth_hint, overflow)  # noqa: SLF001 - same package
    device = table.device
    if inverse.device != device:
        inverse = inverse.to(device)
    if offsets.device != device or offsets.dtype != torch.int64:
        offsets = offsets.to(device=device, dtype=torch.int64)
    return TableBatch(plan, inverse, offsets, mode, one_per_bag)


def _check_bags(name: str, values: torch.Tensor, offsets: torch.Tensor) -> None:
    if values.dim() != 1 or offsets.dim() != 1 or offsets.numel() < 1:
        raise InvalidInputError(
            f"table '{name}': values and offsets must be 1-D (got {tuple(values.shape)} and "
            f"{tuple(offsets.shape)})"
        )
    if values.is_floating_point():
        raise InvalidInputError(f"table '{name}': ids must be integers, got {values.dtype}")
    if int(offsets[-1]) != values.numel() or int(offsets[0]) != 0:
        raise InvalidInputError(
            f"table '{name}': offsets end at {int(offsets[-1])} but there are {values.numel()} ids"
        )
    if offsets.numel() > 1 and not bool((offsets[1:] >= offsets[:-1]).all()):
        bag = int(torch.nonzero(offsets[1:] < offsets[:-1])[0])
        raise InvalidInputError(
            f"table '{name}': offsets decrease at bag {bag} ({int(offsets[bag])} -> "
            f"{int(offsets[bag + 1])}); offsets must be non-decreasing"
        )


def _value_rows(batch: TableBatch) -> torch.Tensor:
    """Per value, its row: from the cache, or (for a plan that overflowed) from the batch's
    overflow rows - two gathers and a select, never a copy of the cache."""
    plan = batch.plan
    over = plan.overflow_weight
    if over is None:
        return plan.lookup_weight().index_select(0, batch.slot_ids)
    base = plan.overflow_base
    in_cache = batch.slot_ids < base
    from_cache = plan.lookup_weight().index_select(0, torch.where(in_cache, batch.slot_ids, 0))
    from_host = over.index_select(0, (batch.slot_ids - base).clamp(0, max(over.shape[0] - 1, 0)))
    return torch.where(in_cache.unsqueeze(1), from_cache, from_host)


def _pool(batch: TableBatch, per_sample_weights: Optional[torch.Tensor]) -> torch.Tensor:
    # The pooled sums run in value order whichever tier holds a row, so results are
    # bit-identical for any cache size and depth.
    weight, index = batch.plan.lookup_weight(), batch.slot_ids
    materialized = weight.dtype != torch.float32 or batch.plan.overflow_weight is not None
    if materialized:
        # Pool the values' own rows (value i is row i): a table stored in FP16 pools in FP32,
        # as FBGEMM's TBE does (its output is FP32), and a plan that overflowed reads some
        # rows from outside the cache - never a copy of the cache either way.
        weight = _value_rows(batch).float()
        index = torch.arange(index.shape[0], device=index.device)
    if batch.bag_of_value is None:
        # One value per bag: its sum and its mean are the row itself (exactly), and a
        # gather is several times cheaper than embedding_bag.
        pooled = weight if materialized else weight.index_select(0, index)
        return pooled if per_sample_weights is None else pooled * per_sample_weights.unsqueeze(1)
    # FBGEMM's weighted mean, which stock TorchRec computes whenever a KJT with weights
    # reaches a mean-pooled table, is sum(w * row) / length; F.embedding_bag weighs sums only.
    weighted_mean = batch.mode == "mean" and per_sample_weights is not None
    pooled = F.embedding_bag(
        index, weight, batch.offsets, mode="sum" if weighted_mean else batch.mode,
        per_sample_weights=per_sample_weights, include_last_offset=True,
    )
    if weighted_mean:
        pooled = pooled / batch.lengths.clamp(min=1).unsqueeze(1).to(pooled.dtype)  # type: ignore[union-attr]
    return pooled


def update_length(batch: TableBatch) -> int:
    """How many of the plan's rows (``plan.rows``, unique rows first) its update covers: on
    the GPU's path (the plan carries its gradient cuts), its unique rows once the host knows
    their number - the copy of the plan's sizes has landed, which ``poll_sizes`` checks
    without waiting (the steady state at a prefetch depth of 1 or more) - and all ``n``
    otherwise (padding included). Either way every row gets the same bits: the sums and the
    row updates of the first rows do not depend on the rows after them (FBGEMM's backward
    runs over its unique rows, reading their number on the device)."""
    plan, planner = batch.plan, batch.table.planner
    if plan.grad_cuts is None or not getattr(planner, "narrow_updates", False):
        return plan.n
    if plan.sizes is None and not plan.poll_sizes():
        planner.updates_padded += 1  # type: ignore[union-attr]
        return plan.n
    planner.updates_unique += 1  # type: ignore[union-attr]
    return min(plan.n, plan.num_rows)


def _row_grads(batch: TableBatch, grad_out: torch.Tensor, psw: Optional[torch.Tensor], want_psw_grad: bool,
               length: Optional[int] = None):
    """Gradient per unique row of ``batch`` (summed in row order), and of the sample weights:
    the plan's first ``length`` rows (default all ``plan.n``; see :func:`update_length`)."""
    table = batch.table
    cuts = batch.plan.grad_cuts
    if cuts is not None and psw is None and (batch.bag_of_value is None or batch.mode == "sum"):
        # Each id's gradient is its bag's, unscaled: the sums gather the bags' rows
        # themselves, and no per-id copy of the gradients is made.
        return sum_segments(cuts, grad_out, length, int(batch.inverse.shape[0]), batch.bag_of_value), None
    if batch.bag_of_value is None:
        g = grad_out  # one value per bag (a mean over one value divides by 1)
    else:
        g = grad_out.index_select(0, batch.bag_of_value)
        # A mean divides a bag's gradient by its length - except for weighted bags on CPU:
        # FBGEMM's CPU backward weighs their gradient by the weight alone (its CUDA backward
        # divides by the length as well). Stock TorchRec runs whichever kernel the device
        # has; following the same rule keeps swapping the sharder a no-op on either.
        if batch.mode == "mean" and (psw is None or g.device.type != "cpu"):
            lengths = batch.lengths[batch.bag_of_value]  # type: ignore[index]
            g = g / lengths.clamp(min=1).unsqueeze(1).to(g.dtype)
    grad_psw = None
    if psw is not None:
        if want_psw_grad:
            grad_psw = (g * _value_rows(batch)).sum(dim=1)
        g = g * psw.unsqueeze(1)
    num_rows = batch.plan.n  # (a device plan's rows are padded: its slots are too)
    if cuts is not None:
        # No atomics on duplicate rows (the same sums, in the same order, on every run), and
        # no sort here: the cuts were planned with the ids (DevicePlanner.plan_ids).
        row_grads = sum_segments(cuts, g, length, int(batch.inverse.shape[0]))
    elif g.device.type == "cpu":
        # index_add_ adds in value order on CPU: deterministic, and cheaper than a sort.
        row_grads = torch.zeros(num_rows, table.dim, dtype=g.dtype, device=g.device)
        row_grads.index_add_(0, batch.inverse, g)
    else:  # (the host planner on a GPU)
        row_grads = segment_sum(batch.inverse, g, num_rows)
    return row_grads, grad_psw


def pool_group(batches: Sequence[TableBatch], weights: Sequence[Optional[torch.Tensor]]) -> List[torch.Tensor]:
    """The forward of one group's lookup: each batch pooled from its resident rows."""
    return [_pool(b, w) for b, w in zip(batches, weights)]


class _GroupLookup(torch.autograd.Function):
    """Pooled lookups of several tables' batches as one autograd node.

    One node, so that the fused update of a group is all-or-nothing: backward computes every
    table's row gradients, refuses the whole group if any is non-finite (no table changed),
    and only then applies the optimizer to each table.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        anchor: torch.Tensor,
        batches: List[TableBatch],
        weights: List[Optional[torch.Tensor]],
        *psw_inputs: torch.Tensor,
    ) -> Tuple[torch.Tensor, ...]:
        # The cache is deliberately not saved with save_for_backward: the fetch engine
        # writes other slots of it while this batch is in flight, and those writes must not
        # trip autograd's version check. Our own slots are pinned until backward is done.
        ctx.batches = batches
        ctx.weights = weights
        # The pins end at backward - or earlier, by the owner's rule (the kernel ends them at
        # its next training forward): a backward that comes after that plans its rows again
        # (TieredTable.apply_gradients). Nothing here waits for this node to be freed: on 2+
        # ranks TorchRec's all-to-all keeps it in a reference cycle that only the cycle
        # collector would free.
        return tuple(pool_group(batches, weights))

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, *grad_outs: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:  # type: ignore[override]
        want_psw = ctx.needs_input_grad[3:]  # type: ignore[attr-defined]
        psw_grads = update_group(ctx.batches, ctx.weights, grad_outs, want_psw)  # type: ignore[attr-defined]
        return (None, None, None, *psw_grads)


@torch.no_grad()
def update_group(
    batches: Sequence[TableBatch],
    weights: Sequence[Optional[torch.Tensor]],
    grad_outs: Sequence[Optional[torch.Tensor]],
    want_psw: Sequence[bool],
) -> List[Optional[torch.Tensor]]:
    """The backward of one group's lookup: row gradients of every table, the fused updates
    (all or nothing), the plans released. Returns the gradients of the weighted batches'
    sample weights (``want_psw[j]`` for the j-th weighted batch)."""
    weighted = [i for i, w in enumerate(weights) if w is not None]
    grads, psw_grads = [], []
    for i, (batch, g, w) in enumerate(zip(batches, grad_outs, weights)):
        if g is None:  # output unused by the loss: zero gradient, as for a resident table
            g = torch.zeros(batch.num_bags, batch.table.dim, device=batch.table.device)
        g = clip_output_gradient(batch.table.optimizer, g)  # FBGEMM's gradient_clipping
        k = weighted.index(i) if w is not None else -1
        row_grads, grad_psw = _row_grads(batch, g, w, bool(k >= 0 and want_psw[k]), update_length(batch))
        grads.append(row_grads)
        if w is not None:
            psw_grads.append(grad_psw)
    if any(b.table.plans_on_device for b in batches):
        # Device tables: the all-or-nothing rule without a host read. The group's update
        # is computed and kept only where every gradient is finite; a skip is counted on
        # the device and reported at a later step (DevicePlanner.poll_skipped).
        ok = _all_finite(grads)
        for batch, row_grads in zip(batches, grads):
            batch.table.planner.note_update(ok)  # type: ignore[union-attr]
            batch.table.apply_gradients(batch.plan, row_grads, checked=True, ok=ok, consume=True)
        return psw_grads
    bad = [b.table for b, rg in zip(batches, grads) if not bool(torch.isfinite(rg.sum()))]
    if bad:
        for b in batches:
            b.table.release(b.plan)
        names = ", ".join(f"'{t.name}'" for t in bad)
        raise InvalidInputError(
            f"non-finite gradient reached table(s) {names}; the update of this batch was skipped "
            f"for all {len(batches)} table(s) of the group, which are unchanged"
        )
    for batch, row_grads in zip(batches, grads):
        batch.table.apply_gradients(batch.plan, row_grads, checked=True)
    return psw_grads


def _all_finite(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A 0-d device bool: every value of every tensor is finite. A sum is finite exactly
    when no summand is NaN or infinite (or it overflows: then the update would not be
    finite either); ``s - s == 0`` holds exactly for a finite ``s`` - two kernels per
    tensor, where ``isfinite`` is four."""
    sums = [t.sum() for t in tensors]
    total = sums[0] if len(sums) == 1 else torch.stack(sums)
    ok = (total - total) == 0
    return ok if len(sums) == 1 else ok.all()


def pooled_lookup_group(
    batches: Sequence[TableBatch],
    anchor: torch.Tensor,
    per_sample_weights: Optional[Sequence[Optional[torch.Tensor]]] = None,
    train: bool = True,
) -> List[torch.Tensor]:
    """``[num_bags, dim]`` pooled embeddings of each planned (and transferred) batch.

    With ``train`` and grad enabled, backward applies each table's fused optimizer, all or
    nothing, and releases the plans. Otherwise (evaluation, ``torch.no_grad()``) the lookup
    is read-only and the plans are released right away, so no pin outlives the call.
    ``anchor`` is any tensor with ``requires_grad=True``; it only connects the graph.
    """
    batches = list(batches)
    for b in batches:
        if b.plan.stage != "done" or b.plan.released:
            why = "its pins have ended" if b.plan.released else "its rows were not moved yet"
            raise NotPrefetchedError(
                f"table '{b.table.name}': a batch was looked up but {why} (plan -> FetchEngine.issue/run -> "
                f"wait -> lookup, once per plan)"
            )
    weights = list(per_sample_weights) if per_sample_weights is not None else [None] * len(batches)
    if train and torch.is_grad_enabled():
        psw_inputs = [w for w in weights if w is not None]
        return list(_GroupLookup.apply(anchor, batches, weights, *psw_inputs))
    try:
        with torch.no_grad():
            return [_pool(b, w) for b, w in zip(batches, weights)]
    finally:
        for b in batches:
            b.table.release(b.plan)


def pooled_lookup(
    batch: TableBatch,
    anchor: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``[num_bags, dim]`` pooled embeddings of one planned batch (see ``pooled_lookup_group``)."""
    return pooled_lookup_group([batch], anchor, [per_sample_weights])[0]
