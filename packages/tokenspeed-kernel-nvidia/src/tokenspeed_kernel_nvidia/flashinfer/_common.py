"""What the FlashInfer adapters share: the verdict, version-aware keyword mapping, workspaces.

Accepted: flashinfer-python >=0.6.14 (what vLLM 0.26 pins) and 0.7.x (`_library.FLASHINFER`).
Both lines were read for every function mapped here; where their signatures differ, the
adapter passes only keywords the installed function declares (`accepts`).

First use: on Hopper every FlashInfer kernel is JIT-compiled with nvcc (flashinfer-cubin holds
Blackwell cubins only): about 10-75 s per attention module, over 19 minutes for the CUTLASS
fused MoE, then cached under ~/.cache/flashinfer.
"""

from __future__ import annotations

import functools
import inspect

import torch

from tokenspeed_kernel.registry import Support, register_kernel

from .._attention import clamp_page_table, clamp_seqlens, workspace
from .._library import FLASHINFER

HALF = (torch.bfloat16, torch.float16)
FP8 = torch.float8_e4m3fn
# trtllm_batch_decode_with_kv_cache: "workspace_buffer ... Must be initialized to 0 for its
# first use"; the XQA path keeps its semaphores in the first 8 MiB (decode.py,
# xqa_batch_decode_with_kv_cache) and its multi-block scratch after them. vLLM's FlashInfer
# backend gives these kernels 128-394 MiB; 128 MiB covers batch 256 x 64 q heads x 64 splits.
DECODE_WORKSPACE_BYTES = 128 << 20
# The prefill wrappers' float workspace (split-KV partial results), FlashInfer's own default.
PREFILL_WORKSPACE_BYTES = 128 << 20


def library_verdict() -> Support:
    return FLASHINFER.verdict()


def flashinfer():
    """The imported `flashinfer` module (ImportError naming the extra if absent)."""
    return FLASHINFER.load()


@functools.cache
def _parameters(fn) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def accepts(fn, name: str) -> bool:
    """Whether the installed version of `fn` takes keyword `name`."""
    return name in _parameters(fn)


def decode_workspace(kind: str, device: torch.device) -> torch.Tensor:
    """The zeroed decode workspace of one kernel family (`xqa`, `trtllm_gen`) on `device`:
    separate buffers, since each keeps its own semaphores there."""
    return workspace(f"flashinfer.{kind}", device, DECODE_WORKSPACE_BYTES)


def sinks_fp32(sinks):
    """XQA and trtllm-gen read sinks as float32 [Hq] (bf16 widens exactly)."""
    return None if sinks is None else sinks.to(torch.float32)


def register_flashinfer(op, name, launcher, *, platforms, traits, priority, supports, text):
    register_kernel(
        op,
        name=name,
        backend="flashinfer",
        platforms=platforms,
        traits=traits,
        priority=priority,
        supports=supports,
        description=text,
    )(launcher)


def batch_decode(backend, query, k_cache, v_cache, target, out3, *, page_table, cache_seqlens,
                 window_left, sinks, softmax_scale, k_scale, v_scale) -> None:  # fmt: skip
    """`trtllm_batch_decode_with_kv_cache` (XQA or trtllm-gen) of query [B, Hq, D] into target
    (out3 itself, or a dense stand-in copied back), one new token per sequence."""
    page_size = k_cache.shape[1]
    seq_lens = clamp_seqlens(cache_seqlens, page_table, page_size)
    flashinfer().decode.trtllm_batch_decode_with_kv_cache(
        query=query,
        kv_cache=(k_cache, v_cache),
        workspace_buffer=decode_workspace(backend.replace("-", "_"), query.device),
        block_tables=clamp_page_table(page_table, k_cache.shape[0]),
        seq_lens=seq_lens,
        max_seq_len=page_table.shape[1] * page_size,
        bmm1_scale=softmax_scale * k_scale,
        bmm2_scale=v_scale,
        window_left=window_left,
        out=target,
        sinks=sinks_fp32(sinks),
        kv_layout="NHD",
        backend=backend,
        q_len_per_req=1,
    )
    # A sequence with no key has output 0 in the contract (a sink has no value vector); the
    # kernel divides by an empty row sum there, so those rows are set here (one small kernel).
    target.masked_fill_(seq_lens.view(-1, 1, 1) == 0, 0.0)
    if target is not out3:
        out3.copy_(target)
