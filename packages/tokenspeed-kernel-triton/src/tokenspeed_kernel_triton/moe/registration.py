"""Registers the Triton MoE kernel with core (imports core; the kernels do not)."""

from __future__ import annotations

import os

KERNEL_NAME = "triton.moe"
WEIGHT_LAYOUT = "triton-mx4words-padded"
WGMMA_KERNEL_NAME = "triton.moe.wgmma"
WGMMA_WEIGHT_LAYOUT = "triton-mx4fragment-padded"


class TritonMoE:
    """A registered "moe" kernel object: padded checkpoint layout, grouped GEMMs with
    in-kernel MXFP4/FP8 dequantization, bf16 or FP8 activations. word_order "fragment" is the
    Hopper variant (wgmma_gemm.py: MXFP4 words decoded into wgmma register fragments)."""

    def __init__(self, name: str, weight_layout: str, word_order: str) -> None:
        self.name = name
        self.weight_layout = weight_layout
        self.word_order = word_order

    def padded_sizes(self, config) -> tuple[int, int]:
        from .layout import padded_sizes

        return padded_sizes(config.hidden_size, config.intermediate_size)

    def prepare_weights(self, plan, weights):
        from tokenspeed_kernel.ops.moe.types import PreparedMoEWeights

        from .kernel import swiglu_fits_f16
        from .layout import prepare_weights

        config = plan.config
        tensors = prepare_weights(
            config.weight_format,
            config.hidden_size,
            config.intermediate_size,
            w13=weights.w13,
            w2=weights.w2,
            w13_scale=weights.w13_scale,
            w2_scale=weights.w2_scale,
            w13_bias=weights.w13_bias,
            w2_bias=weights.w2_bias,
            word_order=self.word_order,
            f16_intermediate=swiglu_fits_f16(config.activation.alpha, config.activation.limit),
        )
        tensors["w13_input_scale"] = _as_float(weights.w13_input_scale)
        tensors["w2_input_scale"] = _as_float(weights.w2_input_scale)
        return PreparedMoEWeights(kernel=self.name, config=config, tensors=tensors)

    def apply(
        self, plan, x, prepared, *, router_logits=None, topk_weights=None, topk_ids=None, out
    ) -> None:
        from .kernel import moe_forward

        config = plan.config
        t = prepared.tensors
        moe_forward(
            x,
            t,
            top_k=config.top_k,
            out=out,
            router_logits=router_logits,
            topk_weights=topk_weights,
            topk_ids=topk_ids,
            activation_format=config.activation_format,
            w13_input_scale=t["w13_input_scale"],
            w2_input_scale=t["w2_input_scale"],
            alpha=config.activation.alpha,
            limit=config.activation.limit,
        )


def _as_float(value) -> float | None:
    return None if value is None else float(value)


def _supports(request, platform):
    from tokenspeed_kernel.platform import arch_number
    from tokenspeed_kernel.registry import Support

    fp8 = "fp8" in (request.weight_format, request.activation_format)
    if fp8 and platform.vendor == "nvidia" and (arch_number(platform.arch) or 0) < 89:
        return Support.no(f"FP8 e4m3 conversion needs sm_89+, this is {platform.arch}")
    return Support.yes()


def _supports_wgmma(request, platform):
    from tokenspeed_kernel.registry import Support

    if request.hidden_size % 16:
        return Support.no(
            f"copies x rows in 16-byte cp.async vectors: hidden_size {request.hidden_size} is "
            "not a multiple of 16"
        )
    return Support.yes()


def register_moe_kernels() -> None:
    from tokenspeed_kernel.registry import register_kernel

    platforms = ["nvidia:sm_80+", "amd:gfx942,gfx950"]
    # The CPU runs these kernels only through the Triton interpreter (tests, debugging).
    if os.environ.get("TRITON_INTERPRET") == "1":
        platforms.append("cpu")
    register_kernel(
        "moe",
        name=KERNEL_NAME,
        backend="triton",
        platforms=platforms,
        traits={
            "weight_format": {"mxfp4", "fp8", "bf16"},
            "activation_format": {"bf16", "fp8"},
            "routing": {"topk_softmax"},
            "bias": True,
        },
        priority=100,
        supports=_supports,
        description="expert-sorted grouped GEMMs, in-kernel MXFP4/FP8 dequant, fused "
        "bias+SwiGLU, one-launch decode routing",
    )(TritonMoE(KERNEL_NAME, WEIGHT_LAYOUT, "natural"))
    # wgmma (sm_90a only: Blackwell has no wgmma) with the weights as the register operand.
    register_kernel(
        "moe",
        name=WGMMA_KERNEL_NAME,
        backend="triton",
        platforms=["nvidia:sm_90"],
        traits={
            "weight_format": {"mxfp4"},
            "activation_format": {"bf16"},
            "routing": {"topk_softmax"},
            "bias": True,
        },
        priority=110,
        supports=_supports_wgmma,
        description="Gluon wgmma grouped GEMMs, MXFP4 words decoded straight into register "
        "fragments (no shared-memory pass), fused bias+SwiGLU",
    )(TritonMoE(WGMMA_KERNEL_NAME, WGMMA_WEIGHT_LAYOUT, "fragment"))
