"""Validity of the attention ops' arguments: the one definition, fast enough for every decode step.

Each checker is straight-line code over tensor metadata: decode and store run it thousands of
times a second, where one generic `check_tensor` call per argument would cost ~13 µs a call
instead of ~4 µs. A failed condition raises through the message builders of `validation`, so
each error names the op, the argument, the expectation and the value received. A checker
returns the selection request and the normalized options.
"""

from __future__ import annotations

import torch

from ...validation import (
    FLOAT16_DTYPES,
    FP8_DTYPES,
    INT32_MAX,
    SINK_DTYPES,
    as_bool,
    as_int,
    check_int,
    check_positive_float,
    check_scale,
    dense_last_dim,
    device_error,
    dtype_error,
    dtype_name,
    ndim_error,
    shape_error,
    stride_error,
    type_error,
)
from .request import KVCACHE_STORE, MHA_DECODE, MHA_EXTEND, MHA_PREFILL, KVStoreRequest
from .request import AttentionRequest as Request

_Tensor = torch.Tensor
_INT32, _INT64, _FP8 = torch.int32, torch.int64, torch.float8_e4m3fn
# Accepted dtypes of `out` with an FP8 cache, the default first.
_FP8_OUT = (torch.bfloat16, torch.float16)


def _tensor(op, name, x, ndims) -> torch.Size:
    shape = x.shape if isinstance(x, _Tensor) else ()
    if len(shape) not in ndims:
        raise _ndim_error(op, name, x, ndims)
    return shape


def _ndim_error(op, name, x, ndims) -> Exception:
    if not isinstance(x, _Tensor):
        return type_error(op, name, x, "a torch.Tensor")
    return ndim_error(op, name, x, ndims)


def _like(op, name, x, device, dtypes, shape=None, dense=True) -> None:
    """x on `device`, with a dtype in `dtypes`, exactly `shape` where given and (if `dense`)
    a dense last dim."""
    if not isinstance(x, _Tensor):
        raise type_error(op, name, x, "a torch.Tensor")
    if shape is not None and x.shape != shape:
        raise shape_error(op, name, x, shape)
    if x.dtype not in dtypes:
        raise dtype_error(op, name, x, dtypes)
    if x.device != device:
        raise device_error(op, name, x, device)
    if dense and not dense_last_dim(x):
        raise stride_error(op, name, x)


def _q(op, q, ndims) -> torch.Size:
    """q [..., Hq, D] bf16/fp16 with a dense last dim."""
    shape = _tensor(op, "q", q, ndims)
    if q.dtype not in FLOAT16_DTYPES:
        raise dtype_error(op, "q", q, FLOAT16_DTYPES)
    if not (q.is_contiguous() or q.stride(-1) == 1):  # dense_last_dim, inlined
        raise stride_error(op, "q", q)
    if shape[-1] < 1:
        raise ValueError(f"{op}: q has head dim {shape[-1]}, expected >= 1")
    return shape


def _kv_scales(op, kv_dtype, k_scale, v_scale) -> tuple[float, float]:
    """Per-tensor scales apply to an FP8 cache only; None means 1.0."""
    if kv_dtype is _FP8:
        return check_scale(op, "k_scale", k_scale), check_scale(op, "v_scale", v_scale)
    if k_scale is not None or v_scale is not None:
        name, value = ("k_scale", k_scale) if k_scale is not None else ("v_scale", v_scale)
        raise ValueError(
            f"{op}: {name} is {value}, expected None for a "
            f"{dtype_name(kv_dtype)} cache (scales apply to FP8 only)"
        )
    return 1.0, 1.0


