"""Tensor ops whose output shapes depend only on input shapes, never on values.

They are what lets the store plan and update on a GPU without the host ever reading device
memory: an op such as ``torch.unique``, ``nonzero``, boolean indexing or ``.item()`` must
copy data to the host to know how big its result is, which stops the training thread until
the GPU has drained its queue. Each function here pads instead: it returns tensors as long
as its input, with a count (a 0-d tensor, on the device) saying how many entries are real.

The same functions run on CPU, where tests check them against their data-dependent
equivalents, and under ``FakeTensorMode`` with CUDA fake tensors, where any data-dependent
op raises (``tests/test_device_store.py``).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F


#: Spare positions that the entries a fixed-shape scatter must drop are spread over
#: (entry ``i`` goes to spare ``i % SPREAD``): on a GPU, entries sent to one address contend
#: for it (atomics, or one row rewritten by many threads), and padding is most of a plan at
#: Zipf batch sizes (2M ids, 22% unique). ``SPREAD`` spares cap that at ``n / SPREAD`` each.
SPREAD = 1024


def spread(n: int, device: torch.device) -> torch.Tensor:
    """``arange(n) % SPREAD`` (int64): which spare position entry ``i`` uses."""
    return torch.remainder(torch.arange(n, dtype=torch.int64, device=device), SPREAD)


def padded_unique(values: torch.Tensor, pad: torch.Tensor | int,
                  spare: torch.Tensor | None = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.unique(values, sorted=True, return_inverse=True)`` padded to ``len(values)``.

    Returns ``(unique, inverse, count)``: ``unique[:count]`` are the sorted distinct values
    and ``unique[count:]`` the matching entries of ``pad`` (an int, or a tensor as long as
    ``values``); ``inverse[i]`` is the index of ``values[i]`` in ``unique``. One sort and a
    cumulative sum (FBGEMM's ``lru_cache_find_uncached`` does the same). Only the first copy
    of a value is written (the others go to spread spare positions: ``spare``, default
    ``spread(n)``), so a hot value's duplicates do not all write one place.
    """
    n = values.shape[0]
    device = values.device
    ordered, order = torch.sort(values, stable=True)
    first = torch.ones(n, dtype=torch.bool, device=device)
    if n > 1:  # (narrow, not slicing: see sync_detector on fake CUDA tensors)
        torch.ne(ordered.narrow(0, 1, n - 1), ordered.narrow(0, 0, n - 1), out=first.narrow(0, 1, n - 1))
    index_of_sorted = torch.cumsum(first, 0) - 1  # int64
    inverse = torch.empty(n, dtype=torch.int64, device=device)
    inverse.index_copy_(0, order, index_of_sorted)
    if isinstance(pad, torch.Tensor):
        unique = torch.cat([pad.to(values.dtype), pad.new_empty(SPREAD, dtype=values.dtype)])
    else:
        unique = torch.full((n + SPREAD,), pad, dtype=values.dtype, device=device)
    spare = spread(n, device) if spare is None else spare
    unique.index_copy_(0, torch.where(first, index_of_sorted, spare + n), ordered)
    count = first.sum()
    return unique.narrow(0, 0, n), inverse, count


def compact(mask: torch.Tensor, fill: int, *values: torch.Tensor,
            spare: torch.Tensor | None = None) -> Tuple[torch.Tensor, ...]:
    """The entries of each of ``values`` where ``mask`` holds, moved to the front in order,
    the rest set to ``fill``; and their number (0-d). Same length as the input.

    ``values[mask]`` without the data-dependent output size: each kept entry goes to its
    rank among the kept ones (a cumulative sum), the others to spare positions past the end
    (spread: ``spare``, default ``spread(n)``), which are dropped.
    """
    n = mask.shape[0]
    rank = torch.cumsum(mask, 0) - 1
    spare = spread(n, mask.device) if spare is None else spare
    target = torch.where(mask, rank, spare + n)
    out = []
    for v in values:
        buffer = torch.full((n + SPREAD, *v.shape[1:]), fill, dtype=v.dtype, device=v.device)
        buffer.index_copy_(0, target, v)
        out.append(buffer.narrow(0, 0, n))
    return (*out, mask.sum())


class SegmentCuts(NamedTuple):
    """Where :func:`sum_segments` cuts a sorted gradient: a function of the ids alone, so a
    device plan computes it with the ids, inside its graph, and the backward sorts nothing.

    ``order``: the entries in segment order (entries left out point at entry 0, in pieces no
    segment reads); ``bounds``: the pieces' start positions in ``order`` (``n + 1``, padding
    pieces empty); ``segment_bounds``: each segment's first piece (``num_segments + 1``)."""

    order: torch.Tensor
    bounds: torch.Tensor
    segment_bounds: torch.Tensor
    #: The piece length the cuts were made with (0: not known, see :func:`sum_segments`).
    piece: int = 0


