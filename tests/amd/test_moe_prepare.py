"""CPU checks of the AMD MoE host side: registration and traits on faked gfx942/gfx950, weight
preparation against tokenspeed_kernel.formats.mxfp4, routing and grouping helpers, and the
pinned grouped config reaching the launch."""

from __future__ import annotations

import pytest
import torch

from tokenspeed_kernel.formats.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from tokenspeed_kernel.ops.moe import MoEConfig, MoEWeights, moe_plan, moe_prepare_weights
from tokenspeed_kernel.ops.moe.api import request_for
from tokenspeed_kernel.ops.moe.reference import topk_softmax as reference_topk
from tokenspeed_kernel.platform import KNOWN_PLATFORMS, fake_platform
from tokenspeed_kernel.registry import get_kernel
from tokenspeed_kernel.selector import select
from tokenspeed_kernel.tuning import pin_config
from tokenspeed_kernel_amd.moe._common import DROPPED_BLOCK, group_by_expert, topk_softmax
from tokenspeed_kernel_amd.moe.mxfp4_moe import (
    GROUPED_PIN,
    GroupedConfig,
    grouped_config,
    run_grouped,
    tiny_config,
)


def _weights(config: MoEConfig, seed: int = 0) -> MoEWeights:
    g = torch.Generator().manual_seed(seed)
    E, H, I = config.num_experts, config.hidden_size, config.intermediate_size  # noqa: E741
    w13, s13 = quantize_mxfp4(torch.randn(E, 2 * I, H, generator=g))
    w2, s2 = quantize_mxfp4(torch.randn(E, H, I, generator=g))
    return MoEWeights(
        w13=w13, w2=w2, w13_scale=s13, w2_scale=s2,
        w13_bias=torch.randn(E, 2 * I, generator=g), w2_bias=torch.randn(E, H, generator=g),
    )  # fmt: skip


@pytest.mark.parametrize("platform", ["mi300x", "mi355x"])
@pytest.mark.parametrize("activation", ["bf16", "fp8"])
def test_selected_on_cdna_for_mxfp4(platform, activation):
    config = MoEConfig(128, 4, 2880, 2880, "mxfp4", activation)
    with fake_platform(platform) as p:
        assert select("moe_apply", request_for(config, 8192), p).name == "amd.moe_apply"
        plan = moe_plan(config, device="cpu")
    assert plan.kernel == "amd.moe_apply"
    assert (plan.padded_hidden_size, plan.padded_intermediate_size) == (2944, 2944)


@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
def test_declines_other_weight_formats(fmt):
    spec = get_kernel("moe_apply", "amd.moe_apply")
    with fake_platform("mi355x") as p:
        verdict = spec.supports(request_for(MoEConfig(8, 2, 128, 128, fmt), 64), p)
    assert not verdict.ok and "weight_format" in verdict.reason


@pytest.mark.parametrize("platform", ["h100", "cpu"])
def test_declines_other_platforms(platform):
    spec = get_kernel("moe_apply", "amd.moe_apply")
    with fake_platform(platform) as p:
        verdict = spec.supports(request_for(MoEConfig(8, 2, 128, 128), 64), p)
    assert not verdict.ok and "gfx942" in verdict.reason


def test_traits_are_only_what_is_tested():
    spec = get_kernel("moe_apply", "amd.moe_apply")
    assert spec.priority == 200 and spec.backend == "amd"
    assert dict(spec.traits) == {
        "weight_format": frozenset({"mxfp4"}),
        "activation_format": frozenset({"bf16", "fp8"}),
        "routing": frozenset({"topk_softmax"}),
        "bias": True,
        "expert_parallel": True,
    }


