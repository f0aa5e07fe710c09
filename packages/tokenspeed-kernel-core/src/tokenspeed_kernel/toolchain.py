"""The Triton release the kernel packages are tested with, and a `supports()` verdict for
kernels that need Gluon names another Triton may lack (Triton 3.8 has no
`gluon.language.thread_barrier`): such a kernel declines with the reason instead of failing
to compile at its first call. Triton is imported only when a verdict is asked for."""

from __future__ import annotations

import functools
import importlib

from .registry import Support

# The range the lock file pins and CI runs; the vendor packages' pyproject.toml declare it.
TESTED_TRITON = ">=3.6,<3.7"
_TESTED = ((3, 6), (3, 7))


def triton_version(version: str) -> tuple[int, int]:
    """(major, minor) of a Triton version string; local suffixes (`3.6.0+rocm`) are ignored."""
    major, minor = version.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


@functools.cache
def triton_support(*gluon_names: str) -> Support:
    """Yes on the tested Triton. On another release: no if any of `gluon_names` (names in
    `triton.experimental.gluon.language` the kernel calls) is missing, else yes with a note."""
    version = importlib.import_module("triton").__version__
    low, high = _TESTED
    if low <= triton_version(version) < high:
        return Support.yes()
    missing = []
    if gluon_names:
        gl = importlib.import_module("triton.experimental.gluon.language")
        missing = [name for name in gluon_names if not hasattr(gl, name)]
    if missing:
        return Support.no(
            f"triton {version} lacks gluon.language.{', '.join(missing)} "
            f"(tested: triton{TESTED_TRITON})"
        )
    return Support.yes(f"triton {version} is untested (tested: triton{TESTED_TRITON})")
