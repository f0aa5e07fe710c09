"""Ragged causal/non-causal prefill attention (GQA, sinks, sliding window) in Gluon for CDNA.

One program owns BLOCK_M rows = (BLOCK_M / H_PACK) tokens x H_PACK query heads of one KV head,
so each K/V tile staged in LDS serves the whole GQA group. The key loop starts at the window's
first visible key (blocks left of the window are never loaded) and stops at the causal edge.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ._common import (
    CODE_GFX942,
    CODE_GFX950,
    LOG2E,
    add_sink,
    attend,
    direct_copies,
    kv_smem_layout,
    load_q,
    load_sinks,
    mma_layout,
    needs_wide_offsets,
    normalize,
    pow2_divisor,
    resolve_arch,
    store_rows,
)


@gluon.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    lse_ptr,
    sinks_ptr,
    cu_seqlens_ptr,
    qk_scale,
    window_left,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    ARCH: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    GQA: gl.constexpr,
    H_PACK: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    INSTR_M: gl.constexpr,
    NUM_WARPS: gl.constexpr,
    CAUSAL: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    HAS_SINKS: gl.constexpr,
    HAS_LSE: gl.constexpr,
    BUFFER: gl.constexpr,
    ASYNC: gl.constexpr,
    WIDE: gl.constexpr,
):
    TOKENS: gl.constexpr = BLOCK_M // H_PACK
    MMA: gl.constexpr = mma_layout(ARCH, NUM_WARPS, BLOCK_M, INSTR_M)
    SMEM: gl.constexpr = kv_smem_layout(ARCH, BLOCK_N, HEAD_DIM)
    pid_m = gl.program_id(0)
    seq = gl.program_id(1)
    head0 = gl.program_id(2) * H_PACK
    kvh = head0 // GQA
    seq_start = gl.load(cu_seqlens_ptr + seq)
    seq_len = gl.load(cu_seqlens_ptr + seq + 1) - seq_start
    m_start = pid_m * TOKENS
    if m_start < seq_len:
        base = seq_start.to(gl.int64)
        q = load_q(
            q_ptr + base * stride_qt,
            m_start,
            seq_len,
            head0,
            stride_qt,
            stride_qh,
            ARCH,
            BLOCK_M,
            HEAD_DIM,
            H_PACK,
            INSTR_M,
            NUM_WARPS,
            BUFFER,
        )
        rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, MMA))
        q_pos = m_start + rows // H_PACK
        k_hi = seq_len
        if CAUSAL:
            k_hi = gl.minimum(seq_len, m_start + TOKENS)
        k_lo = 0
        if HAS_WINDOW:
            k_lo = gl.maximum(m_start - window_left, 0)
        k_smem = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [BLOCK_N, HEAD_DIM], SMEM)
        v_smem = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [BLOCK_N, HEAD_DIM], SMEM)
        acc, m_i, l_i = attend(
            q,
            q_pos,
            k_lo,
            k_hi,
            qk_scale,
            window_left,
            k_ptr + base * stride_kt,
            v_ptr + base * stride_vt,
            kvh * stride_kh,
            kvh * stride_vh,
            cu_seqlens_ptr,
            stride_kt,
            0,
            stride_vt,
            0,
            k_smem,
            v_smem,
            ARCH,
            BLOCK_M,
            BLOCK_N,
            HEAD_DIM,
            INSTR_M,
            NUM_WARPS,
            False,
            1,
            CAUSAL,
            HAS_WINDOW,
            BUFFER,
            ASYNC,
            WIDE,
        )
        sink = load_sinks(sinks_ptr, head0, HAS_SINKS, BLOCK_M, H_PACK, gl.SliceLayout(1, MMA))
        acc, m_i, l_i = add_sink(acc, m_i, l_i, sink)
        out, lse2 = normalize(acc, m_i, l_i)
        store_rows(
            out_ptr + base * stride_ot,
            lse_ptr + base * stride_lt,
            out,
            lse2,
            m_start,
            seq_len,
            head0,
            stride_ot,
            stride_oh,
            stride_lt,
            stride_lh,
            ARCH,
            BLOCK_M,
            HEAD_DIM,
            H_PACK,
            NUM_WARPS,
            HAS_LSE,
            BUFFER,
        )


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int  # rows per program: tokens x packed heads
    block_n: int  # keys per LDS tile
    num_warps: int
    instr_m: int  # MMA instruction M (32x32 or 16x16 MFMA; 16 for mma_v2)
    max_head_pack: int  # query heads of one GQA group sharing a program


def _configs(arch_code: int, head_dim: int) -> PrefillConfig:
    if arch_code == CODE_GFX950:
        # 160 KiB LDS: 128-key K and V tiles (64 KiB at D=128) fit twice over; 32x32 MFMA keeps
        # the 128-row accumulator at 64 VGPRs per lane for D=128.
        return PrefillConfig(128, 128 if head_dim <= 64 else 64, 4, 32, 16)
    if arch_code == CODE_GFX942:
        # 64 KiB LDS: 64-key tiles (32 KiB for K+V at D=128) leave room for the layout
        # conversions of Q and P; 304 CUs want many programs, so no wider tiles.
        return PrefillConfig(128, 64, 4, 32, 16)
    # NVIDIA (numerics of the shared body): mma_v2 with four 16-row warps.
    return PrefillConfig(64, 64, 4, 16, 8)


_pinned: PrefillConfig | None = None


@contextlib.contextmanager
def use_config(config: PrefillConfig) -> Iterator[PrefillConfig]:
    """Pin the prefill config inside the block (tests, benchmarks)."""
    global _pinned
    previous, _pinned = _pinned, config
    try:
        yield config
    finally:
        _pinned = previous


def choose_config(arch_code: int, head_dim: int) -> PrefillConfig:
    return _pinned if _pinned is not None else _configs(arch_code, head_dim)


def mha_prefill(
    q,
    k,
    v,
    *,
    cu_seqlens,
    max_seqlen,
    causal=True,
    window_left=-1,
    sinks=None,
    softmax_scale=None,
    out=None,
    lse=None,
    arch=None,
    direct_to_lds=None,
):
    """q [T, Hq, D], k/v [T, Hkv, D] (bf16/fp16, D in 64/128); cu_seqlens [B+1] int32.

    Writes out [T, Hq, D] and lse [T, Hq] float32 (natural log, sink included) when given.
    `arch` ("gfx942", "gfx950", "nvidia") defaults to q's device; `direct_to_lds=False`
    stages K/V through registers even where direct-to-LDS copies are possible.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    scale = head_dim**-0.5 if softmax_scale is None else float(softmax_scale)
    out = torch.empty_like(q) if out is None else out
    num_seqs = cu_seqlens.shape[0] - 1
    if num_tokens == 0 or num_seqs <= 0 or max_seqlen <= 0:
        return out
    arch_code, _ = resolve_arch(q.device, arch)
    cfg = choose_config(arch_code, head_dim)
    group = num_q_heads // num_kv_heads
    h_pack = pow2_divisor(group, min(cfg.max_head_pack, cfg.block_m))
    wide = needs_wide_offsets(q, k, v, out, lse)
    grid = (-(-max_seqlen // (cfg.block_m // h_pack)), num_seqs, num_q_heads // h_pack)
    lse_strides = lse.stride() if lse is not None else (0, 0)
    _prefill_kernel[grid](
        q, k, v, out, lse if lse is not None else out, sinks if sinks is not None else out,
        cu_seqlens, scale * LOG2E, window_left,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), *lse_strides,
        ARCH=arch_code, HEAD_DIM=head_dim, GQA=group, H_PACK=h_pack, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, INSTR_M=cfg.instr_m, NUM_WARPS=cfg.num_warps, CAUSAL=causal,
        HAS_WINDOW=window_left >= 0, HAS_SINKS=sinks is not None, HAS_LSE=lse is not None,
        BUFFER=arch_code != 0 and not wide,
        ASYNC=direct_copies(direct_to_lds, arch_code, k, v, wide),
        WIDE=wide, num_warps=cfg.num_warps,
    )  # fmt: skip
    return out


def aot_specs(arch: str) -> list:
    """GPT-OSS prefill (D=64, GQA 8, sinks, full and sliding layers) and D=128, for `arch`."""
    from ..aot import AotSpec
    from ._common import ARCH_CODES

    code = ARCH_CODES["nvidia" if arch.startswith("sm_") else arch]
    ptrs = ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "lse_ptr", "sinks_ptr", "cu_seqlens_ptr")
    strides = (
        "stride_qt",
        "stride_qh",
        "stride_kt",
        "stride_kh",
        "stride_vt",
        "stride_vh",
        "stride_ot",
        "stride_oh",
        "stride_lt",
        "stride_lh",
    )
    specs = []
    for head_dim, window in ((64, False), (64, True), (128, False)):
        cfg = _configs(code, head_dim)
        types = dict(zip(ptrs, ("*bf16",) * 4 + ("*fp32", "*fp32", "*i32"), strict=True))
        signature = {
            **types,
            "qk_scale": "fp32",
            "window_left": "i32",
            **{s: "i32" for s in strides},
        }
        h_pack = pow2_divisor(8, min(cfg.max_head_pack, cfg.block_m))
        constexprs = dict(
            ARCH=code,
            HEAD_DIM=head_dim,
            GQA=8,
            H_PACK=h_pack,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            INSTR_M=cfg.instr_m,
            NUM_WARPS=cfg.num_warps,
            CAUSAL=True,
            HAS_WINDOW=window,
            HAS_SINKS=True,
            HAS_LSE=True,
            BUFFER=code != 0,
            ASYNC=code != CODE_GFX942,
            WIDE=False,
        )
        name = f"prefill_d{head_dim}_gqa8{'_window' if window else ''}"
        specs.append(
            AotSpec(
                name,
                _prefill_kernel,
                signature,
                constexprs,
                cfg.num_warps,
                divisible=(*ptrs[:4], *strides[:8]),
            )
        )
    return specs
