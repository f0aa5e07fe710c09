"""FP8 e4m3 (`torch.float8_e4m3fn`) with float32 scales: `x ≈ q × scale`.

Granularities: "tensor" (one scale, shape []), "channel" (one per row of a weight `[..., N, K]`,
scale `[..., N]`) and "token" (one per row of activations `[..., M, K]`, scale `[..., M]`). Channel
and token are both row-wise (the amax is taken over the last dimension); both names are kept because
they are what weight and activation code call them.
"""

from __future__ import annotations

import torch

from ..validation import check_tensor, dtype_name

__all__ = ["FP8_DTYPE", "FP8_E4M3_MAX", "dequantize_fp8", "quantize_fp8"]

FP8_E4M3_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn

GRANULARITIES = ("tensor", "channel", "token")

# An all-zero tensor or row would give scale 0 and 0/0 = NaN; flooring amax keeps the scale
# positive (>= 1e-12 / 448) so zeros quantize to 0. Rows whose amax is below it are noise anyway.
_AMAX_FLOOR = 1e-12

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_granularity(fn: str, granularity: str) -> None:
    if granularity not in GRANULARITIES:
        allowed = ", ".join(repr(g) for g in GRANULARITIES)
        raise ValueError(f"{fn}: granularity is {granularity!r}, expected one of {allowed}")


def _static_scale(fn: str, scale: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(
                f"{fn}: scale has shape {list(scale.shape)}, expected one element for "
                "granularity 'tensor'"
            )
        if scale.device != device:
            raise ValueError(f"{fn}: scale is on {scale.device}, expected {device} (x's)")
        scale = scale.reshape(()).to(torch.float32)
    else:
        scale = torch.tensor(float(scale), dtype=torch.float32, device=device)
    value = float(scale)
    if not (value > 0 and value < float("inf")):
        raise ValueError(f"{fn}: scale is {value}, expected a finite positive value")
    return scale


def quantize_fp8(
    x: torch.Tensor, *, granularity: str = "tensor", scale: torch.Tensor | float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes `x [..., K]` to float8_e4m3fn: returns `(q [..., K], scale)` with `x ≈ q × scale`.

    `scale` is float32 of shape [] for granularity "tensor" and `[...]` (x's shape without its last
    dimension) for "channel" and "token". A static `scale` (a float or a one-element tensor) is
    used as given and is only valid with "tensor"; otherwise the scale is `max(amax, 1e-12) / 448`.
    `x / scale` is clamped to ±448 and cast, which rounds to nearest, ties to even. Raises
    ValueError if `x` holds NaN or inf: a dynamic scale would silently turn the whole tensor or
    row into NaN.
    """
    fn = "quantize_fp8"
    _check_granularity(fn, granularity)
    check_tensor(fn, "x", x, dtypes=_FLOAT_DTYPES)
    if granularity != "tensor":
        if scale is not None:
            raise ValueError(
                f"{fn}: scale is given with granularity {granularity!r}, expected a static scale "
                "only with granularity 'tensor'"
            )
        if x.dim() == 0:
            raise ValueError(
                f"{fn}: x has shape [], expected at least one dimension for granularity "
                f"{granularity!r}"
            )
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{fn}: x contains NaN or inf, expected finite values")
    # float32 holds float16/bfloat16 exactly and is the precision the scales are stored in.
    xf = x.to(torch.float32)
    # CUDA divides by a python scalar as a multiply by its rounded reciprocal (1/448 is inexact),
    # so dividing by a device tensor keeps the scale correctly rounded and equal to the CPU's.
    fp8_max = torch.full((), FP8_E4M3_MAX, dtype=torch.float32, device=x.device)
    if scale is not None:
        scale = _static_scale(fn, scale, x.device)
        scaled = xf / scale
    elif granularity == "tensor":
        scale = xf.abs().amax().clamp(min=_AMAX_FLOOR) / fp8_max
        scaled = xf / scale
    else:
        scale = xf.abs().amax(dim=-1).clamp(min=_AMAX_FLOOR) / fp8_max
        scaled = xf / scale.unsqueeze(-1)
    # The clamp catches amax / (amax / 448) landing a rounding step above 448, and static-scale
    # overflow, which the cast would otherwise turn into NaN (e4m3fn has no inf).
    q = scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8(
    q: torch.Tensor,
    scale: torch.Tensor | float,
    *,
    granularity: str = "tensor",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Returns `q [..., K] × scale` as `dtype`, computed in float32 (float64 for `dtype` float64).

    `scale` is a float or one-element tensor for "tensor", `[...]` (q's shape without its last
    dimension) for "channel" and "token".
    """
    fn = "dequantize_fp8"
    _check_granularity(fn, granularity)
    check_tensor(fn, "q", q, dtypes=(FP8_DTYPE,))
    if dtype not in _FLOAT_DTYPES:
        expected = ", ".join(dtype_name(d) for d in _FLOAT_DTYPES)
        raise ValueError(f"{fn}: dtype is {dtype_name(dtype)}, expected one of {expected}")
    work_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    if not isinstance(scale, torch.Tensor):
        scale = torch.tensor(float(scale), dtype=torch.float32, device=q.device)
    check_tensor(fn, "scale", scale, dtypes=_FLOAT_DTYPES)
    if scale.device != q.device:
        raise ValueError(f"{fn}: scale is on {scale.device}, expected {q.device} (q's)")
    if granularity == "tensor":
        if scale.numel() != 1:
            raise ValueError(
                f"{fn}: scale has shape {list(scale.shape)}, expected one element for "
                "granularity 'tensor'"
            )
        s = scale.reshape(())
    else:
        expected_shape = list(q.shape[:-1])
        if q.dim() == 0 or list(scale.shape) != expected_shape:
            raise ValueError(
                f"{fn}: scale has shape {list(scale.shape)}, expected {expected_shape} for "
                f"granularity {granularity!r} with q of shape {list(q.shape)}"
            )
        s = scale.unsqueeze(-1)
    return (q.to(work_dtype) * s.to(work_dtype)).to(dtype)
