"""Selection request for the MoE op (built once per `moe_plan`)."""

from __future__ import annotations

from typing import NamedTuple

from ...registry import declare_op

# Kernels register under the op a runtime calls per step; moe_plan selects among them.
# The feature names `MoERequest.features()` yields: what kernels may declare as traits.
# "expert_parallel": the layer holds a range of the experts (MoEConfig.num_local_experts <
# num_experts); ids stay global, pairs routed to other ranks' experts contribute nothing.
MOE_FEATURES = ("weight_format", "activation_format", "routing", "bias", "expert_parallel")
MOE_APPLY = declare_op(
    "moe_apply", summary="mixture of experts (plan, prepare weights, apply)", traits=MOE_FEATURES
)


class MoERequest(NamedTuple):
    weight_format: str
    activation_format: str
    has_bias: bool
    routing: str
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    max_num_tokens: int
    expert_offset: int = 0
    num_local_experts: int | None = None  # None: all num_experts

    @property
    def expert_parallel(self) -> bool:
        local = self.num_local_experts
        return local is not None and local != self.num_experts

    def features(self) -> tuple[tuple[str, object], ...]:
        features: list[tuple[str, object]] = [
            ("weight_format", self.weight_format),
            ("activation_format", self.activation_format),
            ("routing", self.routing),
        ]
        if self.has_bias:
            features.append(("bias", True))
        if self.expert_parallel:
            features.append(("expert_parallel", True))
        return tuple(features)

    def __str__(self) -> str:
        experts = f"E {self.num_experts}"
        if self.expert_parallel:
            last = self.expert_offset + self.num_local_experts - 1
            experts += f" (local {self.expert_offset}..{last})"
        return (
            f"{experts} top-{self.top_k}, H {self.hidden_size}, "
            f"I {self.intermediate_size}, {self.weight_format} weights, "
            f"{self.activation_format} activations{', bias' if self.has_bias else ''}, "
            f"up to {self.max_num_tokens} tokens"
        )
