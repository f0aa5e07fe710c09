"""MoE configuration, weights and plan types.

`MoEWeights` holds checkpoint-layout tensors (never mutated); a kernel's `prepare_weights`
turns them into `PreparedMoEWeights` laid out for that kernel.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ...validation import INT32_MAX

WEIGHT_FORMATS = ("mxfp4", "fp8", "bf16")
ACTIVATION_FORMATS = ("bf16", "fp8")
ROUTINGS = ("topk_softmax",)


@dataclass(frozen=True)
class SwiGLU:
    """GPT-OSS clamped SwiGLU: g = min(gate, limit), u = clamp(up, -limit, limit),
    a = g * sigmoid(alpha * g) * (u + 1). alpha finite > 0; limit >= 0, inf for no clamp."""

    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        # Stored as plain floats: kernels pass them as fp32 launch arguments.
        alpha = _real("alpha", self.alpha)
        if not 0.0 < alpha < math.inf:
            raise ValueError(f"SwiGLU: alpha is {alpha}, expected a finite float > 0")
        limit = _real("limit", self.limit)
        if not 0.0 <= limit <= math.inf:  # +inf: no clamp
            raise ValueError(f"SwiGLU: limit is {limit}, expected a float >= 0 (inf: no clamp)")
        object.__setattr__(self, "alpha", alpha)
        object.__setattr__(self, "limit", limit)


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"SwiGLU: {name} is {type(value).__name__}, expected a float")
    return float(value)


@dataclass(frozen=True)
class MoEConfig:
    """Static description of one MoE layer (or one rank's shard of it).

    num_experts E, top_k, hidden_size H, intermediate_size I (per expert, before gating).

    Expert parallelism: this rank holds `num_local_experts` experts (None: all E), global
    experts expert_offset .. expert_offset + num_local_experts - 1; its weights' leading dim
    is that local count, local expert j being global expert expert_offset + j. E stays the
    global count: router logits are [M, E] and topk ids are global. A token's top-k pairs
    whose expert lives on another rank contribute nothing here; the ranks' outputs sum to the
    whole layer. Tensor parallelism needs no field: a shard is a layer whose I is the shard's
    (`parallel.tensor_parallel_shard`). After construction num_local_experts is an int.
    """

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    weight_format: str = "mxfp4"
    activation_format: str = "bf16"
    activation: SwiGLU = field(default_factory=SwiGLU)
    has_bias: bool = True
    routing: str = "topk_softmax"
    expert_offset: int = 0
    num_local_experts: int | None = None

    def __post_init__(self) -> None:
        if self.num_local_experts is None:
            object.__setattr__(self, "num_local_experts", self.num_experts)
        for name in ("num_experts", "top_k", "hidden_size", "intermediate_size"):
            _set_int(self, name, minimum=1)
        _set_int(self, "expert_offset", minimum=0)
        _set_int(self, "num_local_experts", minimum=1)
        if self.top_k > self.num_experts:
            raise ValueError(
                f"MoEConfig: top_k is {self.top_k}, expected at most num_experts "
                f"({self.num_experts})"
            )
        if self.expert_offset + self.num_local_experts > self.num_experts:
            raise ValueError(
                f"MoEConfig: expert_offset + num_local_experts is {self.expert_offset} + "
                f"{self.num_local_experts}, expected at most num_experts ({self.num_experts}): "
                "local experts are a range of the global ones"
            )
        _check_choice("weight_format", self.weight_format, WEIGHT_FORMATS)
        _check_choice("activation_format", self.activation_format, ACTIVATION_FORMATS)
        _check_choice("routing", self.routing, ROUTINGS)
        if not isinstance(self.activation, SwiGLU):
            raise TypeError(
                f"MoEConfig: activation is {type(self.activation).__name__}, expected SwiGLU"
            )
        if not isinstance(self.has_bias, bool):
            raise TypeError(f"MoEConfig: has_bias is {self.has_bias!r}, expected True or False")
        if self.weight_format == "mxfp4":
            for name in ("hidden_size", "intermediate_size"):
                if getattr(self, name) % 32:
                    raise ValueError(
                        f"MoEConfig: {name} is {getattr(self, name)}, expected a multiple of "
                        "32 for mxfp4 weights (one e8m0 scale per 32 elements)"
                    )

    @property
    def expert_parallel(self) -> bool:
        """Whether this rank holds only some of the experts."""
        return self.num_local_experts != self.num_experts


def _set_int(config: MoEConfig, name: str, *, minimum: int) -> None:
    value = getattr(config, name)
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        expected = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"MoEConfig: {name} is {value!r}, expected {expected}")
    # Kernels take the sizes as 32-bit arguments.
    if value > INT32_MAX:
        raise ValueError(f"MoEConfig: {name} is {value!r}, expected an int <= {INT32_MAX}")
    object.__setattr__(config, name, int(value))  # numpy ints too, stored plain


def _check_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"MoEConfig: {name} is {value!r}, expected one of {', '.join(allowed)}")


@dataclass(frozen=True, eq=False)
class MoEWeights:
    """Checkpoint-layout expert weights (see the contract for each format's layout). E here is
    the layer's num_local_experts (all experts unless expert-parallel).

    mxfp4: w13 [E, 2I, H/2] uint8 (low nibble = even element), w13_scale [E, 2I, H/32] uint8
    e8m0; w2 [E, H, I/2], w2_scale [E, H, I/32]. fp8: w13 [E, 2I, H] float8_e4m3fn with
    w13_scale [E, 2I] float32; w2 [E, H, I], w2_scale [E, H]. bf16: w13 [E, 2I, H],
    w2 [E, H, I]. Rows of w13 interleave gate (even) and up (odd).
    Biases: w13_bias [E, 2I], w2_bias [E, H]. FP8 activations: optional static per-tensor
    input scales w13_input_scale / w2_input_scale (absent = dynamic per-token).
    """

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    w13_input_scale: float | None = None
    w2_input_scale: float | None = None


@dataclass(frozen=True)
class MoEPlan:
    """The kernel chosen for one MoE layer, fixed before serving starts."""

    config: MoEConfig
    kernel: str
    reason: str
    weight_layout: str
    padded_hidden_size: int
    padded_intermediate_size: int
    max_num_tokens: int
    device: torch.device
    # The selected kernel's implementation, resolved once so moe_apply skips the registry.
    impl: Any = field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        pad = ""
        if (self.padded_hidden_size, self.padded_intermediate_size) != (
            self.config.hidden_size,
            self.config.intermediate_size,
        ):
            pad = (
                f", padded H {self.config.hidden_size}->{self.padded_hidden_size}"
                f" I {self.config.intermediate_size}->{self.padded_intermediate_size}"
            )
        config = self.config
        if config.expert_parallel:
            last = config.expert_offset + config.num_local_experts - 1
            pad += f"; experts {config.expert_offset}..{last} of {config.num_experts}"
        return (
            f"MoEPlan({self.kernel}: {self.reason}; layout {self.weight_layout}{pad}; "
            f"max_num_tokens {self.max_num_tokens}; device {self.device})"
        )


@dataclass(frozen=True, eq=False)
class PreparedMoEWeights:
    """Weights laid out for one kernel. `tensors` is kernel-private."""

    kernel: str
    config: MoEConfig
    tensors: dict[str, Any]


class MoEKernel(Protocol):
    """What a kernel registered for "moe_apply" implements. `moe_plan` selects one object;
    `moe_prepare_weights` and `moe_apply` call it directly (no second dispatch)."""

    weight_layout: str

    def padded_sizes(self, config: MoEConfig) -> tuple[int, int]:
        """(H, I) as the kernel stores them (padding never leaks to callers)."""
        ...

    def prepare_weights(self, plan: MoEPlan, weights: MoEWeights) -> PreparedMoEWeights:
        """New tensors laid out for this kernel; `weights` is never mutated."""
        ...

    def apply(
        self,
        plan: MoEPlan,
        x: torch.Tensor,
        prepared: PreparedMoEWeights,
        *,
        router_logits: torch.Tensor | None,
        topk_weights: torch.Tensor | None,
        topk_ids: torch.Tensor | None,
        out: torch.Tensor,
    ) -> None:
        """Write out [M, H]; inputs are validated and exactly one routing input is given."""
        ...
