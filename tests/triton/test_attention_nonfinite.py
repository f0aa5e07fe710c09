"""Triton attention with NaN/inf in V at keys that some rows of a tile see and others mask
(causal diagonal, window's left edge, decode with Q > 1): every row matches the core reference,
NaN where the reference is NaN (a row that sees such a key), the reference's value elsewhere.
The fast kernels flag such tiles and a fix-up launch recomputes them (`attention/_fixup.py`);
on finite inputs no tile is flagged, so the fix-up writes nothing.

CPU runs go through the Triton interpreter in fp16 (its bf16 dot is broken) with small tiles
pinned so that the poisoned keys land inside tiles; the GPU versions run at GPT-OSS shapes with
the platform's tile configs.
"""

from __future__ import annotations

import math

import pytest
import torch
from triton_attention_shapes import GPT_OSS, SHAPES

from tokenspeed_kernel.ops.attention.reference import (
    reference_decode,
    reference_extend,
    reference_prefill,
)
from tokenspeed_kernel.testing import assert_close
from tokenspeed_kernel.tuning import pin_config
from tokenspeed_kernel_triton.attention import _fixup, decode, extend, prefill
from tokenspeed_kernel_triton.attention._tile_config import AttentionConfig
from tokenspeed_kernel_triton.attention.decode_config import DecodeConfig

# These tests feed NaN/inf on purpose; the Triton interpreter's numpy reports each one.
pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value encountered:RuntimeWarning",
    "ignore:All-NaN slice encountered:RuntimeWarning",
    "ignore:overflow encountered:RuntimeWarning",
)
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
SCALE = 0.125


# Tile configs of prefill/extend: the platform's, 16-row tiles, and one masked loop over
# 32-row tiles packing GQA heads (the Hopper window layout). None on the GPU keeps its own.
CONFIGS = [
    pytest.param(None, id="default"),
    pytest.param(AttentionConfig(16, 16, 1, 1), id="16x16"),
    pytest.param(AttentionConfig(64, 32, 1, 1, heads_per_tile=8, split_mask=False), id="onemask"),
]
VALUES = [
    pytest.param(math.nan, id="nan"),
    pytest.param(math.inf, id="inf"),
    pytest.param(-math.inf, id="-inf"),
]
# Every value at the platform's config, NaN at the others (the interpreter is slow).
CASES = [
    *(pytest.param(None, value.values[0], id=f"default-{value.id}") for value in VALUES),
    *(pytest.param(config.values[0], math.nan, id=f"{config.id}-nan") for config in CONFIGS[1:]),
]


def _randn(gen, *shape, dtype):
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def _match_reference(got, want, name, dtype):
    """NaN exactly where the reference is NaN (whole rows), the reference's value elsewhere."""
    got, want = got.float().cpu(), want.float().cpu()
    assert torch.equal(got.isnan(), want.isnan()), f"{name}: NaN rows differ from the reference"
    finite = ~want.isnan()
    assert got[finite].isfinite().all(), f"{name}: a row the reference keeps finite is not"
    assert_close(got[finite], want[finite], dtype=dtype, name=name)


class _Launches:
    """Wraps a module's kernel: records each launch's (FIXUP, grid, flags) and, with
    skip_fixup, drops the fix-up launches."""

    def __init__(self, kernel, flags_index, skip_fixup=False):
        self.kernel, self.flags_index, self.skip_fixup = kernel, flags_index, skip_fixup
        self.calls = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((kwargs["FIXUP"], grid, args[self.flags_index]))
            if not (self.skip_fixup and kwargs["FIXUP"]):
                self.kernel[grid](*args, **kwargs)

        return launch

    def fixups(self):
        return sum(fixup for fixup, _, _ in self.calls)

    def flags_set(self):
        """Flags set after the launches (with skip_fixup: what the fast launches set)."""
        fast = [(grid, flags) for fixup, grid, flags in self.calls if not fixup]
        return sum(int(flags[: math.prod(grid)].ne(0).sum()) for grid, flags in fast)


# ----------------------------------------------------------------------------- prefill


def _prefill(q, k, v, *, causal, window, sinks=None, lse=True, out=None, fn=None):
    n = q.shape[0]
    out = torch.empty_like(q) if out is None else out
    lse_t = torch.empty(n, q.shape[1], device=q.device) if lse else None
    (fn or prefill.mha_prefill)(
        q, k, v, cu_seqlens=torch.tensor([0, n], dtype=torch.int32, device=q.device),
        max_seqlen=n, causal=causal, window_left=window, sinks=sinks, softmax_scale=SCALE,
        out=out, lse=lse_t,
    )  # fmt: skip
    return out, lse_t


