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
from ._fixup import (
    FLAG_CHUNK,
    any_flag,
    clear_flags,
    fixup_programs,
    flag_nonfinite,
    flag_span,
    tile_flags,
)

KERNEL_NAME = "triton.mha_extend_with_kvcache"


@triton.jit
def _extend_tile(
    pid_m, pid_h, seq, Q, K, V, Out, Lse, Sinks, CuSeqlensQ, PageTable, CacheSeqlens, Flag,
    qk_scale, v_scale, window_left, num_m_blocks, num_tokens, num_pages, max_keys,
    stride_qt, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_lt, stride_pt,
    GROUP: tl.constexpr, HEADS_PER_TILE: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_LSE: tl.constexpr, SPLIT_MASK: tl.constexpr,
    EXACT: tl.constexpr,
):  # fmt: skip
    """Computes and stores the tile at grid ids (pid_m, pid_h, seq). The fast path (not EXACT)
    also sets *Flag when its accumulator holds a NaN or inf (`_fixup.py`); EXACT recomputes
    the tile with the reference's outcome."""
    TOKENS: tl.constexpr = BLOCK_M // HEADS_PER_TILE
    pid_m, head_base, seq = _tiles.tile_program(
        pid_m, pid_h, seq, num_m_blocks, HEADS_PER_TILE, not HAS_WINDOW
    )
    q_start, n_q = _tiles.sequence_span(CuSeqlensQ, seq, num_tokens)
    t0 = pid_m * TOKENS
    if t0 < n_q:
        # Keys past the page table do not exist; a negative length is 0 (two integer ops).
        seq_k = tl.minimum(tl.maximum(tl.load(CacheSeqlens + seq), 0), max_keys)
        pos0 = seq_k - n_q  # absolute position of query row 0
        kv_head = head_base // GROUP
        q, _, tile0, local, toks, heads, row_ok, offs_n, offs_d = _tiles.query_tile(
            Q, q_start, t0, head_base, n_q, stride_qt, stride_qh, BLOCK_M, HEADS_PER_TILE,
            BLOCK_N, HEAD_DIM,
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
        if EXACT:
            acc, l_i, m_i = _tiles.attend_exact(
                q, tile, keys, bounds, BLOCK_M, HEAD_DIM, BLOCK_N, True, HAS_WINDOW, PAGE_SIZE
            )
        else:
            acc, l_i, m_i = _tiles.attend_key_ranges(
                q, tile, keys, bounds, BLOCK_M, HEAD_DIM, BLOCK_N, True, HAS_WINDOW, SPLIT_MASK,
                PAGE_SIZE,
            )  # fmt: skip
            flag_nonfinite(Flag, acc, row_ok)
        acc, lse = _tiles.attn_finalize(acc, l_i, m_i, Sinks, heads, HAS_SINKS)
        # FP8 caches: p @ v_fp8 used unscaled values; v_scale is linear in the output.
        acc = acc * v_scale
        strides = (stride_ot, stride_oh, stride_lt)
        _tiles.store_rows(Out, Lse, acc, lse, tile0, local, heads, row_ok, offs_d, strides, HAS_LSE)


@bind_launches
@triton.jit
def _extend_kernel(
    Q, K, V, Out, Lse, Sinks, CuSeqlensQ, PageTable, CacheSeqlens, Flags,
    qk_scale, v_scale, window_left, num_m_blocks, num_head_tiles, num_flags, num_tokens,
    num_pages, max_keys,
    stride_qt, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_lt, stride_pt,
    GROUP: tl.constexpr, HEADS_PER_TILE: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_LSE: tl.constexpr, SPLIT_MASK: tl.constexpr,
    FIXUP: tl.constexpr, FLAG_CHUNK: tl.constexpr,
):  # fmt: skip
    """FIXUP=False: one tile per program (grid (m blocks, head tiles, sequences)), which may
    set Flags[pid_m + num_m_blocks * (pid_h + num_head_tiles * seq)]. FIXUP=True: persistent
    programs recompute the flagged tiles exactly and clear their flags (`_fixup.py`)."""
    if FIXUP:
        lo, hi = flag_span(num_flags)
        for c0 in range(lo, hi, FLAG_CHUNK):
            if any_flag(Flags, c0, hi, FLAG_CHUNK):
                for i in range(c0, tl.minimum(c0 + FLAG_CHUNK, hi)):
                    if tl.load(Flags + i) != 0:
                        _extend_tile(
                            i % num_m_blocks, (i // num_m_blocks) % num_head_tiles,
                            i // (num_m_blocks * num_head_tiles), Q, K, V, Out, Lse, Sinks,
                            CuSeqlensQ, PageTable, CacheSeqlens, Flags, qk_scale, v_scale,
                            window_left, num_m_blocks, num_tokens, num_pages, max_keys,
                            stride_qt, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp,
                            stride_vt, stride_vh, stride_ot, stride_oh, stride_lt, stride_pt,
                            GROUP, HEADS_PER_TILE, HEAD_DIM, PAGE_SIZE, BLOCK_M, BLOCK_N,
                            HAS_WINDOW, HAS_SINKS, HAS_LSE, SPLIT_MASK, True,
                        )  # fmt: skip
                clear_flags(Flags, c0, hi, FLAG_CHUNK)
    else:
        pid_m, pid_h, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        flag = Flags + pid_m + num_m_blocks * (pid_h + num_head_tiles * seq)
        _extend_tile(
            pid_m, pid_h, seq, Q, K, V, Out, Lse, Sinks, CuSeqlensQ, PageTable, CacheSeqlens,
            flag, qk_scale, v_scale, window_left, num_m_blocks, num_tokens, num_pages, max_keys,
            stride_qt, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt,
            stride_vh, stride_ot, stride_oh, stride_lt, stride_pt, GROUP, HEADS_PER_TILE,
            HEAD_DIM, PAGE_SIZE, BLOCK_M, BLOCK_N, HAS_WINDOW, HAS_SINKS, HAS_LSE, SPLIT_MASK,
            False,
        )  # fmt: skip


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
    # Extend is causal: its tiles load keys some of their rows mask, so the fix-up always runs.
    num_flags = grid[0] * grid[1] * grid[2]
    flags = tile_flags(q.device, num_flags)
    if out.data_ptr() == q.data_ptr():
        q = q.clone()  # the fix-up reads q after the fast launch wrote out
    args = (
        q, k_cache, v_cache, out, out if lse is None else lse, q if sinks is None else sinks,
        cu_seqlens_q, page_table, cache_seqlens, flags,
        softmax_scale * k_scale * LOG2E.value, v_scale, window_left, num_m_blocks, grid[1],
        num_flags, q.shape[0], k_cache.shape[0], page_table.shape[1] * k_cache.shape[1],
        *q.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3], *out.stride()[:2],
        0 if lse is None else lse.stride(0), page_table.stride(0),
    )  # fmt: skip
    page_size = k_cache.shape[1]
    _extend_kernel[grid](*args, PAGE_SIZE=page_size, FIXUP=False, FLAG_CHUNK=FLAG_CHUNK, **meta)
    _extend_kernel[(fixup_programs(q.device, num_flags),)](
        *args, PAGE_SIZE=page_size, FIXUP=True, FLAG_CHUNK=FLAG_CHUNK, **meta
    )


def register() -> None:
    traits = dict(ATTENTION_TRAITS, kv_dtype=(*HALF, FP8), page_size=ANY)
    description = "paged chunked prefill; per-token page gather (any page size), FP8 KV"
    register_attention_kernel(
        mha_extend_with_kvcache, KERNEL_NAME, traits, supports_dot_and_fp8, description, AOT_CASES
    )
