"""Registers the AMD MoE kernel with tokenspeed_kernel (the only module here importing core)."""

from __future__ import annotations

from tokenspeed_kernel.ops.moe.types import PreparedMoEWeights
from tokenspeed_kernel.registry import register_kernel

from .mxfp4_moe import AmdMxfp4MoE

KERNEL_NAME = "amd.moe"

# Only what the tests exercise: MXFP4 weights, bf16 or fp8 activations (fp8 with static
# per-tensor scales, or dynamic per-token ones computed between launches), top-k softmax, bias.
TRAITS = {
    "weight_format": {"mxfp4"},
    "activation_format": {"bf16", "fp8"},
    "routing": {"topk_softmax"},
    "bias": True,
}


def _prepared(name, config, tensors):
    return PreparedMoEWeights(kernel=name, config=config, tensors=tensors)


def make_kernel(name: str = KERNEL_NAME) -> AmdMxfp4MoE:
    return AmdMxfp4MoE(name, make_prepared=_prepared)


def register_moe_kernels() -> None:
    register_kernel(
        "moe",
        name=KERNEL_NAME,
        backend="amd",
        platforms=["amd:gfx942,gfx950"],
        traits=TRAITS,
        priority=200,
        description=(
            "Gluon MXFP4 MoE: fused routing+GEMM1+SwiGLU+requant and split-K GEMM2 for M<=4, "
            "grouped GEMM above; gfx950 scaled MFMA for fp8 activations"
        ),
    )(make_kernel())