def _prefill_inputs(shape, n, seed):
    gen = torch.Generator().manual_seed(seed)
    q = _randn(gen, n, shape.heads_q, shape.dim, dtype=shape.dtype)
    k, v = (_randn(gen, n, shape.heads_kv, shape.dim, dtype=shape.dtype) for _ in "kv")
    return q, k, v, _randn(gen, shape.heads_q, dtype=torch.float32)


def _check_prefill(shape, q, k, v, sinks, *, causal, window, config):
    with pin_config(prefill.KERNEL_NAME, config):
        out, lse = _prefill(q, k, v, causal=causal, window=window, sinks=sinks)
    want, want_lse = _prefill(
        q, k, v, causal=causal, window=window, sinks=sinks, fn=reference_prefill
    )
    _match_reference(out, want, "out", shape.dtype)
    _match_reference(lse, want_lse, "lse", torch.float32)
    return out


@pytest.mark.parametrize("config,value", CASES)
@pytest.mark.parametrize("shape", SHAPES)
def test_prefill_window_issue_example(shape, config, value):
    """The issue's case: 100 tokens, window 3, v[:50] poisoned. Rows >= 53 see none of it and
    are finite; rows 50..52 see some and are NaN, as in the reference."""
    q, k, v, sinks = _prefill_inputs(shape, 100, seed=1)
    v[:50] = value
    out = _check_prefill(shape, q, k, v, sinks, causal=True, window=3, config=config)
    assert out[53:].isfinite().all()
    assert out[50:53].isnan().all()
    # The fix-up clears the flags it found: zero between calls.
    assert not any(flags.any() for flags in _fixup._flags.values())


@pytest.mark.parametrize("window", [-1, 20])
@pytest.mark.parametrize("config,value", CASES)
@pytest.mark.parametrize("shape", SHAPES)
def test_prefill_causal_diagonal(shape, config, value, window):
    """64 tokens, v[41] poisoned (inside a tile of every config): rows < 41 mask it causally,
    and with window 20 rows > 61 mask it too; those match the reference, the others are NaN."""
    q, k, v, sinks = _prefill_inputs(shape, 64, seed=2)
    v[41] = value
    out = _check_prefill(shape, q, k, v, sinks, causal=True, window=window, config=config)
    assert out[:41].isfinite().all() and out[41:62].isnan().all()


@pytest.mark.parametrize("shape", SHAPES)
def test_prefill_out_aliasing_q(shape):
    """out is q: the fix-up must still read the original queries."""
    q, k, v, sinks = _prefill_inputs(shape, 64, seed=3)
    v[41] = math.nan
    want, want_lse = _prefill(q, k, v, causal=True, window=5, sinks=sinks, fn=reference_prefill)
    with pin_config(prefill.KERNEL_NAME, AttentionConfig(16, 16, 1, 1) if not ON_GPU else None):
        out, lse = _prefill(q, k, v, causal=True, window=5, sinks=sinks, out=q)
    assert out.data_ptr() == q.data_ptr()
    _match_reference(out, want, "out", shape.dtype)
    _match_reference(lse, want_lse, "lse", torch.float32)


# ----------------------------------------------------------------------------- paged


