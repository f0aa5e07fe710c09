"""`mha_decode_with_kvcache` through FlashAttention-3's paged forward with its split-KV
heuristic (num_splits=0): Q new tokens per sequence, causal among themselves.

Priority 90, below the Triton decode (100): behind it at every GPT-OSS decode bucket measured
(`benchmarks/results/kernels_h100.md`); the measured ranking decides per shape.
"""

from __future__ import annotations

from tokenspeed_kernel.registry import ANY

from .._attention import clamp_page_table, clamp_seqlens
from ._common import TRAITS, fa3_forward, register_fa3

PRIORITY = 90


def mha_decode_with_kvcache(
    q, k_cache, v_cache, *, page_table, cache_seqlens, window_left, sinks, softmax_scale,
    k_scale, v_scale, out, lse,
) -> None:  # fmt: skip
    """q [B, Q, Hq, D]; caches [num_pages, P, Hkv, D]; writes out [B, Q, Hq, D] and lse
    [B, Q, Hq] if given. k_scale/v_scale are 1.0 (FP8 caches are declined)."""
    if q.shape[0] == 0:
        return
    fa3_forward(
        q, k_cache, v_cache, out=out, lse=lse, sinks=sinks, softmax_scale=softmax_scale,
        causal=True, window_left=window_left, rows=lambda x: x.transpose(1, 2),
        seqused_k=clamp_seqlens(cache_seqlens, page_table, k_cache.shape[1]),
        page_table=clamp_page_table(page_table, k_cache.shape[0]), num_splits=0,
    )  # fmt: skip


def register() -> None:
    traits = dict(TRAITS, page_size=ANY, q_len=ANY)
    description = "FlashAttention-3 paged forward, split-KV heuristic (tokenspeed-fa3), sm_90"
    register_fa3("mha_decode_with_kvcache", mha_decode_with_kvcache, traits, description, PRIORITY)
