"""NVIDIA kernels for tokenspeed-kernel: adapters over FlashAttention-3 and FlashInfer, and
kernels of our own written with the CuTe DSL."""
