"""Reference points outside the registry for `bench --peers`, used only where importable.

- `peer:fa3`: FlashAttention-3 through `flash_attn_interface` (varlen prefill; paged extend and
  decode through `flash_attn_with_kvcache`), with sinks and sliding windows.
- `peer:torch.sdpa`: `torch.nn.functional.scaled_dot_product_attention` on contiguous tensors. It
  has no sinks and no paging: for decode the visible keys are gathered into contiguous K/V
  before timing, so it shows the cost of the attention math alone, not a paged kernel's.

Peers are timed on the same inputs but never checked or selected.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from ..formats.fp8 import FP8_DTYPE
from .workloads import Point

PeerCall = Callable[[], object]


def peer_calls(
    point: Point, inputs, device: torch.device
) -> list[tuple[str, PeerCall | None, str]]:
    """(peer name, call or None, note) for each peer that applies to this op."""
    if point.op not in ("mha_prefill", "mha_extend_with_kvcache", "mha_decode_with_kvcache"):
        return []
    found = []
    for name, make in (("peer:fa3", _fa3), ("peer:torch.sdpa", _sdpa)):
        try:
            call, note = make(point, inputs, device)
        except ImportError as exc:
            call, note = None, f"not importable ({exc})"
        found.append((name, call, note))
    return found


def _fa3(point: Point, inputs, device):
    if device.type != "cuda":
        return None, "needs a CUDA GPU"
    fa3 = importlib.import_module("flash_attn_interface")
    s = point.case.shape
    if s.cache_dtype == FP8_DTYPE:
        return None, "fp8 cache not wired up for this peer"
    args, kw = inputs
    window = (s.window_left, 0) if s.window_left >= 0 else (-1, -1)
    # This FA3 build takes bf16 sinks ("sinks must have dtype bfloat16", seen on an H200).
    sinks = None if kw["sinks"] is None else kw["sinks"].to(torch.bfloat16)
    common = dict(softmax_scale=kw["softmax_scale"], causal=True, window_size=window, sinks=sinks)
    q = args[0]
    if point.op == "mha_prefill":
        cu = kw["cu_seqlens"]
        return (
            lambda: fa3.flash_attn_varlen_func(
                q, args[1], args[2], cu, cu, kw["max_seqlen"], kw["max_seqlen"], **common
            )
        ), ""
    paged = dict(page_table=kw["page_table"], cache_seqlens=kw["cache_seqlens"], **common)
    if point.op == "mha_extend_with_kvcache":
        paged.update(cu_seqlens_q=kw["cu_seqlens_q"], max_seqlen_q=kw["max_seqlen_q"])
    return (lambda: fa3.flash_attn_with_kvcache(q, args[1], args[2], **paged)), ""


def _sdpa(point: Point, inputs, device):
    s = point.case.shape
    sdpa = torch.nn.functional.scaled_dot_product_attention
    args, kw = inputs
    gqa = s.num_q_heads != s.num_kv_heads
    if point.op == "mha_prefill":
        if s.window_left >= 0 or len(set(s.seqlens)) != 1:
            return None, "no sliding window / needs equal lengths"
        batch, n = len(s.seqlens), s.seqlens[0]

        def split(x):
            return x.view(batch, n, x.shape[1], x.shape[2]).transpose(1, 2)

        q, k, v = (split(x) for x in args)
        return (
            lambda: sdpa(q, k, v, is_causal=True, scale=kw["softmax_scale"], enable_gqa=gqa)
        ), "no sinks"
    if point.op != "mha_decode_with_kvcache" or s.q_lens[0] != 1 or s.cache_dtype == FP8_DTYPE:
        return None, "decode Q=1 bf16/fp16 only"
    if len(set(s.seqlens)) != 1:
        return None, "needs equal lengths"
    length = s.seqlens[0]
    first = 0 if s.window_left < 0 else max(0, length - 1 - s.window_left)
    k, v = (_contiguous(cache, kw["page_table"], first, length) for cache in args[1:3])
    q = args[0].transpose(1, 2)  # [B, Hq, 1, D]
    return (
        lambda: sdpa(q, k, v, scale=kw["softmax_scale"], enable_gqa=gqa)
    ), "no sinks, contiguous KV (no paging)"


def _contiguous(cache: torch.Tensor, page_table: torch.Tensor, first: int, end: int):
    """Positions first..end-1 of every sequence as [B, Hkv, end - first, D]."""
    page_size = cache.shape[1]
    pos = torch.arange(first, end, device=cache.device)
    pages = page_table[:, pos // page_size].long()
    return cache[pages, pos % page_size].transpose(1, 2).contiguous()
