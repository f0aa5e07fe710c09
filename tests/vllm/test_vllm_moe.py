"""The GPT-OSS MXFP4 MoE method inside vLLM's own RoutedExperts layer, one per rank: vLLM's
FusedMoEConfig and expert map, our create_weights, vLLM's expert weight loader fed the slices
GPT-OSS's loader cuts for each rank, then process_weights_after_loading and apply_monolithic.
The ranks' outputs summed (vLLM's all-reduce) must match the core reference on the whole layer,
at tensor-parallel shards (uneven and padded ones included) and expert-parallel ranges."""

from __future__ import annotations

import contextlib

import pytest

pytest.importorskip("vllm", reason="needs vLLM 0.26: run bash scripts/test_vllm_plugin.sh")

import torch  # noqa: E402
from vllm.model_executor.layers.fused_moe import FusedMoEConfig, RoutedExperts  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402
from vllm.model_executor.layers.fused_moe.config import (  # noqa: E402
    FusedMoEParallelConfig,
    RoutingMethodType,
)
from vllm.model_executor.layers.fused_moe.expert_map_manager import (  # noqa: E402
    ExpertMapManager,
)

import tokenspeed_kernel as tk  # noqa: E402
from tokenspeed_kernel_vllm.moe import (  # noqa: E402
    TokenspeedGptOssMxfp4Config,
    TokenspeedGptOssMxfp4MoEMethod,
    unsupported_reason,
)

REFERENCE = "reference.moe_apply"
OCP_MX_BLOCK = 32


def parallel_config(*, tp=1, tp_rank=0, ep=1, ep_rank=0) -> FusedMoEParallelConfig:
    return FusedMoEParallelConfig(
        tp_size=tp, pcp_size=1, dp_size=1, ep_size=ep, tp_rank=tp_rank, pcp_rank=0, dp_rank=0,
        ep_rank=ep_rank, sp_size=1, use_ep=ep > 1, all2all_backend="allgather_reducescatter",
        enable_eplb=False,
    )  # fmt: skip


def fused_moe_config(par, *, num_experts, top_k, hidden, intermediate, device="cpu",
                     **overrides):  # fmt: skip
    """The FusedMoEConfig vLLM's FusedMoE builds for GPT-OSS's MLPBlock on this rank."""
    args = dict(
        num_experts=num_experts, experts_per_token=top_k, hidden_dim=hidden,
        intermediate_size=intermediate,
        num_local_experts=num_experts // par.ep_size, num_logical_experts=num_experts,
        activation=MoEActivation.SWIGLUOAI, device=device,
        routing_method=RoutingMethodType.RenormalizeNaive, moe_parallel_config=par,
        in_dtype=torch.bfloat16, has_bias=True,
    )  # fmt: skip
    args.update(overrides)
    return FusedMoEConfig(**args)


