"""Chunked prefill over a paged KV cache ("NHD" pages [num_pages, P, Hkv, D]).

The n_b query rows of sequence b sit at positions cache_seqlens[b]-n_b .. cache_seqlens[b]-1;
keys come from the cache, token p at page_table[b, p // P] * P + p % P. When a key block fits
in a page (P a multiple of BLOCK_N) one page id serves the block; otherwise every key's address
is computed per token, so any page size works (page size 1 included). FP8 (e4m3) caches are
converted to the query dtype in registers; k_scale folds into the logit scale and v_scale into
the final normalization.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tokenspeed_kernel.registry import ANY, register_kernel

from ._common import (
    FP8,
    HALF,
    LOG2E,
    attend_key_ranges,
    attention_platforms,
    attn_finalize,
    key_block_bounds,
    load_q_tile,
    packed_rows,
    plan_tiles,
    store_rows,
    supports_dot_and_fp8,
)

KERNEL_NAME = "triton.mha_extend_with_kvcache"
HEAD_DIMS = (64, 128)


@triton.jit
def _extend_kernel(
    Q,
    K,
    V,
    Out,
    Lse,
    Sinks,
    CuSeqlensQ,
    PageTable,
    CacheSeqlens,
    qk_scale,
    v_scale,
    window_left,
    num_m_blocks,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_vp,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_pt,
    GROUP: tl.constexpr,
    HEADS_PER_TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_LSE: tl.constexpr,
    SPLIT_MASK: tl.constexpr,
):
    TOKENS: tl.constexpr = BLOCK_M // HEADS_PER_TILE
    pid_m = tl.program_id(0)
    head_base = tl.program_id(1) * HEADS_PER_TILE
    seq = tl.program_id(2)
    if not HAS_WINDOW:
        # Later query blocks see more keys: launch them first for load balance.
        pid_m = num_m_blocks - 1 - pid_m
    q_start = tl.load(CuSeqlensQ + seq)
    n_q = tl.load(CuSeqlensQ + seq + 1) - q_start
    t0 = pid_m * TOKENS
    if t0 >= n_q:
        return
    seq_k = tl.load(CacheSeqlens + seq)
    pos0 = seq_k - n_q  # absolute position of query row 0
    kv_head = head_base // GROUP
    tok0 = q_start.to(tl.int64)
    toks, heads = packed_rows(t0, head_base, BLOCK_M, HEADS_PER_TILE)
    row_ok = toks < n_q
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    tile0 = tok0 + t0  # int64 first token of the tile; in-tile offsets stay 32-bit
    local = toks - t0
    q = load_q_tile(Q, tile0, local, heads, row_ok, offs_d, stride_qt, stride_qh)
    page_row = PageTable + seq.to(tl.int64) * stride_pt

    last_row = pos0 + tl.minimum(t0 + TOKENS, n_q) - 1
    lo, full_lo, full_hi, hi = key_block_bounds(
        pos0 + t0, last_row, seq_k, window_left, BLOCK_N, True, HAS_WINDOW
    )
    rows = pos0 + toks
    kh_k = kv_head * stride_kh
    kh_v = kv_head * stride_vh
    acc, l_i, m_i = attend_key_ranges(
        q,
        (rows, seq_k, window_left, qk_scale, offs_n),
        (K, V, page_row, kh_k, kh_v, stride_kp, stride_kt, stride_vp, stride_vt, offs_n, offs_d),
        lo,
        full_lo,
        full_hi,
        hi,
        BLOCK_M,
        HEAD_DIM,
        BLOCK_N,
        True,
        HAS_WINDOW,
        SPLIT_MASK,
        PAGE_SIZE,
    )
    acc, lse = attn_finalize(acc, l_i, m_i, Sinks, heads, HAS_SINKS)
    # FP8 caches: p @ v_fp8 used unscaled values; v_scale is linear in the output.
    acc = acc * v_scale
    strides = (stride_ot, stride_oh, stride_lt)
    store_rows(Out, Lse, acc, lse, tile0, local, heads, row_ok, offs_d, strides, HAS_LSE)


# ----------------------------------------------------------------------------- launcher

# GPT-OSS-like engines (GQA 8, hd 64, sinks, lse): 64-token pages with and without a window,
# 16-token pages (a block spans several pages on AMD and pre-Hopper tiles), an FP8 cache.
_AOT_CASE = dict(
    seqlens=(256,),
    q_lens=(64,),
    num_q_heads=16,
    num_kv_heads=2,
    head_dim=64,
    page_size=64,
    sinks=0.0,
    lse=True,
)
AOT_CASES = (
    _AOT_CASE,
    dict(_AOT_CASE, window_left=127),
    dict(_AOT_CASE, page_size=16),
    dict(_AOT_CASE, kv_dtype=FP8),
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
    window_left,
    sinks,
    softmax_scale,
    k_scale,
    v_scale,
    out,
    lse,
):
    """Writes `out` (and `lse` unless None) for the new tokens of each sequence.

    q [T, Hq, D] bf16/fp16; k_cache/v_cache [num_pages, P, Hkv, D] (q's dtype or
    float8_e4m3fn); cu_seqlens_q [B+1] int32; page_table [B, max_pages] int32;
    cache_seqlens [B] int32; max_seqlen_q >= every n_b; out [T, Hq, D]; lse [T, Hq] float32.
    """
    num_seqs = cu_seqlens_q.shape[0] - 1
    if q.shape[0] == 0 or num_seqs == 0 or max_seqlen_q == 0:
        return
    grid, num_m_blocks, meta = plan_tiles(
        KERNEL_NAME, q, k_cache.shape[2], num_seqs, max_seqlen_q, window_left, sinks, lse
    )
    _extend_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        out if lse is None else lse,
        q if sinks is None else sinks,
        cu_seqlens_q,
        page_table,
        cache_seqlens,
        softmax_scale * k_scale * LOG2E.value,
        v_scale,
        window_left,
        num_m_blocks,
        *q.stride()[:2],
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        *out.stride()[:2],
        0 if lse is None else lse.stride(0),
        page_table.stride(0),
        PAGE_SIZE=k_cache.shape[1],
        **meta,
    )


def register() -> None:
    register_kernel(
        "mha_extend_with_kvcache",
        name=KERNEL_NAME,
        backend="triton",
        platforms=attention_platforms(),
        traits=dict(
            dtype=HALF,
            kv_dtype=(*HALF, FP8),
            head_dim=HEAD_DIMS,
            gqa_ratio=ANY,
            page_size=ANY,
            window=True,
            sinks=True,
            lse=True,
        ),
        priority=100,
        supports=supports_dot_and_fp8,
        description="paged chunked prefill; per-token page gather (any page size), FP8 KV",
        aot_cases=AOT_CASES,
    )(mha_extend_with_kvcache)
