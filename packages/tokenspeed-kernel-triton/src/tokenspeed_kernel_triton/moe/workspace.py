"""Scratch buffers that outlive one MoE call, so that a warm `moe_apply` allocates nothing.

Routing tables, GEMM1's activations and GEMM2's partial rows are rewritten by every call
before they are read, so one buffer per (slot, dtype, device, stream) serves every layer: the
calls of one stream run one after another, and another stream (a CUDA graph's capture stream,
an engine's second stream) gets buffers of its own. A buffer grows to the largest call seen and
stays (what the caching allocator would have kept anyway). A tensor returned here is valid until
the next MoE call on the same stream: nothing that outlives the call may hold one, except a
replay recipe (replay.py), which checks `generation` (bumped by every allocation here) before it
launches on the buffers it recorded.
"""

from __future__ import annotations

import math

import torch

_buffers: dict[tuple, torch.Tensor] = {}
# Buffers allocated so far (replaced ones included).
generation = 0


def _stream(device: torch.device) -> int:
    # The raw handle: a C call, where torch.cuda.current_stream builds a Python object.
    return torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0


def scratch(slot: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialized [shape] tensor of `dtype` for `slot` of the current call."""
    global generation
    if not isinstance(device, torch.device):  # callers pass x.device: no new object per call
        device = torch.device(device)
    numel = math.prod(shape)
    key = (slot, dtype, device, _stream(device))
    buffer = _buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = torch.empty(max(numel, 1), dtype=dtype, device=device)
        _buffers[key] = buffer
        generation += 1
    return buffer[:numel].view(shape)


def poison_scratch() -> None:
    """Fill every floating-point scratch buffer with NaN, so that a comparison of two calls'
    outputs (benchmarks/ab_moe_configs.py) also sees rows the second call never wrote rather
    than the first call's values left in the shared buffers."""
    for buffer in _buffers.values():
        if buffer.is_floating_point():
            buffer.fill_(float("nan"))
