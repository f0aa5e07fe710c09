"""tokenspeed-kernel: stable LLM-inference operators over a registry of kernels.

A runtime calls the operators below; a selector picks the best registered kernel for each
request on the tensors' own device. Pure-torch reference kernels make every op run anywhere.
"""

from . import plugins as _plugins  # noqa: F401  (installs the lazy plugin loader)
from .errors import Candidate, UnsupportedError
from .ops.attention import (
    AttentionRequest,
    KVStoreRequest,
    kvcache_store,
    mha_decode_with_kvcache,
    mha_extend_with_kvcache,
    mha_prefill,
)
from .ops.moe import (
    MoEConfig,
    MoEKernel,
    MoEPlan,
    MoERequest,
    MoEWeights,
    PreparedMoEWeights,
    SwiGLU,
    expert_parallel_shard,
    moe_apply,
    moe_plan,
    moe_prepare_weights,
    tensor_parallel_shard,
)
from .platform import KNOWN_PLATFORMS, Platform, PlatformSpec, fake_platform, platform_of
from .registry import (
    ANY,
    KernelSpec,
    Support,
    declare_op,
    get_kernel,
    kernels,
    op_names,
    register_kernel,
)
from .selector import Explanation, explain, use_kernel

__version__ = "0.1.0"

__all__ = [
    "ANY",
    "KNOWN_PLATFORMS",
    "AttentionRequest",
    "Candidate",
    "Explanation",
    "KVStoreRequest",
    "KernelSpec",
    "MoEConfig",
    "MoEKernel",
    "MoEPlan",
    "MoERequest",
    "MoEWeights",
    "Platform",
    "PlatformSpec",
    "PreparedMoEWeights",
    "Support",
    "SwiGLU",
    "UnsupportedError",
    "declare_op",
    "expert_parallel_shard",
    "explain",
    "fake_platform",
    "get_kernel",
    "kernels",
    "kvcache_store",
    "mha_decode_with_kvcache",
    "mha_extend_with_kvcache",
    "mha_prefill",
    "op_names",
    "moe_apply",
    "moe_plan",
    "moe_prepare_weights",
    "platform_of",
    "register_kernel",
    "tensor_parallel_shard",
    "use_kernel",
]
