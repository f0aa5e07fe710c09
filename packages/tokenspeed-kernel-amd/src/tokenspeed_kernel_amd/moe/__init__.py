"""MoE kernels (Gluon) for CDNA3/CDNA4; importable without tokenspeed_kernel."""
