"""Kernel selection: a pure, cached function of (op, platform, request, override).

Filter by platform, traits and the kernel's own `supports`; among the kernels left, the
measured fastest where a ranking covers the request (`rankings.py`), else order by
(-priority, name). Overrides (`TOKENSPEED_KERNEL_FORCE="op=kernel,..."` or
`use_kernel(op, name)`) still have to pass the same checks: a forced kernel never runs on a
request it declared it cannot serve.

The cached path (every op call) is one dict read per op keyed by the request, plus an
identity test of the platform (plus the ContextVar read once `use_kernel` has been used);
rankings are resolved when the cache misses.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from . import env, rankings, registry
from .errors import Candidate, UnsupportedError
from .platform import Platform
from .registry import KernelSpec

FORCE_ENV = "TOKENSPEED_KERNEL_FORCE"

# Every selection: (op, platform, request, forced) -> kernel.
_cache: dict[tuple, KernelSpec] = {}
# The hot path: op -> request -> (platform, kernel) of the last platform that selected it
# without an override. Keyed without the platform because Platform hashes in Python (~0.1 µs);
# the identity test is exact, and another platform falls back to `_cache`.
_last: dict[str, dict[Any, tuple[Platform, KernelSpec]]] = {}
_cache_lock = threading.Lock()
# Whether `use_kernel` ever ran in this process: until it does, no context (thread, task, or
# a context copied inside a block, which keeps the override after the block ends) can hold
# an override, and select skips the ContextVar read.
_scopes_used = False


def _clear_cache() -> None:
    with _cache_lock:
        _cache.clear()
        _last.clear()


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
    # The ranking that decided the choice; None where priorities did (or an override).
    measured: rankings.Measured | None = None

    def __str__(self) -> str:
        head = f"{self.op} on {self.platform}"
        if self.forced:
            head += f" (forced: {self.forced})"
        lines = [head, f"  request: {self.request}"]
        lines += [f"  {'*' if c.name == self.selected else '-'} {c}" for c in self.candidates]
        lines.append(f"  selected: {self.selected or 'none'}")
        if self.measured is not None:
            lines.append(f"  why: {self.measured}")
        elif self.selected and not self.forced:
            lines.append("  why: highest priority (no measured ranking covers this request)")
        return "\n".join(lines)


def select(op: str, request: Any, platform: Platform) -> KernelSpec:
    """The kernel that serves `request` on `platform`; raises UnsupportedError if none."""
    if _scopes_used or env.get(FORCE_ENV):
        forced = forced_kernel(op)
        if forced is not None:
            return _select_keyed(op, request, platform, forced)
    per_op = _last.get(op)  # dict reads are atomic: the hit path needs no lock
    if per_op is not None:
        hit = per_op.get(request)
        if hit is not None and hit[0] is platform:
            return hit[1]
    return _select_keyed(op, request, platform, None)


def _select_keyed(op, request, platform, forced) -> KernelSpec:
    key = (op, platform, request, forced)
    spec = _cache.get(key)
    if spec is None:
        spec = _select_and_cache(key, op, request, platform, forced)
    elif forced is None:
        with _cache_lock:
            if _cache.get(key) is spec:  # not dropped by a registry change meanwhile
                _last.setdefault(op, {})[request] = (platform, spec)
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
            if forced is None:
                _last.setdefault(op, {})[request] = (platform, spec)
    return spec


def explain(op: str, request: Any, platform: Platform) -> Explanation:
    forced = forced_kernel(op)
    candidates = tuple(_verdicts(op, request, platform))
    measured = None
    if forced is not None:
        chosen = next((c for c in candidates if c.name == forced), None)
        selected = forced if chosen is not None and chosen.accepted else None
    else:
        specs = {s.name: s for s in registry.kernels(op)}
        accepted = [specs[c.name] for c in candidates if c.accepted and c.name in specs]
        spec, measured = _choose(op, request, platform, accepted)
        selected = None if spec is None else spec.name
    return Explanation(op, platform, request, candidates, selected, forced, measured)


def _choose(op, request, platform, accepted: list[KernelSpec]):
    """(kernel, ranking that chose it or None) among `accepted` (in priority order)."""
    if not accepted:
        return None, None
    measured = rankings.lookup(op, request, platform, (s.name for s in accepted))
    if measured is None:
        return accepted[0], None
    best = measured.order[0][0]
    return next(s for s in accepted if s.name == best), measured


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
    specs = registry.kernels(op)
    if rankings.sources():
        accepted = [spec for spec in specs if spec.supports(request, platform).ok]
        spec, _ = _choose(op, request, platform, accepted)
        if spec is not None:
            return spec
    else:  # priorities alone: the first kernel that accepts, without asking the rest
        for spec in specs:
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
    global _scopes_used
    spec = registry.get_kernel(op, name)
    _scopes_used = True
    token = _scoped.set(_scoped.get() + ((op, name),))
    try:
        yield spec
    finally:
        _scoped.reset(token)