def segment_sum(index: torch.Tensor, src: torch.Tensor, num_segments: int) -> torch.Tensor:
    """``zeros(num_segments, d).index_add_(0, index, src)`` in a deterministic order, with no
    long serial chain of additions: :func:`sum_segments` of :func:`segment_cuts`.

    ``index_add_`` adds duplicates with atomics on CUDA, so the order of the additions, and
    the rounding, changes from run to run. Here the entries are sorted by segment (a stable
    sort keeps their original order within a segment) and summed in two levels, each an
    ``embedding_bag`` sum (which adds a bag's entries one after the other, one thread per
    bag and column):

    1. pieces: the sorted entries cut at every segment start and every ``piece`` positions
       (``piece = isqrt(n)``), each piece summed;
    2. per segment, its pieces summed in order.

    A hot row repeated ``m`` times then costs ``piece + m / piece`` dependent additions, not
    ``m`` (Zipf ids at 2M: ~2.8k instead of 124k). The cuts depend only on the batch's ids,
    so the result is the same on every run, at every prefetch depth and cache size (FBGEMM's
    backward splits long segments the same way, for the same reason). It differs from one
    serial sum in the last bits: the device planner uses it on GPUs only, where no serial
    order is kept anyway.
    """
    return sum_segments(segment_cuts(index, num_segments), src)


def segment_cuts(index: torch.Tensor, num_segments: int, skip: Optional[torch.Tensor] = None,
                 piece: Optional[int] = None) -> SegmentCuts:
    """The cuts of :func:`segment_sum` for ``index`` (entries in ``[0, num_segments)``).

    ``skip``: entries to leave out (a plan's padding, whose gradient rows do not exist);
    they sort after every segment and no segment reads them. ``piece`` (default
    ``isqrt(n)``): the piece length. With the same ``piece``, the entries that are not
    skipped get the same cuts whether or not skipped ones follow them: a batch planned at
    its own length and the same batch padded to a bucket sum alike."""
    n = index.shape[0]
    device = index.device
    key = index if skip is None else torch.where(skip, num_segments, index)
    order = torch.argsort(key, stable=True)
    if n == 0:
        empty = torch.zeros(1, dtype=torch.int64, device=device)
        return SegmentCuts(order, empty, torch.zeros(num_segments + 1, dtype=torch.int64, device=device))
    piece = max(1, math.isqrt(n) if piece is None else piece)
    ordered = key.index_select(0, order)
    # Level 1: a piece starts at position 0, at every multiple of ``piece`` and at every
    # new segment; its start positions are compacted to the front (padding: n, an empty bag).
    position = torch.arange(n, device=device)
    starts = torch.remainder(position, piece) == 0
    if n > 1:  # (narrow, not slicing: see sync_detector on fake CUDA tensors)
        starts.narrow(0, 1, n - 1).logical_or_(ordered.narrow(0, 1, n - 1) != ordered.narrow(0, 0, n - 1))
    piece_start, piece_segment, _ = compact(starts, n, position, ordered)
    bounds = torch.cat([piece_start, piece_start.new_full((1,), n)])
    # Level 2: pieces are in segment order; the padding pieces (empty) and the skipped
    # entries' pieces belong to segment ``num_segments``, past every real one, so they fall
    # after the last bound.
    piece_segment = torch.where(piece_start < n, piece_segment, num_segments)
    segment_bounds = torch.searchsorted(piece_segment, torch.arange(num_segments + 1, device=device,
                                                                    dtype=piece_segment.dtype))
    if skip is not None:
        order = torch.where(ordered == num_segments, 0, order)  # (read by no segment's sum)
    return SegmentCuts(order, bounds, segment_bounds, piece)


def sum_segments(cuts: SegmentCuts, src: torch.Tensor, num_segments: Optional[int] = None,
                 num_entries: Optional[int] = None, rows_of: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per segment, the sum of its entries' rows of ``src`` (``[entries, d]``), cut as
    ``cuts`` says: two ``embedding_bag`` sums and no sort.

    ``rows_of``: entry ``i``'s row is ``src[rows_of[i]]`` (a gather folded into the first
    sum's indices, so that the entries' rows are never materialised).

    ``num_segments`` (with ``num_entries``, the entries that are not skipped, and the cuts'
    ``piece``): only the first segments are summed, and only the pieces that can hold them
    are (``num_segments + ceil(num_entries / piece)`` at most: a piece starts at every
    segment and every ``piece`` entries). Each sum is the same, in the same order, as
    without it: the work follows the segments asked for, not the cuts' padded length."""
    total = int(cuts.segment_bounds.shape[0]) - 1
    order, bounds, segment_bounds = cuts.order, cuts.bounds, cuts.segment_bounds
    if num_segments is not None and num_segments < total and num_entries is not None and cuts.piece > 0:
        pieces = min(int(bounds.shape[0]) - 1, num_segments + -(-num_entries // cuts.piece))
        # The entries not skipped come first; pieces past them (the skipped entries', the
        # padding's) end up empty, never reading past ``num_entries``.
        order = order.narrow(0, 0, num_entries)
        bounds = bounds.narrow(0, 0, pieces + 1).clamp(max=num_entries)
        segment_bounds = segment_bounds.narrow(0, 0, num_segments + 1)
        total = num_segments
    if src.shape[0] == 0 or order.shape[0] == 0:
        return torch.zeros(total, *src.shape[1:], dtype=src.dtype, device=src.device)
    if rows_of is not None:
        order = rows_of.index_select(0, order)
    partial = F.embedding_bag(order, src, bounds, mode="sum", include_last_offset=True)
    return F.embedding_bag(torch.arange(partial.shape[0], device=src.device), partial, segment_bounds,
                           mode="sum", include_last_offset=True)
