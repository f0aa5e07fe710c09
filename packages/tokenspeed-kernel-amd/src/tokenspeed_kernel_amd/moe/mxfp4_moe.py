"""GPT-OSS MoE with MXFP4 weights on CDNA: the registered kernel object (`amd.moe_apply`),
weight preparation, path choice and launches.

M <= 4 tokens take the tiny-batch path (`tiny_batch.py`: fused routing + GEMM1 GEMVs, split-K
GEMM2), larger M the grouped GEMMs (`grouped_gemm.py`). FP8 activations: static per-tensor
scales (GEMM1 requantizes in its epilogue and stores fp8) or, when the checkpoint has none,
dynamic per-token scales as the reference defines them (the row amax is taken with torch
between launches and the consumer quantizes on load).

Expert parallel (the weights hold experts expert_offset .. of the E the router ranks): routing
runs on the host over all E and the ids become local ones, -1 for other ranks' experts, which
both paths already skip; so M <= 4 pays the host top-k the fused path otherwise avoids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenspeed_kernel.ops.moe.types import PreparedMoEWeights
from tokenspeed_kernel.platform import platform_of
from tokenspeed_kernel.registry import register_kernel
from tokenspeed_kernel.tuning import first_match, pinned_config

from ._common import (
    A_BF16,
    A_FP8,
    A_QUANT,
    A_SPLIT,
    AMAX_FLOOR,
    FP8_MAX,
    OUT_F32,
    OUT_FP8,
    PAD,
    gemm_layouts,
    gemv_layout,
    group_by_expert,
    layout_constexprs,
    round_up,
    route_layout,
    topk_softmax,
)
from .grouped_gemm import moe_gemm1_kernel, moe_gemm2_kernel
from .tiny_batch import tiny_gemm1_kernel, tiny_gemm2_kernel

KERNEL_NAME = "amd.moe_apply"
# Configs pinned per path: `tuning.pin_config(GROUPED_PIN, GroupedConfig(...))`.
GROUPED_PIN = f"{KERNEL_NAME}/grouped"
TINY_PIN = f"{KERNEL_NAME}/tiny"
FP8 = torch.float8_e4m3fn
# Beyond 4 tokens the 4*k expert GEMVs re-read weights the grouped GEMM reads once per expert.
TINY_MAX_TOKENS = 4


@dataclass(frozen=True)
class GroupedConfig:
    block_m: int
    block_n: int
    num_warps: int


@dataclass(frozen=True)
class TinyConfig:
    block_n1: int
    block_n2: int
    block_kb: int
    split: int
    num_warps: int


# BLOCK_M by rows per expert: MFMA/MMA tiles are 16 rows, so taller blocks only pay once
# experts hold more rows than that.
BLOCK_M_BY_ROWS = ((16, 16), (48, 32), (None, 64))


def grouped_config(pairs: int, num_experts: int) -> GroupedConfig:
    block_m = first_match(BLOCK_M_BY_ROWS, pairs / num_experts)
    # 64 output columns x 64 packed bytes keep two weight planes + accumulators in ~128 VGPRs
    # on CDNA (no spills at 4 waves/SIMD) and the decode in registers on NVIDIA.
    return GroupedConfig(block_m, 64, 4)


def tiny_config(pairs: int, h_pad: int, i_pad: int, cus: int) -> TinyConfig:
    block_n2 = 32
    # Split K of GEMM2 until there are ~2 programs per CU: at M <= 4 the H tiles alone
    # (H_pad / 32 per pair) leave most CUs idle.
    tiles = (h_pad // block_n2) * pairs
    chunks = i_pad // 128
    split = max(1, min(chunks, -(-2 * cus // tiles)))
    # 32 rows x 64 bytes per step: 8 bytes/thread per plane with 4 warps of 64 lanes, every
    # load a full 16-byte vector; I_pad / 32 x pairs programs for GEMM1.
    return TinyConfig(32, block_n2, 64, split, 4)


class AmdMxfp4MoE:
    """MXFP4-weight MoE for GPT-OSS (core's `MoEKernel`): tiny-batch fused path (M <= 4) and
    grouped GEMM."""

    weight_layout = "amd-mxfp4-gate-up-planes-padded-128"

    def padded_sizes(self, config) -> tuple[int, int]:
        return round_up(config.hidden_size, PAD), round_up(config.intermediate_size, PAD)

    def prepare_weights(self, plan, weights) -> PreparedMoEWeights:
        """Checkpoint MXFP4 -> gate/up planes [E, 2, I_pad, H_pad/2] (+ e8m0 [.., H_pad/32]),
        w2 [E, H_pad, I_pad/2], float32 biases; new tensors, the caller's are only read."""
        tensors = prepare_tensors(plan.config, weights, *self.padded_sizes(plan.config))
        return PreparedMoEWeights(kernel=plan.kernel, config=plan.config, tensors=tensors)

    def apply(self, plan, x, prepared, *, router_logits, topk_weights, topk_ids, out) -> None:
        """x [M, H] bf16 -> out [M, H] bf16 (in place); router_logits [M, E] or precomputed
        topk_weights [M, k] float32 + topk_ids [M, k] int32 (a pair whose id is outside
        [0, E) contributes nothing: both paths skip it with an integer compare)."""
        x = x.contiguous()
        if x.shape[0] == 0:
            return
        platform = platform_of(x.device)
        # The tests' NVIDIA instantiation builds the same source with mma_v2 and plain loads.
        arch = platform.arch if platform.vendor == "amd" else "nvidia"
        t, config = prepared.tensors, plan.config
        if config.expert_parallel:
            if router_logits is not None:
                topk_weights, topk_ids = topk_softmax(router_logits, config.top_k)
                router_logits = None
            topk_ids = local_ids(topk_ids, config.expert_offset, config.num_local_experts)
        if x.shape[0] <= TINY_MAX_TOKENS:
            run_tiny(arch, platform.sm_count, config, t, x, router_logits, topk_weights,
                     topk_ids, out)  # fmt: skip
            return
        if router_logits is not None:
            topk_weights, topk_ids = topk_softmax(router_logits, config.top_k)
        run_grouped(arch, config, t, x, topk_weights, topk_ids, out)


def local_ids(topk_ids: torch.Tensor, offset: int, count: int) -> torch.Tensor:
    """Global ids [M, k] -> ids of the experts held here ([0, count)), -1 for the others."""
    local = topk_ids - offset
    return torch.where((local >= 0) & (local < count), local, -1).to(torch.int32).contiguous()


def prepare_tensors(config, w, h_pad: int, i_pad: int) -> dict:
    if config.weight_format != "mxfp4":
        raise ValueError(
            f"AmdMxfp4MoE: weight_format is {config.weight_format!r}, expected 'mxfp4'"
        )
    E, H, I = config.num_local_experts, config.hidden_size, config.intermediate_size  # noqa: E741
    dev = w.w13.device
    # Gate (even rows) and up (odd rows) become two planes so one program reads both halves of
    # the same outputs and the SwiGLU needs no cross-lane shuffle.
    w13 = torch.zeros(E, 2, i_pad, h_pad // 2, dtype=torch.uint8, device=dev)
    w13[:, :, :I, : H // 2] = w.w13.view(E, I, 2, H // 2).transpose(1, 2)
    # Scale 127 (2^0) in the padding: zero codes times a finite scale stay zero.
    w13s = torch.full((E, 2, i_pad, h_pad // 32), 127, dtype=torch.uint8, device=dev)
    w13s[:, :, :I, : H // 32] = w.w13_scale.view(E, I, 2, H // 32).transpose(1, 2)
    w2 = torch.zeros(E, h_pad, i_pad // 2, dtype=torch.uint8, device=dev)
    w2[:, :H, : I // 2] = w.w2
    w2s = torch.full((E, h_pad, i_pad // 32), 127, dtype=torch.uint8, device=dev)
    w2s[:, :H, : I // 32] = w.w2_scale
    b13 = torch.zeros(E, 2, i_pad, dtype=torch.float32, device=dev)
    b2 = torch.zeros(E, h_pad, dtype=torch.float32, device=dev)
    if config.has_bias:
        b13[:, :, :I] = w.w13_bias.float().view(E, I, 2).transpose(1, 2)
        b2[:, :H] = w.w2_bias.float()

    def static(scale):
        return None if scale is None else torch.tensor([float(scale)], device=dev)

    tensors = dict(w13=w13, w13_scale=w13s, w13_bias=b13, w2=w2, w2_scale=w2s, w2_bias=b2)
    return dict(tensors, x_scale=static(w.w13_input_scale), a_scale=static(w.w2_input_scale))


def _empty_scale(device):
    return torch.ones(1, dtype=torch.float32, device=device)


def _gemm1_operands(config, t, x, rows: int, i_pad: int):
    """GEMM1's activation scales, row stride and A_MODE (a static scale is one element, stride
    0), its output [rows, i_pad] and OUT_MODE, and the scale its epilogue requantizes with.
    The output is fp8 with a static scale, else float32: the reference keeps the SwiGLU output
    in float32, and a bf16 rounding per element costs ~1% RMS at large activations."""
    if config.activation_format != "fp8":
        x_scale, x_stride, a_mode = _empty_scale(x.device), 0, A_BF16
    elif t["x_scale"] is not None:
        x_scale, x_stride, a_mode = t["x_scale"], 0, A_QUANT
    else:
        amax = x.float().abs().amax(dim=-1).clamp(min=AMAX_FLOOR)
        x_scale, x_stride, a_mode = amax / torch.full((), FP8_MAX, device=x.device), 1, A_QUANT
    if config.activation_format == "fp8" and t["a_scale"] is not None:
        inter = torch.empty(rows, i_pad, dtype=FP8, device=x.device)
        return x_scale, x_stride, a_mode, inter, OUT_FP8, t["a_scale"]
    inter = torch.empty(rows, i_pad, dtype=torch.float32, device=x.device)
    return x_scale, x_stride, a_mode, inter, OUT_F32, x_scale


def _gemm2_input(config, t, inter, out_mode):
    """(A tensor, scales, row stride, A_MODE) of GEMM2; fp8 codes are read as bytes."""
    if config.activation_format != "fp8":
        return inter, _empty_scale(inter.device), 0, A_SPLIT
    if out_mode == OUT_FP8:
        return inter.view(torch.uint8), t["a_scale"], 0, A_FP8
    # Dynamic per-token scales of the float32 intermediate, as the reference quantizes it.
    amax = inter.abs().amax(dim=-1).clamp(min=AMAX_FLOOR)
    return inter, amax / torch.full((), FP8_MAX, device=inter.device), 1, A_QUANT


def run_grouped(arch, config, t, x, topk_weights, topk_ids, out) -> None:
    """The grouped-GEMM path; the config is the one pinned for GROUPED_PIN, else the table's."""
    M, H = x.shape
    k, E = config.top_k, config.num_local_experts
    h_pad, i_pad = t["w2"].shape[1], t["w13"].shape[2]
    # Rows per expert: the pairs spread over every expert, wherever they are held.
    cfg = pinned_config(GROUPED_PIN) or grouped_config(M * k, config.num_experts)
    rows, block_expert = group_by_expert(topk_ids, E, cfg.block_m)
    blocks = block_expert.numel()
    scaled = arch == "gfx950" and config.activation_format == "fp8"
    layouts = layout_constexprs(gemm_layouts(arch, cfg.block_m, cfg.block_n, cfg.num_warps, scaled))
    common = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, ARCH=arch, HAS_BIAS=config.has_bias,
                  SCALED=scaled, num_warps=cfg.num_warps, **layouts)  # fmt: skip
    x_scale, x_stride, a_mode, inter, out_mode, out_scale = _gemm1_operands(
        config, t, x, blocks * cfg.block_m, i_pad
    )
    act = config.activation
    moe_gemm1_kernel[(blocks, i_pad // cfg.block_n)](
        x, x_scale, t["w13"], t["w13_scale"], t["w13_bias"], rows, block_expert, inter,
        out_scale, x.stride(0), x_stride, H, h_pad // 2, i_pad, k, act.alpha, act.limit,
        A_MODE=a_mode, OUT_MODE=out_mode, **common,
    )  # fmt: skip
    a_in, a_scale, a_stride, a_mode2 = _gemm2_input(config, t, inter, out_mode)
    y = torch.empty(M * k, h_pad, dtype=torch.float32, device=x.device)
    moe_gemm2_kernel[(blocks, h_pad // cfg.block_n)](
        a_in, a_scale, t["w2"], t["w2_scale"], t["w2_bias"], rows, block_expert,
        topk_weights.reshape(-1).float().contiguous(), y, a_stride, i_pad // 2, h_pad, k,
        A_MODE=a_mode2, **common,
    )  # fmt: skip
    out.copy_(y.view(M, k, h_pad)[:, :, :H].sum(dim=1))


def _tiny_routing(x, k, router_logits, topk_weights, topk_ids):
    """(logits, logits row stride, topk weights, topk ids): GEMM1 writes the routing outputs
    itself when it routes; precomputed ones are read as given."""
    if router_logits is not None:
        weights = torch.empty(x.shape[0], k, dtype=torch.float32, device=x.device)
        ids = torch.empty(x.shape[0], k, dtype=torch.int32, device=x.device)
        return router_logits, router_logits.stride(0), weights, ids
    # The logits operand is unused without routing.
    return topk_weights, 0, topk_weights.float().contiguous(), topk_ids.contiguous()


def run_tiny(arch, cus, config, t, x, router_logits, topk_weights, topk_ids, out) -> None:
    """The tiny-batch path; the config is the one pinned for TINY_PIN, else `tiny_config`'s
    for `cus` compute units."""
    M, H = x.shape
    k, E = config.top_k, config.num_local_experts
    h_pad, i_pad = t["w2"].shape[1], t["w13"].shape[2]
    pairs = M * k
    cfg = pinned_config(TINY_PIN) or tiny_config(pairs, h_pad, i_pad, cus)
    logits, stride_lm, topk_weights, topk_ids = _tiny_routing(
        x, k, router_logits, topk_weights, topk_ids
    )
    x_scale, x_stride, a_mode, inter, out_mode, out_scale = _gemm1_operands(
        config, t, x, pairs, i_pad
    )
    lw = gemv_layout(arch, cfg.num_warps)
    act = config.activation
    tiny_gemm1_kernel[(i_pad // cfg.block_n1, pairs)](
        x, logits, topk_weights, topk_ids, x_scale, t["w13"], t["w13_scale"], t["w13_bias"],
        inter, out_scale, x.stride(0), stride_lm, x_stride, E, H, h_pad // 2, i_pad, act.alpha,
        act.limit, TOP_K=k, E_BLOCK=max(64, 1 << (E - 1).bit_length()), BLOCK_N=cfg.block_n1,
        BLOCK_KB=cfg.block_kb, ARCH=arch, ROUTE=router_logits is not None, A_MODE=a_mode,
        OUT_MODE=out_mode, HAS_BIAS=config.has_bias, LW=lw,
        LE=route_layout(arch, cfg.num_warps), num_warps=cfg.num_warps,
    )  # fmt: skip
    a_in, a_scale, a_stride, a_mode2 = _gemm2_input(config, t, inter, out_mode)
    kb_total = i_pad // 2
    split_kb = round_up(-(-kb_total // cfg.split), cfg.block_kb)
    split = -(-kb_total // split_kb)
    partial = torch.empty(split, pairs, h_pad, dtype=torch.float32, device=x.device)
    tiny_gemm2_kernel[(h_pad // cfg.block_n2, split, pairs)](
        a_in, a_scale, topk_weights, topk_ids, t["w2"], t["w2_scale"], t["w2_bias"], partial,
        a_stride, E, kb_total, h_pad, split_kb, pairs, BLOCK_N=cfg.block_n2,
        BLOCK_KB=cfg.block_kb, ARCH=arch, A_MODE=a_mode2, HAS_BIAS=config.has_bias, LW=lw,
        num_warps=cfg.num_warps,
    )  # fmt: skip
    out.copy_(partial.view(split, M, k, h_pad).sum(dim=(0, 2))[:, :H])


# Only what the tests exercise: MXFP4 weights, bf16 or fp8 activations (fp8 with static
# per-tensor scales, or dynamic per-token ones computed between launches), top-k softmax, bias.
TRAITS = {
    "weight_format": {"mxfp4"},
    "activation_format": {"bf16", "fp8"},
    "routing": {"topk_softmax"},
    "bias": True,
    "expert_parallel": True,
}
# Every activation flavour (bf16; fp8 with static or dynamic scales) on each path: M=1 takes
# the tiny-batch kernels (E=128 gives their 128-wide routing block), M=128 and M=2048 the
# grouped GEMMs with 16- and 64-row blocks (4 and 64 rows per expert). The kernels take H and I
# as runtime values, so small ones compile the GPT-OSS specializations.
_SHAPE = dict(num_experts=128, top_k=4, hidden_size=256, intermediate_size=256)
_FLAVOURS = (
    dict(activation_format="bf16"),
    dict(activation_format="fp8", static_scales=True),
    dict(activation_format="fp8"),
)
AOT_CASES = (
    dict(_SHAPE, num_tokens=1),
    dict(_SHAPE, num_tokens=1, activation_format="fp8", static_scales=True),
    dict(_SHAPE, num_tokens=1, activation_format="fp8", routing="precomputed"),
    *(dict(_SHAPE, num_tokens=m, **flavour) for m in (128, 2048) for flavour in _FLAVOURS),
)
# The grouped GEMMs run on MFMA; the tiny-batch GEMVs on the vector units by design (an MFMA
# tile would be >= 75% padding at M <= 4).
AOT_EXPECT = {
    "moe_gemm1_kernel": ("mfma", "buffer_load", "buffer_store"),
    "moe_gemm2_kernel": ("mfma", "buffer_load", "buffer_store"),
    "tiny_gemm1_kernel": ("buffer_load", "buffer_store"),
    "tiny_gemm2_kernel": ("buffer_load", "buffer_store"),
}


def register() -> None:
    register_kernel(
        "moe_apply",
        name=KERNEL_NAME,
        backend="amd",
        platforms=["amd:gfx942,gfx950"],
        traits=TRAITS,
        priority=200,
        description=(
            "Gluon MXFP4 MoE: fused routing+GEMM1+SwiGLU+requant and split-K GEMM2 for M<=4, "
            "grouped GEMM above; gfx950 scaled MFMA for fp8 activations"
        ),
        aot_cases=AOT_CASES,
    )(AmdMxfp4MoE())
