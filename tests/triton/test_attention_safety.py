"""Triton attention and kvcache_store on inputs that must not give wrong answers or touch memory
outside the tensors given: masked keys holding NaN/inf, sinks of +-inf, and out-of-range
device values (page ids, cache_seqlens, cu_seqlens, slots) under the documented rules.

Expected values come from `_attend64`, a float64 loop over each query row's visible keys only
(independent of the kernels and of the core reference). Caches, page tables and token tensors
are views inside larger buffers: guard regions hold NaN (a read would poison an output) or a
sentinel (a write would change it). CPU runs go through the Triton interpreter in fp16 (its
bf16 dot is broken); the GPU versions run at GPT-OSS shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from tokenspeed_kernel.testing import assert_close
from tokenspeed_kernel.tuning import pin_config
from tokenspeed_kernel_triton.attention import decode, extend, prefill
from tokenspeed_kernel_triton.attention._tiles import AttentionConfig
from tokenspeed_kernel_triton.attention.decode_config import DecodeConfig

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
SENTINEL = 7.0  # output rows no sequence covers keep what the caller put there


@dataclass(frozen=True)
class Shape:
    heads_q: int
    heads_kv: int
    dim: int
    page_size: int
    dtype: torch.dtype


CPU_SHAPE = Shape(4, 2, 64, 16, torch.float16)
GPT_OSS = Shape(64, 8, 64, 64, torch.bfloat16)
SHAPES = [
    pytest.param(CPU_SHAPE, id="cpu"),
    pytest.param(GPT_OSS, id="gpt-oss", marks=pytest.mark.gpu),
]


def _attend64(q, k, v, q_pos, k_pos, key_ok, *, window_left, sinks, scale, causal=True):
    """out [n, Hq, D], lse [n, Hq] float64 of one sequence; each row reads only its visible keys
    (key_ok, causality, window), so values of other keys cannot reach it."""
    n, heads_q, dim = q.shape
    group = heads_q // k.shape[1]
    q, k, v = q.double(), k.double(), v.double()
    out = torch.zeros(n, heads_q, dim, dtype=torch.float64)
    lse = torch.full((n, heads_q), -math.inf, dtype=torch.float64)
    for i in range(n):
        seen = key_ok.clone()
        if causal:
            seen &= k_pos <= q_pos[i]
        if window_left >= 0:
            seen &= k_pos >= q_pos[i] - window_left
        for h in range(heads_q):
            s = k[seen, h // group] @ q[i, h] * scale
            m = s.max() if s.numel() else torch.tensor(-math.inf, dtype=torch.float64)
            sink = -math.inf if sinks is None else float(sinks[h])
            if sink == math.inf:
                lse[i, h] = math.inf
                continue
            m = max(float(m), sink)
            if m == -math.inf:
                continue
            p = torch.exp(s - m)
            denom = p.sum() + math.exp(sink - m)
            out[i, h] = p @ v[seen, h // group] / denom
            lse[i, h] = m + math.log(denom)
    return out, lse


def _guarded(shape, dtype, fill, *, lead=1, tail=1, gen=None):
    """(view, buffer): a [shape] view inside a buffer with `lead`/`tail` guard rows of `fill`
    along dim 0 (random values in the view)."""
    buffer = torch.full((lead + shape[0] + tail, *shape[1:]), fill, dtype=torch.float32)
    buffer[lead : lead + shape[0]] = torch.randn(shape, generator=gen)
    buffer = buffer.to(dtype).to(DEVICE)
    return buffer[lead : lead + shape[0]], buffer


def _check(got, want, rows, dtype, name):
    assert_close(got[rows].float().cpu(), want[rows].float(), dtype=dtype, name=name)


# ----------------------------------------------------------------------------- sliding window


def _poison(x, upto, value):
    x = x.clone()
    x[:upto] = value
    return x


PREFILL_CONFIGS = [
    pytest.param(None, id="default"),
    pytest.param(AttentionConfig(16, 16, 1, 1), id="16x16"),
    pytest.param(AttentionConfig(64, 32, 1, 1, heads_per_tile=8, split_mask=False), id="onemask"),
]


def _prefill(shape, q, k, v, cu, *, window, sinks, out, lse, max_seqlen=None):
    kwargs = dict(causal=True, window_left=window, softmax_scale=0.125, out=out, lse=lse)
    prefill.mha_prefill(
        q.to(DEVICE), k.to(DEVICE), v.to(DEVICE),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=DEVICE),
        max_seqlen=max_seqlen or q.shape[0], sinks=None if sinks is None else sinks.to(DEVICE),
        **kwargs,
    )  # fmt: skip


def _tokens(gen, n, shape, poison=None):
    """q [n, Hq, D], k, v [n, Hkv, D] in shape.dtype; poison = (which, value, upto)."""
    q = torch.randn(n, shape.heads_q, shape.dim, generator=gen)
    k, v = (torch.randn(n, shape.heads_kv, shape.dim, generator=gen) for _ in "kv")
    if poison is not None:
        which, value, upto = poison
        (k if which == "k" else v)[:upto] = value
    return tuple(x.to(shape.dtype) for x in (q, k, v))


PREFILL_CONFIGS = [
    pytest.param(None, id="default"),
    pytest.param(AttentionConfig(16, 16, 1, 1), id="16x16"),
    pytest.param(AttentionConfig(64, 32, 1, 1, heads_per_tile=8, split_mask=False), id="onemask"),
]
POISONS = [("v", math.nan), ("v", math.inf), ("k", math.nan)]


@pytest.mark.parametrize("config", PREFILL_CONFIGS)
@pytest.mark.parametrize("which,value", POISONS)
@pytest.mark.parametrize("shape", SHAPES)
def test_prefill_window_drops_nonfinite_keys_outside(shape, which, value, config):
    """100 tokens, window 3, k or v[:50] poisoned: rows >= 53 see none of it and must match the
    clean computation; rows 50..52 see poisoned keys and must not come out finite."""
    gen = torch.Generator().manual_seed(1)
    n, window = 100, 3
    q, k, v = _tokens(gen, n, shape, (which, value, 50))
    sinks = torch.randn(shape.heads_q, generator=gen)
    pos = torch.arange(n)
    want, want_lse = _attend64(
        q, k, v, pos, pos, pos >= 0, window_left=window, sinks=sinks, scale=0.125
    )
    out = torch.empty(n, shape.heads_q, shape.dim, dtype=shape.dtype, device=DEVICE)
    lse = torch.empty(n, shape.heads_q, device=DEVICE)
    with pin_config(prefill.KERNEL_NAME, config):
        _prefill(shape, q, k, v, [0, n], window=window, sinks=sinks, out=out, lse=lse)
    _check(out, want, slice(53, None), shape.dtype, "out")
    _check(lse, want_lse, slice(53, None), torch.float32, "lse")
    assert not out[50:53].isfinite().all(dim=-1).any()


def _paged_cache(gen, shape, seqlens, *, poison=None, spare_pages=2):
    """(k_cache, v_cache, page_table, (k, v) per sequence, guard buffers). Pages are shuffled;
    one NaN guard page sits before and after each cache, and the page table is the left part
    of a wider table whose extra columns name an unused page full of NaN (a read past a row's
    end would find it)."""
    page = shape.page_size
    pages_per_seq = [-(-n // page) for n in seqlens]
    max_pages = max(pages_per_seq)
    num_pages = sum(pages_per_seq) + spare_pages
    cache_shape = (num_pages, page, shape.heads_kv, shape.dim)
    k_cache, k_buf = _guarded(cache_shape, shape.dtype, math.nan, gen=gen)
    v_cache, v_buf = _guarded(cache_shape, shape.dtype, math.nan, gen=gen)
    trap = num_pages - 1  # never assigned to a sequence
    k_cache[trap] = math.nan
    v_cache[trap] = math.nan
    wide = torch.full((len(seqlens), max_pages + 3), trap, dtype=torch.int32)
    order = torch.randperm(num_pages - spare_pages, generator=gen).to(torch.int32)
    per_seq, used = [], 0
    for b, n in enumerate(seqlens):
        wide[b, : pages_per_seq[b]] = order[used : used + pages_per_seq[b]]
        used += pages_per_seq[b]
        pos = torch.arange(n)
        pages = wide[b, pos // page].long().to(DEVICE)
        k, v = (c[pages, pos.to(DEVICE) % page].cpu() for c in (k_cache, v_cache))
        if poison is not None:
            which, value, upto = poison
            cache, x = (k_cache, k) if which == "k" else (v_cache, v)
            cache[pages[:upto], pos[:upto].to(DEVICE) % page] = value
            x[:upto] = value
        per_seq.append((k, v))
    table = wide.to(DEVICE)[:, :max_pages]
    return k_cache, v_cache, table, per_seq, (k_buf, v_buf)


def _paged_expected(q, per_seq, rows, seqlens, table, num_pages, page, **kw):
    """Float64 outputs of each sequence b (query rows rows[b], keys per_seq[b] of which those
    on a page id outside [0, num_pages) are masked)."""
    outs, lses = [], []
    for b, (k, v) in enumerate(per_seq):
        n_q, seq_k = rows[b].stop - rows[b].start, seqlens[b]
        k_pos = torch.arange(seq_k)
        ids = table[b].cpu().long()[k_pos // page] if seq_k else torch.zeros(0, dtype=torch.long)
        key_ok = (ids >= 0) & (ids < num_pages)
        q_pos = torch.arange(seq_k - n_q, seq_k)
        o, lse = _attend64(q[rows[b]], k[:seq_k], v[:seq_k], q_pos, k_pos, key_ok, **kw)
        outs.append(o)
        lses.append(lse)
    return outs, lses


def _extend(q, caches, cu, cache_seqlens, *, window, sinks, out, lse):
    k_cache, v_cache, table = caches
    extend.mha_extend_with_kvcache(
        q.to(DEVICE), k_cache, v_cache,
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=DEVICE), page_table=table,
        cache_seqlens=torch.tensor(cache_seqlens, dtype=torch.int32, device=DEVICE),
        max_seqlen_q=q.shape[0], window_left=window,
        sinks=None if sinks is None else sinks.to(DEVICE), softmax_scale=0.125, k_scale=1.0,
        v_scale=1.0, out=out, lse=lse,
    )  # fmt: skip


@pytest.mark.parametrize("which,value", POISONS)
@pytest.mark.parametrize("shape", SHAPES)
def test_extend_window_drops_nonfinite_keys_outside(shape, which, value):
    """100 cached tokens, the last 60 new, window 3, k or v[:50] poisoned: query rows at
    positions >= 53 (rows >= 13) must match the clean computation."""
    gen = torch.Generator().manual_seed(2)
    seq_k, n_q, window = 100, 60, 3
    k_cache, v_cache, table, per_seq, _ = _paged_cache(
        gen, shape, [seq_k], poison=(which, value, 50)
    )
    q = torch.randn(n_q, shape.heads_q, shape.dim, generator=gen).to(shape.dtype)
    sinks = torch.randn(shape.heads_q, generator=gen)
    (want,), (want_lse,) = _paged_expected(
        q, per_seq, [slice(0, n_q)], [seq_k], table, k_cache.shape[0], shape.page_size,
        window_left=window, sinks=sinks, scale=0.125,
    )  # fmt: skip
    out = torch.empty(n_q, shape.heads_q, shape.dim, dtype=shape.dtype, device=DEVICE)
    lse = torch.empty(n_q, shape.heads_q, device=DEVICE)
    _extend(q, (k_cache, v_cache, table), [0, n_q], [seq_k], window=window, sinks=sinks,
            out=out, lse=lse)  # fmt: skip
    _check(out, want, slice(13, None), shape.dtype, "out")
    _check(lse, want_lse, slice(13, None), torch.float32, "lse")
    assert not out[10:13].isfinite().all(dim=-1).any()


def _decode(q, caches, cache_seqlens, *, window, sinks, splits):
    k_cache, v_cache, table = caches
    out = torch.full(q.shape, SENTINEL, dtype=q.dtype, device=DEVICE)
    lse = torch.full(q.shape[:-1], SENTINEL, device=DEVICE)
    config = DecodeConfig(16 if not ON_GPU else 64, 1 if not ON_GPU else 4, 1, 1, splits)
    with pin_config(decode.KERNEL_NAME, config):
        decode.mha_decode_with_kvcache(
            q.to(DEVICE), k_cache, v_cache, page_table=table,
            cache_seqlens=torch.tensor(cache_seqlens, dtype=torch.int32, device=DEVICE),
            window_left=window, sinks=None if sinks is None else sinks.to(DEVICE),
            softmax_scale=0.125, k_scale=1.0, v_scale=1.0, out=out, lse=lse,
        )  # fmt: skip
    return out, lse


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("which,value", POISONS)
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_window_drops_nonfinite_keys_outside(shape, which, value, splits):
    """60 cached keys, 16 new tokens (positions 44..59), window 3, k or v[:50] poisoned: tokens
    at positions >= 53 share a tile with tokens that see the poison, and must match the clean
    computation."""
    gen = torch.Generator().manual_seed(3)
    seq_k, q_len, window = 60, 16, 3
    k_cache, v_cache, table, per_seq, _ = _paged_cache(
        gen, shape, [seq_k], poison=(which, value, 50)
    )
    q = torch.randn(1, q_len, shape.heads_q, shape.dim, generator=gen).to(shape.dtype)
    sinks = torch.randn(shape.heads_q, generator=gen)
    (want,), (want_lse,) = _paged_expected(
        q[0], per_seq, [slice(0, q_len)], [seq_k], table, k_cache.shape[0], shape.page_size,
        window_left=window, sinks=sinks, scale=0.125,
    )  # fmt: skip
    out, lse = _decode(q, (k_cache, v_cache, table), [seq_k], window=window, sinks=sinks,
                       splits=splits)  # fmt: skip
    _check(out[0], want, slice(9, None), shape.dtype, "out")
    _check(lse[0], want_lse, slice(9, None), torch.float32, "lse")
    assert not out[0, 6:9].isfinite().all(dim=-1).any()
