"""MXFP4 (OCP Microscaling v1.0): e2m1 elements sharing one e8m0 scale per block of 32.

Checkpoint layout (the contract's MoE weights): `packed [..., K/2]` uint8 holds two e2m1 codes
per byte along K, the low nibble being the even element; `scales [..., K/32]` uint8 holds e8m0
exponents, and an element's value is `e2m1 × 2^(scale − 127)`.
"""

from __future__ import annotations

import torch

from ..validation import check_tensor, dtype_name

__all__ = [
    "E2M1_VALUES",
    "MXFP4_BLOCK",
    "dequantize_mxfp4",
    "e2m1_to_float",
    "float_to_e2m1",
    "pack_e2m1",
    "quantize_mxfp4",
    "unpack_e2m1",
]

# Code c: bit 3 sign, bits 2..1 exponent (bias 1), bit 0 mantissa. Code 8 is -0.0.
E2M1_VALUES: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip

MXFP4_BLOCK = 32

# Largest power-of-two exponent of an e2m1 value (6 = 1.5 × 2^2); the OCP scale rule subtracts it.
_E2M1_EMAX = 2
_E8M0_BIAS = 127
_E8M0_MAX = 254  # 255 encodes NaN

# Midpoints between consecutive e2m1 magnitudes (codes i and i+1).
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_tensor(fn: str, name: str, t: object, dtypes: tuple[torch.dtype, ...]) -> None:
    check_tensor(fn, name, t, dtypes=dtypes)
    if t.dim() == 0:
        raise ValueError(f"{fn}: {name} has shape [], expected at least one dimension")


def _check_codes(fn: str, codes: torch.Tensor) -> None:
    # A code above 15 would spill into the neighbouring nibble when packed: refuse, never corrupt.
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"{fn}: codes has value {int(codes.max())}, expected values in 0..15")


def _check_finite(fn: str, name: str, x: torch.Tensor) -> None:
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{fn}: {name} contains NaN or inf, expected finite values")


