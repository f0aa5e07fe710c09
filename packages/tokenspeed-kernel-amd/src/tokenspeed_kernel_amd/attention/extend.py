"""Chunked prefill over the paged KV cache (GQA, sinks, sliding window, bf16/fp16/FP8 KV) in
Gluon for CDNA.

The n new tokens of a sequence are its last n positions (already stored in the cache). Same
row packing and key loop as prefill (`_common.attend`), with keys gathered through the page
table one row at a time (any page size). FP8 caches are converted to the query dtype on the way
into LDS; the key scale folds into the softmax scale and the value scale into the output.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ._common import (
    ARCH_CODES,
    FP8_DTYPE,
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
from .prefill import choose_config


@gluon.jit
def _extend_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    lse_ptr,
    sinks_ptr,
    cu_seqlens_ptr,
    page_table_ptr,
    cache_seqlens_ptr,
    qk_scale,
    v_scale,
    window_left,
    stride_pt,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
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
    HAS_WINDOW: gl.constexpr,
    HAS_SINKS: gl.constexpr,
    HAS_LSE: gl.constexpr,
    BUFFER: gl.constexpr,
    ASYNC: gl.constexpr,
    WIDE: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
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
        # Row i of the n new tokens sits at position kv_len - n + i; keys are causal.
        kv_len = gl.load(cache_seqlens_ptr + seq)
        q_off = kv_len - seq_len
        rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, MMA))
        q_pos = q_off + m_start + rows // H_PACK
        k_hi = gl.minimum(kv_len, q_off + m_start + TOKENS)
        k_lo = 0
        if HAS_WINDOW:
            k_lo = gl.maximum(q_off + m_start - window_left, 0)
        k_smem = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [BLOCK_N, HEAD_DIM], SMEM)
        v_smem = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [BLOCK_N, HEAD_DIM], SMEM)
        acc, m_i, l_i = attend(
            q,
            q_pos,
            k_lo,
            k_hi,
            qk_scale,
            window_left,
            k_ptr,
            v_ptr,
            kvh * stride_kh,
            kvh * stride_vh,
            page_table_ptr + seq.to(gl.int64) * stride_pt,
            stride_kp,
            stride_ks,
            stride_vp,
            stride_vs,
            k_smem,
            v_smem,
            ARCH,
            BLOCK_M,
            BLOCK_N,
            HEAD_DIM,
            INSTR_M,
            NUM_WARPS,
            True,
            PAGE_SIZE,
            True,
            HAS_WINDOW,
            BUFFER,
            ASYNC,
            WIDE,
        )
        # FP8 caches: the key scale is in qk_scale; the value scale multiplies the output.
        acc = acc * v_scale
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


def mha_extend_with_kvcache(
    q,
    k_cache,
    v_cache,
    *,
    cu_seqlens_q,
    page_table,
    cache_seqlens,
    max_seqlen_q,
    window_left=-1,
    sinks=None,
    softmax_scale=None,
    k_scale=1.0,
    v_scale=1.0,
    out=None,
    lse=None,
    arch=None,
    direct_to_lds=None,
):
    """q [T, Hq, D] ragged by cu_seqlens_q [B+1] int32; caches [num_pages, P, Hkv, D]
    (bf16/fp16, or float8_e4m3fn with per-tensor k_scale/v_scale); page_table [B, max_pages]
    int32; cache_seqlens [B] int32 including the new tokens.

    Writes out [T, Hq, D] (bf16 for an FP8 cache unless given) and lse [T, Hq] when given.
    `arch` and `direct_to_lds` as for `mha_prefill`.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    scale = head_dim**-0.5 if softmax_scale is None else float(softmax_scale)
    if out is None:
        dtype = torch.bfloat16 if k_cache.dtype == FP8_DTYPE else q.dtype
        out = torch.empty(q.shape, dtype=dtype, device=q.device)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_tokens == 0 or num_seqs <= 0 or max_seqlen_q <= 0:
        return out
    arch_code, _ = resolve_arch(q.device, arch)
    cfg = choose_config(arch_code, head_dim)
    group = num_q_heads // num_kv_heads
    h_pack = pow2_divisor(group, min(cfg.max_head_pack, cfg.block_m))
    wide = needs_wide_offsets(q, k_cache, v_cache, out, lse, page_table)
    grid = (-(-max_seqlen_q // (cfg.block_m // h_pack)), num_seqs, num_q_heads // h_pack)
    lse_strides = lse.stride() if lse is not None else (0, 0)
    _extend_kernel[grid](
        q, k_cache, v_cache, out, lse if lse is not None else out,
        sinks if sinks is not None else out, cu_seqlens_q, page_table, cache_seqlens,
        scale * float(k_scale) * LOG2E, float(v_scale), window_left, page_table.stride(0),
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        out.stride(0), out.stride(1), *lse_strides,
        ARCH=arch_code, HEAD_DIM=head_dim, GQA=group, H_PACK=h_pack, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, INSTR_M=cfg.instr_m, NUM_WARPS=cfg.num_warps,
        HAS_WINDOW=window_left >= 0, HAS_SINKS=sinks is not None, HAS_LSE=lse is not None,
        BUFFER=arch_code != 0 and not wide,
        ASYNC=direct_copies(direct_to_lds, arch_code, k_cache, v_cache, wide), WIDE=wide,
        PAGE_SIZE=page_size, num_warps=cfg.num_warps,
    )  # fmt: skip
    return out


def aot_specs(arch: str) -> list:
    """GPT-OSS extend (D=64, GQA 8, page 64, sinks; full, sliding, FP8 KV) for `arch`."""
    from ..aot import AotSpec
    from ._common import CODE_GFX942

    code = ARCH_CODES["nvidia" if arch.startswith("sm_") else arch]
    ptrs = (
        "q_ptr",
        "k_ptr",
        "v_ptr",
        "out_ptr",
        "lse_ptr",
        "sinks_ptr",
        "cu_seqlens_ptr",
        "page_table_ptr",
        "cache_seqlens_ptr",
    )
    strides = (
        "stride_qt",
        "stride_qh",
        "stride_kp",
        "stride_ks",
        "stride_kh",
        "stride_vp",
        "stride_vs",
        "stride_vh",
        "stride_ot",
        "stride_oh",
        "stride_lt",
        "stride_lh",
    )
    specs = []
    for head_dim, window, kv in ((64, False, "bf16"), (64, True, "bf16"), (64, True, "fp8e4nv")):
        cfg = choose_config(code, head_dim)
        types = ("*bf16", f"*{kv}", f"*{kv}", "*bf16", "*fp32", "*fp32", "*i32", "*i32", "*i32")
        signature = {
            **dict(zip(ptrs, types, strict=True)),
            "qk_scale": "fp32",
            "v_scale": "fp32",
            "window_left": "i32",
            "stride_pt": "i32",
            **{s: "i32" for s in strides},
        }
        constexprs = dict(
            ARCH=code,
            HEAD_DIM=head_dim,
            GQA=8,
            H_PACK=pow2_divisor(8, cfg.max_head_pack),
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            INSTR_M=cfg.instr_m,
            NUM_WARPS=cfg.num_warps,
            HAS_WINDOW=window,
            HAS_SINKS=True,
            HAS_LSE=True,
            BUFFER=code != 0,
            ASYNC=code != CODE_GFX942 and kv == "bf16",
            WIDE=False,
            PAGE_SIZE=64,
        )
        name = f"extend_d{head_dim}_gqa8_page64{'_window' if window else ''}_{kv}"
        specs.append(
            AotSpec(
                name,
                _extend_kernel,
                signature,
                constexprs,
                cfg.num_warps,
                divisible=(*ptrs[:4], "stride_pt", *strides[:10]),
            )
        )
    return specs
