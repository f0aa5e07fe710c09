"""`moe_apply` through TensorRT-LLM's trtllm-gen FP4 block-scale fused MoE on Blackwell, as
FlashInfer ports it (`flashinfer.fused_moe.trtllm_fp4_block_scale_routed_moe`), MXFP4 weights
x bf16 activations, kernels prebuilt for sm_100.

Not run here: no Blackwell GPU is lent. Registered for sm_100/sm_103, its weight preparation
and call mapping tested on the CPU against a recording stand-in of FlashInfer; its GPU
conformance test skips on Hopper.

Layout (fused_moe/core.py docstrings, 0.6.14 and 0.7.2.post1, and vLLM's test of it,
tests/kernels/moe/test_mxfp4_moe.py `tg_mxfp4_moe`): gemm1 rows "[w3; w1]" (up first, then
gate), then `reorder_rows_for_gated_act_gemm` per expert (interleaves the two halves for the
fused gated activation), then `shuffle_matrix_a` / `shuffle_matrix_sf_a` with epilogue tile
128 on weights, e8m0 scales (viewed as float8_e4m3fn storage) and float32 biases alike;
gemm2 shuffled the same way. H and I padded to multiples of 256 (vLLM pads GPT-OSS's 2880 to
3072 for this kernel). Routing is ours (core top-k softmax, ties to the lower expert), passed
as (ids int32, weights bf16) [M, k] with routing method TopK (weights used as given):
routing weights round to bf16 (the kernel's weight dtype).

Priority 90, below the Triton MoE kernels (100/110) until measured on a B200.
"""

from __future__ import annotations

import torch

from tokenspeed_kernel.ops.moe.types import PreparedMoEWeights
from tokenspeed_kernel.registry import Support

from ._common import flashinfer, library_verdict, register_flashinfer
from ._moe import (
    UNIT_SCALE,
    pad_last2,
    padded_input,
    round_up,
    routing,
    split_gate_up,
    swiglu_tensors,
)

KERNEL_NAME = "flashinfer.moe_apply.trtllm_fp4"
PRIORITY = 90
PAD_MULTIPLE = 256
EPILOGUE_TILE_M = 128
# flashinfer RoutingMethodType.TopK (tllm_enums.py): top-k of the given scores, no softmax.
ROUTING_TOPK = 5
WEIGHT_LAYOUT = (
    "flashinfer trtllm-gen fp4: gemm1 rows up then gate, reordered for the gated activation, "
    "weights/e8m0 scales/float32 biases shuffled for epilogue tile 128; H, I padded to 256"
)


def _shuffle_experts(fi, weights, scales, bias, *, gated: bool):
    """Per expert: (reorder for the gated GEMM1 if `gated`), then the trtllm-gen shuffles."""
    out_w, out_s, out_b = [], [], []
    for e in range(weights.shape[0]):
        w, s = weights[e], scales[e]
        b = None if bias is None else bias[e].reshape(-1, 1)
        if gated:
            w = fi.reorder_rows_for_gated_act_gemm(w.clone())
            s = fi.reorder_rows_for_gated_act_gemm(s.clone())
            b = None if b is None else fi.reorder_rows_for_gated_act_gemm(b.clone())
        out_w.append(fi.shuffle_matrix_a(w.contiguous(), EPILOGUE_TILE_M))
        out_s.append(fi.shuffle_matrix_sf_a(s.contiguous(), EPILOGUE_TILE_M))
        if b is not None:
            out_b.append(fi.shuffle_matrix_a(b.contiguous(), EPILOGUE_TILE_M))
    stacked_b = torch.stack(out_b).reshape(weights.shape[0], -1) if out_b else None
    scales_fp8 = torch.stack(out_s).reshape(scales.shape).view(torch.float8_e4m3fn)
    return torch.stack(out_w), scales_fp8, stacked_b


