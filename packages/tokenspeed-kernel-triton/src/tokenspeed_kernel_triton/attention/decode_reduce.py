"""Phase 2 of split-KV decode: merge the per-split partials of each query row and add the
attention sink exactly once.

Each split s left o_s (its output normalized by its own denominator) and lse_s (log2 of that
denominator plus its running max; -inf for a split that saw no key). With M the max of the
lse_s and the sink, out = sum_s 2^(lse_s - M) o_s / (sum_s 2^(lse_s - M) + 2^(sink - M)) and
lse = M + log2(denominator), returned in natural log.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._launch import bind_launches
from ._common import LN2, LOG2E


@bind_launches
@triton.jit
def _decode_reduce_kernel(
    MidO,
    MidLse,
    Sinks,
    Out,
    Lse,
    num_q_heads,
    stride_ob,
    stride_ot,
    stride_oh,
    stride_lb,
    stride_lt,
    stride_lh,
    Q_LEN: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_LSE: tl.constexpr,
):
    row = tl.program_id(0)  # (b * Q_LEN + t) * num_q_heads + h, the partials' row order
    head = row % num_q_heads
    t = (row // num_q_heads) % Q_LEN
    b = row // (num_q_heads * Q_LEN)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    split_ok = offs_s < NUM_SPLITS
    lse_s = tl.load(MidLse + row * NUM_SPLITS + offs_s, mask=split_ok, other=float("-inf"))
    m = tl.max(lse_s, 0)
    if HAS_SINKS:
        sink = tl.load(Sinks + head).to(tl.float32) * LOG2E
        m = tl.maximum(m, sink)
    # Nothing visible and no sink: m = -inf; shift by 0 so every weight is 0, not NaN.
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse_s - m)
    denom = tl.sum(w, 0)
    if HAS_SINKS:
        # sink == m: the term is exactly 1, also for sink = +inf (all the mass: out 0, lse +inf)
        # where sink - m is NaN.
        denom += tl.math.exp2(tl.where(sink == m, 0.0, sink - m))
    o_ptrs = MidO + (row * NUM_SPLITS + offs_s[:, None]) * HEAD_DIM + offs_d[None, :]
    o_s = tl.load(o_ptrs, mask=split_ok[:, None], other=0.0)
    o = tl.sum(o_s * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    out_ptrs = Out + b * stride_ob + t * stride_ot + head * stride_oh + offs_d
    tl.store(out_ptrs, o.to(Out.dtype.element_ty))
    if HAS_LSE:
        lse = (m + tl.math.log2(denom)) * LN2
        tl.store(Lse + b * stride_lb + t * stride_lt + head * stride_lh, lse)


def decode_reduce(
    mid_o, mid_lse, sinks, out, lse, batch, q_len, num_q_heads, head_dim, splits
) -> None:
    """mid_o [B*Q*Hq, splits, D], mid_lse [B*Q*Hq, splits] float32 -> out [B, Q, Hq, D] and
    lse [B, Q, Hq] (or None)."""
    rows = batch * q_len * num_q_heads
    if rows == 0:
        return
    block_s = triton.next_power_of_2(splits)
    lse_t = lse if lse is not None else out
    lse_strides = lse.stride() if lse is not None else (0, 0, 0)
    # One row per program: [splits, D] floats (<= 128 x 128) stay in registers of 4 warps.
    _decode_reduce_kernel[(rows,)](
        mid_o,
        mid_lse,
        sinks if sinks is not None else mid_lse,
        out,
        lse_t,
        num_q_heads,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        *lse_strides,
        Q_LEN=q_len,
        HEAD_DIM=head_dim,
        NUM_SPLITS=splits,
        BLOCK_S=block_s,
        HAS_SINKS=sinks is not None,
        HAS_LSE=lse is not None,
        num_warps=4 if block_s * head_dim >= 2048 else 1,
    )
