"""Pieces shared by the Triton MoE kernels (portable and Hopper): weight-format codes, the exact
bf16 rounding the Triton interpreter gets wrong, the padding rule, the SwiGLU fp16 bound and the
routing call both forwards make.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from tokenspeed_kernel.platform import Platform

from .routing import route

# H and I are padded to a multiple of this (GPT-OSS 2880 -> 2944, +2.2% bytes and FLOPs) so that
# every K step and N block of both GEMMs is full: BLOCK_K and BLOCK_N (<= 128; GEMM1's N is 2I,
# so up to 256 there) divide it and the inner loop needs no K/N masks. 64 would leave 2880
# unpadded but forces BLOCK_K = 64 and GEMM2's BLOCK_N = 64, which cost more than 2.2%.
PAD_MULTIPLE = 128

# Weight formats as the kernels' W_FORMAT constexpr (host ints; constexpr twins for jit code).
WEIGHT_FORMAT_CODES = {"bf16": 0, "fp8": 1, "mxfp4": 2}
W_FP8 = tl.constexpr(1)
W_MXFP4 = tl.constexpr(2)


@triton.jit
def round_to_bf16(x, INTERPRETED: tl.constexpr):
    """x float32 -> bfloat16, rounded to nearest even. The Triton 3.6 interpreter's float32 ->
    bfloat16 cast truncates and garbles subnormals, so there the rounding is done on the bits and
    the top half reinterpreted (finite x)."""
    if INTERPRETED:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(tl.bfloat16)


def round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def padded_sizes(hidden_size: int, intermediate_size: int) -> tuple[int, int]:
    return round_up(hidden_size, PAD_MULTIPLE), round_up(intermediate_size, PAD_MULTIPLE)


@functools.cache
def has_ptx_decode(platform: Platform) -> bool:
    """Whether the MXFP4 byte-permute decoder (inline PTX with mul.rn.bf16x2) runs on
    `platform`: NVIDIA sm_90 and newer, compiled (the interpreter, vendor "cpu", cannot run
    PTX). Cached: every moe_apply asks."""
    return platform.vendor == "nvidia" and platform.sm >= 90


def swiglu_fits_f16(alpha: float, limit: float) -> bool:
    """Whether |min(g, limit) * sigmoid(alpha * g) * (clamp(u, -limit, limit) + 1)| stays
    below fp16's max for every g, u: the gate factor is at most max(limit, 0.2785 / alpha)
    in size (g * sigmoid(alpha * g) >= -0.2785 / alpha), the up factor at most limit + 1."""
    if not (alpha > 0 and 0 <= limit < math.inf):
        return False
    return max(limit, 0.2785 / alpha) * (limit + 1) < 60000


def layer_experts(prepared: dict, router_logits, expert_offset: int) -> int:
    """The layer's experts across all ranks: a router's width, else (precomputed ids, which
    only need the local range) the prepared ones from expert_offset."""
    if router_logits is not None:
        return router_logits.shape[1]
    return expert_offset + prepared["num_experts"]


def route_for_gemms(
    prepared: dict,
    top_k: int,
    block_m: int,
    *,
    router_logits: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    topk_ids: torch.Tensor | None = None,
    expert_offset: int = 0,
    **options,
) -> tuple:
    """routing.route for the grouped GEMMs: ((weights, sorted pairs, tiles, tile count on the
    device, tile-count bound, top_k), the ids the combine checks). The forwards pass their
    routing keywords through: either router_logits [M, E] or precomputed topk_weights [M, k]
    float32 + topk_ids [M, k] int32. The prepared weights hold experts expert_offset ..
    expert_offset + prepared["num_experts"] - 1 (all E, unless expert-parallel). Ids the router
    picks are in range when it holds every expert (None to check); otherwise the ids go to
    the combine, which skips the pairs routing left out. options: route's launch_dependents,
    ready, prescale and narrow."""
    local = prepared["num_experts"]
    num_experts = layer_experts(prepared, router_logits, expert_offset)
    weights, ids, sorted_pairs, tiles, num_tiles, max_tiles = route(
        router_logits,
        topk_weights,
        topk_ids,
        top_k=top_k,
        num_experts=num_experts,
        block_m=block_m,
        expert_offset=expert_offset,
        num_local_experts=local,
        **options,
    )
    routing = (weights, sorted_pairs, tiles, num_tiles, max_tiles, top_k)
    every_pair_local = router_logits is not None and local == num_experts
    return routing, (None if every_pair_local else ids)
