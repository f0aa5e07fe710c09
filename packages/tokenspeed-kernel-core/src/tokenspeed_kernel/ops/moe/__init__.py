from . import reference  # noqa: F401  (registers the reference kernel)
from .api import moe_apply, moe_plan, moe_prepare_weights
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
    "moe_apply",
    "moe_plan",
    "moe_prepare_weights",
]
