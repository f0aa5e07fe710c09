"""Public attention operators: check, select a kernel, call it.

Kernels receive normalized arguments: every default resolved, `out` (and `lse` when asked
for) preallocated, decode q always 4-D [B, Q, Hq, D]. Values on the device (sequence lengths,
page ids) are not read here, since that would synchronize the stream on every call, except in
checked mode (`TOKENSPEED_KERNEL_CHECKED=1`, see `index_checks`). Validity is defined once, in
`checks`.

Under torch.compile each public function hands its arguments to the `torch.library` custom op
of the same name (`ops.library`), so selection, checks and ContextVar lookups run inside the
opaque op at run time instead of in Dynamo's traced region; the op runs the `*_into` function.
"""

from __future__ import annotations

import torch

from ... import capture, env
from ...platform import platform_of
from ...selector import select
from .. import index_checks
from .checks import check_decode, check_extend, check_prefill, check_store, out_dtype

_FLOAT32 = torch.float32
# Bound once: each eager call tests it first, and the attribute chain costs ~50 ns more.
_compiling = torch.compiler.is_compiling


def _kernel(op, request, device, positional):
    """The function of the kernel selected for `request`; under TOKENSPEED_KERNEL_CAPTURE,
    one that records each call first (`positional` names its positional arguments)."""
    try:
        platform = platform_of(device)
    except ValueError as exc:  # a device no kernel can run on (meta): name the argument
        raise ValueError(f"{op}: {positional[0]} is on {device}: {exc}") from None
    kernel = select(op, request, platform)
    if capture.active():
        return capture.recording(op, kernel.name, kernel.fn, positional)
    return kernel.fn


# Allocations only when needed: on the decode path a helper call costs ~0.1 µs of ~8.
def _new_out(q, kv_dtype):
    return torch.empty(q.shape, dtype=out_dtype(q.dtype, kv_dtype), device=q.device)


def _new_lse(q):
    return torch.empty(q.shape[:-1], dtype=_FLOAT32, device=q.device)


def mha_prefill(
    q, k, v, *, cu_seqlens, max_seqlen, causal=True,
    window_left=-1, sinks=None, softmax_scale=None, return_lse=False, out=None,
):  # fmt: skip
    """Ragged self-attention without a cache.

    q [T, Hq, D], k/v [T, Hkv, D] bf16/fp16; cu_seqlens [B+1] int32; max_seqlen int.
    Returns out [T, Hq, D], and lse [T, Hq] float32 if `return_lse`.
    """
    options = (window_left, sinks, softmax_scale, return_lse)
    if _compiling():
        from .. import library

        return library.mha_prefill(q, k, v, cu_seqlens, max_seqlen, causal, options, out)
    out, lse = prefill_into(q, k, v, cu_seqlens, max_seqlen, causal, options, out, None)
    return (out, lse) if return_lse else out


def prefill_into(q, k, v, cu_seqlens, max_seqlen, causal, options, out, lse):
    """Check, allocate what the caller did not give, select and run; returns (out, lse).
    `lse` is given only by the custom op (preallocated when `options` ask for it)."""
    request, scale, max_seqlen = check_prefill(
        q, k, v, cu_seqlens, max_seqlen, causal, options, out
    )
    if env.checked:
        index_checks.check_prefill(cu_seqlens, q.shape[0], max_seqlen)
    out = _new_out(q, q.dtype) if out is None else out
    if options[3] and lse is None:
        lse = _new_lse(q)
    _kernel("mha_prefill", request, q.device, ("q", "k", "v"))(
        q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, causal=request.causal,
        window_left=request.window_left, sinks=options[1], softmax_scale=scale, out=out, lse=lse,
    )  # fmt: skip
    return out, lse


def mha_extend_with_kvcache(
    q, k_cache, v_cache, *, cu_seqlens_q, page_table, cache_seqlens, max_seqlen_q,
    window_left=-1, sinks=None, softmax_scale=None, return_lse=False, out=None,
    k_scale=None, v_scale=None,
):  # fmt: skip
    """Chunked prefill over the paged cache (the new tokens are already stored).

    q [T, Hq, D] ragged by cu_seqlens_q [B+1] int32; caches [num_pages, P, Hkv, D];
    page_table [B, max_pages] int32; cache_seqlens [B] int32 (including the new tokens).
    Row i of sequence b is position cache_seqlens[b] - n_b + i; causal.
    """
    cache = (k_cache, v_cache, page_table, cache_seqlens)
    options = (window_left, sinks, softmax_scale, return_lse)
    ragged = (cu_seqlens_q, max_seqlen_q)
    if _compiling():
        from .. import library

        return library.mha_extend_with_kvcache(q, ragged, cache, options, out, k_scale, v_scale)
    out, lse = extend_into(q, ragged, cache, options, out, None, k_scale, v_scale)
    return (out, lse) if return_lse else out


