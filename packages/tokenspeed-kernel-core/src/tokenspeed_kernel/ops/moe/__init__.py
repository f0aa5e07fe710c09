from . import reference  # noqa: F401  (registers the reference kernel)
from .api import moe_apply, moe_plan, moe_prepare_weights
from .parallel import (
    expert_parallel_bounds,
    expert_parallel_shard,
    tensor_parallel_bounds,
    tensor_parallel_shard,
)
from .request import MoERequest
from .types import MoEConfig, MoEKernel, MoEPlan, MoEWeights, PreparedMoEWeights, SwiGLU

__all__ = [
    "MoEConfig",
    "MoEKernel",
    "MoEPlan",
    "MoERequest",
    "MoEWeights",
    "PreparedMoEWeights",
    "SwiGLU",
    "expert_parallel_bounds",
    "expert_parallel_shard",
    "moe_apply",
    "moe_plan",
    "moe_prepare_weights",
    "tensor_parallel_bounds",
    "tensor_parallel_shard",
]
