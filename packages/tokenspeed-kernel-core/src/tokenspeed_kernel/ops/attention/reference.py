"""Pure-torch reference attention kernels: the numerics oracle and the run-anywhere fallback.

Arguments arrive validated and normalized by the public API (defaults resolved, q of decode always
4-D). The values of the index tensors are checked here always (`index_checks`, what the ops run in
checked mode): the oracle raises the same named errors instead of failing inside torch indexing.
Math is float32 throughout; the result is cast once, into the caller's ``out``. One helper,
``_attend``, holds the masked softmax with sinks for one sequence; prefill, extend and decode only
differ in where their keys come from and at which absolute positions their queries sit.
"""

from __future__ import annotations

import torch

from ...registry import ANY, register_kernel
from ...validation import FLOAT16_DTYPES, KV_CACHE_DTYPES
from .. import index_checks
from .request import KVCACHE_STORE, MHA_DECODE, MHA_EXTEND, MHA_PREFILL

_FP8 = torch.float8_e4m3fn
_FP8_MAX = 448.0

# Elements of one [Hq, rows, keys] score block. Queries are processed in row blocks so a long
# prefill on the fallback path needs a bounded few hundred MiB instead of Hq * n * n floats.
_SCORE_BLOCK_ELEMS = 1 << 25


