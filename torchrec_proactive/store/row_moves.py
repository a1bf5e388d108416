"""Row moves whose length only the device knows: ``dst[dst_index[i]] = src[src_index[i]]``
for every entry ``i`` whose ``guard[i] < bound``, one kernel, no host read.

Why: a device plan's move lists are padded to the batch's id count and only their first
``num_fills`` / ``num_writebacks`` entries are real (the counts live on the device). A plain
``index_copy_`` of the real entries needs their number on the host (a sync, which the fetch
worker used to absorb, making the training thread wait for it in turn); a padded one would
read or write a row per padding entry, through PCIe when one side is the host tier. Here a
padding entry is recognised by its host row (the sentinel rows are ``>= num_rows``, see
``device_planner.py``) and does nothing: the moves of a plan are enqueued by whoever issues
them, on the copy stream, and the host never learns their sizes to move them. FBGEMM's
``lru_cache_populate`` reads its count on the device the same way.

One op (``torchrec_proactive::move_rows_``, a ``torch.library`` custom op, so fake tensors,
``CostCounter`` and ``sync_detector`` see one call):

* on CUDA with Triton (which PyTorch's CUDA builds ship for ``torch.compile``), one Triton
  kernel on a capped grid (``move_grid``: a program per 16-entry tile, at most an eighth of
  the SMs, each striding over the tiles, as FBGEMM caps its prefetch grids), so that the
  moves, which read host memory over PCIe from the SMs, leave the SMs to the compute
  stream; ``src``/``dst`` may be FBGEMM host-mapped UVM tensors (the host tier as the
  device sees it), so rows cross PCIe once, with no staging;
* elsewhere the reference: ``index_copy_`` of the kept entries (boolean indexing: it reads
  the guard, which is free on the CPU).

Invariant: kept entries have distinct ``dst_index`` values (a plan never moves two rows
into one slot or one row twice), so the result does not depend on the order of entries.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

__all__ = ["move_rows_", "triton_move_rows", "moves_on_device", "device_alias", "move_grid", "max_move_blocks",
           "MOVE_STATS", "reset_move_stats"]


#: The launch configuration of the moves issued so far (any device: what the CUDA kernel
#: launches, or would): the largest grid, in blocks. ``reset_move_stats`` clears it.
MOVE_STATS = {"grid_blocks_max": 0, "moves": 0}


def reset_move_stats() -> None:
    MOVE_STATS.update(grid_blocks_max=0, moves=0)


#: Entries one program moves at a time (a tile of rows: their loads are in flight together,
#: which is what keeps a PCIe read busy from few SMs).
TILE = 16
#: Streaming multiprocessors assumed where none can be asked (CPU counts): an H100's.
_DEFAULT_SMS = 132


def max_move_blocks(device: Optional[torch.device] = None) -> int:
    """The cap on a move's grid: an eighth of the GPU's SMs, at least 8 (FBGEMM caps its
    prefetch grids alike), so that moves leave the SMs to the compute stream's kernels."""
    sms = _DEFAULT_SMS
    if device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available():
        sms = torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
    return max(8, sms // 8)


def move_grid(n: int, device: Optional[torch.device] = None, max_blocks: Optional[int] = None) -> int:
    """Blocks the CUDA kernel launches for ``n`` entries: a block (program) per ``TILE``
    entries, at most ``max_blocks`` (``max_move_blocks``); each block strides over the
    tiles (a grid-stride loop), so any ``n`` moves in a capped grid."""
    cap = max_move_blocks(device) if max_blocks is None else max(1, int(max_blocks))
    return max(1, min(-(-n // TILE), cap))


def _note_launch(n: int, device: Optional[torch.device] = None) -> None:
    MOVE_STATS["moves"] += 1
    MOVE_STATS["grid_blocks_max"] = max(MOVE_STATS["grid_blocks_max"], move_grid(n, device))


@torch.library.custom_op("torchrec_proactive::move_rows_", mutates_args=("dst",))
def move_rows_(dst: torch.Tensor, dst_index: torch.Tensor, src: torch.Tensor, src_index: torch.Tensor,
               guard: torch.Tensor, bound: int) -> None:
    """``dst[dst_index[i]] = src[src_index[i]]`` where ``guard[i] < bound`` (2-D ``dst``
    and ``src`` of one width; 1-D index tensors of one length, on one device)."""
    _note_launch(int(guard.shape[0]))
    _reference(dst, dst_index, src, src_index, guard, bound)


def _reference(dst: torch.Tensor, dst_index: torch.Tensor, src: torch.Tensor, src_index: torch.Tensor,
               guard: torch.Tensor, bound: int) -> None:
    keep = guard < bound  # (boolean indexing reads the guard: free on the CPU, a sync on a GPU)
    dst.index_copy_(0, dst_index[keep].long(), src.index_select(0, src_index[keep]).to(dst.dtype))


@move_rows_.register_fake
def _(dst: torch.Tensor, dst_index: torch.Tensor, src: torch.Tensor, src_index: torch.Tensor,
      guard: torch.Tensor, bound: int) -> None:
    _note_launch(int(guard.shape[0]))
    return None


@functools.lru_cache(maxsize=None)
def _triton_kernel() -> Optional[Any]:
    """The Triton kernel, or None where Triton is not installed (CPU builds of PyTorch)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def _move_rows_kernel(dst, dst_index, src, src_index, guard, bound, n, width,
                          dst_stride, src_stride, TILE: tl.constexpr, BLOCK: tl.constexpr):
        # A capped grid (move_grid): program p moves tiles p, p + grid, ... of TILE entries
        # each. A padding entry (its host row is a sentinel, >= bound) does nothing: no row
        # of either side is touched for it.
        grid = tl.num_programs(0)
        num_tiles = tl.cdiv(n, TILE)
        for t in range(tl.program_id(0), num_tiles, grid):
            entries = t * TILE + tl.arange(0, TILE)
            live = entries < n
            keep = live & (tl.load(guard + entries, mask=live, other=bound) < bound)
            d = tl.load(dst_index + entries, mask=keep, other=0).to(tl.int64)
            s = tl.load(src_index + entries, mask=keep, other=0).to(tl.int64)
            for start in range(0, width, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = keep[:, None] & (cols < width)[None, :]
                v = tl.load(src + s[:, None] * src_stride + cols[None, :], mask=mask)
                tl.store(dst + d[:, None] * dst_stride + cols[None, :], v.to(dst.dtype.element_ty), mask=mask)

    return _move_rows_kernel


def triton_move_rows(dst: torch.Tensor, dst_index: torch.Tensor, src: torch.Tensor, src_index: torch.Tensor,
                     guard: torch.Tensor, bound: int, max_blocks: Optional[int] = None) -> int:
    """``move_rows_`` as one Triton kernel (CUDA; on the CPU under ``TRITON_INTERPRET=1``),
    launched on ``move_grid`` blocks (capped: see ``max_move_blocks``). Returns the grid."""
    kernel = _triton_kernel()
    if kernel is None:
        raise RuntimeError("triton_move_rows needs Triton")
    n = int(guard.shape[0])
    if n == 0:
        return 0
    width = int(dst.shape[1])
    if dst.stride(1) != 1 or src.stride(1) != 1:
        raise ValueError("move_rows_: rows must be contiguous")
    block = min(256, max(16, 1 << (width - 1).bit_length()))
    grid = move_grid(n, dst.device, max_blocks)
    kernel[(grid,)](dst, dst_index, src, src_index, guard, bound, n, width, dst.stride(0), src.stride(0),
                    TILE=TILE, BLOCK=block)
    return grid


def moves_on_device(device: torch.device) -> bool:
    """Whether ``move_rows_`` on ``device`` runs without reading its guard on the host."""
    return torch.device(device).type == "cuda" and _triton_kernel() is not None


@move_rows_.register_kernel("cuda")
def _(dst: torch.Tensor, dst_index: torch.Tensor, src: torch.Tensor, src_index: torch.Tensor,
      guard: torch.Tensor, bound: int) -> None:
    # Triton is imported at the first move, not with the package (CPU users never pay it).
    _note_launch(int(guard.shape[0]), dst.device)
    if _triton_kernel() is None:
        _reference(dst, dst_index, src, src_index, guard, bound)
    else:
        triton_move_rows(dst, dst_index, src, src_index, guard, bound)


class _CudaArrayInterface:
    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 2, "strides": None}


def device_alias(t: torch.Tensor, device: torch.device) -> Optional[torch.Tensor]:
    """A CUDA tensor over the bytes of ``t``, pinned host memory (which the GPU addresses
    through unified virtual addressing, as FBGEMM's host-mapped UVM), or None where that
    is not possible (off CUDA, pageable or non-contiguous memory). It owns nothing: whoever
    holds it must hold ``t``."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available() or not t.is_contiguous() or not t.is_pinned():
        return None
    try:
        raw = torch.as_tensor(_CudaArrayInterface(t.data_ptr(), t.numel() * t.element_size()), device=device)
        return raw.view(t.dtype).view(t.shape)
    except (RuntimeError, TypeError, ValueError):
        return None