def _paged(shape, gen, seqlens, poison):
    """(k_cache, v_cache, page_table) with shuffled pages; poison = (positions, value) per
    sequence, set in V."""
    page = shape.page_size
    pages_per_seq = [-(-n // page) for n in seqlens]
    num_pages = sum(pages_per_seq)
    cache_shape = (num_pages, page, shape.heads_kv, shape.dim)
    k_cache, v_cache = (_randn(gen, *cache_shape, dtype=shape.dtype) for _ in "kv")
    order = torch.randperm(num_pages, generator=gen).to(torch.int32)
    table = torch.zeros(len(seqlens), max(pages_per_seq), dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_per_seq):
        table[b, :n] = order[used : used + n]
        used += n
    positions, value = poison
    for b in range(len(seqlens)):
        for p in positions:
            v_cache[table[b, p // page], p % page] = value
    return k_cache, v_cache, table.to(DEVICE)


def _extend(q, caches, seqlens, n_qs, *, window, sinks, fn=None):
    k_cache, v_cache, table = caches
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], device=q.device)
    cu = torch.tensor([0, *torch.tensor(n_qs).cumsum(0).tolist()], dtype=torch.int32)
    (fn or extend.mha_extend_with_kvcache)(
        q, k_cache, v_cache, cu_seqlens_q=cu.to(DEVICE), page_table=table,
        cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device=DEVICE),
        max_seqlen_q=max(n_qs), window_left=window, sinks=sinks, softmax_scale=SCALE,
        k_scale=1.0, v_scale=1.0, out=out, lse=lse,
    )  # fmt: skip
    return out, lse


EXTEND_CASES = [
    # Cached key 36 is seen by positions 36..41 and masked by the window for the later rows
    # of their tiles; new key 60 is masked causally for the rows before it.
    pytest.param(5, (36, 60), id="window5"),
    pytest.param(-1, (60, 70), id="causal"),
]


@pytest.mark.parametrize("window,positions", EXTEND_CASES)
@pytest.mark.parametrize("config,value", CASES[:4])
@pytest.mark.parametrize("shape", SHAPES)
def test_extend_poison_in_cache_and_new_tokens(shape, config, window, positions, value):
    """Two sequences of 80 cached keys, the last 40 new (positions 40..79)."""
    gen = torch.Generator().manual_seed(4)
    seqlens, n_qs = [80, 80], [40, 40]
    caches = _paged(shape, gen, seqlens, (positions, value))
    q = _randn(gen, sum(n_qs), shape.heads_q, shape.dim, dtype=shape.dtype)
    sinks = _randn(gen, shape.heads_q, dtype=torch.float32)
    with pin_config(extend.KERNEL_NAME, config):
        out, lse = _extend(q, caches, seqlens, n_qs, window=window, sinks=sinks)
    want, want_lse = _extend(q, caches, seqlens, n_qs, window=window, sinks=sinks,
                             fn=reference_extend)  # fmt: skip
    _match_reference(out, want, "out", shape.dtype)
    _match_reference(lse, want_lse, "lse", torch.float32)
    assert want.isnan().any() and want.isfinite().all(dim=-1).any()


# ----------------------------------------------------------------------------- decode


def _decode(q, caches, seqlens, *, window, sinks, splits=None, fn=None):
    k_cache, v_cache, table = caches
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], device=q.device)
    config = None if splits is None else DecodeConfig(16, 1, 1, 1, splits)
    with pin_config(decode.KERNEL_NAME, config if not ON_GPU else None):
        (fn or decode.mha_decode_with_kvcache)(
            q, k_cache, v_cache, page_table=table,
            cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device=DEVICE),
            window_left=window, sinks=sinks, softmax_scale=SCALE, k_scale=1.0, v_scale=1.0,
            out=out, lse=lse,
        )  # fmt: skip
    return out, lse


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("window", [-1, 3])
@pytest.mark.parametrize("q_len", [2, 3, 4])
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_multi_token_poisoned_key(shape, q_len, window, splits):
    """40 cached keys, Q new tokens: key 39 (the last new one) is masked causally for every row
    but the last; with window 3, key 37 - Q is seen by row 0 only."""
    gen = torch.Generator().manual_seed(5)
    seq_k = 40
    positions = (seq_k - 1,) if window < 0 else (seq_k - 1, seq_k - q_len - 3)
    value = math.nan if q_len != 3 else math.inf
    caches = _paged(shape, gen, [seq_k, seq_k], (positions, value))
    q = _randn(gen, 2, q_len, shape.heads_q, shape.dim, dtype=shape.dtype)
    sinks = _randn(gen, shape.heads_q, dtype=torch.float32)
    out, lse = _decode(q, caches, [seq_k, seq_k], window=window, sinks=sinks, splits=splits)
    want, want_lse = _decode(q, caches, [seq_k, seq_k], window=window, sinks=sinks,
                             fn=reference_decode)  # fmt: skip
    _match_reference(out, want, "out", shape.dtype)
    _match_reference(lse, want_lse, "lse", torch.float32)
    assert out[:, -1].isnan().all()
    if window < 0:
        assert out[:, :-1].isfinite().all()
    else:
        assert out[:, 0].isnan().all() and out[:, 1:-1].isfinite().all()


# ----------------------------------------------------------------------------- finite inputs


def _launches(monkeypatch, module, name, flags_index, skip_fixup):
    launches = _Launches(getattr(module, name), flags_index, skip_fixup)
    monkeypatch.setattr(module, name, launches)
    return launches


PREFILL_FINITE = [
    pytest.param(True, -1, 1, id="causal"),
    pytest.param(True, 7, 1, id="window"),
    pytest.param(False, 7, 1, id="noncausal-window"),
    pytest.param(False, -1, 0, id="noncausal"),
]


@pytest.mark.parametrize("causal,window,fixups", PREFILL_FINITE)
@pytest.mark.parametrize("shape", SHAPES)
def test_prefill_finite_inputs_flag_nothing(monkeypatch, shape, causal, window, fixups):
    """Finite inputs: no tile is flagged, and the output with the fix-up is bitwise the output
    without it; non-causal prefill without a window launches no fix-up."""
    q, k, v, sinks = _prefill_inputs(shape, 48, seed=6)
    runs = {}
    for skip in (False, True):
        launches = _launches(monkeypatch, prefill, "_prefill_kernel", 7, skip)
        runs[skip] = _prefill(q, k, v, causal=causal, window=window, sinks=sinks)
        monkeypatch.undo()
        assert launches.fixups() == fixups
        if fixups:
            assert launches.flags_set() == 0
    assert all(torch.equal(a, b) for a, b in zip(runs[False], runs[True], strict=True))
    want, _ = _prefill(q, k, v, causal=causal, window=window, sinks=sinks, fn=reference_prefill)
    _match_reference(runs[False][0], want, "out", shape.dtype)


