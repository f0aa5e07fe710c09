"""Test helpers for the AMD attention kernels: the NVIDIA instantiation of each kernel,
registered for the duration of a test with the real kernel's traits (the real registrations
stay gfx942/gfx950 only)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

from tokenspeed_kernel.registry import KernelSpec, get_kernel
from tokenspeed_kernel.testing import temporary_kernel


@contextlib.contextmanager
def nvidia_instantiation(op: str, **launcher_kwargs) -> Iterator[KernelSpec]:
    """The kernel's shared body built with NVIDIA layouts (mma_v2, plain/cp.async loads), as a
    temporary kernel for `assert_conformance` on an NVIDIA GPU."""
    kernel = get_kernel(op, f"amd.{op}")
    fn = functools.partial(kernel.fn, arch="nvidia", **launcher_kwargs)
    suffix = "".join(f".{k}{v}" for k, v in sorted(launcher_kwargs.items()))
    name = kernel.name.replace("amd.", "amdtest.", 1) + ".nvidia" + suffix
    with temporary_kernel(op, name, fn, traits=kernel.traits, platforms=("nvidia:sm_80+",)) as spec:
        yield spec
