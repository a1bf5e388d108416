"""FBGEMM's FP16 stochastic rounding of an update, as one fused op.

The rule (FBGEMM's CUDA ``stochastic_rounding_scalar``): 32 random bits per value, a pure
function of ``(seed, step, row id, column)`` so that a row rounds the same whichever slot
or tier holds it; their top 13 bits become noise below FP16's precision at the value's
exponent, added with its sign, and the sum is rounded toward zero. A value therefore rounds
away from zero with a probability equal to its distance from the FP16 value below it.

Why one op (issue 30, item 6). Written as ATen ops the rule is a hash over ``[n, dim]`` and
a dozen elementwise passes: ~95 kernels and ~220 bytes of memory traffic per value at
2M x 128, several GB per step. FBGEMM rounds inside its update kernel, in registers. Here
the rule is one ``torch.library`` custom op, ``torchrec_proactive::round_fp16_stochastic``:

* on CUDA, one Triton kernel (PyTorch's CUDA builds ship Triton for ``torch.compile``):
  each FP32 value read once, its FP16 value written once, the row ids read once per row;
* elsewhere (and on CUDA without Triton) the ATen reference, :func:`reference_round_fp16`.

The two give the same bits (``tests/test_fused_rounding.py`` runs the Triton kernel under
Triton's interpreter on the CPU against the reference), so a row overflowing to the host
tier, where the reference runs, rounds as it would have in the cache: the cache size
never changes a result. Fake tensors, ``CostCounter`` and ``sync_detector`` see one op.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

__all__ = [
    "round_rows",
    "rounding_key",
    "rounding_bits",
    "stochastic_round_fp16",
    "reference_round_fp16",
    "triton_round_fp16",
]

_M32 = 0xFFFFFFFF
_FP16_MAX_EXPONENT_BITS = -8388608  # 0xff800000 as an int32: the sign and exponent of an FP32
_MIX_1, _MIX_2 = 0x7FEB352D, 0x846CA68B  # Wellons' "lowbias32" multipliers
_GOLDEN = 0x9E3779B9  # spreads column numbers before they are hashed


def round_rows(
    values: torch.Tensor,
    dtype: torch.dtype,
    stochastic_rows: Optional[torch.Tensor] = None,
    seed: int = 0,
    step: int = 0,
) -> torch.Tensor:
    """FP32 rows rounded once into the table's ``dtype``: stochastically for FP16 when
    ``stochastic_rows`` (the rows' ids, keying the noise) is given - FBGEMM's CUDA rule -,
    else to nearest (FBGEMM's CPU kernel, and every dtype FBGEMM does not round
    stochastically, BF16 included)."""
    if dtype == values.dtype:
        return values
    if dtype == torch.float16 and stochastic_rows is not None:
        return round_fp16_stochastic(values.float().contiguous(), stochastic_rows.to(torch.int64),
                                     rounding_key(seed, step))
    return values.to(dtype)


def rounding_key(seed: int, step: int) -> int:
    """The 32-bit key of one step's draws (host arithmetic: nothing waits for a device)."""
    return _mix32(_mix32(step & _M32) ^ (seed & _M32))


@torch.library.custom_op("torchrec_proactive::round_fp16_stochastic", mutates_args=())
def round_fp16_stochastic(values: torch.Tensor, rows: torch.Tensor, key: int) -> torch.Tensor:
    """``[n, dim]`` FP32 ``values`` rounded to FP16 by the stochastic rule, row ``i``'s noise
    keyed by ``(key, rows[i], column)`` (``rows``: int64, ``[n]``; ``key``: ``rounding_key``)."""
    return reference_round_fp16(values, rows, key)


@round_fp16_stochastic.register_fake
def _(values: torch.Tensor, rows: torch.Tensor, key: int) -> torch.Tensor:
    return torch.empty(values.shape, dtype=torch.float16, device=values.device)


@round_fp16_stochastic.register_kernel("cuda")
def _(values: torch.Tensor, rows: torch.Tensor, key: int) -> torch.Tensor:
    # Triton is imported at the first rounding, not with the package (CPU users never pay it).
    if _triton_kernel() is None:
        return reference_round_fp16(values, rows, key)
    return triton_round_fp16(values, rows, key)


# ---------------------------------------------------------------------- reference (ATen)
def reference_round_fp16(values: torch.Tensor, rows: torch.Tensor, key: int) -> torch.Tensor:
    """The rule in ATen ops: the definition the Triton kernel is tested against."""
    return stochastic_round_fp16(values, _bits(key, rows, int(values.shape[1])))


def stochastic_round_fp16(x: torch.Tensor, random_bits: torch.Tensor) -> torch.Tensor:
    """FP32 -> FP16 by FBGEMM's CUDA stochastic rounding (``stochastic_rounding_scalar``): the
    top 13 of 32 random bits become noise below the FP16 precision at ``x``'s exponent, added
    to ``x`` with its sign, and the sum is rounded toward zero. So ``x`` rounds away from zero
    with a probability equal to its distance from the FP16 value below it (as FBGEMM, exact
    for ``x`` in FP16's normal range). ``random_bits``: int64 in ``[0, 2**32)`` or int32 (the
    same bits), ``x``'s shape.
    """
    bits = x.contiguous().view(torch.int32)
    sign_exponent = bits & _FP16_MAX_EXPONENT_BITS
    if random_bits.dtype == torch.int32:  # (the same 32 bits, two's complement: shift logically)
        noise = (random_bits >> 19) & 0x1FFF
    else:
        noise = (random_bits >> 19).to(torch.int32)
    noisy = (sign_exponent | noise).view(torch.float32)
    return _fp16_toward_zero(x + (noisy - sign_exponent.view(torch.float32)))


def _fp16_toward_zero(y: torch.Tensor) -> torch.Tensor:
    """``__float2half_rz``: the FP16 value nearest to ``y`` that is not further from zero."""
    nearest = y.to(torch.float16)
    overshoot = nearest.float().abs() > y.abs()
    # One FP16 step toward zero: the magnitude bits minus one (sign-magnitude order), which
    # also turns an overflow to infinity into the largest finite value, as rz does.
    return torch.where(overshoot, (nearest.view(torch.int16) - 1).view(torch.float16), nearest)


def _mul32(x: Any, c: int) -> Any:
    """``x * c mod 2**32`` for ``0 <= x < 2**32`` (int64 tensor or int) with no
    intermediate overflow."""
    return (x * (c & 0xFFFF) + ((x * (c >> 16)) & 0xFFFF) * 65536) & _M32


def _mix32(x: Any) -> Any:
    """A 32-bit integer hash (Wellons' "lowbias32"); ``x`` in ``[0, 2**32)``, int64 or int."""
    x = x ^ (x >> 16)
    x = _mul32(x, _MIX_1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MIX_2)
    return x ^ (x >> 16)


def rounding_bits(seed: int, step: int, rows: torch.Tensor, dim: int) -> torch.Tensor:
    """``[len(rows), dim]`` random 32-bit values (int64), a pure function of
    ``(seed, step, row, column)``: reproducible, and the same whichever slot holds a row."""
    return _bits(rounding_key(seed, step), rows, dim).to(torch.int64) & _M32


def _bits(key: int, rows: torch.Tensor, dim: int) -> torch.Tensor:
    """:func:`rounding_bits` of a step's key, as int32 (the same 32 bits, two's complement).
    The per-row and per-column hashes are vectors; only the last mix runs over
    ``[len(rows), dim]``, in int32 (its multiplications wrap modulo 2**32 as the hash needs)."""
    rows = rows.to(torch.int64)
    per_row = _mix32(_mix32((rows & _M32) ^ key) ^ ((rows >> 32) & _M32))
    columns = _mix32(torch.arange(dim, dtype=torch.int64, device=rows.device) * _GOLDEN & _M32)
    return _mix32_int32(_to_int32(per_row).unsqueeze(1) ^ _to_int32(columns))


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in ``[0, 2**32)`` (int64) as the int32 with the same bits."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def _mix32_int32(x: torch.Tensor) -> torch.Tensor:
    """:func:`_mix32` on int32 bit patterns: logical shifts are arithmetic shifts masked."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _MIX_1
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * (_MIX_2 - 2**32)  # (as a signed 32-bit constant)
    return x ^ ((x >> 16) & 0xFFFF)


# ---------------------------------------------------------------------- Triton (CUDA)
@functools.lru_cache(maxsize=None)
def _triton_kernel() -> Optional[Any]:
    """The Triton kernel (``_triton_rounding.py``), or None where Triton is not installed
    (CPU builds of PyTorch)."""
    try:
        from ._triton_rounding import round_kernel
    except ImportError:
        return None
    return round_kernel


def triton_round_fp16(values: torch.Tensor, rows: torch.Tensor, key: int) -> torch.Tensor:
    """The op as one Triton kernel (CUDA; on the CPU under ``TRITON_INTERPRET=1``)."""
    kernel = _triton_kernel()
    if kernel is None:
        raise RuntimeError("triton_round_fp16 needs Triton")
    values = values.contiguous()
    n, width = int(values.shape[0]), int(values.shape[1])
    out = torch.empty((n, width), dtype=torch.float16, device=values.device)
    if n == 0 or width == 0:
        return out
    block = min(1024, max(16, 1 << (width - 1).bit_length()))
    key_bits = key - 2**32 if key >= 2**31 else key  # (an int32 argument with the key's bits)
    kernel[(n,)](values, rows, out, key_bits, width, values.stride(0), out.stride(0), BLOCK=block)
    return out
