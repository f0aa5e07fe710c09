"""Whether tokenspeed-kernel serves a request here, in the terms vLLM asks it.

The pure-torch reference kernels serve every request on every device: inside a serving engine
they are a numerics oracle, not a serving path (a GPT-OSS decode step through them takes
seconds). So a request counts as served only when a non-reference kernel accepts it, unless
TOKENSPEED_KERNEL_VLLM_REFERENCE=1 (numerics checks, CPU tests) lets the reference count too.
"""

from __future__ import annotations

import os

import torch

import tokenspeed_kernel as tk
from tokenspeed_kernel.platform import default_device

REFERENCE_ENV = "TOKENSPEED_KERNEL_VLLM_REFERENCE"
REFERENCE_BACKEND = "reference"


def reference_allowed() -> bool:
    """TOKENSPEED_KERNEL_VLLM_REFERENCE: "1" lets the reference kernels serve; unset, empty
    or "0" does not (read on each call: it decides at model construction, not per step)."""
    value = os.environ.get(REFERENCE_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{REFERENCE_ENV} is {value!r}, expected 1, 0 or unset")
    return value == "1"


def current_platform(device: torch.device | None = None) -> tk.Platform:
    """The platform of `device`, by default the device this process runs on (vLLM sets the
    current CUDA device per worker before it builds the model)."""
    return tk.platform_of(default_device() if device is None else torch.device(device))


def is_reference(op: str, kernel_name: str) -> bool:
    return tk.get_kernel(op, kernel_name).backend == REFERENCE_BACKEND


def decline_reason(op: str, request, platform: tk.Platform) -> str | None:
    """None if a kernel that counts serves `request` on `platform`, else why not, with every
    candidate's verdict."""
    explanation = tk.explain(op, request, platform)
    declined = "; ".join(f"{c.name}: {c.reason}" for c in explanation.candidates if not c.accepted)
    if explanation.selected is None:
        return (
            f"{op}: no tokenspeed-kernel kernel serves {request} on {platform.arch} "
            f"({declined or 'no kernels registered'})"
        )
    if is_reference(op, explanation.selected) and not reference_allowed():
        return (
            f"{op}: only the pure-torch reference kernel serves {request} on "
            f"{platform.arch} ({declined or 'no other kernel registered'}); "
            f"{REFERENCE_ENV}=1 runs it anyway (numerics checks, not serving)"
        )
    return None
