"""Public attention operators: validate, select a kernel, call it.

Kernels receive normalized arguments: every default resolved, `out` (and `lse` when asked
for) preallocated, decode q always 4-D [B, Q, Hq, D]. Values on the device (sequence lengths,
page ids) are not read here: that would synchronize the stream on every call.
"""

from __future__ import annotations

import math

import torch

from ... import capture
from ...platform import platform_of
from ...selector import select
from ...validation import (
    FLOAT16_DTYPES,
    FP8_DTYPES,
    SINK_DTYPES,
    check_contiguous_last_dim,
    check_int,
    check_ndim,
    check_scale,
    check_tensor,
    dtype_name,
)
from .fast_checks import decode_args_valid, store_args_valid
from .request import AttentionRequest, KVStoreRequest

_INT32 = (torch.int32,)
_INT64 = (torch.int64,)


def mha_prefill(
    q,
    k,
    v,
    *,
    cu_seqlens,
    max_seqlen,
    causal=True,
    window_left=-1,
    sinks=None,
    softmax_scale=None,
    return_lse=False,
    out=None,
):
    """Ragged self-attention without a cache.

    q [T, Hq, D], k/v [T, Hkv, D] bf16/fp16; cu_seqlens [B+1] int32; max_seqlen int.
    Returns out [T, Hq, D], and lse [T, Hq] float32 if `return_lse`.
    """
    op = "mha_prefill"
    check_ndim(op, "q", q, (3,))
    num_tokens, num_q_heads, head_dim = q.shape
    device = q.device
    check_tensor(op, "q", q, dtypes=FLOAT16_DTYPES)
    check_ndim(op, "k", k, (3,))
    num_kv_heads = k.shape[1]
    check_tensor(op, "k", k, shape=(num_tokens, None, head_dim), dtypes=(q.dtype,), device=device)
    check_tensor(op, "v", v, shape=k.shape, dtypes=(q.dtype,), device=device)
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_contiguous_last_dim(op, name, x)
    _check_gqa(op, num_q_heads, num_kv_heads)
    check_tensor(op, "cu_seqlens", cu_seqlens, shape=(None,), dtypes=_INT32, device=device)
    if cu_seqlens.shape[0] < 1:
        raise ValueError(f"{op}: cu_seqlens has shape [0], expected [B+1] with B >= 0")
    check_int(op, "max_seqlen", max_seqlen, minimum=0)
    if not isinstance(causal, bool):
        raise TypeError(f"{op}: causal is {type(causal).__name__}, expected bool")
    window_left = _check_window(op, window_left)
    if window_left >= 0 and not causal:
        raise ValueError(
            f"{op}: window_left is {window_left} with causal=False, expected "
            "causal=True (a window counts keys to the left of each query)"
        )
    scale, lse = _check_common(
        op, q, num_q_heads, head_dim, sinks, softmax_scale, return_lse, (num_tokens, num_q_heads)
    )
    out = _check_out(op, out, q.shape, (q.dtype,), device)
    request = AttentionRequest(
        q.dtype,
        k.dtype,
        head_dim,
        num_q_heads,
        num_kv_heads,
        0,
        0,
        causal,
        window_left,
        sinks is not None,
        return_lse,
    )
    kernel = select(op, request, platform_of(device))
    if capture.active():
        capture.record(
            op,
            kernel.name,
            dict(
                q=q,
                k=k,
                v=v,
                cu_seqlens=cu_seqlens,
                max_seqlen=max_seqlen,
                causal=causal,
                window_left=window_left,
                sinks=sinks,
                softmax_scale=softmax_scale,
                return_lse=return_lse,
            ),
        )
    kernel.fn(
        q,
        k,
        v,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        causal=causal,
        window_left=window_left,
        sinks=sinks,
        softmax_scale=scale,
        out=out,
        lse=lse,
    )
    return (out, lse) if return_lse else out


