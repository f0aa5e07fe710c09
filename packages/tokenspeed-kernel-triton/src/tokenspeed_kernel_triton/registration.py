"""Entry point `tokenspeed_kernel.plugins: triton`: registers every Triton kernel with core.

Each kernel module ends with its own `register()`; this module only lists them.
"""

from __future__ import annotations

from .attention import decode, extend, kvcache_store, prefill
from .moe import moe, moe_sm90

KERNEL_MODULES = (prefill, extend, decode, kvcache_store, moe, moe_sm90)


def register() -> None:
    for module in KERNEL_MODULES:
        module.register()
