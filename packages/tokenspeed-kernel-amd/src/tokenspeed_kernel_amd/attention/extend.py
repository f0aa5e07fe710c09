"""Chunked prefill over the paged KV cache (GQA, sinks, sliding window, bf16/fp16/FP8 KV) in
Gluon for CDNA.

The n new tokens of a sequence are its last n positions (already stored in the cache). Same
row packing and key loop as prefill (`_common.attend`), with keys gathered through the page
table one row at a time (any page size). FP8 caches are converted to the query dtype on the way
into LDS; the key scale folds into the softmax scale and the value scale into the output.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from tokenspeed_kernel.registry import ANY, register_kernel
from tokenspeed_kernel.toolchain import triton_support

from ._common import (
    attend,
    cached_keys,
    finish_rows,
    kv_smem_layout,
    load_q,
    mma_layout,
    sequence_bounds,
)
from ._launch import (
    FP8_DTYPE,
    HALF_DTYPES,
    PLATFORMS,
    PRIORITY,
    attention_traits,
    optional_operands,
    paged_out,
    qk_scale_log2,
    ragged_launch,
)

KERNEL_NAME = "amd.mha_extend_with_kvcache"


@gluon.jit
def _extend_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, sinks_ptr, cu_seqlens_ptr, page_table_ptr,
    cache_seqlens_ptr, num_tokens, num_pages, max_keys, qk_scale, v_scale, window_left,
    stride_pt, stride_qt, stride_qh,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_ot, stride_oh,
    stride_lt, stride_lh,
    ARCH: gl.constexpr, HEAD_DIM: gl.constexpr, GQA: gl.constexpr, H_PACK: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, INSTR_M: gl.constexpr,
    NUM_WARPS: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_SINKS: gl.constexpr,
    HAS_LSE: gl.constexpr, BUFFER: gl.constexpr, ASYNC: gl.constexpr, WIDE: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
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
        # Row i of the n new tokens sits at position kv_len - n + i; keys are causal.
        kv_len = cached_keys(cache_seqlens_ptr, seq, max_keys)
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
            q, q_pos, k_lo, k_hi, qk_scale, window_left, k_ptr, v_ptr, kvh * stride_kh,
            kvh * stride_vh, page_table_ptr + seq.to(gl.int64) * stride_pt, num_pages, stride_kp,
            stride_ks, stride_vp, stride_vs, k_smem, v_smem, ARCH, BLOCK_M, BLOCK_N, HEAD_DIM,
            INSTR_M, NUM_WARPS, True, PAGE_SIZE, True, HAS_WINDOW, BUFFER, ASYNC, WIDE, True,
        )  # fmt: skip
        # FP8 caches: the key scale is in qk_scale; the value scale multiplies the output.
        acc = acc * v_scale
        finish_rows(
            acc, m_i, l_i, sinks_ptr, out_ptr, lse_ptr, base, stride_ot, stride_lt, m_start,
            seq_len, head0, stride_ot, stride_oh, stride_lt, stride_lh, ARCH, BLOCK_M, HEAD_DIM,
            H_PACK, NUM_WARPS, HAS_SINKS, HAS_LSE, BUFFER, gl.SliceLayout(1, MMA),
        )  # fmt: skip


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
    int32; cache_seqlens [B] int32 including the new tokens. Bad device values stay in
    bounds: cu_seqlens_q as for `mha_prefill`, cache_seqlens clamped to [0, max_pages * P],
    page ids outside [0, num_pages) read as masked keys.

    Writes out [T, Hq, D] (bf16 for an FP8 cache unless given) and lse [T, Hq] when given.
    `arch` and `direct_to_lds` as for `mha_prefill`; the config is the `RaggedConfig` pinned
    for KERNEL_NAME, else the platform's.
    """
    out = paged_out(q, k_cache, out)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if q.shape[0] == 0 or num_seqs <= 0 or max_seqlen_q <= 0:
        return out
    grid, constexprs = ragged_launch(
        KERNEL_NAME, q, k_cache, v_cache, out, lse, sinks, max_seqlen=max_seqlen_q,
        window_left=window_left, arch=arch, direct_to_lds=direct_to_lds, num_seqs=num_seqs,
        more=(page_table,),
    )  # fmt: skip
    lse_arg, sinks_arg, lse_strides = optional_operands(out, lse, sinks, 2)
    _extend_kernel[grid](
        q, k_cache, v_cache, out, lse_arg, sinks_arg, cu_seqlens_q, page_table, cache_seqlens,
        q.shape[0], k_cache.shape[0], page_table.shape[1] * k_cache.shape[1],
        qk_scale_log2(q.shape[2], softmax_scale, k_scale), float(v_scale), window_left,
        page_table.stride(0), *q.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3],
        *out.stride()[:2], *lse_strides, PAGE_SIZE=k_cache.shape[1], **constexprs,
    )  # fmt: skip
    return out


# GPT-OSS extend (D=64, GQA 8, page 64, sinks): full and sliding layers, FP8 KV.
_GPT_OSS = dict(seqlens=(200,), q_lens=(70,), num_q_heads=64, num_kv_heads=8, head_dim=64,
                page_size=64, sinks=0.0, lse=True)  # fmt: skip
AOT_CASES = (
    _GPT_OSS,
    dict(_GPT_OSS, window_left=127),
    dict(_GPT_OSS, window_left=127, kv_dtype=FP8_DTYPE),
)
AOT_EXPECT = {"_extend_kernel": ("mfma", "buffer_load")}


def register() -> None:
    register_kernel(
        "mha_extend_with_kvcache",
        name=KERNEL_NAME,
        backend="amd",
        platforms=PLATFORMS,
        traits=attention_traits((*HALF_DTYPES, FP8_DTYPE), page_size=ANY),
        priority=PRIORITY,
        # Its layouts call gl.thread_barrier, which Triton 3.8 no longer has.
        supports=lambda request, platform: triton_support("thread_barrier"),
        description="Gluon paged chunked prefill, MFMA; per-key page gather; FP8 KV",
        aot_cases=AOT_CASES,
    )(mha_extend_with_kvcache)