def _paged(op, q, shape, sizes, q_len, cache, options, out, k_scale, v_scale):
    """`cache` = (k_cache, v_cache, page_table, cache_seqlens): caches [num_pages, P, Hkv, D]
    of q's dtype or FP8, page_table [B, *] and cache_seqlens [B] int32; `shape` is q's;
    `sizes` = (B, query tokens, longest query sequence).
    Returns (request, softmax scale, k_scale, v_scale)."""
    # Inline conditions rather than one helper call per tensor (`_like`, `dense_last_dim`):
    # each call costs ~0.1-0.2 µs of the ~4 µs this takes, and decode runs it on every step.
    # `x.is_contiguous() or x.stride(-1) == 1` is `dense_last_dim`: the flag is cached, the
    # stride is read only where it is not set.
    k_cache, v_cache, page_table, cache_seqlens = cache
    num_seqs = sizes[0]
    device, q_dtype, head_dim = q.device, q.dtype, shape[-1]
    ks = k_cache.shape if isinstance(k_cache, _Tensor) else ()
    if len(ks) != 4:
        raise _ndim_error(op, "k_cache", k_cache, (4,))
    kv_dtype = k_cache.dtype
    if ks[3] != head_dim:
        raise shape_error(op, "k_cache", k_cache, (None, None, None, head_dim))
    if kv_dtype is not q_dtype and kv_dtype not in FP8_DTYPES:
        raise dtype_error(op, "k_cache", k_cache, {q_dtype, *FP8_DTYPES})
    if k_cache.device != device:
        raise device_error(op, "k_cache", k_cache, device)
    if not isinstance(v_cache, _Tensor):
        raise type_error(op, "v_cache", v_cache, "a torch.Tensor")
    if v_cache.shape != ks:
        raise shape_error(op, "v_cache", v_cache, ks)
    if v_cache.dtype is not kv_dtype:
        raise dtype_error(op, "v_cache", v_cache, (kv_dtype,))
    if v_cache.device != device:
        raise device_error(op, "v_cache", v_cache, device)
    if not (k_cache.is_contiguous() or k_cache.stride(-1) == 1):
        raise stride_error(op, "k_cache", k_cache)
    if not (v_cache.is_contiguous() or v_cache.stride(-1) == 1):
        raise stride_error(op, "v_cache", v_cache)
    pts = page_table.shape if isinstance(page_table, _Tensor) else ()
    if len(pts) != 2:
        raise _ndim_error(op, "page_table", page_table, (2,))
    if pts[0] != num_seqs:
        raise shape_error(op, "page_table", page_table, (num_seqs, None))
    if page_table.dtype is not _INT32:
        raise dtype_error(op, "page_table", page_table, (_INT32,))
    if page_table.device != device:
        raise device_error(op, "page_table", page_table, device)
    # Kernels step along a row of page ids and over cache_seqlens by one element.
    if not (page_table.is_contiguous() or page_table.stride(-1) == 1):
        raise stride_error(op, "page_table", page_table)
    lens = cache_seqlens.shape if isinstance(cache_seqlens, _Tensor) else ()
    if len(lens) != 1:
        raise _ndim_error(op, "cache_seqlens", cache_seqlens, (1,))
    if lens[0] != num_seqs:
        raise shape_error(op, "cache_seqlens", cache_seqlens, (num_seqs,))
    if cache_seqlens.dtype is not _INT32:
        raise dtype_error(op, "cache_seqlens", cache_seqlens, (_INT32,))
    if cache_seqlens.device != device:
        raise device_error(op, "cache_seqlens", cache_seqlens, device)
    if not (cache_seqlens.is_contiguous() or cache_seqlens.stride(-1) == 1):
        raise stride_error(op, "cache_seqlens", cache_seqlens)
    if ks[1] < 1:
        raise ValueError(f"{op}: k_cache has shape {list(ks)}, expected page size >= 1")
    request, scale = _request(
        op, device, options, q_dtype, kv_dtype, head_dim, shape[-2], ks[2], ks[1], q_len, True,
        sizes[1], sizes[2],
    )  # fmt: skip
    if kv_dtype is _FP8 or k_scale is not None or v_scale is not None:
        k_scale, v_scale = _kv_scales(op, kv_dtype, k_scale, v_scale)
    else:  # no scales for a 16-bit cache: `_kv_scales` would return these
        k_scale = v_scale = 1.0
    if out is not None:
        # `_like(op, "out", out, device, out dtypes, shape)`, inlined
        if not isinstance(out, _Tensor):
            raise type_error(op, "out", out, "a torch.Tensor")
        if out.shape != shape:
            raise shape_error(op, "out", out, shape)
        if out.dtype is not q_dtype and (kv_dtype is not _FP8 or out.dtype not in _FP8_OUT):
            raise dtype_error(op, "out", out, _FP8_OUT if kv_dtype is _FP8 else (q_dtype,))
        if out.device != device:
            raise device_error(op, "out", out, device)
        if not (out.is_contiguous() or out.stride(-1) == 1):
            raise stride_error(op, "out", out)
    return request, scale, k_scale, v_scale


