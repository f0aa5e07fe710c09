"""`mha_prefill` through FlashInfer's attention-sink wrapper (`_sink_wrapper.py`): the packed
k/v become a paged cache of one-token pages, page i holding token i, so sequence b's keys are
pages cu[b] .. cu[b+1] - 1 (listed from cu[0], so the page list starts at 0).

Priority 20: it plans on the host every call (not CUDA-graph capturable). H200, FlashInfer
0.7.2 (GPU.md): causal S=8192 x2 417 TFLOP/s against FA3's 478; window 127 63 against 104.
"""

from __future__ import annotations

import torch

from tokenspeed_kernel.registry import ANY

from ._common import HALF, register_flashinfer
from ._sink_wrapper import HEAD_DIMS, PRIORITY, host_offsets, run_paged, supports

KERNEL_NAME = "flashinfer.mha_prefill.sink"


def mha_prefill(
    q, k, v, *, cu_seqlens, max_seqlen, causal, window_left, sinks, softmax_scale, out, lse
) -> None:
    """q [T, Hq, D], k/v [T, Hkv, D] ragged by cu_seqlens [B+1] int32; sinks [Hq]."""
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return
    cu = host_offsets(cu_seqlens, num_tokens)
    first, last = int(cu[0]), int(cu[-1])
    pages = dict(
        cu=cu,
        kv_indptr=cu - first,
        kv_indices=torch.arange(first, last, dtype=torch.int32, device=q.device),
        last_page_len=torch.ones(cu.shape[0] - 1, dtype=torch.int32),
    )
    run_paged(
        q, k.unsqueeze(1), v.unsqueeze(1), pages, causal=causal, window_left=window_left,
        sinks=sinks, softmax_scale=softmax_scale, out=out, lse=lse,
    )  # fmt: skip


def register() -> None:
    traits = dict(
        dtype=HALF, kv_dtype=HALF, head_dim=HEAD_DIMS, gqa_ratio=ANY, non_causal=True,
        window=True, sinks=True, lse=True,
    )  # fmt: skip
    register_flashinfer(
        "mha_prefill", KERNEL_NAME, mha_prefill, platforms=("nvidia:sm_80+",), traits=traits,
        priority=PRIORITY, supports=supports,
        text="FlashInfer attention-sink wrapper (JIT); plans on the host every call",
    )  # fmt: skip
