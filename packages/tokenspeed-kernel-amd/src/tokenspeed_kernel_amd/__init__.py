"""Gluon attention and MoE kernels for AMD CDNA3/CDNA4 (gfx942, gfx950).

The kernel modules (`tokenspeed_kernel_amd.attention.prefill`, `.extend`, `.decode`, `moe.*`)
depend on torch and triton only, so an engine can call them directly; `registration` (the
`tokenspeed_kernel.plugins` entry point) is the only module that imports tokenspeed_kernel.
"""

__version__ = "0.1.0"
