"""Paged decode attention (Q >= 1 new tokens per sequence; GQA, sinks, sliding window,
bf16/fp16/FP8 KV) in Gluon for CDNA, split over the keys.

One program owns (sequence, GQA group, split): its rows pack the Q new tokens x the group's
query heads, so each K/V tile is read once for the whole group. Splits divide the visible keys
(window-bounded) evenly; the split count comes from the work and the device's CU count. With
one split the kernel finishes the rows itself; otherwise it writes normalized partial outputs
and their log-sum-exps, and `decode_reduce` merges them, adding the sink exactly once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from tokenspeed_kernel.registry import ANY, register_kernel
from tokenspeed_kernel.toolchain import triton_support
from tokenspeed_kernel.tuning import first_match, pinned_config

from ._common import (
    CODE_GFX942,
    CODE_GFX950,
    attend,
    cached_keys,
    finish_rows,
    kv_smem_layout,
    load_q,
    mma_layout,
    normalize,
    store_rows,
)
from ._launch import (
    FP8_DTYPE,
    HALF_DTYPES,
    PLATFORMS,
    PRIORITY,
    attention_traits,
    launch_arch,
    memory_flags,
    optional_operands,
    paged_out,
    pow2_divisor,
    qk_scale_log2,
)
from .decode_reduce import launch_reduce

KERNEL_NAME = "amd.mha_decode_with_kvcache"
MAX_Q_LEN = 128  # rows of one program: Q tokens x packed heads, at most one 128-row MMA tile


@gluon.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, sinks_ptr, page_table_ptr, cache_seqlens_ptr,
    o_part_ptr, lse_part_ptr, num_pages, max_keys, qk_scale, v_scale, window_left, stride_pt,
    stride_qb, stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
    stride_vh, stride_ob,
    stride_ot, stride_oh, stride_lb, stride_lt, stride_lh,
    ARCH: gl.constexpr, HEAD_DIM: gl.constexpr, GQA: gl.constexpr, H_PACK: gl.constexpr,
    NUM_Q_HEADS: gl.constexpr, Q_LEN: gl.constexpr, SPLITS: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_WARPS: gl.constexpr,
    HAS_WINDOW: gl.constexpr, HAS_SINKS: gl.constexpr, HAS_LSE: gl.constexpr,
    BUFFER: gl.constexpr, ASYNC: gl.constexpr, WIDE: gl.constexpr, PAGE_SIZE: gl.constexpr,
):  # fmt: skip
    MMA: gl.constexpr = mma_layout(ARCH, NUM_WARPS, BLOCK_M, 16)
    SMEM: gl.constexpr = kv_smem_layout(ARCH, BLOCK_N, HEAD_DIM)
    seq = gl.program_id(0)
    head0 = gl.program_id(1) * H_PACK
    split = gl.program_id(2)
    kvh = head0 // GQA
    seq64 = seq.to(gl.int64)
    kv_len = cached_keys(cache_seqlens_ptr, seq, max_keys)
    q = load_q(
        q_ptr + seq64 * stride_qb, 0, Q_LEN, head0, stride_qt, stride_qh, ARCH, BLOCK_M,
        HEAD_DIM, H_PACK, 16, NUM_WARPS, BUFFER,
    )  # fmt: skip
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, MMA))
    q_pos = kv_len - Q_LEN + rows // H_PACK
    # Visible keys of the whole group: [first query - W, last query]; splits share them evenly.
    k_lo = 0
    if HAS_WINDOW:
        k_lo = gl.maximum(kv_len - Q_LEN - window_left, 0)
    span = gl.maximum(kv_len - k_lo, 0)
    chunk = gl.cdiv(gl.cdiv(span, SPLITS), BLOCK_N) * BLOCK_N
    s_lo = k_lo + split * chunk
    s_hi = gl.minimum(kv_len, s_lo + chunk)
    k_smem = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [BLOCK_N, HEAD_DIM], SMEM)
    v_smem = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [BLOCK_N, HEAD_DIM], SMEM)
    acc, m_i, l_i = attend(
        q, q_pos, s_lo, s_hi, qk_scale, window_left, k_ptr, v_ptr, kvh * stride_kh,
        kvh * stride_vh, page_table_ptr + seq64 * stride_pt, num_pages, stride_kp, stride_ks,
        stride_vp, stride_vs, k_smem, v_smem, ARCH, BLOCK_M, BLOCK_N, HEAD_DIM, 16, NUM_WARPS, True,
        PAGE_SIZE, True, HAS_WINDOW, BUFFER, ASYNC, WIDE, Q_LEN > 1,
    )  # fmt: skip
    acc = acc * v_scale
    if SPLITS == 1:
        finish_rows(
            acc, m_i, l_i, sinks_ptr, out_ptr, lse_ptr, seq64, stride_ob, stride_lb, 0, Q_LEN,
            head0, stride_ot, stride_oh, stride_lt, stride_lh, ARCH, BLOCK_M, HEAD_DIM, H_PACK,
            NUM_WARPS, HAS_SINKS, HAS_LSE, BUFFER, gl.SliceLayout(1, MMA),
        )  # fmt: skip
    else:
        # Partials [B, Q, Hq, SPLITS, D] and their lse [B, Q, Hq, SPLITS]; no sink here.
        out, lse2 = normalize(acc, m_i, l_i)
        row0 = seq64 * (Q_LEN * NUM_Q_HEADS * SPLITS) + split
        store_rows(
            o_part_ptr + row0 * HEAD_DIM, lse_part_ptr + row0, out, lse2, 0, Q_LEN, head0,
            NUM_Q_HEADS * SPLITS * HEAD_DIM, SPLITS * HEAD_DIM, NUM_Q_HEADS * SPLITS, SPLITS,
            ARCH, BLOCK_M, HEAD_DIM, H_PACK, NUM_WARPS, True, BUFFER,
        )  # fmt: skip


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int  # keys per LDS tile
    num_warps: int
    max_rows: int  # Q tokens x packed heads per program
    programs_per_cu: int  # splits aim for this many programs per CU
    min_blocks_per_split: int  # below this the reduce costs more than the extra programs gain
    max_splits: int
    num_splits: int | None = None  # None: from the work and the CU count


# gfx950 keys per LDS tile by head dim: 128-key tiles (32 KiB for K+V at D=64) halve the
# loop trips where they fit the 160 KiB LDS.
GFX950_BLOCK_N = ((64, 128), (None, 64))


def decode_config(arch_code: int, head_dim: int) -> DecodeConfig:
    if arch_code == CODE_GFX950:
        # Memory bound: 2 programs per CU (8 waves) are enough to cover HBM latency.
        return DecodeConfig(first_match(GFX950_BLOCK_N, head_dim), 4, 64, 2, 2, 64)
    if arch_code == CODE_GFX942:
        # 64 KiB LDS: 64-key tiles keep 4 programs per CU resident; 304 CUs need more splits.
        return DecodeConfig(64, 4, 64, 2, 4, 64)
    # NVIDIA (numerics of the shared body).
    return DecodeConfig(64, 4, 64, 2, 4, 64)


def num_splits(cfg: DecodeConfig, programs: int, max_keys: int, units: int) -> int:
    """Splits per (sequence, group): enough programs to fill every CU `programs_per_cu` times,
    never so many that a split gets fewer than `min_blocks_per_split` key tiles."""
    want = -(-units * cfg.programs_per_cu // max(programs, 1))
    by_keys = max(1, -(-max_keys // cfg.block_n) // cfg.min_blocks_per_split)
    return max(1, min(want, by_keys, cfg.max_splits))


def pack_rows(q_len: int, group: int, cfg: DecodeConfig) -> tuple[int, int]:
    """(heads packed per program, BLOCK_M)."""
    h_pack = pow2_divisor(group, max(1, cfg.max_rows // q_len))
    block_m = max(16, 1 << math.ceil(math.log2(h_pack * q_len)))
    return h_pack, block_m


def _split_count(cfg, q, k_cache, page_table, window_left, programs, units) -> int:
    if cfg.num_splits is not None:
        return cfg.num_splits
    max_keys = page_table.shape[1] * k_cache.shape[1]
    if window_left >= 0:
        max_keys = min(max_keys, window_left + q.shape[1])
    return num_splits(cfg, programs, max_keys, units)


def mha_decode_with_kvcache(
    q,
    k_cache,
    v_cache,
    *,
    page_table,
    cache_seqlens,
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
    """q [B, Q, Hq, D] (Q new tokens per sequence, causal among themselves); caches
    [num_pages, P, Hkv, D] bf16/fp16 or float8_e4m3fn (per-tensor k_scale/v_scale); page_table
    [B, max_pages] int32; cache_seqlens [B] int32 including the new tokens.

    Writes out [B, Q, Hq, D] and lse [B, Q, Hq] float32 when given. The config (and a forced
    split count, `DecodeConfig.num_splits`) is the one pinned for KERNEL_NAME, else the
    platform's. `arch` and `direct_to_lds` as for `mha_prefill`.
    """
    num_seqs, q_len, num_q_heads, head_dim = q.shape
    out = paged_out(q, k_cache, out)
    if num_seqs == 0:
        return out
    if q_len > MAX_Q_LEN:
        raise ValueError(
            f"mha_decode_with_kvcache: q has {q_len} tokens per sequence, "
            f"expected at most {MAX_Q_LEN}"
        )
    arch_code, platform = launch_arch(q.device, arch)
    cfg = pinned_config(KERNEL_NAME) or decode_config(arch_code, head_dim)
    group = num_q_heads // k_cache.shape[2]
    h_pack, block_m = pack_rows(q_len, group, cfg)
    programs = num_seqs * (num_q_heads // h_pack)
    splits = _split_count(cfg, q, k_cache, page_table, window_left, programs, platform.sm_count)
    flags = memory_flags(arch_code, k_cache, v_cache, direct_to_lds, q, out, lse, page_table)
    o_part = lse_part = out
    if splits > 1:
        o_part = q.new_empty((num_seqs, q_len, num_q_heads, splits, head_dim), dtype=torch.float32)
        lse_part = q.new_empty(o_part.shape[:-1], dtype=torch.float32)
    lse_arg, sinks_arg, lse_strides = optional_operands(out, lse, sinks, 3)
    _decode_kernel[(num_seqs, num_q_heads // h_pack, splits)](
        q, k_cache, v_cache, out, lse_arg, sinks_arg, page_table, cache_seqlens, o_part,
        lse_part, k_cache.shape[0], page_table.shape[1] * k_cache.shape[1],
        qk_scale_log2(head_dim, softmax_scale, k_scale), float(v_scale), window_left,
        page_table.stride(0), *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
        *out.stride()[:3], *lse_strides,
        ARCH=arch_code, HEAD_DIM=head_dim, GQA=group, H_PACK=h_pack, NUM_Q_HEADS=num_q_heads,
        Q_LEN=q_len, SPLITS=splits, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        NUM_WARPS=cfg.num_warps, HAS_WINDOW=window_left >= 0, HAS_SINKS=sinks is not None,
        HAS_LSE=lse is not None, PAGE_SIZE=k_cache.shape[1], num_warps=cfg.num_warps, **flags,
    )  # fmt: skip
    if splits > 1:
        launch_reduce(o_part, lse_part, out, lse, sinks, arch_code, flags["BUFFER"])
    return out


# GPT-OSS decode (D=64, GQA 8, page 64, sinks, lse). The split count follows the context: 64
# keys give one split, 4096 (or a window that wide) 16 splits plus the reduce, on both
# gfx942 and gfx950; Q=4 over a 2047-key window (speculative verification, FP8 KV) 8 splits.
_GPT_OSS = dict(num_q_heads=64, num_kv_heads=8, head_dim=64, page_size=64, q_lens=(1,),
                sinks=0.0, lse=True)  # fmt: skip
AOT_CASES = (
    dict(_GPT_OSS, seqlens=(64,)),
    dict(_GPT_OSS, seqlens=(4096,)),
    dict(_GPT_OSS, seqlens=(4096,), window_left=4095),
    dict(_GPT_OSS, seqlens=(2048,), q_lens=(4,), window_left=2043, kv_dtype=FP8_DTYPE),
)
AOT_EXPECT = {"_decode_kernel": ("mfma", "buffer_load"), "_reduce_kernel": ("buffer_load",)}


def register() -> None:
    register_kernel(
        "mha_decode_with_kvcache",
        name=KERNEL_NAME,
        backend="amd",
        platforms=PLATFORMS,
        traits=attention_traits(
            (*HALF_DTYPES, FP8_DTYPE), page_size=ANY, q_len=range(1, MAX_Q_LEN + 1)
        ),
        priority=PRIORITY,
        # Its layouts call gl.thread_barrier, which Triton 3.8 no longer has.
        supports=lambda request, platform: triton_support("thread_barrier"),
        description="Gluon split-KV paged decode, MFMA; splits from work and CU count; "
        "reduce adds the sink once; FP8 KV",
        aot_cases=AOT_CASES,
    )(mha_decode_with_kvcache)
