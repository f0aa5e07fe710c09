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

KERNEL_NAME = "triton.mha_prefill"


@bind_launches
@triton.jit
def _prefill_kernel(
    Q, K, V, Out, Lse, Sinks, CuSeqlens,
    qk_scale, window_left, num_m_blocks, num_tokens,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_lt,
    GROUP: tl.constexpr, HEADS_PER_TILE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_LSE: tl.constexpr, SPLIT_MASK: tl.constexpr,
):  # fmt: skip
    TOKENS: tl.constexpr = BLOCK_M // HEADS_PER_TILE
    pid_m, head_base, seq = _tiles.tile_program(
        num_m_blocks, HEADS_PER_TILE, IS_CAUSAL and not HAS_WINDOW
    )
    start, seqlen = _tiles.sequence_span(CuSeqlens, seq, num_tokens)
    t0 = pid_m * TOKENS
    if t0 >= seqlen:
        return
    kv_head = head_base // GROUP
    q, tok0, tile0, local, rows, heads, row_ok, offs_n, offs_d = _tiles.query_tile(
        Q, start, t0, head_base, seqlen, stride_qt, stride_qh, BLOCK_M, HEADS_PER_TILE, BLOCK_N,
        HEAD_DIM,
    )  # fmt: skip
    k_base = K + tok0 * stride_kt + kv_head * stride_kh
    v_base = V + tok0 * stride_vt + kv_head * stride_vh

    last_row = tl.minimum(t0 + TOKENS, seqlen) - 1
    bounds = _tiles.key_block_bounds(
        t0, last_row, seqlen, window_left, BLOCK_N, IS_CAUSAL, HAS_WINDOW
    )
    tile = (rows, seqlen, window_left, qk_scale, offs_n)
    keys = (k_base, v_base, stride_kt, stride_vt, offs_n, offs_d)
    acc, l_i, m_i = _tiles.attend_key_ranges(
        q, tile, keys, bounds, BLOCK_M, HEAD_DIM, BLOCK_N, IS_CAUSAL, HAS_WINDOW, SPLIT_MASK, 0
    )
    acc, lse = _tiles.attn_finalize(acc, l_i, m_i, Sinks, heads, HAS_SINKS)
    strides = (stride_ot, stride_oh, stride_lt)
    _tiles.store_rows(Out, Lse, acc, lse, tile0, local, heads, row_ok, offs_d, strides, HAS_LSE)


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
    _prefill_kernel[grid](
        q, k, v, out, out if lse is None else lse, q if sinks is None else sinks, cu_seqlens,
        softmax_scale * LOG2E.value, window_left, num_m_blocks, q.shape[0],
        *q.stride()[:2], *k.stride()[:2], *v.stride()[:2], *out.stride()[:2],
        0 if lse is None else lse.stride(0),
        IS_CAUSAL=causal, **meta,
    )  # fmt: skip


def register() -> None:
    traits = dict(ATTENTION_TRAITS, kv_dtype=HALF, non_causal=True)
    description = "ragged flash attention; window-bounded key loop, unmasked interior blocks"
    register_attention_kernel(
        mha_prefill, KERNEL_NAME, traits, interpreter_dot_verdict, description, AOT_CASES
    )
