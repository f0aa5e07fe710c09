"""Weighted combine: out[t] = sum_j y[t * top_k + j] over a token's top-k pairs.

GEMM2 already added the second bias and multiplied by the routing weight (bias first, as the
contract says); this sums the k rows in float32 in a fixed order (deterministic) and rounds
once. The rows are float32, or fp16 with the elements not below a bound in magnitude kept
exact in a float32 tensor of the same shape (wgmma_gemm_sm90's fp16 pair rows).
Where routing may have left pairs out (precomputed ids outside [0, E); with expert
parallelism, ids of other ranks' experts) their rows were never written: they are skipped, a
compare on k ids per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from tokenspeed_kernel.platform import interpreting

from .._launch import bind_launches
from ._common import round_to_bf16
from .replay import recordable


@recordable
@bind_launches
@triton.jit
def _combine_kernel(
    y_ptr,
    out_ptr,
    ids_ptr,
    wide_ptr,
    half_bound,
    E_OFF,
    E,
    H,
    stride_y,
    stride_o,
    TOPK: tl.constexpr,
    SPLITS: tl.constexpr,
    CHECK_IDS: tl.constexpr,
    HALF_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INTERPRETED: tl.constexpr,
    WAIT_PRIOR: tl.constexpr,
):
    if WAIT_PRIOR:
        # Launched with programmatic dependent launch: wait for the GEMM that writes y.
        gdc_wait()
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.zeros((BLOCK_H,), tl.float32)
    for j in tl.static_range(TOPK * SPLITS):
        row_ok = mask
        if CHECK_IDS:
            expert = tl.load(ids_ptr + token * TOPK + j // SPLITS) - E_OFF
            row_ok = mask & (expert >= 0) & (expert < E)
        row = token * (TOPK * SPLITS) + j
        value = tl.load(y_ptr + row * stride_y + offs, mask=row_ok, other=0.0).to(tl.float32)
        if HALF_ROWS:
            # Not below the bound (or not finite): GEMM2 stored the exact float32 as well.
            wide = row_ok & ((tl.abs(value) < half_bound) == 0)
            value = tl.where(wide, tl.load(wide_ptr + row * stride_y + offs, mask=wide), value)
        acc += value
    tl.store(out_ptr + token * stride_o + offs, round_to_bf16(acc, INTERPRETED), mask=mask)


def combine(
    y,
    out,
    *,
    top_k: int,
    splits: int = 1,
    topk_ids=None,
    num_experts: int = 0,
    expert_offset: int = 0,
    pdl=False,
    wide=None,
    half_bound: float = 0.0,
) -> None:
    """y [M * top_k * splits, H] float32 (`splits` consecutive partial rows per pair) -> out
    [M, H] bfloat16. topk_ids [M, top_k] (global ids): skip the pairs whose id is outside
    [expert_offset, expert_offset + num_experts), the experts routing grouped. pdl: launch with
    programmatic dependent launch (CUDA sm_90+), behind a kernel that triggers it
    (wgmma_gemm_sm90's PDL). y fp16 with wide (float32, y's shape and strides): the pair rows
    of wgmma_gemm_sm90.fragment_gemm's fp16 form, elements not below half_bound in magnitude
    read from wide."""
    if (y.dtype == torch.float16) != (wide is not None):
        raise ValueError("combine: fp16 pair rows come with `wide`, float32 rows without")
    M, H = out.shape
    if M == 0:
        return
    # 1024 columns per program: 4 KB fp32 per row load, enough for full-width vector loads. A
    # decode step has a handful of tokens: narrower programs spread its rows over more SMs.
    block_h = min(1024 if M >= 64 else 256, triton.next_power_of_2(H))
    _combine_kernel[(M, triton.cdiv(H, block_h))](
        y,
        out,
        topk_ids if topk_ids is not None else y,
        wide if wide is not None else y,
        half_bound,
        expert_offset,
        num_experts,
        H,
        y.stride(0),
        out.stride(0),
        TOPK=top_k,
        SPLITS=splits,
        CHECK_IDS=topk_ids is not None,
        HALF_ROWS=wide is not None,
        BLOCK_H=block_h,
        INTERPRETED=interpreting(),
        WAIT_PRIOR=pdl,
        num_warps=4,
        # Only CUDA's launcher knows the option (HIP's rejects it).
        **({"launch_pdl": True} if pdl else {}),
    )
