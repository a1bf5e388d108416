"""The kernel's VBE output layout (``VbeLayout``), against a reference written from
TorchRec's description of its VBE output: rank-major, within a rank feature by feature,
each feature's ``B[f][r]`` bags of ``dim`` values; merged outputs put each group's
(rank, feature) segment at TorchRec's ``vbe_output_offsets[r][f]``."""

from __future__ import annotations

import torch

from torchrec_proactive.integration.embedding_kernel import VbeLayout


def _bags_in_kjt_order(strides):
    """(feature, rank, bag) of every bag in the KJT's order: feature-major, then rank."""
    return [(f, r, b) for f, per_rank in enumerate(strides) for r, n in enumerate(per_rank) for b in range(n)]


def test_order_is_rank_major_then_feature():
    strides = [[2, 1], [3, 0], [1, 2]]  # B[f][r]
    kjt = _bags_in_kjt_order(strides)
    layout = VbeLayout.of(strides, torch.device("cpu"))
    got = [kjt[i] for i in layout.order.tolist()]
    assert got == sorted(kjt, key=lambda t: (t[1], t[0], t[2]))


def test_place_writes_each_segment_at_its_offset_and_keeps_the_rest():
    strides, dim = [[2, 1], [3, 0]], 4  # this group: 2 features over 2 ranks
    layout = VbeLayout.of(strides, torch.device("cpu"))
    flat = torch.arange(1.0, 1 + sum(map(sum, strides)) * dim)  # this group's values, rank-major
    # another group's segments sit between ours: rank 0 at [0, 8) [30, 42), rank 1 at [50, 54) [60, 60)
    offsets = torch.tensor([[0, 30], [50, 60]])
    output = torch.full((70,), -1.0)
    out = layout.place(flat, dim, output, offsets)
    want = output.clone()
    pos = 0
    for r in range(2):
        for f in range(2):
            n = strides[f][r] * dim
            want[offsets[r][f]: offsets[r][f] + n] = flat[pos: pos + n]
            pos += n
    assert torch.equal(out, want)
    assert torch.equal(output, torch.full((70,), -1.0))  # out of place (autograd sees every group)
