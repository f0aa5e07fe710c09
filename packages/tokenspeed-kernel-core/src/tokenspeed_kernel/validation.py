"""Input validation shared by the public operators.

Every message names the op and the argument, what was expected and what was received.
These run on every call, so they only touch tensor metadata (never values on the device).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

FLOAT16_DTYPES = frozenset({torch.bfloat16, torch.float16})
FP8_DTYPES = frozenset({torch.float8_e4m3fn})
KV_CACHE_DTYPES = FLOAT16_DTYPES | FP8_DTYPES
SINK_DTYPES = frozenset({torch.float32, torch.bfloat16})


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def describe_dtypes(dtypes: Collection[torch.dtype]) -> str:
    names = sorted(dtype_name(d) for d in dtypes)
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def check_tensor(
    op: str,
    name: str,
    x: object,
    *,
    shape: Sequence[int | None] | None = None,
    dtypes: Collection[torch.dtype] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check a tensor argument; `None` entries in `shape` accept any size."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {name} is {type(x).__name__}, expected a torch.Tensor")
    if shape is not None:
        actual = x.shape
        # A plain loop: this runs several times per op call and any(<genexpr>) costs ~2x.
        mismatch = len(actual) != len(shape)
        if not mismatch:
            for got, want in zip(actual, shape, strict=True):
                if want is not None and got != want:
                    mismatch = True
                    break
        if mismatch:
            expected = ", ".join("*" if s is None else str(s) for s in shape)
            raise ValueError(f"{op}: {name} has shape {list(actual)}, expected [{expected}]")
    if dtypes is not None and x.dtype not in dtypes:
        raise ValueError(
            f"{op}: {name} has dtype {dtype_name(x.dtype)}, expected {describe_dtypes(dtypes)}"
        )
    if device is not None and x.device != device:
        raise ValueError(f"{op}: {name} is on {x.device}, expected {device} (the device of q)")
    return x


def check_ndim(op: str, name: str, x: object, ndims: Collection[int]) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {name} is {type(x).__name__}, expected a torch.Tensor")
    if x.dim() not in ndims:
        want = " or ".join(f"{n}-D" for n in sorted(ndims))
        raise ValueError(f"{op}: {name} has shape {list(x.shape)}, expected {want}")
    return x


def check_contiguous_last_dim(op: str, name: str, x: torch.Tensor) -> None:
    # Kernels vectorize loads along the head dim; a strided last dim would silently need a copy.
    if x.stride(-1) != 1:
        raise ValueError(
            f"{op}: {name} has stride {x.stride(-1)} in its last dim, expected 1 (contiguous)"
        )


def check_int(op: str, name: str, value: object, *, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{op}: {name} is {type(value).__name__}, expected int")
    if value < minimum:
        raise ValueError(f"{op}: {name} is {value}, expected an int >= {minimum}")
    return value


def check_scale(op: str, name: str, value: object) -> float:
    """Per-tensor dequantization scale: None means 1.0."""
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{op}: {name} is {type(value).__name__}, expected a float")
    value = float(value)
    if not (value > 0.0 and value != float("inf")):
        raise ValueError(f"{op}: {name} is {value}, expected a finite float > 0")
    return value
