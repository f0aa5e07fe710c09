"""Pure-torch MoE reference: the numerics oracle and the fallback that runs anywhere.

Weights are dequantized once to float32 and every GEMM accumulates in float32. FP8 activations are
emulated (quantize, then dequantize) at the points where the kernels quantize, so the reference
carries the same activation rounding as the kernels it checks.
"""

from __future__ import annotations

import torch

from tokenspeed_kernel.formats.fp8 import dequantize_fp8, quantize_fp8
from tokenspeed_kernel.formats.mxfp4 import dequantize_mxfp4
from tokenspeed_kernel.ops import index_checks
from tokenspeed_kernel.ops.moe.request import MOE_APPLY
from tokenspeed_kernel.ops.moe.types import (
    ACTIVATION_FORMATS,
    ROUTINGS,
    WEIGHT_FORMATS,
    MoEConfig,
    MoEPlan,
    MoEWeights,
    PreparedMoEWeights,
)
from tokenspeed_kernel.registry import register_kernel

KERNEL_NAME = "reference.moe_apply"


def topk_softmax(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing: router_logits [M, E] -> (topk_weights [M, k] float32, topk_ids [M, k] int32).

    Ties go to the lower expert index; the weights are a softmax over the k selected logits.
    """
    logits = router_logits.float()
    # torch.topk leaves the order of equal values unspecified (and it differs between CPU and
    # CUDA); a stable descending sort keeps equal logits in index order, so the lower index wins.
    values, ids = torch.sort(logits, dim=-1, descending=True, stable=True)
    values, ids = values[:, :top_k], ids[:, :top_k]
    return torch.softmax(values, dim=-1), ids.to(torch.int32)


def _dequantize_one(
    weight_format: str, w: torch.Tensor, scale: torch.Tensor | None, name: str
) -> torch.Tensor:
    if weight_format == "mxfp4":
        if scale is None:
            raise ValueError(f"ReferenceMoE: {name}_scale is None, expected e8m0 scales for mxfp4")
        return dequantize_mxfp4(w, scale, dtype=torch.float32)
    if weight_format == "fp8":
        if scale is None:
            raise ValueError(f"ReferenceMoE: {name}_scale is None, expected fp8 channel scales")
        # One float32 scale per output row: [E, N] scales a [E, N, K] weight along K.
        return w.to(torch.float32) * scale.to(torch.float32).unsqueeze(-1)
    return w.to(torch.float32)


def dequantize_expert_weights(
    config: MoEConfig, weights: MoEWeights
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint weights -> (w13 float32 [E, 2I, H], w2 float32 [E, H, I])."""
    fmt = config.weight_format
    w13 = _dequantize_one(fmt, weights.w13, weights.w13_scale, "w13")
    w2 = _dequantize_one(fmt, weights.w2, weights.w2_scale, "w2")
    e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
    for name, got, want in (("w13", w13, (e, 2 * i, h)), ("w2", w2, (e, h, i))):
        if tuple(got.shape) != want:
            raise ValueError(
                f"ReferenceMoE: {name} dequantizes to shape {tuple(got.shape)}, expected {want}"
            )
    return w13, w2


def _fake_quant_fp8(x: torch.Tensor, static_scale: float | None) -> torch.Tensor:
    """x [N, K] float32 -> x rounded through float8_e4m3fn, as the FP8-activation kernels see it.

    Static per-tensor scale when the checkpoint has one, else dynamic per-token (amax / 448).
    """
    if static_scale is not None:
        q, scale = quantize_fp8(x, granularity="tensor", scale=static_scale)
        return dequantize_fp8(q, scale, granularity="tensor", dtype=torch.float32)
    q, scale = quantize_fp8(x, granularity="token")
    return dequantize_fp8(q, scale, granularity="token", dtype=torch.float32)


def _float32_copy(t: torch.Tensor | None) -> torch.Tensor | None:
    # A copy, so the prepared weights never alias (and can never write to) the caller's tensors.
    return None if t is None else t.detach().to(torch.float32, copy=True)


class ReferenceMoE:
    """Dequantize-then-float32 MoE; slow, exact to float32 accumulation, runs on any device."""

    name = KERNEL_NAME
    weight_layout = "checkpoint"

    def padded_sizes(self, config: MoEConfig) -> tuple[int, int]:
        return config.hidden_size, config.intermediate_size

    def prepare_weights(self, plan: MoEPlan, weights: MoEWeights) -> PreparedMoEWeights:
        config = plan.config
        w13, w2 = dequantize_expert_weights(config, weights)
        tensors = {
            "w13": w13,
            "w2": w2,
            "w13_bias": _float32_copy(weights.w13_bias) if config.has_bias else None,
            "w2_bias": _float32_copy(weights.w2_bias) if config.has_bias else None,
            "w13_input_scale": weights.w13_input_scale,
            "w2_input_scale": weights.w2_input_scale,
        }
        return PreparedMoEWeights(kernel=KERNEL_NAME, config=config, tensors=tensors)

    def apply(
        self,
        plan: MoEPlan,
        x: torch.Tensor,
        prepared: PreparedMoEWeights,
        *,
        router_logits: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        topk_ids: torch.Tensor | None = None,
        out: torch.Tensor,
    ) -> None:
        """x [M, H] -> out [M, H] (written in place, x's dtype).

        Routing: router_logits [M, E], or precomputed topk_weights [M, k] float32 with
        topk_ids [M, k] int32 (the API validated that exactly one form is given). Ids are
        global; pairs whose expert is outside this layer's local range contribute nothing.
        """
        config = plan.config
        t = prepared.tensors
        fp8_act = config.activation_format == "fp8"
        alpha, limit = config.activation.alpha, config.activation.limit
        if router_logits is not None:
            topk_weights, topk_ids = topk_softmax(router_logits, config.top_k)
        else:
            index_checks.check_moe_apply(topk_ids, config.num_experts)
        M, k = topk_ids.shape

        xf = x.to(torch.float32)
        if fp8_act:
            # x is quantized once per token before GEMM1, independent of the expert.
            xf = _fake_quant_fp8(xf, t["w13_input_scale"])

        # Group the M*k (token, expert) pairs by local expert so each expert runs one dense
        # GEMM; pairs of other ranks' experts go to one more group past the local ones, skipped.
        local = config.num_local_experts
        flat_ids = topk_ids.reshape(-1).to(torch.int64) - config.expert_offset
        flat_ids = torch.where((flat_ids >= 0) & (flat_ids < local), flat_ids, local)
        flat_tokens = torch.arange(M, device=x.device).repeat_interleave(k)
        flat_weights = topk_weights.reshape(-1).to(torch.float32)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=local + 1)[:local].tolist()

        acc = torch.zeros(M, config.hidden_size, dtype=torch.float32, device=x.device)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            sel = order[start : start + n]
            start += n
            tokens = flat_tokens[sel]
            h = xf[tokens] @ t["w13"][e].T
            if t["w13_bias"] is not None:
                h = h + t["w13_bias"][e]
            g = h[:, 0::2].clamp(max=limit)
            u = h[:, 1::2].clamp(-limit, limit)
            a = g * torch.sigmoid(alpha * g) * (u + 1)
            if fp8_act:
                a = _fake_quant_fp8(a, t["w2_input_scale"])
            y = a @ t["w2"][e].T
            if t["w2_bias"] is not None:
                y = y + t["w2_bias"][e]
            acc.index_add_(0, tokens, y * flat_weights[sel].unsqueeze(-1))
        out.copy_(acc)


# Lowest priority: the oracle and the fallback that makes MoE run on any device.
register_kernel(
    MOE_APPLY,
    name=KERNEL_NAME,
    backend="reference",
    platforms=["*"],
    traits={
        "weight_format": WEIGHT_FORMATS,
        "activation_format": ACTIVATION_FORMATS,
        "routing": ROUTINGS,
        "bias": True,
        "expert_parallel": True,
    },
    priority=0,
    description="pure torch, float32 accumulation",
)(ReferenceMoE())
