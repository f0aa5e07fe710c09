"""`mha_decode_with_kvcache` through TensorRT-LLM's trtllm-gen attention on Blackwell, as
FlashInfer ports it (`trtllm_batch_decode_with_kv_cache(..., backend="trtllm-gen")`, kernels
shipped prebuilt in flashinfer-cubin for sm_100/sm_103).

Not run here: no Blackwell GPU is lent. It is registered for sm_100/sm_103, its argument
mapping is tested on the CPU against a recording stand-in of FlashInfer
(tests/nvidia/test_nvidia_mapping.py), and its conformance GPU test skips on Hopper. Checked
without a GPU by scripts/check_trtllm_gen_build.sh (tests/nvidia/test_trtllm_gen_build.py):
FlashInfer's trtllm-gen module (the launcher and reduction kernels that load the cubins)
compiles with nvcc for sm_100a; for every request the traits below admit, the cubin table holds
a decode kernel for sm_100 and sm_103 under each key FlashInfer's kernel selection may look up
(fmhaKernels.cuh, mirrored in the test); and those cubins have the sha256 the table records.
The cubins come from flashinfer-cubin 0.6.13, the last on PyPI: its trtllm-gen FMHA directory
is the artifact FlashInfer 0.6.14 names, with the checksums 0.6.14 expects.

Mapping (decode.py, 0.6.14 and 0.7.2.post1): kv_cache (k, v) [num_pages, P, Hkv, D] with
kv_layout="NHD" (transposed to HND as a view, no copy); the head and page strides may be
arbitrary, the head dim must be dense; bmm1_scale = softmax_scale * k_scale, bmm2_scale =
v_scale; sinks float32 [Hq]; window_left as is. Declared conservatively, to what FlashInfer's
own trtllm-gen decode tests cover: head dims 64 and 128, pages 16/32/64, Q = 1, no lse (its
log base is not documented).

Priority 90, below the Triton decode (100) until measured on a B200.
"""

from __future__ import annotations

import torch

from tokenspeed_kernel.registry import Support

from .._attention import dense_last_dim
from ._common import (
    FP8,
    HALF,
    batch_decode,
    library_verdict,
    register_flashinfer,
)

KERNEL_NAME = "flashinfer.mha_decode_with_kvcache.trtllm_gen"
PRIORITY = 90
PLATFORMS = ("nvidia:sm_100,sm_103",)


def mha_decode_with_kvcache(
    q, k_cache, v_cache, *, page_table, cache_seqlens, window_left, sinks, softmax_scale,
    k_scale, v_scale, out, lse,
) -> None:  # fmt: skip
    """q [B, 1, Hq, D]; caches [num_pages, P, Hkv, D]; writes out [B, 1, Hq, D]."""
    if q.shape[0] == 0:
        return
    query = dense_last_dim(q[:, 0])
    out3 = out[:, 0]
    target = out3 if out3.stride(-1) == 1 else torch.empty_like(out3)
    batch_decode(
        "trtllm-gen", query, k_cache, v_cache, target, out3, page_table=page_table,
        cache_seqlens=cache_seqlens, window_left=window_left, sinks=sinks,
        softmax_scale=softmax_scale, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip


def supports(request, platform) -> Support:
    verdict = library_verdict()
    if not verdict.ok:
        return verdict
    if request.kv_dtype not in (request.dtype, FP8):
        return Support.no("trtllm-gen needs the KV cache in q's dtype or float8_e4m3fn")
    return Support.yes()


def register() -> None:
    traits = dict(
        dtype=HALF,
        kv_dtype=(*HALF, FP8),
        head_dim=(64, 128),
        gqa_ratio=(1, 2, 4, 8, 16),
        page_size=(16, 32, 64),
        q_len=(1,),
        window=True,
        sinks=True,
    )
    register_flashinfer(
        "mha_decode_with_kvcache", KERNEL_NAME, mha_decode_with_kvcache, platforms=PLATFORMS,
        traits=traits, priority=PRIORITY, supports=supports,
        text="TensorRT-LLM trtllm-gen attention via FlashInfer (Blackwell cubins); untested "
        "on hardware here",
    )  # fmt: skip
