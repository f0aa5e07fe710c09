"""Merge of the split-KV decode partials (decode.py): one program per (sequence, token, query
head) combines the splits' normalized outputs by their log-sum-exps and adds the sink once."""

from __future__ import annotations

import math

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ._common import load, rows_layout, store
from ._launch import optional_operands


@gluon.jit
def _reduce_kernel(
    o_part_ptr,
    lse_part_ptr,
    out_ptr,
    lse_ptr,
    sinks_ptr,
    stride_ob,
    stride_ot,
    stride_oh,
    stride_lb,
    stride_lt,
    stride_lh,
    ARCH: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    NUM_Q_HEADS: gl.constexpr,
    Q_LEN: gl.constexpr,
    SPLITS: gl.constexpr,
    BLOCK_S: gl.constexpr,
    NUM_WARPS: gl.constexpr,
    HAS_SINKS: gl.constexpr,
    HAS_LSE: gl.constexpr,
    BUFFER: gl.constexpr,
):
    """out = sum_s w_s o_s / (sum_s w_s + exp(sink - M)), w_s = exp(lse_s - M): the sink joins
    the denominator once, here, and never in the partials."""
    LD: gl.constexpr = rows_layout(ARCH, NUM_WARPS, HEAD_DIM, 4)
    row = gl.program_id(0)  # (seq * Q_LEN + token) * NUM_Q_HEADS + head
    head = row % NUM_Q_HEADS
    tok = (row // NUM_Q_HEADS) % Q_LEN
    seq = (row // NUM_Q_HEADS // Q_LEN).to(gl.int64)
    s = gl.arange(0, BLOCK_S, layout=gl.SliceLayout(1, LD))
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LD))
    lse_s = load(lse_part_ptr + row.to(gl.int64) * SPLITS, s, s < SPLITS, BUFFER)
    lse_s = gl.where(s < SPLITS, lse_s, float("-inf"))
    m = gl.max(lse_s, 0)
    if HAS_SINKS:
        sink = gl.load(sinks_ptr + head).to(gl.float32)
        m = gl.maximum(m, sink)
    m_use = gl.where(m == float("-inf"), 0.0, m)
    w = gl.exp(lse_s - m_use)
    denom = gl.sum(w, 0)
    if HAS_SINKS:
        # sink = +inf takes all the mass: its term is 1 (not exp(inf - inf)), the rest 0.
        denom = denom + gl.where(sink == m_use, 1.0, gl.exp(sink - m_use))
    offs = gl.expand_dims(s, 1) * HEAD_DIM + gl.expand_dims(d, 0)
    o_s = load(
        o_part_ptr + row.to(gl.int64) * (SPLITS * HEAD_DIM),
        offs,
        gl.expand_dims(s < SPLITS, 1),
        BUFFER,
    )
    o = gl.sum(o_s * gl.expand_dims(w, 1), 0) / gl.where(denom > 0.0, denom, 1.0)
    dst = out_ptr + seq * stride_ob + tok * stride_ot + head * stride_oh
    store(dst, d, o.to(out_ptr.dtype.element_ty), d < HEAD_DIM, BUFFER)
    if HAS_LSE:
        lse = gl.where(
            denom > 0.0, m_use + gl.log(gl.where(denom > 0.0, denom, 1.0)), float("-inf")
        )
        gl.store(lse_ptr + seq * stride_lb + tok * stride_lt + head * stride_lh, lse)


def launch_reduce(o_part, lse_part, out, lse, sinks, arch_code: int, buffer: bool) -> None:
    """o_part [B, Q, Hq, S, D] / lse_part [B, Q, Hq, S] float32 -> out [B, Q, Hq, D] (and lse
    [B, Q, Hq] when given)."""
    num_seqs, q_len, num_q_heads, splits, head_dim = o_part.shape
    lse_arg, sinks_arg, lse_strides = optional_operands(out, lse, sinks, 3)
    _reduce_kernel[(num_seqs * q_len * num_q_heads,)](
        o_part, lse_part, out, lse_arg, sinks_arg, *out.stride()[:3], *lse_strides,
        ARCH=arch_code, HEAD_DIM=head_dim, NUM_Q_HEADS=num_q_heads, Q_LEN=q_len,
        SPLITS=splits, BLOCK_S=max(2, 1 << math.ceil(math.log2(splits))), NUM_WARPS=1,
        HAS_SINKS=sinks is not None, HAS_LSE=lse is not None, BUFFER=buffer, num_warps=1,
    )  # fmt: skip
