"""Environment settings, read once: `os.environ` lookups cost about 1 µs each, too much for
ops called thousands of times a second. After changing a variable in-process, call `reload()`.
"""

from __future__ import annotations

import os

NAMES = ("TOKENSPEED_KERNEL_FORCE", "TOKENSPEED_KERNEL_CAPTURE")

_values: dict[str, str | None] | None = None


def get(name: str) -> str | None:
    global _values
    if _values is None:
        _values = {n: os.environ.get(n) for n in NAMES}
    return _values[name]


def reload() -> None:
    """Re-read the environment (tests, or a runtime that changes settings in-process)."""
    global _values
    _values = None
