"""Entry point `tokenspeed_kernel.plugins: nvidia`: every module of this package that ends with a
`register()` is a kernel module, and registers itself; then the rankings measured on each GPU
(`rankings/<gpu>.json`, written by `tokenspeed-kernel tune`) are added, so that on that GPU the
fastest kernel measured for a request's bucket is selected, ours or a library's."""

from __future__ import annotations

from pathlib import Path

from tokenspeed_kernel import registry
from tokenspeed_kernel.plugins import register_kernel_modules

RANKINGS = Path(__file__).parent / "rankings"


def register() -> None:
    register_kernel_modules(__package__)
    for path in sorted(RANKINGS.glob("*.json")):
        registry.add_rankings(path, origin=f"tokenspeed-kernel-nvidia rankings/{path.name}")
