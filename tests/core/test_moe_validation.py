"""Every validation error of the MoE ops: ValueError/TypeError naming the argument."""

from __future__ import annotations

import pytest
import torch

import tokenspeed_kernel as tk

BF16 = torch.bfloat16


def test_moe_config_errors():
    base = dict(num_experts=8, top_k=2, hidden_size=64, intermediate_size=96)
    cases = [
        (dict(top_k=9), ValueError, "top_k is 9, expected at most num_experts"),
        (dict(num_experts=0), ValueError, "num_experts is 0, expected a positive int"),
        (dict(hidden_size=70), ValueError, "hidden_size is 70, expected a multiple of 32"),
        (
            dict(weight_format="nvfp4"),
            ValueError,
            "weight_format is 'nvfp4', expected one of mxfp4, fp8, bf16",
        ),
        (
            dict(activation_format="fp4"),
            ValueError,
            "activation_format is 'fp4', expected one of bf16, fp8",
        ),
        (dict(routing="sigmoid"), ValueError, "routing is 'sigmoid', expected one of topk_softmax"),
        (dict(activation="gelu"), TypeError, "activation is str, expected SwiGLU"),
    ]
    for over, exc, match in cases:
        with pytest.raises(exc, match=match):
            tk.MoEConfig(**{**base, **over})


def _moe(weight_format="bf16", has_bias=True):
    config = tk.MoEConfig(8, 2, 64, 96, weight_format=weight_format, has_bias=has_bias)
    plan = tk.moe_plan(config, device="cpu", max_num_tokens=16)
    E, H, I = 8, 64, 96  # noqa: E741
    weights = tk.MoEWeights(
        w13=torch.randn(E, 2 * I, H, dtype=BF16) * 0.1,
        w2=torch.randn(E, H, I, dtype=BF16) * 0.1,
        w13_bias=torch.randn(E, 2 * I) if has_bias else None,
        w2_bias=torch.randn(E, H) if has_bias else None,
    )
    return config, plan, weights


def test_moe_prepare_errors():
    config, plan, w = _moe()
    bad = [
        (
            tk.MoEWeights(w13=w.w13.float(), w2=w.w2, w13_bias=w.w13_bias, w2_bias=w.w2_bias),
            "weights.w13 has dtype float32, expected bfloat16",
        ),
        (
            tk.MoEWeights(w13=w.w13, w2=w.w2[:, :, :32], w13_bias=w.w13_bias, w2_bias=w.w2_bias),
            r"weights.w2 has shape \[8, 64, 32\], expected \[8, 64, 96\]",
        ),
        (
            tk.MoEWeights(w13=w.w13, w2=w.w2, w2_bias=w.w2_bias),
            r"weights.w13_bias is None, expected a tensor of shape \[8, 192\]",
        ),
        (
            tk.MoEWeights(
                w13=w.w13,
                w2=w.w2,
                w13_scale=torch.ones(8, 192),
                w13_bias=w.w13_bias,
                w2_bias=w.w2_bias,
            ),
            "weights.w13_scale is a tensor, expected None with bf16 weights",
        ),
        (
            tk.MoEWeights(
                w13=w.w13, w2=w.w2, w13_bias=w.w13_bias, w2_bias=w.w2_bias, w13_input_scale=0.1
            ),
            "weights.w13_input_scale is 0.1, expected None with bf16 activations",
        ),
    ]
    for weights, match in bad:
        with pytest.raises(ValueError, match="moe_prepare_weights: " + match):
            tk.moe_prepare_weights(plan, weights)
    with pytest.raises(TypeError, match="weights is dict, expected MoEWeights"):
        tk.moe_prepare_weights(plan, {"w13": w.w13})
    _, no_bias_plan, _ = _moe(has_bias=False)
    with pytest.raises(
        ValueError, match="weights.w13_bias is a tensor, expected None with has_bias=False"
    ):
        tk.moe_prepare_weights(no_bias_plan, w)


