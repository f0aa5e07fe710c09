"""Kernel registry: every kernel of every op, with its platforms, traits and priority.

Traits map a feature name to what the kernel handles: `True` for a boolean feature
(sinks, window, lse, ...), or a collection of accepted values (dtypes, head dims, page sizes;
`ANY` accepts every value). A request feature the kernel does not declare is not supported.
Each op declares its feature names, so a misspelt trait fails at registration.

Registration and selection may run on several threads (a server's first requests): a lock
guards every change, and `generation()` lets caches know whether the registry changed.
"""

from __future__ import annotations

import logging
import numbers
import threading
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
_op_traits: dict[str, frozenset[str]] = {}
_kernels: dict[str, dict[str, KernelSpec]] = {}
# Re-entrant: a plugin's register() reads the registry while it registers.
_lock = threading.RLock()
_generation = 0


def declare_op(name: str, *, summary: str, traits: Iterable[str]) -> str:
    """Declare a registry op (kernels register under it) with the feature names its requests
    carry (the names kernels may declare as traits); returns `name`."""
    if name in _ops:
        raise ValueError(f"declare_op: op {name!r} is already declared")
    _op_traits[name] = frozenset(traits)
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
            verdict = self._dynamic_verdict(request, platform)
            if not verdict.ok:
                return verdict
        return Support.yes("supports this request")

    def _dynamic_verdict(self, request: Any, platform: Platform) -> Support:
        """The kernel's own check, isolated: one that raises or answers something other than
        a Support declines this request (with that as the reason) instead of breaking the op."""
        try:
            verdict = self.dynamic_supports(request, platform)  # type: ignore[misc]
        except Exception as exc:
            logger.warning("%s: supports() raised on %s", self.name, request, exc_info=True)
            return Support.no(f"supports() raised {type(exc).__name__}: {exc}")
        if not isinstance(verdict, Support):
            return Support.no(
                f"supports() returned {type(verdict).__name__} {verdict!r}, expected a Support"
            )
        return verdict


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
    """Decorator recording `fn` as kernel `name` for `op`; returns `fn` unchanged. Every
    argument is checked here, so a bad registration fails where it is written."""
    check_op("register_kernel", op)
    where = f"register_kernel({name!r})"
    _check_names(where, name, backend)
    specs = _platform_specs(where, platforms)
    frozen_traits = _frozen_traits(where, op, traits)
    if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
        raise TypeError(f"{where}: priority is {priority!r}, expected an int")
    if supports is not None and not callable(supports):
        raise TypeError(f"{where}: supports is {type(supports).__name__}, expected a callable")
    if not isinstance(description, str):
        raise TypeError(f"{where}: description is {type(description).__name__}, expected a str")
    cases = tuple(aot_cases)
    if not all(isinstance(case, Mapping) for case in cases):
        raise TypeError(f"{where}: aot_cases holds a non-mapping, expected keyword dicts")

    def decorate(fn: Any) -> Any:
        spec = KernelSpec(
            op, name, backend, fn, specs, frozen_traits, int(priority), supports, description,
            tuple(types.MappingProxyType(dict(case)) for case in cases),
        )  # fmt: skip
        with _lock:
            existing = _find(name)
            if existing is not None and not replace:
                raise ValueError(
                    f"register_kernel: {name} is already registered for {existing.op}; "
                    "pass replace=True to replace it"
                )
            restore(name, spec)
        logger.debug("registered %s for %s (priority %d)", name, op, spec.priority)
        return fn

    return decorate


def _check_names(where: str, name: object, backend: object) -> None:
    if not isinstance(backend, str) or not backend:
        raise TypeError(f"{where}: backend is {backend!r}, expected a non-empty str")
    if not isinstance(name, str) or not name.startswith(f"{backend}."):
        raise ValueError(
            f"register_kernel: name is {name!r}, expected '<backend>.<op>[.<variant>]' "
            f"starting with {backend + '.'!r}"
        )


