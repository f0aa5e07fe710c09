"""Grouped GEMM over experts, one kernel for both MoE GEMMs.

Program (tile t, N block): tile t holds up to BLOCK_M sorted (token, expert) rows of one expert
(see routing.py). The weight tile is dequantized in registers to bf16 (exact for MXFP4, FP8 and
bf16) and fed to the matrix units with an fp32 accumulator:
- MXFP4: e2m1 codes re-encoded by moe_prepare_weights as int32 words of 8 K elements, one e8m0
  scale per 32 K elements; see mxfp4_words.py for the word format and its two decoders
  (byte-permute lookups on NVIDIA sm_90+, portable arithmetic elsewhere).
- FP8 weights: the per-output-channel scale multiplies the accumulator.
Activations are bf16, or FP8 e4m3 upcast exactly to bf16 with a per-tensor or per-row scale
applied to the accumulator (the FP8 codes times their scale, as the reference dequantizes them).

GEMM1 (SWIGLU): A rows are gathered by token from x; the N block spans interleaved gate (even)
and up (odd) rows of w13, so the epilogue adds the bias, splits the pairs and writes
`a = min(g, L) * sigmoid(alpha * min(g, L)) * (clamp(u, -L, L) + 1)` to the sorted rows: as bf16
hi + lo halves for bf16 activations (keeping the reference's float32 intermediate), FP8 directly
when a static scale is given, float32 for a dynamic per-row FP8 scale quantized later.
GEMM2: A rows are the sorted rows of `a` (hi and lo make two MMAs on the one dequantized weight
tile); the epilogue adds the bias, multiplies by the routing weight and writes fp32 rows indexed
by pair for the combine.

One kernel body over 80 lines: its K loop and both GEMMs' epilogues share the tile's row state.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._launch import bind_launches
from ._common import W_FP8, W_MXFP4, WEIGHT_FORMAT_CODES, round_to_bf16
from .e4m3 import e4m3_of
from .mxfp4_words import WORD_ELEMENTS, decode_words, decode_words_ptx
from .replay import recordable

_MXFP4 = WEIGHT_FORMAT_CODES["mxfp4"]


@triton.jit
def _weight_tile(
    weights,
    offs_n,
    k0,
    W_FORMAT: tl.constexpr,
    PTX_DECODE: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Weight rows offs_n, columns k0..k0+BLOCK_K of one expert as [BLOCK_K, BLOCK_N] bf16.
    weights: (w_ptr, ws_ptr, w_base, ws_base, stride_wn, stride_sn)."""
    w_ptr, ws_ptr, w_base, ws_base, stride_wn, stride_sn = weights
    if W_FORMAT == W_MXFP4:
        offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        words = tl.load(w_ptr + w_base + offs_n[:, None] * stride_wn + offs_w[None, :])
        offs_s = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        scale = tl.load(ws_ptr + ws_base + offs_n[:, None] * stride_sn + offs_s[None, :])
        if PTX_DECODE:
            w = decode_words_ptx(words, scale, BLOCK_N, BLOCK_K)
        else:
            w = decode_words(words, scale, BLOCK_N, BLOCK_K, INTERPRETED)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + w_base + offs_n[:, None] * stride_wn + offs_k[None, :])
        w = w.to(tl.bfloat16)
    return tl.trans(w)


