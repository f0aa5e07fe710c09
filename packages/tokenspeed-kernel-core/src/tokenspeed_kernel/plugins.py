"""Plugin loading through the `tokenspeed_kernel.plugins` entry-point group.

Each entry point names a zero-argument `register()`. Plugins load lazily, once, on first use
of the registry; each load is isolated so that a broken plugin is recorded and the rest work.
`TOKENSPEED_KERNEL_PLUGINS`: unset = all, empty = none, else a comma-separated allow-list.
"""

from __future__ import annotations

import importlib
import logging
import os
import pkgutil
import traceback
from dataclasses import dataclass
from importlib.metadata import entry_points

from . import registry

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "tokenspeed_kernel.plugins"
ALLOW_LIST_ENV = "TOKENSPEED_KERNEL_PLUGINS"


@dataclass(frozen=True)
class PluginResult:
    name: str
    target: str
    status: str  # "loaded", "failed" or "skipped"
    error: str = ""
    kernels: tuple[str, ...] = ()
    detail: str = ""


_results: list[PluginResult] | None = None


def register_kernel_modules(package: str) -> None:
    """A backend's plugin entry point: import every module of `package` and call the
    `register()` each kernel module ends with. Adding a kernel is adding its module."""
    root = importlib.import_module(package)
    for info in sorted(pkgutil.walk_packages(root.__path__, package + "."), key=lambda i: i.name):
        if info.ispkg or info.name == f"{package}.registration":
            continue
        register = getattr(importlib.import_module(info.name), "register", None)
        if callable(register):
            register()


def load_plugins() -> list[PluginResult]:
    """Load every allowed plugin once; later calls return the recorded results."""
    global _results
    if _results is None:
        _results = []  # set first: a plugin's register() uses the registry re-entrantly
        _results.extend(_load_all())
    return list(_results)


def reload_plugins() -> list[PluginResult]:
    """Unregister what plugins registered and load them again (for tests and tools)."""
    global _results
    for result in _results or []:
        for name in result.kernels:
            try:
                registry.unregister_kernel(name)
            except ValueError:
                pass
    _results = None
    return load_plugins()


def _allowed() -> set[str] | None:
    raw = os.environ.get(ALLOW_LIST_ENV)
    if raw is None:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


def _load_all() -> list[PluginResult]:
    allowed = _allowed()
    results = []
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        if allowed is not None and ep.name not in allowed:
            results.append(
                PluginResult(ep.name, ep.value, "skipped", detail=f"not in {ALLOW_LIST_ENV}")
            )
            continue
        results.append(_load_one(ep))
    return results


def _load_one(ep) -> PluginResult:
    before = registry.registered_names()
    try:
        register = ep.load()
        register()
    except Exception as exc:  # isolation: one broken plugin must not break the others
        logger.warning("plugin %s (%s) failed to load: %s", ep.name, ep.value, exc)
        detail = traceback.format_exc(limit=3)
        after = registry.registered_names() - before
        for name in after:  # a half-registered plugin would serve untested kernels
            registry.unregister_kernel(name)
        return PluginResult(
            ep.name, ep.value, "failed", f"{type(exc).__name__}: {exc}", detail=detail
        )
    added = tuple(sorted(registry.registered_names() - before))
    logger.debug("plugin %s registered %d kernels", ep.name, len(added))
    return PluginResult(ep.name, ep.value, "loaded", kernels=added)


registry.set_plugin_loader(load_plugins)
