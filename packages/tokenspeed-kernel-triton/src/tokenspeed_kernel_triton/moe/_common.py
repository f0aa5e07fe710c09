"""Pieces shared by the Triton MoE kernels (portable and Hopper): weight-format codes, the exact
bf16 rounding the Triton interpreter gets wrong, the padding rule, the SwiGLU fp16 bound and the
routing call both forwards make, and the key their tile tables are read by.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from tokenspeed_kernel.platform import Platform

from .routing import FUSED_MAX_PAIRS, route

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


# The tile tables' bounds (moe_sm90's CONFIGS, moe's NVIDIA table) are pairs over GPT-OSS-120B's
# 128 experts, on which they were measured.
TABLE_EXPERTS = 128


def selection_pairs(num_tokens: int, top_k: int, num_local_experts: int, num_experts: int) -> int:
    """The tile tables' key (moe_sm90.pick_config; moe.pick_config on NVIDIA). The decode
    tiles (pairs that fit the one-program router) are picked by how many experts a batch
    selects: tokens x top_k, or on an expert-parallel rank the pairs its experts expect under
    uniform routing (rounded up): rank 0 of EP=8 at M=8 holds about 2 of the 27 experts a
    whole layer would, as at the whole layer's M=1 (triton.moe_apply.sm90, H200, 2026-11-29,
    graph-timed over 4 layers beside vLLM's path, µs, the whole layer's M=8 pick (128x8) / the
    M=1 pick / the M=4 pick / vLLM: M=8 33.6 / 20.3 / 20.9 / 65.5, M=12 45.4 / 31.4 / 28.4 /
    69.3, M=16 45.6 / 33.4 / 30.2 / 73.6). Past them, by tokens per selected expert, which
    expert parallelism leaves as it is: the pairs TABLE_EXPERTS experts would hold at this
    load. GPT-OSS-20B's 32 experts hold four times GPT-OSS-120B's tokens each, and keyed on its
    own pairs it ran tiles too narrow and lost to vLLM's path from M=64 to 512 (H200
    GPU-deebdeeb, 2026-11-29, `benchmarks/ab_moe_configs.py --model gpt-oss-20b`, µs, keyed on
    pairs / on 128 experts' pairs / vLLM: M=64 196.7 / 155.2 / 189.9, M=128 310.3 / 185.2 /
    280.5, M=256 354.8 / 241.9 / 324.4, M=512 436.9 / 348.5 / 383.5, M=1024 640.6 / 587.3 /
    645.1). Its decode sizes keep the decode keys (another H200 the same day, µs, decode key /
    128 experts' pairs / vLLM: whole M=8 77.6 / 82.6 / 131.9, M=16 108.3 / 109.2 / 170.8; EP=2
    M=8 38.9 / 61.3 / 76.4; TP=2 M=16 60.2 / 69.1 / 108.9)."""
    pairs = num_tokens * top_k
    if pairs <= FUSED_MAX_PAIRS:
        if num_local_experts < num_experts:
            return max(1, -(-pairs * num_local_experts // num_experts))
        return pairs
    # Never a decode tile's key: those need the one-program router's pairs.
    return max(FUSED_MAX_PAIRS + 1, -(-pairs * TABLE_EXPERTS // num_experts))