def mha_extend_with_kvcache(
    q,
    k_cache,
    v_cache,
    *,
    cu_seqlens_q,
    page_table,
    cache_seqlens,
    max_seqlen_q,
    window_left=-1,
    sinks=None,
    softmax_scale=None,
    return_lse=False,
    out=None,
    k_scale=None,
    v_scale=None,
):
    """Chunked prefill over the paged cache (the new tokens are already stored).

    q [T, Hq, D] ragged by cu_seqlens_q [B+1] int32; caches [num_pages, P, Hkv, D];
    page_table [B, max_pages] int32; cache_seqlens [B] int32 (including the new tokens).
    Row i of sequence b is position cache_seqlens[b] - n_b + i; causal.
    """
    op = "mha_extend_with_kvcache"
    check_ndim(op, "q", q, (3,))
    num_tokens, num_q_heads, head_dim = q.shape
    device = q.device
    check_tensor(op, "q", q, dtypes=FLOAT16_DTYPES)
    check_contiguous_last_dim(op, "q", q)
    check_tensor(op, "cu_seqlens_q", cu_seqlens_q, shape=(None,), dtypes=_INT32, device=device)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_seqs < 0:
        raise ValueError(f"{op}: cu_seqlens_q has shape [0], expected [B+1] with B >= 0")
    page_size, num_kv_heads = _check_paged_cache(
        op, q, head_dim, k_cache, v_cache, page_table, cache_seqlens, num_seqs
    )
    _check_gqa(op, num_q_heads, num_kv_heads)
    check_int(op, "max_seqlen_q", max_seqlen_q, minimum=0)
    window_left = _check_window(op, window_left)
    k_scale, v_scale = _check_kv_scales(op, k_cache.dtype, k_scale, v_scale)
    scale, lse = _check_common(
        op, q, num_q_heads, head_dim, sinks, softmax_scale, return_lse, (num_tokens, num_q_heads)
    )
    out = _check_out(op, out, q.shape, _out_dtypes(q, k_cache), device)
    request = AttentionRequest(
        q.dtype,
        k_cache.dtype,
        head_dim,
        num_q_heads,
        num_kv_heads,
        page_size,
        0,
        True,
        window_left,
        sinks is not None,
        return_lse,
    )
    kernel = select(op, request, platform_of(device))
    if capture.active():
        capture.record(
            op,
            kernel.name,
            dict(
                q=q,
                k_cache=k_cache,
                v_cache=v_cache,
                cu_seqlens_q=cu_seqlens_q,
                page_table=page_table,
                cache_seqlens=cache_seqlens,
                max_seqlen_q=max_seqlen_q,
                window_left=window_left,
                sinks=sinks,
                softmax_scale=softmax_scale,
                return_lse=return_lse,
                k_scale=k_scale,
                v_scale=v_scale,
            ),
        )
    kernel.fn(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q=cu_seqlens_q,
        page_table=page_table,
        cache_seqlens=cache_seqlens,
        max_seqlen_q=max_seqlen_q,
        window_left=window_left,
        sinks=sinks,
        softmax_scale=scale,
        k_scale=k_scale,
        v_scale=v_scale,
        out=out,
        lse=lse,
    )
    return (out, lse) if return_lse else out


def mha_decode_with_kvcache(
    q,
    k_cache,
    v_cache,
    *,
    page_table,
    cache_seqlens,
    window_left=-1,
    sinks=None,
    softmax_scale=None,
    return_lse=False,
    out=None,
    k_scale=None,
    v_scale=None,
):
    """Decode Q new tokens per sequence over the paged cache.

    q [B, Hq, D] (one token each) or [B, Q, Hq, D] (causal among themselves); caches
    [num_pages, P, Hkv, D]; page_table [B, max_pages] int32; cache_seqlens [B] int32.
    Returns q's shape (and lse [B, Hq] or [B, Q, Hq] float32 if `return_lse`).
    """
    op = "mha_decode_with_kvcache"
    if not decode_args_valid(
        q,
        k_cache,
        v_cache,
        page_table,
        cache_seqlens,
        window_left,
        sinks,
        softmax_scale,
        return_lse,
        out,
        k_scale,
        v_scale,
    ):
        _diagnose_decode(
            op,
            q,
            k_cache,
            v_cache,
            page_table,
            cache_seqlens,
            window_left,
            sinks,
            softmax_scale,
            return_lse,
            out,
            k_scale,
            v_scale,
        )
    shape = q.shape
    squeeze = len(shape) == 3
    if squeeze:
        num_seqs, num_q_heads, head_dim = shape
        q_len = 1
        q4 = q.view(num_seqs, 1, num_q_heads, head_dim)
    else:
        num_seqs, q_len, num_q_heads, head_dim = shape
        q4 = q
    _, page_size, num_kv_heads, _ = k_cache.shape
    device = q.device
    fp8 = k_cache.dtype is torch.float8_e4m3fn
    scale = head_dim**-0.5 if softmax_scale is None else float(softmax_scale)
    k_scale = 1.0 if k_scale is None else float(k_scale)
    v_scale = 1.0 if v_scale is None else float(v_scale)
    lse = torch.empty(shape[:-1], dtype=torch.float32, device=device) if return_lse else None
    if out is None:
        out = torch.empty(shape, dtype=torch.bfloat16 if fp8 else q.dtype, device=device)
    request = AttentionRequest(
        q.dtype,
        k_cache.dtype,
        head_dim,
        num_q_heads,
        num_kv_heads,
        page_size,
        q_len,
        True,
        window_left,
        sinks is not None,
        return_lse,
    )
    kernel = select(op, request, platform_of(device))
    if capture.active():
        capture.record(
            op,
            kernel.name,
            dict(
                q=q,
                k_cache=k_cache,
                v_cache=v_cache,
                page_table=page_table,
                cache_seqlens=cache_seqlens,
                window_left=window_left,
                sinks=sinks,
                softmax_scale=softmax_scale,
                return_lse=return_lse,
                k_scale=k_scale,
                v_scale=v_scale,
            ),
        )
    if squeeze:
        out4 = out.view(num_seqs, 1, num_q_heads, head_dim)
        lse4 = None if lse is None else lse.view(num_seqs, 1, num_q_heads)
    else:
        out4, lse4 = out, lse
    kernel.fn(
        q4,
        k_cache,
        v_cache,
        page_table=page_table,
        cache_seqlens=cache_seqlens,
        window_left=window_left,
        sinks=sinks,
        softmax_scale=scale,
        k_scale=k_scale,
        v_scale=v_scale,
        out=out4,
        lse=lse4,
    )
    return (out, lse) if return_lse else out


