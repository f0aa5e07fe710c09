"""The AMD MoE kernels' NVIDIA instantiation (same Gluon source, `mma_v2` + plain loads) against
the core reference on the shared conformance cases and GPT-OSS shapes. GPU machine only."""

import pytest
import torch

from tokenspeed_kernel.platform import PlatformSpec
from tokenspeed_kernel.registry import KernelSpec
from tokenspeed_kernel.testing import assert_conformance, conformance_cases
from tokenspeed_kernel.testing.cases import moe_case
from tokenspeed_kernel.testing.inputs import MoEShape
from tokenspeed_kernel_amd.moe.mxfp4_moe import KERNEL_NAME, TRAITS, AmdMxfp4MoE

pytestmark = pytest.mark.gpu

# The registered spec says gfx942/gfx950; this one differs only in the platform it accepts.
NVIDIA_SPEC = KernelSpec(
    "moe_apply",
    KERNEL_NAME,
    "amd",
    AmdMxfp4MoE(),
    (PlatformSpec.parse("nvidia:sm_80+"),),
    TRAITS,
    200,
)

G = dict(num_experts=128, top_k=4, hidden_size=2880, intermediate_size=2880)
EXTRA = [
    # Tiny path (M <= 4) and grouped path (M > 4) on both sides of the boundary, fp8 both ways.
    moe_case(
        "gpt-oss-fp8-static-m1", MoEShape(1, **G, activation_format="fp8", static_scales=True)
    ),
    moe_case(
        "gpt-oss-fp8-static-m4-precomputed",
        MoEShape(4, **G, activation_format="fp8", static_scales=True, routing="precomputed"),
    ),
    moe_case(
        "gpt-oss-fp8-static-m5", MoEShape(5, **G, activation_format="fp8", static_scales=True)
    ),
    moe_case("gpt-oss-fp8-dynamic-m64", MoEShape(64, **G, activation_format="fp8")),
    moe_case("gpt-oss-fp8-dynamic-m2", MoEShape(2, **G, activation_format="fp8")),
    moe_case("gpt-oss-bf16-m4-ties", MoEShape(4, **G, routing="ties")),
    moe_case("gpt-oss-bf16-m300", MoEShape(300, **G)),
]
CASES = conformance_cases("moe_apply", preset="gpt-oss-120b") + EXTRA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_nvidia_instantiation_conformance(case):
    assert_conformance(NVIDIA_SPEC, case, "cuda")
