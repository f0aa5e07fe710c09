"""Kernel registry: every kernel of every op, with its platforms, traits and priority.

Traits map a feature name to what the kernel handles: `True` for a boolean feature
(sinks, window, lse, ...), or a collection of accepted values (dtypes, head dims, page sizes;
`ANY` accepts every value). A request feature the kernel does not declare is not supported.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .platform import Platform, PlatformSpec
from .validation import dtype_name

logger = logging.getLogger(__name__)

# Ops in declaration order; op families add theirs with `declare_op` when core imports them.
_ops: dict[str, str] = {}
_kernels: dict[str, dict[str, KernelSpec]] = {}


def declare_op(name: str, *, summary: str) -> str:
    """Declare a registry op (kernels register under it); returns `name`."""
    if name in _ops:
        raise ValueError(f"declare_op: op {name!r} is already declared")
    _ops[name] = summary
    _kernels[name] = {}
    return name


def op_names() -> tuple[str, ...]:
    """Every declared op, in declaration order."""
    return tuple(_ops)


def check_op(where: str, op: object) -> str:
    if op not in _ops:
        raise ValueError(f"{where}: op is {op!r}, expected one of {', '.join(_ops)}")
    return op  # type: ignore[return-value]


class _AnyValue:
    def __contains__(self, value: object) -> bool:
        return True

    def __repr__(self) -> str:
        return "ANY"


ANY = _AnyValue()


@dataclass(frozen=True)
class Support:
    """A kernel's verdict on a request; a refusal always carries a reason."""

    ok: bool
    reason: str = ""

    def __post_init__(self) -> None:
        if not self.ok and not self.reason:
            raise ValueError("Support: a refusal needs a non-empty reason")

    def __bool__(self) -> bool:
        return self.ok

    @classmethod
    def yes(cls, reason: str = "") -> Support:
        return cls(True, reason)

    @classmethod
    def no(cls, reason: str) -> Support:
        return cls(False, reason)


@dataclass(frozen=True, eq=False)
class KernelSpec:
    """One registered kernel. `fn` is what the op calls (for "moe_apply": an object implementing
    `tokenspeed_kernel.ops.moe.MoEKernel`). `aot_cases` are the shapes the ahead-of-time compile
    check (`tokenspeed-kernel aot`) runs the kernel on: keyword dicts of the op's shape class in
    `tokenspeed_kernel.testing.inputs`, each optionally limited by `"targets": (...)`."""

    op: str
    name: str
    backend: str
    fn: Any
    platforms: tuple[PlatformSpec, ...]
    traits: Mapping[str, Any]
    priority: int
    dynamic_supports: Callable[[Any, Platform], Support] | None = None
    description: str = ""
    aot_cases: tuple[Mapping[str, Any], ...] = ()

    def supports(self, request: Any, platform: Platform) -> Support:
        """Platform, then declared traits, then the kernel's own dynamic check."""
        mismatches = [spec.mismatch(platform) for spec in self.platforms]
        if all(mismatches):
            if len(mismatches) == 1:
                return Support.no(mismatches[0])
            wanted = ", ".join(str(spec) for spec in self.platforms)
            return Support.no(f"needs one of {wanted}, this is {platform.label}")
        for feature, value in request.features():
            allowed = self.traits.get(feature)
            if allowed is True:
                continue
            if allowed is None or allowed is False:
                shown = "" if value is True else f"={describe_value(value)}"
                return Support.no(f"does not declare {feature}{shown}")
            if value not in allowed:
                shown, accepted = describe_value(value), describe_value(allowed)
                return Support.no(f"{feature} {shown} not in {accepted}")
        if self.dynamic_supports is not None:
            verdict = self.dynamic_supports(request, platform)
            if not verdict.ok:
                return verdict
        return Support.yes("supports this request")


def describe_value(value: object) -> str:
    """A trait value as people read it: dtype names, sorted sets."""
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    if isinstance(value, (set, frozenset, tuple, list)):
        return "{" + ", ".join(sorted(describe_value(v) for v in value)) + "}"
    return repr(value) if isinstance(value, str) else str(value)


_listeners: list[Callable[[], None]] = []


def _no_plugins() -> None:
    pass


_ensure_plugins: Callable[[], None] = _no_plugins


def register_kernel(
    op: str,
    *,
    name: str,
    backend: str,
    platforms: Iterable[str | PlatformSpec],
    traits: Mapping[str, Any],
    priority: int,
    supports: Callable[[Any, Platform], Support] | None = None,
    description: str = "",
    aot_cases: Iterable[Mapping[str, Any]] = (),
    replace: bool = False,
) -> Callable[[Any], Any]:
    """Decorator recording `fn` as kernel `name` for `op`; returns `fn` unchanged."""
    check_op("register_kernel", op)
    if not name.startswith(f"{backend}."):
        raise ValueError(
            f"register_kernel: name is {name!r}, expected '<backend>.<op>[.<variant>]' "
            f"starting with {backend + '.'!r}"
        )
    specs = tuple(p if isinstance(p, PlatformSpec) else PlatformSpec.parse(p) for p in platforms)
    if not specs:
        raise ValueError(f"register_kernel: {name} declares no platforms")
    frozen_traits = types.MappingProxyType(
        {k: v if v is True or v is ANY else frozenset(v) for k, v in traits.items()}
    )

    def decorate(fn: Any) -> Any:
        existing = _find(name)
        if existing is not None and not replace:
            raise ValueError(
                f"register_kernel: {name} is already registered for {existing.op}; "
                "pass replace=True to replace it"
            )
        if existing is not None:
            del _kernels[existing.op][name]
        spec = KernelSpec(
            op,
            name,
            backend,
            fn,
            specs,
            frozen_traits,
            priority,
            supports,
            description,
            tuple(types.MappingProxyType(dict(case)) for case in aot_cases),
        )
        _kernels[op][name] = spec
        logger.debug("registered %s for %s (priority %d)", name, op, priority)
        _changed()
        return fn

    return decorate


def unregister_kernel(name: str) -> None:
    spec = _find(name)
    if spec is None:
        raise ValueError(f"unregister_kernel: no kernel named {name!r}")
    del _kernels[spec.op][name]
    _changed()


def kernels(op: str) -> list[KernelSpec]:
    """Registered kernels of `op` (plugins loaded first), best first: (-priority, name)."""
    check_op("kernels", op)
    _ensure_plugins()
    return sorted(_kernels[op].values(), key=lambda s: (-s.priority, s.name))


def get_kernel(op: str, name: str) -> KernelSpec:
    for spec in kernels(op):
        if spec.name == name:
            return spec
    known = ", ".join(s.name for s in kernels(op)) or "none"
    raise ValueError(f"{op}: no kernel named {name!r}; registered: {known}")


def _find(name: str) -> KernelSpec | None:
    for specs in _kernels.values():
        if name in specs:
            return specs[name]
    return None


def _changed() -> None:
    for listener in _listeners:
        listener()


def on_change(listener: Callable[[], None]) -> None:
    """Call `listener` whenever the registry changes (the selector drops its cache)."""
    _listeners.append(listener)


def set_plugin_loader(loader: Callable[[], None]) -> None:
    global _ensure_plugins
    _ensure_plugins = loader


def registered_names() -> set[str]:
    """Names of every registered kernel, without loading plugins."""
    return {name for specs in _kernels.values() for name in specs}
