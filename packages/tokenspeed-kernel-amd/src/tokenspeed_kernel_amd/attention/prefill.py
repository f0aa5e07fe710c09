"""Ragged causal/non-causal prefill attention (GQA, sinks, sliding window) in Gluon for CDNA.

One program owns BLOCK_M rows = (BLOCK_M / H_PACK) tokens x H_PACK query heads of one KV head,
so each K/V tile staged in LDS serves the whole GQA group. The key loop starts at the window's
first visible key (blocks left of the window are never loaded) and stops at the causal edge.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from tokenspeed_kernel.registry import register_kernel
from tokenspeed_kernel.toolchain import triton_support

from ._common import (
    attend,
    finish_rows,
    kv_smem_layout,
    load_q,
    mma_layout,
    sequence_bounds,
)
from ._launch import (
    HALF_DTYPES,
    PLATFORMS,
    PRIORITY,
    attention_traits,
    optional_operands,
    qk_scale_log2,
    ragged_launch,
)

KERNEL_NAME = "amd.mha_prefill"


@gluon.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, sinks_ptr, cu_seqlens_ptr, num_tokens, qk_scale,
    window_left,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_lt, stride_lh,
    ARCH: gl.constexpr, HEAD_DIM: gl.constexpr, GQA: gl.constexpr, H_PACK: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, INSTR_M: gl.constexpr,
    NUM_WARPS: gl.constexpr, CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr,
    HAS_SINKS: gl.constexpr, HAS_LSE: gl.constexpr, BUFFER: gl.constexpr, ASYNC: gl.constexpr,
    WIDE: gl.constexpr,
):  # fmt: skip
    TOKENS: gl.constexpr = BLOCK_M // H_PACK
    MMA: gl.constexpr = mma_layout(ARCH, NUM_WARPS, BLOCK_M, INSTR_M)
    SMEM: gl.constexpr = kv_smem_layout(ARCH, BLOCK_N, HEAD_DIM)
    pid_m = gl.program_id(0)
    seq = gl.program_id(1)
    head0 = gl.program_id(2) * H_PACK
    kvh = head0 // GQA
    seq_start, seq_len = sequence_bounds(cu_seqlens_ptr, seq, num_tokens)
    m_start = pid_m * TOKENS
    if m_start < seq_len:
        base = seq_start.to(gl.int64)
        q = load_q(
            q_ptr + base * stride_qt, m_start, seq_len, head0, stride_qt, stride_qh,
            ARCH, BLOCK_M, HEAD_DIM, H_PACK, INSTR_M, NUM_WARPS, BUFFER,
        )  # fmt: skip
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
            q, q_pos, k_lo, k_hi, qk_scale, window_left, k_ptr + base * stride_kt,
            v_ptr + base * stride_vt, kvh * stride_kh, kvh * stride_vh, cu_seqlens_ptr, 0,
            stride_kt, 0, stride_vt, 0, k_smem, v_smem, ARCH, BLOCK_M, BLOCK_N, HEAD_DIM,
            INSTR_M, NUM_WARPS, False, 1, CAUSAL, HAS_WINDOW, BUFFER, ASYNC, WIDE,
            CAUSAL or HAS_WINDOW,
        )  # fmt: skip
        finish_rows(
            acc, m_i, l_i, sinks_ptr, out_ptr, lse_ptr, base, stride_ot, stride_lt, m_start,
            seq_len, head0, stride_ot, stride_oh, stride_lt, stride_lh, ARCH, BLOCK_M, HEAD_DIM,
            H_PACK, NUM_WARPS, HAS_SINKS, HAS_LSE, BUFFER, gl.SliceLayout(1, MMA),
        )  # fmt: skip


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
    cu_seqlens entries are clamped to [0, T] and a sequence ending before its start is empty
    (rows no sequence covers are not written).
    `arch` ("gfx942", "gfx950", "nvidia") defaults to q's platform; `direct_to_lds=False`
    stages K/V through registers even where direct-to-LDS copies are possible. The config is
    `tuning.pin_config(KERNEL_NAME, RaggedConfig(...))` where pinned.
    """
    out = torch.empty_like(q) if out is None else out
    num_seqs = cu_seqlens.shape[0] - 1
    if q.shape[0] == 0 or num_seqs <= 0 or max_seqlen <= 0:
        return out
    grid, constexprs = ragged_launch(
        KERNEL_NAME, q, k, v, out, lse, sinks, max_seqlen=max_seqlen, window_left=window_left,
        arch=arch, direct_to_lds=direct_to_lds, num_seqs=num_seqs,
    )  # fmt: skip
    lse_arg, sinks_arg, lse_strides = optional_operands(out, lse, sinks, 2)
    _prefill_kernel[grid](
        q, k, v, out, lse_arg, sinks_arg, cu_seqlens, q.shape[0],
        qk_scale_log2(q.shape[2], softmax_scale), window_left, *q.stride()[:2], *k.stride()[:2],
        *v.stride()[:2], *out.stride()[:2], *lse_strides, CAUSAL=causal, **constexprs,
    )  # fmt: skip
    return out


# GPT-OSS prefill (D=64, GQA 8, sinks; full and sliding layers) and D=128.
AOT_CASES = (
    dict(seqlens=(64,), num_q_heads=64, num_kv_heads=8, head_dim=64, sinks=0.0, lse=True),
    dict(seqlens=(64,), num_q_heads=64, num_kv_heads=8, head_dim=64, sinks=0.0, lse=True,
         window_left=127),
    dict(seqlens=(64,), num_q_heads=64, num_kv_heads=8, head_dim=128, sinks=0.0, lse=True),
)  # fmt: skip
# ISA features the design relies on, per jit function, for the aot check.
AOT_EXPECT = {"_prefill_kernel": ("mfma", "buffer_load")}


def register() -> None:
    register_kernel(
        "mha_prefill",
        name=KERNEL_NAME,
        backend="amd",
        platforms=PLATFORMS,
        traits=attention_traits(HALF_DTYPES, non_causal=True),
        priority=PRIORITY,
        # Its layouts call gl.thread_barrier, which Triton 3.8 no longer has.
        supports=lambda request, platform: triton_support("thread_barrier"),
        description="Gluon flash attention, MFMA; GQA rows packed per program; "
        "window-bounded key loop; gfx950 direct-to-LDS K/V copies",
        aot_cases=AOT_CASES,
    )(mha_prefill)
