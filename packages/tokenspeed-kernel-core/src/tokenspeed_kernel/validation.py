"""Input validation shared by the public operators.

Every message names the op and the argument, what was expected and what was received. The
`*_error` functions build those messages and are called only once a check has failed, so a
checker on the decode path can test conditions inline and still raise the same errors as
`check_tensor`. Checks only touch tensor metadata, never values on the device.
"""

from __future__ import annotations

import math
import numbers
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


def type_error(op: str, name: str, value: object, expected: str) -> TypeError:
    return TypeError(f"{op}: {name} is {type(value).__name__}, expected {expected}")


def ndim_error(op: str, name: str, x: torch.Tensor, ndims: Collection[int]) -> ValueError:
    want = " or ".join(f"{n}-D" for n in sorted(ndims))
    return ValueError(f"{op}: {name} has shape {list(x.shape)}, expected {want}")


def shape_error(op: str, name: str, x: torch.Tensor, shape: Sequence[int | None]) -> ValueError:
    expected = ", ".join("*" if s is None else str(s) for s in shape)
    return ValueError(f"{op}: {name} has shape {list(x.shape)}, expected [{expected}]")


def dtype_error(op: str, name: str, x: torch.Tensor, dtypes: Collection[torch.dtype]):
    return ValueError(
        f"{op}: {name} has dtype {dtype_name(x.dtype)}, expected {describe_dtypes(dtypes)}"
    )


def device_error(
    op: str, name: str, x: torch.Tensor, device: torch.device, of: str = "the device of q"
) -> ValueError:
    """`of` says where the expected device comes from: q for attention, the plan for MoE."""
    return ValueError(f"{op}: {name} is on {x.device}, expected {device} ({of})")


def stride_error(op: str, name: str, x: torch.Tensor) -> ValueError:
    if x.layout is not torch.strided:
        return ValueError(f"{op}: {name} has layout {x.layout}, expected torch.strided (dense)")
    return ValueError(
        f"{op}: {name} has stride {x.stride(-1)} in its last dim, expected 1 (contiguous)"
    )


def dense_last_dim(x: torch.Tensor) -> bool:
    # Kernels vectorize loads along the last dim; a strided one would silently need a copy.
    # is_contiguous() is a cached flag, cheaper than reading the stride.
    return x.is_contiguous() or x.stride(-1) == 1


def shape_matches(actual: Sequence[int], shape: Sequence[int | None]) -> bool:
    """`None` entries of `shape` accept any size."""
    if len(actual) != len(shape):
        return False
    # A plain loop: any(<genexpr>) costs ~2x on a path that runs on every op call.
    for got, want in zip(actual, shape, strict=True):
        if want is not None and got != want:
            return False
    return True


def check_tensor(
    op: str,
    name: str,
    x: object,
    *,
    shape: Sequence[int | None] | None = None,
    dtypes: Collection[torch.dtype] | None = None,
    device: torch.device | None = None,
    device_of: str = "the device of q",
) -> torch.Tensor:
    """Check a tensor argument; `None` entries in `shape` accept any size; `device_of` names
    where `device` comes from in the error."""
    if not isinstance(x, torch.Tensor):
        raise type_error(op, name, x, "a torch.Tensor")
    if shape is not None and not shape_matches(x.shape, shape):
        raise shape_error(op, name, x, shape)
    if dtypes is not None and x.dtype not in dtypes:
        raise dtype_error(op, name, x, dtypes)
    if device is not None and x.device != device:
        raise device_error(op, name, x, device, device_of)
    return x


def check_ndim(op: str, name: str, x: object, ndims: Collection[int]) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise type_error(op, name, x, "a torch.Tensor")
    if x.dim() not in ndims:
        raise ndim_error(op, name, x, ndims)
    return x


def check_contiguous_last_dim(op: str, name: str, x: torch.Tensor) -> None:
    if not dense_last_dim(x):
        raise stride_error(op, name, x)


def as_int(op: str, name: str, value: object) -> int:
    """Any integer but bool (numpy's included), as a plain int."""
    if type(value) is not int and (
        isinstance(value, bool) or not isinstance(value, numbers.Integral)
    ):
        raise type_error(op, name, value, "int")
    return int(value)


def as_bool(op: str, name: str, value: object) -> bool:
    """True or False, numpy's bool included (its type is also named `bool`), as a plain bool."""
    kind = type(value)
    if kind is bool or (kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_")):
        return bool(value)
    qualified = (
        kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"
    )
    raise TypeError(f"{op}: {name} is {qualified}, expected bool (True or False)")


# Kernels take ints as 32-bit arguments; a larger one would overflow inside the launch.
INT32_MAX = 2**31 - 1


def check_int(op: str, name: str, value: object, *, minimum: int, maximum: int = INT32_MAX) -> int:
    value = as_int(op, name, value)
    if value < minimum:
        raise ValueError(f"{op}: {name} is {value}, expected an int >= {minimum}")
    if value > maximum:
        raise ValueError(f"{op}: {name} is {value}, expected an int <= {maximum}")
    return value


def check_device(op: str, name: str, device: object) -> torch.device:
    """A device kernels can run on, as a torch.device: not meta (no data), CUDA only where
    torch sees that GPU. Asked here so the caller gets this error, not the driver's."""
    try:
        device = torch.device(device)  # type: ignore[arg-type]
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{op}: {name} is {device!r}, expected a torch device ({exc})") from None
    if device.type == "meta":
        raise ValueError(f"{op}: {name} is meta, expected cpu or cuda (meta tensors hold no data)")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"{op}: {name} is {device}, but torch sees no CUDA/ROCm device here")
        if device.index is not None and device.index >= count:
            raise ValueError(f"{op}: {name} is {device}, expected cuda:0..cuda:{count - 1}")
    return device


def check_positive_float(op: str, name: str, value: object) -> float:
    """Any finite real > 0 but bool (numpy scalars included), returned as a plain float."""
    if type(value) is not float and (
        isinstance(value, bool) or not isinstance(value, numbers.Real)
    ):
        raise type_error(op, name, value, "a float")
    value = float(value)
    if not 0.0 < value < math.inf:
        raise ValueError(f"{op}: {name} is {value}, expected a finite float > 0")
    return value


def check_scale(op: str, name: str, value: object) -> float:
    """Per-tensor dequantization scale: None means 1.0."""
    return 1.0 if value is None else check_positive_float(op, name, value)
