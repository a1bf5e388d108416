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

from typing import Tuple

import torch
import torch.nn.functional as F


def padded_unique(values: torch.Tensor, pad: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.unique(values, sorted=True, return_inverse=True)`` padded to ``len(values)``.

    Returns ``(unique, inverse, count)``: ``unique[:count]`` are the sorted distinct values
    and ``unique[count:] == pad``; ``inverse[i]`` is the index of ``values[i]`` in ``unique``.
    One sort and a cumulative sum (FBGEMM's ``lru_cache_find_uncached`` does the same).
    """
    n = values.shape[0]
    ordered, order = torch.sort(values, stable=True)
    first = torch.ones(n, dtype=torch.bool, device=values.device)
    if n > 1:  # (narrow, not slicing: see sync_detector on fake CUDA tensors)
        torch.ne(ordered.narrow(0, 1, n - 1), ordered.narrow(0, 0, n - 1), out=first.narrow(0, 1, n - 1))
    index_of_sorted = torch.cumsum(first, 0) - 1  # int64
    inverse = torch.empty(n, dtype=torch.int64, device=values.device)
    inverse.index_copy_(0, order, index_of_sorted)
    unique = torch.full((n + 1,), pad, dtype=values.dtype, device=values.device)
    # Duplicates write the same value to the same place, so the result is deterministic.
    unique.index_copy_(0, index_of_sorted, ordered)
    count = first.sum()
    return unique.narrow(0, 0, n), inverse, count


def compact(mask: torch.Tensor, fill: int, *values: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """The entries of each of ``values`` where ``mask`` holds, moved to the front in order,
    the rest set to ``fill``; and their number (0-d). Same length as the input.

    ``values[mask]`` without the data-dependent output size: each kept entry goes to its
    rank among the kept ones (a cumulative sum), the others to one spare position past the
    end, which is dropped.
    """
    n = mask.shape[0]
    rank = torch.cumsum(mask, 0) - 1
    target = torch.where(mask, rank, torch.full_like(rank, n))
    out = []
    for v in values:
        buffer = torch.full((n + 1, *v.shape[1:]), fill, dtype=v.dtype, device=v.device)
        buffer.index_copy_(0, target, v)  # (several writes land on the spare entry only)
        out.append(buffer.narrow(0, 0, n))
    return (*out, mask.sum())


def segment_sum(index: torch.Tensor, src: torch.Tensor, num_segments: int) -> torch.Tensor:
    """``zeros(num_segments, d).index_add_(0, index, src)`` in a deterministic order.

    ``index_add_`` adds duplicates with atomics on CUDA, so the order of the additions, and
    the rounding, changes from run to run. Here the entries are sorted by segment (a stable
    sort keeps their original order within a segment) and each segment is one bag of an
    ``embedding_bag`` sum, which adds a bag's entries one after the other: the same order
    on every run and on every device (FBGEMM's backward is sort-based for the same reason).
    """
    order = torch.argsort(index, stable=True)
    bounds = torch.searchsorted(index.index_select(0, order),
                                torch.arange(num_segments + 1, device=index.device, dtype=index.dtype))
    return F.embedding_bag(order, src, bounds, mode="sum", include_last_offset=True)
