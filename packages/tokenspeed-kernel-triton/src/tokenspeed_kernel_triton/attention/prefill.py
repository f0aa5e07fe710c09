"""Ragged (varlen) flash attention for prefill: causal or not, GQA, sliding window, sinks, lse.

One program computes one tile of BLOCK_M query rows of one sequence (BLOCK_M / H tokens of the
H query heads that share a KV head: GQA packing) and walks only the key blocks those rows can
see: causality bounds the end, the window the start (blocks left of the window are never
loaded). The visited range splits into masked edge blocks (the causal diagonal, the window's
left edge, the sequence tail) and an unmasked middle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._launch import bind_launches
from . import _tile_config, _tiles
from ._common import (
    ATTENTION_TRAITS,
    GPT_OSS_AOT_CASE,
    HALF,
    LOG2E,
    interpreter_dot_verdict,
    register_attention_kernel,
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

KERNEL_NAME = "triton.mha_prefill"


@triton.jit
def _prefill_tile(
    pid_m, pid_h, seq, Q, K, V, Out, Lse, Sinks, CuSeqlens, Flag,
    qk_scale, window_left, num_m_blocks, num_tokens,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_lt,
    GROUP: tl.constexpr, HEADS_PER_TILE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_LSE: tl.constexpr, SPLIT_MASK: tl.constexpr,
    EXACT: tl.constexpr,
):  # fmt: skip
    """Computes and stores the tile at grid ids (pid_m, pid_h, seq). The fast path (not EXACT)
    of a causal or windowed launch also sets *Flag when its accumulator holds a NaN or inf
    (`_fixup.py`); EXACT recomputes the tile with the reference's outcome."""
    FLAG: tl.constexpr = (IS_CAUSAL or HAS_WINDOW) and not EXACT
    TOKENS: tl.constexpr = BLOCK_M // HEADS_PER_TILE
    pid_m, head_base, seq = _tiles.tile_program(
        pid_m, pid_h, seq, num_m_blocks, HEADS_PER_TILE, IS_CAUSAL and not HAS_WINDOW
    )
    start, seqlen = _tiles.sequence_span(CuSeqlens, seq, num_tokens)
    t0 = pid_m * TOKENS
    if t0 < seqlen:
        kv_head = head_base // GROUP
        q, tok0, tile0, local, rows, heads, row_ok, offs_n, offs_d = _tiles.query_tile(
            Q, start, t0, head_base, seqlen, stride_qt, stride_qh, BLOCK_M, HEADS_PER_TILE,
            BLOCK_N, HEAD_DIM,
        )  # fmt: skip
        k_base = K + tok0 * stride_kt + kv_head * stride_kh
        v_base = V + tok0 * stride_vt + kv_head * stride_vh

        last_row = tl.minimum(t0 + TOKENS, seqlen) - 1
        bounds = _tiles.key_block_bounds(
            t0, last_row, seqlen, window_left, BLOCK_N, IS_CAUSAL, HAS_WINDOW
        )
        tile = (rows, seqlen, window_left, qk_scale, offs_n)
        keys = (k_base, v_base, stride_kt, stride_vt, offs_n, offs_d)
        if EXACT:
            acc, l_i, m_i = _tiles.attend_exact(
                q, tile, keys, bounds, BLOCK_M, HEAD_DIM, BLOCK_N, IS_CAUSAL, HAS_WINDOW, 0
            )
        else:
            acc, l_i, m_i = _tiles.attend_key_ranges(
                q, tile, keys, bounds, BLOCK_M, HEAD_DIM, BLOCK_N, IS_CAUSAL, HAS_WINDOW,
                SPLIT_MASK, 0,
            )  # fmt: skip
        if FLAG:
            flag_nonfinite(Flag, acc, row_ok)
        acc, lse = _tiles.attn_finalize(acc, l_i, m_i, Sinks, heads, HAS_SINKS)
        strides = (stride_ot, stride_oh, stride_lt)
        _tiles.store_rows(Out, Lse, acc, lse, tile0, local, heads, row_ok, offs_d, strides, HAS_LSE)