def _platform_specs(where: str, platforms: object) -> tuple[PlatformSpec, ...]:
    if isinstance(platforms, str) or not isinstance(platforms, Iterable):
        raise TypeError(f"{where}: platforms is {platforms!r}, expected a list of platform specs")
    specs = tuple(p if isinstance(p, PlatformSpec) else PlatformSpec.parse(p) for p in platforms)
    if not specs:
        raise ValueError(f"{where}: declares no platforms")
    return specs


def _frozen_traits(where: str, op: str, traits: object) -> Mapping[str, Any]:
    """Each trait a feature name of `op`, its value True, ANY or a collection of values."""
    if not isinstance(traits, Mapping):
        raise TypeError(f"{where}: traits is {type(traits).__name__}, expected a mapping")
    known = _op_traits[op]
    frozen = {}
    for feature, value in traits.items():
        if feature not in known:
            raise ValueError(
                f"{where}: trait {feature!r} is not a feature of {op}, expected one of "
                f"{', '.join(sorted(known))}"
            )
        if value is True or value is ANY:
            frozen[feature] = value
        elif isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
            raise TypeError(
                f"{where}: trait {feature!r} is {value!r}, expected True, ANY or a collection "
                "of accepted values (a str is one value: wrap it, e.g. {'bf16'})"
            )
        else:
            frozen[feature] = frozenset(value)
    return types.MappingProxyType(frozen)


def restore(name: str, spec: KernelSpec | None) -> None:
    """Make `spec` the kernel registered as `name` (None: none), whatever is there now: how a
    failed or unloaded plugin puts back what it replaced."""
    global _generation
    with _lock:
        existing = _find(name)
        if existing is not None:
            del _kernels[existing.op][name]
        if spec is not None:
            _kernels[spec.op][name] = spec
        _generation += 1
        _changed()


def snapshot() -> dict[str, KernelSpec]:
    """Every registered kernel by name, without loading plugins."""
    with _lock:
        return {name: spec for specs in _kernels.values() for name, spec in specs.items()}


def generation() -> int:
    """A number that changes with every registration change (for caches of selections)."""
    return _generation


def unregister_kernel(name: str) -> None:
    with _lock:
        if _find(name) is None:
            raise ValueError(f"unregister_kernel: no kernel named {name!r}")
        restore(name, None)


def kernels(op: str) -> list[KernelSpec]:
    """Registered kernels of `op` (plugins loaded first), best first: (-priority, name)."""
    check_op("kernels", op)
    _ensure_plugins()  # outside the lock: loading takes it, from the loading thread
    with _lock:
        specs = list(_kernels[op].values())
    return sorted(specs, key=lambda s: (-s.priority, s.name))


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


def add_rankings(source: Any, *, origin: str | None = None) -> Any:
    """Add a measured rankings file (a path, or its parsed JSON as a mapping) that the selector
    consults before priorities: how a vendor package ships what `tokenspeed-kernel tune`
    measured (call it from the plugin's `register()`). Validated here: malformed JSON, a
    wrong format or an unknown op raise `ValueError` naming the file; kernels it names that
    are not registered are ignored with a warning when it is used. Files in
    TOKENSPEED_KERNEL_RANKINGS take precedence. Returns the loaded `rankings.Source`."""
    from . import rankings  # noqa: PLC0415  (rankings validates against this module)

    loaded = rankings.add(source, origin=origin)
    rankings_changed()
    return loaded


def rankings_changed() -> None:
    """Selections made from other rankings are stale: drop them (`rankings.reload()`)."""
    global _generation
    with _lock:
        _generation += 1
        _changed()


def on_change(listener: Callable[[], None]) -> None:
    """Call `listener` whenever the registry changes (the selector drops its cache)."""
    _listeners.append(listener)


def set_plugin_loader(loader: Callable[[], None]) -> None:
    global _ensure_plugins
    _ensure_plugins = loader


def registered_names() -> set[str]:
    """Names of every registered kernel, without loading plugins."""
    return set(snapshot())
