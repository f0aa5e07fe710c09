"""One per-dtype tolerance table and the comparison every conformance check uses.

A kernel and the reference see the same inputs in the same formats, so the budget covers float32
accumulation in another order plus the final rounding of the output: half an ulp of bf16 (2^-9)
or fp16 (2^-12) relative, with a little headroom. FP8 results (a quantizing cache store, an MoE
output computed through FP8 activations) may round an element one e4m3 step (2^-3 relative)
differently after a different intermediate rounding; in MoE such steps add up to a few percent
of the output's RMS, which the case builders keep O(1), hence an absolute 2^-4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..validation import dtype_name


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.bfloat16: Tolerance(1e-2, 1.6e-2),
    torch.float16: Tolerance(2e-3, 2e-3),
    # lse and other float32 results: accumulation order only.
    torch.float32: Tolerance(2e-4, 2e-5),
    torch.float8_e4m3fn: Tolerance(2.0**-4, 2.0**-3),
}


def tolerance(dtype: torch.dtype) -> Tolerance:
    if dtype not in TOLERANCES:
        known = ", ".join(dtype_name(d) for d in TOLERANCES)
        raise ValueError(f"tolerance: no entry for {dtype_name(dtype)}, expected one of {known}")
    return TOLERANCES[dtype]


@dataclass(frozen=True)
class Comparison:
    """Result of comparing one tensor with its expected value (errors in float64).

    max_rel is |err| / max(|expected|, atol); worst_index is the coordinate that exceeds its
    allowance the most (or the largest error when everything passes).
    """

    name: str
    ok: bool
    max_abs: float
    max_rel: float
    rms: float
    worst_index: tuple[int, ...] | None
    actual: float = math.nan
    expected: float = math.nan
    num_bad: int = 0
    numel: int = 0
    atol: float = 0.0
    rtol: float = 0.0
    message: str = ""

    def __str__(self) -> str:
        if self.message:
            return f"{self.name}: {self.message}"
        verdict = "ok" if self.ok else f"{self.num_bad}/{self.numel} outside"
        where = ""
        if self.worst_index is not None:
            where = (
                f"; worst at {self.worst_index}: got {self.actual:.6g}, "
                f"expected {self.expected:.6g}"
            )
        return (
            f"{self.name}: {verdict} atol={self.atol:g} rtol={self.rtol:g}; "
            f"max abs {self.max_abs:.3e}, max rel {self.max_rel:.3e}, "
            f"rms {self.rms:.3e}{where}"
        )


def compare(
    actual: torch.Tensor, expected: torch.Tensor, *, dtype: torch.dtype, name: str = "output"
) -> Comparison:
    """Compare under `dtype`'s tolerance: |a - e| <= atol + rtol * |e| everywhere. Equal
    infinities agree (an lse with nothing visible is -inf); NaN never does."""
    tol = tolerance(dtype)
    if tuple(actual.shape) != tuple(expected.shape):
        return Comparison(
            name,
            False,
            math.inf,
            math.inf,
            math.inf,
            None,
            atol=tol.atol,
            rtol=tol.rtol,
            message=f"shape {list(actual.shape)}, expected {list(expected.shape)}",
        )
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    numel = a.numel()
    if numel == 0:
        return Comparison(name, True, 0.0, 0.0, 0.0, None, atol=tol.atol, rtol=tol.rtol)
    same = a == e  # covers equal infinities
    err = torch.where(same, torch.zeros_like(a), (a - e).abs()).nan_to_num(nan=math.inf)
    finite_e = torch.where(torch.isfinite(e), e.abs(), torch.zeros_like(e))
    excess = err - (tol.atol + tol.rtol * finite_e)
    bad = excess > 0
    flat = int(excess.reshape(-1).argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape))
    rel = err / finite_e.clamp(min=tol.atol)
    return Comparison(
        name=name,
        ok=not bool(bad.any()),
        max_abs=float(err.max()),
        max_rel=float(rel.max()),
        rms=float(err.pow(2).mean().sqrt()),
        worst_index=index,
        actual=float(a[index]),
        expected=float(e[index]),
        num_bad=int(bad.sum()),
        numel=numel,
        atol=tol.atol,
        rtol=tol.rtol,
    )


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, *, dtype: torch.dtype, name: str = "output"
) -> Comparison:
    """`compare`, raising AssertionError with max/RMS error and the worst coordinates."""
    result = compare(actual, expected, dtype=dtype, name=name)
    if not result.ok:
        raise AssertionError(str(result))
    return result
