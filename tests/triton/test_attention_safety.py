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

import pytest
import torch
from triton_attention_shapes import SHAPES

from tokenspeed_kernel.testing import assert_close
from tokenspeed_kernel.tuning import pin_config
from tokenspeed_kernel_triton.attention import decode, extend, prefill
from tokenspeed_kernel_triton.attention._tile_config import AttentionConfig
from tokenspeed_kernel_triton.attention.decode_config import DecodeConfig
from tokenspeed_kernel_triton.attention.kvcache_store import kvcache_store

# These tests feed NaN/inf on purpose; the Triton interpreter's numpy reports each one.
pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value encountered in matmul:RuntimeWarning:triton.runtime.interpreter",
    "ignore:All-NaN slice encountered:RuntimeWarning:triton.runtime.interpreter",
)
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
SENTINEL = 7.0  # output rows no sequence covers keep what the caller put there


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


def _prefill(shape, q, k, v, cu, *, window, sinks, out, lse, max_seqlen=None):
    kwargs = dict(causal=True, window_left=window, softmax_scale=0.125, out=out, lse=lse)
    prefill.mha_prefill(
        q.to(DEVICE), k.to(DEVICE), v.to(DEVICE),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=DEVICE),
        max_seqlen=max_seqlen or q.shape[0], sinks=None if sinks is None else sinks.to(DEVICE),
        **kwargs,
    )  # fmt: skip


def _keys(keys):
    return slice(0, keys) if isinstance(keys, int) else keys


def _tokens(gen, n, shape, poison=None):
    """q [n, Hq, D], k, v [n, Hkv, D] in shape.dtype; poison = (which, value, keys): keys
    (a slice, or an int n for the first n) of k or v set to value."""
    q = torch.randn(n, shape.heads_q, shape.dim, generator=gen)
    k, v = (torch.randn(n, shape.heads_kv, shape.dim, generator=gen) for _ in "kv")
    if poison is not None:
        which, value, keys = poison
        (k if which == "k" else v)[_keys(keys)] = value
    return tuple(x.to(shape.dtype) for x in (q, k, v))


PREFILL_CONFIGS = [
    pytest.param(None, id="default"),
    pytest.param(AttentionConfig(16, 16, 1, 1), id="16x16"),
    pytest.param(AttentionConfig(64, 32, 1, 1, heads_per_tile=8, split_mask=False), id="onemask"),
]
# Keys here: a masked key's score is replaced by -inf whatever K holds. Non-finite V at keys
# a tile loads and some of its rows mask (the fix-up launch, `attention/_fixup.py`) is checked
# against the core reference in test_attention_nonfinite.py.
POISONS = [("k", math.nan), ("k", math.inf), ("k", -math.inf)]


