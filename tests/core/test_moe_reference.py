"""ReferenceMoE against an independent float64 oracle.

The oracle decodes e2m1/e8m0 from the bit definitions, routes with a Python sort (ties to the lower
expert index) and loops over tokens and their experts one at a time. It shares no code with the
reference beyond torch's own float8_e4m3fn cast (round to nearest even) for FP8 activations.
It checks the shared conformance cases (`tokenspeed_kernel.testing`) and, below, local cases that
sweep what only the reference is held to so far: clamp-saturating gains, fp16 outputs, zero rows.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch

from tokenspeed_kernel.ops.moe.reference import (
    ReferenceMoE,
    dequantize_expert_weights,
    topk_softmax,
)
from tokenspeed_kernel.ops.moe.types import MoEConfig, MoEPlan, MoEWeights, SwiGLU
from tokenspeed_kernel.testing import conformance_cases

FP8_MAX = 448.0

# (atol, rtol), atol relative to the largest |expected| output. The output is the only rounding
# that the reference and the float64 oracle do not share: half an ulp of the output dtype
# (bf16 2^-9, fp16 2^-12), plus float32 accumulation and rare FP8 activation ties.
TOLERANCES = {
    torch.bfloat16: (1e-2, 1.6e-2),
    torch.float16: (1e-3, 1e-3),
}


@dataclass(frozen=True)
class Case:
    name: str
    weight_format: str
    activation_format: str = "bf16"
    static_input_scales: bool = False  # fp8 activations: static per-tensor scales, else dynamic
    has_bias: bool = True
    bias_dtype: torch.dtype = torch.float32
    precomputed_routing: bool = False
    tied_logits: bool = False
    m: int = 3
    e: int = 8
    top_k: int = 2
    h: int = 64
    i: int = 96
    dtype: torch.dtype = torch.bfloat16
    gain_log2: int = 0  # scales weights by 2^gain_log2; 3 drives most pre-activations past ±7
    zero_first_token: bool = False
    seed: int = 0


CASES = [
    Case("mxfp4-m1-k1", "mxfp4", m=1, top_k=1),
    Case("mxfp4-m17-k4-precomputed", "mxfp4", m=17, top_k=4, precomputed_routing=True),
    Case("mxfp4-fp16-bf16bias", "mxfp4", m=17, dtype=torch.float16, bias_dtype=torch.bfloat16),
    Case("mxfp4-nobias", "mxfp4", has_bias=False, top_k=4),
    Case("mxfp4-fp8act-dynamic", "mxfp4", "fp8", m=17, zero_first_token=True),
    Case("mxfp4-fp8act-static", "mxfp4", "fp8", static_input_scales=True, m=17, top_k=4),
    Case("mxfp4-clamp", "mxfp4", m=17, gain_log2=3),
    Case("mxfp4-tied-logits", "mxfp4", m=17, top_k=4, tied_logits=True),
    Case("fp8-bf16act", "fp8", m=17),
    Case("fp8-nobias-m1", "fp8", m=1, top_k=4, has_bias=False),
    Case("fp8-fp8act-dynamic-k1", "fp8", "fp8", m=17, top_k=1),
    Case("fp8-fp8act-static-precomputed", "fp8", "fp8", static_input_scales=True,
         precomputed_routing=True),
    Case("fp8-clamp-fp16", "fp8", m=17, gain_log2=3, dtype=torch.float16),
    Case("bf16-bf16act", "bf16", m=17, top_k=4),
    Case("bf16-fp16-m1-nobias", "bf16", m=1, dtype=torch.float16, has_bias=False),
    Case("bf16-fp8act-static-nobias", "bf16", "fp8", static_input_scales=True, has_bias=False),
    Case("bf16-fp8act-dynamic-precomputed", "bf16", "fp8", m=17, top_k=4,
         precomputed_routing=True),
    Case("bf16-clamp", "bf16", m=3, top_k=4, gain_log2=3, bias_dtype=torch.bfloat16),
]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Independent float64 oracle


def e2m1_value(code: int) -> float:
    """e2m1 from its bits: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent = (code >> 1) & 0b11
    mantissa = code & 0b1
    if exponent == 0:  # subnormal: 0 or 0.5
        return sign * 0.5 * mantissa
    return sign * 2.0 ** (exponent - 1) * (1.0 + 0.5 * mantissa)


