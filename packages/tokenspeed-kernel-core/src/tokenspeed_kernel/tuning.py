"""Config choice shared by every backend: threshold tables and scoped pins.

A kernel picks its launch config (tiles, splits, warps) from a threshold table: rows of
`(upper bound or None, config)`, each row with a one-line hardware reason beside it, the last
row a catch-all. Tests and benchmarks pin a config for one kernel with `pin_config`, keyed by
the kernel's registered name (`"triton.mha_decode_with_kvcache"`; a kernel with several
configs suffixes the part, `"triton.moe_apply.sm90/gemm1"`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

_pins: dict[str, Any] = {}


def first_match(table: Sequence[tuple[int | float | None, T]], value: int | float) -> T:
    """The config of the first row whose bound covers `value` (`value <= bound`; None: any)."""
    for bound, config in table:
        if bound is None or value <= bound:
            return config
    raise ValueError(f"first_match: no row covers {value}; end the table with a (None, ...) row")


def pinned_config(key: str) -> Any | None:
    """The config pinned for `key`, or None (the kernel uses its heuristic)."""
    return _pins.get(key) if _pins else None


@contextlib.contextmanager
def pin_config(key: str, config: T) -> Iterator[T]:
    """Inside the block, the kernel (or kernel part) `key` launches with `config`."""
    missing = object()
    previous = _pins.get(key, missing)
    _pins[key] = config
    try:
        yield config
    finally:
        if previous is missing:
            del _pins[key]
        else:
            _pins[key] = previous
