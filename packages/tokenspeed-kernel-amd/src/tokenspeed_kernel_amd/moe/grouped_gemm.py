"""Grouped-GEMM MoE path (medium and large batches): pairs (token, expert) grouped by expert into
BLOCK_M row blocks; GEMM1 with bias, clamped SwiGLU and FP8 requantization fused into its
epilogue; GEMM2 with bias and the routing weight fused, writing one row per pair.

MXFP4 weights are read as packed bytes plus e8m0 scales and either decoded in registers to bf16
(gfx942, bf16 activations on gfx950, and the NVIDIA `mma_v2` test instantiation) or fed as-is to
the gfx950 scaled MFMA with FP8 activations (`SCALED`). Both read the same byte and scale tiles
through the same offsets; decoding splits each byte into the even and odd K elements, so the
dequantizing path multiplies them with the even and odd activation columns (two MMAs per step).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.amd import cdna4

from ._common import (
    DROPPED_BLOCK,
    dequant_mxfp4,
    fp8_round,
    load_even,
    load_tile,
    mma,
    scale_offsets,
    store_tile,
    swiglu,
)

# A_MODE and OUT_MODE values are `_common`'s A_* and OUT_* constants.
DROPPED = gl.constexpr(DROPPED_BLOCK)


@gluon.jit
def _load_a(
    a_ptr,
    row_off,
    row_mask,
    row_scale,
    col,
    K_VALID,
    ARCH: gl.constexpr,
    A_MODE: gl.constexpr,
    OUT_DTYPE: gl.constexpr,
):
    """A[rows, col] as OUT_DTYPE (bf16 operand, or fp8 codes for the scaled MFMA)."""
    mask = row_mask[:, None] & (col < K_VALID)[None, :]
    v = load_tile(a_ptr, row_off[:, None] + col[None, :], mask, ARCH)
    if A_MODE == 1:
        v = fp8_round(v.to(gl.float32), row_scale[:, None])
    elif A_MODE == 2:
        # fp8 codes travel as bytes: a masked load's `other` has no fp8 literal.
        v = v.to(gl.float8e4nv, bitcast=True)
    return v.to(OUT_DTYPE)


@gluon.jit
def _dequant_mma(
    a_e,
    a_o,
    packed,
    scales,
    acc,
    ARCH: gl.constexpr,
    A_MODE: gl.constexpr,
    DOT_A: gl.constexpr,
    DOT_B: gl.constexpr,
):
    """acc += A_even W_even + A_odd W_odd with the packed tile decoded to bf16 in registers."""
    w_e, w_o = dequant_mxfp4(packed, scales, gl.bfloat16)
    w_e = gl.convert_layout(w_e, DOT_B)
    w_o = gl.convert_layout(w_o, DOT_B)
    hi_e = a_e.to(gl.bfloat16)
    hi_o = a_o.to(gl.bfloat16)
    acc = mma(gl.convert_layout(hi_e, DOT_A), w_e, acc, ARCH)
    acc = mma(gl.convert_layout(hi_o, DOT_A), w_o, acc, ARCH)
    if A_MODE == 3:
        # bf16 hi + bf16 lo carry 16 of float32's 24 mantissa bits: the bf16-activation path
        # then matches a float32 intermediate instead of adding a bf16 rounding per element.
        lo_e = (a_e - hi_e.to(gl.float32)).to(gl.bfloat16)
        lo_o = (a_o - hi_o.to(gl.float32)).to(gl.bfloat16)
        acc = mma(gl.convert_layout(lo_e, DOT_A), w_e, acc, ARCH)
        acc = mma(gl.convert_layout(lo_o, DOT_A), w_o, acc, ARCH)
    return acc


@gluon.jit
def _mainloop(
    a_ptr, row_off, row_mask, row_scale, K_VALID, w0, w1, s0, s1, K_BYTES, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, TWO: gl.constexpr, ARCH: gl.constexpr, A_MODE: gl.constexpr,
    SCALED: gl.constexpr, MMA: gl.constexpr, DOT_A: gl.constexpr, DOT_B: gl.constexpr,
    LOAD_A: gl.constexpr, LOAD_W: gl.constexpr, SCALE_B: gl.constexpr,
):  # fmt: skip
    """acc_p[m, n] = sum_k A[m, k] W_p[n, k] over the whole K for weight planes p = 0 (and 1)."""
    BKB: gl.constexpr = 64
    S_ROW = K_BYTES // 16
    offs_kb = gl.arange(0, BKB, layout=gl.SliceLayout(1, LOAD_W))
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, LOAD_W))
    w_offs = offs_n[None, :] * K_BYTES + offs_kb[:, None]
    if SCALED:
        offs_sn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, SCALE_B))
        offs_j = gl.arange(0, BKB // 16, layout=gl.SliceLayout(0, SCALE_B))
        s_offs = scale_offsets(offs_sn[:, None], 16 * offs_j[None, :], S_ROW)
    else:
        s_offs = scale_offsets(offs_n[None, :], offs_kb[:, None], S_ROW)
    offs_ka = gl.arange(0, BKB, layout=gl.SliceLayout(0, LOAD_A))
    # A_SPLIT keeps the float32 operand and multiplies it as bf16 hi + lo parts.
    A_DT: gl.constexpr = gl.float32 if A_MODE == 3 else gl.bfloat16
    acc0 = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA)
    acc1 = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA)
    for kb0 in range(0, K_BYTES, BKB):
        p0 = load_even(w0 + kb0, w_offs, ARCH)
        c0 = load_even(s0 + kb0 // 16, s_offs, ARCH)
        if TWO:
            p1 = load_even(w1 + kb0, w_offs, ARCH)
            c1 = load_even(s1 + kb0 // 16, s_offs, ARCH)
        if SCALED:
            offs_k = gl.arange(0, 2 * BKB, layout=gl.SliceLayout(0, LOAD_A))
            a = _load_a(
                a_ptr, row_off, row_mask, row_scale, 2 * kb0 + offs_k, K_VALID, ARCH, A_MODE,
                gl.float8e4nv,
            )  # fmt: skip
            a = gl.convert_layout(a, DOT_A)
            acc0 = cdna4.mfma_scaled(
                a, None, "e4m3", gl.convert_layout(p0, DOT_B), c0, "e2m1", acc0
            )
            if TWO:
                acc1 = cdna4.mfma_scaled(
                    a, None, "e4m3", gl.convert_layout(p1, DOT_B), c1, "e2m1", acc1
                )
        else:
            col = 2 * (kb0 + offs_ka)
            a_e = _load_a(a_ptr, row_off, row_mask, row_scale, col, K_VALID, ARCH, A_MODE, A_DT)
            a_o = _load_a(a_ptr, row_off, row_mask, row_scale, col + 1, K_VALID, ARCH, A_MODE, A_DT)
            acc0 = _dequant_mma(a_e, a_o, p0, c0, acc0, ARCH, A_MODE, DOT_A, DOT_B)
            if TWO:
                acc1 = _dequant_mma(a_e, a_o, p1, c1, acc1, ARCH, A_MODE, DOT_A, DOT_B)
    return acc0, acc1


@gluon.jit
def _block_rows(
    rows_ptr,
    a_scale_ptr,
    a_scale_stride,
    ROW_OF_PAIR: gl.constexpr,
    TOP_K,
    stride_am,
    BLOCK_M: gl.constexpr,
    LAYOUT: gl.constexpr,
):
    """This block's pairs, validity, A row offsets and A row scales (1 where unused).

    GEMM1 reads token rows of x (pair // k); GEMM2 reads its own rows of the intermediate.
    """
    offs_m = gl.program_id(0) * BLOCK_M + gl.arange(0, BLOCK_M, layout=LAYOUT)
    pair = gl.load(rows_ptr + offs_m)
    valid = pair >= 0
    if ROW_OF_PAIR:
        a_row = gl.where(valid, pair // TOP_K, 0)
    else:
        a_row = offs_m
    scale = gl.load(a_scale_ptr + a_row * a_scale_stride, mask=valid, other=1.0)
    return pair, valid, a_row * stride_am, scale


@gluon.jit
def _store_zero_rows(
    rows_ptr, y_ptr, n0, H_PAD, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    ARCH: gl.constexpr, MMA: gl.constexpr,
):  # fmt: skip
    """y[pair, n0 : n0 + BLOCK_N] = 0 for this block's pairs."""
    offs_m = gl.program_id(0) * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, MMA))
    pair = gl.load(rows_ptr + offs_m)
    mask = pair >= 0
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))
    offs = gl.where(mask, pair, 0)[:, None] * H_PAD + offs_n[None, :]
    zeros = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA)
    store_tile(y_ptr, offs, zeros, mask[:, None], ARCH)