def test_moe_apply_errors():
    config, plan, w = _moe()
    prepared = tk.moe_prepare_weights(plan, w)
    x = torch.randn(3, 64, dtype=BF16)
    logits = torch.randn(3, 8)
    ids = torch.zeros(3, 2, dtype=torch.int32)
    cases = [
        (dict(x=x.half()), ValueError, "x has dtype float16, expected bfloat16"),
        (
            dict(x=torch.randn(3, 32, dtype=BF16)),
            ValueError,
            r"x has shape \[3, 32\], expected \[\*, 64\]",
        ),
        (
            dict(x=torch.randn(17, 64, dtype=BF16), router_logits=torch.randn(17, 8)),
            ValueError,
            r"x has 17 tokens, expected at most the plan's max_num_tokens \(16\)",
        ),
        (
            dict(router_logits=torch.randn(3, 7)),
            ValueError,
            r"router_logits has shape \[3, 7\], expected \[3, 8\]",
        ),
        (
            dict(router_logits=None),
            ValueError,
            "router_logits is None, expected router_logits or both",
        ),
        (dict(router_logits=None, topk_ids=ids), ValueError, "router_logits is None"),
        (
            dict(topk_ids=ids, topk_weights=torch.ones(3, 2)),
            ValueError,
            "router_logits and topk_weights/topk_ids are both given",
        ),
        (
            dict(router_logits=None, topk_ids=ids.long(), topk_weights=torch.ones(3, 2)),
            ValueError,
            "topk_ids has dtype int64, expected int32",
        ),
        (
            dict(router_logits=None, topk_ids=ids, topk_weights=torch.ones(3, 4)),
            ValueError,
            r"topk_weights has shape \[3, 4\], expected \[3, 2\]",
        ),
        (dict(out=torch.empty(3, 64)), ValueError, "out has dtype float32, expected bfloat16"),
        (
            dict(x=torch.randn(64, 3, dtype=BF16).t()),
            ValueError,
            "x has stride 3 in its last dim, expected 1",
        ),
        (
            dict(router_logits=torch.randn(8, 3).t()),
            ValueError,
            "router_logits has stride 3 in its last dim",
        ),
        (
            dict(out=torch.empty(64, 3, dtype=BF16).t()),
            ValueError,
            "out has stride 3 in its last dim",
        ),
        (
            dict(router_logits=None, topk_ids=ids, topk_weights=torch.ones(2, 3).t()),
            ValueError,
            r"topk_weights has strides \[1, 3\], expected contiguous",
        ),
        (dict(weights=w), TypeError, "weights is MoEWeights, expected the PreparedMoEWeights"),
        (dict(plan="reference.moe_apply"), TypeError, "plan is str, expected MoEPlan"),
    ]
    for over, exc, match in cases:
        args = dict(plan=plan, x=x, weights=prepared, router_logits=logits)
        args.update(over)
        with pytest.raises(exc, match="moe_apply: " + match):
            tk.moe_apply(args.pop("plan"), args.pop("x"), args.pop("weights"), **args)
    other_config, other_plan, other_w = _moe(has_bias=False)
    other = tk.moe_prepare_weights(other_plan, tk.MoEWeights(w13=other_w.w13, w2=other_w.w2))
    with pytest.raises(
        ValueError, match="config.has_bias is False in the weights, True in the plan"
    ):
        tk.moe_apply(plan, x, other, logits)


def test_moe_plan_errors():
    config = tk.MoEConfig(8, 2, 64, 96)
    with pytest.raises(ValueError, match="moe_plan: max_num_tokens is 0, expected an int >= 1"):
        tk.moe_plan(config, device="cpu", max_num_tokens=0)
    with pytest.raises(TypeError, match="moe_plan: config is dict, expected MoEConfig"):
        tk.moe_plan({"num_experts": 8}, device="cpu")