def _diagnose_decode(
    op,
    q,
    k_cache,
    v_cache,
    page_table,
    cache_seqlens,
    window_left,
    sinks,
    softmax_scale,
    return_lse,
    out,
    k_scale,
    v_scale,
) -> None:
    """Raise the precise error for a call `decode_args_valid` refused."""
    check_ndim(op, "q", q, (3, 4))
    q4 = q.unsqueeze(1) if q.dim() == 3 else q
    num_seqs, q_len, num_q_heads, head_dim = q4.shape
    check_tensor(op, "q", q, dtypes=FLOAT16_DTYPES)
    check_contiguous_last_dim(op, "q", q)
    if q_len < 1:
        raise ValueError(f"{op}: q has shape {list(q.shape)}, expected Q >= 1 tokens per sequence")
    _, num_kv_heads = _check_paged_cache(
        op, q, head_dim, k_cache, v_cache, page_table, cache_seqlens, num_seqs
    )
    _check_gqa(op, num_q_heads, num_kv_heads)
    _check_window(op, window_left)
    _check_kv_scales(op, k_cache.dtype, k_scale, v_scale)
    _check_common(op, q, num_q_heads, head_dim, sinks, softmax_scale, return_lse, q.shape[:-1])
    _check_out(op, out, q.shape, _out_dtypes(q, k_cache), q.device)
    raise AssertionError(f"{op}: decode_args_valid refused a call the checkers accept")


