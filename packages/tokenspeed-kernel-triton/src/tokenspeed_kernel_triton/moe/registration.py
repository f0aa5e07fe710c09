"""Registers the Triton MoE kernel with core (imports core; the kernels do not)."""

from __future__ import annotations


def register_moe_kernels() -> None:
    """Owned by the MoE kernels."""
