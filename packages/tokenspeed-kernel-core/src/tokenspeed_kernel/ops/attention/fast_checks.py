"""One-expression validity predicates for the ops that run every decode step.

Validation through the per-argument checkers costs ~15 µs per call on a slow host; these
predicates accept exactly the valid calls in ~2 µs. When one says no (or trips over a
non-tensor), the op runs the per-argument checkers, which raise the precise error.
`tests/core/test_api_validation.py` runs every invalid case through both.
"""

from __future__ import annotations

import math

import torch

_F16 = (torch.bfloat16, torch.float16)
_FP8 = torch.float8_e4m3fn
_SINK = (torch.float32, torch.bfloat16)
_I32, _I64 = torch.int32, torch.int64


def _scale_ok(value, fp8: bool) -> bool:
    if value is None:
        return True
    return fp8 and type(value) in (float, int) and 0 < value < math.inf


def _last_dim_dense(x) -> bool:
    return x.is_contiguous() or x.stride(-1) == 1


def decode_args_valid(
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
) -> bool:
    try:
        qs = q.shape
        if len(qs) == 3:
            batch, q_heads, head_dim = qs
        elif len(qs) == 4:
            batch, q_len, q_heads, head_dim = qs
            if q_len < 1:
                return False
        else:
            return False
        # get_device() (an int) and is_contiguous() (a cached flag) are the cheapest probes.
        device, kv_dtype, ks = q.get_device(), k_cache.dtype, k_cache.shape
        fp8 = kv_dtype is _FP8
        return (
            q.dtype in _F16
            and _last_dim_dense(q)
            and head_dim >= 1
            and len(ks) == 4
            and ks[3] == head_dim
            and ks[1] >= 1
            and ks[2] >= 1
            and q_heads % ks[2] == 0
            and (fp8 or kv_dtype is q.dtype)
            and v_cache.shape == ks
            and v_cache.dtype is kv_dtype
            and k_cache.get_device() == device
            and v_cache.get_device() == device
            and _last_dim_dense(k_cache)
            and _last_dim_dense(v_cache)
            and page_table.dtype is _I32
            and page_table.ndim == 2
            and page_table.shape[0] == batch
            and page_table.get_device() == device
            and cache_seqlens.dtype is _I32
            and cache_seqlens.shape == (batch,)
            and cache_seqlens.get_device() == device
            and type(window_left) is int
            and window_left >= -1
            and (
                sinks is None
                or (
                    sinks.shape == (q_heads,)
                    and sinks.dtype in _SINK
                    and sinks.get_device() == device
                )
            )
            and (
                softmax_scale is None
                or (type(softmax_scale) in (float, int) and 0 < softmax_scale < math.inf)
            )
            and type(return_lse) is bool
            and _scale_ok(k_scale, fp8)
            and _scale_ok(v_scale, fp8)
            and (
                out is None
                or (
                    out.shape == qs
                    and out.get_device() == device
                    and _last_dim_dense(out)
                    and (out.dtype in _F16 if fp8 else out.dtype is q.dtype)
                )
            )
        )
    except (AttributeError, TypeError, ValueError):
        return False


def store_args_valid(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> bool:
    try:
        shape, device, cs = k.shape, k.get_device(), k_cache.shape
        fp8 = k_cache.dtype is _FP8
        return (
            len(shape) == 3
            and k.dtype in _F16
            and v.shape == shape
            and v.dtype is k.dtype
            and v.get_device() == device
            and len(cs) == 4
            and cs[2] == shape[1]
            and cs[3] == shape[2]
            and (fp8 or k_cache.dtype is k.dtype)
            and v_cache.shape == cs
            and v_cache.dtype is k_cache.dtype
            and k_cache.get_device() == device
            and v_cache.get_device() == device
            and _last_dim_dense(k)
            and _last_dim_dense(v)
            and _last_dim_dense(k_cache)
            and _last_dim_dense(v_cache)
            and slot_mapping.dtype is _I64
            and slot_mapping.shape == (shape[0],)
            and slot_mapping.get_device() == device
            and _scale_ok(k_scale, fp8)
            and _scale_ok(v_scale, fp8)
        )
    except (AttributeError, TypeError, ValueError):
        return False
