"""The moe_apply peer (vLLM 0.26's triton_kernels path) on the CPU: it is listed with a
"not importable" note where triton_kernels is absent, and our checkpoint weights converted to
triton_kernels' logical layout, run through a plain-torch emulation of the peer's math
(matmul_ogs on [K, N] weights, `_swiglu_fn` on interleaved pairs, gammas on the second GEMM),
give the core reference's output. The peer rounds where the reference does not (a bf16 SwiGLU
intermediate, bf16 per-expert outputs before the top-k sum): `triton_kernels_moe_emulation`
rounds there too, and at GPT-OSS sizes that rounding alone misses the float32 reference by
more than the bf16 tolerance, so the GPU test checks the peer against the emulation. The
swizzled layout and the kernels themselves run on the GPU only (test_moe_peer_gpu.py)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tokenspeed_kernel import capture, env, expert_parallel_shard
from tokenspeed_kernel.cli import main
from tokenspeed_kernel.ops.moe.types import MoEConfig, MoEWeights
from tokenspeed_kernel.registry import get_kernel
from tokenspeed_kernel.testing import assert_close, compare, moe_plan_for
from tokenspeed_kernel.testing.cases import moe_case
from tokenspeed_kernel.testing.inputs import MoEShape, generator, moe_inputs, moe_weights
from tokenspeed_kernel.tools import peers
from tokenspeed_kernel.tools.peers import (
    INTERMEDIATE_MULTIPLE,
    MOE_PEER,
    SCALE_GROUP_MULTIPLE,
    TritonKernelsWeights,
    compare_to_emulation,
    peer_calls,
    peer_names,
    source_sha256,
    triton_kernels_layout,
    triton_kernels_moe_emulation,
    triton_kernels_origin,
)
from tokenspeed_kernel.tools.workloads import Point

# e2m1 magnitudes by code (bit 3 is the sign), as OCP MX defines them.
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _dequantize_kn(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[E, K/2, N] packed along K (low nibble = even k) with [E, >= K/32, N] e8m0 scales ->
    float32 [E, K, N], read the way matmul_ogs reads its logical layout."""
    e, half, n = packed.shape
    codes = torch.stack((packed & 15, packed >> 4), dim=2).reshape(e, 2 * half, n).long()
    values = E2M1[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    groups = scale[:, : 2 * half // 32].float()
    return values * torch.exp2(groups - 127).repeat_interleave(32, dim=1)


def _peer_math(
    w: TritonKernelsWeights,
    x,
    logits,
    top_k: int,
    alpha: float,
    limit: float,
    rounded=False,
    local_experts: int | None = None,
):
    """The peer's forward in plain torch: routing(sm_first=False), matmul_ogs + bias with the
    fused swiglu (gelu = even column, linear = odd), matmul_ogs + bias, times gammas, summed;
    `rounded` stores the swiglu output and each gamma-weighted expert output in bf16, as the
    kernels do. `local_experts`: `w` holds experts 0 .. local_experts - 1 (rank 0 of an
    expert-parallel split; routing's simulated_ep), the others' pairs are dropped after the
    softmax over the global top-k."""
    w13 = _dequantize_kn(w.w13, w.w13_scale)
    w2 = _dequantize_kn(w.w2, w.w2_scale)
    values, ids = torch.topk(logits.float(), top_k, dim=-1)
    gammas = torch.softmax(values, dim=-1)
    store = (lambda t: t.to(torch.bfloat16).float()) if rounded else (lambda t: t)
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(top_k):
            e = int(ids[t, j])
            if local_experts is not None and e >= local_experts:
                continue
            h = x[t].float() @ w13[e] + w.w13_bias[e]
            gelu = h[0::2].clamp(max=limit)
            linear = h[1::2].clamp(-limit, limit)
            s = gelu / (1 + torch.exp(-alpha * gelu))
            a = store(s * linear + s)
            out[t] += store(gammas[t, j] * (a @ w2[e] + w.w2_bias[e]))
    return out


# I = 96 pads to 128 (INTERMEDIATE_MULTIPLE); H/32 = 2 and Ip/32 = 4 scale groups pad to 4.
SHAPE = MoEShape(
    num_tokens=7, num_experts=8, top_k=2, hidden_size=64, intermediate_size=96, gain=4.0
)


def _checkpoint():
    gen = generator("moe-peer", SHAPE)
    weights = moe_weights(SHAPE, gen)
    x, routing = moe_inputs(SHAPE, gen)
    return weights, x, routing["router_logits"]


def test_layout_pads_and_keeps_the_gate_up_interleave():
    weights, _, _ = _checkpoint()
    w = triton_kernels_layout(SHAPE.config(), weights)
    e, h, i = 8, 64, 96
    ip = 128
    assert w.intermediate_size == ip and ip % INTERMEDIATE_MULTIPLE == 0
    hs, is_ = 4, 4
    assert hs % SCALE_GROUP_MULTIPLE == 0
    assert tuple(w.w13.shape) == (e, h // 2, 2 * ip) and w.w13.stride(1) == 1
    assert tuple(w.w13_scale.shape) == (e, hs, 2 * ip) and w.w13_scale.stride(1) == 1
    assert tuple(w.w2.shape) == (e, ip // 2, h) and w.w2.stride(1) == 1
    assert tuple(w.w2_scale.shape) == (e, is_, h) and w.w2_scale.stride(1) == 1
    assert w.w13_bias.dtype == torch.float32 and tuple(w.w13_bias.shape) == (e, 2 * ip)
    # Column n of W13 is checkpoint row n: gate j at 2j, up j at 2j + 1.
    assert torch.equal(w.w13[:, :, : 2 * i], weights.w13.transpose(1, 2))
    assert torch.equal(w.w13_scale[:, : h // 32, : 2 * i], weights.w13_scale.transpose(1, 2))
    assert torch.equal(w.w13_bias[:, : 2 * i], weights.w13_bias)
    assert torch.equal(w.w2[:, : i // 2], weights.w2.transpose(1, 2))
    assert torch.equal(w.w2_scale[:, : i // 32], weights.w2_scale.transpose(1, 2))
    for padding in (
        w.w13[:, :, 2 * i :],
        w.w13_scale[:, h // 32 :],
        w.w13_scale[:, :, 2 * i :],
        w.w13_bias[:, 2 * i :],
        w.w2[:, i // 2 :],
        w.w2_scale[:, i // 32 :],
    ):
        assert padding.numel() and not padding.any()
    # New tensors: the caller's weights are never aliased.
    assert w.w13.data_ptr() != weights.w13.data_ptr()


def test_layout_through_the_peers_math_matches_the_reference():
    """gain 4 drives many gate/up pre-activations past the clamp (limit 7)."""
    weights, x, logits = _checkpoint()
    config = SHAPE.config()
    w = triton_kernels_layout(config, weights)
    swiglu = config.activation
    got = _peer_math(w, x, logits, config.top_k, swiglu.alpha, swiglu.limit)
    reference = get_kernel("moe_apply", "reference.moe_apply")
    plan = moe_plan_for(reference, config, SHAPE.num_tokens, "cpu")
    expected = torch.empty_like(x)
    reference.fn.apply(
        plan, x, reference.fn.prepare_weights(plan, weights), router_logits=logits, out=expected
    )
    # The clamp is exercised: some gate pre-activation exceeds the limit.
    w13 = _dequantize_kn(w.w13, w.w13_scale)
    assert (x.float() @ w13[0] + w.w13_bias[0])[:, 0::2].max() > swiglu.limit
    assert_close(got.to(torch.bfloat16), expected, dtype=torch.bfloat16, name="peer math")


def gpt_oss_weights(num_experts: int, w13_octaves: int, device) -> MoEWeights:
    """GPT-OSS-120B-sized (H = I = 2880) MXFP4 weights from random bytes. Scales aim entries at
    1/sqrt(cols) (+-1 octave); w13_octaves shifts W13 up (and W2 down) to push pre-activations
    past the SwiGLU clamp. The GPU test uses it with the 128 experts of GPT-OSS-120B."""
    e, h, i = num_experts, 2880, 2880
    g = torch.Generator(device=device).manual_seed(7 + w13_octaves)

    def mx(rows, cols, shift):
        u8 = dict(generator=g, device=device, dtype=torch.uint8)
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
        w13_bias=0.5 * torch.randn(e, 2 * i, generator=g, device=device),
        w2_bias=0.5 * torch.randn(e, h, generator=g, device=device),
    )


def _emulate(config, x, logits, prepared):
    t = prepared.tensors
    return triton_kernels_moe_emulation(
        config, x, logits, t["w13"], t["w2"], t["w13_bias"], t["w2_bias"]
    )


def test_emulation_is_the_peers_math_rounded_where_the_kernels_round():
    weights, x, logits = _checkpoint()
    config = SHAPE.config()
    swiglu = config.activation
    w = triton_kernels_layout(config, weights)
    args = (w, x, logits, config.top_k, swiglu.alpha, swiglu.limit)
    reference = get_kernel("moe_apply", "reference.moe_apply")
    plan = moe_plan_for(reference, config, SHAPE.num_tokens, "cpu")
    out, steps = _emulate(config, x, logits, reference.fn.prepare_weights(plan, weights))
    assert out.dtype == torch.bfloat16 and steps.shape == out.shape and bool((steps > 0).all())
    # Same rounding points on triton_kernels' layout, summed in another order.
    rounded = _peer_math(*args, rounded=True).to(torch.bfloat16)
    result = compare_to_emulation(rounded, out, steps, name="peer math, rounded")
    assert result.ok, str(result)
    # The rounding is there: the unrounded math differs somewhere.
    assert not torch.equal(_peer_math(*args).to(torch.bfloat16), out)


@pytest.fixture(scope="module")
def gpt_oss_sized():
    """4 experts at GPT-OSS-120B's H and I, W13 up 2 octaves (pre-activations past the clamp),
    64 tokens: the reference-prepared weights, the inputs, and the emulation's (out, steps)."""
    config = MoEConfig(4, 4, 2880, 2880, weight_format="mxfp4", activation_format="bf16")
    weights = gpt_oss_weights(4, 2, "cpu")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 2880, generator=g).to(torch.bfloat16)
    logits = torch.randn(64, 4, generator=g)
    reference = get_kernel("moe_apply", "reference.moe_apply")
    plan = moe_plan_for(reference, config, 64, "cpu")
    prepared = reference.fn.prepare_weights(plan, weights)
    expected = torch.empty_like(x)
    reference.fn.apply(plan, x, prepared, router_logits=logits, out=expected)
    return config, weights, prepared, x, logits, expected, _emulate(config, x, logits, prepared)


def test_peer_rounding_alone_misses_the_reference_by_more_than_bf16_tolerance(gpt_oss_sized):
    """What the GPU saw for the peer at M=64 on 128 such experts (1290/184320 outside, max abs
    0.125, rms 1.1e-2) is what its rounding costs: here 0.7% outside, max abs 0.125, rms 1.3e-2
    on 4 experts."""
    *_, expected, (out, steps) = gpt_oss_sized
    result = compare(out, expected, dtype=torch.bfloat16, name="emulated peer")
    assert not result.ok and 0.001 < result.num_bad / result.numel < 0.02, str(result)
    assert 0.03 < result.max_abs < 0.25 and 0.005 < result.rms < 0.02, str(result)
    # So a peer that did not round there would fail the check against the emulation.
    result = compare_to_emulation(expected, out, steps, name="the reference")
    assert not result.ok, str(result)


def test_emulation_bound_holds_in_another_order_and_catches_a_wrong_scale(gpt_oss_sized):
    config, weights, prepared, x, logits, _, (out, steps) = gpt_oss_sized
    t = prepared.tensors
    # The same function accumulated in another order (as the peer's tensor cores do): H
    # permuted in GEMM1, the intermediate's gate/up pairs permuted in GEMM2.
    g = torch.Generator().manual_seed(0)
    ph = torch.randperm(2880, generator=g)
    pi = torch.randperm(2880, generator=g)
    pairs = torch.stack((2 * pi, 2 * pi + 1), dim=1).reshape(-1)
    shuffled = triton_kernels_moe_emulation(
        config,
        x[:, ph],
        logits,
        t["w13"][:, pairs][:, :, ph],
        t["w2"][:, :, pi],
        t["w13_bias"][:, pairs],
        t["w2_bias"],
    )[0]
    assert not torch.equal(shuffled, out)
    result = compare_to_emulation(shuffled, out, steps, name="reordered")
    assert result.ok, str(result)
    # A layout slip the GPU could make: W2's scales read one K-group late in 1 column of 64.
    s2 = weights.w2_scale.clone()
    s2[:, ::64] = s2[:, ::64].roll(1, dims=-1)
    wrong = MoEWeights(
        w13=weights.w13,
        w2=weights.w2,
        w13_scale=weights.w13_scale,
        w2_scale=s2,
        w13_bias=weights.w13_bias,
        w2_bias=weights.w2_bias,
    )
    reference = get_kernel("moe_apply", "reference.moe_apply")
    plan = moe_plan_for(reference, config, 64, "cpu")
    slipped = _emulate(config, x, logits, reference.fn.prepare_weights(plan, wrong))[0]
    result = compare_to_emulation(slipped, out, steps, name="wrong w2 scales")
    assert not result.ok and result.worst_index[1] % 64 == 0, str(result)


def _expert_parallel(rank: int, world_size: int):
    weights, x, logits = _checkpoint()
    config, shard = expert_parallel_shard(SHAPE.config(), weights, rank=rank, world_size=world_size)
    return config, shard, x, logits


def test_expert_parallel_rank_0_runs_as_the_peers_simulated_split():
    """Rank 0 of 2 (experts 0..3 of 8): the layout holds its 4 experts; the peer's math on it,
    pairs of experts 4..7 dropped after the global softmax, is the reference's for that rank;
    rounded, it is the emulation's, and a token routed to no local expert comes out 0."""
    config, shard, x, logits = _expert_parallel(0, 2)
    assert peers.moe_peer_unsupported(config) == ""
    w = triton_kernels_layout(config, shard)
    assert w.w13.shape[0] == 4 and w.w2.shape[0] == 4
    swiglu = config.activation
    args = (w, x, logits, config.top_k, swiglu.alpha, swiglu.limit)
    reference = get_kernel("moe_apply", "reference.moe_apply")
    plan = moe_plan_for(reference, config, SHAPE.num_tokens, "cpu")
    prepared = reference.fn.prepare_weights(plan, shard)
    expected = torch.empty_like(x)
    reference.fn.apply(plan, x, prepared, router_logits=logits, out=expected)
    got = _peer_math(*args, local_experts=4).to(torch.bfloat16)
    assert_close(got, expected, dtype=torch.bfloat16, name="peer math, rank 0 of 2")
    out, steps = _emulate(config, x, logits, prepared)
    rounded = _peer_math(*args, rounded=True, local_experts=4).to(torch.bfloat16)
    result = compare_to_emulation(rounded, out, steps, name="peer math, rank 0 of 2, rounded")
    assert result.ok, str(result)
    # The split drops pairs: the whole layer's output differs, and a token whose top-k are
    # all remote has none.
    whole_layout = triton_kernels_layout(SHAPE.config(), _checkpoint()[0])
    whole = _peer_math(whole_layout, *args[1:]).to(torch.bfloat16)
    assert not torch.equal(got, whole)
    remote = (torch.topk(logits, config.top_k, dim=-1).indices >= 4).all(dim=-1)
    assert remote.any() and not out[remote].any() and not expected[remote].any()


def test_expert_parallel_ranks_past_0_are_refused_with_the_reason():
    config, shard, _, _ = _expert_parallel(1, 2)
    reason = peers.moe_peer_unsupported(config)
    assert "rank 0 of an even split" in reason and "experts 4..7 of 8" in reason
    with pytest.raises(ValueError, match="rank 0 of an even split"):
        triton_kernels_layout(config, shard)
    uneven = MoEConfig(8, 2, 64, 96, num_local_experts=3)
    assert "rank 0 of an even split" in peers.moe_peer_unsupported(uneven)


def test_layout_refuses_what_the_peer_does_not_run():
    weights, _, _ = _checkpoint()
    fp8 = MoEConfig(8, 2, 64, 96, activation_format="fp8")
    with pytest.raises(ValueError, match="bf16 activations only"):
        triton_kernels_layout(fp8, weights)
    wrong = MoEWeights(
        w13=weights.w13[:, :, :-1],
        w2=weights.w2,
        w13_scale=weights.w13_scale,
        w2_scale=weights.w2_scale,
        w13_bias=weights.w13_bias,
        w2_bias=weights.w2_bias,
    )
    with pytest.raises(ValueError, match=r"w13 is \(8, 192, 31\)"):
        triton_kernels_layout(SHAPE.config(), wrong)


def test_peer_listed_with_a_note_when_not_importable(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_kernels", None)
    point = Point(moe_case("peer-m7", SHAPE), "mxfp4 x bf16", 7, "tokens", "M=7")
    weights, x, logits = _checkpoint()
    routing = dict(router_logits=logits, topk_weights=None, topk_ids=None)
    found = peer_calls(point, ((x,), routing), torch.device("cpu"), weights)
    assert peer_names("moe_apply") == (MOE_PEER,)
    assert [(name, call) for name, call, _ in found] == [(MOE_PEER, None)]
    assert found[0][2].startswith("not importable")


def test_bench_cli_lists_the_moe_peer(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "triton_kernels", None)
    # The roofline cache goes to a temporary directory, never the user's.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(capture.CAPTURE_ENV, raising=False)
    env.reload()
    args = ["bench", "--preset", "tiny", "--op", "moe_apply", "--peers"]
    args += ["--kernels", "reference.*", "--out", str(tmp_path), "--no-plot"]
    args += ["--iters", "2", "--warmup", "1", "--budget-ms", "10"]
    assert main(args) == 0
    capsys.readouterr()
    rows = json.loads((tmp_path / "results.json").read_text())["results"]
    peers = [r for r in rows if r["peer"]]
    assert peers and {r["kernel"] for r in peers} == {MOE_PEER}
    assert all(r["status"] == "unavailable" for r in peers)
    assert all(r["note"].startswith("not importable") for r in peers)


def test_origin_names_the_copy_by_content(tmp_path, monkeypatch):
    """Any other triton_kernels is reported as not vLLM 0.26.0's vendored copy."""
    package = tmp_path / "triton_kernels"
    package.mkdir()
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "triton_kernels", raising=False)
    origin = triton_kernels_origin()
    # Outside the working directory only the folder's name: no machine path in a results file.
    assert "at triton_kernels (" in origin and str(tmp_path) not in origin
    assert "not vLLM 0.26.0's vendored copy" in origin
    monkeypatch.chdir(tmp_path)
    assert "at triton_kernels (" in triton_kernels_origin()


def test_origin_of_the_vendored_copy_names_no_location(tmp_path, monkeypatch):
    """vLLM 0.26.0's vendored copy is named by its content hash alone: where a machine keeps
    it does not reach a results file."""
    package = tmp_path / "copy" / "triton_kernels"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "copy"))
    monkeypatch.delitem(sys.modules, "triton_kernels", raising=False)
    monkeypatch.chdir(tmp_path)
    assert "at copy/triton_kernels (" in triton_kernels_origin()
    sha = source_sha256(package)
    monkeypatch.setattr(peers, "VLLM_0_26_TRITON_KERNELS_SHA256", sha)
    assert triton_kernels_origin() == (
        f"triton_kernels (sha256 {sha[:12]}, vLLM 0.26.0 wheel's vendored copy "
        "(vllm/third_party/triton_kernels))"
    )
