"""The Triton release this package is tested with, and a `supports()` verdict for kernels that
need Gluon names another Triton may lack (Triton 3.8 has no `gluon.language.thread_barrier`), so
such a kernel declines with the reason instead of failing to compile at its first call."""

from __future__ import annotations

import functools

import triton

from tokenspeed_kernel.registry import Support

# The range the lock file pins and CI runs; pyproject.toml declares the same.
TESTED_TRITON = ">=3.6,<3.7"
_TESTED = ((3, 6), (3, 7))


def triton_version() -> tuple[int, int]:
    """(major, minor) of the installed Triton; local suffixes (`3.6.0+rocm`) are ignored."""
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


@functools.cache
def triton_support(*gluon_names: str) -> Support:
    """Yes on the tested Triton. On another release: no if any of `gluon_names` (names in
    `triton.experimental.gluon.language` the kernel calls) is missing, else yes with a note."""
    version = triton.__version__
    low, high = _TESTED
    if low <= triton_version() < high:
        return Support.yes()
    missing = []
    if gluon_names:
        from triton.experimental.gluon import language as gl  # noqa: PLC0415  (Gluon kernels)

        missing = [name for name in gluon_names if not hasattr(gl, name)]
    if missing:
        return Support.no(
            f"triton {version} lacks gluon.language.{', '.join(missing)} "
            f"(tested: triton{TESTED_TRITON})"
        )
    return Support.yes(f"triton {version} is untested (tested: triton{TESTED_TRITON})")
