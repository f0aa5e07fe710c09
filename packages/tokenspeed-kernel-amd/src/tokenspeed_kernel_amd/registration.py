"""Entry point of the `tokenspeed_kernel.plugins` group: registers the AMD Gluon kernels.

The only module of this package that imports tokenspeed_kernel (through the registration
functions it calls).
"""

from __future__ import annotations


def register() -> None:
    from .attention.registration import register_attention_kernels
    from .moe.registration import register_moe_kernels

    register_attention_kernels()
    register_moe_kernels()
