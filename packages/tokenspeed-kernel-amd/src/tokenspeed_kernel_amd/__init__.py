"""Gluon attention and MoE kernels for AMD CDNA3/CDNA4 (gfx942, gfx950), registered with
tokenspeed-kernel-core through the `tokenspeed_kernel.plugins` entry point (`registration`)."""

__version__ = "0.1.0"