@pytest.mark.parametrize("config", PREFILL_CONFIGS)
@pytest.mark.parametrize("which,value", POISONS)
@pytest.mark.parametrize("shape", SHAPES)
def test_prefill_window_drops_nonfinite_keys_outside(shape, which, value, config):
    """100 tokens, window 3, k[:50] poisoned: rows >= 53 see none of it and must match the
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


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("shape", SHAPES)
def test_prefill_window_skips_value_blocks_no_row_reaches(shape, value):
    """100 tokens, window 3, 16x16 tiles, v[:32] poisoned: the tiles of rows >= 48 start
    loading at key 32, so those rows match the clean computation whatever V holds before."""
    gen = torch.Generator().manual_seed(7)
    n, window = 100, 3
    q, k, v = _tokens(gen, n, shape, ("v", value, 32))
    pos = torch.arange(n)
    want, want_lse = _attend64(
        q, k, v, pos, pos, pos >= 0, window_left=window, sinks=None, scale=0.125
    )
    out = torch.empty(n, shape.heads_q, shape.dim, dtype=shape.dtype, device=DEVICE)
    lse = torch.empty(n, shape.heads_q, device=DEVICE)
    with pin_config(prefill.KERNEL_NAME, AttentionConfig(16, 16, 1, 1)):
        _prefill(shape, q, k, v, [0, n], window=window, sinks=None, out=out, lse=lse)
    _check(out, want, slice(48, None), shape.dtype, "out")
    _check(lse, want_lse, slice(48, None), torch.float32, "lse")
    assert not out[32:35].isfinite().all(dim=-1).any()


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
            which, value, keys = poison
            keys = _keys(keys)
            cache, x = (k_cache, k) if which == "k" else (v_cache, v)
            cache[pages[keys], pos[keys].to(DEVICE) % page] = value
            x[keys] = value
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
    """100 cached tokens, the last 60 new, window 3, k[:50] poisoned: query rows at
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
    """60 cached keys, 16 new tokens (positions 44..59), window 3, k[:50] poisoned: tokens
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


# ------------------------------------------------ one poisoned key inside the visited range
# Key POISONED is seen by the rows at positions POISONED .. POISONED + window and masked for
# the rows of the same tiles before it (causal diagonal) or past its window (left edge): those
# must match the clean computation, the rows that see it must not come out finite. K here; V
# in test_attention_nonfinite.py.
POISONED = 41
ONE_KEY = [("k", math.nan)]
WINDOWS = [-1, 3, 20]


def _check_one_poisoned_key(out, want, positions, window, dtype):
    sees = positions >= POISONED
    if window >= 0:
        sees &= positions <= POISONED + window
    assert sees.any() and (~sees).any()
    _check(out, want, ~sees, dtype, "out")
    assert not out[sees.to(out.device)].isfinite().all(dim=-1).any()


@pytest.mark.parametrize("config", PREFILL_CONFIGS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("which,value", ONE_KEY)
@pytest.mark.parametrize("shape", SHAPES)
def test_prefill_poisoned_key_reaches_only_rows_that_see_it(shape, which, value, window, config):
    gen = torch.Generator().manual_seed(4)
    n = 100
    q, k, v = _tokens(gen, n, shape, (which, value, slice(POISONED, POISONED + 1)))
    pos = torch.arange(n)
    want, _ = _attend64(q, k, v, pos, pos, pos >= 0, window_left=window, sinks=None, scale=0.125)
    out = torch.empty(n, shape.heads_q, shape.dim, dtype=shape.dtype, device=DEVICE)
    with pin_config(prefill.KERNEL_NAME, config):
        _prefill(shape, q, k, v, [0, n], window=window, sinks=None, out=out, lse=None)
    _check_one_poisoned_key(out, want, pos, window, shape.dtype)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("which,value", ONE_KEY)
@pytest.mark.parametrize("shape", SHAPES)
def test_extend_poisoned_key_reaches_only_rows_that_see_it(shape, which, value, window):
    """100 cached keys, the last 70 new (positions 30..99)."""
    gen = torch.Generator().manual_seed(5)
    seq_k, n_q = 100, 70
    k_cache, v_cache, table, per_seq, _ = _paged_cache(
        gen, shape, [seq_k], poison=(which, value, slice(POISONED, POISONED + 1))
    )
    q = torch.randn(n_q, shape.heads_q, shape.dim, generator=gen).to(shape.dtype)
    (want,), _ = _paged_expected(
        q, per_seq, [slice(0, n_q)], [seq_k], table, k_cache.shape[0], shape.page_size,
        window_left=window, sinks=None, scale=0.125,
    )  # fmt: skip
    out = torch.empty(n_q, shape.heads_q, shape.dim, dtype=shape.dtype, device=DEVICE)
    _extend(q, (k_cache, v_cache, table), [0, n_q], [seq_k], window=window, sinks=None,
            out=out, lse=None)  # fmt: skip
    _check_one_poisoned_key(out, want, torch.arange(seq_k - n_q, seq_k), window, shape.dtype)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("which,value", ONE_KEY)
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_poisoned_key_reaches_only_rows_that_see_it(shape, which, value, window, splits):
    """50 cached keys, 16 new tokens (positions 34..49) in one tile."""
    gen = torch.Generator().manual_seed(6)
    seq_k, q_len = 50, 16
    k_cache, v_cache, table, per_seq, _ = _paged_cache(
        gen, shape, [seq_k], poison=(which, value, slice(POISONED, POISONED + 1))
    )
    q = torch.randn(1, q_len, shape.heads_q, shape.dim, generator=gen).to(shape.dtype)
    (want,), _ = _paged_expected(
        q[0], per_seq, [slice(0, q_len)], [seq_k], table, k_cache.shape[0], shape.page_size,
        window_left=window, sinks=None, scale=0.125,
    )  # fmt: skip
    out, _ = _decode(q, (k_cache, v_cache, table), [seq_k], window=window, sinks=None,
                     splits=splits)  # fmt: skip
    positions = torch.arange(seq_k - q_len, seq_k)
    _check_one_poisoned_key(out[0], want, positions, window, shape.dtype)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("window", [3, 20])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_single_token_ignores_values_it_masks(shape, value, window, splits):
    """Q = 1, 60 cached keys, v[:50] poisoned: the tile loads only its row's window, so at
    window 3 the row matches the clean computation, at window 20 it sees the poison."""
    gen = torch.Generator().manual_seed(8)
    seq_k = 60
    k_cache, v_cache, table, per_seq, _ = _paged_cache(gen, shape, [seq_k], poison=("v", value, 50))
    q = torch.randn(1, 1, shape.heads_q, shape.dim, generator=gen).to(shape.dtype)
    sinks = torch.randn(shape.heads_q, generator=gen)
    (want,), (want_lse,) = _paged_expected(
        q[0], per_seq, [slice(0, 1)], [seq_k], table, k_cache.shape[0], shape.page_size,
        window_left=window, sinks=sinks, scale=0.125,
    )  # fmt: skip
    out, lse = _decode(q, (k_cache, v_cache, table), [seq_k], window=window, sinks=sinks,
                       splits=splits)  # fmt: skip
    if window == 3:
        _check(out[0], want, slice(None), shape.dtype, "out")
        _check(lse[0], want_lse, slice(None), torch.float32, "lse")
    else:
        assert not out[0].isfinite().all(dim=-1).any()


# ----------------------------------------------------------------------------- sinks of +-inf


def _inf_sinks(gen, heads):
    """Head 0 takes all the mass (+inf: out 0, lse +inf), head 1 none (-inf: as without a
    sink), the others finite."""
    sinks = torch.randn(heads, generator=gen)
    sinks[0], sinks[1] = math.inf, -math.inf
    return sinks


def _check_inf_sinks(out, lse, want, want_lse, dtype):
    assert out.isfinite().all() and (out[..., 0, :] == 0).all()
    assert (lse[..., 0] == math.inf).all()
    _check(out[..., 1:, :], want[..., 1:, :], slice(None), dtype, "out")
    _check(lse[..., 1:], want_lse[..., 1:], slice(None), torch.float32, "lse")


@pytest.mark.parametrize("window", [-1, 5])
@pytest.mark.parametrize("shape", SHAPES)
def test_prefill_infinite_sinks(shape, window):
    gen = torch.Generator().manual_seed(4)
    n = 40
    q, k, v = _tokens(gen, n, shape)
    sinks = _inf_sinks(gen, shape.heads_q)
    pos = torch.arange(n)
    want, want_lse = _attend64(
        q, k, v, pos, pos, pos >= 0, window_left=window, sinks=sinks, scale=0.125
    )
    out = torch.empty(n, shape.heads_q, shape.dim, dtype=shape.dtype, device=DEVICE)
    lse = torch.empty(n, shape.heads_q, device=DEVICE)
    _prefill(shape, q, k, v, [0, n], window=window, sinks=sinks, out=out, lse=lse)
    _check_inf_sinks(out, lse, want, want_lse, shape.dtype)


@pytest.mark.parametrize("shape", SHAPES)
def test_extend_infinite_sinks(shape):
    """Two sequences; the second has fewer cached keys than new tokens, so its first rows sit
    at negative positions and see no key (head 1: zeros and lse -inf)."""
    gen = torch.Generator().manual_seed(5)
    seqlens, n_qs = [50, 6], [20, 10]
    k_cache, v_cache, table, per_seq, _ = _paged_cache(gen, shape, seqlens)
    q = torch.randn(sum(n_qs), shape.heads_q, shape.dim, generator=gen).to(shape.dtype)
    sinks = _inf_sinks(gen, shape.heads_q)
    rows = [slice(0, 20), slice(20, 30)]
    wants, lses = _paged_expected(
        q, per_seq, rows, seqlens, table, k_cache.shape[0], shape.page_size, window_left=-1,
        sinks=sinks, scale=0.125,
    )  # fmt: skip
    out = torch.empty(q.shape, dtype=shape.dtype, device=DEVICE)
    lse = torch.empty(q.shape[:-1], device=DEVICE)
    _extend(q, (k_cache, v_cache, table), [0, 20, 30], seqlens, window=-1, sinks=sinks,
            out=out, lse=lse)  # fmt: skip
    _check_inf_sinks(out, lse, torch.cat(wants), torch.cat(lses), shape.dtype)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_infinite_sinks(shape, splits):
    """Sequence lengths 0 (nothing visible), 1 and 45, two new tokens each."""
    gen = torch.Generator().manual_seed(6)
    seqlens, q_len = [0, 1, 45], 2
    k_cache, v_cache, table, per_seq, _ = _paged_cache(gen, shape, seqlens)
    q = torch.randn(3, q_len, shape.heads_q, shape.dim, generator=gen).to(shape.dtype)
    sinks = _inf_sinks(gen, shape.heads_q)
    wants, lses = _paged_expected(
        q.flatten(0, 1), per_seq, [slice(2 * b, 2 * b + 2) for b in range(3)], seqlens, table,
        k_cache.shape[0], shape.page_size, window_left=-1, sinks=sinks, scale=0.125,
    )  # fmt: skip
    out, lse = _decode(q, (k_cache, v_cache, table), seqlens, window=-1, sinks=sinks,
                       splits=splits)  # fmt: skip
    _check_inf_sinks(out, lse, torch.stack(wants), torch.stack(lses), shape.dtype)


# ----------------------------------------------------------------------------- bad device values


@pytest.mark.parametrize("shape", SHAPES)
def test_kvcache_store_skips_slots_outside_the_cache(shape):
    """Slots num_slots, num_slots + 5, 2^40, -1 and -7 store nothing; the guard pages around
    both caches keep their sentinel; valid slots land."""
    gen = torch.Generator().manual_seed(7)
    num_pages, page = 3, shape.page_size
    num_slots = num_pages * page
    slots = [1, num_slots, num_slots + 5, 2**40, -1, -7, num_slots - 1]
    k, v = (
        torch.randn(len(slots), shape.heads_kv, shape.dim, generator=gen).to(shape.dtype)
        for _ in "kv"
    )
    cache_shape = (num_pages, page, shape.heads_kv, shape.dim)
    caches = [_guarded(cache_shape, shape.dtype, SENTINEL, gen=gen) for _ in "kv"]
    want = [cache.cpu().clone() for cache, _ in caches]
    for t, slot in enumerate(slots):
        if 0 <= slot < num_slots:
            want[0][slot // page, slot % page] = k[t]
            want[1][slot // page, slot % page] = v[t]
    kvcache_store(
        k.to(DEVICE), v.to(DEVICE), caches[0][0], caches[1][0],
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE), k_scale=1.0,
        v_scale=1.0,
    )  # fmt: skip
    for (cache, buffer), expected in zip(caches, want, strict=True):
        assert torch.equal(cache.cpu(), expected)
        assert (buffer[0] == SENTINEL).all() and (buffer[-1] == SENTINEL).all()


PREFILL_BAD_CU = [[5, 2, 12, 100], [-3, -1, 12, 2**31 - 1], [0, 20, 2**31 - 1, 3]]


@pytest.mark.parametrize("cu", PREFILL_BAD_CU, ids=["decreasing", "negative", "past-T"])
@pytest.mark.parametrize("shape", SHAPES)
def test_prefill_clamps_cu_seqlens(shape, cu):
    """T = 40: offsets clamp to [0, 40], an end before its start is an empty sequence, rows no
    sequence covers keep the caller's values, and nothing outside q/k/v/out is touched (NaN
    guard rows around the inputs, sentinel rows around out)."""
    gen = torch.Generator().manual_seed(8)
    n = 40
    q, k, v = (
        _guarded((n, h, shape.dim), shape.dtype, math.nan, gen=gen)[0]
        for h in (shape.heads_q, shape.heads_kv, shape.heads_kv)
    )
    sinks = torch.randn(shape.heads_q, generator=gen)
    out, out_buf = _guarded((n, shape.heads_q, shape.dim), shape.dtype, SENTINEL, gen=gen)
    out.fill_(SENTINEL)
    lse, lse_buf = _guarded((n, shape.heads_q), torch.float32, SENTINEL, gen=gen)
    lse.fill_(SENTINEL)
    _prefill(shape, q, k, v, cu, window=-1, sinks=sinks, out=out, lse=lse)
    assert (out_buf[0] == SENTINEL).all() and (out_buf[-1] == SENTINEL).all()
    assert (lse_buf[0] == SENTINEL).all() and (lse_buf[-1] == SENTINEL).all()
    bounds = [min(max(c, 0), n) for c in cu]
    covered = torch.zeros(n, dtype=torch.bool)
    for start, end in zip(bounds[:-1], bounds[1:], strict=False):
        if end <= start:
            continue
        covered[start:end] = True
        pos = torch.arange(end - start)
        want, want_lse = _attend64(
            *(x[start:end].cpu() for x in (q, k, v)), pos, pos, pos >= 0, window_left=-1,
            sinks=sinks, scale=0.125,
        )  # fmt: skip
        _check(out[start:end], want, slice(None), shape.dtype, "out")
        _check(lse[start:end], want_lse, slice(None), torch.float32, "lse")
    assert (out[~covered.to(DEVICE)] == SENTINEL).all()


def _bad_pages(table, num_pages):
    """Out-of-range ids in the page tables of the odd sequences (-1 / num_pages, 1000 /
    -2^31, alternating); returns those sequences. Kernels clamp a bad id into the cache: the
    read stays inside it (compute-sanitizer checks that on the GPU) and that sequence's output
    is unspecified, so tests check the other sequences only."""
    bad_ids = [-1, num_pages, 1000, -(2**31)]
    bad_seqs = list(range(1, table.shape[0], 2))
    for n, b in enumerate(bad_seqs):
        table[b, min(b, table.shape[1] - 1)] = bad_ids[n % len(bad_ids)]
        table[b, 0] = bad_ids[(n + 1) % len(bad_ids)]
    return bad_seqs


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_bad_page_ids_and_lengths(shape, splits):
    """cache_seqlens -5 (as 0), 10^6 and 2^31 - 1 (as the page table's 4 pages) and 37; bad
    page ids in sequences 1 and 3 leave sequences 0 and 2 exact. NaN guard pages around the
    caches and a NaN page named past each table row's end: any read outside shows up as NaN."""
    gen = torch.Generator().manual_seed(9)
    full = 4 * shape.page_size
    lengths, given = [0, full, 37, full], [-5, 10**6, 37, 2**31 - 1]
    k_cache, v_cache, table, per_seq, _ = _paged_cache(gen, shape, lengths)
    bad_seqs = _bad_pages(table, k_cache.shape[0])
    q = torch.randn(4, 2, shape.heads_q, shape.dim, generator=gen).to(shape.dtype)
    sinks = torch.randn(shape.heads_q, generator=gen)
    wants, lses = _paged_expected(
        q.flatten(0, 1), per_seq, [slice(2 * b, 2 * b + 2) for b in range(4)], lengths, table,
        k_cache.shape[0], shape.page_size, window_left=-1, sinks=sinks, scale=0.125,
    )  # fmt: skip
    out, lse = _decode(q, (k_cache, v_cache, table), given, window=-1, sinks=sinks,
                       splits=splits)  # fmt: skip
    clean = [b for b in range(4) if b not in bad_seqs]
    _check(out[clean], torch.stack(wants)[clean], slice(None), shape.dtype, "out")
    _check(lse[clean], torch.stack(lses)[clean], slice(None), torch.float32, "lse")


EXTEND_BAD = [
    pytest.param([5, 2, 12, 2**31 - 1], [-3, 10**6, 30], id="decreasing-cu"),
    pytest.param([-7, 10, 10, 30], [5, 2**31 - 1, 30], id="negative-cu"),
]


@pytest.mark.parametrize("cu,given", EXTEND_BAD)
@pytest.mark.parametrize("shape", SHAPES)
def test_extend_bad_indices(shape, cu, given):
    """T = 30 new tokens: cu_seqlens_q clamped as in prefill, cache_seqlens clamped to
    [0, 4 pages], bad page ids in sequence 1 (its rows unspecified); uncovered rows and the
    guard rows around q and out untouched."""
    gen = torch.Generator().manual_seed(10)
    n, full = 30, 4 * shape.page_size
    lengths = [min(max(g, 0), full) for g in given]
    k_cache, v_cache, table, per_seq, _ = _paged_cache(gen, shape, lengths)
    bad_seqs = _bad_pages(table, k_cache.shape[0])
    q = _guarded((n, shape.heads_q, shape.dim), shape.dtype, math.nan, gen=gen)[0]
    sinks = torch.randn(shape.heads_q, generator=gen)
    out, out_buf = _guarded((n, shape.heads_q, shape.dim), shape.dtype, SENTINEL, gen=gen)
    out.fill_(SENTINEL)
    lse = torch.full((n, shape.heads_q), SENTINEL, device=DEVICE)
    _extend(q, (k_cache, v_cache, table), cu, given, window=-1, sinks=sinks, out=out, lse=lse)
    assert (out_buf[0] == SENTINEL).all() and (out_buf[-1] == SENTINEL).all()
    bounds = [min(max(c, 0), n) for c in cu]
    rows = [slice(s, max(s, e)) for s, e in zip(bounds[:-1], bounds[1:], strict=False)]
    wants, lses = _paged_expected(
        q.cpu(), per_seq, rows, lengths, table, k_cache.shape[0], shape.page_size,
        window_left=-1, sinks=sinks, scale=0.125,
    )  # fmt: skip
    covered = torch.zeros(n, dtype=torch.bool)
    for b, (r, want, want_lse) in enumerate(zip(rows, wants, lses, strict=True)):
        covered[r] = True
        if b in bad_seqs:
            continue
        _check(out[r], want, slice(None), shape.dtype, "out")
        _check(lse[r], want_lse, slice(None), torch.float32, "lse")
    assert (out[~covered.to(DEVICE)] == SENTINEL).all()
