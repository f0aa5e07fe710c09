"""Tiny-batch MoE path (M <= 4 tokens): weights dominate the traffic, so both GEMMs are GEMVs on
the vector units (an MFMA tile would be at least 75% padding) and the work is spread over the
GPU by output tiles and, for the second GEMM, by K splits.

Launch 1 (`tiny_gemm1_kernel`) fuses routing (top-k of the logits, ties to the lower index,
softmax over the k), the first GEMM, its bias, the clamped SwiGLU and the FP8 requantization:
one program per (I tile, token, slot). Launch 2 (`tiny_gemm2_kernel`) is a split-K GEMV writing
r * (partial + bias) per split; the host sums splits and slots.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ._common import (
    dequant_mxfp4,
    fp8_round,
    load_even,
    load_tile,
    scale_offsets,
    store_tile,
    swiglu,
)


@gluon.jit
def _route(logits_ptr, E, slot, TOP_K: gl.constexpr, E_BLOCK: gl.constexpr, LAYOUT: gl.constexpr):
    """Expert and routing weight of top-k slot `slot` for one token's logits [E]."""
    offs = gl.arange(0, E_BLOCK, layout=LAYOUT)
    v = gl.load(logits_ptr + offs, mask=offs < E, other=float("-inf")).to(gl.float32)
    # NaN ranks as +inf (torch's sort order): `v == m` below then always finds an index < E.
    v = gl.where(v == v, v, float("inf"))
    top = gl.max(v, axis=0)
    denom = 0.0
    chosen = 0
    chosen_logit = top
    for j in gl.static_range(TOP_K):
        m = gl.max(v, axis=0)
        # Lowest index among the maxima: ties go to the lower expert.
        idx = gl.min(gl.where(v == m, offs, E_BLOCK), axis=0)
        denom += gl.exp(m - top)
        chosen = gl.where(slot == j, idx, chosen)
        chosen_logit = gl.where(slot == j, m, chosen_logit)
        v = gl.where(offs == idx, float("-inf"), v)
    return chosen, gl.exp(chosen_logit - top) / denom


@gluon.jit
def _load_vec(ptr, col, K_VALID, scale, ARCH: gl.constexpr, A_MODE: gl.constexpr):
    """Activation elements `col` of one row as float32 (fp8-rounded codes when A_MODE is 1)."""
    v = load_tile(ptr, col, col < K_VALID, ARCH)
    if A_MODE == 2:
        # fp8 codes travel as bytes: a masked load's `other` has no fp8 literal.
        v = v.to(gl.float8e4nv, bitcast=True)
    v = v.to(gl.float32)
    if A_MODE == 1:
        v = fp8_round(v, scale).to(gl.float32)
    return v


