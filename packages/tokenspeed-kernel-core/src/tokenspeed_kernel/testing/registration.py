"""Register a kernel for the duration of a test, and always unregister it afterwards."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ..registry import KernelSpec, Support, get_kernel, register_kernel, unregister_kernel


@contextlib.contextmanager
def temporary_kernel(
    op: str,
    name: str,
    fn: Any,
    *,
    traits: Mapping[str, Any] | None = None,
    platforms: tuple[str, ...] = ("*",),
    priority: int = -100,
    supports: Callable[[Any, Any], Support] | None = None,
) -> Iterator[KernelSpec]:
    """Register `fn` as kernel `name` ("<backend>.<op>[...]") of `op`, yield its spec, then
    unregister it. traits default to the reference kernel's (everything the contract allows);
    the low default priority keeps it from being selected over real kernels elsewhere."""
    if traits is None:
        traits = get_kernel(op, f"reference.{op}").traits
    backend = name.split(".", 1)[0]
    register_kernel(
        op,
        name=name,
        backend=backend,
        platforms=platforms,
        traits=traits,
        priority=priority,
        supports=supports,
    )(fn)
    try:
        yield get_kernel(op, name)
    finally:
        unregister_kernel(name)