def _pack(codes: torch.Tensor) -> torch.Tensor:
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _lookup(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    table = torch.tensor(E2M1_VALUES, dtype=dtype, device=codes.device)
    return table[codes.long()]


def _round_e2m1(x: torch.Tensor) -> torch.Tensor:
    # Counting the midpoints below |x| gives the nearest magnitude code, saturating at 7 (6.0).
    # A value exactly on a midpoint goes to the even code (IEEE roundTiesToEven, which the OCP spec
    # and PTX `cvt.rn.satfinite.e2m1x2` use), so device quantizers can agree with this bit-exactly:
    # the comparison is strict where the lower code is even and inclusive where it is odd.
    mag = x.abs()
    codes = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for lower_code, midpoint in enumerate(_MIDPOINTS):
        above = mag > midpoint if lower_code % 2 == 0 else mag >= midpoint
        codes += above
    # The sign bit is kept for -0.0 and small negatives too, as the hardware conversion does.
    return codes | (torch.signbit(x).to(torch.uint8) << 3)


def _e8m0_to_float32(scales: torch.Tensor) -> torch.Tensor:
    # e8m0 and float32 share the exponent bias 127, so byte s is exactly the float32 exponent field;
    # building the bits avoids exp2, whose device implementations need not be exact. Byte 0 (2^-127)
    # is a float32 subnormal and byte 255 is NaN.
    s = scales.to(torch.int32)
    bits = torch.where(s == 0, 0x400000, s << 23)
    bits = torch.where(s == 255, 0x7FC00000, bits)
    return bits.view(torch.float32)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Packs e2m1 codes two per byte: `codes [..., K]` uint8 in 0..15 -> `[..., K/2]` uint8.

    The even element goes to the low nibble, the odd element to the high nibble.
    """
    _check_tensor("pack_e2m1", "codes", codes, (torch.uint8,))
    if codes.shape[-1] % 2:
        raise ValueError(
            f"pack_e2m1: codes has last dimension {codes.shape[-1]}, expected an even number"
        )
    _check_codes("pack_e2m1", codes)
    return _pack(codes)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Unpacks `packed [..., K/2]` uint8 into e2m1 codes `[..., K]` uint8 (low nibble first)."""
    _check_tensor("unpack_e2m1", "packed", packed, (torch.uint8,))
    return _unpack(packed)


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """Decodes e2m1 `codes [...]` uint8 in 0..15 to float32 values of the same shape."""
    _check_tensor("e2m1_to_float", "codes", codes, (torch.uint8,))
    _check_codes("e2m1_to_float", codes)
    return _lookup(codes, torch.float32)


def float_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Rounds `x [...]` (float16, bfloat16, float32 or float64) to e2m1 codes `[...]` uint8.

    Rounds to the nearest e2m1 value, ties to the even code (0.25 -> 0, 0.75 -> 1, 5 -> 4), and
    saturates magnitudes above 6 to ±6. The sign is kept, so small negatives give code 8 (-0.0).
    Raises ValueError if `x` holds NaN or inf: e2m1 has no encoding for them.
    """
    _check_tensor("float_to_e2m1", "x", x, _FLOAT_DTYPES)
    _check_finite("float_to_e2m1", "x", x)
    return _round_e2m1(x)


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes `x [..., K]` to MXFP4: returns `packed [..., K/2]` and `scales [..., K/32]` uint8.

    `x` is float16, bfloat16, float32 or float64, finite, with K a multiple of 32. Each block of 32
    gets the OCP MX scale `2^(floor(log2(amax)) - 2)`, stored as e8m0 (`floor(log2(amax)) + 125`)
    clamped to 0..254; 255 (NaN) is never produced. A block of zeros gets byte 0 (2^-127), the value
    any block whose amax is below 2^-125 clamps to anyway. Elements are `x / scale` rounded to e2m1,
    ties to even, saturating at ±6 (see `float_to_e2m1`).
    """
    fn = "quantize_mxfp4"
    _check_tensor(fn, "x", x, _FLOAT_DTYPES)
    k = x.shape[-1]
    if k % MXFP4_BLOCK:
        raise ValueError(f"{fn}: x has last dimension {k}, expected a multiple of {MXFP4_BLOCK}")
    _check_finite(fn, "x", x)
    # float16/bfloat16 widen to float32 exactly; float64 stays float64 so that rounding to e2m1
    # happens once, on the exact scaled value, and never after an intermediate float32 rounding.
    work_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    blocks = x.to(work_dtype).reshape(*x.shape[:-1], k // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    # floor(log2(amax)) is the unbiased exponent field, read exactly from the bits. Zeros and
    # subnormals read as the minimum exponent, which clamps to byte 0 below.
    if work_dtype == torch.float64:
        floor_log2 = ((amax.view(torch.int64) >> 52) & 0x7FF) - 1023
    else:
        floor_log2 = ((amax.view(torch.int32) >> 23) & 0xFF) - 127
    scales = (floor_log2 - _E2M1_EMAX + _E8M0_BIAS).clamp(0, _E8M0_MAX).to(torch.uint8)
    # Multiplying by the exact power of two 2^(127 - s) = e8m0 byte (254 - s) equals dividing by
    # the scale, with no rounding of its own.
    inv_scale = _e8m0_to_float32(_E8M0_MAX - scales).to(work_dtype)
    codes = _round_e2m1(blocks * inv_scale.unsqueeze(-1))
    return _pack(codes.reshape(x.shape)), scales


def dequantize_mxfp4(
    packed: torch.Tensor, scales: torch.Tensor, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Decodes `packed [..., K/2]` and `scales [..., K/32]` (uint8) to `[..., K]` of `dtype`.

    Value = e2m1 × 2^(scale − 127), computed exactly in float32 (float64 when `dtype` is float64)
    and then cast; a value beyond the range of that type becomes ±inf and scale byte 255 gives NaN.
    """
    fn = "dequantize_mxfp4"
    _check_tensor(fn, "packed", packed, (torch.uint8,))
    _check_tensor(fn, "scales", scales, (torch.uint8,))
    if dtype not in _FLOAT_DTYPES:
        expected = ", ".join(dtype_name(d) for d in _FLOAT_DTYPES)
        raise ValueError(f"{fn}: dtype is {dtype_name(dtype)}, expected one of {expected}")
    half_block = MXFP4_BLOCK // 2
    if packed.shape[-1] % half_block:
        raise ValueError(
            f"{fn}: packed has last dimension {packed.shape[-1]}, expected a multiple of "
            f"{half_block} (K/2 with K a multiple of {MXFP4_BLOCK})"
        )
    expected_shape = [*packed.shape[:-1], packed.shape[-1] // half_block]
    if list(scales.shape) != expected_shape:
        raise ValueError(f"{fn}: scales has shape {list(scales.shape)}, expected {expected_shape}")
    if scales.device != packed.device:
        raise ValueError(f"{fn}: scales is on {scales.device}, expected {packed.device} (packed's)")
    work_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    values = _lookup(_unpack(packed), work_dtype)
    values = values.reshape(*expected_shape, MXFP4_BLOCK)
    out = values * _e8m0_to_float32(scales).to(work_dtype).unsqueeze(-1)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2).to(dtype)
