"""Paged decode attention (Q >= 1 new tokens per sequence; GQA, sinks, sliding window,
bf16/fp16/FP8 KV) in Gluon for CDNA, split over the keys.

One program owns (sequence, GQA group, split): its rows pack the Q new tokens x the group's
query heads, so each K/V tile is read once for the whole group. Splits divide the visible keys
(window-bounded) evenly; the split count comes from the work and the device's CU count. With
one split the kernel finishes the rows itself; otherwise it writes normalized partial outputs
and their log-sum-exps, and `decode_reduce` merges them, adding the sink exactly once.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ._common import (
    ARCH_CODES,
    CODE_GFX942,
    CODE_GFX950,
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
from .decode_reduce import _reduce_kernel, launch_reduce

MAX_Q_LEN = 128  # rows of one program: Q tokens x packed heads, at most one 128-row MMA tile


@gluon.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    lse_ptr,
    sinks_ptr,
    page_table_ptr,
    cache_seqlens_ptr,
    o_part_ptr,
    lse_part_ptr,
    qk_scale,
    v_scale,
    window_left,
    stride_pt,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_ob,
    stride_ot,
    stride_oh,
    stride_lb,
    stride_lt,
    stride_lh,
    ARCH: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    GQA: gl.constexpr,
    H_PACK: gl.constexpr,
    NUM_Q_HEADS: gl.constexpr,
    Q_LEN: gl.constexpr,
    SPLITS: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    NUM_WARPS: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    HAS_SINKS: gl.constexpr,
    HAS_LSE: gl.constexpr,
    BUFFER: gl.constexpr,
    ASYNC: gl.constexpr,
    WIDE: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
):
    MMA: gl.constexpr = mma_layout(ARCH, NUM_WARPS, BLOCK_M, 16)
    SMEM: gl.constexpr = kv_smem_layout(ARCH, BLOCK_N, HEAD_DIM)
    seq = gl.program_id(0)
    head0 = gl.program_id(1) * H_PACK
    split = gl.program_id(2)
    kvh = head0 // GQA
    seq64 = seq.to(gl.int64)
    kv_len = gl.load(cache_seqlens_ptr + seq)
    q = load_q(
        q_ptr + seq64 * stride_qb,
        0,
        Q_LEN,
        head0,
        stride_qt,
        stride_qh,
        ARCH,
        BLOCK_M,
        HEAD_DIM,
        H_PACK,
        16,
        NUM_WARPS,
        BUFFER,
    )
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
        q,
        q_pos,
        s_lo,
        s_hi,
        qk_scale,
        window_left,
        k_ptr,
        v_ptr,
        kvh * stride_kh,
        kvh * stride_vh,
        page_table_ptr + seq64 * stride_pt,
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
        16,
        NUM_WARPS,
        True,
        PAGE_SIZE,
        True,
        HAS_WINDOW,
        BUFFER,
        ASYNC,
        WIDE,
    )
    acc = acc * v_scale
    if SPLITS == 1:
        sink = load_sinks(sinks_ptr, head0, HAS_SINKS, BLOCK_M, H_PACK, gl.SliceLayout(1, MMA))
        acc, m_i, l_i = add_sink(acc, m_i, l_i, sink)
        out, lse2 = normalize(acc, m_i, l_i)
        store_rows(
            out_ptr + seq64 * stride_ob,
            lse_ptr + seq64 * stride_lb,
            out,
            lse2,
            0,
            Q_LEN,
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
    else:
        # Partials [B, Q, Hq, SPLITS, D] and their lse [B, Q, Hq, SPLITS]; no sink here.
        out, lse2 = normalize(acc, m_i, l_i)
        row0 = seq64 * (Q_LEN * NUM_Q_HEADS * SPLITS) + split
        store_rows(
            o_part_ptr + row0 * HEAD_DIM,
            lse_part_ptr + row0,
            out,
            lse2,
            0,
            Q_LEN,
            head0,
            NUM_Q_HEADS * SPLITS * HEAD_DIM,
            SPLITS * HEAD_DIM,
            NUM_Q_HEADS * SPLITS,
            SPLITS,
            ARCH,
            BLOCK_M,
            HEAD_DIM,
            H_PACK,
            NUM_WARPS,
            True,
            BUFFER,
        )


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int  # keys per LDS tile
    num_warps: int
    max_rows: int  # Q tokens x packed heads per program
    programs_per_cu: int  # splits aim for this many programs per CU
    min_blocks_per_split: int  # below this the reduce costs more than the extra programs gain
    max_splits: int


def _configs(arch_code: int, head_dim: int) -> DecodeConfig:
    if arch_code == CODE_GFX950:
        # 160 KiB LDS: 128-key tiles (32 KiB for K+V at D=64) halve the loop trips; memory
        # bound, so 2 programs per CU (8 waves) are enough to cover HBM latency.
        return DecodeConfig(128 if head_dim <= 64 else 64, 4, 64, 2, 2, 64)
    if arch_code == CODE_GFX942:
        # 64 KiB LDS: 64-key tiles keep 4 programs per CU resident; 304 CUs need more splits.
        return DecodeConfig(64, 4, 64, 2, 4, 64)
    # NVIDIA (numerics of the shared body).
    return DecodeConfig(64, 4, 64, 2, 4, 64)


_pinned: DecodeConfig | None = None


@contextlib.contextmanager
def use_config(config: DecodeConfig) -> Iterator[DecodeConfig]:
    """Pin the decode config inside the block (tests, benchmarks)."""
    global _pinned
    previous, _pinned = _pinned, config
    try:
        yield config
    finally:
        _pinned = previous


def num_splits(cfg: DecodeConfig, programs: int, max_keys: int, units: int) -> int:
    """Splits per (sequence, group): enough programs to fill every CU `programs_per_cu` times,
    never so many that a split gets fewer than `min_blocks_per_split` key tiles."""
    want = -(-units * cfg.programs_per_cu // max(programs, 1))
    by_keys = max(1, -(-max_keys // cfg.block_n) // cfg.min_blocks_per_split)
    return max(1, min(want, by_keys, cfg.max_splits))


def plan(q_len: int, group: int, cfg: DecodeConfig) -> tuple[int, int]:
    """(heads packed per program, BLOCK_M)."""
    h_pack = pow2_divisor(group, max(1, cfg.max_rows // q_len))
    block_m = max(16, 1 << math.ceil(math.log2(h_pack * q_len)))
    return h_pack, block_m


def choose_config(arch_code: int, head_dim: int) -> DecodeConfig:
    return _pinned if _pinned is not None else _configs(arch_code, head_dim)


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
    splits=None,
    direct_to_lds=None,
):
    """q [B, Q, Hq, D] (Q new tokens per sequence, causal among themselves); caches
    [num_pages, P, Hkv, D] bf16/fp16 or float8_e4m3fn (per-tensor k_scale/v_scale); page_table
    [B, max_pages] int32; cache_seqlens [B] int32 including the new tokens.

    Writes out [B, Q, Hq, D] and lse [B, Q, Hq] float32 when given. `splits` overrides the
    split count (tests); by default it follows the work and the device's CU count. `arch` and
    `direct_to_lds` as for `mha_prefill`.
    """
    num_seqs, q_len, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    scale = head_dim**-0.5 if softmax_scale is None else float(softmax_scale)
    if out is None:
        dtype = torch.bfloat16 if k_cache.dtype == FP8_DTYPE else q.dtype
        out = torch.empty(q.shape, dtype=dtype, device=q.device)
    if num_seqs == 0:
        return out
    if q_len > MAX_Q_LEN:
        raise ValueError(
            f"mha_decode_with_kvcache: q has {q_len} tokens per sequence, "
            f"expected at most {MAX_Q_LEN}"
        )
    arch_code, units = resolve_arch(q.device, arch)
    cfg = choose_config(arch_code, head_dim)
    group = num_q_heads // num_kv_heads
    h_pack, block_m = plan(q_len, group, cfg)
    max_keys = page_table.shape[1] * page_size
    if window_left >= 0:
        max_keys = min(max_keys, window_left + q_len)
    programs = num_seqs * (num_q_heads // h_pack)
    if splits is None:
        splits = num_splits(cfg, programs, max_keys, units)
    wide = needs_wide_offsets(q, k_cache, v_cache, out, lse, page_table)
    buffer = arch_code != 0 and not wide
    o_part = lse_part = out
    if splits > 1:
        o_part = torch.empty(
            (num_seqs, q_len, num_q_heads, splits, head_dim), dtype=torch.float32, device=q.device
        )
        lse_part = torch.empty(o_part.shape[:-1], dtype=torch.float32, device=q.device)
    lse_arg = lse if lse is not None else out
    lse_strides = lse.stride() if lse is not None else (0, 0, 0)
    _decode_kernel[(num_seqs, num_q_heads // h_pack, splits)](
        q, k_cache, v_cache, out, lse_arg, sinks if sinks is not None else out, page_table,
        cache_seqlens, o_part, lse_part, scale * float(k_scale) * LOG2E, float(v_scale),
        window_left, page_table.stride(0), *q.stride()[:3], *k_cache.stride()[:3],
        *v_cache.stride()[:3], *out.stride()[:3], *lse_strides,
        ARCH=arch_code, HEAD_DIM=head_dim, GQA=group, H_PACK=h_pack, NUM_Q_HEADS=num_q_heads,
        Q_LEN=q_len, SPLITS=splits, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        NUM_WARPS=cfg.num_warps, HAS_WINDOW=window_left >= 0, HAS_SINKS=sinks is not None,
        HAS_LSE=lse is not None, BUFFER=buffer,
        ASYNC=direct_copies(direct_to_lds, arch_code, k_cache, v_cache, wide), WIDE=wide,
        PAGE_SIZE=page_size, num_warps=cfg.num_warps,
    )  # fmt: skip
    if splits > 1:
        launch_reduce(o_part, lse_part, out, lse, sinks, arch_code, buffer)
    return out


def aot_specs(arch: str) -> list:
    """GPT-OSS decode (D=64, GQA 8, page 64, sinks, lse): one split and split-KV + reduce,
    full and sliding layers, FP8 KV, Q=4 (speculative verification); for `arch`."""
    from ..aot import AotSpec

    code = ARCH_CODES["nvidia" if arch.startswith("sm_") else arch]
    ptrs = (
        "q_ptr",
        "k_ptr",
        "v_ptr",
        "out_ptr",
        "lse_ptr",
        "sinks_ptr",
        "page_table_ptr",
        "cache_seqlens_ptr",
        "o_part_ptr",
        "lse_part_ptr",
    )
    strides = (
        "stride_qb",
        "stride_qt",
        "stride_qh",
        "stride_kp",
        "stride_ks",
        "stride_kh",
        "stride_vp",
        "stride_vs",
        "stride_vh",
        "stride_ob",
        "stride_ot",
        "stride_oh",
        "stride_lb",
        "stride_lt",
        "stride_lh",
    )
    specs = []
    cases = (
        (1, 1, False, "bf16"),
        (1, 16, False, "bf16"),
        (1, 16, True, "bf16"),
        (4, 8, True, "fp8e4nv"),
    )
    for q_len, splits, window, kv in cases:
        cfg = _configs(code, 64)
        h_pack, block_m = plan(q_len, 8, cfg)
        types = (
            "*bf16",
            f"*{kv}",
            f"*{kv}",
            "*bf16",
            "*fp32",
            "*fp32",
            "*i32",
            "*i32",
            "*fp32",
            "*fp32",
        )
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
            HEAD_DIM=64,
            GQA=8,
            H_PACK=h_pack,
            NUM_Q_HEADS=64,
            Q_LEN=q_len,
            SPLITS=splits,
            BLOCK_M=block_m,
            BLOCK_N=cfg.block_n,
            NUM_WARPS=cfg.num_warps,
            HAS_WINDOW=window,
            HAS_SINKS=True,
            HAS_LSE=True,
            BUFFER=code != 0,
            ASYNC=code != CODE_GFX942 and kv == "bf16",
            WIDE=False,
            PAGE_SIZE=64,
        )
        name = f"decode_d64_gqa8_page64_q{q_len}_splits{splits}{'_window' if window else ''}_{kv}"
        specs.append(
            AotSpec(
                name,
                _decode_kernel,
                signature,
                constexprs,
                cfg.num_warps,
                divisible=(*ptrs[:4], *ptrs[8:], "stride_pt", *strides[:12]),
            )
        )
    reduce_ptrs = ("o_part_ptr", "lse_part_ptr", "out_ptr", "lse_ptr", "sinks_ptr")
    reduce_strides = strides[9:]
    signature = {
        **dict(zip(reduce_ptrs, ("*fp32", "*fp32", "*bf16", "*fp32", "*fp32"), strict=True)),
        **{s: "i32" for s in reduce_strides},
    }
    constexprs = dict(
        ARCH=code,
        HEAD_DIM=64,
        NUM_Q_HEADS=64,
        Q_LEN=1,
        SPLITS=16,
        BLOCK_S=16,
        NUM_WARPS=1,
        HAS_SINKS=True,
        HAS_LSE=True,
        BUFFER=code != 0,
    )
    specs.append(
        AotSpec(
            "decode_reduce_d64_splits16",
            _reduce_kernel,
            signature,
            constexprs,
            1,
            expect=("buffer_load",),
            divisible=(*reduce_ptrs[:3], *reduce_strides),
            notes="no MMA: a weighted sum over the splits",
        )
    )
    return specs
