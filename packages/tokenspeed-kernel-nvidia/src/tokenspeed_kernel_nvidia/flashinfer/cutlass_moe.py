"""`moe_apply` through TensorRT-LLM's CUTLASS fused MoE as FlashInfer ports it
(`flashinfer.fused_moe.cutlass_fused_moe`), MXFP4 weights x bf16 activations (W4A16) on sm_90.

Layout expected (fused_moe/core.py `cutlass_fused_moe` with `use_w4_group_scaling=True`, and
vLLM's Hopper test of it, tests/kernels/moe/test_mxfp4_moe.py
`test_flashinfer_cutlass_mxfp4_fused_moe`): fc1 weights [E, 2I, H/2] uint8 with the up
projection's rows first, then the gate's ("[w3; w1]"); fc2 [E, H, I/2]; e8m0 scales of each
interleaved by groups of 4 along K: [E, N, K/32] -> [E, K/128, N * 4] (element (n, 4j + t)
moves to (j, 4n + t)), hence H and I padded to multiples of 128 (2880 -> 2944, +2.2% bytes);
the 4-bit codes themselves reordered for the mixed-input GEMM's lookup-table conversion by
FlashInfer's own `interleave_moe_weights_for_sm90_mixed_gemm(w, "fp4")` (a kernel of the same
module; without it every output is wrong for K > 128); bf16 biases in the same row order;
routing as top-k ids int32 and weights float32 [M, k]; SwiGLU
`min(gate, limit) * sigmoid(alpha * ...) * (clamp(up, +-limit) + beta)` with beta 1, per-expert
float32 alpha/beta/limit. Biases are rounded to bf16 (the kernel's bias dtype).

Numerics: the library rounds inside more coarsely than the contract's bf16 tolerance allows:
on an H100 and an H200 up to 3.3% of a conformance case's outputs fall outside it, by at most
0.0625 against the float32 reference (tests/nvidia/test_flashinfer_moe_gpu.py holds it to twice
that). Selection by measurement never picks it where a Triton MoE kernel is installed (slower at
every GPT-OSS batch); it serves where none is (core + this package alone).

First use: FlashInfer JIT-compiles its module (182 nvcc units for sm_90a, over 19 minutes on a
16-core H100 host); `python -m tokenspeed_kernel_nvidia.flashinfer.prebuild` builds it once
ahead of time on any machine with nvcc, and the first call then loads it (1.3-1.9 s on an
H100 or H200). Priority 40, below both Triton MoE kernels (100, 110): autotuned, it takes
1.35-3.16x the time of `triton.moe_apply.sm90` at every GPT-OSS batch on both GPUs
(`benchmarks/results/kernels_h100.md`, `kernels_h200.md`).
"""

from __future__ import annotations

import contextlib

import torch

from tokenspeed_kernel.ops.moe.types import PreparedMoEWeights
from tokenspeed_kernel.registry import Support

from .._attention import workspace
from ._common import accepts, flashinfer, library_verdict, register_flashinfer
from ._moe import (
    UNIT_SCALE,
    pad_last2,
    padded_input,
    round_up,
    routing,
    split_gate_up,
    swiglu_tensors,
)

KERNEL_NAME = "flashinfer.moe_apply.cutlass"
PRIORITY = 40
PAD_MULTIPLE = 128
WEIGHT_LAYOUT = (
    "flashinfer cutlass W4A16: fc1 [E, 2Ip, Hp/2] rows up then gate, fc2 [E, Hp, Ip/2], codes "
    "interleaved for the sm90 mixed-input GEMM, e8m0 scales interleaved by 4 along K "
    "([E, K/128, N*4]), bf16 biases"
)