@gluon.jit
def moe_gemm1_kernel(
    x_ptr, x_scale_ptr, w_ptr, ws_ptr, bias_ptr, rows_ptr, block_expert_ptr, out_ptr,
    out_scale_ptr, stride_xm, x_scale_stride, H, K_BYTES, I_PAD, TOP_K, alpha, limit,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, ARCH: gl.constexpr, A_MODE: gl.constexpr,
    OUT_MODE: gl.constexpr, HAS_BIAS: gl.constexpr, SCALED: gl.constexpr, MMA: gl.constexpr,
    DOT_A: gl.constexpr, DOT_B: gl.constexpr, LOAD_A: gl.constexpr, LOAD_W: gl.constexpr,
    SCALE_B: gl.constexpr,
):  # fmt: skip
    """inter[r, n] = swiglu(x[tok] . W13[e, gate/up, n] + b13) for block rows r of expert e.

    w [E, 2, I_PAD, H_PAD/2] packed e2m1, ws [E, 2, I_PAD, H_PAD/32] e8m0, bias [E, 2, I_PAD].
    """
    e = gl.load(block_expert_ptr + gl.program_id(0))
    if e < 0:
        return
    n0 = gl.program_id(1) * BLOCK_N
    _, valid, a_off, a_scale = _block_rows(
        rows_ptr, x_scale_ptr, x_scale_stride, True, TOP_K, stride_xm, BLOCK_M,
        gl.SliceLayout(1, LOAD_A),
    )  # fmt: skip
    plane = I_PAD * K_BYTES
    w0 = w_ptr + e.to(gl.int64) * (2 * plane) + n0 * K_BYTES
    s0 = ws_ptr + e.to(gl.int64) * (2 * plane // 16) + n0 * (K_BYTES // 16)
    gate, up = _mainloop(
        x_ptr, a_off, valid, a_scale, H, w0, w0 + plane, s0, s0 + plane // 16, K_BYTES, BLOCK_M,
        BLOCK_N, True, ARCH, A_MODE, SCALED, MMA, DOT_A, DOT_B, LOAD_A, LOAD_W, SCALE_B,
    )  # fmt: skip
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))
    if A_MODE == 1:
        row_scale = gl.convert_layout(a_scale, gl.SliceLayout(1, MMA))[:, None]
        gate = gate * row_scale
        up = up * row_scale
    if HAS_BIAS:
        b = bias_ptr + e * (2 * I_PAD)
        gate = gate + gl.load(b + offs_n)[None, :]
        up = up + gl.load(b + I_PAD + offs_n)[None, :]
    act = swiglu(gate, up, alpha, limit)
    offs_m = gl.program_id(0) * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, MMA))
    mask = gl.convert_layout(valid, gl.SliceLayout(1, MMA))[:, None]
    offs = offs_m[:, None] * I_PAD + offs_n[None, :]
    if OUT_MODE == 1:
        act = fp8_round(act, gl.load(out_scale_ptr))
    store_tile(out_ptr, offs, act, mask, ARCH)


