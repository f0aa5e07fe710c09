"""Reference attention kernels against an independent float64 oracle written from the contract.

The oracle below loops over queries and heads and lists each query's visible keys explicitly; it
shares no code with the reference. Paged caches are built here from contiguous K/V with shuffled
page tables, extra unused pages and garbage in every slot no sequence owns, so a kernel that reads
past a sequence or through the wrong page produces a visible error.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import pytest
import torch

from tokenspeed_kernel.ops.attention import reference
from tokenspeed_kernel.ops.attention.reference import (
    reference_decode,
    reference_extend,
    reference_kvcache_store,
    reference_prefill,
)

FP8 = torch.float8_e4m3fn

# (atol, rtol) per output dtype. The oracle sees the same bf16/fp16/fp8 inputs, so the budget only
# covers float32 accumulation plus the final rounding of out (bf16: 8 bits, fp16: 11 bits).
TOLERANCE = {
    torch.bfloat16: (1e-2, 1.6e-2),
    torch.float16: (2e-3, 2e-3),
    torch.float32: (1e-4, 1e-5),  # lse, returned in float32
}

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def assert_close(actual, expected, *, dtype, what):
    """Compare in float64; report max and RMS error and the worst coordinates on failure."""
    atol, rtol = TOLERANCE[dtype]
    actual = actual.detach().double().cpu()
    expected = expected.detach().double().cpu()
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    # -inf (an lse with nothing visible) must match exactly; everything else must be finite.
    inf_a, inf_e = torch.isinf(actual), torch.isinf(expected)
    assert torch.equal(inf_a, inf_e) and torch.equal(actual[inf_a], expected[inf_e]), (
        f"{what}: infinities differ"
    )
    a, e = actual[~inf_a], expected[~inf_e]
    assert torch.isfinite(a).all(), f"{what}: non-finite values"
    err = (a - e).abs()
    bad = err > atol + rtol * e.abs()
    if bad.any():
        worst = (err - rtol * e.abs()).argmax()
        coord = tuple(int(i) for i in torch.nonzero(~inf_a)[worst])
        rms = err.pow(2).mean().sqrt().item()
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{bad.numel()} outside atol={atol} rtol={rtol}; "
            f"max err {err.max().item():.3e}, rms {rms:.3e}; worst at {coord}: "
            f"got {actual[coord].item():.6g}, expected {expected[coord].item():.6g}"
        )


def max_violation(actual, expected, *, dtype):
    """How far past the tolerance the worst element is (> 0 means assert_close would fail)."""
    atol, rtol = TOLERANCE[dtype]
    a, e = actual.double().cpu(), expected.double().cpu()
    # Equal infinities agree; an infinity against a finite value is an unbounded violation.
    err = torch.where(a == e, 0.0, (a - e).abs()).nan_to_num(nan=math.inf)
    return (err - atol - rtol * e.abs().nan_to_num(posinf=0.0, neginf=0.0)).max().item()


def oracle(q, k, v, q_positions, *, causal, window_left, sinks, softmax_scale):
    """float64 attention of one sequence straight from the contract.

    q [n, Hq, D]; k, v [L, Hkv, D] with key j at position j; q_positions: n ints.
    Returns out [n, Hq, D], lse [n, Hq].
    """
    q, k, v = q.double(), k.double(), v.double()
    n, num_q_heads, head_dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    out = torch.zeros(n, num_q_heads, head_dim, dtype=torch.float64)
    lse = torch.full((n, num_q_heads), -math.inf, dtype=torch.float64)
    for i in range(n):
        pos = q_positions[i]
        visible = []
        for j in range(num_keys):
            if causal and j > pos:
                continue
            if window_left >= 0 and j < pos - window_left:
                continue
            visible.append(j)
        for h in range(num_q_heads):
            kv = h // (num_q_heads // num_kv_heads)
            sink = None if sinks is None else float(sinks[h])
            logits = [softmax_scale * float(q[i, h] @ k[j, kv]) for j in visible]
            terms = logits + ([] if sink is None else [sink])
            if not terms:
                continue  # no key and no sink: zeros, lse = -inf
            m = max(terms)
            weights = [math.exp(s - m) for s in logits]
            denom = sum(weights) + (0.0 if sink is None else math.exp(sink - m))
            for w, j in zip(weights, visible, strict=True):
                out[i, h] += w * v[j, kv]
            out[i, h] /= denom
            lse[i, h] = m + math.log(denom)
    return out, lse


@dataclass(frozen=True)
class Case:
    name: str
    op: str  # "prefill" | "extend" | "decode"
    seqlens: tuple[int, ...]  # full length of each sequence (keys)
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    # extend: new tokens per sequence; decode: (Q,) shared by all; prefill: unused
    q_lens: tuple[int, ...] = ()
    causal: bool = True
    window_left: int = -1
    sinks: str = "none"  # "none" | "normal" | "large" (+30) | "negative" (-30)
    sinks_dtype: torch.dtype = torch.float32
    page_size: int = 16
    fp8: bool = False
    k_scale: float = 1.0
    v_scale: float = 1.0
    # q multiplier. Large-sink cases raise logits to the sink's scale, so the sink competes with
    # the keys and out stays O(1) (with logits ~ N(0, 1) and sink +30, out ~ 1e-13 would pass any
    # atol); q_gain 100 drives logits past 88, where exp overflows float32 without a max shift.
    q_gain: float = 1.0

    def __str__(self) -> str:
        return self.name


CASES = [
    # prefill
    Case("prefill-gqa1-odd", "prefill", (1, 7, 13), 2, 2, 64),
    Case("prefill-gqa8-empty-seq", "prefill", (5, 0, 11), 8, 1, 128, torch.float16, sinks="normal"),
    Case("prefill-noncausal", "prefill", (9, 1, 4), 4, 2, 16, causal=False, sinks="normal"),
    Case("prefill-noncausal-sink+30", "prefill", (6, 3), 2, 1, 16, causal=False, sinks="large",
         q_gain=20.0),
    Case("prefill-window0", "prefill", (6, 3), 4, 4, 16, window_left=0, sinks="normal"),
    Case("prefill-window1-sink+30", "prefill", (10, 1), 8, 1, 64, torch.float16, window_left=1,
         sinks="large", q_gain=20.0),
    Case("prefill-window5-64q8kv-sink-30", "prefill", (17, 2), 64, 8, 16, window_left=5,
         sinks="negative", sinks_dtype=torch.bfloat16),
    Case("prefill-huge-logits", "prefill", (12, 5), 4, 2, 64, q_gain=100.0, sinks="normal"),
    Case("prefill-all-empty-but-one", "prefill", (0, 3, 0), 4, 1, 16, sinks="normal"),
    # extend
    Case("extend-page3-gqa8", "extend", (7, 20, 1), 8, 1, 64, q_lens=(3, 20, 1), page_size=3,
         sinks="normal"),
    Case("extend-page16-window5-empty-q", "extend", (33, 5, 0), 2, 1, 128, torch.float16,
         q_lens=(9, 0, 0), window_left=5, sinks="normal", sinks_dtype=torch.bfloat16),
    Case("extend-page1-window1-sink+30", "extend", (9, 4), 4, 4, 16, q_lens=(4, 4), page_size=1,
         window_left=1, sinks="large", q_gain=20.0),
    Case("extend-window0", "extend", (8, 5), 4, 2, 16, q_lens=(3, 5), page_size=3,
         window_left=0),
    Case("extend-fp8-page3", "extend", (12, 6), 8, 2, 64, q_lens=(5, 1), page_size=3,
         sinks="normal", fp8=True, k_scale=0.5, v_scale=2.0),
    Case("extend-fp8-window0-sink-30", "extend", (19, 3), 4, 1, 16, q_lens=(2, 3), window_left=0,
         sinks="negative", fp8=True, k_scale=1.5, v_scale=0.25),
    # decode
    Case("decode-q1-gqa8-d128", "decode", (1, 17, 40), 8, 1, 128, q_lens=(1,), sinks="normal"),
    Case("decode-q3-page3-window1", "decode", (3, 10, 25), 4, 2, 16, torch.float16, q_lens=(3,),
         page_size=3, window_left=1),
    Case("decode-q1-page1-window0-sink+30", "decode", (5, 2), 4, 4, 16, q_lens=(1,), page_size=1,
         window_left=0, sinks="large", q_gain=60.0),
    Case("decode-q3-fp8-64q8kv-window5", "decode", (11, 4, 30), 64, 8, 16, q_lens=(3,),
         window_left=5, sinks="normal", fp8=True, k_scale=1.5, v_scale=0.25),
    Case("decode-q1-empty-seq", "decode", (0, 6, 1), 4, 2, 16, q_lens=(1,)),
    Case("decode-q1-empty-seq-sink", "decode", (0, 6), 4, 2, 16, q_lens=(1,), sinks="normal"),
    Case("decode-q3-padded-slot", "decode", (0, 8), 2, 1, 16, torch.float16, q_lens=(3,),
         page_size=3, sinks="large", q_gain=20.0),
]  # fmt: skip


def generator(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(parts).encode()))


def make_sinks(case: Case, gen):
    if case.sinks == "none":
        return None
    base = {"normal": 0.0, "large": 30.0, "negative": -30.0}[case.sinks]
    sinks = base + torch.randn(case.num_q_heads, generator=gen)
    return sinks.to(case.sinks_dtype)


def make_kv(case: Case, length, gen):
    """K or V [length, Hkv, D] in the cache dtype; FP8 values stay well inside +-448."""
    x = torch.randn(length, case.num_kv_heads, case.head_dim, generator=gen)
    if case.fp8:
        return (2 * x).to(FP8)
    return x.to(case.dtype)


def build_paged(ks, vs, page_size, gen):
    """Scatter per-sequence K/V [L_b, Hkv, D] into caches [num_pages, P, Hkv, D] through a
    shuffled page table [B, max_pages] int32. Unused pages, the tails of last pages and a spare
    page-table column hold garbage (large values, valid page ids), so any read outside a sequence
    shows up in the output."""
    pages_per_seq = [-(-len(x) // page_size) for x in ks]
    num_pages = sum(pages_per_seq) + 3
    max_pages = max(pages_per_seq) + 1
    shape = (num_pages, page_size, *ks[0].shape[1:])
    caches = [(10 * torch.randn(shape, generator=gen)).to(ks[0].dtype) for _ in range(2)]
    page_table = torch.randint(0, num_pages, (len(ks), max_pages), generator=gen)
    free_pages = torch.randperm(num_pages, generator=gen).tolist()
    for b, (k, v) in enumerate(zip(ks, vs, strict=True)):
        for p in range(pages_per_seq[b]):
            page = page_table[b, p] = free_pages.pop()
            for cache, x in zip(caches, (k, v), strict=True):
                chunk = x[p * page_size : (p + 1) * page_size]
                cache[page, : len(chunk)] = chunk
    return caches[0], caches[1], page_table.to(torch.int32)


def run_case(case: Case, device, *, with_lse=True, seed_extra=()):
    """Run the reference on fresh inputs; return (out, lse, oracle_inputs)."""
    gen = generator(case.name, *seed_extra)
    heads, dim = case.num_q_heads, case.head_dim
    scale = 1.0 / math.sqrt(dim)
    sinks = make_sinks(case, gen)
    ks = [make_kv(case, n, gen) for n in case.seqlens]
    vs = [make_kv(case, n, gen) for n in case.seqlens]
    if case.op == "prefill":
        q_lens = case.seqlens
    elif case.op == "extend":
        q_lens = case.q_lens
    else:
        q_lens = case.q_lens * len(case.seqlens)
    q_per_seq = [(case.q_gain * torch.randn(n, heads, dim, generator=gen)).to(case.dtype)
                 for n in q_lens]  # fmt: skip
    total = sum(q_lens)
    q = torch.cat(q_per_seq).to(device)
    out = torch.full((total, heads, dim), float("nan"), dtype=case.dtype, device=device)
    lse = torch.full((total, heads), float("nan"), device=device) if with_lse else None
    dev_sinks = None if sinks is None else sinks.to(device)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    if case.op == "prefill":
        reference_prefill(q, torch.cat(ks).to(device), torch.cat(vs).to(device),
                          cu_seqlens=cu.to(device), max_seqlen=max(case.seqlens),
                          causal=case.causal, window_left=case.window_left, sinks=dev_sinks,
                          softmax_scale=scale, out=out, lse=lse)  # fmt: skip
    else:
        k_cache, v_cache, page_table = build_paged(ks, vs, case.page_size, gen)
        common = dict(page_table=page_table.to(device),
                      cache_seqlens=torch.tensor(case.seqlens, dtype=torch.int32, device=device),
                      window_left=case.window_left, sinks=dev_sinks, softmax_scale=scale,
                      k_scale=case.k_scale, v_scale=case.v_scale)  # fmt: skip
        k_cache, v_cache = k_cache.to(device), v_cache.to(device)
        if case.op == "extend":
            reference_extend(q, k_cache, v_cache, cu_seqlens_q=cu.to(device),
                             max_seqlen_q=max(q_lens), out=out, lse=lse, **common)  # fmt: skip
        else:
            batch, qn = len(case.seqlens), case.q_lens[0]
            out4 = out.view(batch, qn, heads, dim)
            lse4 = None if lse is None else lse.view(batch, qn, heads)
            reference_decode(q.view(batch, qn, heads, dim), k_cache, v_cache, out=out4,
                             lse=lse4, **common)  # fmt: skip
    k_scale, v_scale = (case.k_scale, case.v_scale) if case.fp8 else (1.0, 1.0)
    seqs = [
        dict(q=qb, k=kb.double() * k_scale, v=vb.double() * v_scale,
             q_positions=list(range(len(kb) - len(qb), len(kb))))
        for qb, kb, vb in zip(q_per_seq, ks, vs, strict=True)
    ]  # fmt: skip
    oracle_kw = dict(causal=case.causal, window_left=case.window_left, sinks=sinks,
                     softmax_scale=scale)  # fmt: skip
    return out, lse, seqs, oracle_kw


def run_oracle(seqs, oracle_kw, *, position_shift=0):
    outs, lses = [], []
    for s in seqs:
        positions = [p + position_shift for p in s["q_positions"]]
        o, lse = oracle(s["q"], s["k"], s["v"], positions, **oracle_kw)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_attention_matches_float64_oracle(case: Case, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    out, lse, seqs, oracle_kw = run_case(case, device)
    expected_out, expected_lse = run_oracle(seqs, oracle_kw)
    assert_close(out, expected_out, dtype=case.dtype, what=f"{case.name} out")
    assert_close(lse, expected_lse, dtype=torch.float32, what=f"{case.name} lse")


@pytest.mark.parametrize(
    "name", ["prefill-noncausal", "prefill-window5-64q8kv-sink-30", "extend-page3-gqa8",
             "decode-q3-page3-window1"],
)  # fmt: skip
def test_row_blocks_match_oracle(name, monkeypatch):
    """Long sequences are processed in query-row blocks, each with its own key range; force
    blocks of one or two rows so that path runs on small shapes."""
    monkeypatch.setattr(reference, "_SCORE_BLOCK_ELEMS", 64)
    case = next(c for c in CASES if c.name == name)
    out, lse, seqs, oracle_kw = run_case(case, "cpu")
    expected_out, expected_lse = run_oracle(seqs, oracle_kw)
    assert_close(out, expected_out, dtype=case.dtype, what=f"{name} out")
    assert_close(lse, expected_lse, dtype=torch.float32, what=f"{name} lse")


def test_lse_is_optional():
    case = CASES[0]
    with_lse, _, _, _ = run_case(case, "cpu")
    without, lse, _, _ = run_case(case, "cpu", with_lse=False)
    assert lse is None
    assert torch.equal(with_lse, without)


def test_no_visible_key_gives_zeros_and_sink_lse():
    """The contract's edge: an empty decode slot yields zeros; lse = -inf, or the sink if any."""
    for name in ("decode-q1-empty-seq", "decode-q1-empty-seq-sink"):
        case = next(c for c in CASES if c.name == name)
        out, lse, _, _ = run_case(case, "cpu")
        heads = case.num_q_heads
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        sinks = make_sinks(case, generator(case.name))
        expected = torch.full((heads,), -math.inf) if sinks is None else sinks.float()
        assert torch.equal(lse[0], expected)