def _request(
    op, device, options, dtype, kv_dtype, head_dim, hq, hkv, page_size, q_len, causal, tokens,
    seqlen,
):  # fmt: skip
    """GQA and the options shared by the three ops; `options` = (window_left, sinks,
    softmax_scale, return_lse); `tokens`/`seqlen` are rounded up to powers of two
    (`request.size_bucket`, inlined). Returns (request, softmax scale)."""
    window_left, sinks, softmax_scale, return_lse = options
    if hkv < 1 or hq < 1 or hq % hkv:
        raise ValueError(
            f"{op}: q has {hq} heads and the keys {hkv}, "
            "expected the query heads to be a multiple of the KV heads (at least one each)"
        )
    if type(window_left) is not int:
        window_left = as_int(op, "window_left", window_left)
    if window_left < -1:
        raise ValueError(f"{op}: window_left is {window_left}, expected -1 (no window) or >= 0")
    if window_left > INT32_MAX:
        raise ValueError(f"{op}: window_left is {window_left}, expected <= {INT32_MAX}")
    if window_left >= 0 and not causal:
        raise ValueError(
            f"{op}: window_left is {window_left} with causal=False, expected "
            "causal=True (a window counts keys to the left of each query)"
        )
    if sinks is not None:
        # Kernels read sinks[h] at offset h: a strided view would give other heads' values.
        # `_like(op, "sinks", sinks, device, SINK_DTYPES, (hq,))`, inlined
        if not isinstance(sinks, _Tensor):
            raise type_error(op, "sinks", sinks, "a torch.Tensor")
        if sinks.shape != (hq,):
            raise shape_error(op, "sinks", sinks, (hq,))
        if sinks.dtype not in SINK_DTYPES:
            raise dtype_error(op, "sinks", sinks, SINK_DTYPES)
        if sinks.device != device:
            raise device_error(op, "sinks", sinks, device)
        if not (sinks.is_contiguous() or sinks.stride(-1) == 1):
            raise stride_error(op, "sinks", sinks)
    if softmax_scale is None:
        scale = head_dim**-0.5
    else:
        scale = check_positive_float(op, "softmax_scale", softmax_scale)
    if type(return_lse) is not bool:
        return_lse = as_bool(op, "return_lse", return_lse)
    # tuple.__new__ skips the NamedTuple's Python-level __new__ (~0.1 µs on the decode path).
    request = tuple.__new__(Request, (
        dtype, kv_dtype, head_dim, hq, hkv, page_size, q_len, causal, window_left,
        sinks is not None, return_lse,
        1 << (tokens - 1).bit_length() if tokens > 0 else 0,
        1 << (seqlen - 1).bit_length() if seqlen > 0 else 0,
    ))  # fmt: skip
    return request, scale


def out_dtype(q_dtype, kv_dtype) -> torch.dtype:
    """The dtype of an output the caller does not give: bf16 for an FP8 cache (the contract)."""
    return _FP8_OUT[0] if kv_dtype is _FP8 else q_dtype


def check_prefill(q, k, v, cu_seqlens, max_seqlen, causal, options, out):
    """`options` = (window_left, sinks, softmax_scale, return_lse).
    Returns (request, softmax scale, max_seqlen)."""
    op = MHA_PREFILL
    shape = _q(op, q, (3,))
    device = q.device
    ks = _tensor(op, "k", k, (3,))
    if ks[0] != shape[0] or ks[2] != shape[2]:
        raise shape_error(op, "k", k, (shape[0], None, shape[2]))
    _like(op, "k", k, device, (q.dtype,))
    _like(op, "v", v, device, (q.dtype,), ks)
    _tensor(op, "cu_seqlens", cu_seqlens, (1,))
    # Offsets are read at consecutive addresses: a strided view would give other values.
    _like(op, "cu_seqlens", cu_seqlens, device, (_INT32,))
    if cu_seqlens.shape[0] < 1:
        raise ValueError(f"{op}: cu_seqlens has shape [0], expected [B+1] with B >= 0")
    max_seqlen = check_int(op, "max_seqlen", max_seqlen, minimum=0)
    if type(causal) is not bool:
        causal = as_bool(op, "causal", causal)
    request, scale = _request(
        op, device, options, q.dtype, k.dtype, shape[2], shape[1], ks[1], 0, 0, causal,
        shape[0], max_seqlen,
    )  # fmt: skip
    if out is not None:
        _like(op, "out", out, device, (q.dtype,), shape)
    return request, scale, max_seqlen


def check_extend(q, cu_seqlens_q, max_seqlen_q, cache, options, out, k_scale, v_scale):
    """Returns (request, softmax scale, k_scale, v_scale, max_seqlen_q)."""
    op = MHA_EXTEND
    shape = _q(op, q, (3,))
    _tensor(op, "cu_seqlens_q", cu_seqlens_q, (1,))
    _like(op, "cu_seqlens_q", cu_seqlens_q, q.device, (_INT32,))
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_seqs < 0:
        raise ValueError(f"{op}: cu_seqlens_q has shape [0], expected [B+1] with B >= 0")
    max_seqlen_q = check_int(op, "max_seqlen_q", max_seqlen_q, minimum=0)
    sizes = (num_seqs, shape[0], max_seqlen_q)
    checked = _paged(op, q, shape, sizes, 0, cache, options, out, k_scale, v_scale)
    return (*checked, max_seqlen_q)


