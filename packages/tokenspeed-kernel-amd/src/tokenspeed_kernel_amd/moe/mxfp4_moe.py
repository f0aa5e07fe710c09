"""GPT-OSS MoE with MXFP4 weights on CDNA: weight preparation, path choice and launches.

`AmdMxfp4MoE` follows tokenspeed_kernel's MoE kernel contract (padded_sizes / prepare_weights /
apply) but imports nothing from it: `prepare_weights` only reads the plan's `config` and the
weights' fields, and returns whatever `make_prepared` builds (the registration passes core's
PreparedMoEWeights), so an engine can drive it directly.

FP8 activations: static per-tensor scales (GEMM1 requantizes in its epilogue and stores fp8) or,
when the checkpoint has none, dynamic per-token scales as the reference defines them (the row
amax is taken with torch between launches and the consumer quantizes on load).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._common import (
    AMAX_FLOOR,
    FP8_MAX,
    PAD,
    cu_count,
    device_arch,
    gemm_layouts,
    gemv_layout,
    group_by_expert,
    round_up,
    topk_softmax,
)
from .grouped_gemm import (
    A_BF16,
    A_FP8,
    A_QUANT,
    A_SPLIT,
    OUT_F32,
    OUT_FP8,
    moe_gemm1_kernel,
    moe_gemm2_kernel,
)
from .tiny_batch import tiny_gemm1_kernel, tiny_gemm2_kernel

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


def grouped_config(arch: str, pairs: int, num_experts: int) -> GroupedConfig:
    rows_per_expert = pairs / num_experts
    # MFMA/MMA tiles are 16 rows: taller blocks only pay once experts hold more rows than that.
    block_m = 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 48 else 64
    # 64 output columns x 64 packed bytes keep two weight planes + accumulators in ~128 VGPRs
    # on CDNA (AOT: no spills at 4 waves/SIMD) and the decode in registers on NVIDIA.
    return GroupedConfig(block_m, 64, 4)


def tiny_config(arch: str, pairs: int, h_pad: int, i_pad: int, cus: int) -> TinyConfig:
    block_n2 = 32
    # Split K of GEMM2 until there are ~2 programs per CU: at M <= 4 the H tiles alone
    # (H_pad / 32 per pair) leave most CUs idle.
    tiles = (h_pad // block_n2) * pairs
    chunks = i_pad // 128
    split = max(1, min(chunks, -(-2 * cus // tiles)))
    # 32 rows x 64 bytes per step: 8 bytes/thread per plane with 4 warps of 64 lanes, every
    # load a full 16-byte vector; I_pad / 32 x pairs programs for GEMM1.
    return TinyConfig(32, block_n2, 64, split, 4)


def _empty_scale(device):
    return torch.ones(1, dtype=torch.float32, device=device)


class AmdMxfp4MoE:
    """MXFP4-weight MoE for GPT-OSS: tiny-batch fused path (M <= 4) and grouped GEMM."""

    weight_layout = "amd-mxfp4-gate-up-planes-padded-128"

    def __init__(self, name: str, make_prepared=None):
        self.name = name
        self.make_prepared = make_prepared

    def padded_sizes(self, config) -> tuple[int, int]:
        return round_up(config.hidden_size, PAD), round_up(config.intermediate_size, PAD)

    def prepare_weights(self, plan, weights):
        """Checkpoint MXFP4 -> gate/up planes [E, 2, I_pad, H_pad/2] (+ e8m0 [.., H_pad/32]),
        w2 [E, H_pad, I_pad/2], float32 biases; new tensors, the caller's are only read."""
        config = plan.config
        tensors = prepare_tensors(config, weights, *self.padded_sizes(config))
        if self.make_prepared is None:
            return tensors
        return self.make_prepared(self.name, config, tensors)

    def apply(
        self, plan, x, prepared, *, router_logits=None, topk_weights=None, topk_ids=None, out
    ):
        """x [M, H] bf16 -> out [M, H] bf16 (in place); router_logits [M, E] or precomputed
        topk_weights [M, k] float32 + topk_ids [M, k] int32."""
        t = getattr(prepared, "tensors", prepared)
        config = plan.config
        x = x.contiguous()
        arch = device_arch(x.device)
        if x.shape[0] == 0:
            return
        if x.shape[0] <= TINY_MAX_TOKENS:
            run_tiny(arch, config, t, x, router_logits, topk_weights, topk_ids, out)
            return
        if router_logits is not None:
            topk_weights, topk_ids = topk_softmax(router_logits, config.top_k)
        run_grouped(arch, config, t, x, topk_weights, topk_ids, out)


