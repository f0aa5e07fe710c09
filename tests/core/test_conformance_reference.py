"""tokenspeed_kernel.testing: the reference kernels pass their own conformance cases (trivially,
but it runs every case's input builder through the real kernel signatures), and deliberately
wrong kernels registered here fail them with a readable message."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from tokenspeed_kernel.ops.moe.reference import ReferenceMoE
from tokenspeed_kernel.ops.moe.types import PreparedMoEWeights
from tokenspeed_kernel.testing import (
    assert_close,
    assert_conformance,
    compare,
    conformance_cases,
    conformance_params,
    preset_cases,
    reference_spec,
    run_case,
    temporary_kernel,
)

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("kernel,case", conformance_params(backend="reference"))
def test_reference_conformance(kernel, case):
    assert_conformance(kernel, case, "cpu")


def _case(op, name):
    return next(c for c in conformance_cases(op) if c.name == name)


def _wrap(op, after=None, **overrides):
    """The reference kernel of `op` with some arguments overridden, then `after(args, kwargs)`."""
    ref = reference_spec(op).fn

    def kernel(*args, **kwargs):
        ref(*args, **{**kwargs, **{k: f(kwargs) for k, f in overrides.items()}})
        if after is not None:
            after(args, kwargs)

    return kernel


def _scale_out(args, kwargs):
    kwargs["out"].mul_(1.01)


def _shift_lse(args, kwargs):
    kwargs["lse"].add_(1e-3)


def _nan_first_row(args, kwargs):
    kwargs["out"][0].fill_(float("nan"))


def _touch_q(args, kwargs):
    args[0].mul_(2)


def _no_skip(op):
    ref = reference_spec(op).fn

    def kernel(k, v, k_cache, v_cache, *, slot_mapping, **kw):
        ref(k, v, k_cache, v_cache, slot_mapping=slot_mapping.clamp(min=0), **kw)

    return kernel


WRONG = [
    ("out x1.01", "mha_prefill", "prefill-odd-gqa1-lse-fp16", _wrap("mha_prefill", _scale_out),
     "out: "),
    ("window off by one", "mha_decode_with_kvcache", "decode-q3-window1-bf16",
     _wrap("mha_decode_with_kvcache", window_left=lambda kw: kw["window_left"] + 1), "out: "),
    ("lse + 1e-3", "mha_extend_with_kvcache", "extend-partial-prefix-page16-gqa8-bf16",
     _wrap("mha_extend_with_kvcache", _shift_lse), "lse: "),
    ("unwritten row", "mha_decode_with_kvcache", "decode-q1-gqa8-d128-page16-bf16",
     _wrap("mha_decode_with_kvcache", _nan_first_row), "out: "),
    ("modifies q", "mha_prefill", "prefill-window0-sinks-lse-bf16",
     _wrap("mha_prefill", _touch_q), "q: input was modified"),
    ("fp8 store ignores k_scale", "kvcache_store", "store-fp8-scales-padded-bf16",
     _wrap("kvcache_store", k_scale=lambda kw: 1.0), "k_cache: "),
    ("stores padded tokens", "kvcache_store", "store-page16-padded-slots-fp16",
     _no_skip("kvcache_store"), "_cache: "),
]  # fmt: skip


@pytest.mark.parametrize("what,op,case_name,fn,message", WRONG, ids=[w[0] for w in WRONG])
def test_wrong_kernel_fails(what, op, case_name, fn, message):
    case = _case(op, case_name)
    with temporary_kernel(op, f"wrong.{op}", fn) as spec:
        result = run_case(spec, case, "cpu")
        assert not result.ok
        assert message in str(result)
        with pytest.raises(pytest.fail.Exception, match=f"wrong.{op} on {case_name}"):
            assert_conformance(spec, case, "cpu")


class _NoSecondBias(ReferenceMoE):
    """Forgets the second bias: the kind of bug the MoE cases must catch."""

    def prepare_weights(self, plan, weights):
        prepared = super().prepare_weights(plan, weights)
        tensors = dict(prepared.tensors, w2_bias=None)
        return PreparedMoEWeights(kernel=plan.kernel, config=prepared.config, tensors=tensors)


class _WrongName(ReferenceMoE):
    pass  # prepare_weights returns weights labelled "reference.moe_apply"


def test_wrong_moe_kernel_fails():
    case = _case("moe_apply", "moe-mxfp4-bf16-bias-logits")
    with temporary_kernel("moe_apply", "wrong.moe", _NoSecondBias()) as spec:
        result = run_case(spec, case, "cpu")
        assert not result.ok and result.name == "out" and result.num_bad > 0
    with temporary_kernel("moe_apply", "wrong.moe.name", _WrongName()) as spec:
        with pytest.raises(RuntimeError, match="returned weights for reference.moe_apply"):
            run_case(spec, case, "cpu")


def test_declining_kernel_is_skipped_with_its_reason():
    case = _case("mha_prefill", "prefill-odd-gqa1-lse-bf16")
    traits = dict(reference_spec("mha_prefill").traits, head_dim={256})
    fn = reference_spec("mha_prefill").fn
    with temporary_kernel("mha_prefill", "narrow.mha_prefill", fn, traits=traits) as spec:
        with pytest.raises(pytest.skip.Exception, match="head_dim 64 not in"):
            assert_conformance(spec, case, "cpu")


def test_raising_kernel_propagates():
    def broken(*args, **kwargs):
        raise RuntimeError("launch failed")

    case = _case("mha_prefill", "prefill-one-token-gqa4-bf16")
    with temporary_kernel("mha_prefill", "broken.mha_prefill", broken) as spec:
        with pytest.raises(RuntimeError, match="launch failed"):
            run_case(spec, case, "cpu")


@pytest.mark.parametrize(
    "op", ["mha_prefill", "mha_extend_with_kvcache", "mha_decode_with_kvcache", "kvcache_store"]
)
def test_cases_build_exactly_the_kernel_keywords(op):
    """Every case passes the keyword arguments the public op passes to kernel.fn (taken from
    the reference's signature), and draws fresh inputs per seed, never zeros."""
    params = inspect.signature(reference_spec(op).fn).parameters
    keywords = {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    for case in conformance_cases(op):
        args, kwargs = case.build("cpu", seed=0)
        assert set(kwargs) == keywords, case.name
        again, _ = case.build("cpu", seed=0)
        other, _ = case.build("cpu", seed=1)
        x = args[0]
        if x.numel():
            assert torch.equal(x, again[0]) and not torch.equal(x, other[0]), case.name
            assert x.abs().amax() > 0, case.name


def _features(op):
    return [c.shape for c in conformance_cases(op)]


def test_attention_cases_cover_the_contract():
    for op in ("mha_prefill", "mha_extend_with_kvcache", "mha_decode_with_kvcache"):
        shapes = _features(op)
        assert {s.head_dim for s in shapes} >= {64, 128}, op
        assert {s.num_q_heads // s.num_kv_heads for s in shapes} >= {1, 8}, op
        assert {s.sinks is None for s in shapes} == {True, False}, op
        assert {s.lse for s in shapes} == {True, False}, op
        assert {-1, 0, 1} <= {s.window_left for s in shapes}, op
        assert {torch.bfloat16, torch.float16} <= {s.dtype for s in shapes}, op
    prefill = _features("mha_prefill")
    assert any(1 in s.seqlens for s in prefill) and any(0 in s.seqlens for s in prefill)
    assert any(not s.causal for s in prefill) and any(s.window_left == 127 for s in prefill)
    extend = _features("mha_extend_with_kvcache")
    assert any(0 < q < n for s in extend for q, n in zip(s.q_lens, s.seqlens, strict=True))
    assert any(0 in s.q_lens for s in extend) and any(s.cache_dtype == FP8 for s in extend)
    decode = _features("mha_decode_with_kvcache")
    assert {s.q_lens[0] > 1 for s in decode} == {True, False}
    assert any(0 in s.seqlens for s in decode)
    assert any(s.cache_dtype == FP8 and s.k_scale != 1.0 for s in decode)
    for op in ("mha_extend_with_kvcache", "mha_decode_with_kvcache", "kvcache_store"):
        assert {1, 128} <= {s.page_size for s in _features(op)}, op


def test_store_and_moe_cases_cover_the_contract():
    store = _features("kvcache_store")
    assert {torch.bfloat16, torch.float16} <= {s.dtype for s in store}
    assert any(s.cache_dtype == FP8 and s.k_scale != 1.0 for s in store)
    assert any(s.skip for s in store) and any(s.skip == s.num_tokens for s in store)
    moe = _features("moe_apply")
    assert {s.weight_format for s in moe} == {"mxfp4", "fp8", "bf16"}
    assert {(s.activation_format, s.static_scales) for s in moe} >= {
        ("bf16", False),
        ("fp8", False),
        ("fp8", True),
    }
    assert {s.has_bias for s in moe} == {True, False}
    assert {s.routing for s in moe} == {"logits", "ties", "precomputed"}
    assert any(s.num_tokens == 1 for s in moe)


def test_preset_cases_have_the_model_shapes():
    cases = preset_cases("mha_decode_with_kvcache", "gpt-oss-120b")
    assert {c.request.page_size for c in cases} == {64}
    assert {(c.request.num_q_heads, c.request.num_kv_heads, c.request.head_dim) for c in cases} == {
        (64, 8, 64)
    }
    assert {c.request.window_left for c in cases} == {-1, 127}
    assert {len(c.shape.seqlens) for c in cases} >= {1, 16, 64}
    moe = preset_cases("moe_apply", "gpt-oss-20b")
    assert {(c.request.num_experts, c.request.top_k, c.request.hidden_size) for c in moe} == {
        (32, 4, 2880)
    }
    # A TP 8 rank's last slice of I = 2880 and an EP 8 rank's block of 32 experts.
    assert {c.request.intermediate_size for c in moe} == {2880, 192}
    assert {(c.request.expert_offset, c.request.num_local_experts) for c in moe} == {
        (0, 32),
        (16, 4),
    }
    merged = conformance_cases("kvcache_store", preset="tiny", dtypes=[torch.bfloat16])
    assert any(c.preset == "tiny" for c in merged) and any(c.preset is None for c in merged)
    assert all(c.dtype == torch.bfloat16 for c in merged)


def test_compare_reports_the_worst_coordinate():
    expected = torch.zeros(3, 4, dtype=torch.float16)
    actual = expected.clone()
    actual[2, 1] = 0.5
    result = compare(actual, expected, dtype=torch.float16, name="out")
    assert not result.ok and result.worst_index == (2, 1) and result.num_bad == 1
    assert math.isclose(result.max_abs, 0.5) and math.isclose(result.rms, 0.5 / math.sqrt(12))
    with pytest.raises(AssertionError, match=r"out: 1/12 outside .* worst at \(2, 1\)"):
        assert_close(actual, expected, dtype=torch.float16, name="out")


def test_compare_infinities_nan_and_shapes():
    lse = torch.tensor([-math.inf, 1.0])
    assert compare(lse.clone(), lse, dtype=torch.float32).ok
    assert not compare(torch.tensor([0.0, 1.0]), lse, dtype=torch.float32).ok
    assert not compare(torch.tensor([-math.inf, math.nan]), lse, dtype=torch.float32).ok
    result = compare(torch.zeros(2, 3), torch.zeros(3, 2), dtype=torch.float32, name="lse")
    assert not result.ok and "shape [2, 3], expected [3, 2]" in str(result)
    with pytest.raises(ValueError, match="no entry for int32"):
        compare(lse, lse, dtype=torch.int32)
