"""The Triton kernel of ``stochastic_rounding.round_fp16_stochastic`` (imported only where
Triton is installed, at the first rounding on CUDA). It must give the bits of
``stochastic_rounding.reference_round_fp16``; see that module for the rule."""

from __future__ import annotations

import triton
import triton.language as tl

# (module constants a jitted function reads must be constexpr; the values are
# stochastic_rounding's, checked equal there by the kernel test)
_MIX_1: tl.constexpr = tl.constexpr(0x7FEB352D)
_MIX_2: tl.constexpr = tl.constexpr(0x846CA68B)
_GOLDEN: tl.constexpr = tl.constexpr(0x9E3779B9)
_SIGN_EXPONENT: tl.constexpr = tl.constexpr(-8388608)  # 0xff800000 as an int32


@triton.jit
def _mix(x):
    # lowbias32 on uint32 (multiplications wrap modulo 2**32, shifts are logical); the
    # constants are typed, so that no promotion to 64 bits can change a product.
    x = x ^ (x >> 16)
    x = x * tl.full((), _MIX_1, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full((), _MIX_2, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def round_kernel(values, rows, out, key_bits, width, in_stride, out_stride, BLOCK: tl.constexpr):
    """One program per row: the row's hash once, then its values a block at a time."""
    i = tl.program_id(0)
    row = tl.load(rows + i)  # int64: its two 32-bit halves are hashed in turn
    low = (row & 0xFFFFFFFF).to(tl.uint32)
    high = ((row >> 32) & 0xFFFFFFFF).to(tl.uint32)
    key = key_bits.to(tl.uint32, bitcast=True)
    per_row = _mix(_mix(low ^ key) ^ high)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < width
        column = _mix(cols.to(tl.uint32) * tl.full((), _GOLDEN, tl.uint32))
        noise = (_mix(per_row ^ column) >> 19).to(tl.int32, bitcast=True)
        x = tl.load(values + i.to(tl.int64) * in_stride + cols, mask=mask, other=0.0)
        sign_exponent = x.to(tl.int32, bitcast=True) & _SIGN_EXPONENT
        noisy = (sign_exponent | noise).to(tl.float32, bitcast=True)
        y = x + (noisy - sign_exponent.to(tl.float32, bitcast=True))
        nearest = y.to(tl.float16)
        # toward zero: one FP16 step back where rounding to nearest went further out
        back = (nearest.to(tl.int16, bitcast=True) - 1).to(tl.float16, bitcast=True)
        result = tl.where(tl.abs(nearest.to(tl.float32)) > tl.abs(y), back, nearest)
        tl.store(out + i.to(tl.int64) * out_stride + cols, result, mask=mask)