def checkpoint(num_experts, hidden, intermediate, generator):
    """GPT-OSS checkpoint tensors as the loader sees them (w13 rows interleave gate and up)."""
    E, H, I = num_experts, hidden, intermediate  # noqa: E741

    def scales(*shape):  # e8m0 2^-9 .. 2^-5: activations of order 1
        return torch.randint(118, 123, shape, generator=generator, dtype=torch.uint8)

    def nibbles(*shape):
        return torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8)

    def bias(*shape):
        return (torch.randn(*shape, generator=generator) * 0.1).to(torch.bfloat16)

    return {
        "w13_weight": nibbles(E, 2 * I, H // 2),
        "w13_weight_scale": scales(E, 2 * I, H // OCP_MX_BLOCK),
        "w2_weight": nibbles(E, H, I // 2),
        "w2_weight_scale": scales(E, H, I // OCP_MX_BLOCK),
        "w13_bias": bias(E, 2 * I),
        "w2_bias": bias(E, H),
    }


def gpt_oss_slices(ckpt, *, intermediate, tp, tp_rank, ep, ep_rank):
    """What vLLM's GptOssModel._load_weights_mxfp4 hands each parameter on this rank: it needs
    a distributed model to run, so its slicing rule is restated here (EP: a block of whole
    experts; TP: ceil(I / 32 / tp) * 32 channels per rank, w2_bias on TP rank 0 only)."""
    if ep > 1:
        per = ckpt["w13_weight"].shape[0] // ep
        return {name: t[ep_rank * per : (ep_rank + 1) * per] for name, t in ckpt.items()}
    per_rank = -(-intermediate // OCP_MX_BLOCK // tp) * OCP_MX_BLOCK
    start = tp_rank * per_rank
    end = min(start + per_rank, intermediate)
    return {
        "w13_weight": ckpt["w13_weight"][:, 2 * start : 2 * end],
        "w13_weight_scale": ckpt["w13_weight_scale"][:, 2 * start : 2 * end],
        "w2_weight": ckpt["w2_weight"][..., start // 2 : end // 2],
        "w2_weight_scale": ckpt["w2_weight_scale"][
            ..., start // OCP_MX_BLOCK : end // OCP_MX_BLOCK
        ],
        "w13_bias": ckpt["w13_bias"][:, 2 * start : 2 * end],
        "w2_bias": ckpt["w2_bias"] if tp_rank == 0 else torch.zeros_like(ckpt["w2_bias"]),
    }


def rank_layer(ckpt, *, num_experts, top_k, hidden, intermediate, tp=1, tp_rank=0, ep=1,
               ep_rank=0, device="cpu"):  # fmt: skip
    """vLLM's RoutedExperts for one rank with our quant config, loaded and processed."""
    par = parallel_config(tp=tp, tp_rank=tp_rank, ep=ep, ep_rank=ep_rank)
    moe = fused_moe_config(
        par, num_experts=num_experts, top_k=top_k, hidden=hidden, intermediate=intermediate,
        device=device,
    )  # fmt: skip
    experts = ExpertMapManager(
        max_num_batched_tokens=64, top_k=top_k, global_num_experts=num_experts,
        num_redundant_experts=0, num_expert_group=None, moe_parallel_config=par,
        placement_strategy="linear", enable_eplb=False,
    )  # fmt: skip
    with torch.device(device):  # vLLM builds the model under its device
        layer = RoutedExperts(
            "model.layers.0.mlp.experts", torch.bfloat16, moe, TokenspeedGptOssMxfp4Config(),
            experts,
        )  # fmt: skip
    assert isinstance(layer.quant_method, TokenspeedGptOssMxfp4MoEMethod)
    slices = gpt_oss_slices(
        ckpt, intermediate=intermediate, tp=tp, tp_rank=tp_rank, ep=ep, ep_rank=ep_rank
    )
    params = dict(layer.named_parameters())
    for name, tensor in slices.items():
        # vLLM's own weight loader (its gpt_oss_mxfp4 branch copies into [:, :rows, :cols]).
        layer.weight_loader(params[name], tensor, weight_name=name, shard_id=None, expert_id=None)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def whole_layer_reference(ckpt, x, logits, *, num_experts, top_k, hidden, intermediate):
    """The core reference kernel on the whole (unsharded) layer, on x's device."""
    config = tk.MoEConfig(num_experts, top_k, hidden, intermediate)
    w = {name: t.to(x.device) for name, t in ckpt.items()}
    with tk.use_kernel("moe_apply", REFERENCE):
        plan = tk.moe_plan(config, device=x.device, max_num_tokens=x.shape[0])
        weights = tk.MoEWeights(
            w13=w["w13_weight"], w13_scale=w["w13_weight_scale"], w2=w["w2_weight"],
            w2_scale=w["w2_weight_scale"], w13_bias=w["w13_bias"], w2_bias=w["w2_bias"],
        )  # fmt: skip
        return tk.moe_apply(plan, x, tk.moe_prepare_weights(plan, weights), logits).float()


def run_ranks(shape, *, tp=1, ep=1, num_tokens=9, seed=0, device="cpu", kernel=REFERENCE):
    """(sum of the ranks' outputs, whole-layer reference, the ranks' layers). `kernel`: the
    MoE kernel the ranks are forced to (None: the selector's choice)."""
    generator = torch.Generator().manual_seed(seed)
    ckpt = checkpoint(shape["num_experts"], shape["hidden"], shape["intermediate"], generator)
    x = torch.randn(num_tokens, shape["hidden"], generator=generator).to(torch.bfloat16)
    logits = torch.randn(num_tokens, shape["num_experts"], generator=generator)
    x, logits = x.to(device), logits.to(torch.bfloat16).to(device)
    total = torch.zeros(num_tokens, shape["hidden"], device=device)
    layers = []
    # On the CPU the Triton interpreter would take minutes: the reference serves there.
    forced = tk.use_kernel("moe_apply", kernel) if kernel else contextlib.nullcontext()
    with forced:
        for rank in range(max(tp, ep)):
            ranks = dict(tp=tp, tp_rank=rank if tp > 1 else 0, ep=ep, ep_rank=rank if ep > 1 else 0)
            layer = rank_layer(ckpt, **shape, **ranks, device=device)
            total += layer.quant_method.apply_monolithic(layer, x, logits).float()
            layers.append(layer)
    return total, whole_layer_reference(ckpt, x, logits, **shape), layers


def assert_close(actual, expected):
    # Each rank rounds its partial sum to bf16 before the all-reduce adds them.
    tol = 2e-2 * expected.abs().max().item()
    err = (actual - expected).abs()
    assert err.max() <= tol, (
        f"max error {err.max():.4g}, RMS {err.pow(2).mean().sqrt():.4g}, tol {tol:.4g}"
    )


SMALL = dict(num_experts=8, top_k=2, hidden=64, intermediate=320)


@pytest.mark.usefixtures("allow_reference", "vllm_config")
@pytest.mark.parametrize(
    ("tp", "shard_sizes", "buffer"),
    [(1, [320], 320), (2, [160, 160], 160), (4, [96, 96, 96, 32], 96)],
    ids=["tp1", "tp2", "tp4-uneven"],
)
def test_tensor_parallel_shards_sum_to_the_layer(tp, shard_sizes, buffer):
    total, expected, layers = run_ranks(SMALL, tp=tp)
    assert [layer.quant_method.plan.config.intermediate_size for layer in layers] == shard_sizes
    # vLLM's buffers hold the largest shard (I // tp = 80 rounded would be too small).
    assert layers[-1].intermediate_size_per_partition == buffer
    assert_close(total, expected)


@pytest.mark.usefixtures("allow_reference", "vllm_config")
def test_gpt_oss_120b_intermediate_at_tp8():
    """I = 2880 at TP 8: vLLM's loader gives 384 channels to ranks 0-6 and 192 to rank 7."""
    shape = dict(num_experts=4, top_k=2, hidden=64, intermediate=2880)
    total, expected, layers = run_ranks(shape, tp=8, num_tokens=5)
    sizes = [layer.quant_method.plan.config.intermediate_size for layer in layers]
    assert sizes == [384] * 7 + [192]
    assert_close(total, expected)


@pytest.mark.usefixtures("allow_reference", "vllm_config")
@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_ranks_sum_to_the_layer(ep):
    total, expected, layers = run_ranks(SMALL, ep=ep, seed=1)
    per = SMALL["num_experts"] // ep
    for rank, layer in enumerate(layers):
        config = layer.quant_method.plan.config
        assert (config.expert_offset, config.num_local_experts) == (rank * per, per)
        assert config.num_experts == SMALL["num_experts"] and config.intermediate_size == 320
    assert_close(total, expected)


@pytest.mark.usefixtures("allow_reference", "vllm_config")
def test_batches_beyond_the_plan_run_in_chunks():
    total, expected, layers = run_ranks(SMALL, num_tokens=9)
    method = layers[0].quant_method
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(150, SMALL["hidden"], generator=generator).to(torch.bfloat16)
    logits = torch.randn(150, SMALL["num_experts"], generator=generator).to(torch.bfloat16)
    # The same kernel and config with room for 64 tokens: 150 run as 64 + 64 + 22.
    with tk.use_kernel("moe_apply", REFERENCE):
        method.plan = tk.moe_plan(method.plan.config, device="cpu", max_num_tokens=64)
    whole = method.apply_monolithic(layers[0], x, logits)
    # Each chunk is a batch the plan takes whole; the same shapes give the same bits (other
    # splits change the GEMMs' M, and with it the CPU BLAS's summation order).
    parts = torch.cat([method.apply_monolithic(layers[0], x[i : i + 64], logits[i : i + 64])
                       for i in range(0, 150, 64)])  # fmt: skip
    assert torch.equal(whole, parts)


@pytest.mark.usefixtures("vllm_config")
def test_layers_stay_on_vllm_where_no_kernel_but_the_reference_serves(monkeypatch):
    monkeypatch.delenv("TOKENSPEED_KERNEL_VLLM_REFERENCE", raising=False)
    moe = fused_moe_config(parallel_config(), num_experts=8, top_k=2, hidden=64, intermediate=320)
    volta = tk.Platform("nvidia", "sm_70", 0, 80, "Tesla V100", 98304, 6 << 20, 98304)
    with tk.fake_platform(volta):
        reason = unsupported_reason(moe)
    assert reason.startswith("moe_apply: only the pure-torch reference kernel serves")
    with tk.fake_platform("h100"):
        assert unsupported_reason(moe) is None  # a Triton MoE kernel serves it


@pytest.mark.usefixtures("allow_reference", "vllm_config")
@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"activation": MoEActivation.SILU}, "activation silu is not supported"),
        ({"routing_method": RoutingMethodType.Sigmoid}, "routing Sigmoid is not supported"),
        ({"in_dtype": torch.float16}, "activations in torch.float16, not bfloat16"),
        ({"hidden_dim": 80}, "hidden_size is 80, expected a multiple of 32"),
    ],
)
def test_layers_vllm_keeps_and_why(overrides, reason):
    moe = fused_moe_config(
        parallel_config(), num_experts=8, top_k=2, hidden=64, intermediate=320, **overrides
    )
    assert reason in unsupported_reason(moe)


@pytest.mark.usefixtures("allow_reference", "vllm_config")
def test_non_linear_expert_placement_is_refused():
    with tk.use_kernel("moe_apply", REFERENCE):
        _, _, layers = run_ranks(SMALL, ep=2)
    layer = layers[0]
    layer._expert_map = torch.tensor([-1, 0, -1, 1, -1, 2, -1, 3], dtype=torch.int32)
    layer.local_num_experts = 4
    with pytest.raises(NotImplementedError, match="only linear expert placement"):
        layer.quant_method.local_experts(layer)


@pytest.mark.usefixtures("no_reference")
def test_vllm_keeps_its_own_method_where_only_the_reference_serves(
    gpt_oss_model_config, plugin_log
):
    """RoutedExperts built with our config on a GPU no kernel but the reference serves gets
    vLLM's own GptOssMxfp4MoEMethod, and one log line says why."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.mxfp4 import GptOssMxfp4MoEMethod

    config = VllmConfig(model_config=gpt_oss_model_config, device_config=DeviceConfig("cpu"))
    par = parallel_config()
    moe = fused_moe_config(par, num_experts=8, top_k=2, hidden=64, intermediate=320)
    experts = ExpertMapManager(
        max_num_batched_tokens=64, top_k=2, global_num_experts=8, num_redundant_experts=0,
        num_expert_group=None, moe_parallel_config=par, placement_strategy="linear",
        enable_eplb=False,
    )  # fmt: skip
    volta = tk.Platform("nvidia", "sm_70", 0, 80, "Tesla V100", 98304, 6 << 20, 98304)
    with set_current_vllm_config(config), tk.fake_platform(volta):
        layer = RoutedExperts(
            "model.layers.0.mlp.experts", torch.bfloat16, moe, TokenspeedGptOssMxfp4Config(),
            experts,
        )  # fmt: skip
    assert type(layer.quant_method) is GptOssMxfp4MoEMethod
    lines = [r.getMessage() for r in plugin_log]
    assert any(
        line.startswith("tokenspeed-kernel: vLLM's own MXFP4 MoE serves GPT-OSS here: moe_apply:")
        and "on sm_70" in line
        for line in lines
    ), lines