def prepare_tensors(config, w, h_pad: int, i_pad: int) -> dict:
    if config.weight_format != "mxfp4":
        raise ValueError(
            f"AmdMxfp4MoE: weight_format is {config.weight_format!r}, expected 'mxfp4'"
        )
    E, H, I = config.num_experts, config.hidden_size, config.intermediate_size  # noqa: E741
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

    return dict(
        w13=w13,
        w13_scale=w13s,
        w13_bias=b13,
        w2=w2,
        w2_scale=w2s,
        w2_bias=b2,
        x_scale=static(w.w13_input_scale),
        a_scale=static(w.w2_input_scale),
    )


def _activation_scales(config, t, x):
    """(scale tensor, row stride, A mode) for GEMM1's input: static = one element, stride 0."""
    if config.activation_format != "fp8":
        return _empty_scale(x.device), 0, A_BF16
    if t["x_scale"] is not None:
        return t["x_scale"], 0, A_QUANT
    amax = x.float().abs().amax(dim=-1).clamp(min=AMAX_FLOOR)
    return amax / torch.full((), FP8_MAX, device=x.device), 1, A_QUANT


def _gemm1_out(config, t, rows, i_pad, device):
    """GEMM1's output buffer and OUT_MODE (fp8 with a static scale, float32 when dynamic)."""
    if config.activation_format != "fp8":
        # float32, not bf16: the reference keeps the SwiGLU output in float32, and a bf16
        # rounding per element costs ~1% RMS at large activations (the clamped case).
        return torch.empty(rows, i_pad, dtype=torch.float32, device=device), OUT_F32
    if t["a_scale"] is not None:
        return torch.empty(rows, i_pad, dtype=FP8, device=device), OUT_FP8
    return torch.empty(rows, i_pad, dtype=torch.float32, device=device), OUT_F32


def _gemm2_input(config, t, inter, out_mode):
    """(A tensor, scales, row stride, A_MODE) of GEMM2; fp8 codes are read as bytes."""
    if config.activation_format != "fp8":
        return inter, _empty_scale(inter.device), 0, A_SPLIT
    if out_mode == OUT_FP8:
        return inter.view(torch.uint8), t["a_scale"], 0, A_FP8
    # Dynamic per-token scales of the float32 intermediate, as the reference quantizes it.
    amax = inter.abs().amax(dim=-1).clamp(min=AMAX_FLOOR)
    return inter, amax / torch.full((), FP8_MAX, device=inter.device), 1, A_QUANT