def check_decode(q, cache, options, out, k_scale, v_scale):
    """Returns (request, softmax scale, k_scale, v_scale)."""
    op = MHA_DECODE
    # `_q(op, q, (3, 4))`, inlined: two calls fewer on every decode step.
    shape = q.shape if isinstance(q, _Tensor) else ()
    ndim = len(shape)
    if ndim != 3 and ndim != 4:
        raise _ndim_error(op, "q", q, (3, 4))
    if q.dtype not in FLOAT16_DTYPES:
        raise dtype_error(op, "q", q, FLOAT16_DTYPES)
    if not (q.is_contiguous() or q.stride(-1) == 1):
        raise stride_error(op, "q", q)
    if shape[-1] < 1:
        raise ValueError(f"{op}: q has head dim {shape[-1]}, expected >= 1")
    q_len = shape[1] if ndim == 4 else 1
    if q_len < 1:
        raise ValueError(f"{op}: q has shape {list(shape)}, expected Q >= 1 tokens per sequence")
    sizes = (shape[0], shape[0] * q_len, 0)
    return _paged(op, q, shape, sizes, q_len, cache, options, out, k_scale, v_scale)


def check_store(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    """Returns (request, k_scale, v_scale)."""
    # Every decode step stores: `_tensor` and `_like` inlined, as in `_paged`.
    op = KVCACHE_STORE
    shape = k.shape if isinstance(k, _Tensor) else ()
    if len(shape) != 3:
        raise _ndim_error(op, "k", k, (3,))
    k_dtype = k.dtype
    if k_dtype not in FLOAT16_DTYPES:
        raise dtype_error(op, "k", k, FLOAT16_DTYPES)
    if not (k.is_contiguous() or k.stride(-1) == 1):
        raise stride_error(op, "k", k)
    device = k.device
    if not isinstance(v, _Tensor):
        raise type_error(op, "v", v, "a torch.Tensor")
    if v.shape != shape:
        raise shape_error(op, "v", v, shape)
    if v.dtype is not k_dtype:
        raise dtype_error(op, "v", v, (k_dtype,))
    if v.device != device:
        raise device_error(op, "v", v, device)
    if not (v.is_contiguous() or v.stride(-1) == 1):
        raise stride_error(op, "v", v)
    cs = k_cache.shape if isinstance(k_cache, _Tensor) else ()
    if len(cs) != 4:
        raise _ndim_error(op, "k_cache", k_cache, (4,))
    if cs[2] != shape[1] or cs[3] != shape[2]:
        raise shape_error(op, "k_cache", k_cache, (None, None, shape[1], shape[2]))
    kv_dtype = k_cache.dtype
    if kv_dtype is not k_dtype and kv_dtype not in FP8_DTYPES:
        raise dtype_error(op, "k_cache", k_cache, {k_dtype, *FP8_DTYPES})
    if k_cache.device != device:
        raise device_error(op, "k_cache", k_cache, device)
    if not (k_cache.is_contiguous() or k_cache.stride(-1) == 1):
        raise stride_error(op, "k_cache", k_cache)
    if not isinstance(v_cache, _Tensor):
        raise type_error(op, "v_cache", v_cache, "a torch.Tensor")
    if v_cache.shape != cs:
        raise shape_error(op, "v_cache", v_cache, cs)
    if v_cache.dtype is not kv_dtype:
        raise dtype_error(op, "v_cache", v_cache, (kv_dtype,))
    if v_cache.device != device:
        raise device_error(op, "v_cache", v_cache, device)
    if not (v_cache.is_contiguous() or v_cache.stride(-1) == 1):
        raise stride_error(op, "v_cache", v_cache)
    slots = slot_mapping.shape if isinstance(slot_mapping, _Tensor) else ()
    if len(slots) != 1:
        raise _ndim_error(op, "slot_mapping", slot_mapping, (1,))
    if slots[0] != shape[0]:
        raise shape_error(op, "slot_mapping", slot_mapping, (shape[0],))
    if slot_mapping.dtype is not _INT64:
        raise dtype_error(op, "slot_mapping", slot_mapping, (_INT64,))
    if slot_mapping.device != device:
        raise device_error(op, "slot_mapping", slot_mapping, device)
    if kv_dtype is _FP8 or k_scale is not None or v_scale is not None:
        k_scale, v_scale = _kv_scales(op, kv_dtype, k_scale, v_scale)
    else:  # no scales for a 16-bit cache: `_kv_scales` would return these
        k_scale = v_scale = 1.0
    tokens = 1 << (shape[0] - 1).bit_length() if shape[0] > 0 else 0
    # tuple.__new__ skips the NamedTuple's Python-level __new__, as in `_request`.
    request = tuple.__new__(KVStoreRequest, (k_dtype, kv_dtype, shape[2], shape[1], cs[1], tokens))
    return request, k_scale, v_scale
