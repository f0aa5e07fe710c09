"""Entry point `tokenspeed_kernel.plugins: nvidia`: every module of this package that ends with a
`register()` is a kernel module, and registers itself."""

from __future__ import annotations

from tokenspeed_kernel.plugins import register_kernel_modules


def register() -> None:
    register_kernel_modules(__package__)
