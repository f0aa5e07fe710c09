"""`mha_decode_with_kvcache` through TensorRT-LLM's XQA kernel, as FlashInfer ports it
(`flashinfer.decode.trtllm_batch_decode_with_kv_cache(..., backend="xqa")`).

Limits, read from flashinfer-python 0.6.14 and 0.7.2.post1:
- decode.py `trtllm_batch_decode_with_kv_cache`: the xqa backend raises NotImplementedError
  for `return_lse`/`lse` (no lse here); kv_cache a tuple (k, v) of [num_pages, P, Hkv, D]
  with kv_layout="NHD"; seq_lens read as uint32 (xqa_wrapper.cu reinterprets the int32 data).
- decode.py `xqa_batch_decode_with_kv_cache`: kv_scale = bmm2_scale * o_scale and q_scale =
  bmm1_scale / kv_scale * sqrt(D), so logits = bmm1_scale * q.k and out = bmm2_scale * p.v:
  bmm1_scale = softmax_scale * k_scale, bmm2_scale = v_scale; sliding_win_size =
  window_left + 1; sinks reshaped [Hkv, Hq/Hkv] float32, added as exp(sink - max) to the row
  sum (csrc/xqa/mha.cu addAttentionSinks): the contract's unscaled sink logit.
- xqa.py `xqa`: page_size in {16, 32, 64, 128}; q fp16/bf16; cache q's dtype or e4m3; output
  q's dtype; compute capability major 9, 10 or 12; q_seq_len > 1 needs a speculative-decoding
  mask (not mapped: Q = 1 only). jit/xqa.py: head_dim % 16 == 0 in [16, 256] (0.7 allows 512;
  the intersection is declared). csrc/xqa/mha.cu: nbValidRows (= head group size for Q = 1)
  <= 32. xqa_wrapper.cu: the page/token/head strides of the K cache are used for V too.

Priority 95, below the Triton decode (100). H100, one run, CUDA graphs (GPU.md), XQA time /
Triton time, page 64: full ctx 8192 B=1/16/64 1.05 / 0.985 / 1.006 (XQA ahead by 1.5% at
B=16; B>=64 both at the copy limit), window 127 B=1/16/64 1.70 / 1.16 / 3.44. One priority
cannot follow the shape; the measured ranking picks XQA where it wins.
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

KERNEL_NAME = "flashinfer.mha_decode_with_kvcache.xqa"
PRIORITY = 95
PAGE_SIZES = (16, 32, 64, 128)
HEAD_DIMS = tuple(range(16, 257, 16))
MAX_GROUP = 32
# Compute capability majors 9, 10, 12 (xqa.py), as the archs torch reports.
PLATFORMS = ("nvidia:sm_90,sm_100,sm_103,sm_120,sm_121",)


def mha_decode_with_kvcache(
    q, k_cache, v_cache, *, page_table, cache_seqlens, window_left, sinks, softmax_scale,
    k_scale, v_scale, out, lse,
) -> None:  # fmt: skip
    """q [B, 1, Hq, D]; caches [num_pages, P, Hkv, D]; writes out [B, 1, Hq, D]."""
    if q.shape[0] == 0:
        return
    if k_cache.stride() != v_cache.stride():
        raise ValueError(
            f"{KERNEL_NAME}: k_cache strides {list(k_cache.stride())} differ from v_cache "
            f"strides {list(v_cache.stride())}; XQA addresses both with the K cache's strides"
        )
    query = dense_last_dim(q[:, 0])
    out3 = out[:, 0]
    target = out3 if out3.dtype == q.dtype and out3.is_contiguous() else torch.empty_like(query)
    batch_decode(
        "xqa", query, k_cache, v_cache, target, out3, page_table=page_table,
        cache_seqlens=cache_seqlens, window_left=window_left, sinks=sinks,
        softmax_scale=softmax_scale, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip


def supports(request, platform) -> Support:
    verdict = library_verdict()
    if not verdict.ok:
        return verdict
    if request.kv_dtype == FP8:
        # XQA's Hopper kernel (csrc/xqa/mha_sm90.cu) does its MMAs in the cache's element type:
        # with an e4m3 cache, MathElem is e4m3 and q is converted to it (needInputCvt), an error
        # the contract does not allow (FA3 declines for the same reason); the FP8 conformance
        # cases fail on an H100 accordingly.
        return Support.no("XQA rounds q to e4m3 to multiply an FP8 cache (the contract keeps q)")
    if request.kv_dtype != request.dtype:
        return Support.no("XQA needs the KV cache in q's dtype")
    return Support.yes()


def register() -> None:
    traits = dict(
        dtype=HALF,
        kv_dtype=HALF,
        head_dim=HEAD_DIMS,
        gqa_ratio=range(1, MAX_GROUP + 1),
        page_size=PAGE_SIZES,
        q_len=(1,),
        window=True,
        sinks=True,
    )
    register_flashinfer(
        "mha_decode_with_kvcache", KERNEL_NAME, mha_decode_with_kvcache, platforms=PLATFORMS,
        traits=traits, priority=PRIORITY, supports=supports,
        text="TensorRT-LLM XQA via FlashInfer (JIT on Hopper, ~10-75 s per module first use); "
        "no lse, Q = 1",
    )  # fmt: skip