def test_prepare_weights_matches_core_format_and_leaves_inputs_alone():
    config = MoEConfig(3, 2, 160, 96, "mxfp4", "fp8")
    w = _weights(config)
    w = MoEWeights(**{**w.__dict__, "w13_input_scale": 0.01, "w2_input_scale": 0.05})
    before = {k: v.clone() for k, v in w.__dict__.items() if isinstance(v, torch.Tensor)}
    with fake_platform("mi355x"):
        plan = moe_plan(config, device="cpu")
    t = moe_prepare_weights(plan, w).tensors
    for name, value in before.items():
        assert torch.equal(getattr(w, name), value), f"{name} was modified"
        assert all(getattr(w, name).data_ptr() != p.data_ptr() for p in t.values()
                   if isinstance(p, torch.Tensor)), f"{name} is aliased"  # fmt: skip
    E, H, I = 3, 160, 96  # noqa: E741
    h_pad, i_pad = 256, 128
    assert t["w13"].shape == (E, 2, i_pad, h_pad // 2) and t["w2"].shape == (E, h_pad, i_pad // 2)
    planes = dequantize_mxfp4(t["w13"], t["w13_scale"])
    want = dequantize_mxfp4(w.w13, w.w13_scale)
    assert torch.equal(planes[:, 0, :I, :H], want[:, 0::2])  # gate = even rows
    assert torch.equal(planes[:, 1, :I, :H], want[:, 1::2])  # up = odd rows
    assert not planes[:, :, I:].any() and not planes[..., H:].any()
    w2 = dequantize_mxfp4(t["w2"], t["w2_scale"])
    assert torch.equal(w2[:, :H, :I], dequantize_mxfp4(w.w2, w.w2_scale))
    assert not w2[:, H:].any() and not w2[..., I:].any()
    assert torch.equal(t["w13_bias"][:, 0, :I], w.w13_bias[:, 0::2])
    assert torch.equal(t["w13_bias"][:, 1, :I], w.w13_bias[:, 1::2])
    assert torch.equal(t["w2_bias"][:, :H], w.w2_bias) and not t["w2_bias"][:, H:].any()
    # Static scales as float32, exactly as the reference's quantize_fp8 rounds them.
    assert torch.equal(t["x_scale"], torch.tensor([0.01], dtype=torch.float32))
    assert torch.equal(t["a_scale"], torch.tensor([0.05], dtype=torch.float32))


def test_routing_matches_reference_including_ties():
    g = torch.Generator().manual_seed(1)
    logits = torch.randint(0, 3, (33, 16), generator=g).float()
    got_w, got_ids = topk_softmax(logits, 4)
    want_w, want_ids = reference_topk(logits, 4)
    assert torch.equal(got_ids, want_ids) and torch.equal(got_w, want_w)


@pytest.mark.parametrize("block_m", [16, 64])
def test_group_by_expert_covers_every_pair_once(block_m):
    g = torch.Generator().manual_seed(2)
    ids = torch.stack([torch.randperm(12, generator=g)[:3] for _ in range(37)]).int()
    rows, block_expert = group_by_expert(ids, 12, block_m)
    assert rows.numel() == block_expert.numel() * block_m
    pairs = rows[rows >= 0].long()
    assert torch.equal(pairs.sort().values, torch.arange(37 * 3))
    for b, e in enumerate(block_expert.tolist()):
        chunk = rows[b * block_m : (b + 1) * block_m]
        chunk = chunk[chunk >= 0].long()
        if e < 0:
            assert chunk.numel() == 0
        else:
            assert chunk.numel() > 0 and (ids.reshape(-1)[chunk] == e).all()


@pytest.mark.parametrize("block_m", [16, 64])
def test_group_by_expert_puts_out_of_range_ids_in_dropped_blocks(block_m):
    """Ids outside [0, E) (-1, E, far past it) never reach an expert's block: they sit in
    DROPPED_BLOCK blocks (GEMM2 writes zero rows for them), every valid pair once elsewhere."""
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(12, generator=g)[:3] for _ in range(37)]).int()
    bad = torch.rand(37, 3, generator=g) < 0.3
    choices = torch.tensor([-1, 12, 13, 1000, -(2**31)], dtype=torch.int32)
    ids[bad] = choices[torch.randint(0, 5, (int(bad.sum()),), generator=g)]
    rows, block_expert = group_by_expert(ids, 12, block_m)
    flat = ids.reshape(-1)
    seen = {"kept": [], "dropped": []}
    for b, e in enumerate(block_expert.tolist()):
        chunk = rows[b * block_m : (b + 1) * block_m]
        chunk = chunk[chunk >= 0].long()
        if e == DROPPED_BLOCK:
            seen["dropped"] += chunk.tolist()
        elif e < 0:
            assert chunk.numel() == 0
        else:
            assert 0 <= e < 12 and chunk.numel() > 0 and (flat[chunk] == e).all()
            seen["kept"] += chunk.tolist()
    assert sorted(seen["kept"]) == torch.nonzero(~bad.reshape(-1)).reshape(-1).tolist()
    assert sorted(seen["dropped"]) == torch.nonzero(bad.reshape(-1)).reshape(-1).tolist()


