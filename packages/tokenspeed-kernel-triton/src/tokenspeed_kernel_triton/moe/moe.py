"""The portable Triton MoE kernel (`triton.moe_apply`): route -> GEMM1 + bias + SwiGLU -> GEMM2
+ bias, routing weight -> combine, on NVIDIA sm_80+, AMD gfx942/gfx950 and (through the Triton
interpreter) the CPU. An engine can call `moe_forward` directly with the tensors from
`layout.prepare_weights`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenspeed_kernel.platform import interpreting, platform_of
from tokenspeed_kernel.registry import Support, register_kernel
from tokenspeed_kernel.tuning import first_match, pinned_config

from ._common import (
    WEIGHT_FORMAT_CODES,
    has_ptx_decode,
    layer_experts,
    route_for_gemms,
    selection_pairs,
)
from .combine import combine
from .grouped_gemm import grouped_gemm
from .layout import PaddedMoEKernel
from .quant import quantize_rows
from .workspace import scratch

KERNEL_NAME = "triton.moe_apply"
WEIGHT_LAYOUT = "triton-mx4words-padded"


@dataclass(frozen=True)
class MoETileConfig:
    """Tiles of the grouped GEMMs (GEMM1's BLOCK_N counts interleaved gate/up rows, so it
    produces BLOCK_N/2 SwiGLU outputs). block_m is also the expert padding of the sorted rows."""

    block_m: int
    block_n1: int
    block_n2: int
    block_k: int
    num_warps: int
    num_stages: int


# (max tokens x top_k, config), first match wins. One line of hardware reason each.
_NVIDIA = (
    # Decode: weight streaming. 16 rows is the smallest MMA tile; narrow N blocks give ~370
    # CTAs per GEMM at M=1, and 6 stages of 4 KB weight loads hide HBM latency (measured on
    # H200: 97 us at M=1 vs 108 us with BLOCK_K 256 x 4 stages).
    (64, MoETileConfig(16, 64, 64, 128, 4, 6)),
    # Mid batches, up to 4096 tokens x top-4 (~128 rows per GPT-OSS-120B expert): 64-row
    # tiles with 4 warps; measured on H200 at M=4096: 4.04 ms vs 4.22 ms with the 128-row tile
    # below, which wins from M=8192 (6.97 vs 7.16 ms). Read by tokens per expert
    # (selection_pairs), as GPT-OSS-20B's 32 experts showed (H200 GPU-1303392a, 2026-11-29,
    # µs, 64-row / 128-row tiles: M=1024 1057.6 / 1116.9 graph-timed over 4 layers, M=2048
    # 1831.3 / 1802.4 and M=4096 3404.7 / 3226.4 eager).
    (16384, MoETileConfig(64, 128, 128, 64, 4, 4)),
    # Prefill: matmul-bound; 128x128 wgmma tiles with 8 warps, 3 stages fit shared memory
    # together with the in-register dequantized weight tile.
    (None, MoETileConfig(128, 128, 128, 64, 8, 3)),
)
_AMD = (
    # CDNA: 64 KB LDS on gfx942 bounds stages x tile; wave64 makes 4 warps = 256 threads.
    (64, MoETileConfig(16, 64, 64, 128, 4, 2)),
    (2048, MoETileConfig(64, 128, 128, 64, 4, 2)),
    (None, MoETileConfig(128, 128, 128, 64, 8, 2)),
)
# The interpreter runs numpy per program: small tiles keep padding waste (and test time) low.
_INTERPRETER = ((None, MoETileConfig(16, 64, 64, 128, 4, 1)),)


def pick_config(num_pairs: int, vendor: str) -> MoETileConfig:
    """The tile config for `num_pairs` (the table's key: tokens x top_k, or on NVIDIA
    selection_pairs) on a `vendor` device (or the pinned one, `tuning.pin_config(KERNEL_NAME,
    config)`)."""
    pinned = pinned_config(KERNEL_NAME)
    if pinned is not None:
        return pinned
    return first_match({"nvidia": _NVIDIA, "amd": _AMD}.get(vendor, _INTERPRETER), num_pairs)


def moe_forward(
    x: torch.Tensor,
    prepared: dict,
    *,
    top_k: int,
    out: torch.Tensor,
    activation_format: str = "bf16",
    w13_input_scale: float | None = None,
    w2_input_scale: float | None = None,
    alpha: float = 1.702,
    limit: float = 7.0,
    expert_offset: int = 0,
    num_experts: int | None = None,
    **routing_inputs,
) -> torch.Tensor:
    """out [M, H] = sum_e r_e (W2[e] swiglu(W13[e] x + b13[e]) + b2[e]) for x [M, H] bf16.

    routing_inputs: router_logits= [M, E] (top-k, ties to the lower index, softmax over the k) or
    precomputed topk_weights= [M, k] float32 + topk_ids= [M, k] int32 (a pair whose id is
    outside [0, E) contributes nothing: routing.py's module doc). Expert parallel: the
    prepared weights are global experts expert_offset .. (ids stay global; pairs of experts
    not held here contribute nothing). FP8 activations: static
    per-tensor input scales when given, else dynamic per-token (per pair for the second GEMM).
    num_experts: the layer's experts across all ranks (None: `layer_experts`), by which the
    NVIDIA table is read.
    """
    M = x.shape[0]
    if M == 0:
        return out
    platform = platform_of(x.device)
    key = M * top_k
    # AMD's table was measured on 128 experts' pairs only (no other expert count).
    if platform.vendor != "amd":
        if num_experts is None:
            logits = routing_inputs.get("router_logits")
            num_experts = layer_experts(prepared, logits, expert_offset)
        key = selection_pairs(M, top_k, prepared["num_experts"], num_experts)
    config = pick_config(key, platform.vendor)
    routing, ids_to_check = route_for_gemms(
        prepared, top_k, config.block_m, expert_offset=expert_offset, **routing_inputs
    )
    fp8 = activation_format == "fp8"
    a_in, a_in_scale = quantize_rows(x, w13_input_scale, "x") if fp8 else (x, None)
    common = dict(
        w_format=WEIGHT_FORMAT_CODES[prepared["weight_format"]],
        config=config,
        interpreted=interpreting(),
        ptx_decode=has_ptx_decode(platform),
    )
    act = _swiglu_rows(x, routing[4] * config.block_m, prepared, fp8, w2_input_scale)
    H, Ip = prepared["hidden_size"], prepared["padded_intermediate_size"]
    gemm1 = dict(gemm1=True, k_valid=H, n_valid=2 * Ip, alpha=alpha, limit=limit)
    out_scale = w2_input_scale if fp8 else None
    w13 = (prepared["w13"], prepared["w13_scale"], prepared["w13_bias"])
    grouped_gemm(a_in, a_in_scale, *w13, act, routing, **gemm1, out_scale=out_scale, **common)
    act_scale = out_scale
    if fp8 and w2_input_scale is None:
        tiles = (routing[2], routing[3], config.block_m)
        act, act_scale = quantize_rows(act, None, "act", tiles)
    y = scratch("y", (M * top_k, H), torch.float32, x.device)
    w2 = (prepared["w2"], prepared["w2_scale"], prepared["w2_bias"])
    grouped_gemm(act, act_scale, *w2, y, routing, gemm1=False, k_valid=Ip, n_valid=H, **common)
    combine(
        y, out, top_k=top_k, topk_ids=ids_to_check, num_experts=prepared["num_experts"],
        expert_offset=expert_offset,
    )  # fmt: skip
    return out


def _swiglu_rows(x, rows: int, prepared: dict, fp8: bool, w2_input_scale) -> torch.Tensor:
    """GEMM1's output rows: bf16 [hi | lo] halves (the reference's float32 intermediate, read
    by GEMM2 without conversions); FP8 straight from the epilogue with a static scale; float32
    for a dynamic FP8 scale, which needs each row's amax first."""
    Ip = prepared["padded_intermediate_size"]
    if not fp8:
        return scratch("act", (rows, 2 * Ip), torch.bfloat16, x.device)
    if w2_input_scale is not None:
        return scratch("act", (rows, Ip), torch.float8_e4m3fn, x.device)
    return scratch("act", (rows, Ip), torch.float32, x.device)


