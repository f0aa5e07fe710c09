"""The moe_apply peer (vLLM 0.26's triton_kernels path, tools/peers.py) computes the same
function as moe_apply on the same weights, at GPT-OSS-120B shapes: moe_apply within the bf16
tolerance of the core reference; the peer, which rounds where the reference does not (a bf16
SwiGLU intermediate, bf16 per-expert outputs before the top-k sum) and so legitimately misses
it by more than that tolerance (test_moe_peer.py measures how far), against
`triton_kernels_moe_emulation`, the reference's math rounded at the peer's points
(`compare_to_emulation`). Both sides' errors against the reference are in the failure message.
Needs an sm_90 GPU and triton_kernels importable (vLLM's vendored copy on PYTHONPATH, e.g.
PYTHONPATH=.carry/peers)."""

from __future__ import annotations

import pytest
import torch
from test_moe_peer import gpt_oss_weights

from tokenspeed_kernel import expert_parallel_shard, moe_apply, moe_plan, moe_prepare_weights
from tokenspeed_kernel.ops.moe.types import MoEConfig
from tokenspeed_kernel.registry import get_kernel
from tokenspeed_kernel.testing import compare, moe_plan_for
from tokenspeed_kernel.tools.peers import compare_to_emulation, triton_kernels_moe_emulation

pytestmark = pytest.mark.gpu

GPT_OSS_120B = dict(num_experts=128, top_k=4, hidden_size=2880, intermediate_size=2880)


def _peer_class():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the peer reproduces vLLM's sm_90 path: needs an sm_90 GPU")
    pytest.importorskip("triton_kernels", reason="vLLM's triton_kernels not on PYTHONPATH")
    from tokenspeed_kernel.tools.peers import TritonKernelsMoE

    return TritonKernelsMoE


@pytest.mark.parametrize(
    "w13_octaves,sizes,ep", [(0, (1, 64, 1024), 1), (2, (64,), 1), (0, (64, 1024), 8)]
)
def test_peer_matches_moe_apply_and_reference(w13_octaves, sizes, ep, monkeypatch):
    """ep > 1: rank 0 of that expert-parallel split (16 of the 128 experts at 8), as the
    peer's simulated expert parallelism runs it; tokens routed to no local expert are 0."""
    peer_class = _peer_class()
    # The reference and the emulation are float32 GEMMs: TF32 would round their inputs.
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    config = MoEConfig(**GPT_OSS_120B, weight_format="mxfp4", activation_format="bf16")
    weights = gpt_oss_weights(128, w13_octaves, "cuda")
    if ep > 1:
        config, weights = expert_parallel_shard(config, weights, rank=0, world_size=ep)
    peer = peer_class(config, weights)
    plan = moe_plan(config, device="cuda", max_num_tokens=max(sizes))
    prepared = moe_prepare_weights(plan, weights)
    reference = get_kernel("moe_apply", "reference.moe_apply")
    ref_plan = moe_plan_for(reference, config, max(sizes), "cuda")
    ref_prepared = reference.fn.prepare_weights(ref_plan, weights)
    t = ref_prepared.tensors
    g = torch.Generator(device="cuda").manual_seed(w13_octaves)
    clamped = 0
    report, failed = [], False
    for m in sizes:
        x = torch.randn(m, 2880, generator=g, device="cuda").to(torch.bfloat16)
        logits = torch.randn(m, 128, generator=g, device="cuda")
        got = peer(x, logits)
        ours = moe_apply(plan, x, prepared, logits)
        expected = torch.empty_like(x)
        reference.fn.apply(ref_plan, x, ref_prepared, router_logits=logits, out=expected)
        emulated, steps = triton_kernels_moe_emulation(
            config, x, logits, t["w13"], t["w2"], t["w13_bias"], t["w2_bias"]
        )
        checked = (
            compare(ours, expected, dtype=torch.bfloat16, name=f"moe_apply (M={m})"),
            compare_to_emulation(got, emulated, steps, name=f"peer (M={m})"),
        )
        failed |= not all(c.ok for c in checked)
        report += [str(c) for c in checked]
        for who, out in (("peer", got), ("peer's rounding (emulated)", emulated)):
            report.append(str(compare(out, expected, dtype=torch.bfloat16, name=f"{who} (M={m})")))
        if ep > 1:
            remote = (torch.topk(logits, 4, dim=-1).indices >= config.num_local_experts).all(-1)
            assert remote.any() and not got[remote].any() and not ours[remote].any()
        # Whether the clamp is reached: the first routed expert's gate pre-activations.
        e = int(torch.topk(logits[0], 4).indices[0])
        if e >= config.num_local_experts:
            continue
        pre = x[:1].float() @ t["w13"][e].T + t["w13_bias"][e]
        clamped += int((pre[:, 0::2] > config.activation.limit).sum())
    print("\n".join(report))
    assert not failed, "\n".join(report)
    if w13_octaves:
        assert clamped > 0, "the gained weights never reached the SwiGLU clamp"
