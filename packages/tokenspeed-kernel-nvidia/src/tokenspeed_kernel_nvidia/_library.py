"""Optional libraries behind this package's kernels: found, version-checked and imported lazily.

Nothing here imports a library at registration: every kernel registers whether or not its
extra is installed, and its `supports()` asks `Library.verdict()`, which declines with a
reason naming the distribution and the extra to install, or the installed version and the
accepted range. The import itself happens once, at the first verdict or call; an import
that fails (a wheel built for another torch, a missing CUDA library) is a decline too.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import threading
from dataclasses import dataclass, field
from typing import Any

from tokenspeed_kernel.registry import Support

PACKAGE = "tokenspeed-kernel-nvidia"


def parse_version(text: str) -> tuple[int, ...]:
    """'0.6.14' -> (0, 6, 14, 0, 0); '3.0.0.post20260810' -> (3, 0, 0, 0, 20260810);
    '0.7.2rc1' -> (0, 7, 2, -1, 1). Release padded to three numbers, then (pre/post, n):
    enough to order the versions these libraries publish (PEP 440 release, rcN, postN)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)*)(?:(a|b|rc)(\d+))?(?:\.?post(\d+))?(?:\+.*)?", text)
    if match is None:
        raise ValueError(f"parse_version: {text!r} is not a version this package understands")
    release = tuple(int(p) for p in match.group(1).split("."))
    release = (release + (0, 0, 0))[: max(3, len(release))]
    if match.group(2):
        return (*release, -1, int(match.group(3)))
    return (*release, 0, int(match.group(4) or 0))


@dataclass
class Library:
    """One optional library: `distribution` on PyPI, imported as `module`, installed through
    `pip install tokenspeed-kernel-nvidia[extra]`, accepted in [minimum, below)."""

    distribution: str
    module: str
    extra: str
    minimum: str
    below: str
    _loaded: Any = field(default=None, init=False, repr=False)
    _failure: str | None = field(default=None, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @property
    def install_hint(self) -> str:
        return f"pip install {PACKAGE}[{self.extra}]"

    def installed_version(self) -> str | None:
        try:
            return importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            return None

    def version_verdict(self) -> Support:
        """Installed, and in the accepted range? (metadata only: nothing imported)."""
        version = self.installed_version()
        if version is None:
            return Support.no(f"{self.distribution} is not installed ({self.install_hint})")
        try:
            parsed = parse_version(version)
        except ValueError:
            return Support.no(f"{self.distribution} {version}: unrecognised version string")
        # `<below` excludes below's own pre-releases (PEP 440): compare the release numbers.
        below = parse_version(self.below)[:-2]
        if not (parse_version(self.minimum) <= parsed and parsed[:-2] < below):
            return Support.no(
                f"{self.distribution} {version} is installed, this package accepts "
                f">={self.minimum},<{self.below} ({self.install_hint})"
            )
        return Support.yes(f"{self.distribution} {version}")

    def verdict(self) -> Support:
        """The version verdict, then whether the module imports (once, cached)."""
        verdict = self.version_verdict()
        if not verdict.ok:
            return verdict
        self.load(quiet=True)
        if self._failure is not None:
            return Support.no(self._failure)
        return verdict

    def load(self, *, quiet: bool = False) -> Any:
        """The imported module; raises ImportError naming the extra if it cannot be imported
        (with `quiet`, records the failure for `verdict()` and returns None)."""
        if self._loaded is None and self._failure is None:
            with self._lock:
                if self._loaded is None and self._failure is None:
                    try:
                        self._loaded = importlib.import_module(self.module)
                    except Exception as exc:  # noqa: BLE001 - any import failure declines
                        self._failure = (
                            f"{self.distribution} is installed but `import {self.module}` "
                            f"failed: {type(exc).__name__}: {exc}"
                        )
        if self._loaded is None and not quiet:
            raise ImportError(self._failure or f"{self.module} is not importable")
        return self._loaded

    def reset(self) -> None:
        """Forget the import (tests that swap a fake module in and out)."""
        with self._lock:
            self._loaded = None
            self._failure = None


# The FA3 build with sinks (sm_90 only); releases are date-stamped post releases of 3.0.0.
# 3.0.0.post20260810 is the one whose interface this package's adapters were written against
# (op schema `flash_attn_3::fwd(..., Tensor? sinks)`).
FA3 = Library("tokenspeed-fa3", "flash_attn_interface", "fa3", "3.0.0.post20260408", "3.1")
# vLLM 0.26 pins 0.6.14; 0.7.x is the current line: both APIs were read and are mapped.
FLASHINFER = Library("flashinfer-python", "flashinfer", "flashinfer", "0.6.14", "0.8")
