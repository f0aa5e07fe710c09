"""Entry point of the `tokenspeed_kernel.plugins` group: registers the AMD Gluon kernels."""

from __future__ import annotations

from .attention import decode, extend, prefill
from .moe import mxfp4_moe

KERNEL_MODULES = (prefill, extend, decode, mxfp4_moe)


def register() -> None:
    for module in KERNEL_MODULES:
        module.register()