def run_grouped(arch, config, t, x, topk_weights, topk_ids, out, cfg=None):
    M, H = x.shape
    k, E = config.top_k, config.num_experts
    h_pad, i_pad = t["w2"].shape[1], t["w13"].shape[2]
    cfg = cfg or grouped_config(arch, M * k, E)
    rows, block_expert = group_by_expert(topk_ids, E, cfg.block_m)
    blocks = block_expert.numel()
    scaled = arch == "gfx950" and config.activation_format == "fp8"
    lay = gemm_layouts(arch, cfg.block_m, cfg.block_n, cfg.num_warps, scaled)
    layouts = dict(
        MMA=lay.mma,
        DOT_A=lay.dot_a,
        DOT_B=lay.dot_b,
        LOAD_A=lay.load_a,
        LOAD_W=lay.load_w,
        SCALE_B=lay.scale_b,
    )
    x_scale, x_stride, a_mode = _activation_scales(config, t, x)
    inter, out_mode = _gemm1_out(config, t, blocks * cfg.block_m, i_pad, x.device)
    act = config.activation
    out_scale = t["a_scale"] if out_mode == OUT_FP8 else x_scale
    moe_gemm1_kernel[(blocks, i_pad // cfg.block_n)](
        x,
        x_scale,
        t["w13"],
        t["w13_scale"],
        t["w13_bias"],
        rows,
        block_expert,
        inter,
        out_scale,
        x.stride(0),
        x_stride,
        H,
        h_pad // 2,
        i_pad,
        k,
        act.alpha,
        act.limit,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        ARCH=arch,
        A_MODE=a_mode,
        OUT_MODE=out_mode,
        HAS_BIAS=config.has_bias,
        SCALED=scaled,
        num_warps=cfg.num_warps,
        **layouts,
    )
    a_in, a_scale, a_stride, a_mode2 = _gemm2_input(config, t, inter, out_mode)
    y = torch.empty(M * k, h_pad, dtype=torch.float32, device=x.device)
    moe_gemm2_kernel[(blocks, h_pad // cfg.block_n)](
        a_in,
        a_scale,
        t["w2"],
        t["w2_scale"],
        t["w2_bias"],
        rows,
        block_expert,
        topk_weights.reshape(-1).float().contiguous(),
        y,
        a_stride,
        i_pad // 2,
        h_pad,
        k,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        ARCH=arch,
        A_MODE=a_mode2,
        HAS_BIAS=config.has_bias,
        SCALED=scaled,
        num_warps=cfg.num_warps,
        **layouts,
    )
    out.copy_(y.view(M, k, h_pad)[:, :, :H].sum(dim=1))


def run_tiny(arch, config, t, x, router_logits, topk_weights, topk_ids, out, cfg=None):
    M, H = x.shape
    k, E = config.top_k, config.num_experts
    h_pad, i_pad = t["w2"].shape[1], t["w13"].shape[2]
    pairs = M * k
    cfg = cfg or tiny_config(arch, pairs, h_pad, i_pad, cu_count(x.device))
    route = router_logits is not None
    if route:
        topk_weights = torch.empty(M, k, dtype=torch.float32, device=x.device)
        topk_ids = torch.empty(M, k, dtype=torch.int32, device=x.device)
        logits, stride_lm = router_logits, router_logits.stride(0)
    else:
        logits, stride_lm = topk_weights, 0  # unused
        topk_weights = topk_weights.float().contiguous()
        topk_ids = topk_ids.contiguous()
    x_scale, x_stride, a_mode = _activation_scales(config, t, x)
    inter, out_mode = _gemm1_out(config, t, pairs, i_pad, x.device)
    out_scale = t["a_scale"] if out_mode == OUT_FP8 else x_scale
    lw = gemv_layout(arch, cfg.num_warps)
    act = config.activation
    tiny_gemm1_kernel[(i_pad // cfg.block_n1, pairs)](
        x,
        logits,
        topk_weights,
        topk_ids,
        x_scale,
        t["w13"],
        t["w13_scale"],
        t["w13_bias"],
        inter,
        out_scale,
        x.stride(0),
        stride_lm,
        x_stride,
        E,
        H,
        h_pad // 2,
        i_pad,
        act.alpha,
        act.limit,
        TOP_K=k,
        E_BLOCK=max(64, 1 << (E - 1).bit_length()),
        BLOCK_N=cfg.block_n1,
        BLOCK_KB=cfg.block_kb,
        ARCH=arch,
        ROUTE=route,
        A_MODE=a_mode,
        OUT_MODE=out_mode,
        HAS_BIAS=config.has_bias,
        LW=lw,
        LE=_route_layout(arch, cfg),
        num_warps=cfg.num_warps,
    )
    a_in, a_scale, a_stride, a_mode2 = _gemm2_input(config, t, inter, out_mode)
    kb_total = i_pad // 2
    split_kb = round_up(-(-kb_total // cfg.split), cfg.block_kb)
    split = -(-kb_total // split_kb)
    partial = torch.empty(split, pairs, h_pad, dtype=torch.float32, device=x.device)
    tiny_gemm2_kernel[(h_pad // cfg.block_n2, split, pairs)](
        a_in,
        a_scale,
        topk_weights,
        topk_ids,
        t["w2"],
        t["w2_scale"],
        t["w2_bias"],
        partial,
        a_stride,
        kb_total,
        h_pad,
        split_kb,
        pairs,
        BLOCK_N=cfg.block_n2,
        BLOCK_KB=cfg.block_kb,
        ARCH=arch,
        A_MODE=a_mode2,
        HAS_BIAS=config.has_bias,
        LW=lw,
        num_warps=cfg.num_warps,
    )
    out.copy_(partial.view(split, M, k, h_pad).sum(dim=(0, 2))[:, :H])


def _route_layout(arch, cfg):
    from triton.experimental.gluon import language as gl

    from ._common import warp_size

    return gl.BlockedLayout([1], [warp_size(arch)], [cfg.num_warps], [0])
