"""FP8 e4m3 activation quantization per row (dynamic, per token) or per tensor (static), rounded
as core's `quantize_fp8` (e4m3.py). The e4m3 values may be stored as fp8 (in K order, or at
their MMA positions for the Hopper kernel's e4m3 fragments, zero-padded to whole 128-column
chunks: e4m3_fragments_sm90.py) or, exactly, as bf16 / fp16 (for the Hopper kernel's
half-precision operands).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tokenspeed_kernel.platform import interpreting

from .._launch import bind_launches
from .e4m3 import dynamic_scale, e4m3_of
from .replay import recordable
from .workspace import scratch


@recordable
@bind_launches
@triton.jit
def _quant_rows_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    static_scale,
    n_cols,
    n_store,
    stride_x,
    stride_q,
    tiles_ptr,
    num_tiles_ptr,
    lo_offset,
    DYNAMIC: tl.constexpr,
    MMA_ORDER: tl.constexpr,
    HI_LO: tl.constexpr,
    TILED: tl.constexpr,
    TILE_M: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERPRETED: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        # Between the Hopper GEMMs: the next one may start (and stream its weights) now, and
        # it waits for this grid; this grid waits for the GEMM that wrote x.
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    if TILED:
        # Rows of the grouped GEMM's output: only those below their tile's end were written
        # (and only those are read next); the rest of the scratch is never touched.
        tile = row // TILE_M
        if tile >= tl.load(num_tiles_ptr):
            return
        if row >= tl.load(tiles_ptr + 2 * tile + 1):
            return
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if DYNAMIC:
        scale = dynamic_scale(x)
        tl.store(scale_ptr + row, scale)
    else:
        scale = static_scale
    q = e4m3_of(x, scale, INTERPRETED)
    if q_ptr.dtype.element_ty != tl.float8e4nv:
        q = q.to(tl.float32).to(q_ptr.dtype.element_ty)  # exact: e4m3 fits bf16 and fp16
    if MMA_ORDER:
        # Column k at its MMA position (e4m3_fragments_sm90.mma_positions), zeros up to n_store.
        t = offs % 128
        position = offs - t + t // 8 % 4 * 32 + t // 4 % 2 * 16 + t // 32 * 4 + t % 4
        tl.store(q_ptr + row * stride_q + position, q, mask=offs < n_store)
    else:
        tl.store(q_ptr + row * stride_q + offs, q, mask=mask)
    if HI_LO:
        # q's rows are bf16 [hi | lo] pairs (the Hopper kernel's intermediate): the value in hi.
        tl.store(q_ptr + row * stride_q + lo_offset + offs, tl.zeros_like(q), mask=mask)


def quantize_rows(
    x,
    static_scale: float | None,
    slot: str,
    tiles=None,
    *,
    values_as=None,
    into=None,
    lo_offset=0,
    pdl=False,
    mma_order=False,
):
    """x [rows, n] -> (q [rows, n] float8_e4m3fn, scale): a float for a static scale, else
    [rows] float32 (one per row). Both tensors are the MoE call's scratch (workspace.py)
    under `slot`: valid until the next MoE call on the stream. tiles: (tile table, tile count
    on the device, rows per tile) when x is a grouped GEMM's output, whose rows past their
    tile's end hold nothing: those rows are skipped, their q and scale left unwritten.
    values_as: store the e4m3 values as this dtype (bfloat16 / float16 hold them exactly)
    instead of float8_e4m3fn. into: write q there instead, a [rows, >= n] tensor of such a
    dtype. lo_offset > 0: into's rows are bf16 [hi | lo] pairs, lo lo_offset columns after
    hi: q goes to hi, lo is zeroed. mma_order: float8_e4m3fn q of [rows, n rounded up to 128]
    with each column at its MMA position and the padding zero (e4m3_fragments_sm90). pdl:
    launch with programmatic dependent launch (CUDA sm_90+) behind a kernel that triggers
    it, and trigger the next one."""
    rows, n = x.shape
    n_store = -(-n // 128) * 128 if mma_order else n
    if into is not None:
        q = into
    else:
        q = scratch(f"{slot}_q", (rows, n_store), values_as or torch.float8_e4m3fn, x.device)
    if mma_order and (q.dtype != torch.float8_e4m3fn or q.shape[1] < n_store or lo_offset):
        raise ValueError(
            f"quantize_rows: MMA order writes float8_e4m3fn rows of {n_store} columns, got "
            f"{q.dtype} x {q.shape[1]}"
        )
    scale = static_scale
    if static_scale is None:
        scale = scratch(f"{slot}_scale", (rows,), torch.float32, x.device)
    if rows:
        # One program holds a whole row: the dynamic scale needs the row's amax before any store.
        block = triton.next_power_of_2(n_store)
        _quant_rows_kernel[(rows,)](
            x,
            q,
            scale if static_scale is None else x,
            1.0 if static_scale is None else static_scale,
            n,
            n_store,
            x.stride(0),
            q.stride(0),
            *(tiles[:2] if tiles else (x, x)),
            lo_offset,
            DYNAMIC=static_scale is None,
            MMA_ORDER=mma_order,
            HI_LO=lo_offset > 0,
            TILED=tiles is not None,
            TILE_M=tiles[2] if tiles else 1,
            BLOCK=block,
            INTERPRETED=interpreting(),
            PDL=pdl,
            num_warps=4 if block <= 4096 else 8,
            # Only CUDA's launcher knows the option (HIP's rejects it).
            **({"launch_pdl": True} if pdl else {}),
        )
    return q, scale
