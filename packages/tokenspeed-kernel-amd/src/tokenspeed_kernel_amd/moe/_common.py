"""Shared pieces of the AMD MoE kernels: one body per kernel, silicon chosen by constexpr.

Every kernel takes `ARCH` ("gfx942", "gfx950" or "nvidia") and the layouts built on the host by
`gemm_layouts`/`gemv_layouts`. Only three things depend on it: the matrix instruction and its
layouts (MFMA on CDNA, `mma_v2` on NVIDIA, which is how the same source is tested on an H100),
buffer loads (CDNA: a scalar base plus 32-bit offsets, no 64-bit address math per element), and
the gfx950 scaled MFMA, which consumes the very byte/scale tiles the dequantizing path decodes.

Host-side helpers here (padding, routing, grouping pairs by expert) are plain torch ops that
never read device values back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.amd import cdna3, cdna4
from triton.experimental.gluon.language.amd._layouts import AMDMFMALayout
from triton.experimental.gluon.language.nvidia import ampere

FP8_MAX = 448.0
# The reference's dynamic-scale floor (amax clamps here before dividing by 448).
AMAX_FLOOR = 1e-12
# H and I are padded to this: one GEMM K step (128 elements = 64 packed bytes = 4 scales), so the
# K loops run without masks; 2880 -> 2944.
PAD = 128


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


# Activation operand modes (A_MODE) of both kernels.
A_BF16 = 0  # bf16 as stored
A_QUANT = 1  # float (bf16 x / fp32 intermediate) quantized to fp8 on load with per-row scales
A_FP8 = 2  # fp8 codes as stored (GEMM1 wrote them with the static scale)
A_SPLIT = 3  # float32 intermediate of the bf16 path, multiplied as bf16 hi + lo
# GEMM1 output modes (OUT_MODE).
OUT_FP8 = 1  # static per-tensor scale: requantized in the epilogue
OUT_F32 = 2  # bf16 path, and dynamic fp8 (the row amax is known only after every N tile)
# block_expert of the blocks holding pairs whose id is outside [0, E) (group_by_expert).
DROPPED_BLOCK = -2


# ----------------------------------------------------------------------------------------------
# Host layouts
# ----------------------------------------------------------------------------------------------


def warp_size(arch: str) -> int:
    return 32 if arch == "nvidia" else 64


@dataclass(frozen=True)
class GemmLayouts:
    """Distributed layouts of one grouped-GEMM instantiation (passed as constexprs)."""

    mma: object  # accumulator
    dot_a: object
    dot_b: object
    load_a: object  # [BLOCK_M, K] activation tile
    load_w: object  # [K bytes, BLOCK_N] weight tile, K fastest
    scale_b: object  # [BLOCK_N, BLOCK_K // 32] e8m0 tile for the scaled MFMA (else load_w)


def gemm_layouts(arch: str, block_m: int, block_n: int, num_warps: int, scaled: bool):
    wm = 2 if block_m >= 32 and num_warps >= 4 else 1
    warps = [wm, num_warps // wm]
    tpw = warp_size(arch)
    if arch == "nvidia":
        mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=warps, instr_shape=[16, 8])
        k_width = 2  # 16-bit operands: two per 32-bit register
    elif scaled:
        # 16x16x128 f8f6f4: one instruction consumes a whole 128-element K step.
        mma = AMDMFMALayout(4, [16, 16, 128], True, warps)
        k_width = 16
    elif arch == "gfx950":
        mma = AMDMFMALayout(4, [16, 16, 32], True, warps)  # v_mfma_f32_16x16x32_bf16
        k_width = 8
    else:
        mma = AMDMFMALayout(3, [16, 16, 16], True, warps)  # v_mfma_f32_16x16x16_bf16
        k_width = 4
    dot_a = gl.DotOperandLayout(0, mma, k_width)
    dot_b = gl.DotOperandLayout(1, mma, k_width)
    # Activations: 8 consecutive K elements per thread (16-byte bf16 loads when contiguous).
    load_a = gl.BlockedLayout([1, 8], [tpw // 8, 8], [num_warps, 1], [1, 0])
    # Packed weights: 16 bytes along K per thread (one dwordx4 / buffer_load_dwordx4).
    load_w = gl.BlockedLayout([16, 1], [4, tpw // 4], [1, num_warps], [0, 1])
    scale_b = load_w
    if scaled:
        scale_b = cdna4.get_mfma_scale_layout(dot_b, [block_n, 128 // 32])
    return GemmLayouts(mma, dot_a, dot_b, load_a, load_w, scale_b)


def layout_constexprs(layouts: GemmLayouts) -> dict:
    """The grouped kernels' layout constexprs: each GemmLayouts field, named in capitals."""
    return {field.name.upper(): getattr(layouts, field.name) for field in fields(layouts)}


