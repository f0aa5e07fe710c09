"""Selection requests for the attention ops: the features of a call that decide which
kernel may serve it. NamedTuples, so that building and hashing one is cheap on the hot path."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...registry import declare_op
from ...validation import dtype_name

# The feature names each request's `features()` yields: what kernels may declare as traits.
ATTENTION_FEATURES = (
    "dtype", "kv_dtype", "head_dim", "gqa_ratio", "page_size", "q_len",
    "non_causal", "window", "sinks", "lse",
)  # fmt: skip
STORE_FEATURES = ("dtype", "kv_dtype", "head_dim", "page_size")

MHA_PREFILL = declare_op(
    "mha_prefill", summary="ragged self-attention without a cache", traits=ATTENTION_FEATURES
)
MHA_EXTEND = declare_op(
    "mha_extend_with_kvcache",
    summary="chunked prefill over the paged KV cache",
    traits=ATTENTION_FEATURES,
)
MHA_DECODE = declare_op(
    "mha_decode_with_kvcache", summary="decode over the paged KV cache", traits=ATTENTION_FEATURES
)
KVCACHE_STORE = declare_op(
    "kvcache_store", summary="write new K/V into the paged cache", traits=STORE_FEATURES
)


def size_bucket(n: int) -> int:
    """`n` rounded up to a power of two (0 stays 0): the size scale of requests, so that a
    selection cache holds one entry per bucket and measured rankings have few keys."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


class AttentionRequest(NamedTuple):
    """`page_size` 0 = no cache (prefill); `q_len` 0 = ragged (prefill, extend).
    `tokens`: query tokens of the call (T; decode B*Q) and `seqlen`: the longest query sequence
    (`max_seqlen`, `max_seqlen_q`; 0 for decode), both as `size_bucket`s; 0 = not given. They
    let measured rankings (`rankings.py`) tell a B=1 decode from a B=64 one."""

    dtype: torch.dtype
    kv_dtype: torch.dtype
    head_dim: int
    num_q_heads: int
    num_kv_heads: int
    page_size: int = 0
    q_len: int = 0
    causal: bool = True
    window_left: int = -1
    sinks: bool = False
    lse: bool = False
    tokens: int = 0
    seqlen: int = 0

    def features(self) -> tuple[tuple[str, object], ...]:
        # Requests built by hand (explain, tools) reach here unchecked by an op; selection
        # results are cached, so this runs once per distinct request.
        if self.num_kv_heads < 1 or self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"AttentionRequest: {self.num_q_heads} query heads and {self.num_kv_heads} KV "
                "heads, expected a positive number of KV heads dividing the query heads"
            )
        features: list[tuple[str, object]] = [
            ("dtype", self.dtype),
            ("kv_dtype", self.kv_dtype),
            ("head_dim", self.head_dim),
            ("gqa_ratio", self.num_q_heads // self.num_kv_heads),
        ]
        if self.page_size:
            features.append(("page_size", self.page_size))
        if self.q_len:
            features.append(("q_len", self.q_len))
        for flag, on in (
            ("non_causal", not self.causal),
            ("window", self.window_left >= 0),
            ("sinks", self.sinks),
            ("lse", self.lse),
        ):
            if on:
                features.append((flag, True))
        return tuple(features)

    def __str__(self) -> str:
        parts = [
            f"q {dtype_name(self.dtype)}",
            f"kv {dtype_name(self.kv_dtype)}",
            f"head_dim {self.head_dim}",
            f"heads {self.num_q_heads}/{self.num_kv_heads}",
        ]
        if self.page_size:
            parts.append(f"page {self.page_size}")
        if self.q_len:
            parts.append(f"q_len {self.q_len}")
        parts.append("causal" if self.causal else "non-causal")
        if self.window_left >= 0:
            parts.append(f"window_left {self.window_left}")
        if self.sinks:
            parts.append("sinks")
        if self.lse:
            parts.append("lse")
        if self.tokens:
            parts.append(f"tokens <= {self.tokens}")
        if self.seqlen:
            parts.append(f"seqlen <= {self.seqlen}")
        return ", ".join(parts)


class KVStoreRequest(NamedTuple):
    """`tokens`: tokens written, as a `size_bucket` (0 = not given)."""

    dtype: torch.dtype
    kv_dtype: torch.dtype
    head_dim: int
    num_kv_heads: int
    page_size: int
    tokens: int = 0

    def features(self) -> tuple[tuple[str, object], ...]:
        return (
            ("dtype", self.dtype),
            ("kv_dtype", self.kv_dtype),
            ("head_dim", self.head_dim),
            ("page_size", self.page_size),
        )

    def __str__(self) -> str:
        tokens = f", tokens <= {self.tokens}" if self.tokens else ""
        return (
            f"k/v {dtype_name(self.dtype)} -> cache {dtype_name(self.kv_dtype)}, "
            f"head_dim {self.head_dim}, kv heads {self.num_kv_heads}, page {self.page_size}"
            f"{tokens}"
        )