@bind_launches
@triton.jit
def _prefill_kernel(
    Q, K, V, Out, Lse, Sinks, CuSeqlens, Flags,
    qk_scale, window_left, num_m_blocks, num_head_tiles, num_flags, num_tokens,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_lt,
    GROUP: tl.constexpr, HEADS_PER_TILE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
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
                        _prefill_tile(
                            i % num_m_blocks, (i // num_m_blocks) % num_head_tiles,
                            i // (num_m_blocks * num_head_tiles), Q, K, V, Out, Lse, Sinks,
                            CuSeqlens, Flags, qk_scale, window_left, num_m_blocks, num_tokens,
                            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                            stride_ot, stride_oh, stride_lt, GROUP, HEADS_PER_TILE, HEAD_DIM,
                            BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_WINDOW, HAS_SINKS, HAS_LSE,
                            SPLIT_MASK, True,
                        )  # fmt: skip
                clear_flags(Flags, c0, hi, FLAG_CHUNK)
    else:
        pid_m, pid_h, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        flag = Flags + pid_m + num_m_blocks * (pid_h + num_head_tiles * seq)
        _prefill_tile(
            pid_m, pid_h, seq, Q, K, V, Out, Lse, Sinks, CuSeqlens, flag, qk_scale, window_left,
            num_m_blocks, num_tokens, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
            stride_vh, stride_ot, stride_oh, stride_lt, GROUP, HEADS_PER_TILE, HEAD_DIM,
            BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_WINDOW, HAS_SINKS, HAS_LSE, SPLIT_MASK, False,
        )  # fmt: skip


# ----------------------------------------------------------------------------- launcher

# GPT-OSS-like structure (GQA 8, sinks, lse): bf16 with and without a window and at hd 128, and
# fp16 once (same code, other dtype). The tile config depends on none of the lengths.
_AOT_CASE = dict(GPT_OSS_AOT_CASE, seqlens=(128,), num_q_heads=16, num_kv_heads=2)
AOT_CASES = (
    _AOT_CASE,
    dict(_AOT_CASE, window_left=127),
    dict(_AOT_CASE, head_dim=128),
    dict(_AOT_CASE, dtype=torch.float16, window_left=127),
)


def mha_prefill(
    q, k, v, *, cu_seqlens, max_seqlen, causal, window_left, sinks, softmax_scale, out, lse
):
    """Ragged self-attention; writes `out` and, unless None, `lse`.

    q [T, Hq, D], k/v [T, Hkv, D] bf16/fp16 (last dim contiguous); cu_seqlens [B+1] int32;
    max_seqlen >= every sequence length; sinks [Hq] float32/bfloat16 or None;
    out [T, Hq, D]; lse [T, Hq] float32 or None. Arguments arrive validated, except the
    device values: cu_seqlens offsets are clamped to [0, T], a sequence ending before it starts
    is empty, and rows no sequence covers are not written (`_tiles.sequence_span`).
    """
    plan = _tile_config.plan_tiles(
        KERNEL_NAME, q, k.shape[1], cu_seqlens, max_seqlen, window_left, sinks, lse
    )
    if plan is None:
        return
    grid, num_m_blocks, meta = plan
    fixup = causal or window_left >= 0  # else no tile loads a key one of its rows masks
    num_flags = grid[0] * grid[1] * grid[2]
    flags = tile_flags(q.device, num_flags) if fixup else q
    if fixup and out.data_ptr() == q.data_ptr():
        q = q.clone()  # the fix-up reads q after the fast launch wrote out
    args = (
        q, k, v, out, out if lse is None else lse, q if sinks is None else sinks, cu_seqlens,
        flags, softmax_scale * LOG2E.value, window_left, num_m_blocks, grid[1], num_flags,
        q.shape[0], *q.stride()[:2], *k.stride()[:2], *v.stride()[:2], *out.stride()[:2],
        0 if lse is None else lse.stride(0),
    )  # fmt: skip
    _prefill_kernel[grid](*args, IS_CAUSAL=causal, FIXUP=False, FLAG_CHUNK=FLAG_CHUNK, **meta)
    if fixup:
        _prefill_kernel[(fixup_programs(q.device, num_flags),)](
            *args, IS_CAUSAL=causal, FIXUP=True, FLAG_CHUNK=FLAG_CHUNK, **meta
        )


def register() -> None:
    traits = dict(ATTENTION_TRAITS, kv_dtype=HALF, non_causal=True)
    description = "ragged flash attention; window-bounded key loop, unmasked interior blocks"
    register_attention_kernel(
        mha_prefill, KERNEL_NAME, traits, interpreter_dot_verdict, description, AOT_CASES
    )
