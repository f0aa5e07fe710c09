"""Where the packages are on PYTHONPATH but not installed (the GPU machine), their entry point
is missing: register the Triton kernels directly so the conformance parameters see them."""

from importlib.metadata import entry_points

if not entry_points(group="tokenspeed_kernel.plugins", name="triton"):
    from tokenspeed_kernel_triton.registration import register

    register()