class FlashInferTrtllmFp4MoE:
    """The registered "moe_apply" object (core `MoEKernel` protocol)."""

    name = KERNEL_NAME
    weight_layout = WEIGHT_LAYOUT

    def padded_sizes(self, config) -> tuple[int, int]:
        return (
            round_up(config.hidden_size, PAD_MULTIPLE),
            round_up(config.intermediate_size, PAD_MULTIPLE),
        )

    def prepare_weights(self, plan, weights) -> PreparedMoEWeights:
        fi = flashinfer()
        config = plan.config
        Hp, Ip = plan.padded_hidden_size, plan.padded_intermediate_size
        gate, up = split_gate_up(weights.w13)
        gate_s, up_s = split_gate_up(weights.w13_scale)
        w13 = torch.cat([pad_last2(up, Ip, Hp // 2), pad_last2(gate, Ip, Hp // 2)], dim=1)
        s13 = torch.cat([pad_last2(s, Ip, Hp // 32, UNIT_SCALE) for s in (up_s, gate_s)], 1)
        w2 = pad_last2(weights.w2, Hp, Ip // 2)
        s2 = pad_last2(weights.w2_scale, Hp, Ip // 32, UNIT_SCALE)
        b13 = b2 = None
        if config.has_bias:
            gate_b, up_b = split_gate_up(weights.w13_bias.float().unsqueeze(-1))
            b13 = torch.cat([pad_last2(up_b, Ip, 1), pad_last2(gate_b, Ip, 1)], 1).squeeze(-1)
            b2 = pad_last2(weights.w2_bias.float().unsqueeze(-1), Hp, 1).squeeze(-1)
        g1 = _shuffle_experts(fi, w13, s13, b13, gated=True)
        g2 = _shuffle_experts(fi, w2, s2, b2, gated=False)
        tensors = dict(gemm1=g1, gemm2=g2, swiglu=swiglu_tensors(config, weights.w13.device))
        return PreparedMoEWeights(KERNEL_NAME, config, tensors)

    def apply(self, plan, x, prepared, *, router_logits, topk_weights, topk_ids, out) -> None:
        if x.shape[0] == 0:
            return
        config, t = plan.config, prepared.tensors
        weights, ids = routing(config, router_logits, topk_weights, topk_ids)
        Hp, Ip = plan.padded_hidden_size, plan.padded_intermediate_size
        padded = Hp != x.shape[1]
        target = torch.empty(x.shape[0], Hp, dtype=x.dtype, device=x.device) if padded else out
        (w1, s1, b1), (w2, s2, b2) = t["gemm1"], t["gemm2"]
        alpha, beta, limit = t["swiglu"]
        flashinfer().fused_moe.trtllm_fp4_block_scale_routed_moe(
            topk_ids=(ids, weights.to(torch.bfloat16)),
            routing_bias=None,
            hidden_states=padded_input(x, Hp),
            hidden_states_scale=None,
            gemm1_weights=w1,
            gemm1_weights_scale=s1,
            gemm1_bias=b1,
            gemm1_alpha=alpha,
            gemm1_beta=beta,
            gemm1_clamp_limit=limit,
            gemm2_weights=w2,
            gemm2_weights_scale=s2,
            gemm2_bias=b2,
            output1_scale_scalar=None,
            output1_scale_gate_scalar=None,
            output2_scale_scalar=None,
            num_experts=config.num_experts,
            top_k=config.top_k,
            n_group=None,
            topk_group=None,
            intermediate_size=Ip,
            local_expert_offset=0,
            local_num_experts=config.num_experts,
            routed_scaling_factor=None,
            routing_method_type=ROUTING_TOPK,
            do_finalize=True,
            output=target,
            tune_max_num_tokens=plan.max_num_tokens,
        )
        if padded:
            out.copy_(target[:, : x.shape[1]])


def supports(request, platform) -> Support:
    return library_verdict()


def register() -> None:
    register_flashinfer(
        "moe_apply", KERNEL_NAME, FlashInferTrtllmFp4MoE(), platforms=("nvidia:sm_100,sm_103",),
        traits={"weight_format": {"mxfp4"}, "activation_format": {"bf16"},
                "routing": {"topk_softmax"}, "bias": True},
        priority=PRIORITY, supports=supports,
        text="TensorRT-LLM trtllm-gen FP4 block-scale fused MoE via FlashInfer, MXFP4 x bf16; "
        "untested on hardware here",
    )  # fmt: skip
