"""`TOKENSPEED_KERNEL_CAPTURE=FILE`: every public-op call appends one JSON line with the op,
the selected kernel, and its arguments' shapes, dtypes and options, so that
`tokenspeed-kernel bench --replay FILE` can measure exactly a real workload's calls.

Index tensors that decide the work (sequence offsets and lengths) are recorded by value; this
reads them back from the device, which is fine for a profiling run and never happens otherwise.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import env

CAPTURE_ENV = "TOKENSPEED_KERNEL_CAPTURE"
# Small integer tensors whose values shape the work (lengths, offsets) are kept by value.
VALUE_ARGS = frozenset({"cu_seqlens", "cu_seqlens_q", "cache_seqlens", "topk_ids"})
_MAX_VALUES = 1 << 16
_lock = threading.Lock()


def active() -> bool:
    return bool(env.get(CAPTURE_ENV))


def describe(name: str, value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        entry: dict[str, Any] = {
            "shape": list(value.shape),
            "dtype": str(value.dtype).removeprefix("torch."),
        }
        if name in VALUE_ARGS and value.numel() <= _MAX_VALUES:
            entry["values"] = value.detach().cpu().tolist()
        return entry
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return repr(value)


def recording(op: str, kernel: str, fn: Callable, positional: Sequence[str]) -> Callable:
    """`fn`, recording each call's arguments first (`positional` names its positional ones)."""

    def call(*args, **kwargs):
        record(op, kernel, {**dict(zip(positional, args, strict=True)), **kwargs})
        return fn(*args, **kwargs)

    return call


def record(op: str, kernel: str, args: dict[str, Any]) -> None:
    """Append one call to the capture file."""
    path = env.get(CAPTURE_ENV)
    if not path:
        return
    line = json.dumps(
        {"op": op, "kernel": kernel, "args": {k: describe(k, v) for k, v in args.items()}}
    )
    with _lock, open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")
