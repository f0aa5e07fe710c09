"""`mha_extend_with_kvcache` through FlashInfer's attention-sink wrapper (`_sink_wrapper.py`):
the page table and lengths become FlashInfer's CSR page list (indptr, indices, last-page
length) on the host, every call.

Priority 20: it plans on the host every call (not CUDA-graph capturable).
"""

from __future__ import annotations

import torch

from tokenspeed_kernel.registry import ANY

from .._attention import clamp_page_table
from ._common import HALF, register_flashinfer
from ._sink_wrapper import HEAD_DIMS, PRIORITY, host_offsets, run_paged, supports

KERNEL_NAME = "flashinfer.mha_extend_with_kvcache.sink"


def page_list(page_table, cache_seqlens, page_size: int, num_pages: int) -> dict:
    """CSR pages of each sequence: kv_indptr [B+1] and last_page_len [B] on the host,
    kv_indices on the device. A sequence of length 0 has no page and last length P, which
    FlashInfer reads as (0 - 1) * P + P = 0 keys."""
    lengths = cache_seqlens.clamp(0, page_table.shape[1] * page_size).cpu().to(torch.int64)
    counts = (lengths + page_size - 1) // page_size
    indptr = torch.zeros(lengths.shape[0] + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=indptr[1:])
    owned = torch.arange(page_table.shape[1]).unsqueeze(0) < counts.unsqueeze(1)
    indices = clamp_page_table(page_table, num_pages)[owned.to(page_table.device)]
    return dict(
        kv_indptr=indptr, kv_indices=indices, last_page_len=lengths - (counts - 1) * page_size
    )


def mha_extend_with_kvcache(
    q, k_cache, v_cache, *, cu_seqlens_q, page_table, cache_seqlens, max_seqlen_q,
    window_left, sinks, softmax_scale, k_scale, v_scale, out, lse,
) -> None:  # fmt: skip
    """q [T, Hq, D] ragged by cu_seqlens_q; caches [num_pages, P, Hkv, D]; k/v_scale 1.0."""
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return
    pages = page_list(page_table, cache_seqlens, k_cache.shape[1], k_cache.shape[0])
    pages["cu"] = host_offsets(cu_seqlens_q, num_tokens)
    run_paged(
        q, k_cache, v_cache, pages, causal=True, window_left=window_left, sinks=sinks,
        softmax_scale=softmax_scale, out=out, lse=lse,
    )  # fmt: skip


def register() -> None:
    traits = dict(
        dtype=HALF, kv_dtype=HALF, head_dim=HEAD_DIMS, gqa_ratio=ANY, page_size=ANY,
        window=True, sinks=True, lse=True,
    )  # fmt: skip
    register_flashinfer(
        "mha_extend_with_kvcache", KERNEL_NAME, mha_extend_with_kvcache,
        platforms=("nvidia:sm_80+",), traits=traits, priority=PRIORITY, supports=supports,
        text="FlashInfer attention-sink wrapper (JIT); plans on the host every call",
    )  # fmt: skip
