"""Kernel selection: a pure, cached function of (op, platform, request, override).

Filter by platform, traits and the kernel's own `supports`, then order by (-priority, name).
Overrides (`TOKENSPEED_KERNEL_FORCE="op=kernel,..."` or `use_kernel(op, name)`) still have to
pass the same checks: a forced kernel never runs on a request it declared it cannot serve.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from . import env, registry
from .errors import Candidate, UnsupportedError
from .platform import Platform
from .registry import KernelSpec

FORCE_ENV = "TOKENSPEED_KERNEL_FORCE"

_cache: dict[tuple, KernelSpec] = {}
_cache_lock = threading.Lock()


def _clear_cache() -> None:
    with _cache_lock:
        _cache.clear()


registry.on_change(_clear_cache)

_scoped: contextvars.ContextVar[tuple[tuple[str, str], ...]] = contextvars.ContextVar(
    "tokenspeed_kernel_use_kernel", default=()
)
_parsed_env: tuple[str | None, dict[str, str]] = (None, {})


@dataclass(frozen=True)
class Explanation:
    op: str
    platform: Platform
    request: Any
    candidates: tuple[Candidate, ...]
    selected: str | None
    forced: str | None

    def __str__(self) -> str:
        head = f"{self.op} on {self.platform}"
        if self.forced:
            head += f" (forced: {self.forced})"
        lines = [head, f"  request: {self.request}"]
        lines += [f"  {'*' if c.name == self.selected else '-'} {c}" for c in self.candidates]
        lines.append(f"  selected: {self.selected or 'none'}")
        return "\n".join(lines)


def select(op: str, request: Any, platform: Platform) -> KernelSpec:
    """The kernel that serves `request` on `platform`; raises UnsupportedError if none."""
    forced = forced_kernel(op)
    key = (op, platform, request, forced)
    spec = _cache.get(key)  # one dict read: atomic, so the hit path needs no lock
    if spec is None:
        spec = _select_and_cache(key, op, request, platform, forced)
    return spec


def _select_and_cache(key, op, request, platform, forced) -> KernelSpec:
    # Another thread may change the registry while this one selects: a selection made from
    # an older registry is returned to this caller but never cached.
    registry.kernels(op)  # loads the plugins first, which changes the generation
    generation = registry.generation()
    spec = _select_uncached(op, request, platform, forced)
    with _cache_lock:
        if registry.generation() == generation:
            _cache[key] = spec
    return spec


def explain(op: str, request: Any, platform: Platform) -> Explanation:
    forced = forced_kernel(op)
    candidates = tuple(_verdicts(op, request, platform))
    if forced is not None:
        chosen = next((c for c in candidates if c.name == forced), None)
        selected = forced if chosen is not None and chosen.accepted else None
    else:
        selected = next((c.name for c in candidates if c.accepted), None)
    return Explanation(op, platform, request, candidates, selected, forced)


def _verdicts(op: str, request: Any, platform: Platform) -> Iterator[Candidate]:
    for spec in registry.kernels(op):
        verdict = spec.supports(request, platform)
        yield Candidate(spec.name, spec.priority, verdict.ok, verdict.reason)


def _select_uncached(op: str, request: Any, platform: Platform, forced: str | None) -> KernelSpec:
    if forced is not None:
        spec = registry.get_kernel(op, forced)
        verdict = spec.supports(request, platform)
        if not verdict.ok:
            raise UnsupportedError(
                op,
                f"forced kernel {forced} cannot serve this request on {platform}: {verdict.reason}",
                list(_verdicts(op, request, platform)),
            )
        return spec
    for spec in registry.kernels(op):
        if spec.supports(request, platform).ok:
            return spec
    raise UnsupportedError(
        op, f"no kernel supports {request} on {platform}", list(_verdicts(op, request, platform))
    )


def forced_kernel(op: str) -> str | None:
    """The kernel forced for `op`: the innermost `use_kernel`, else TOKENSPEED_KERNEL_FORCE."""
    for scoped_op, name in reversed(_scoped.get()):
        if scoped_op == op:
            return name
    raw = env.get(FORCE_ENV)
    if not raw:
        return None
    return _parse_force(raw).get(op)


def _parse_force(raw: str) -> dict[str, str]:
    global _parsed_env
    if _parsed_env[0] == raw:
        return _parsed_env[1]
    forced = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        op, sep, name = item.partition("=")
        op, name = op.strip(), name.strip()
        if not sep or not name:
            raise ValueError(f"{FORCE_ENV}: entry {item!r} is not of the form op=kernel")
        if op not in registry.op_names():
            raise ValueError(
                f"{FORCE_ENV}: op {op!r} in {item!r} is unknown, expected one of "
                f"{', '.join(registry.op_names())}"
            )
        forced[op] = name
    _parsed_env = (raw, forced)
    return forced


@contextlib.contextmanager
def use_kernel(op: str, name: str) -> Iterator[KernelSpec]:
    """Force kernel `name` for `op` inside the block (validated against each request)."""
    spec = registry.get_kernel(op, name)
    token = _scoped.set(_scoped.get() + ((op, name),))
    try:
        yield spec
    finally:
        _scoped.reset(token)