@gluon.jit
def _gemv_step(w, s, offs_n, kb, a_e, a_o, acc, K_BYTES, ARCH: gl.constexpr):
    """acc[n, kb] += W[n, 2kb] a[2kb] + W[n, 2kb+1] a[2kb+1] for one [BLOCK_N, BLOCK_KB] tile."""
    packed = load_even(w, offs_n[:, None] * K_BYTES + kb[None, :], ARCH)
    scales = load_even(s, scale_offsets(offs_n[:, None], kb[None, :], K_BYTES // 16), ARCH)
    lo, hi = dequant_mxfp4(packed, scales, gl.float32)
    return acc + lo * a_e[None, :] + hi * a_o[None, :]


@gluon.jit
def tiny_gemm1_kernel(
    x_ptr, logits_ptr, topk_w_ptr, topk_ids_ptr, x_scale_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr,
    out_scale_ptr, stride_xm, stride_lm, x_scale_stride, E, H, K_BYTES, I_PAD, alpha, limit,
    TOP_K: gl.constexpr, E_BLOCK: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_KB: gl.constexpr,
    ARCH: gl.constexpr, ROUTE: gl.constexpr, A_MODE: gl.constexpr, OUT_MODE: gl.constexpr,
    HAS_BIAS: gl.constexpr, LW: gl.constexpr, LE: gl.constexpr,
):  # fmt: skip
    """inter[pair, n] = swiglu(W13[e] x[tok] + b13[e]) for pair = tok * k + slot, n in a tile.

    ROUTE: the expert comes from the logits (and programs of tile 0 write topk ids/weights);
    else from topk_ids. w [E, 2, I_PAD, H_PAD/2], ws [E, 2, I_PAD, H_PAD/32], bias [E, 2, I_PAD].
    """
    n0 = gl.program_id(0) * BLOCK_N
    pair = gl.program_id(1)
    tok = pair // TOP_K
    if ROUTE:
        e, r = _route(logits_ptr + tok * stride_lm, E, pair % TOP_K, TOP_K, E_BLOCK, LE)
        if gl.program_id(0) == 0:
            gl.store(topk_ids_ptr + pair, e)
            gl.store(topk_w_ptr + pair, r)
    else:
        e = gl.load(topk_ids_ptr + pair)
        # An id outside [0, E) is no pair: GEMM2 writes its partial rows as zeros.
        if (e < 0) | (e >= E):
            return
    x_scale = gl.load(x_scale_ptr + tok * x_scale_stride)
    plane = I_PAD * K_BYTES
    w = w_ptr + e.to(gl.int64) * (2 * plane) + n0 * K_BYTES
    s = ws_ptr + e.to(gl.int64) * (2 * plane // 16) + n0 * (K_BYTES // 16)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LW))
    offs_kb = gl.arange(0, BLOCK_KB, layout=gl.SliceLayout(0, LW))
    acc_g = gl.zeros([BLOCK_N, BLOCK_KB], gl.float32, LW)
    acc_u = gl.zeros([BLOCK_N, BLOCK_KB], gl.float32, LW)
    x_row = x_ptr + tok * stride_xm
    for kb0 in range(0, K_BYTES, BLOCK_KB):
        kb = kb0 + offs_kb
        a_e = _load_vec(x_row, 2 * kb, H, x_scale, ARCH, A_MODE)
        a_o = _load_vec(x_row, 2 * kb + 1, H, x_scale, ARCH, A_MODE)
        acc_g = _gemv_step(w, s, offs_n, kb, a_e, a_o, acc_g, K_BYTES, ARCH)
        acc_u = _gemv_step(w + plane, s + plane // 16, offs_n, kb, a_e, a_o, acc_u, K_BYTES, ARCH)
    gate = gl.sum(acc_g, axis=1)
    up = gl.sum(acc_u, axis=1)
    if A_MODE == 1:
        gate = gate * x_scale
        up = up * x_scale
    if HAS_BIAS:
        b = bias_ptr + e * (2 * I_PAD) + n0
        gate = gate + gl.load(b + offs_n)
        up = up + gl.load(b + I_PAD + offs_n)
    act = swiglu(gate, up, alpha, limit)
    if OUT_MODE == 1:
        act = fp8_round(act, gl.load(out_scale_ptr))
    store_tile(out_ptr, pair * I_PAD + n0 + offs_n, act, offs_n < BLOCK_N, ARCH)


@gluon.jit
def tiny_gemm2_kernel(
    a_ptr, a_scale_ptr, topk_w_ptr, topk_ids_ptr, w_ptr, ws_ptr, bias_ptr, partial_ptr,
    a_scale_stride, E, K_BYTES, H_PAD, SPLIT_KB, NUM_PAIRS, BLOCK_N: gl.constexpr,
    BLOCK_KB: gl.constexpr, ARCH: gl.constexpr, A_MODE: gl.constexpr, HAS_BIAS: gl.constexpr,
    LW: gl.constexpr,
):  # fmt: skip
    """partial[split, pair, n] = r * (W2[e, n, K slice] . inter[pair, K slice] (+ b2 on split
    0)); w [E, H_PAD, I_PAD/2], ws [E, H_PAD, I_PAD/32], bias [E, H_PAD]."""
    n0 = gl.program_id(0) * BLOCK_N
    split = gl.program_id(1)
    pair = gl.program_id(2)
    e = gl.load(topk_ids_ptr + pair)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LW))
    offs = (split * NUM_PAIRS + pair) * H_PAD + n0 + offs_n
    if (e < 0) | (e >= E):
        # An id outside [0, E) contributes nothing (and reads no weights).
        zeros = gl.zeros([BLOCK_N], gl.float32, gl.SliceLayout(1, LW))
        store_tile(partial_ptr, offs, zeros, offs_n < BLOCK_N, ARCH)
        return
    r = gl.load(topk_w_ptr + pair)
    a_scale = gl.load(a_scale_ptr + pair * a_scale_stride)
    w = w_ptr + e.to(gl.int64) * (H_PAD * K_BYTES) + n0 * K_BYTES
    s = ws_ptr + e.to(gl.int64) * (H_PAD * K_BYTES // 16) + n0 * (K_BYTES // 16)
    offs_kb = gl.arange(0, BLOCK_KB, layout=gl.SliceLayout(0, LW))
    acc = gl.zeros([BLOCK_N, BLOCK_KB], gl.float32, LW)
    a_row = a_ptr + pair * (2 * K_BYTES)
    k_start = split * SPLIT_KB
    k_end = gl.minimum(k_start + SPLIT_KB, K_BYTES)
    for kb0 in range(k_start, k_end, BLOCK_KB):
        kb = kb0 + offs_kb
        a_e = _load_vec(a_row, 2 * kb, 2 * K_BYTES, a_scale, ARCH, A_MODE)
        a_o = _load_vec(a_row, 2 * kb + 1, 2 * K_BYTES, a_scale, ARCH, A_MODE)
        acc = _gemv_step(w, s, offs_n, kb, a_e, a_o, acc, K_BYTES, ARCH)
    y = gl.sum(acc, axis=1)
    if A_MODE == 1 or A_MODE == 2:
        y = y * a_scale
    if HAS_BIAS:
        y = y + gl.where(split == 0, gl.load(bias_ptr + e * H_PAD + n0 + offs_n), 0.0)
    store_tile(partial_ptr, offs, y * r, offs_n < BLOCK_N, ARCH)