def gemv_layout(arch: str, num_warps: int):
    """[BLOCK_N, K bytes] weight tile for the tiny-batch GEMVs: 16 bytes along K per thread."""
    tpw = warp_size(arch)
    return gl.BlockedLayout([1, 16], [tpw // 4, 4], [num_warps, 1], [1, 0])


def route_layout(arch: str, num_warps: int):
    """[E_BLOCK] router logits of one token, spread over every lane."""
    return gl.BlockedLayout([1], [warp_size(arch)], [num_warps], [0])


# ----------------------------------------------------------------------------------------------
# Host routing and grouping (torch; no host synchronization)
# ----------------------------------------------------------------------------------------------


def topk_softmax(router_logits: torch.Tensor, top_k: int):
    """router_logits [M, E] -> (topk_weights [M, k] float32, topk_ids [M, k] int32).

    Ties go to the lower expert index (stable descending sort); softmax over the k logits.
    NaN sorts above every number, so ids stay in [0, E) and a token with a NaN pick gets NaN
    weights (the reference's outcome).
    """
    values, ids = torch.sort(router_logits.float(), dim=-1, descending=True, stable=True)
    return torch.softmax(values[:, :top_k], dim=-1), ids[:, :top_k].to(torch.int32)


def group_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Pairs (token, slot) grouped by expert, each expert padded to whole BLOCK_M blocks.

    Returns (rows [num_blocks * BLOCK_M] int32: pair index token*k+slot or -1,
    block_expert [num_blocks] int32: expert of each block, DROPPED_BLOCK for the blocks of
    pairs whose id is outside [0, E), or -1 past the used blocks). Those pairs form one more
    group after the experts': GEMM1 skips it, GEMM2 writes zero rows for it, so they
    contribute nothing and no weights are read for them (the cost: a compare and a select over
    the M*k ids). num_blocks is an upper bound known without reading the ids back to the host.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    pairs = flat.numel()
    device = flat.device
    flat = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    counts = torch.bincount(flat, minlength=num_experts + 1)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    pos = padded_end[expert] - padded[expert] + torch.arange(pairs, device=device) - start[expert]
    num_blocks = min(pairs, (pairs + (num_experts + 1) * (block_m - 1)) // block_m)
    rows = torch.full((num_blocks * block_m,), -1, dtype=torch.int32, device=device)
    rows[pos] = order.to(torch.int32)
    block_start = torch.arange(num_blocks, device=device) * block_m
    group = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)
    dropped_or_past = torch.where(group == num_experts, DROPPED_BLOCK, -1).to(torch.int32)
    return rows, torch.where(group < num_experts, group, dropped_or_past)


# ----------------------------------------------------------------------------------------------
# Device helpers
# ----------------------------------------------------------------------------------------------


@gluon.jit
def load_tile(base, offsets, mask, ARCH: gl.constexpr):
    """Masked load of base[offsets] (int32 offsets); CDNA: buffer_load (bounds in the descriptor,
    one scalar base, no per-element 64-bit address)."""
    if ARCH == "nvidia":
        return gl.load(base + offsets, mask=mask, other=0)
    else:
        return cdna3.buffer_load(base, offsets, mask=mask, other=0)


@gluon.jit
def load_even(base, offsets, ARCH: gl.constexpr):
    """Unmasked load: tiles that never cross the (padded) tensor end."""
    if ARCH == "nvidia":
        return gl.load(base + offsets)
    else:
        return cdna3.buffer_load(base, offsets)


@gluon.jit
def store_tile(base, offsets, value, mask, ARCH: gl.constexpr):
    if ARCH == "nvidia":
        gl.store(base + offsets, value, mask=mask)
    else:
        cdna3.buffer_store(value, base, offsets, mask=mask)


@gluon.jit
def mma(a, b, acc, ARCH: gl.constexpr):
    if ARCH == "nvidia":
        return ampere.mma_v2(a, b, acc)
    else:
        return cdna3.mfma(a, b, acc)


@gluon.jit
def e2m1_to_f32(codes):
    """e2m1 codes (low 4 bits of an int32) -> float32, exactly: sign, 2-bit exponent (bias 1),
    1-bit mantissa rebuilt as float32 bits; exponent 0 is the subnormal 0 / 0.5."""
    mag = codes & 7
    e = mag >> 1
    m = mag & 1
    normal = ((e + 126) << 23) | (m << 22)
    bits = gl.where(e == 0, m * (126 << 23), normal) | ((codes & 8) << 28)
    return bits.to(gl.float32, bitcast=True)


@gluon.jit
def e8m0_to_f32(scales):
    """e8m0 bytes -> float32 2^(s-127): the byte is the float32 exponent field; byte 0 is the
    subnormal 2^-127 and 255 is NaN, as the core format defines them."""
    s = scales.to(gl.int32)
    bits = gl.where(s == 0, 0x400000, s << 23)
    bits = gl.where(s == 255, 0x7FC00000, bits)
    return bits.to(gl.float32, bitcast=True)


@gluon.jit
def dequant_mxfp4(packed, scales, DTYPE: gl.constexpr):
    """packed bytes and their (broadcast) e8m0 scales, same shape -> (even, odd) elements."""
    p = packed.to(gl.int32)
    s = e8m0_to_f32(scales)
    lo = (e2m1_to_f32(p & 15) * s).to(DTYPE)
    hi = (e2m1_to_f32(p >> 4) * s).to(DTYPE)
    return lo, hi


@gluon.jit
def fp8_round(v, scale):
    """v / scale rounded through float8_e4m3fn (saturating at +-448) and returned as the fp8
    code: the reference's quantize_fp8 (true division, clamp, round to nearest even)."""
    q = gl.div_rn(v, scale)
    q = gl.minimum(gl.maximum(q, -448.0), 448.0)
    return q.to(gl.float8e4nv)


@gluon.jit
def swiglu(gate, up, alpha, limit):
    """GPT-OSS clamped SwiGLU: min(g, limit) * sigmoid(alpha g) * (clamp(u, +-limit) + 1)."""
    g = gl.minimum(gate, limit)
    u = gl.minimum(gl.maximum(up, -limit), limit)
    return g / (1.0 + gl.exp(-alpha * g)) * (u + 1.0)


@gluon.jit
def scale_offsets(offs_n, kbyte, S_ROW):
    """Offset of the e8m0 scale of packed byte `kbyte` in weight row `offs_n` (16 bytes per
    scale). The decoding paths take one per byte, the scaled MFMA one per 32 elements: the same
    address math, so the gfx950-only path reads exactly the scales the tested path reads."""
    return offs_n * S_ROW + kbyte // 16
