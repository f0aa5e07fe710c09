"""Plugin loading through the `tokenspeed_kernel.plugins` entry-point group.

Each entry point names a zero-argument `register()`. Plugins load lazily, once, on first use
of the registry, by one thread while the others wait; each load is isolated so that a broken
plugin (any exception, `sys.exit` included) is recorded, its registrations rolled back (what it
replaced restored), and the rest work. `TOKENSPEED_KERNEL_PLUGINS`: unset = all, empty = none,
else a comma-separated allow-list; a name in it that no installed plugin has is warned about.
"""

from __future__ import annotations

import importlib
import logging
import os
import pkgutil
import threading
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


_results: tuple[PluginResult, ...] | None = None
# What each loaded plugin's kernels replaced (None: nothing), to put back when it unloads.
_replaced: dict[str, dict[str, registry.KernelSpec | None]] = {}
# Held while loading: other threads wait for the finished results instead of selecting from a
# half-loaded registry. Re-entrant, because a plugin's register() reads the registry.
_lock = threading.RLock()
_loading = False


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
    """Load every allowed plugin once (whichever thread comes first; the others wait), and
    return the recorded results. Results are published only once every plugin has loaded."""
    global _results, _loading
    if _results is None:
        with _lock:
            if _results is None and not _loading:
                _loading = True
                try:
                    _results = tuple(_load_all())
                finally:
                    _loading = False
    # None here only for the loading thread itself (a plugin's register() using the registry).
    return list(_results or ())


def unload_plugins() -> None:
    """Put the registry back as it was before plugins loaded: each plugin's kernels removed,
    what they replaced restored (the last loaded first). The next use loads them again."""
    global _results
    with _lock:
        for result in reversed(_results or ()):
            for name, previous in _replaced.pop(result.name, {}).items():
                registry.restore(name, previous)
        _results = None


def reload_plugins() -> list[PluginResult]:
    """Unload and load again (for tests and tools, after changing TOKENSPEED_KERNEL_PLUGINS)."""
    with _lock:
        unload_plugins()
        return load_plugins()


def _allowed() -> set[str] | None:
    raw = os.environ.get(ALLOW_LIST_ENV)
    if raw is None:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


def _load_all() -> list[PluginResult]:
    allowed = _allowed()
    installed = sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)
    results = []
    for ep in installed:
        if allowed is not None and ep.name not in allowed:
            results.append(
                PluginResult(ep.name, ep.value, "skipped", detail=f"not in {ALLOW_LIST_ENV}")
            )
            continue
        results.append(_load_one(ep))
    names = {ep.name for ep in installed}
    for unknown in sorted((allowed or set()) - names):
        detail = (
            f"{ALLOW_LIST_ENV} names {unknown!r}, but no installed plugin has that name "
            f"(installed: {', '.join(sorted(names)) or 'none'})"
        )
        logger.warning("%s", detail)
        results.append(PluginResult(unknown, "", "skipped", detail=detail))
    return results


def _load_one(ep) -> PluginResult:
    before = registry.snapshot()
    try:
        register = ep.load()
        register()
    except KeyboardInterrupt:
        _roll_back(before)
        raise
    # Isolation: one broken plugin, even one calling sys.exit, must not break the others.
    except BaseException as exc:
        logger.warning("plugin %s (%s) failed to load: %s", ep.name, ep.value, exc)
        detail = traceback.format_exc(limit=3)
        _roll_back(before)  # a half-registered plugin would serve untested kernels
        return PluginResult(
            ep.name, ep.value, "failed", f"{type(exc).__name__}: {exc}", detail=detail
        )
    changed = _changed_since(before)
    _replaced[ep.name] = {name: before.get(name) for name in changed}
    logger.debug("plugin %s registered %d kernels", ep.name, len(changed))
    return PluginResult(ep.name, ep.value, "loaded", kernels=tuple(sorted(changed)))


def _changed_since(before: dict[str, registry.KernelSpec]) -> list[str]:
    """Names registered, replaced or removed since `before`."""
    now = registry.snapshot()
    return [name for name in before.keys() | now.keys() if before.get(name) is not now.get(name)]


def _roll_back(before: dict[str, registry.KernelSpec]) -> None:
    for name in _changed_since(before):
        registry.restore(name, before.get(name))


registry.set_plugin_loader(load_plugins)
