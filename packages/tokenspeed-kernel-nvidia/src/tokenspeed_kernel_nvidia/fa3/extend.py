"""`mha_extend_with_kvcache` through FlashAttention-3's paged forward (ragged q over the paged
cache, causal aligned bottom-right: the contract's positions).

Priority 90, below the Triton extend (100): ahead of it with a full context, behind it with
window 127 (`benchmarks/results/kernels_h100.md`); the measured ranking decides per shape.
"""

from __future__ import annotations

from tokenspeed_kernel.registry import ANY

from .._attention import clamp_offsets, clamp_page_table, clamp_seqlens
from ._common import TRAITS, fa3_forward, register_fa3

PRIORITY = 90


def mha_extend_with_kvcache(
    q, k_cache, v_cache, *, cu_seqlens_q, page_table, cache_seqlens, max_seqlen_q,
    window_left, sinks, softmax_scale, k_scale, v_scale, out, lse,
) -> None:  # fmt: skip
    """q [T, Hq, D] ragged by cu_seqlens_q; caches [num_pages, P, Hkv, D]; page_table
    [B, max_pages] int32; cache_seqlens [B] int32 (new tokens included). k_scale/v_scale are
    1.0 (FP8 caches are declined)."""
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return
    cu = clamp_offsets(cu_seqlens_q, num_tokens)
    fa3_forward(
        q, k_cache, v_cache, out=out, lse=lse, sinks=sinks, softmax_scale=softmax_scale,
        causal=True, window_left=window_left, rows=lambda x: x.t(),
        cu_seqlens_q=cu, max_seqlen_q=max_seqlen_q,
        seqused_k=clamp_seqlens(cache_seqlens, page_table, k_cache.shape[1]),
        page_table=clamp_page_table(page_table, k_cache.shape[0]), num_splits=0,
    )  # fmt: skip


def register() -> None:
    traits = dict(TRAITS, page_size=ANY)
    description = "FlashAttention-3 paged forward (tokenspeed-fa3), sm_90, any page size"
    register_fa3("mha_extend_with_kvcache", mha_extend_with_kvcache, traits, description, PRIORITY)
