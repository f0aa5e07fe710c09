"""Reference attention kernels against an independent float64 oracle written from the contract.

The inputs are the shared conformance cases (`tokenspeed_kernel.testing`: shuffled page tables,
garbage in every cache slot no sequence owns, NaN-filled outputs) plus a few edges only the
reference is held to so far. The oracle below reads those normalized arguments, lists each
query's visible keys explicitly and shares no code with the reference.
"""

from __future__ import annotations

import math

import pytest
import torch

import tokenspeed_kernel as tk
from tokenspeed_kernel.ops.attention import reference
from tokenspeed_kernel.ops.attention.reference import (
    reference_decode,
    reference_extend,
    reference_kvcache_store,
    reference_prefill,
)
from tokenspeed_kernel.testing import AttentionShape, assert_close, compare, conformance_cases
from tokenspeed_kernel.testing.cases import attention_case
from tokenspeed_kernel.testing.inputs import generator

FP8 = torch.float8_e4m3fn
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
REFERENCES = {
    "mha_prefill": reference_prefill,
    "mha_extend_with_kvcache": reference_extend,
    "mha_decode_with_kvcache": reference_decode,
}


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


def sequences(op, args, kwargs):
    """Split normalized arguments into per-sequence (q [n, Hq, D], k/v [L, Hkv, D] float64 after
    dequantization, absolute query positions), gathering paged keys through the page table."""
    q = args[0].cpu()
    if op == "mha_prefill":
        k, v = args[1].cpu(), args[2].cpu()
        cu = kwargs["cu_seqlens"].tolist()
        for s, e in zip(cu[:-1], cu[1:], strict=True):
            yield q[s:e], k[s:e].double(), v[s:e].double(), list(range(e - s))
        return
    k_cache, v_cache = args[1].cpu(), args[2].cpu()
    page_size = k_cache.shape[1]
    table, lens = kwargs["page_table"].cpu(), kwargs["cache_seqlens"].tolist()
    fp8 = k_cache.dtype == FP8
    k_scale, v_scale = (kwargs["k_scale"], kwargs["v_scale"]) if fp8 else (1.0, 1.0)
    if op == "mha_extend_with_kvcache":
        cu = kwargs["cu_seqlens_q"].tolist()
        rows = [q[s:e] for s, e in zip(cu[:-1], cu[1:], strict=True)]
    else:
        rows = list(q)
    for b, (q_b, length) in enumerate(zip(rows, lens, strict=True)):
        pages = [int(table[b, p // page_size]) for p in range(length)]
        offsets = [p % page_size for p in range(length)]
        k_b = (
            torch.stack([k_cache[pg, o] for pg, o in zip(pages, offsets, strict=True)])
            if length
            else k_cache.new_zeros((0, *k_cache.shape[2:]))
        )
        v_b = (
            torch.stack([v_cache[pg, o] for pg, o in zip(pages, offsets, strict=True)])
            if length
            else v_cache.new_zeros((0, *v_cache.shape[2:]))
        )
        n = len(q_b)
        yield q_b, k_b.double() * k_scale, v_b.double() * v_scale, list(range(length - n, length))


def run_oracle(op, args, kwargs, *, position_shift=0, **overrides):
    """The float64 answer for a case's arguments; `overrides` replace oracle options (to show
    that a wrong window, sink or causality would be caught)."""
    options = dict(causal=kwargs.get("causal", True), window_left=kwargs["window_left"],
                   sinks=kwargs["sinks"], softmax_scale=kwargs["softmax_scale"])  # fmt: skip
    options.update(overrides)
    if options["sinks"] is not None:
        options["sinks"] = options["sinks"].cpu()
    outs, lses = [], []
    for q_b, k_b, v_b, positions in sequences(op, args, kwargs):
        o, lse = oracle(q_b, k_b, v_b, [p + position_shift for p in positions], **options)
        outs.append(o)
        lses.append(lse)
    if op == "mha_decode_with_kvcache":
        return torch.stack(outs), torch.stack(lses)
    return torch.cat(outs), torch.cat(lses)


A = AttentionShape
# Edges the shared list does not carry yet (candidates for it once every backend has run them on
# its silicon): page size 3, logits past float32's exp range, a -30 sink, fp8 with a window of 0,
# and a padded decode slot (cache_seqlens < Q, so its queries see no key).
EXTRA_CASES = [
    attention_case("ref-prefill-huge-logits", "mha_prefill",
                   A((12, 5), 4, 2, 64, q_gain=100.0, sinks=0.0, lse=True)),
    attention_case("ref-prefill-window5-64q8kv-sink-30", "mha_prefill",
                   A((17, 2), 64, 8, 16, window_left=5, sinks=-30.0, sinks_dtype=torch.bfloat16,
                     lse=True)),
    attention_case("ref-prefill-noncausal-sink+30", "mha_prefill",
                   A((6, 3), 2, 1, 16, causal=False, sinks=30.0, q_gain=20.0, lse=True)),
    attention_case("ref-extend-page3-gqa8", "mha_extend_with_kvcache",
                   A((7, 20, 1), 8, 1, 64, q_lens=(3, 20, 1), page_size=3, sinks=0.0, lse=True)),
    attention_case("ref-extend-fp8-window0-sink-30", "mha_extend_with_kvcache",
                   A((19, 3), 4, 1, 16, kv_dtype=FP8, q_lens=(2, 3), page_size=16, window_left=0,
                     sinks=-30.0, lse=True, k_scale=1.5, v_scale=0.25)),
    attention_case("ref-decode-q3-page3-window1", "mha_decode_with_kvcache",
                   A((3, 10, 25), 4, 2, 16, torch.float16, q_lens=(3,), page_size=3,
                     window_left=1, lse=True)),
    attention_case("ref-decode-q3-padded-slot-sink", "mha_decode_with_kvcache",
                   A((0, 8), 2, 1, 16, torch.float16, q_lens=(3,), page_size=3, sinks=30.0,
                     q_gain=20.0, lse=True)),
]  # fmt: skip
CASES = [c for op in REFERENCES for c in conformance_cases(op)] + EXTRA_CASES
BY_NAME = {c.name: c for c in CASES}


def run_reference(case, device="cpu"):
    args, kwargs = case.build(device)
    REFERENCES[case.op](*args, **kwargs)
    return args, kwargs


def check_against_oracle(case, device="cpu"):
    args, kwargs = run_reference(case, device)
    expected_out, expected_lse = run_oracle(case.op, args, kwargs)
    assert_close(kwargs["out"], expected_out, dtype=case.shape.out_dtype, name=f"{case} out")
    if kwargs["lse"] is not None:
        assert_close(kwargs["lse"], expected_lse, dtype=torch.float32, name=f"{case} lse")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_attention_matches_float64_oracle(case, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    check_against_oracle(case, device)


@pytest.mark.parametrize(
    "name", ["prefill-noncausal-sinks-bf16", "ref-prefill-window5-64q8kv-sink-30",
             "ref-extend-page3-gqa8", "ref-decode-q3-page3-window1"],
)  # fmt: skip
def test_row_blocks_match_oracle(name, monkeypatch):
    """Long sequences are processed in query-row blocks, each with its own key range; force
    blocks of one or two rows so that path runs on small shapes."""
    monkeypatch.setattr(reference, "_SCORE_BLOCK_ELEMS", 64)
    check_against_oracle(BY_NAME[name])


def test_lse_is_optional():
    case = BY_NAME["prefill-odd-gqa1-lse-bf16"]
    with_lse = run_reference(case)[1]["out"]
    args, kwargs = case.build("cpu")
    kwargs["lse"] = None
    reference_prefill(*args, **kwargs)
    assert torch.equal(with_lse, kwargs["out"])


def test_no_visible_key_gives_zeros_and_sink_lse():
    """The contract's edge: an empty decode slot yields zeros; lse = -inf, or the sink if any."""
    for name in ("decode-q1-empty-seq-lse-bf16", "ref-decode-q3-padded-slot-sink"):
        _, kwargs = run_reference(BY_NAME[name])
        out, lse, sinks = kwargs["out"][0], kwargs["lse"][0], kwargs["sinks"]
        assert torch.equal(out, torch.zeros_like(out))
        expected = (
            torch.full_like(lse, -math.inf) if sinks is None else sinks.float().expand_as(lse)
        )
        assert torch.equal(lse, expected)


MUTATIONS = [
    # (case, mutation): each must move the oracle past the tolerance, proving the comparison
    # above would catch that bug in a kernel.
    ("ref-prefill-window5-64q8kv-sink-30", "window+1"),
    ("ref-prefill-window5-64q8kv-sink-30", "window-1"),
    ("prefill-window0-sinks-lse-bf16", "window+1"),
    ("extend-window0-no-sinks-fp16", "window+1"),
    ("extend-page1-window1-gqa1-bf16", "window+1"),
    ("extend-d128-page64-window5-empty-q-bf16", "window-1"),
    ("ref-decode-q3-page3-window1", "window-1"),
    ("prefill-noncausal-sinks-bf16", "sink-twice"),
    ("ref-extend-page3-gqa8", "sink-twice"),
    ("decode-q1-gqa8-d128-page16-bf16", "sink-scaled"),
    ("ref-extend-page3-gqa8", "positions+1"),
    ("ref-decode-q3-page3-window1", "positions-1"),
    ("prefill-odd-gqa1-lse-bf16", "noncausal"),
]


@pytest.mark.parametrize(("name", "mutation"), MUTATIONS)
def test_oracle_detects_off_by_one_and_double_sink(name, mutation):
    case = BY_NAME[name]
    args, kwargs = run_reference(case)
    out, lse = kwargs["out"], kwargs["lse"]
    assert_close(out, run_oracle(case.op, args, kwargs)[0], dtype=case.shape.out_dtype,
                 name="unmutated")  # fmt: skip
    overrides, shift = {}, 0
    if mutation.startswith("window"):
        overrides["window_left"] = kwargs["window_left"] + (1 if mutation == "window+1" else -1)
    elif mutation == "sink-twice":
        # Counting the sink twice in the denominator is a sink logit raised by log(2).
        overrides["sinks"] = kwargs["sinks"].double() + math.log(2.0)
    elif mutation == "sink-scaled":
        overrides["sinks"] = kwargs["sinks"].double() * kwargs["softmax_scale"]
    elif mutation == "noncausal":
        overrides["causal"] = False
    else:
        shift = 1 if mutation == "positions+1" else -1
    wrong_out, wrong_lse = run_oracle(case.op, args, kwargs, position_shift=shift, **overrides)
    moved = not compare(out, wrong_out, dtype=case.shape.out_dtype).ok
    if lse is not None:
        moved = moved and not compare(lse, wrong_lse, dtype=torch.float32).ok
    assert moved, f"{mutation} on {name} stays within tolerance: the oracle could not catch it"


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


@pytest.mark.parametrize("poison", ["v_nan", "v_inf", "k_nan"])
def test_keys_outside_every_window_do_not_reach_the_output(poison):
    """A masked key contributes nothing whatever its value (0 * NaN is NaN in a plain p @ v):
    prefill of 100 tokens, window 3, K or V poisoned at positions 0..49."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(100, 4, 64, generator=g, dtype=torch.float16) for _ in range(3))
    cu = torch.tensor([0, 100], dtype=torch.int32)
    with tk.use_kernel("mha_prefill", "reference.mha_prefill"):
        clean = tk.mha_prefill(q, k, v, cu_seqlens=cu, max_seqlen=100, window_left=3)
        target = v if poison.startswith("v") else k
        target[:50] = float("nan") if poison.endswith("nan") else float("inf")
        out = tk.mha_prefill(q, k, v, cu_seqlens=cu, max_seqlen=100, window_left=3)
    assert torch.equal(out[53:], clean[53:])
    assert not torch.isfinite(out[:53]).any()