def test_topk_softmax_keeps_ids_in_range_with_nan_logits():
    logits = torch.randn(4, 6)
    logits[0, 2] = float("nan")
    logits[1, :] = float("nan")
    weights, ids = topk_softmax(logits, 3)
    assert ids.min() >= 0 and ids.max() < 6
    assert ids[0, 0] == 2 and torch.isnan(weights[:2]).all()


def test_configs_follow_rows_per_expert_and_cu_count():
    assert grouped_config(4 * 128, 128).block_m == 16
    assert grouped_config(4 * 4096, 128).block_m == 64
    cus = KNOWN_PLATFORMS["mi300x"].sm_count
    assert tiny_config(4, 2944, 2944, cus).split > tiny_config(16, 2944, 2944, cus).split


def test_pinned_grouped_config_reaches_the_launch(monkeypatch):
    """`tuning.pin_config(GROUPED_PIN, ...)` replaces the table's choice; the launches are
    intercepted (Gluon kernels do not run on the CPU)."""
    from tokenspeed_kernel_amd.moe import mxfp4_moe

    launched = {}

    class Capture:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.setdefault(self.name, kwargs)

    monkeypatch.setattr(mxfp4_moe, "moe_gemm1_kernel", Capture("gemm1"))
    monkeypatch.setattr(mxfp4_moe, "moe_gemm2_kernel", Capture("gemm2"))
    config = MoEConfig(4, 2, 128, 128, "mxfp4", "bf16")
    with fake_platform("mi300x"):
        plan = moe_plan(config, device="cpu")
    t = moe_prepare_weights(plan, _weights(config)).tensors
    ids = torch.tensor([[0, 1]] * 8, dtype=torch.int32)
    weights = torch.full((8, 2), 0.5)
    x, out = torch.randn(8, 128).bfloat16(), torch.empty(8, 128, dtype=torch.bfloat16)
    with pin_config(GROUPED_PIN, GroupedConfig(32, 64, 4)):
        run_grouped("gfx942", config, t, x, weights, ids, out)
    assert launched["gemm1"]["BLOCK_M"] == launched["gemm2"]["BLOCK_M"] == 32
    launched.clear()
    run_grouped("gfx942", config, t, x, weights, ids, out)
    assert launched["gemm1"]["BLOCK_M"] == grouped_config(16, 4).block_m


@pytest.mark.parametrize("m", [2, 9])
def test_expert_parallel_routes_globally_and_hands_local_ids_to_both_paths(monkeypatch, m):
    """A rank holding experts 3..5 of 8: routing over all 8 logits, then ids 3..5 become 0..2
    and every other id -1 (which both paths skip) before the tiny (M <= 4) or grouped path;
    the weights are prepared for the 3 local experts. Launches are intercepted."""
    from tokenspeed_kernel_amd.moe import mxfp4_moe

    seen = {}

    def capture(name):
        def run(*args):
            seen[name] = args

        return run

    monkeypatch.setattr(mxfp4_moe, "run_tiny", capture("tiny"))
    monkeypatch.setattr(mxfp4_moe, "run_grouped", capture("grouped"))
    config = MoEConfig(8, 2, 128, 128, "mxfp4", "bf16", expert_offset=3, num_local_experts=3)
    with fake_platform("mi300x"):
        plan = moe_plan(config, device="cpu")
    assert plan.kernel == "amd.moe_apply"
    local_weights = _weights(MoEConfig(3, 2, 128, 128, "mxfp4", "bf16"))
    prepared = moe_prepare_weights(plan, local_weights)
    assert prepared.tensors["w13"].shape[0] == 3
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(m, 8, generator=g)
    x, out = torch.randn(m, 128).bfloat16(), torch.empty(m, 128, dtype=torch.bfloat16)
    with fake_platform("mi300x"):
        plan.impl.apply(plan, x, prepared, router_logits=logits, topk_weights=None,
                        topk_ids=None, out=out)  # fmt: skip
    want_w, want_ids = reference_topk(logits, 2)
    want_local = torch.where((want_ids >= 3) & (want_ids < 6), want_ids - 3, -1)
    if m <= 4:
        logits_arg, weights_arg, ids_arg = seen["tiny"][5], seen["tiny"][6], seen["tiny"][7]
        assert logits_arg is None
    else:
        weights_arg, ids_arg = seen["grouped"][4], seen["grouped"][5]
    assert torch.equal(ids_arg, want_local.int()) and torch.equal(weights_arg, want_w)
