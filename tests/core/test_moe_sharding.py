"""Tensor- and expert-parallel MoE shards: the contract's validation, the split rules, and the
reference kernel's shards summing to the unsharded layer (logits and precomputed routing,
with and without biases, every weight format, several world sizes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tokenspeed_kernel as tk
from tokenspeed_kernel.ops.moe.api import request_for
from tokenspeed_kernel.ops.moe.parallel import (
    expert_parallel_bounds,
    tensor_parallel_bounds,
)
from tokenspeed_kernel.selector import explain
from tokenspeed_kernel.testing import assert_close
from tokenspeed_kernel.testing.inputs import MoEShape, generator, moe_inputs, moe_weights
from tokenspeed_kernel.testing.registration import temporary_kernel

BASE = dict(num_experts=8, top_k=2, hidden_size=64, intermediate_size=96)


@pytest.mark.parametrize(
    "over,exc,match",
    [
        (dict(expert_offset=-1), ValueError, "expert_offset is -1, expected an int >= 0"),
        (dict(num_local_experts=0), ValueError, "num_local_experts is 0, expected a positive"),
        (dict(expert_offset=6, num_local_experts=3), ValueError,
         r"expert_offset \+ num_local_experts is 6 \+ 3, expected at most num_experts \(8\)"),
        (dict(expert_offset=8), ValueError, r"8 \+ 8, expected at most num_experts"),
        (dict(expert_offset=1.0), ValueError, "expert_offset is 1.0, expected an int"),
        (dict(num_local_experts=True), ValueError, "num_local_experts is True"),
        (dict(top_k=9, num_local_experts=2), ValueError, "top_k is 9, expected at most"),
    ],
)  # fmt: skip
def test_config_rejects_bad_expert_ranges(over, exc, match):
    with pytest.raises(exc, match=match):
        tk.MoEConfig(**{**BASE, **over})


def test_config_defaults_to_all_experts_and_top_k_may_exceed_the_local_count():
    full = tk.MoEConfig(**BASE)
    assert full.num_local_experts == 8 and not full.expert_parallel
    assert full == tk.MoEConfig(**BASE, num_local_experts=8)
    ep = tk.MoEConfig(**{**BASE, "top_k": 4}, expert_offset=6, num_local_experts=2)
    assert ep.expert_parallel and ep.num_local_experts == 2
    plan = tk.moe_plan(ep, device="cpu")
    assert "experts 6..7 of 8" in str(plan)


def test_expert_parallel_is_a_trait_kernels_must_declare():
    """A kernel that does not declare "expert_parallel" is never selected for a rank's
    subset of experts (and still is for the whole layer)."""
    reference = tk.get_kernel("moe_apply", "reference.moe_apply")
    traits = {k: v for k, v in reference.traits.items() if k != "expert_parallel"}
    with temporary_kernel(
        "moe_apply", "test.moe_apply.no_ep", reference.fn, traits=traits, priority=50
    ):
        whole = tk.moe_plan(tk.MoEConfig(**BASE), device="cpu")
        assert whole.kernel == "test.moe_apply.no_ep"
        ep = tk.MoEConfig(**BASE, expert_offset=4, num_local_experts=4)
        plan = tk.moe_plan(ep, device="cpu")
        assert plan.kernel == "reference.moe_apply"
        cpu = tk.platform_of(torch.device("cpu"))
        verdicts = {c.name: c for c in explain("moe_apply", request_for(ep, 16), cpu).candidates}
        assert "expert_parallel" in verdicts["test.moe_apply.no_ep"].reason


def _layer(shape: MoEShape, seed: str = "parallel"):
    weights = moe_weights(shape, generator(seed, shape))
    x, routing = moe_inputs(shape, generator(seed, "inputs", shape))
    return shape.config(), weights, x, routing


def _apply(config, weights, x, routing):
    plan = tk.moe_plan(config, device="cpu", max_num_tokens=max(1, x.shape[0]))
    return tk.moe_apply(plan, x, tk.moe_prepare_weights(plan, weights), **routing)


def test_weights_hold_only_the_local_experts():
    config, weights, _, _ = _layer(MoEShape(3, **BASE, weight_format="bf16"))
    ep = dataclasses.replace(config, expert_offset=2, num_local_experts=3)
    plan = tk.moe_plan(ep, device="cpu")
    with pytest.raises(ValueError, match=r"weights.w13 has shape \[8, 192, 64\], expected \[3,"):
        tk.moe_prepare_weights(plan, weights)


def test_tensor_parallel_bounds_keep_whole_scale_groups():
    def sizes(i, n, fmt="mxfp4"):
        bounds = [
            tensor_parallel_bounds(i, rank=r, world_size=n, weight_format=fmt) for r in range(n)
        ]
        assert bounds[0][0] == 0 and bounds[-1][1] == i
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
        return [end - start for start, end in bounds]

    # GPT-OSS-120B's I = 2880: 720 and 360 are not multiples of 32 (vLLM's split).
    assert sizes(2880, 2) == [1440, 1440]
    assert sizes(2880, 4) == [736, 736, 736, 672]
    assert sizes(2880, 8) == [384] * 7 + [192]
    assert sizes(96, 3, "bf16") == [32, 32, 32]
    assert sizes(10, 4, "bf16") == [3, 3, 3, 1]
    with pytest.raises(ValueError, match="rank 3 of 4 holds no intermediate channels"):
        tensor_parallel_bounds(96, rank=3, world_size=4)
    with pytest.raises(ValueError, match="intermediate_size is 100, expected a multiple of 32"):
        tensor_parallel_bounds(100, rank=0, world_size=2)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(rank=2, world_size=2), ValueError, r"rank is 2, expected an int in \[0, 2\)"),
        (dict(rank=-1, world_size=2), ValueError, "rank is -1"),
        (dict(rank=0, world_size=0), ValueError, "world_size is 0, expected an int >= 1"),
        (dict(rank=0, world_size=2.0), TypeError, "world_size is float, expected an int"),
        (dict(rank=True, world_size=2), TypeError, "rank is bool, expected an int"),
    ],
)
def test_shard_rank_errors(kwargs, exc, match):
    config, weights, _, _ = _layer(MoEShape(1, **BASE))
    for shard in (tk.tensor_parallel_shard, tk.expert_parallel_shard):
        with pytest.raises(exc, match=match):
            shard(config, weights, **kwargs)


def test_shard_input_errors():
    config, weights, _, _ = _layer(MoEShape(1, **BASE))
    with pytest.raises(TypeError, match="tensor_parallel_shard: config is dict"):
        tk.tensor_parallel_shard(BASE, weights, rank=0, world_size=2)
    with pytest.raises(TypeError, match="expert_parallel_shard: weights is tuple"):
        tk.expert_parallel_shard(config, (weights.w13,), rank=0, world_size=2)
    bad = dataclasses.replace(weights, w2=weights.w2[:, :, :16])
    with pytest.raises(ValueError, match=r"tensor_parallel_shard: weights.w2 has shape"):
        tk.tensor_parallel_shard(config, bad, rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"world_size is 9, expected at most num_experts \(8\)"):
        tk.expert_parallel_shard(config, weights, rank=0, world_size=9)
    ep, ep_weights = tk.expert_parallel_shard(config, weights, rank=1, world_size=2)
    with pytest.raises(ValueError, match="config holds experts 4..7 of 8, expected all"):
        tk.expert_parallel_shard(ep, ep_weights, rank=0, world_size=2)


def test_expert_parallel_bounds_follow_linear_placement():
    assert [expert_parallel_bounds(128, rank=r, world_size=8) for r in (0, 7)] == [
        (0, 16),
        (112, 16),
    ]
    assert [expert_parallel_bounds(10, rank=r, world_size=4) for r in range(4)] == [
        (0, 3),
        (3, 3),
        (6, 2),
        (8, 2),
    ]


def test_tensor_parallel_shard_layout():
    """Channels [start, end) of every expert: w13 rows 2c, 2c + 1 (gate, up), w2 columns
    (MXFP4: packed bytes and scale groups), w2_bias on rank 0 only; the caller's tensors are
    not modified."""
    config, weights, _, _ = _layer(MoEShape(1, 4, 2, 64, 128))
    before = weights.w13.clone()
    shard_config, shard = tk.tensor_parallel_shard(config, weights, rank=1, world_size=2)
    assert shard_config == dataclasses.replace(config, intermediate_size=64)
    assert torch.equal(shard.w13, weights.w13[:, 128:256])
    assert torch.equal(shard.w13_scale, weights.w13_scale[:, 128:256])
    assert torch.equal(shard.w2, weights.w2[:, :, 32:64])
    assert torch.equal(shard.w2_scale, weights.w2_scale[:, :, 2:4])
    assert torch.equal(shard.w13_bias, weights.w13_bias[:, 128:256])
    assert torch.count_nonzero(shard.w2_bias) == 0
    _, first = tk.tensor_parallel_shard(config, weights, rank=0, world_size=2)
    assert torch.equal(first.w2_bias, weights.w2_bias)
    assert torch.equal(weights.w13, before)


SHARD_SHAPES = [
    pytest.param(MoEShape(9, 8, 2, 64, 96), id="mxfp4-bias-logits"),
    pytest.param(MoEShape(6, 8, 4, 64, 160, has_bias=False, routing="precomputed"),
                 id="mxfp4-nobias-precomputed"),
    pytest.param(MoEShape(7, 6, 3, 64, 96, bias_dtype=torch.bfloat16, routing="ties"),
                 id="mxfp4-bf16bias-ties-E6"),
    pytest.param(MoEShape(5, 8, 2, 64, 48, weight_format="fp8"), id="fp8-bias"),
    pytest.param(MoEShape(5, 8, 2, 64, 64, weight_format="fp8", activation_format="fp8",
                          static_scales=True, routing="precomputed"), id="fp8-fp8static"),
    pytest.param(MoEShape(4, 4, 2, 32, 40, weight_format="bf16"), id="bf16-odd-I"),
]  # fmt: skip


def _sum(outputs):
    return torch.stack([o.float() for o in outputs]).sum(0)


@pytest.mark.parametrize("shape", SHARD_SHAPES)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_reference_tensor_parallel_shards_sum_to_the_layer(shape, world_size):
    config, weights, x, routing = _layer(shape)
    unit = 32 if shape.weight_format == "mxfp4" else 1
    if -(-shape.intermediate_size // unit // world_size) * unit * (world_size - 1) >= (
        shape.intermediate_size
    ):
        pytest.skip(f"I = {shape.intermediate_size} fills fewer than {world_size} ranks")
    expected = _apply(config, weights, x, routing)
    outputs = []
    for rank in range(world_size):
        shard_config, shard = tk.tensor_parallel_shard(
            config, weights, rank=rank, world_size=world_size
        )
        outputs.append(_apply(shard_config, shard, x, routing))
    dtype = torch.float8_e4m3fn if shape.activation_format == "fp8" else torch.bfloat16
    assert_close(_sum(outputs), expected.float(), dtype=dtype, name=f"TP {world_size}")


@pytest.mark.parametrize("shape", SHARD_SHAPES)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_reference_expert_parallel_shards_sum_to_the_layer(shape, world_size):
    config, weights, x, routing = _layer(shape)
    expected = _apply(config, weights, x, routing)
    outputs = []
    for rank in range(world_size):
        shard_config, shard = tk.expert_parallel_shard(
            config, weights, rank=rank, world_size=world_size
        )
        outputs.append(_apply(shard_config, shard, x, routing))
    # Each pair is computed on exactly one rank, as in the whole layer: only the per-rank
    # bf16 rounding of the output differs.
    assert_close(_sum(outputs), expected.float(), dtype=torch.bfloat16, name=f"EP {world_size}")


def test_pairs_of_other_ranks_contribute_nothing():
    """A token routed only to other ranks' experts gets exact zeros (no bias either); ids
    outside [0, E) in precomputed routing still raise in the reference (the oracle)."""
    shape = MoEShape(3, 8, 2, 64, 64, routing="precomputed")
    config, weights, x, _ = _layer(shape)
    shard_config, shard = tk.expert_parallel_shard(config, weights, rank=1, world_size=2)
    ids = torch.tensor([[0, 1], [4, 2], [7, 6]], dtype=torch.int32)
    topk_weights = torch.full((3, 2), 0.5)
    out = _apply(shard_config, shard, x, dict(topk_weights=topk_weights, topk_ids=ids))
    assert torch.count_nonzero(out[0]) == 0
    assert torch.count_nonzero(out[1]) > 0 and torch.count_nonzero(out[2]) > 0
    full = _apply(config, weights, x, dict(topk_weights=topk_weights, topk_ids=ids))
    assert torch.equal(out[2], full[2])  # both of its experts are local
    bad = torch.tensor([[0, 8], [4, 2], [7, 6]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"topk_ids\[0, 1\] is 8, expected an expert id in \[0, 8"):
        _apply(shard_config, shard, x, dict(topk_weights=topk_weights, topk_ids=bad))


def test_tensor_and_expert_parallel_compose():
    """TP 2 x EP 2: each of 4 ranks holds half the channels of half the experts."""
    config, weights, x, routing = _layer(MoEShape(7, 8, 2, 64, 64))
    expected = _apply(config, weights, x, routing)
    outputs = []
    for ep_rank in range(2):
        ep_config, ep_weights = tk.expert_parallel_shard(
            config, weights, rank=ep_rank, world_size=2
        )
        for tp_rank in range(2):
            c, w = tk.tensor_parallel_shard(ep_config, ep_weights, rank=tp_rank, world_size=2)
            assert (c.expert_offset, c.num_local_experts, c.intermediate_size) == (
                4 * ep_rank,
                4,
                32,
            )
            outputs.append(_apply(c, w, x, routing))
    assert_close(_sum(outputs), expected.float(), dtype=torch.bfloat16, name="TP2 x EP2")
