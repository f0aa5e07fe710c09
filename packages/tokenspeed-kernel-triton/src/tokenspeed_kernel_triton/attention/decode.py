"""Paged decode attention with a split-KV grid (`mha_decode_with_kvcache`).

One program owns one (sequence, KV head, split) and processes every query head of that KV head
for all Q new tokens at once: the GROUP = Hq / Hkv heads x Q tokens form the M dimension of
`tl.dot` (padded to 16 rows), so each K/V tile is read from memory once for the whole group and
the tensor cores (mma on sm_80/sm_90, mfma on CDNA) do the math. Decode is memory-bound: the
floor is the bytes of the visible K and V over the copy bandwidth.

Phase 1 (this module) splits each sequence's visible key range into NUM_SPLITS contiguous
chunks of whole key blocks and writes per split the normalized partial output and its
log-sum-exp. Phase 2 (`decode_reduce.py`) merges the splits and adds the sink exactly once. With
a single split, phase 1 finalizes directly (sink, lse) and phase 2 is skipped.

Scores live in the log2 domain (qk_scale = softmax_scale * k_scale * log2 e) so the
exponentials are exp2; an FP8 cache's k_scale folds into that scale and v_scale into the output.
The launch reads no device value on the host (CUDA-graph safe): the split count comes from the
shapes (batch, KV heads, page-table width or window) and the SM count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenspeed_kernel.platform import platform_of
from tokenspeed_kernel.tuning import pinned_config

from .._launch import bind_launches
from ._common import (
    ATTENTION_TRAITS,
    FP8,
    GPT_OSS_AOT_CASE,
    HALF,
    LN2,
    LOG2E,
    merge_sink,
    register_attention_kernel,
    supports_dot_and_fp8,
)
from ._fixup import (
    FLAG_CHUNK,
    any_flag,
    clear_flags,
    current_stream,
    fixup_programs,
    flag_nonfinite,
    flag_span,
    tile_flags,
)
from .decode_config import plan_decode
from .decode_reduce import decode_reduce

KERNEL_NAME = "triton.mha_decode_with_kvcache"
PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_Q_LEN = 64


@triton.jit
def _block_pages(
    PageRow,
    stride_ptp,
    start_n,
    cols,
    col_ok,
    num_pages,
    PAGE_SIZE: tl.constexpr,
    BLOCK_IN_PAGE: tl.constexpr,
):
    """Physical page of each key (int64, so page * stride never overflows). A page id outside
    [0, num_pages) is clamped into it, so no load leaves the cache (the keys read are another
    page's: the contract's unspecified outcome for a bad id). Cost: an integer min and max."""
    if BLOCK_IN_PAGE:
        # The whole block lies in one page: one page-table read for the block.
        page = tl.load(PageRow + (start_n // PAGE_SIZE) * stride_ptp).to(tl.int64)
    else:
        page = tl.load(PageRow + (cols // PAGE_SIZE) * stride_ptp, mask=col_ok, other=0)
        page = page.to(tl.int64)
    return tl.minimum(tl.maximum(page, 0), num_pages - 1)


@triton.jit
def _load_block(
    Cache, page, cols, col_ok, offs_d, stride_page, stride_slot, PAGE_SIZE: tl.constexpr
):
    """[BLOCK_N, D] tile of one KV head (Cache already points at the head); masked rows are 0."""
    slot = page * stride_page + (cols % PAGE_SIZE) * stride_slot
    return tl.load(Cache + slot[:, None] + offs_d[None, :], mask=col_ok[:, None], other=0.0)


@triton.jit
def _visible(cols, col_ok, pos, window_left, HAS_WINDOW: tl.constexpr):
    """[rows, keys]: causality (among the Q tokens and against the cache end) and the window."""
    visible = (cols[None, :] <= pos[:, None]) & col_ok[None, :]
    if HAS_WINDOW:
        visible = visible & (cols[None, :] >= pos[:, None] - window_left)
    return visible


@triton.jit
def _attend_block(
    acc, l_i, m_i, q, k, v, cols, col_ok, pos, qk_scale, window_left, HAS_WINDOW: tl.constexpr
):
    """One key block of online softmax (log2 domain) for every row of the tile."""
    s = tl.dot(q, tl.trans(k.to(q.dtype))) * qk_scale
    s = tl.where(_visible(cols, col_ok, pos, window_left, HAS_WINDOW), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no key yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def _store_final(
    Out,
    Lse,
    Sinks,
    acc,
    l_i,
    m_i,
    v_scale,
    b,
    tok,
    head,
    row_ok,
    offs_d,
    out_strides,
    lse_strides,
    HAS_SINKS: tl.constexpr,
    HAS_LSE: tl.constexpr,
):
    """Single-split path: add the sink (once: there is no other split), normalize, store."""
    stride_ob, stride_ot, stride_oh = out_strides
    stride_lb, stride_lt, stride_lh = lse_strides
    if HAS_SINKS:
        sink = tl.load(Sinks + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
        m_i, alpha, l_i = merge_sink(m_i, l_i, sink)
        acc = acc * alpha[:, None]
    # l = 0 only for a query that sees nothing and has no sink (or a -inf one): zeros.
    o = acc * (v_scale / tl.where(l_i == 0.0, 1.0, l_i))[:, None]
    o_ptrs = Out + b * stride_ob + tok[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(o_ptrs + offs_d[None, :], o.to(Out.dtype.element_ty), mask=row_ok[:, None])
    if HAS_LSE:
        lse = (m_i + tl.math.log2(l_i)) * LN2
        tl.store(Lse + b * stride_lb + tok * stride_lt + head * stride_lh, lse, mask=row_ok)


@triton.jit
def _attend_split(
    q, keys, start, end, lo, pos, qk_scale, window_left,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_IN_PAGE: tl.constexpr, HAS_WINDOW: tl.constexpr,
    EXACT: tl.constexpr,
):  # fmt: skip
    """(acc, l, m) of the tile over the key blocks [start, end). EXACT (the fix-up's path,
    `_fixup.py`): a key masked for a row contributes nothing to it whatever its V, and a row
    that sees a V row holding a NaN or inf gets NaN (the reference's outcome): such V rows are
    zeroed for the dot (0 * NaN would reach the rows that mask the key) and the rows that see
    them set to NaN."""
    PageRow, stride_ptp, num_pages, KHead, VHead, stride_kp, stride_ks, stride_vp, stride_vs = keys
    offs_d = tl.arange(0, HEAD_DIM)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    poisoned = tl.zeros([BLOCK_M], tl.int32)
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        # Keys left of the window are not loaded: engines may have freed (and reused) their
        # pages, so neither their page ids nor their contents can be trusted.
        col_ok = (cols >= lo) & (cols < end)
        page = _block_pages(
            PageRow, stride_ptp, start_n, cols, col_ok, num_pages, PAGE_SIZE, BLOCK_IN_PAGE
        )
        k = _load_block(KHead, page, cols, col_ok, offs_d, stride_kp, stride_ks, PAGE_SIZE)
        v = _load_block(VHead, page, cols, col_ok, offs_d, stride_vp, stride_vs, PAGE_SIZE)
        if EXACT:
            v = v.to(q.dtype)
            bad_key = tl.max(tl.where(tl.abs(v.to(tl.float32)) < float("inf"), 0, 1), 1)
            visible = _visible(cols, col_ok, pos, window_left, HAS_WINDOW)
            poisoned = tl.maximum(poisoned, tl.max(tl.where(visible, bad_key[None, :], 0), 1))
            v = tl.where(bad_key[:, None] > 0, 0.0, v)
        acc, l_i, m_i = _attend_block(
            acc, l_i, m_i, q, k, v, cols, col_ok, pos, qk_scale, window_left, HAS_WINDOW
        )
    if EXACT:
        acc = tl.where(poisoned[:, None] > 0, float("nan"), acc)
    return acc, l_i, m_i


# fmt: off
@triton.jit
def _decode_tile(
    pid_bhm, split, Q, K, V, PageTable, SeqLens, Sinks, Out, Lse, MidO, MidLse, Flag,
    qk_scale, v_scale, window_left, num_kv_heads, stride_sb, num_pages, max_keys,
    stride_qb, stride_qt, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_ptb, stride_ptp,
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lt, stride_lh,
    Q_LEN: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_LSE: tl.constexpr, BLOCK_IN_PAGE: tl.constexpr, KV_FP8: tl.constexpr,
    Q_PRESCALE: tl.constexpr, EXACT: tl.constexpr,
):
    """Computes and stores split `split` of the tile pid_bhm (its partials, or the final rows
    with one split). The fast path (not EXACT) with Q > 1 also sets *Flag when its
    accumulator holds a NaN or inf (`_fixup.py`); EXACT recomputes it with the reference's
    outcome. Q = 1 never loads a key its rows mask (lo and end are that row's bounds)."""
    num_m_tiles: tl.constexpr = (Q_LEN * GROUP + BLOCK_M - 1) // BLOCK_M
    m_tile = pid_bhm % num_m_tiles
    bh = pid_bhm // num_m_tiles
    kv_head = bh % num_kv_heads
    b = bh // num_kv_heads
    # Row r of the tile is token r // GROUP and query head kv_head * GROUP + r % GROUP.
    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < Q_LEN * GROUP
    tok = offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = Q + b * stride_qb + tok[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_ptrs + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    if KV_FP8:
        # e4m3 -> fp16 is one instruction per pair, e4m3 -> bf16 three (via fp16): run both
        # dots in fp16, which holds every e4m3 value and p in [0, 1] exactly or better than
        # bf16. Q_PRESCALE (2^-8 for bf16 q, undone in qk_scale) keeps |q| up to 1.7e7 finite.
        q = (q.to(tl.float32) * Q_PRESCALE).to(tl.float16)

    # Keys past the page table do not exist; a negative length is 0 (two integer ops).
    seqlen = tl.minimum(tl.maximum(tl.load(SeqLens + b * stride_sb), 0), max_keys)
    pos = seqlen - Q_LEN + tok  # absolute position of each row (negative: sees nothing)
    first_tok = (m_tile * BLOCK_M) // GROUP
    last_tok = (tl.minimum(m_tile * BLOCK_M + BLOCK_M, Q_LEN * GROUP) - 1) // GROUP
    hi = tl.maximum(seqlen - Q_LEN + last_tok + 1, 0)
    lo = 0
    if HAS_WINDOW:
        # The window bounds the first visible key: blocks before it are never visited.
        lo = tl.minimum(tl.maximum(seqlen - Q_LEN + first_tok - window_left, 0), hi)
    lo_block = lo // BLOCK_N * BLOCK_N
    blocks_per_split = tl.cdiv(tl.cdiv(hi - lo_block, BLOCK_N), NUM_SPLITS)
    start = lo_block + split * blocks_per_split * BLOCK_N
    end = tl.minimum(start + blocks_per_split * BLOCK_N, hi)

    keys = (PageTable + b * stride_ptb, stride_ptp, num_pages, K + kv_head * stride_kh,
            V + kv_head * stride_vh, stride_kp, stride_ks, stride_vp, stride_vs)
    acc, l_i, m_i = _attend_split(q, keys, start, end, lo, pos, qk_scale, window_left, BLOCK_M,
                                  HEAD_DIM, BLOCK_N, PAGE_SIZE, BLOCK_IN_PAGE, HAS_WINDOW, EXACT)
    if Q_LEN > 1 and not EXACT:
        flag_nonfinite(Flag, acc, row_ok)

    if NUM_SPLITS == 1:
        _store_final(Out, Lse, Sinks, acc, l_i, m_i, v_scale, b, tok, head, row_ok, offs_d,
                     (stride_ob, stride_ot, stride_oh), (stride_lb, stride_lt, stride_lh),
                     HAS_SINKS, HAS_LSE)
    else:
        # Partial of this split: normalized output and its lse (log2), -inf when empty.
        o = acc * (v_scale / tl.where(l_i == 0.0, 1.0, l_i))[:, None]
        row = (b * Q_LEN + tok) * (num_kv_heads * GROUP) + head
        mid_ptrs = MidO + (row[:, None] * NUM_SPLITS + split) * HEAD_DIM + offs_d[None, :]
        tl.store(mid_ptrs, o, mask=row_ok[:, None])
        tl.store(MidLse + row * NUM_SPLITS + split, m_i + tl.math.log2(l_i), mask=row_ok)


@bind_launches
@triton.jit
def _decode_split_kernel(
    Q, K, V, PageTable, SeqLens, Sinks, Out, Lse, MidO, MidLse, Flags,
    qk_scale, v_scale, window_left, num_kv_heads, stride_sb, num_pages, max_keys, num_bhm,
    stride_qb, stride_qt, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_ptb, stride_ptp,
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lt, stride_lh,
    Q_LEN: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_LSE: tl.constexpr, BLOCK_IN_PAGE: tl.constexpr, KV_FP8: tl.constexpr,
    Q_PRESCALE: tl.constexpr, FIXUP: tl.constexpr, FLAG_CHUNK: tl.constexpr,
):
    """FIXUP=False: one (sequence, KV head, row tile) x split per program, grid (num_bhm,
    NUM_SPLITS); with Q > 1 the flag it may set is Flags[pid_bhm + num_bhm * split]. FIXUP=True
    (Q > 1 only): persistent programs recompute the flagged ones exactly and clear their flags
    (`_fixup.py`)."""
    if FIXUP:
        lo, hi = flag_span(num_bhm * NUM_SPLITS)
        for c0 in range(lo, hi, FLAG_CHUNK):
            if any_flag(Flags, c0, hi, FLAG_CHUNK):
                for i in range(c0, tl.minimum(c0 + FLAG_CHUNK, hi)):
                    if tl.load(Flags + i) != 0:
                        _decode_tile(
                            i % num_bhm, i // num_bhm, Q, K, V, PageTable, SeqLens, Sinks,
                            Out, Lse, MidO, MidLse, Flags, qk_scale, v_scale, window_left,
                            num_kv_heads, stride_sb, num_pages, max_keys, stride_qb, stride_qt,
                            stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
                            stride_vh, stride_ptb, stride_ptp, stride_ob, stride_ot, stride_oh,
                            stride_lb, stride_lt, stride_lh, Q_LEN, GROUP, HEAD_DIM, PAGE_SIZE,
                            BLOCK_M, BLOCK_N, NUM_SPLITS, HAS_WINDOW, HAS_SINKS, HAS_LSE,
                            BLOCK_IN_PAGE, KV_FP8, Q_PRESCALE, True,
                        )
                clear_flags(Flags, c0, hi, FLAG_CHUNK)
    else:
        pid_bhm = tl.program_id(0)
        split = tl.program_id(1)
        _decode_tile(
            pid_bhm, split, Q, K, V, PageTable, SeqLens, Sinks, Out, Lse, MidO, MidLse,
            Flags + pid_bhm + num_bhm * split, qk_scale, v_scale, window_left, num_kv_heads,
            stride_sb, num_pages, max_keys, stride_qb, stride_qt, stride_qh, stride_kp,
            stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_ptb, stride_ptp,
            stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, stride_lh, Q_LEN, GROUP,
            HEAD_DIM, PAGE_SIZE, BLOCK_M, BLOCK_N, NUM_SPLITS, HAS_WINDOW, HAS_SINKS, HAS_LSE,
            BLOCK_IN_PAGE, KV_FP8, Q_PRESCALE, False,
        )


# fmt: on


# ----------------------------------------------------------------------------- launch

_scratch: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _split_scratch(device: torch.device, rows: int, splits: int, head_dim: int):
    """Partial outputs [rows, splits, D] and lses [rows, splits] float32, kept per device, stream
    and shape: no allocation on the hot path, and a captured CUDA graph keeps valid buffers."""
    key = (device, current_stream(device), rows, splits, head_dim)
    buffers = _scratch.get(key)
    if buffers is None:
        buffers = (
            torch.empty((rows, splits, head_dim), dtype=torch.float32, device=device),
            torch.empty((rows, splits), dtype=torch.float32, device=device),
        )
        _scratch[key] = buffers
    return buffers


def mha_decode_with_kvcache(
    q, k_cache, v_cache, *, page_table, cache_seqlens, window_left, sinks, softmax_scale, k_scale,
    v_scale, out, lse,
):  # fmt: skip
    """Decode attention over a paged cache (normalized arguments of the public op).

    q [B, Q, Hq, D]; k_cache/v_cache [num_pages, P, Hkv, D] (bf16/fp16, or float8_e4m3fn with
    per-tensor k_scale/v_scale); page_table [B, max_pages] int32; cache_seqlens [B] int32;
    sinks [Hq] or None; out [B, Q, Hq, D]; lse [B, Q, Hq] float32 or None. Device values are
    not trusted: cache_seqlens is clamped to [0, max_pages * P] and page ids are clamped into
    [0, num_pages) (memory-safe; that sequence's output is then unspecified).
    """
    batch, q_len, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    if batch == 0:
        return
    config, block_m, splits = plan_decode(
        platform_of(q.device),
        k_cache.element_size(),
        batch,
        q_len,
        num_q_heads,
        num_kv_heads,
        head_dim,
        page_size,
        page_table.shape[1],
        window_left,
        pinned_config(KERNEL_NAME),
    )
    group = num_q_heads // num_kv_heads
    m_tiles = -(-q_len * group // block_m)
    if splits > 1:
        mid_o, mid_lse = _split_scratch(q.device, batch * q_len * num_q_heads, splits, head_dim)
    else:
        mid_o = mid_lse = out  # unused: the kernel finalizes in place
    lse_t = lse if lse is not None else out
    lse_strides = lse.stride() if lse is not None else (0, 0, 0)
    grid = (batch * num_kv_heads * m_tiles, splits)
    # Q > 1: a tile's rows see and mask the same keys, so the fix-up runs (`_fixup.py`).
    num_flags = grid[0] * splits
    flags = tile_flags(q.device, num_flags) if q_len > 1 else q
    if q_len > 1 and splits == 1 and out.data_ptr() == q.data_ptr():
        q = q.clone()  # the fix-up reads q after the fast launch wrote out
    kv_fp8 = k_cache.dtype == FP8
    q_prescale = 2.0**-8 if kv_fp8 and q.dtype == torch.bfloat16 else 1.0
    # fmt: off
    args = (
        q, k_cache, v_cache, page_table, cache_seqlens, sinks if sinks is not None else q,
        out, lse_t, mid_o, mid_lse, flags,
        softmax_scale * k_scale * LOG2E.value / q_prescale, v_scale, window_left, num_kv_heads,
        cache_seqlens.stride(0), k_cache.shape[0], page_table.shape[1] * page_size, grid[0],
        *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], *page_table.stride(),
        *out.stride()[:3], *lse_strides,
    )
    meta = dict(
        Q_LEN=q_len, GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size, BLOCK_M=block_m,
        BLOCK_N=config.block_n, NUM_SPLITS=splits, HAS_WINDOW=window_left >= 0,
        HAS_SINKS=sinks is not None, HAS_LSE=lse is not None,
        BLOCK_IN_PAGE=page_size % config.block_n == 0, KV_FP8=kv_fp8, Q_PRESCALE=q_prescale,
        FLAG_CHUNK=FLAG_CHUNK, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    # fmt: on
    _decode_split_kernel[grid](*args, FIXUP=False, **meta)
    if q_len > 1:
        _decode_split_kernel[(fixup_programs(q.device, num_flags),)](*args, FIXUP=True, **meta)
    if splits > 1:
        decode_reduce(mid_o, mid_lse, sinks, out, lse, batch, q_len, num_q_heads, head_dim, splits)


# GPT-OSS-like decode (GQA 8, one new token, sinks, lse) at the split counts the heuristic picks
# on every target for these lengths: 64 sequences fill the device unsplit (page 64; page 16 with
# a window); one sequence of 960 keys splits 16 ways (and runs the reduce), of 192 keys over an
# FP8 cache 4 ways, of 448 keys at hd 128 in pages of one token 8 ways; 4 new tokens over 960
# keys (speculative decoding) also compile the fix-up launch.
_AOT_CASE = dict(
    GPT_OSS_AOT_CASE, seqlens=(64,) * 64, q_lens=(1,), num_q_heads=64, num_kv_heads=8, page_size=64
)
_ONE_SEQUENCE = dict(_AOT_CASE, num_q_heads=16, num_kv_heads=2)
AOT_CASES = (
    _AOT_CASE,
    dict(_AOT_CASE, page_size=16, window_left=127),
    dict(_ONE_SEQUENCE, seqlens=(960,)),
    dict(_ONE_SEQUENCE, seqlens=(192,), kv_dtype=FP8),
    dict(_ONE_SEQUENCE, seqlens=(448,), head_dim=128, page_size=1),
    dict(_ONE_SEQUENCE, seqlens=(960,), q_lens=(4,)),
)


def register() -> None:
    traits = dict(
        ATTENTION_TRAITS, kv_dtype=(*HALF, FP8), page_size=PAGE_SIZES, q_len=range(1, MAX_Q_LEN + 1)
    )
    description = (
        "split-KV paged decode; GQA heads x Q tokens share each K/V tile (tl.dot), "
        "window-bounded splits, sink added once in the reduce, FP8 KV"
    )
    register_attention_kernel(
        mha_decode_with_kvcache, KERNEL_NAME, traits, supports_dot_and_fp8, description, AOT_CASES
    )