@triton.jit
def _mma(a, b, acc, INTERPRETED: tl.constexpr):
    if INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _swiglu_store(
    out_ptr,
    acc,
    rows,
    activation,
    QUANT_OUT: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """rows: (offs_m, row_ok, pid_n, N, stride_om); activation: (out_scale, alpha, limit)."""
    offs_m, row_ok, pid_n, N, stride_om = rows
    out_scale, alpha, limit = activation
    g, u = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))
    g = tl.minimum(g, limit)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    act = g * tl.sigmoid(alpha * g) * (u + 1.0)
    if QUANT_OUT:
        act = e4m3_of(act, out_scale, INTERPRETED)
    offs_o = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_o[None, :]
    if out_ptr.dtype.element_ty == tl.bfloat16:
        # bf16 hi + lo halves carry 16 of float32's mantissa bits: GEMM2 multiplies both, so it
        # sees `a` at float32-like precision (a single bf16 rounding puts ~0.4% of GPT-OSS-sized
        # outputs over the bf16 tolerance: scripts/moe_intermediate_precision.py); the row is
        # [hi (N/2 columns) | lo (N/2 columns)].
        hi = round_to_bf16(act, INTERPRETED)
        lo = round_to_bf16(act - hi.to(tl.float32), INTERPRETED)
        tl.store(ptrs, hi, mask=row_ok[:, None])
        tl.store(ptrs + N // 2, lo, mask=row_ok[:, None])
    else:
        tl.store(ptrs, act, mask=row_ok[:, None])


@recordable
@bind_launches
@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    a_scale_ptr,
    a_scale,
    w_ptr,
    ws_ptr,
    bias_ptr,
    out_ptr,
    route_w_ptr,
    sorted_ptr,
    tiles_ptr,
    num_tiles_ptr,
    N,
    K,
    K_VALID,
    N_VALID,
    stride_am,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_be,
    stride_om,
    out_scale,
    alpha,
    limit,
    TOPK: tl.constexpr,
    W_FORMAT: tl.constexpr,
    PTX_DECODE: tl.constexpr,
    A_SCALE: tl.constexpr,
    GATHER_A: tl.constexpr,
    SPLIT_A: tl.constexpr,
    SWIGLU: tl.constexpr,
    QUANT_OUT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """A_SCALE: 0 none, 1 per tensor (a_scale), 2 per A row (a_scale_ptr). INTERPRETED (the
    Triton 3.6 interpreter, whose bf16 tl.dot multiplies raw bits and whose bf16 cast truncates)
    feeds the dot the same exact operand values as float32 and rounds bf16 stores on the bits."""
    pid = tl.program_id(0)
    num_n = N // BLOCK_N
    tile = pid // num_n
    pid_n = pid % num_n
    if tile >= tl.load(num_tiles_ptr):
        return
    expert = tl.load(tiles_ptr + 2 * tile).to(tl.int64)
    row_end = tl.load(tiles_ptr + 2 * tile + 1)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < row_end
    pair = tl.load(sorted_ptr + offs_m, mask=row_ok, other=0)
    a_rows = pair // TOPK if GATHER_A else offs_m
    a_rows = a_rows.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_base = expert * stride_we
    ws_base = expert * stride_se
    weights = (w_ptr, ws_ptr, w_base, ws_base, stride_wn, stride_sn)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a_mask = row_ok[:, None] & (k0 + offs_k < K_VALID)[None, :]
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + (k0 + offs_k)[None, :], mask=a_mask, other=0.0
        )
        b = _weight_tile(weights, offs_n, k0, W_FORMAT, PTX_DECODE, INTERPRETED, BLOCK_N, BLOCK_K)
        if SPLIT_A:
            # GEMM1 stored the SwiGLU rows as [hi | lo] bf16 halves: two MMAs on the one
            # dequantized weight tile.
            lo = tl.load(
                a_ptr + a_rows[:, None] * stride_am + (K + k0 + offs_k)[None, :],
                mask=a_mask,
                other=0.0,
            )
            acc = _mma(a, b, acc, INTERPRETED)
            acc = _mma(lo, b, acc, INTERPRETED)
        else:
            acc = _mma(a.to(tl.bfloat16), b, acc, INTERPRETED)
    if W_FORMAT == W_FP8:
        acc *= tl.load(ws_ptr + ws_base + offs_n)[None, :]
    if A_SCALE == 1:
        acc *= a_scale
    elif A_SCALE == 2:
        acc *= tl.load(a_scale_ptr + a_rows, mask=row_ok, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + offs_n)[None, :]
    if SWIGLU:
        rows = (offs_m, row_ok, pid_n, N, stride_om)
        activation = (out_scale, alpha, limit)
        _swiglu_store(out_ptr, acc, rows, activation, QUANT_OUT, INTERPRETED, BLOCK_M, BLOCK_N)
    else:
        acc *= tl.load(route_w_ptr + pair, mask=row_ok, other=0.0)[:, None]
        ptrs = out_ptr + pair[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(ptrs, acc, mask=row_ok[:, None] & (offs_n < N_VALID)[None, :])


# ----------------------------------------------------------------------------- host side


def grouped_gemm(
    a,
    a_scale,
    w,
    w_scale,
    bias,
    out,
    routing,
    *,
    w_format: int,
    gemm1: bool,
    k_valid: int,
    n_valid: int,
    config,
    interpreted: bool,
    ptx_decode: bool = False,
    out_scale: float | None = None,
    alpha: float = 0.0,
    limit: float = 0.0,
):
    """One grouped GEMM over the tiles of `routing` (see routing.route).

    a [rows, K] (x [M, H] gathered by token for GEMM1, the sorted `a` rows for GEMM2); a_scale
    None, a float (per tensor) or [rows] float32; w [E, N, K] (mxfp4: [E, N, K/2] uint8 with
    w_scale [E, N, K/32]; fp8: w_scale [E, N] float32); bias [E, N] float32 or None.
    GEMM1 writes the SwiGLU rows to out [sorted rows, N/2]; GEMM2 writes routing-weighted rows
    to out [M * top_k, n_valid] float32.
    """
    topk_weights, sorted_pairs, tiles, num_tiles, max_tiles, top_k = routing
    N = w.shape[1]
    K = w.shape[2] * (WORD_ELEMENTS if w_format == _MXFP4 else 1)
    block_n = config.block_n1 if gemm1 else config.block_n2
    a_scale_mode = 0 if a_scale is None else (1 if isinstance(a_scale, float) else 2)
    scale_ptr = a_scale if a_scale_mode == 2 else a
    ws = w_scale if w_scale is not None else w
    grid = (max_tiles * (N // block_n),)
    _grouped_gemm_kernel[grid](
        a,
        scale_ptr,
        a_scale if a_scale_mode == 1 else 1.0,
        w,
        ws,
        bias if bias is not None else ws,
        out,
        topk_weights,
        sorted_pairs,
        tiles,
        num_tiles,
        N,
        K,
        k_valid,
        n_valid,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        ws.stride(0) if w_scale is not None else 0,
        ws.stride(1) if w_format == _MXFP4 else 0,
        bias.stride(0) if bias is not None else 0,
        out.stride(0),
        1.0 if out_scale is None else out_scale,
        alpha,
        limit,
        TOPK=top_k,
        W_FORMAT=w_format,
        PTX_DECODE=ptx_decode,
        A_SCALE=a_scale_mode,
        GATHER_A=gemm1,
        SPLIT_A=not gemm1 and a.dtype == torch.bfloat16,
        SWIGLU=gemm1,
        QUANT_OUT=out_scale is not None,
        HAS_BIAS=bias is not None,
        INTERPRETED=interpreted,
        BLOCK_M=config.block_m,
        BLOCK_N=block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