MUTATIONS = [
    # (case, mutation): each must move the oracle by more than the tolerance, proving the
    # comparison above would catch that bug in a kernel.
    ("prefill-window5-64q8kv-sink-30", "window+1"),
    ("prefill-window5-64q8kv-sink-30", "window-1"),
    ("prefill-window0", "window+1"),
    ("extend-window0", "window+1"),
    ("extend-page1-window1-sink+30", "window+1"),
    ("extend-page16-window5-empty-q", "window-1"),
    ("decode-q3-page3-window1", "window-1"),
    ("prefill-noncausal", "sink-twice"),
    ("extend-page3-gqa8", "sink-twice"),
    ("decode-q1-gqa8-d128", "sink-scaled"),
    ("extend-page3-gqa8", "positions+1"),
    ("decode-q3-page3-window1", "positions-1"),
    ("prefill-gqa1-odd", "noncausal"),
]


@pytest.mark.parametrize(("name", "mutation"), MUTATIONS)
def test_oracle_detects_off_by_one_and_double_sink(name, mutation):
    case = next(c for c in CASES if c.name == name)
    out, lse, seqs, oracle_kw = run_case(case, "cpu")
    expected_out, expected_lse = run_oracle(seqs, oracle_kw)
    assert_close(out, expected_out, dtype=case.dtype, what="unmutated")
    shift = 0
    if mutation.startswith("window"):
        oracle_kw["window_left"] += 1 if mutation == "window+1" else -1
    elif mutation == "sink-twice":
        # Counting the sink twice in the denominator is a sink logit raised by log(2).
        oracle_kw["sinks"] = oracle_kw["sinks"].double() + math.log(2.0)
    elif mutation == "sink-scaled":
        oracle_kw["sinks"] = oracle_kw["sinks"].double() * oracle_kw["softmax_scale"]
    elif mutation == "noncausal":
        oracle_kw["causal"] = False
    else:
        shift = 1 if mutation == "positions+1" else -1
    wrong_out, wrong_lse = run_oracle(seqs, oracle_kw, position_shift=shift)
    assert max_violation(out, wrong_out, dtype=case.dtype) > 0
    assert max_violation(lse, wrong_lse, dtype=torch.float32) > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, FP8], ids=str)