def extend_into(q, ragged, cache, options, out, lse, k_scale, v_scale):
    """`prefill_into` for mha_extend_with_kvcache; `ragged` = (cu_seqlens_q, max_seqlen_q)."""
    cu_seqlens_q, max_seqlen_q = ragged
    k_cache, v_cache, page_table, cache_seqlens = cache
    request, scale, k_scale, v_scale, max_seqlen_q = check_extend(
        q, cu_seqlens_q, max_seqlen_q, cache, options, out, k_scale, v_scale
    )
    if env.checked:
        index_checks.check_extend(
            q, k_cache, cu_seqlens_q, page_table, cache_seqlens, max_seqlen_q, request.window_left
        )
    out = _new_out(q, k_cache.dtype) if out is None else out
    if options[3] and lse is None:
        lse = _new_lse(q)
    _kernel("mha_extend_with_kvcache", request, q.device, ("q", "k_cache", "v_cache"))(
        q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, page_table=page_table,
        cache_seqlens=cache_seqlens, max_seqlen_q=max_seqlen_q, window_left=request.window_left,
        sinks=options[1], softmax_scale=scale, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse,
    )  # fmt: skip
    return out, lse


def mha_decode_with_kvcache(
    q, k_cache, v_cache, *, page_table, cache_seqlens,
    window_left=-1, sinks=None, softmax_scale=None, return_lse=False, out=None,
    k_scale=None, v_scale=None,
):  # fmt: skip
    """Decode Q new tokens per sequence over the paged cache.

    q [B, Hq, D] (one token each) or [B, Q, Hq, D] (causal among themselves); caches
    [num_pages, P, Hkv, D]; page_table [B, max_pages] int32; cache_seqlens [B] int32.
    Returns q's shape (and lse [B, Hq] or [B, Q, Hq] float32 if `return_lse`).
    """
    cache = (k_cache, v_cache, page_table, cache_seqlens)
    options = (window_left, sinks, softmax_scale, return_lse)
    if _compiling():
        from .. import library

        return library.mha_decode_with_kvcache(q, cache, options, out, k_scale, v_scale)
    out, lse = decode_into(q, cache, options, out, None, k_scale, v_scale)
    return (out, lse) if return_lse else out


def decode_into(q, cache, options, out, lse, k_scale, v_scale):
    """`prefill_into` for mha_decode_with_kvcache."""
    request, scale, k_scale, v_scale = check_decode(q, cache, options, out, k_scale, v_scale)
    k_cache, v_cache, page_table, cache_seqlens = cache
    out = _new_out(q, k_cache.dtype) if out is None else out
    if options[3] and lse is None:
        lse = _new_lse(q)
    q4, out4, lse4 = q, out, lse
    if q.dim() == 3:
        q4, out4 = q.unsqueeze(1), out.unsqueeze(1)
        lse4 = None if lse is None else lse.unsqueeze(1)
    if env.checked:
        index_checks.check_decode(q4, k_cache, page_table, cache_seqlens, request.window_left)
    _kernel("mha_decode_with_kvcache", request, q.device, ("q", "k_cache", "v_cache"))(
        q4, k_cache, v_cache, page_table=page_table, cache_seqlens=cache_seqlens,
        window_left=request.window_left, sinks=options[1], softmax_scale=scale,
        k_scale=k_scale, v_scale=v_scale, out=out4, lse=lse4,
    )  # fmt: skip
    return out, lse


def kvcache_store(k, v, k_cache, v_cache, *, slot_mapping, k_scale=None, v_scale=None):
    """Write k/v [T, Hkv, D] into the paged caches [num_pages, P, Hkv, D] in place at
    slot_mapping [T] int64 (slot = page * P + offset; negative = skip). Quantizes to an FP8
    cache as fp8(k / k_scale)."""
    if _compiling():
        from .. import library

        return library.kvcache_store(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    store_into(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def store_into(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    """Check, select and run kvcache_store (the custom op's implementation too)."""
    request, k_scale, v_scale = check_store(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if env.checked:
        index_checks.check_store(k_cache, slot_mapping)
    _kernel("kvcache_store", request, k.device, ("k", "v", "k_cache", "v_cache"))(
        k, v, k_cache, v_cache, slot_mapping=slot_mapping, k_scale=k_scale, v_scale=v_scale
    )
