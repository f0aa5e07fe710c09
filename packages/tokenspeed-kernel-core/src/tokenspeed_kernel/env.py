"""Environment settings, read once: `os.environ` lookups cost about 1 µs each, too much for
ops called thousands of times a second. After changing a variable in-process, call `reload()`.
"""

from __future__ import annotations

import os

CHECKED_ENV = "TOKENSPEED_KERNEL_CHECKED"
NAMES = ("TOKENSPEED_KERNEL_FORCE", "TOKENSPEED_KERNEL_CAPTURE", CHECKED_ENV)

_values: dict[str, str | None] | None = None

# TOKENSPEED_KERNEL_CHECKED=1: ops read their index tensors on the host and raise on values
# the kernels would skip or clamp. A module attribute, not a function: every op call tests it,
# and an attribute read is the cheapest test Python has (a call costs ~40 ns more).
checked: bool = os.environ.get(CHECKED_ENV) == "1"


def get(name: str) -> str | None:
    global _values
    if _values is None:
        _values = {n: os.environ.get(n) for n in NAMES}
    return _values[name]


def reload() -> None:
    """Re-read the environment (tests, or a runtime that changes settings in-process)."""
    global _values, checked
    _values = None
    checked = get(CHECKED_ENV) == "1"