E2M1_LUT = torch.tensor([e2m1_value(c) for c in range(16)], dtype=torch.float64)


def decode_mxfp4_f64(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    lo = E2M1_LUT[(packed & 0xF).long()]  # even element along K
    hi = E2M1_LUT[(packed >> 4).long()]
    values = torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], -1)
    block_scale = torch.pow(2.0, scales.to(torch.float64) - 127.0)  # e8m0
    return values * block_scale.repeat_interleave(32, dim=-1)


def decode_weight_f64(w: torch.Tensor, scale: torch.Tensor | None, fmt: str) -> torch.Tensor:
    if fmt == "mxfp4":
        return decode_mxfp4_f64(w, scale)
    if fmt == "fp8":
        return w.to(torch.float64) * scale.to(torch.float64).unsqueeze(-1)
    return w.to(torch.float64)


def fake_quant_fp8(v: torch.Tensor, static_scale: float | None) -> torch.Tensor:
    """The documented FP8-activation rounding: float32 v, scale s (static per-tensor, or per-token
    amax/448), q = fp8_e4m3fn_rne(clamp(v / s, ±448)), value q * s."""
    v = v.to(torch.float32)
    if static_scale is not None:
        s = torch.tensor(static_scale, dtype=torch.float32)
    else:
        amax = v.abs().amax(dim=-1, keepdim=True)
        # An all-zero row quantizes to zeros whatever its scale; 1 avoids 0/0.
        s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (v / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.to(torch.float64) * s.to(torch.float64)


def route_f64(logits: torch.Tensor, top_k: int) -> tuple[list[list[int]], list[list[float]]]:
    ids, weights = [], []
    for row in logits.to(torch.float64).tolist():
        chosen = sorted(range(len(row)), key=lambda e: (-row[e], e))[:top_k]
        top = max(row[e] for e in chosen)
        exps = [math.exp(row[e] - top) for e in chosen]
        ids.append(chosen)
        weights.append([x / sum(exps) for x in exps])
    return ids, weights


@dataclass
class OracleResult:
    out: torch.Tensor  # [M, H] float64
    clamped_gate: int  # pre-activations the SwiGLU clamp changed, to prove the case exercises it
    clamped_up: int


def oracle(config: MoEConfig, x, weights: MoEWeights, ids, route_w, act: SwiGLU) -> OracleResult:
    w13 = decode_weight_f64(weights.w13, weights.w13_scale, config.weight_format)
    w2 = decode_weight_f64(weights.w2, weights.w2_scale, config.weight_format)
    b13 = weights.w13_bias.to(torch.float64) if config.has_bias else None
    b2 = weights.w2_bias.to(torch.float64) if config.has_bias else None
    fp8 = config.activation_format == "fp8"
    out = torch.zeros(x.shape[0], config.hidden_size, dtype=torch.float64)
    clamped_gate = clamped_up = 0
    for t in range(x.shape[0]):
        xt = x[t].to(torch.float64)
        if fp8:
            xt = fake_quant_fp8(xt.unsqueeze(0), weights.w13_input_scale)[0]
        for global_id, r in zip(ids[t], route_w[t], strict=True):
            # Expert parallel: the weights hold experts offset .. offset + local - 1 only.
            e = global_id - config.expert_offset
            if not 0 <= e < config.num_local_experts:
                continue
            h = w13[e] @ xt + (b13[e] if b13 is not None else 0.0)
            gate, up = h[0::2], h[1::2]
            clamped_gate += int((gate > act.limit).sum())
            clamped_up += int((up.abs() > act.limit).sum())
            g = gate.clamp(max=act.limit)
            u = up.clamp(-act.limit, act.limit)
            a = g * torch.sigmoid(act.alpha * g) * (u + 1)
            if fp8:
                a = fake_quant_fp8(a.unsqueeze(0), weights.w2_input_scale)[0]
            y = w2[e] @ a + (b2[e] if b2 is not None else 0.0)
            out[t] += r * y
    return OracleResult(out, clamped_gate, clamped_up)


# ---------------------------------------------------------------------------------------------
# Inputs


def make_weights(case: Case, gen: torch.Generator) -> MoEWeights:
    # The gain applies to w13 only: it is what drives the gate/up pre-activations past the limit.
    e, h, i, gain = case.e, case.h, case.i, 2.0**case.gain_log2

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    if case.weight_format == "mxfp4":

        def mx(n, k, gain_log2):
            packed = torch.randint(0, 256, (e, n, k // 2), generator=gen, dtype=torch.uint8)
            # Bytes 116..124 (2^-11..2^-3) keep |W x| around 1 for x ~ N(0, 1) at these sizes;
            # The gain shifts the exponents, which is exact.
            lo = 116 + gain_log2
            scale = torch.randint(lo, lo + 9, (e, n, k // 32), generator=gen, dtype=torch.uint8)
            return packed, scale

        w13, w13_scale = mx(2 * i, h, case.gain_log2)
        w2, w2_scale = mx(h, i, 0)
    elif case.weight_format == "fp8":

        def f8(n, k, gain):
            q = (randn(e, n, k) * 2.0).to(torch.float8_e4m3fn)
            # |q| ~ 2, so |W x| is around 1 for x ~ N(0, 1) before the gain.
            scale = (torch.rand(e, n, generator=gen) * 0.6 + 0.3) * gain / math.sqrt(k)
            return q, scale

        w13, w13_scale = f8(2 * i, h, gain)
        w2, w2_scale = f8(h, i, 1.0)
    else:
        w13 = (randn(e, 2 * i, h) * gain / math.sqrt(h)).to(torch.bfloat16)
        w2 = (randn(e, h, i) / math.sqrt(i)).to(torch.bfloat16)
        w13_scale = w2_scale = None
    biases = {}
    if case.has_bias:
        biases = {
            "w13_bias": (randn(e, 2 * i) * 0.5).to(case.bias_dtype),
            "w2_bias": (randn(e, h) * 0.5).to(case.bias_dtype),
        }
    scales = {}
    if case.activation_format == "fp8" and case.static_input_scales:
        # Calibrated-looking static scales that still saturate the occasional large activation.
        scales = {"w13_input_scale": 3.0 / FP8_MAX, "w2_input_scale": 4.0 / FP8_MAX}
    return MoEWeights(w13, w2, w13_scale, w2_scale, **biases, **scales)


def make_config(case: Case) -> MoEConfig:
    formats = (case.weight_format, case.activation_format)
    return MoEConfig(case.e, case.top_k, case.h, case.i, *formats, has_bias=case.has_bias)


def make_plan(config: MoEConfig, m: int) -> MoEPlan:
    sizes = (config.hidden_size, config.intermediate_size)
    cpu = torch.device("cpu")
    return MoEPlan(config, "reference.moe_apply", "test", "checkpoint", *sizes, m, cpu)


def make_logits(case: Case, gen: torch.Generator) -> torch.Tensor:
    if case.tied_logits:
        # Three distinct values over eight experts: every row has exact ties at the top-k cut.
        return torch.randint(0, 3, (case.m, case.e), generator=gen).to(torch.bfloat16)
    return torch.randn(case.m, case.e, generator=gen, dtype=torch.float32) * 2.0


def make_routing(case: Case, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(case.e, generator=gen)[: case.top_k] for _ in range(case.m)])
    weights = torch.rand(case.m, case.top_k, generator=gen) + 0.1
    return (weights / weights.sum(-1, keepdim=True)).float(), ids.to(torch.int32)


def snapshot(weights: MoEWeights) -> dict[str, object]:
    return {
        f.name: v.clone() if isinstance(v, torch.Tensor) else v
        for f in dataclasses.fields(weights)
        if (v := getattr(weights, f.name)) is not None
    }


def assert_unchanged(weights: MoEWeights, before: dict[str, object]) -> None:
    for name, old in before.items():
        new = getattr(weights, name)
        if isinstance(old, torch.Tensor):
            assert new.dtype == old.dtype and new.shape == old.shape, name
            # Bitwise, so fp8 tensors and NaN payloads compare too.
            assert torch.equal(new.view(torch.uint8), old.view(torch.uint8)), name
        else:
            assert new == old, name


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    actual, expected = actual.to(torch.float64), expected.to(torch.float64)
    err = (actual - expected).abs()
    bound = atol * expected.abs().max() + rtol * expected.abs()
    bad = ~(err <= bound)  # also catches NaN
    if bad.any():
        worst = torch.nonzero(bad)[:5].tolist()
        idx = tuple(int(v) for v in torch.nonzero(err == err.max())[0])
        raise AssertionError(
            f"{int(bad.sum())}/{err.numel()} elements off: max abs err {err.max():.3e} at {idx} "
            f"(got {actual[idx]:.5f}, expected {expected[idx]:.5f}), rms err "
            f"{err.pow(2).mean().sqrt():.3e}, max |expected| {expected.abs().max():.3e}; "
            f"first offending coordinates {worst}"
        )


def run_case(case: Case, device: str = "cpu"):
    gen = torch.Generator().manual_seed(case.seed)
    config = make_config(case)
    weights = make_weights(case, gen)
    x = torch.randn(case.m, case.h, generator=gen).to(case.dtype)
    if case.zero_first_token:
        x[0] = 0
    if case.precomputed_routing:
        topk_weights, topk_ids = make_routing(case, gen)
        logits = None
        ids, route_w = topk_ids.tolist(), topk_weights.double().tolist()
    else:
        logits = make_logits(case, gen)
        topk_weights = topk_ids = None
        ids, route_w = route_f64(logits, case.top_k)

    before, x_before = snapshot(weights), x.clone()
    logits_before = None if logits is None else logits.clone()

    def to_dev(t):
        return t.to(device) if isinstance(t, torch.Tensor) else t

    dev_weights = dataclasses.replace(weights, **{k: to_dev(v) for k, v in before.items()})
    kernel = ReferenceMoE()
    plan = make_plan(config, case.m)
    prepared = kernel.prepare_weights(plan, dev_weights)
    out = torch.full((case.m, case.h), float("nan"), dtype=case.dtype, device=device)
    kernel.apply(
        plan,
        to_dev(x),
        prepared,
        router_logits=to_dev(logits),
        topk_weights=to_dev(topk_weights),
        topk_ids=to_dev(topk_ids),
        out=out,
    )
    assert out.dtype == case.dtype and out.shape == (case.m, case.h)
    assert_unchanged(dev_weights, {k: to_dev(v) for k, v in before.items()})
    assert_unchanged(weights, before)
    assert torch.equal(x, x_before)
    if logits is not None:
        assert torch.equal(logits, logits_before)

    expected = oracle(config, x, weights, ids, route_w, config.activation)
    assert_close(out.cpu(), expected.out, case.dtype)
    return out.cpu(), expected, (x, weights, ids, route_w)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_reference_matches_f64_oracle(case: Case):
    run_case(case)


@pytest.mark.parametrize("case", conformance_cases("moe_apply"), ids=str)
def test_shared_conformance_cases_match_f64_oracle(case):
    """The shared MoE cases every backend is checked on, anchored to the float64 oracle."""
    (config, weights, x), routing = case.build("cpu")
    if routing["router_logits"] is not None:
        ids, route_w = route_f64(routing["router_logits"], config.top_k)
    else:
        ids = routing["topk_ids"].tolist()
        route_w = routing["topk_weights"].double().tolist()
    kernel, plan = ReferenceMoE(), make_plan(config, x.shape[0])
    out = torch.full_like(x, float("nan"))
    kernel.apply(plan, x, kernel.prepare_weights(plan, weights), out=out, **routing)
    expected = oracle(config, x, weights, ids, route_w, config.activation).out
    assert_close(out, expected, torch.bfloat16)


@pytest.mark.parametrize("case", [c for c in CASES if c.gain_log2 > 0], ids=lambda c: c.name)
def test_clamp_is_exercised_and_checked(case: Case):
    out, expected, (x, weights, ids, route_w) = run_case(case)
    # Both sides of the clamp fire often, so the limit is not a no-op here ...
    assert expected.clamped_gate > 20 and expected.clamped_up > 20
    # ... and an oracle with a wrong limit (or none) disagrees with the reference.
    for wrong in (SwiGLU(limit=6.0), SwiGLU(limit=8.0), SwiGLU(limit=float("inf"))):
        wrong_out = oracle(make_config(case), x, weights, ids, route_w, wrong).out
        with pytest.raises(AssertionError):
            assert_close(out, wrong_out, case.dtype)


def test_tied_logits_pick_lower_index():
    # Row 0: experts 1, 2 and 4 tie at the top; row 1: all tie; row 2: 3 and 5 tie for second.
    logits = torch.tensor(
        [
            [0.0, 3.0, 3.0, 1.0, 3.0, 0.0, -1.0, 2.0],
            [1.0] * 8,
            [0.0, 0.0, 0.0, 2.0, 0.0, 2.0, 5.0, 0.0],
        ]
    )
    for dtype in (torch.float32, torch.bfloat16):
        weights, ids = topk_softmax(logits.to(dtype), 2)
        assert ids.dtype == torch.int32 and weights.dtype == torch.float32
        assert ids.tolist() == [[1, 2], [0, 1], [6, 3]]
        assert torch.allclose(weights[:2], torch.full((2, 2), 0.5))
    _, ids = topk_softmax(logits, 4)
    assert ids.tolist() == [[1, 2, 4, 7], [0, 1, 2, 3], [6, 3, 5, 0]]


@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("m", [1, 3, 17])
def test_topk_softmax_matches_python_sort(m: int, top_k: int):
    gen = torch.Generator().manual_seed(100 * m + top_k)
    # Few distinct values, so ties are common, plus a continuous part on alternate rows.
    logits = torch.randint(-2, 3, (m, 8), generator=gen).float()
    logits[::2] += torch.randn(logits[::2].shape, generator=gen)
    weights, ids = topk_softmax(logits, top_k)
    want_ids, want_w = route_f64(logits, top_k)
    assert ids.tolist() == want_ids
    want_w = torch.tensor(want_w, dtype=torch.float64)
    torch.testing.assert_close(weights.double(), want_w, atol=1e-6, rtol=1e-6)


def test_dequantize_expert_weights_and_sizes():
    case = Case("dq", "mxfp4")
    config = make_config(case)
    weights = make_weights(case, torch.Generator().manual_seed(7))
    w13, w2 = dequantize_expert_weights(config, weights)
    assert w13.dtype == w2.dtype == torch.float32
    assert w13.shape == (8, 2 * 96, 64) and w2.shape == (8, 64, 96)
    assert torch.equal(w13.double(), decode_mxfp4_f64(weights.w13, weights.w13_scale))
    assert torch.equal(w2.double(), decode_mxfp4_f64(weights.w2, weights.w2_scale))
    kernel = ReferenceMoE()
    assert kernel.weight_layout == "checkpoint"
    assert kernel.padded_sizes(config) == (64, 96)


def test_prepare_rejects_missing_or_misshapen_weights():
    case = Case("bad", "mxfp4")
    config = make_config(case)
    weights = make_weights(case, torch.Generator().manual_seed(3))
    plan = make_plan(config, 1)
    kernel = ReferenceMoE()
    no_scale = dataclasses.replace(weights, w2_scale=None)
    with pytest.raises(ValueError, match="w2_scale is None"):
        kernel.prepare_weights(plan, no_scale)
    fp8_plan = make_plan(dataclasses.replace(config, weight_format="fp8"), 1)
    fp8_case = dataclasses.replace(case, weight_format="fp8")
    fp8_weights = make_weights(fp8_case, torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="w13_scale is None"):
        kernel.prepare_weights(fp8_plan, dataclasses.replace(fp8_weights, w13_scale=None))
    small = make_plan(dataclasses.replace(config, intermediate_size=64), 1)
    with pytest.raises(ValueError, match=r"w13 dequantizes to shape \(8, 192, 64\)"):
        kernel.prepare_weights(small, weights)


def test_prepared_weights_do_not_alias_caller_tensors():
    case = Case("alias", "bf16", bias_dtype=torch.float32)
    config = make_config(case)
    weights = make_weights(case, torch.Generator().manual_seed(5))
    prepared = ReferenceMoE().prepare_weights(make_plan(config, 1), weights)
    assert prepared.kernel == "reference.moe_apply" and prepared.config == config
    for name in ("w13", "w2", "w13_bias", "w2_bias"):
        assert prepared.tensors[name].dtype == torch.float32
        assert prepared.tensors[name].data_ptr() != getattr(weights, name).data_ptr()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case", [c for c in CASES if c.m == 17 or c.tied_logits], ids=lambda c: c.name
)
def test_reference_on_cuda(case: Case):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    run_case(case, "cuda")