@pytest.mark.parametrize("shape", SHAPES)
def test_extend_finite_inputs_flag_nothing(monkeypatch, shape):
    gen = torch.Generator().manual_seed(7)
    seqlens, n_qs = [50, 30], [20, 30]
    caches = _paged(shape, gen, seqlens, ((), 0.0))
    q = _randn(gen, sum(n_qs), shape.heads_q, shape.dim, dtype=shape.dtype)
    runs = {}
    for skip in (False, True):
        launches = _launches(monkeypatch, extend, "_extend_kernel", 9, skip)
        runs[skip] = _extend(q, caches, seqlens, n_qs, window=6, sinks=None)
        monkeypatch.undo()
        assert launches.fixups() == 1 and launches.flags_set() == 0
    assert all(torch.equal(a, b) for a, b in zip(runs[False], runs[True], strict=True))


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_finite_inputs_flag_nothing(monkeypatch, shape, q_len, splits):
    """Q = 1 launches no fix-up (its tiles load only their row's keys)."""
    gen = torch.Generator().manual_seed(8)
    seqlens = [40, 23]
    caches = _paged(shape, gen, seqlens, ((), 0.0))
    q = _randn(gen, 2, q_len, shape.heads_q, shape.dim, dtype=shape.dtype)
    runs = {}
    for skip in (False, True):
        launches = _launches(monkeypatch, decode, "_decode_split_kernel", 10, skip)
        runs[skip] = _decode(q, caches, seqlens, window=5, sinks=None, splits=splits)
        monkeypatch.undo()
        assert launches.fixups() == (q_len > 1)
        if q_len > 1:
            assert launches.flags_set() == 0
    assert all(torch.equal(a, b) for a, b in zip(runs[False], runs[True], strict=True))


# ----------------------------------------------------------------------------- CUDA graphs


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("op", ["prefill", "decode"])
def test_fixup_replays_in_a_cuda_graph(op):
    """The fast launch, its flags and the fix-up captured once, replayed on new V (clean, or
    NaN at other keys each time): every replay matches the reference."""
    shape = GPT_OSS
    gen = torch.Generator().manual_seed(9)
    if op == "prefill":
        q, k, v, sinks = _prefill_inputs(shape, 256, seed=9)
        values, reference = v, reference_prefill
        # Token ranges of V: rows >= 103 clean, rows 40..43 only, rows 200..203 only.
        poisons = [slice(0, 100), slice(40, 41), None, slice(200, 201)]
        cu = torch.tensor([0, 256], dtype=torch.int32, device=DEVICE)
        args, kwargs = (q, k, v), dict(cu_seqlens=cu, max_seqlen=256, causal=True)
        launcher = prefill.mha_prefill

    else:
        seqlens = [300, 77]
        caches = _paged(shape, gen, seqlens, ((), 0.0))
        q = _randn(gen, 2, 4, shape.heads_q, shape.dim, dtype=shape.dtype)
        sinks = _randn(gen, shape.heads_q, dtype=torch.float32)
        values, reference = caches[1], reference_decode
        # Slots of every page of V: slot 41 holds key 297 of sequence 0 (masked for its first
        # new token at 296, seen by the others; its other slot-41 keys are outside the window).
        poisons = [slice(41, 42), None, slice(0, 64), slice(41, 42)]
        lengths = torch.tensor(seqlens, dtype=torch.int32, device=DEVICE)
        args = (q, *caches[:2])
        kwargs = dict(page_table=caches[2], cache_seqlens=lengths, k_scale=1.0, v_scale=1.0)
        launcher = decode.mha_decode_with_kvcache
    window = 3 if op == "prefill" else 20
    kwargs.update(window_left=window, sinks=sinks, softmax_scale=SCALE)

    def call(fn, out, lse):
        fn(*args, **kwargs, out=out, lse=lse)

    out, lse = torch.empty_like(q), torch.empty(q.shape[:-1], device=DEVICE)
    clean = values.clone()
    call(launcher, out, lse)  # compile and allocate outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(launcher, out, lse)
    for poison in [None, *poisons]:
        values.copy_(clean)
        if poison is not None:
            (values[poison] if op == "prefill" else values[:, poison]).fill_(math.nan)
        graph.replay()
        want, want_lse = torch.empty_like(out), torch.empty_like(lse)
        call(reference, want, want_lse)
        _match_reference(out, want, "out", shape.dtype)
        _match_reference(lse, want_lse, "lse", torch.float32)