def kvcache_store(k, v, k_cache, v_cache, *, slot_mapping, k_scale=None, v_scale=None):
    """Write k/v [T, Hkv, D] into the paged caches [num_pages, P, Hkv, D] in place at
    slot_mapping [T] int64 (slot = page * P + offset; negative = skip). Quantizes to an FP8
    cache as fp8(k / k_scale)."""
    op = "kvcache_store"
    if not store_args_valid(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale):
        _diagnose_store(op, k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    _, num_kv_heads, head_dim = k.shape
    k_scale = 1.0 if k_scale is None else float(k_scale)
    v_scale = 1.0 if v_scale is None else float(v_scale)
    request = KVStoreRequest(k.dtype, k_cache.dtype, head_dim, num_kv_heads, k_cache.shape[1])
    kernel = select(op, request, platform_of(k.device))
    if capture.active():
        capture.record(
            op,
            kernel.name,
            dict(
                k=k,
                v=v,
                k_cache=k_cache,
                v_cache=v_cache,
                slot_mapping=slot_mapping,
                k_scale=k_scale,
                v_scale=v_scale,
            ),
        )
    kernel.fn(k, v, k_cache, v_cache, slot_mapping=slot_mapping, k_scale=k_scale, v_scale=v_scale)


def _diagnose_store(op, k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    """Raise the precise error for a call `store_args_valid` refused."""
    check_ndim(op, "k", k, (3,))
    num_tokens, num_kv_heads, head_dim = k.shape
    device = k.device
    check_tensor(op, "k", k, dtypes=FLOAT16_DTYPES)
    check_tensor(op, "v", v, shape=k.shape, dtypes=(k.dtype,), device=device)
    check_ndim(op, "k_cache", k_cache, (4,))
    check_tensor(
        op,
        "k_cache",
        k_cache,
        shape=(None, None, num_kv_heads, head_dim),
        dtypes=(k.dtype, *FP8_DTYPES),
        device=device,
    )
    check_tensor(
        op, "v_cache", v_cache, shape=k_cache.shape, dtypes=(k_cache.dtype,), device=device
    )
    for name, x in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_contiguous_last_dim(op, name, x)
    check_tensor(
        op, "slot_mapping", slot_mapping, shape=(num_tokens,), dtypes=_INT64, device=device
    )
    _check_kv_scales(op, k_cache.dtype, k_scale, v_scale)
    raise AssertionError(f"{op}: store_args_valid refused a call the checkers accept")


def _check_gqa(op: str, num_q_heads: int, num_kv_heads: int) -> None:
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"{op}: q has {num_q_heads} heads and the keys {num_kv_heads}, "
            "expected the query heads to be a multiple of the KV heads"
        )


def _check_window(op: str, window_left: object) -> int:
    if not isinstance(window_left, int) or isinstance(window_left, bool):
        raise TypeError(f"{op}: window_left is {type(window_left).__name__}, expected int")
    if window_left < -1:
        raise ValueError(f"{op}: window_left is {window_left}, expected -1 (no window) or >= 0")
    return window_left


def _check_common(op, q, num_q_heads, head_dim, sinks, softmax_scale, return_lse, lse_shape):
    """Sinks, softmax scale and lse; returns (scale, preallocated lse or None)."""
    if head_dim < 1:
        raise ValueError(f"{op}: q has head dim {head_dim}, expected >= 1")
    if sinks is not None:
        check_tensor(op, "sinks", sinks, shape=(num_q_heads,), dtypes=SINK_DTYPES, device=q.device)
    if softmax_scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    else:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            raise TypeError(
                f"{op}: softmax_scale is {type(softmax_scale).__name__}, expected a float"
            )
        scale = float(softmax_scale)
        if not math.isfinite(scale) or scale <= 0.0:
            raise ValueError(f"{op}: softmax_scale is {softmax_scale}, expected a finite float > 0")
    if not isinstance(return_lse, bool):
        raise TypeError(f"{op}: return_lse is {type(return_lse).__name__}, expected bool")
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device) if return_lse else None
    return scale, lse


def _check_paged_cache(op, q, head_dim, k_cache, v_cache, page_table, cache_seqlens, num_seqs):
    device = q.device
    check_ndim(op, "k_cache", k_cache, (4,))
    check_tensor(
        op,
        "k_cache",
        k_cache,
        shape=(None, None, None, head_dim),
        dtypes=(q.dtype, *FP8_DTYPES),
        device=device,
    )
    check_tensor(
        op, "v_cache", v_cache, shape=k_cache.shape, dtypes=(k_cache.dtype,), device=device
    )
    check_contiguous_last_dim(op, "k_cache", k_cache)
    check_contiguous_last_dim(op, "v_cache", v_cache)
    check_tensor(op, "page_table", page_table, shape=(num_seqs, None), dtypes=_INT32, device=device)
    check_tensor(
        op, "cache_seqlens", cache_seqlens, shape=(num_seqs,), dtypes=_INT32, device=device
    )
    page_size = k_cache.shape[1]
    if page_size < 1:
        raise ValueError(f"{op}: k_cache has shape {list(k_cache.shape)}, expected page size >= 1")
    return page_size, k_cache.shape[2]


def _check_kv_scales(op, cache_dtype, k_scale, v_scale):
    if cache_dtype not in FP8_DTYPES:
        for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            if value is not None:
                raise ValueError(
                    f"{op}: {name} is {value}, expected None for a "
                    f"{dtype_name(cache_dtype)} cache (scales apply to FP8 only)"
                )
        return 1.0, 1.0
    return check_scale(op, "k_scale", k_scale), check_scale(op, "v_scale", v_scale)


def _out_dtypes(q, k_cache):
    # An FP8 cache's output is bf16 by default (the contract); a given out may be either.
    return FLOAT16_DTYPES if k_cache.dtype in FP8_DTYPES else (q.dtype,)


def _check_out(op, out, shape, dtypes, device):
    if out is None:
        dtype = dtypes[0] if len(dtypes) == 1 else torch.bfloat16
        return torch.empty(shape, dtype=dtype, device=device)
    check_tensor(op, "out", out, shape=tuple(shape), dtypes=dtypes, device=device)
    check_contiguous_last_dim(op, "out", out)
    return out