@gluon.jit
def moe_gemm2_kernel(
    a_ptr, a_scale_ptr, w_ptr, ws_ptr, bias_ptr, rows_ptr, block_expert_ptr, topk_w_ptr, y_ptr,
    a_scale_stride, K_BYTES, H_PAD, TOP_K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    ARCH: gl.constexpr, A_MODE: gl.constexpr, HAS_BIAS: gl.constexpr, SCALED: gl.constexpr,
    MMA: gl.constexpr, DOT_A: gl.constexpr, DOT_B: gl.constexpr, LOAD_A: gl.constexpr,
    LOAD_W: gl.constexpr, SCALE_B: gl.constexpr,
):  # fmt: skip
    """y[pair, n] = r_pair * (inter[r] . W2[e, n] + b2[e, n]) for block rows r of expert e.

    w [E, H_PAD, I_PAD/2], ws [E, H_PAD, I_PAD/32], bias [E, H_PAD], y [M*k, H_PAD] float32.
    """
    e = gl.load(block_expert_ptr + gl.program_id(0))
    n0 = gl.program_id(1) * BLOCK_N
    if e == DROPPED:
        # Pairs with an id outside [0, E): zero rows, so the host sum adds nothing for them.
        _store_zero_rows(rows_ptr, y_ptr, n0, H_PAD, BLOCK_M, BLOCK_N, ARCH, MMA)
    if e < 0:
        return
    pair, valid, a_off, a_scale = _block_rows(
        rows_ptr, a_scale_ptr, a_scale_stride, False, TOP_K, 2 * K_BYTES, BLOCK_M,
        gl.SliceLayout(1, LOAD_A),
    )  # fmt: skip
    w0 = w_ptr + e.to(gl.int64) * (H_PAD * K_BYTES) + n0 * K_BYTES
    s0 = ws_ptr + e.to(gl.int64) * (H_PAD * K_BYTES // 16) + n0 * (K_BYTES // 16)
    acc, _ = _mainloop(
        a_ptr, a_off, valid, a_scale, 2 * K_BYTES, w0, w0, s0, s0, K_BYTES, BLOCK_M, BLOCK_N,
        False, ARCH, A_MODE, SCALED, MMA, DOT_A, DOT_B, LOAD_A, LOAD_W, SCALE_B,
    )  # fmt: skip
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))
    if A_MODE == 1 or A_MODE == 2:
        acc = acc * gl.convert_layout(a_scale, gl.SliceLayout(1, MMA))[:, None]
    if HAS_BIAS:
        acc = acc + gl.load(bias_ptr + e * H_PAD + offs_n)[None, :]
    pair = gl.convert_layout(pair, gl.SliceLayout(1, MMA))
    mask = pair >= 0
    r = gl.load(topk_w_ptr + pair, mask=mask, other=0.0)
    offs = gl.where(mask, pair, 0)[:, None] * H_PAD + offs_n[None, :]
    store_tile(y_ptr, offs, acc * r[:, None], mask[:, None], ARCH)