class TritonMoE(PaddedMoEKernel):
    """The registered "moe_apply" kernel object: padded checkpoint layout, grouped GEMMs with
    in-kernel MXFP4/FP8 dequantization, bf16 or FP8 activations."""

    name = KERNEL_NAME
    weight_layout = WEIGHT_LAYOUT
    word_order = "natural"
    forward = staticmethod(moe_forward)

    def forward_options(self, config, tensors: dict) -> dict:
        return dict(
            num_experts=config.num_experts,
            activation_format=config.activation_format,
            w13_input_scale=tensors["w13_input_scale"],
            w2_input_scale=tensors["w2_input_scale"],
        )


def supports(request, platform) -> Support:
    fp8 = "fp8" in (request.weight_format, request.activation_format)
    if fp8 and platform.vendor == "nvidia" and platform.sm < 89:
        return Support.no(f"FP8 e4m3 conversion needs sm_89+, this is {platform.arch}")
    return Support.yes()


# GPT-OSS-120B's H = I = 2880 and top-4 with fewer experts where a config does not depend on
# the expert count; 128 experts (the routers' BLOCK_E) at small H and I. M = 1 / 4 / 16 take the
# decode tiles and the one-program router, 4096 (16384 pairs) the mid tiles on NVIDIA and the
# prefill tiles on AMD, 4500 the prefill tiles everywhere; EP 8 ranks route into 16 experts.
_GPT_OSS = dict(top_k=4, hidden_size=2880, intermediate_size=2880)
_ROUTERS = dict(num_experts=128, top_k=4, hidden_size=128, intermediate_size=128)
AOT_CASES = (
    dict(_GPT_OSS, num_tokens=1, num_experts=8),
    dict(_GPT_OSS, num_tokens=1, num_experts=8, activation_format="fp8"),
    dict(_GPT_OSS, num_tokens=1, num_experts=8, activation_format="fp8", static_scales=True),
    dict(_GPT_OSS, num_tokens=4096, num_experts=8),
    dict(_GPT_OSS, num_tokens=4096, num_experts=8, activation_format="fp8"),
    dict(_ROUTERS, num_tokens=4),
    dict(_ROUTERS, num_tokens=16),
    dict(_ROUTERS, num_tokens=4500),
    dict(_ROUTERS, num_tokens=1, weight_format="fp8"),
    dict(_ROUTERS, num_tokens=1, weight_format="bf16"),
    # Expert parallel at EP 8 (16 of 128 experts): the routers' local block is 16 wide.
    dict(_ROUTERS, num_tokens=4, expert_offset=16, num_local_experts=16),
    dict(_ROUTERS, num_tokens=4500, expert_offset=16, num_local_experts=16),
)


def register() -> None:
    platforms = ["nvidia:sm_80+", "amd:gfx942,gfx950"]
    # The CPU runs these kernels only through the Triton interpreter (tests, debugging).
    if interpreting():
        platforms.append("cpu")
    register_kernel(
        "moe_apply",
        name=KERNEL_NAME,
        backend="triton",
        platforms=platforms,
        traits={
            "weight_format": {"mxfp4", "fp8", "bf16"},
            "activation_format": {"bf16", "fp8"},
            "routing": {"topk_softmax"},
            "bias": True,
            "expert_parallel": True,
        },
        priority=100,
        supports=supports,
        description="expert-sorted grouped GEMMs, in-kernel MXFP4/FP8 dequant, fused "
        "bias+SwiGLU, one-launch decode routing",
        aot_cases=AOT_CASES,
    )(TritonMoE())
