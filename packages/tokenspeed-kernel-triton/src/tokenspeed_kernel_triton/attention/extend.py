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

from tokenspeed_kernel.registry import ANY

from .._launch import bind_launches
from . import _tile_config, _tiles
from ._common import (
    ATTENTION_TRAITS,
    FP8,
    GPT_OSS_AOT_CASE,
    HALF,
    LOG2E,
    register_attention_kernel,
    supports_dot_and_fp8,
)

KERNEL_NAME = "triton.mha_extend_with_kvcache"


@bind_launches
@triton.jit
def _extend_kernel(
    Q, K, V, Out, Lse, Sinks, CuSeqlensQ, PageTable, CacheSeqlens,
    qk_scale, v_scale, window_left, num_m_blocks, num_tokens, num_pages, max_keys,
    stride_qt, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_lt, stride_pt,
    GROUP: tl.constexpr, HEADS_PER_TILE: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_LSE: tl.constexpr, SPLIT_MASK: tl.constexpr,
):  # fmt: skip
    TOKENS: tl.constexpr = BLOCK_M // HEADS_PER_TILE
    pid_m, head_base, seq = _tiles.tile_program(num_m_blocks, HEADS_PER_TILE, not HAS_WINDOW)
    q_start, n_q = _tiles.sequence_span(CuSeqlensQ, seq, num_tokens)
    t0 = pid_m * TOKENS
    if t0 >= n_q:
        return
    # Keys past the page table do not exist; a negative length is 0 (two integer ops).
    seq_k = tl.minimum(tl.maximum(tl.load(CacheSeqlens + seq), 0), max_keys)
    pos0 = seq_k - n_q  # absolute position of query row 0
    kv_head = head_base // GROUP
    q, _, tile0, local, toks, heads, row_ok, offs_n, offs_d = _tiles.query_tile(
        Q, q_start, t0, head_base, n_q, stride_qt, stride_qh, BLOCK_M, HEADS_PER_TILE, BLOCK_N,
        HEAD_DIM,
    )  # fmt: skip
    page_row = PageTable + seq.to(tl.int64) * stride_pt

    last_row = pos0 + tl.minimum(t0 + TOKENS, n_q) - 1
    bounds = _tiles.key_block_bounds(
        pos0 + t0, last_row, seq_k, window_left, BLOCK_N, True, HAS_WINDOW
    )
    tile = (pos0 + toks, seq_k, window_left, qk_scale, offs_n)
    kh_k = kv_head * stride_kh
    kh_v = kv_head * stride_vh
    keys = (
        K, V, page_row, num_pages, kh_k, kh_v, stride_kp, stride_kt, stride_vp, stride_vt,
        offs_n, offs_d,
    )  # fmt: skip
    acc, l_i, m_i = _tiles.attend_key_ranges(
        q, tile, keys, bounds, BLOCK_M, HEAD_DIM, BLOCK_N, True, HAS_WINDOW, SPLIT_MASK, PAGE_SIZE
    )
    acc, lse = _tiles.attn_finalize(acc, l_i, m_i, Sinks, heads, HAS_SINKS)
    # FP8 caches: p @ v_fp8 used unscaled values; v_scale is linear in the output.
    acc = acc * v_scale
    strides = (stride_ot, stride_oh, stride_lt)
    _tiles.store_rows(Out, Lse, acc, lse, tile0, local, heads, row_ok, offs_d, strides, HAS_LSE)


# ----------------------------------------------------------------------------- launcher

# GPT-OSS-like engines (GQA 8, hd 64, sinks, lse): 64-token pages with and without a window,
# 16-token pages (a block spans several pages on AMD and pre-Hopper tiles), an FP8 cache.
_AOT_CASE = dict(
    GPT_OSS_AOT_CASE, seqlens=(256,), q_lens=(64,), num_q_heads=16, num_kv_heads=2, page_size=64
)
AOT_CASES = (
    _AOT_CASE,
    dict(_AOT_CASE, window_left=127),
    dict(_AOT_CASE, page_size=16),
    dict(_AOT_CASE, kv_dtype=FP8),
)


def mha_extend_with_kvcache(
    q, k_cache, v_cache, *, cu_seqlens_q, page_table, cache_seqlens, max_seqlen_q, window_left,
    sinks, softmax_scale, k_scale, v_scale, out, lse,
):  # fmt: skip
    """Writes `out` (and `lse` unless None) for the new tokens of each sequence.

    q [T, Hq, D] bf16/fp16; k_cache/v_cache [num_pages, P, Hkv, D] (q's dtype or
    float8_e4m3fn); cu_seqlens_q [B+1] int32; page_table [B, max_pages] int32;
    cache_seqlens [B] int32; max_seqlen_q >= every n_b; out [T, Hq, D]; lse [T, Hq] float32.
    Device values are not trusted: cu_seqlens_q as in prefill, cache_seqlens clamped to
    [0, max_pages * P], page ids clamped into [0, num_pages) (memory-safe; that sequence's
    output is then unspecified).
    """
    num_kv_heads = k_cache.shape[2]
    plan = _tile_config.plan_tiles(
        KERNEL_NAME, q, num_kv_heads, cu_seqlens_q, max_seqlen_q, window_left, sinks, lse
    )
    if plan is None:
        return
    grid, num_m_blocks, meta = plan
    _extend_kernel[grid](
        q, k_cache, v_cache, out, out if lse is None else lse, q if sinks is None else sinks,
        cu_seqlens_q, page_table, cache_seqlens,
        softmax_scale * k_scale * LOG2E.value, v_scale, window_left, num_m_blocks, q.shape[0],
        k_cache.shape[0], page_table.shape[1] * k_cache.shape[1],
        *q.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3], *out.stride()[:2],
        0 if lse is None else lse.stride(0), page_table.stride(0),
        PAGE_SIZE=k_cache.shape[1], **meta,
    )  # fmt: skip


def register() -> None:
    traits = dict(ATTENTION_TRAITS, kv_dtype=(*HALF, FP8), page_size=ANY)
    description = "paged chunked prefill; per-token page gather (any page size), FP8 KV"
    register_attention_kernel(
        mha_extend_with_kvcache, KERNEL_NAME, traits, supports_dot_and_fp8, description, AOT_CASES
    )