def _attend(q, k, v, *, q_start, k_start, causal, window_left, sinks, softmax_scale, out, lse):
    """Attention of one sequence.

    q [n, Hq, D] float32, query row i at absolute position q_start + i.
    k, v [L, Hkv, D] float32, key row j at absolute position k_start + j.
    sinks [Hq] float32 or None. Writes out [n, Hq, D] and, unless None, lse [n, Hq].
    """
    n, num_q_heads, head_dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    # [n, Hkv, group, D]: query head h = kv * group + g, so GQA needs no copy of K/V.
    q = q.view(n, num_kv_heads, group, head_dim)
    sink = None if sinks is None else sinks.view(num_q_heads, 1)
    rows = max(1, _SCORE_BLOCK_ELEMS // max(1, num_q_heads * num_keys))
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        # Only keys some query of this block can see: causal bounds the end, the window the start.
        hi = (q_start + r1 - k_start) if causal else num_keys
        lo = (q_start + r0 - window_left - k_start) if window_left >= 0 else 0
        hi = min(max(hi, 0), num_keys)
        lo = min(max(lo, 0), hi)
        q_pos = torch.arange(q_start + r0, q_start + r1, device=q.device)
        k_pos = torch.arange(k_start + lo, k_start + hi, device=q.device)

        s = torch.einsum("nkgd,lkd->kgnl", q[r0:r1], k[lo:hi]).reshape(num_q_heads, r1 - r0, -1)
        s = s * softmax_scale
        visible = torch.ones(r1 - r0, hi - lo, dtype=torch.bool, device=q.device)
        if causal:
            visible &= k_pos[None, :] <= q_pos[:, None]
        if window_left >= 0:
            visible &= k_pos[None, :] >= q_pos[:, None] - window_left
        s = s.masked_fill(~visible, float("-inf"))

        # m over keys AND sink: a sink far above every logit (e.g. +30) must not overflow exp.
        m = s.amax(dim=-1) if hi > lo else s.new_full((num_q_heads, r1 - r0), float("-inf"))
        if sink is not None:
            m = torch.maximum(m, sink)
        # m = -inf only when nothing is visible and there is no sink: shift by 0 so that the
        # numerator and denominator both come out 0 instead of NaN.
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp(s - m[..., None])
        denom = p.sum(dim=-1)
        if sink is not None:
            denom = denom + torch.exp(sink - m)
        o = _weighted_values(p.view(num_kv_heads, group, r1 - r0, -1), v[lo:hi], visible)
        # denom >= 1 whenever anything (key or sink) is visible, since the max term is exp(0).
        safe = torch.where(denom > 0, denom, torch.ones_like(denom))
        o = o.reshape(r1 - r0, num_q_heads, head_dim) / safe.t()[..., None]
        out[r0:r1].copy_(o)
        if lse is not None:
            lse[r0:r1].copy_((m + torch.log(denom)).t())


def _weighted_values(p, v, visible):
    """o [n, Hkv, group, D] = p @ v, where a key masked for a row contributes nothing whatever
    its value (0 * NaN would be NaN) and a visible non-finite value makes the row NaN."""
    finite = torch.isfinite(v).all(dim=-1)  # [L, Hkv]
    if bool(finite.all()):
        return torch.einsum("kgnl,lkd->nkgd", p, v)
    o = torch.einsum("kgnl,lkd->nkgd", p, v.masked_fill(~finite[..., None], 0.0))
    poisoned = (visible.float() @ (~finite).float()) > 0  # [n, Hkv]
    return o.masked_fill(poisoned[:, :, None, None], float("nan"))


def _dequant(cache, scale):
    # The per-tensor scales describe FP8 caches only; bf16/fp16 caches hold the values themselves.
    x = cache.float()
    return x * scale if cache.dtype == _FP8 else x


def _gather(cache, page_row, start, end, scale):
    """Logical positions start .. end-1 of one sequence as [end - start, Hkv, D] float32."""
    page_size = cache.shape[1]
    pos = torch.arange(start, end, device=cache.device)
    pages = page_row.to(cache.device)[pos // page_size].long()
    return _dequant(cache[pages, pos % page_size], scale)


def _attend_paged(q, k_cache, v_cache, page_row, seqlen, *, window_left, k_scale, v_scale, **kw):
    """The n = q.shape[0] queries are the last n positions of a sequence of seqlen cached tokens."""
    q_start = seqlen - q.shape[0]
    # A window never looks before q_start - W; skip gathering pages no query can see.
    k_start = 0 if window_left < 0 else max(q_start - window_left, 0)
    k = _gather(k_cache, page_row, k_start, seqlen, k_scale)
    v = _gather(v_cache, page_row, k_start, seqlen, v_scale)
    _attend(
        q.float(),
        k,
        v,
        q_start=q_start,
        k_start=k_start,
        causal=True,
        window_left=window_left,
        **kw,
    )


def _sinks_f32(sinks):
    return None if sinks is None else sinks.float()


def reference_prefill(
    q, k, v, *, cu_seqlens, max_seqlen, causal, window_left, sinks, softmax_scale, out, lse
) -> None:
    """Ragged self-attention without a cache.

    q [T, Hq, D], k/v [T, Hkv, D], cu_seqlens [B+1] int32, sinks [Hq] or None,
    out [T, Hq, D], lse [T, Hq] float32 or None. max_seqlen is only checked: lengths come
    from cu_seqlens, which the reference reads on the host anyway.
    """
    sinks = _sinks_f32(sinks)
    bounds = index_checks.check_prefill(cu_seqlens, q.shape[0], max_seqlen)
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        if e == s:
            continue
        _attend(
            q[s:e].float(),
            k[s:e].float(),
            v[s:e].float(),
            q_start=0,
            k_start=0,
            causal=causal,
            window_left=window_left,
            sinks=sinks,
            softmax_scale=softmax_scale,
            out=out[s:e],
            lse=None if lse is None else lse[s:e],
        )


def _attend_sequences(q, k_cache, v_cache, page_table, seqlens, rows, *, sinks, out, lse, **kw):
    """`rows[b]` indexes the query (and output) rows of sequence b, `seqlens[b]` is its cached
    length; `kw` holds window_left, softmax_scale, k_scale and v_scale."""
    sinks = _sinks_f32(sinks)
    for b, (seqlen, r) in enumerate(zip(seqlens, rows, strict=True)):
        if q[r].shape[0] == 0:
            continue
        rows_lse = None if lse is None else lse[r]
        _attend_paged(
            q[r],
            k_cache,
            v_cache,
            page_table[b],
            seqlen,
            sinks=sinks,
            out=out[r],
            lse=rows_lse,
            **kw,
        )


def reference_extend(
    q, k_cache, v_cache, *, cu_seqlens_q, page_table, cache_seqlens, max_seqlen_q,
    window_left, sinks, softmax_scale, k_scale, v_scale, out, lse,
) -> None:  # fmt: skip
    """Chunked prefill against a paged cache that already holds the new tokens.

    q [T, Hq, D] ragged by cu_seqlens_q [B+1]; k_cache/v_cache [num_pages, P, Hkv, D];
    page_table [B, max_pages] int32; cache_seqlens [B] int32 (including the new tokens);
    out [T, Hq, D]; lse [T, Hq] float32 or None. max_seqlen_q is only checked (see prefill).
    """
    bounds, seqlens = index_checks.check_extend(
        q, k_cache, cu_seqlens_q, page_table, cache_seqlens, max_seqlen_q, window_left
    )
    rows = [slice(s, e) for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
    _attend_sequences(
        q, k_cache, v_cache, page_table, seqlens, rows, window_left=window_left,
        sinks=sinks, softmax_scale=softmax_scale, k_scale=k_scale, v_scale=v_scale,
        out=out, lse=lse,
    )  # fmt: skip


def reference_decode(
    q, k_cache, v_cache, *, page_table, cache_seqlens,
    window_left, sinks, softmax_scale, k_scale, v_scale, out, lse,
) -> None:  # fmt: skip
    """Decode: extend with exactly Q new tokens per sequence.

    q [B, Q, Hq, D]; out [B, Q, Hq, D]; lse [B, Q, Hq] float32 or None; cache as for extend.
    A sequence shorter than Q (cache_seqlens 0 for a padded batch slot) puts its first queries
    at negative positions, which see no key: zeros, or the sink alone.
    """
    seqlens = index_checks.check_decode(q, k_cache, page_table, cache_seqlens, window_left)
    _attend_sequences(
        q, k_cache, v_cache, page_table, seqlens, range(q.shape[0]),
        window_left=window_left, sinks=sinks, softmax_scale=softmax_scale, k_scale=k_scale,
        v_scale=v_scale, out=out, lse=lse,
    )  # fmt: skip


def _quantize(x, dtype, scale):
    if dtype != _FP8:
        return x.to(dtype)
    # Saturate instead of overflowing: e4m3fn has no inf, and out-of-range values would become NaN.
    return (x.float() / scale).clamp(-_FP8_MAX, _FP8_MAX).to(_FP8)


def reference_kvcache_store(k, v, k_cache, v_cache, *, slot_mapping, k_scale, v_scale) -> None:
    """Write k/v [T, Hkv, D] into caches [num_pages, P, Hkv, D] at slot_mapping [T] int64.

    slot = page * P + offset; a negative slot skips its token (padding). FP8 caches store
    (x / scale) saturated to +-448, rounded to nearest even; other caches store x cast.
    """
    index_checks.check_store(k_cache, slot_mapping)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].to(k_cache.device)
    page_size = k_cache.shape[1]
    pages, offsets = slots // page_size, slots % page_size
    k_cache[pages, offsets] = _quantize(k[keep], k_cache.dtype, k_scale)
    v_cache[pages, offsets] = _quantize(v[keep], v_cache.dtype, v_scale)


_PAGED_TRAITS = {
    "dtype": FLOAT16_DTYPES,
    "kv_dtype": KV_CACHE_DTYPES,
    "head_dim": ANY,
    "page_size": ANY,
}
_ATTENTION_TRAITS = _PAGED_TRAITS | {
    "gqa_ratio": ANY,
    "q_len": ANY,
    "non_causal": True,
    "window": True,
    "sinks": True,
    "lse": True,
}
# Lowest priority: the numerics oracle, and the fallback that makes every op run anywhere.
for _op, _fn, _traits in (
    (MHA_PREFILL, reference_prefill, _ATTENTION_TRAITS),
    (MHA_EXTEND, reference_extend, _ATTENTION_TRAITS),
    (MHA_DECODE, reference_decode, _ATTENTION_TRAITS),
    (KVCACHE_STORE, reference_kvcache_store, _PAGED_TRAITS),
):
    register_kernel(
        _op, name=f"reference.{_op}", backend="reference", platforms=["*"], traits=_traits,
        priority=0, description="pure torch, float32 math",
    )(_fn)  # fmt: skip