def interleave_scales(scales: torch.Tensor) -> torch.Tensor:
    """e8m0 [E, N, K/32] -> [E, K/128, N * 4]: groups of 4 consecutive K-blocks of a row kept
    together, rows of a group placed side by side (the Hopper mixed-input GEMM's order)."""
    E, N, blocks = scales.shape
    grouped = scales.reshape(E, N, blocks // 4, 4).permute(0, 2, 1, 3)
    return grouped.reshape(E, blocks // 4, N * 4).contiguous()


class FlashInferCutlassMoE:
    """The registered "moe_apply" object (core `MoEKernel` protocol)."""

    name = KERNEL_NAME
    weight_layout = WEIGHT_LAYOUT

    def padded_sizes(self, config) -> tuple[int, int]:
        return (
            round_up(config.hidden_size, PAD_MULTIPLE),
            round_up(config.intermediate_size, PAD_MULTIPLE),
        )

    def prepare_weights(self, plan, weights) -> PreparedMoEWeights:
        config = plan.config
        Hp, Ip = plan.padded_hidden_size, plan.padded_intermediate_size
        gate, up = split_gate_up(weights.w13)
        gate_s, up_s = split_gate_up(weights.w13_scale)
        fc1 = torch.cat([pad_last2(up, Ip, Hp // 2), pad_last2(gate, Ip, Hp // 2)], dim=1)
        fc1_scale = torch.cat(
            [pad_last2(s, Ip, Hp // 32, UNIT_SCALE) for s in (up_s, gate_s)], dim=1
        )
        interleave = flashinfer().fused_moe.interleave_moe_weights_for_sm90_mixed_gemm
        tensors = dict(
            fc1=interleave(fc1.contiguous(), "fp4"),
            fc2=interleave(pad_last2(weights.w2, Hp, Ip // 2).contiguous(), "fp4"),
            fc1_scale=interleave_scales(fc1_scale),
            fc2_scale=interleave_scales(pad_last2(weights.w2_scale, Hp, Ip // 32, UNIT_SCALE)),
            fc1_bias=None,
            fc2_bias=None,
        )
        if config.has_bias:
            gate_b, up_b = split_gate_up(weights.w13_bias.unsqueeze(-1))
            bias = torch.cat([pad_last2(up_b, Ip, 1), pad_last2(gate_b, Ip, 1)], dim=1)
            tensors["fc1_bias"] = bias.squeeze(-1).to(torch.bfloat16).contiguous()
            fc2_bias = pad_last2(weights.w2_bias.unsqueeze(-1), Hp, 1).squeeze(-1)
            tensors["fc2_bias"] = fc2_bias.to(torch.bfloat16).contiguous()
        tensors["swiglu"] = swiglu_tensors(config, weights.w13.device)
        return PreparedMoEWeights(KERNEL_NAME, config, tensors)

    def apply(self, plan, x, prepared, *, router_logits, topk_weights, topk_ids, out) -> None:
        if x.shape[0] == 0:
            return
        t = prepared.tensors
        weights, ids = routing(plan.config, router_logits, topk_weights, topk_ids)
        Hp = plan.padded_hidden_size
        padded = Hp != x.shape[1]
        target = torch.empty(x.shape[0], Hp, dtype=x.dtype, device=x.device) if padded else out
        alpha, beta, limit = t["swiglu"]
        library = flashinfer()
        fused_moe = library.fused_moe
        with _first_call_tuning(library, plan, x.device):
            fused_moe.cutlass_fused_moe(
                input=padded_input(x, Hp),
                token_selected_experts=ids,
                token_final_scales=weights,
                fc1_expert_weights=t["fc1"],
                fc2_expert_weights=t["fc2"],
                output_dtype=torch.bfloat16,
                quant_scales=[t["fc1_scale"], t["fc2_scale"]],
                fc1_expert_biases=t["fc1_bias"],
                fc2_expert_biases=t["fc2_bias"],
                swiglu_alpha=alpha,
                swiglu_beta=beta,
                swiglu_limit=limit,
                output=target,
                use_w4_group_scaling=True,
                tune_max_num_tokens=plan.max_num_tokens,
                **_workspace_kwargs(fused_moe, plan, x.device),
            )
        if padded:
            out.copy_(target[:, : x.shape[1]])


_tuned_plans: set[tuple] = set()


def _plan_key(plan) -> tuple:
    config = plan.config
    return (plan.padded_hidden_size, plan.padded_intermediate_size, config.num_experts,
            config.top_k, plan.max_num_tokens)  # fmt: skip


def _first_call_tuning(library, plan, device):
    """The first call of each layer shape (outside a CUDA-graph capture) runs under FlashInfer's
    autotuner, which times the CUTLASS tactics for every token bucket up to the plan's
    `max_num_tokens` (`tune_max_num_tokens`) and keeps the fastest per bucket for the process,
    as vLLM's warm-up does; without it every batch runs the library's default tactic."""
    key = (_plan_key(plan), device)
    if key in _tuned_plans:
        return contextlib.nullcontext()
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return contextlib.nullcontext()
    _tuned_plans.add(key)
    return library.autotune(True)


_workspace_bytes: dict[tuple, int] = {}


def _workspace_kwargs(fused_moe, plan, device) -> dict:
    """0.7.x takes a caller-owned scratch buffer (`workspace_buffer`, sized by
    `cutlass_fused_moe_workspace_size` for the plan's max tokens) instead of allocating it on
    every call: one buffer per device and layer shape, shared by every layer of that shape
    (they run one after another on one stream). 0.6.14 allocates it itself."""
    if not accepts(fused_moe.cutlass_fused_moe, "workspace_buffer"):
        return {}
    config = plan.config
    key = _plan_key(plan)
    nbytes = _workspace_bytes.get((key, device))
    if nbytes is None:
        nbytes = _workspace_bytes[(key, device)] = fused_moe.cutlass_fused_moe_workspace_size(
            plan.max_num_tokens, key[0], key[1], config.num_experts, config.top_k,
            x_dtype=torch.bfloat16, weight_dtype=torch.uint8, use_w4_group_scaling=True,
            device=device,
        )  # fmt: skip
    return {"workspace_buffer": workspace(f"flashinfer.cutlass_moe{key}", device, nbytes)}


def supports(request, platform) -> Support:
    return library_verdict()


def register() -> None:
    register_flashinfer(
        "moe_apply", KERNEL_NAME, FlashInferCutlassMoE(), platforms=("nvidia:sm_90",),
        traits={"weight_format": {"mxfp4"}, "activation_format": {"bf16"},
                "routing": {"topk_softmax"}, "bias": True},
        priority=PRIORITY, supports=supports,
        text="TensorRT-LLM CUTLASS fused MoE via FlashInfer, MXFP4 x bf16 (W4A16); up to 3% of "
        "outputs outside the bf16 tolerance (library rounding); prebuild its module (JIT > 19 min)",
    )  # fmt: skip
