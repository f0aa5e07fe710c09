"""Entry point `tokenspeed_kernel.plugins: triton`: registers every Triton kernel with core.

The only module of this package that imports core; the kernel modules work without it.
"""

from __future__ import annotations


def register() -> None:
    from .attention.registration import register_attention_kernels
    from .moe.registration import register_moe_kernels

    register_attention_kernels()
    register_moe_kernels()
