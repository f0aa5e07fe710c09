"""`mha_prefill` through FlashAttention-3 (ragged q/k/v, causal or not, window, sinks, GQA).

Priority 95, below the Triton prefill (100). FA3 leads causal prefill from S=4096 on, ours
leads at S=1024 and with window 127 (`benchmarks/results/kernels_h100.md`). One priority
cannot follow the shape; the measured ranking (`tokenspeed-kernel tune`) picks FA3 where it
wins.
"""

from __future__ import annotations

from .._attention import clamp_offsets
from ._common import TRAITS, fa3_forward, register_fa3

PRIORITY = 95


def mha_prefill(
    q, k, v, *, cu_seqlens, max_seqlen, causal, window_left, sinks, softmax_scale, out, lse
) -> None:
    """q [T, Hq, D], k/v [T, Hkv, D] ragged by cu_seqlens [B+1] int32; writes out [T, Hq, D]
    and lse [T, Hq] float32 if given."""
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return
    cu = clamp_offsets(cu_seqlens, num_tokens)
    fa3_forward(
        q, k, v, out=out, lse=lse, sinks=sinks, softmax_scale=softmax_scale, causal=causal,
        window_left=window_left, rows=lambda x: x.t(), cu_seqlens_q=cu,
        cu_seqlens_k=cu, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, num_splits=1,
    )  # fmt: skip


def register() -> None:
    traits = dict(TRAITS, non_causal=True)
    description = (
        "FlashAttention-3 varlen forward (tokenspeed-fa3), sm_90; sinks bf16 holds exactly native, "
        "other sinks or lse merged exactly afterwards"
    )
    register_fa3("mha_prefill", mha_prefill, traits, description, PRIORITY)
