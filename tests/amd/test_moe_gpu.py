"""The AMD MoE kernels' NVIDIA instantiation (same Gluon source, `mma_v2` + plain loads) against
the core reference on the shared conformance cases and GPT-OSS shapes. GPU machine only."""

import pytest
import torch

from tokenspeed_kernel.platform import PlatformSpec
from tokenspeed_kernel.registry import KernelSpec, get_kernel
from tokenspeed_kernel.testing import (
    assert_close,
    assert_conformance,
    conformance_cases,
    moe_plan_for,
)
from tokenspeed_kernel.testing.cases import moe_case
from tokenspeed_kernel.testing.inputs import MoEShape, generator, moe_weights
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


def _small_layer(shape: MoEShape):
    weights = moe_weights(shape, generator("amd-moe-safety", shape))
    weights = type(weights)(
        **{k: v.cuda() if torch.is_tensor(v) else v for k, v in vars(weights).items()}
    )
    plan = moe_plan_for(NVIDIA_SPEC, shape.config(), shape.num_tokens, "cuda")
    return weights, plan, NVIDIA_SPEC.fn.prepare_weights(plan, weights)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("tokens", [1, 4, 64])
def test_out_of_range_ids_contribute_nothing(tokens):
    """Tiny-batch (M <= 4) and grouped paths: a pair whose id is outside [0, E) adds nothing;
    the reference runs the valid pairs only (bad ones at expert 0 with weight 0)."""
    shape = MoEShape(tokens, 6, 4, 256, 256)
    weights, plan, prepared = _small_layer(shape)
    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(6, generator=g)[:4] for _ in range(tokens)]).int()
    bad = torch.rand(tokens, 4, generator=g) < 0.3
    bad[0, 1] = True
    choices = torch.tensor([-1, 6, 7, 1000, -(2**31)], dtype=torch.int32)
    ids[bad] = choices[torch.randint(0, 5, (int(bad.sum()),), generator=g)]
    topk_weights = (torch.rand(tokens, 4, generator=g) + 0.1).cuda()
    ids, bad = ids.cuda(), bad.cuda()
    x = torch.randn(tokens, 256, generator=g).to(torch.bfloat16).cuda()
    out = torch.full_like(x, float("nan"))
    NVIDIA_SPEC.fn.apply(
        plan, x, prepared, router_logits=None, topk_weights=topk_weights, topk_ids=ids, out=out
    )
    reference = get_kernel("moe_apply", "reference.moe_apply")
    ref_plan = moe_plan_for(reference, shape.config(), tokens, "cuda")
    ref_out = torch.empty_like(x)
    reference.fn.apply(
        ref_plan, x, reference.fn.prepare_weights(ref_plan, weights), router_logits=None,
        topk_weights=torch.where(bad, 0.0, topk_weights), topk_ids=torch.where(bad, 0, ids),
        out=ref_out,
    )  # fmt: skip
    assert_close(out, ref_out, dtype=torch.bfloat16, name="out")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_nan_logits_route_in_range_on_the_tiny_path():
    """The tiny path routes inside GEMM1: NaN ranks as +inf, so the ids stay in range; the
    token with the NaN gets NaN weights (the reference's outcome), the others finite rows."""
    shape = MoEShape(3, 8, 4, 256, 256)
    _, plan, prepared = _small_layer(shape)
    x = torch.randn(3, 256, device="cuda").to(torch.bfloat16)
    logits = torch.randn(3, 8, device="cuda")
    logits[1, 5] = float("nan")
    out = torch.empty_like(x)
    NVIDIA_SPEC.fn.apply(
        plan, x, prepared, router_logits=logits, topk_weights=None, topk_ids=None, out=out
    )
    torch.cuda.synchronize()
    assert torch.isnan(out[1]).all() and torch.isfinite(out[[0, 2]]).all()