def test_kvcache_store(cache_dtype, page_size, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    gen = generator("store", str(cache_dtype), page_size)
    num_pages, heads, dim, tokens = 12, 2, 16, 9
    src_dtype = torch.bfloat16 if cache_dtype != torch.float16 else torch.float16
    k = torch.randn(tokens, heads, dim, generator=gen).to(src_dtype)
    v = torch.randn(tokens, heads, dim, generator=gen).to(src_dtype)
    if cache_dtype == FP8:
        k[0, 0, :3] = torch.tensor([1e4, -1e4, 300.0])  # saturates at +-448 after / k_scale
    k_scale, v_scale = (0.5, 3.0) if cache_dtype == FP8 else (1.0, 1.0)
    k_cache = torch.randn(num_pages, page_size, heads, dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(num_pages, page_size, heads, dim, generator=gen).to(cache_dtype)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(num_pages * page_size, generator=gen)[:tokens]
    slots[[1, 4]] = -1  # padding tokens
    dev = [x.to(device) for x in (k, v, k_cache, v_cache)]
    reference_kvcache_store(*dev, slot_mapping=slots.to(device), k_scale=k_scale,
                            v_scale=v_scale)  # fmt: skip
    k_cache, v_cache = dev[2].cpu(), dev[3].cpu()

    def bits(x):
        return x.view(torch.uint8) if x.dtype == FP8 else x.view(torch.int16)

    written = torch.zeros(num_pages * page_size, dtype=torch.bool)
    for t in range(tokens):
        slot = int(slots[t])
        if slot < 0:
            continue
        written[slot] = True
        page, off = divmod(slot, page_size)
        for src, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
            if cache_dtype == FP8:
                want = (src[t].float() / scale).clamp(-448, 448).to(FP8)
            else:
                want = src[t].to(cache_dtype)
            assert torch.equal(bits(cache[page, off]), bits(want)), f"token {t} slot {slot}"
    flat = written.view(num_pages, page_size)
    assert torch.equal(bits(k_cache[~flat]), bits(k_before[~flat])), "untouched K slot changed"
    assert torch.equal(bits(v_cache[~flat]), bits(v_before[~flat])), "untouched V slot changed"


def test_kvcache_store_fp8_rounding_and_saturation():
    """Known e4m3fn encodings: ties round to even, out-of-range saturates to +-448 (0x7E/0xFE)."""
    values = torch.tensor([1.0625, 1.1875, 1e4, -1e4, 0.0, -2.0])  # / scale 0.5 below
    k = (values * 0.5).view(6, 1, 1).to(torch.bfloat16)
    k_cache = torch.zeros(2, 3, 1, 1, dtype=FP8)
    v_cache = torch.zeros(2, 3, 1, 1, dtype=FP8)
    slots = torch.arange(6, dtype=torch.int64)
    reference_kvcache_store(k, k, k_cache, v_cache, slot_mapping=slots, k_scale=0.5, v_scale=1.0)
    assert k_cache.view(torch.uint8).flatten().tolist() == [0x38, 0x3A, 0x7E, 0xFE, 0x00, 0xC0]
