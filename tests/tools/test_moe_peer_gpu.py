"""The moe_apply peer (vLLM 0.26's triton_kernels path, tools/peers.py) computes the same
function as moe_apply on the same weights: at GPT-OSS-120B shapes both are checked against the
core reference at the bf16 tolerance, and against each other within the sum of those two
allowances. Needs an sm_90 GPU and triton_kernels importable (vLLM's vendored copy on
PYTHONPATH, e.g. PYTHONPATH=.old/peers)."""

from __future__ import annotations

import pytest
import torch

from tokenspeed_kernel import moe_apply, moe_plan, moe_prepare_weights
from tokenspeed_kernel.ops.moe.types import MoEConfig, MoEWeights
from tokenspeed_kernel.registry import get_kernel
from tokenspeed_kernel.testing import assert_close, moe_plan_for, tolerance

pytestmark = pytest.mark.gpu

GPT_OSS_120B = dict(num_experts=128, top_k=4, hidden_size=2880, intermediate_size=2880)


def _peer_class():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the peer reproduces vLLM's sm_90 path: needs an sm_90 GPU")
    pytest.importorskip("triton_kernels", reason="vLLM's triton_kernels not on PYTHONPATH")
    from tokenspeed_kernel.tools.peers import TritonKernelsMoE

    return TritonKernelsMoE


def _weights(w13_octaves: int) -> MoEWeights:
    """GPT-OSS-120B MXFP4 weights from random bytes on the GPU. Scales aim entries at
    1/sqrt(cols) (+-1 octave); w13_octaves shifts W13 up (and W2 down) to push pre-activations
    past the SwiGLU clamp."""
    e, h, i = 128, 2880, 2880
    g = torch.Generator(device="cuda").manual_seed(7 + w13_octaves)

    def mx(rows, cols, shift):
        u8 = dict(generator=g, device="cuda", dtype=torch.uint8)
        packed = torch.randint(0, 256, (e, rows, cols // 2), **u8)
        center = 120 + shift
        return packed, torch.randint(center - 1, center + 2, (e, rows, cols // 32), **u8)

    w13, s13 = mx(2 * i, h, w13_octaves)
    w2, s2 = mx(h, i, -w13_octaves)
    return MoEWeights(
        w13=w13,
        w2=w2,
        w13_scale=s13,
        w2_scale=s2,
        w13_bias=0.5 * torch.randn(e, 2 * i, generator=g, device="cuda"),
        w2_bias=0.5 * torch.randn(e, h, generator=g, device="cuda"),
    )


@pytest.mark.parametrize("w13_octaves,sizes", [(0, (1, 64, 1024)), (2, (64,))])
def test_peer_matches_moe_apply_and_reference(w13_octaves, sizes):
    peer_class = _peer_class()
    config = MoEConfig(**GPT_OSS_120B, weight_format="mxfp4", activation_format="bf16")
    weights = _weights(w13_octaves)
    peer = peer_class(config, weights)
    plan = moe_plan(config, device="cuda", max_num_tokens=max(sizes))
    prepared = moe_prepare_weights(plan, weights)
    reference = get_kernel("moe_apply", "reference.moe_apply")
    ref_plan = moe_plan_for(reference, config, max(sizes), "cuda")
    ref_prepared = reference.fn.prepare_weights(ref_plan, weights)
    tol = tolerance(torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(w13_octaves)
    clamped = 0
    for m in sizes:
        x = torch.randn(m, 2880, generator=g, device="cuda").to(torch.bfloat16)
        logits = torch.randn(m, 128, generator=g, device="cuda")
        got = peer(x, logits)
        ours = moe_apply(plan, x, prepared, logits)
        expected = torch.empty_like(x)
        reference.fn.apply(ref_plan, x, ref_prepared, router_logits=logits, out=expected)
        assert_close(got, expected, dtype=torch.bfloat16, name=f"peer (M={m})")
        assert_close(ours, expected, dtype=torch.bfloat16, name=f"moe_apply (M={m})")
        # Each is within atol + rtol |ref| of the reference, so within twice that of each other.
        diff = (got.float() - ours.float()).abs()
        allowed = 2 * (tol.atol + tol.rtol * expected.float().abs())
        assert bool((diff <= allowed).all()), f"M={m}: peer - ours max {diff.max():.3e}"
        # Whether the clamp is reached: the first routed expert's gate pre-activations.
        e = int(torch.topk(logits[0], 4).indices[0])
        pre = x[:1].float() @ ref_prepared.tensors["w13"][e].T + ref_prepared.tensors["w13_bias"][e]
        clamped += int((pre[:, 0::2] > config.activation.limit).sum())
    if w13_octaves:
        assert clamped > 0, "the gained weights never reached the SwiGLU clamp"
