"""e4m3 (float8_e4m3fn) rounding as core's quantize_fp8 does it, shared by the quantization pass
(quant.py), the one-program router's x rows and the Hopper GEMM's epilogue: a dynamic scale is
max(amax, 1e-12) / 448 with IEEE division, then q = clamp(x / scale, -448, 448) rounded to
nearest even.
"""

from __future__ import annotations

import triton
import triton.language as tl

# The largest float8_e4m3fn magnitude.
FP8_MAX = tl.constexpr(448.0)
AMAX_FLOOR = tl.constexpr(1e-12)


@triton.jit
def round_to_fp8(x, INTERPRETED: tl.constexpr):
    """x float32 within +-448 -> float8_e4m3fn, rounded to nearest even. The Triton 3.6
    interpreter rounds values just below a power of two down a whole binade (124.7 -> 64), so
    there x is first rounded to e4m3 precision in float32: 3 mantissa bits on the bits for
    normals, multiples of 2^-9 (the subnormal step, via an exact magic-number add) below 2^-6."""
    if INTERPRETED:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
        normal = bits.to(tl.float32, bitcast=True)
        sub = (x + 12288.0) - 12288.0
        x = tl.where(tl.abs(x) < 0.015625, sub, normal)
    return x.to(tl.float8e4nv)


@triton.jit
def dynamic_scale(x):
    """The per-row scale of float32 x (all of the row)."""
    return tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), AMAX_FLOOR), FP8_MAX)


@triton.jit
def e4m3_of(x, scale, INTERPRETED: tl.constexpr):
    """float32 x / scale (IEEE division) clamped to +-448 and rounded to the nearest e4m3."""
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
    return round_to_fp8(q, INTERPRETED)
