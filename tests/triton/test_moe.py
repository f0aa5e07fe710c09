"""Triton MoE: the shared conformance cases (CPU through the Triton interpreter), routing and
grouping invariants, weight preparation (never mutates or aliases the caller's tensors, padding
never leaks), and GPT-OSS-120B shapes on the GPU.

Interpreter workarounds (CPU only, in the kernels under their INTERPRETED constexpr, set when
TRITON_INTERPRET=1): Triton 3.6's interpreter multiplies raw bits in a bf16 tl.dot, truncates
float32 -> bf16 casts and misrounds float32 -> fp8 just below powers of two. There the dots take
the same exact operand values as float32, and bf16/fp8 roundings are done to nearest even on
the bits before the cast. Compiled kernels use the hardware paths; no tolerance is changed.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tokenspeed_kernel import (
    expert_parallel_shard,
    moe_apply,
    moe_plan,
    moe_prepare_weights,
    tensor_parallel_shard,
)
from tokenspeed_kernel.ops.moe.reference import topk_softmax
from tokenspeed_kernel.ops.moe.types import MoEConfig, MoEWeights
from tokenspeed_kernel.platform import platform_of
from tokenspeed_kernel.registry import get_kernel
from tokenspeed_kernel.selector import use_kernel
from tokenspeed_kernel.testing import (
    assert_close,
    assert_conformance,
    conformance_params,
    moe_plan_for,
)
from tokenspeed_kernel.testing.inputs import MoEShape, generator, moe_weights
from tokenspeed_kernel.tuning import pin_config
from tokenspeed_kernel_triton.moe import moe as moe_module
from tokenspeed_kernel_triton.moe import workspace
from tokenspeed_kernel_triton.moe.fragment_config_sm90 import FragmentConfig
from tokenspeed_kernel_triton.moe.moe import MoETileConfig
from tokenspeed_kernel_triton.moe.moe_sm90 import moe_forward_sm90
from tokenspeed_kernel_triton.moe.routing import FUSED_MAX_PAIRS, max_tiles, route

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
KERNEL = "triton.moe_apply"
HOPPER = "triton.moe_apply.sm90"


@pytest.mark.parametrize("kernel,case", conformance_params(op="moe_apply", backend="triton"))
def test_conformance(kernel, case):
    assert_conformance(kernel, case)


def _check_grouping(ids, sorted_pairs, tiles, num_tiles, block_m):
    """Every pair appears once, in a tile of its own expert, tiles in expert order."""
    flat = ids.reshape(-1).long()
    n = int(num_tiles)
    seen = []
    last_expert = -1
    for t in range(n):
        expert, row_end = (int(v) for v in tiles[t])
        assert expert >= last_expert
        last_expert = expert
        rows = sorted_pairs[t * block_m : min((t + 1) * block_m, row_end)].long()
        assert len(rows) > 0
        assert torch.all(flat[rows] == expert)
        seen += rows.tolist()
    assert sorted(seen) == list(range(flat.numel()))


@pytest.mark.parametrize("tokens,experts,top_k", [(5, 8, 2), (13, 128, 4), (70, 16, 4)])
def test_routing_matches_reference_with_ties(tokens, experts, top_k):
    """Integer logits force ties (lower index wins); 13 x 4 pairs over 128 experts fill the
    one-program router's four warps, 70 x 4 take the multi-kernel path."""
    gen = generator("moe-routing", tokens, experts, top_k)
    logits = torch.randint(0, 3, (tokens, experts), generator=gen).float().to(DEVICE)
    weights, ids, sorted_pairs, tiles, num_tiles, _ = route(
        logits, None, None, top_k=top_k, num_experts=experts, block_m=16
    )
    ref_w, ref_ids = topk_softmax(logits, top_k)
    assert torch.equal(ids.cpu(), ref_ids.cpu())
    assert_close(weights, ref_w, dtype=torch.float32, name="topk_weights")
    _check_grouping(ids.cpu(), sorted_pairs.cpu(), tiles.cpu(), num_tiles.cpu(), 16)


@pytest.mark.parametrize("tokens", [13, 70])  # the one-program router, the multi-kernel one
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_routing_orders_logits_of_every_width_as_the_reference(tokens, dtype):
    """Both routers rank logits of every float width as the reference does: logits one step
    apart in their dtype, signed zeros (equal: the lower index wins), -inf (picked when a row
    has too few finite logits) and NaN (above everything); the weights its softmax."""
    experts, top_k = 32, 4
    gen = generator("moe-routing-keys", tokens, str(dtype))
    step = torch.finfo(dtype).eps
    # Many logits one step apart near 1: any ranking coarser than the dtype ties them.
    logits = (1 + step * torch.randint(-6, 7, (tokens, experts), generator=gen)).to(dtype)
    logits[0, :] = 0.0
    logits[0, 0], logits[0, 9] = -0.0, 0.5
    logits[1, :] = float("-inf")
    logits[1, 7], logits[1, 3] = -2.0, -3.0
    logits[2, 11] = float("nan")
    logits[3, :] = torch.linspace(-4, 4, experts).to(dtype)
    weights, ids, sorted_pairs, tiles, num_tiles, _ = route(
        logits.to(DEVICE), None, None, top_k=top_k, num_experts=experts, block_m=16
    )
    ref_w, ref_ids = topk_softmax(logits, top_k)
    assert ids[0].tolist() == [9, 0, 1, 2]  # -0 at column 0 ties with the +0s after it
    assert ids[1].tolist() == [7, 3, 0, 1]
    assert torch.equal(ids.cpu(), ref_ids)
    assert torch.isnan(weights[2]).all()
    finite = torch.arange(tokens) != 2
    assert_close(weights.cpu()[finite], ref_w[finite], dtype=torch.float32, name="weights")
    _check_grouping(ids.cpu(), sorted_pairs.cpu(), tiles.cpu(), num_tiles.cpu(), 16)


@pytest.mark.gpu
@pytest.mark.skipif(
    not ON_GPU or torch.cuda.get_device_capability() < (9, 0),
    reason="programmatic dependent launch needs sm_90+",
)
@pytest.mark.parametrize("tokens", [70, 3072])
@pytest.mark.parametrize("precomputed", [False, True])
def test_chained_multi_kernel_router_routes_as_unchained(tokens, precomputed):
    """launch_dependents chains the multi-kernel router's launches (each waits for the one
    before it): the same grouping as separate launches, with the scatter summing few blocks
    (70 tokens) or the align kernel between (3072), from logits or precomputed ids."""
    experts, top_k = 128, 4
    gen = generator("moe-chained-router", tokens)
    logits = torch.randn(tokens, experts, generator=gen).to(DEVICE)
    ref_w, ref_ids = topk_softmax(logits, top_k)
    inputs = (None, ref_w.float(), ref_ids.int()) if precomputed else (logits, None, None)
    outputs = []
    for chained in (False, True):
        routed = route(
            *inputs, top_k=top_k, num_experts=experts, block_m=64, launch_dependents=chained
        )
        outputs.append([t.clone() if torch.is_tensor(t) else t for t in routed])
    for unchained, chained in zip(*outputs, strict=True):
        assert torch.equal(unchained, chained) if torch.is_tensor(chained) else unchained == chained
    _, ids, sorted_pairs, tiles, num_tiles, _ = outputs[1]
    assert torch.equal(ids.cpu(), ref_ids.cpu())
    _check_grouping(ids.cpu(), sorted_pairs.cpu(), tiles.cpu(), num_tiles.cpu(), 64)


def test_routing_refuses_ready_counters_it_cannot_clear():
    """Only the one-program router zeroes the GEMMs' per-tile counters, and only as many as
    there can be tiles: anything else is refused before a launch, not left stale."""
    tokens = FUSED_MAX_PAIRS // 4 + 1
    logits = torch.randn(tokens, 16, generator=generator("moe-ready", tokens)).to(DEVICE)
    ready = torch.empty(1024, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=f"at most {FUSED_MAX_PAIRS} pairs"):
        route(logits, None, None, top_k=4, num_experts=16, block_m=8, ready=ready)
    with pytest.raises(ValueError, match="int32 counters"):
        route(logits[:2], None, None, top_k=4, num_experts=16, block_m=8, ready=ready[:1])
    with pytest.raises(ValueError, match="int32 counters"):
        route(logits[:2], None, None, top_k=4, num_experts=16, block_m=8, ready=ready.float())


def test_routing_refuses_narrow_tiles_it_cannot_write():
    """The narrow tiles' buffer holds an int32 per local expert, narrow_t is below the tile,
    and the full tiles' list holds an int32 count and one per tile of the bound: anything
    else is refused before a launch."""
    logits = torch.randn(70, 16, generator=generator("moe-narrow", 70)).to(DEVICE)
    fits = torch.empty(16, dtype=torch.int32, device=DEVICE)
    listed = torch.empty(1 + max_tiles(280, 16, 8), dtype=torch.int32, device=DEVICE)
    route(logits, None, None, top_k=4, num_experts=16, block_m=8, narrow=(fits, 4, listed))
    for narrow in (
        (fits[:15], 4, listed), (fits.float(), 4, listed), (fits, 0, listed), (fits, 8, listed),
        (fits, 4, listed[:-1]), (fits, 4, listed.float()), (fits, 4, listed.repeat(2)[::2]),
    ):  # fmt: skip
        with pytest.raises(ValueError, match="narrow"):
            route(logits, None, None, top_k=4, num_experts=16, block_m=8, narrow=narrow)


@pytest.mark.parametrize("tokens", [6, 70])  # the one-program router, the multi-kernel one
@pytest.mark.parametrize("expert_offset", [0, 4])
def test_routing_writes_each_local_experts_narrow_tile(tokens, expert_offset):
    """narrow_tiles[e]: local expert e's last tile if it holds at most narrow_t rows, else -1
    (no rows: -1), whatever the buffer held; the GEMMs' narrow launches run these tiles and
    no others. full_tiles: the count of the other tiles, then their indices in order, which
    the warp-specialized kernel shares out."""
    experts, local, top_k, block_m, narrow_t = 16, 8, 2, 8, 4
    # Local experts with one tile of 6 rows, of 3, of 1 and none; at 70 tokens also last
    # tiles of 8 and 3 rows; the other pairs go to expert 12, on no rank's local range here.
    counts = {0: 6, 1: 3, 2: 1} if tokens == 6 else {0: 40, 1: 19, 3: 1, 6: 6}
    ids = [expert_offset + e for e, n in counts.items() for _ in range(n)]
    ids += [12] * (tokens * top_k - len(ids))
    ids = torch.tensor(ids, dtype=torch.int32).reshape(tokens, top_k).to(DEVICE)
    weights = torch.full((tokens, top_k), 0.5, device=DEVICE)
    narrow = torch.full((local,), 77, dtype=torch.int32, device=DEVICE)
    bound = max_tiles(tokens * top_k, local, block_m)
    listed = torch.full((1 + bound,), 77, dtype=torch.int32, device=DEVICE)
    _, _, _, tiles, num_tiles, _ = route(
        None, weights, ids, top_k=top_k, num_experts=experts, block_m=block_m,
        expert_offset=expert_offset, num_local_experts=local, narrow=(narrow, narrow_t, listed),
    )  # fmt: skip
    expected = [-1] * local
    for t in range(int(num_tiles)):
        expert, row_end = (int(v) for v in tiles[t])
        last = t == int(num_tiles) - 1 or int(tiles[t + 1][0]) != expert
        if last and row_end - t * block_m <= narrow_t:
            expected[expert] = t
    assert any(e >= 0 for e in expected) and any(e < 0 for e in expected)
    assert narrow.tolist() == expected
    full = [t for t in range(int(num_tiles)) if t not in expected]
    assert full and listed[: 1 + len(full)].tolist() == [len(full), *full]


def test_router_prescales_rows_exactly():
    """The one-program router's prescale programs (the post-scaled Hopper GEMM1's x): each row
    times 2^(126 - E), E = floor(log2 max|row|) clamped to [0, 126], exact; rows beyond the
    largest bf16 power, tiny rows and all-zero rows included."""
    g = generator("moe-prescale", 5)
    magnitudes = torch.tensor([1.0, 2.0**120, 2.0**-40, 0.0, 3.0])
    x = (torch.randn(5, 80, generator=g) * magnitudes[:, None]).to(torch.bfloat16)
    x[4, 7] = -(2.0**127)  # the largest magnitude may be negative; 2^127 is E = 126's edge
    logits = torch.randn(5, 16, generator=g)
    scaled, exponents = torch.empty_like(x), torch.empty(5, dtype=torch.int32)
    x, logits, scaled, exponents = (t.to(DEVICE) for t in (x, logits, scaled, exponents))
    route(logits, None, None, top_k=4, num_experts=16, block_m=2, prescale=(x, scaled, exponents))
    amax = x.float().abs().amax(dim=1)
    want_exp = torch.floor(torch.log2(amax)).clamp(0, 126).nan_to_num(0).to(torch.int32)
    assert exponents.tolist() == want_exp.tolist()
    assert want_exp[2:].tolist() == [0, 0, 126]  # tiny, zero, and 2^127 (clamped)
    factor = torch.exp2(126.0 - want_exp.double())
    assert torch.equal(scaled.double(), x.double() * factor[:, None])


@pytest.mark.parametrize("static", [None, 0.02])
def test_router_quantizes_rows_as_the_pass_does_before_prescaling(static):
    """FP8 activations on post-scaled tiles: the router prescales x's e4m3 values, the same as
    quantize_rows gives (and, per row, the same scales), so no launch of its own is needed."""
    from tokenspeed_kernel_triton.moe.quant import quantize_rows

    g = generator("moe-prescale-fp8", 5)
    magnitudes = torch.tensor([1.0, 300.0, 2.0**-20, 0.0, 3.0])
    x = (torch.randn(5, 80, generator=g) * magnitudes[:, None]).to(torch.bfloat16).to(DEVICE)
    logits = torch.randn(5, 16, generator=g).to(DEVICE)
    scaled = torch.empty_like(x)
    exponents = torch.empty(5, dtype=torch.int32, device=DEVICE)
    scales = None if static else torch.full((5,), -1.0, device=DEVICE)
    quant = (static, scales)
    route(
        logits,
        None,
        None,
        top_k=4,
        num_experts=16,
        block_m=2,
        prescale=(x, scaled, exponents, quant),
    )
    q, want_scale = quantize_rows(x, static, "test_router_fp8", values_as=torch.bfloat16)
    if static is None:
        assert torch.equal(scales, want_scale)
    want_exp = torch.floor(torch.log2(q.float().abs().amax(dim=1))).clamp(0, 126)
    want_exp = want_exp.nan_to_num(0).to(torch.int32)
    assert exponents.tolist() == want_exp.tolist()
    factor = torch.exp2(126.0 - want_exp.double())
    assert torch.equal(scaled.double(), q.double() * factor[:, None])


def test_router_refuses_prescaling_beyond_one_program():
    tokens = FUSED_MAX_PAIRS // 4 + 1
    logits = torch.randn(tokens, 16, generator=generator("moe-prescale", tokens)).to(DEVICE)
    x = torch.zeros(tokens, 32, dtype=torch.bfloat16, device=DEVICE)
    exponents = torch.empty(tokens, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=f"prescale needs at most {FUSED_MAX_PAIRS} pairs"):
        route(logits, None, None, top_k=4, num_experts=16, block_m=2, prescale=(x, x, exponents))


def _layer(shape: MoEShape, device=DEVICE):
    weights = moe_weights(shape, generator("moe-layer", shape))
    weights = MoEWeights(
        **{
            name: value.to(device) if isinstance(value, torch.Tensor) else value
            for name, value in vars(weights).items()
        }
    )
    return shape.config(), weights


def test_prepare_never_mutates_or_aliases_and_padding_does_not_leak():
    shape = MoEShape(5, 8, 2, 96, 160, bias_dtype=torch.bfloat16)
    config, weights = _layer(shape)
    before = {k: v.clone() for k, v in vars(weights).items() if isinstance(v, torch.Tensor)}
    with use_kernel("moe_apply", KERNEL):
        plan = moe_plan(config, device=DEVICE)
        assert plan.kernel == KERNEL
        assert (plan.padded_hidden_size, plan.padded_intermediate_size) == (128, 256)
        prepared = moe_prepare_weights(plan, weights)
    for name, value in before.items():
        assert torch.equal(getattr(weights, name), value), f"{name} was modified"
    ours = [t for t in prepared.tensors.values() if isinstance(t, torch.Tensor)]
    theirs = [
        t.untyped_storage().data_ptr()
        for t in vars(weights).values()
        if isinstance(t, torch.Tensor)
    ]
    assert not {t.untyped_storage().data_ptr() for t in ours} & set(theirs)

    # out is a view into a NaN-filled buffer: nothing outside [M, H] may be written.
    gen = generator("moe-leak")
    x = torch.randn(5, 96, generator=gen).to(torch.bfloat16).to(DEVICE)
    logits = torch.randn(5, 8, generator=gen).to(DEVICE)
    buffer = torch.full((7, 130), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    out = buffer[1:6, 2:98]
    result = moe_apply(plan, x, prepared, logits, out=out)
    assert result.shape == (5, 96) and result.data_ptr() == out.data_ptr()
    assert torch.isnan(buffer[0]).all() and torch.isnan(buffer[6]).all()
    assert torch.isnan(buffer[:, :2]).all() and torch.isnan(buffer[:, 98:]).all()
    reference = get_kernel("moe_apply", "reference.moe_apply")
    ref_plan = moe_plan_for(reference, config, plan.max_num_tokens, DEVICE)
    ref_out = torch.empty_like(x)
    reference.fn.apply(
        ref_plan,
        x,
        reference.fn.prepare_weights(ref_plan, weights),
        router_logits=logits,
        out=ref_out,
    )
    assert_close(out, ref_out, dtype=torch.bfloat16, name="out")


def test_scale_bytes_beyond_kernel_range_are_refused():
    config, weights = _layer(MoEShape(1, 4, 2, 64, 64))
    scale = weights.w2_scale.clone()
    scale[0, 0, 0] = 250
    bad = MoEWeights(**{**vars(weights), "w2_scale": scale})
    plan = moe_plan_for(get_kernel("moe_apply", KERNEL), config, 16, DEVICE)
    with pytest.raises(ValueError, match="w2_scale holds e8m0 byte 250"):
        get_kernel("moe_apply", KERNEL).fn.prepare_weights(plan, bad)


class _Picked(Exception):
    pass


@pytest.mark.parametrize(
    "vendor,experts,tokens,want_block_m",
    [
        ("nvidia", 128, 2048, 64),  # GPT-OSS-120B: 64 tokens an expert
        ("nvidia", 32, 2048, 128),  # GPT-OSS-20B: 256, as 120B's M=8192
        ("nvidia", 32, 1024, 64),  # 128 an expert, as 120B's M=4096
        ("nvidia", 32, 16, 16),  # the decode tiles keep their pairs
        ("amd", 32, 512, 64),  # AMD's table: pairs (measured on 128 experts only)
    ],
)
def test_the_portable_tiles_follow_tokens_per_expert_on_nvidia(
    monkeypatch, vendor, experts, tokens, want_block_m
):
    """The portable kernel's NVIDIA table was measured on 128 experts' pairs; fewer experts
    hold more tokens each and read it at the pairs 128 would hold (the H200 measurements in
    moe.py). AMD's keeps tokens x top_k."""
    picked = []
    real_pick = moe_module.pick_config

    def pick(key, platform_vendor):
        picked.append(real_pick(key, platform_vendor))
        raise _Picked

    monkeypatch.setattr(moe_module, "pick_config", pick)
    monkeypatch.setattr(moe_module, "platform_of", lambda device: SimpleNamespace(vendor=vendor))
    x = torch.zeros(tokens, 64, dtype=torch.bfloat16)
    prepared = dict(num_experts=experts)
    with pytest.raises(_Picked):
        moe_module.moe_forward(
            x,
            prepared,
            top_k=4,
            out=torch.empty_like(x),
            router_logits=torch.zeros(tokens, experts),
        )
    assert picked[0].block_m == want_block_m
    # The registered kernel passes the plan's expert count (an expert-parallel rank's layer).
    config = MoEConfig(128, 4, 64, 96, num_local_experts=16)
    options = moe_module.TritonMoE().forward_options(
        config, dict(w13_input_scale=None, w2_input_scale=None)
    )
    assert options["num_experts"] == 128


def test_pinned_config_gives_the_same_result():
    """Every tile config is an exact reorganization: a pinned 32-row config (two experts'
    rows padded differently) reproduces the default's output bit for bit."""
    shape = MoEShape(9, 8, 2, 64, 64)
    config, weights = _layer(shape)
    spec = get_kernel("moe_apply", KERNEL)
    plan = moe_plan_for(spec, config, 16, DEVICE)
    prepared = spec.fn.prepare_weights(plan, weights)
    gen = generator("moe-pin")
    x = torch.randn(9, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    logits = torch.randn(9, 8, generator=gen).to(DEVICE)
    default = torch.empty_like(x)
    spec.fn.apply(plan, x, prepared, router_logits=logits, out=default)
    pinned = torch.empty_like(x)
    with pin_config(KERNEL, MoETileConfig(32, 64, 32, 64, 4, 1)):
        spec.fn.apply(plan, x, prepared, router_logits=logits, out=pinned)
    assert torch.equal(default, pinned)


@pytest.mark.parametrize(
    "act,hidden,expected",
    [
        ("bf16", 2880, HOPPER),
        ("fp8", 2880, HOPPER),  # e4m3 values as bf16 operands, scales on the accumulators
        ("bf16", 2888, KERNEL),  # x rows are copied in 16-byte vectors
    ],
)
def test_hopper_selects_the_wgmma_kernel_where_it_applies(act, hidden, expected):
    from tokenspeed_kernel.ops.moe.request import MoERequest
    from tokenspeed_kernel.platform import KNOWN_PLATFORMS
    from tokenspeed_kernel.selector import explain

    request = MoERequest("mxfp4", act, True, "topk_softmax", 128, 4, hidden, 2880, 8192)
    for gpu in ("h100", "h200"):
        assert explain("moe_apply", request, KNOWN_PLATFORMS[gpu]).selected == expected
    # Blackwell has no wgmma.
    assert explain("moe_apply", request, KNOWN_PLATFORMS["b200"]).selected == KERNEL
    if hidden % 16:
        verdicts = {
            c.name: c for c in explain("moe_apply", request, KNOWN_PLATFORMS["h200"]).candidates
        }
        assert "not a multiple of 16" in verdicts[HOPPER].reason


# ----------------------------------------------------------------------------- GPU

GPT_OSS_120B = dict(num_experts=128, top_k=4, hidden_size=2880, intermediate_size=2880)


def gpt_oss_weights(activation_format="bf16", static=False, seed=0, device="cuda", experts=128):
    """GPT-OSS-120B MXFP4 expert weights built on the GPU from random bytes (1.7 GB); with
    experts=32 GPT-OSS-20B's."""
    E, H, I = experts, 2880, 2880  # noqa: E741
    g = torch.Generator(device=device).manual_seed(seed)

    def mx(rows, cols):
        packed = torch.randint(
            0, 256, (E, rows, cols // 2), generator=g, device=device, dtype=torch.uint8
        )
        # Random codes have RMS ~2.9: aim entries at 1/sqrt(cols) (+-1 octave) as core's cases.
        center = 127 - 6 - 1
        scales = torch.randint(
            center - 1,
            center + 2,
            (E, rows, cols // 32),
            generator=g,
            device=device,
            dtype=torch.uint8,
        )
        return packed, scales

    w13, s13 = mx(2 * I, H)
    w2, s2 = mx(H, I)
    static_scales = dict(w13_input_scale=3.5 / 448, w2_input_scale=24.0 / 448) if static else {}
    return MoEWeights(
        w13=w13,
        w2=w2,
        w13_scale=s13,
        w2_scale=s2,
        w13_bias=0.5 * torch.randn(E, 2 * I, generator=g, device=device),
        w2_bias=0.5 * torch.randn(E, H, generator=g, device=device),
        **static_scales,
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "kernel,act",
    [
        (KERNEL, "bf16"),
        (KERNEL, "fp8-dynamic"),
        (KERNEL, "fp8-static"),
        (HOPPER, "bf16"),
        (HOPPER, "bf16-hilo"),
        (HOPPER, "bf16-prmt"),
        (HOPPER, "fp8-dynamic"),
        (HOPPER, "fp8-static"),
        (HOPPER, "fp8-dynamic-hilo"),
        (HOPPER, "fp8-static-hilo"),
    ],
)
def test_gpt_oss_120b_shapes(kernel, act):
    """bf16 on triton.moe_apply.sm90 shift-decodes both weights, w2 to fp16 for an fp16 SwiGLU
    intermediate. bf16-hilo plants a w2 scale byte fp16 cannot hold (bf16 hi + lo, w2 still
    shift-decoded to bf16); bf16-prmt plants one bf16's shift decode cannot hold in each weight
    (byte-permute decode for both). fp8-dynamic-hilo: fp8 activations with the bf16 hi + lo
    intermediate (its quantization reads hi + lo, writes hi). fp8-dynamic and fp8-static
    prepare w2 as e4m3 fragments (GEMM2 on FP8 MMAs, its SwiGLU rows in e4m3 at their MMA
    positions). With static scales GEMM1 quantizes its own SwiGLU rows (fp8-static: into
    e4m3; fp8-static-hilo: into hi, lo zero)."""
    activation_format = "fp8" if act.startswith("fp8") else "bf16"
    config = MoEConfig(**GPT_OSS_120B, weight_format="mxfp4", activation_format=activation_format)
    weights = gpt_oss_weights(activation_format, static=act.startswith("fp8-static"))
    if act.endswith("-hilo"):
        weights.w2_scale[5, 100, 7] = 103  # 2^-24: below fp16's reach for 0.5 * scale
    if act == "bf16-prmt":
        weights.w13_scale[9, 11, 13] = 129  # the factor 2^128 is no bf16
        weights.w2_scale[5, 100, 7] = 129
    spec = get_kernel("moe_apply", kernel)
    mismatches = [p.mismatch(platform_of(torch.device("cuda"))) for p in spec.platforms]
    if all(mismatches):
        pytest.skip(f"{kernel}: {mismatches[0]}")
    plan = moe_plan_for(spec, config, 4096, "cuda")
    prepared = spec.fn.prepare_weights(plan, weights)
    if kernel == HOPPER:
        expected = ("prmt", "prmt") if act.endswith("-prmt") else ("bf16", "fp16")
        if act.endswith("-hilo"):
            # fp8: the planted block lies 18 binades below its row's top, past the 11 of
            # e4m3 fragments: w2 stays half precision.
            expected = ("bf16", "bf16")
        elif activation_format == "fp8":
            expected = ("bf16", "e4m3")
        assert (prepared.tensors["w13_decode"], prepared.tensors["w2_decode"]) == expected
    dtype = torch.float8_e4m3fn if activation_format == "fp8" else torch.bfloat16
    # 1 and 4 take the decode tiles, 16 (tile counters), 64, 256 and 384 the serving ones
    # (sm90), 4096 and 4500 (18000 pairs) the prefill.
    sizes = (1, 4, 16, 64, 256, 384, 4096, 4500)
    _assert_matches_reference(spec, plan, prepared, weights, sizes, dtype, act, seed=1)


def _assert_matches_reference(spec, plan, prepared, weights, sizes, dtype, label, seed):
    """`spec`'s layer (plan, prepared from `weights`) against the reference's at each M of
    `sizes` (inputs seeded by `seed`), within `dtype`'s tolerance."""
    config = plan.config
    reference = get_kernel("moe_apply", "reference.moe_apply")
    ref_plan = moe_plan_for(reference, config, max(sizes), "cuda")
    ref_prepared = reference.fn.prepare_weights(ref_plan, weights)
    g = torch.Generator(device="cuda").manual_seed(seed)
    for m in sizes:
        x = torch.randn(m, config.hidden_size, generator=g, device="cuda").to(torch.bfloat16)
        logits = torch.randn(m, config.num_experts, generator=g, device="cuda")
        out = torch.empty_like(x)
        spec.fn.apply(plan, x, prepared, router_logits=logits, out=out)
        expected = torch.empty_like(x)
        reference.fn.apply(ref_plan, x, ref_prepared, router_logits=logits, out=expected)
        assert_close(out, expected, dtype=dtype, name=f"out (M={m}, {label})")


@pytest.mark.gpu
def test_gpt_oss_20b_shapes():
    """GPT-OSS-20B's 32 experts hold four times 120B's tokens each at the same M, so past the
    decode tiles (M > 16) triton.moe_apply.sm90 runs the tiles 120B runs at four times the M
    (_common.selection_pairs): every tile regime against the reference."""
    config = MoEConfig(**dict(GPT_OSS_120B, num_experts=32), weight_format="mxfp4")
    spec = get_kernel("moe_apply", HOPPER)
    if spec.platforms[0].mismatch(platform_of(torch.device("cuda"))):
        pytest.skip("no wgmma on this GPU")
    weights = gpt_oss_weights(experts=32)
    plan = moe_plan_for(spec, config, 2048, "cuda")
    prepared = spec.fn.prepare_weights(plan, weights)
    sizes = (1, 4, 8, 16, 64, 128, 512, 1024, 2048)
    _assert_matches_reference(spec, plan, prepared, weights, sizes, torch.bfloat16, "20B", seed=2)


def _wgmma_gpt_oss_layer():
    """triton.moe_apply.sm90 planned for GPT-OSS-120B (bf16 activations) with its prepared weights,
    or a skip where this GPU has no wgmma."""
    config = MoEConfig(**GPT_OSS_120B, weight_format="mxfp4", activation_format="bf16")
    spec = get_kernel("moe_apply", HOPPER)
    if spec.platforms[0].mismatch(platform_of(torch.device("cuda"))):
        pytest.skip("no wgmma on this GPU")
    plan = moe_plan_for(spec, config, 4096, "cuda")
    return spec, plan, spec.fn.prepare_weights(plan, gpt_oss_weights())


@pytest.mark.gpu
def test_wgmma_ring_steps_of_several_chunks_are_exact():
    """Two or four K chunks per ring step (and zero-filled chunks where a CTA's count does not
    divide: K = 2944 is 23 chunks, GEMM2's splits 12 and 11), with all of a step's wgmmas in
    flight or one at a time, multiply in the same order as one chunk per step: the output is
    bit for bit the same, at the decode and the prefill tiles."""
    spec, plan, prepared = _wgmma_gpt_oss_layer()
    g = torch.Generator(device="cuda").manual_seed(2)
    tiles = {1: (64, 8, 4, 4, 2), 4: (64, 8, 4, 4, 2), 300: (128, 64, 4, 4, 1)}
    for m, (block_w, block_t, warps, stages, split) in tiles.items():
        x = torch.randn(m, 2880, generator=g, device="cuda").to(torch.bfloat16)
        logits = torch.randn(m, 128, generator=g, device="cuda")
        outs = []
        # (chunks per step, wgmma chunks in flight): four chunks waited one by one as well;
        # the prefill tile's fragments are 4x larger, so at most two chunks there.
        variants = ((1, None), (2, None), (4, None), (4, 1))
        for chunks, in_flight in variants if block_t == 8 else variants[:2]:
            out = torch.empty_like(x)
            tile = FragmentConfig(
                block_w, block_t, warps, stages, split, chunks, mma_in_flight=in_flight
            )
            with pin_config(HOPPER, tile):
                spec.fn.apply(plan, x, prepared, router_logits=logits, out=out)
            outs.append(out)
        for out in outs[1:]:
            assert torch.equal(outs[0], out), f"M={m}"


@pytest.mark.gpu
def test_wgmma_row_blocks_may_overhang_the_padded_rows():
    """256-row blocks over GEMM2's 2944 rows (H padded to 128): the last block of the last
    expert reads no byte past the weights, scales or bias, and every row block multiplies in
    the same order as 128-row ones: bit for bit the same output."""
    spec, plan, prepared = _wgmma_gpt_oss_layer()
    g = torch.Generator(device="cuda").manual_seed(5)
    m = 300
    x = torch.randn(m, 2880, generator=g, device="cuda").to(torch.bfloat16)
    logits = torch.randn(m, 128, generator=g, device="cuda")
    logits[:, 127] += 100.0  # every token selects the last expert, whose rows end the tensors
    outs = []
    for tile in (FragmentConfig(128, 64, 4, 4), FragmentConfig(256, 64, 8, 3)):
        out = torch.empty_like(x)
        with pin_config(HOPPER, tile):
            spec.fn.apply(plan, x, prepared, router_logits=logits, out=out)
        torch.cuda.synchronize()
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.gpu
def test_wgmma_takes_the_weights_through_their_strides():
    """The prepared words and scales are stored panel-major (a ring step's copy is one block of
    memory); the same tensors stored row-major give bit for bit the same output, at the decode
    tiles and the prefill tile."""
    spec, plan, prepared = _wgmma_gpt_oss_layer()
    row_major = dict(prepared.tensors)
    for name in ("w13", "w2", "w13_scale", "w2_scale"):
        t = row_major[name]
        row_major[name] = t.reshape(t.shape[0], t.shape[1] * t.shape[2], -1)
        assert row_major[name].is_contiguous() and not t.is_contiguous(), name
    g = torch.Generator(device="cuda").manual_seed(4)
    for m in (1, 4, 300):
        x = torch.randn(m, 2880, generator=g, device="cuda").to(torch.bfloat16)
        logits = torch.randn(m, 128, generator=g, device="cuda")
        outs = [torch.empty_like(x) for _ in range(2)]
        for tensors, out in zip((prepared.tensors, row_major), outs, strict=True):
            moe_forward_sm90(x, tensors, top_k=4, out=out, router_logits=logits)
        assert torch.equal(outs[0], outs[1]), f"M={m}"


@pytest.mark.gpu
def test_wgmma_programmatic_dependent_launch_changes_nothing():
    """With programmatic dependent launch each kernel starts while the previous one finishes
    (GEMM2 streams its first weights, then waits for GEMM1's grid, or for its tile's GEMM1
    CTAs on counters the router zeroes): the output is bit for bit that of plain launches, for
    one call and for calls back to back on one stream (each finds the last one's counters)."""
    spec, plan, prepared = _wgmma_gpt_oss_layer()
    g = torch.Generator(device="cuda").manual_seed(3)
    # Decode tiles up to 16 tokens (128 rows from M=8), and the prefill tile at M=64. Tile
    # counters only where the one-program router zeroes them (up to FUSED_MAX_PAIRS pairs).
    decode = dict(block_w=64, block_t=8, num_warps=4, gemm2_split_k=2)
    tiles = {
        1: dict(decode, stages=2, chunks=4),
        4: dict(decode, stages=2, chunks=4, mma_in_flight=1),
        8: dict(block_w=128, block_t=8, num_warps=4, stages=3),
        16: dict(decode, stages=3, chunks=2),
        64: dict(block_w=128, block_t=64, num_warps=4, stages=4),
    }
    for m, tile in tiles.items():
        xs = [torch.randn(m, 2880, generator=g, device="cuda").to(torch.bfloat16) for _ in range(3)]
        logits = [torch.randn(m, 128, generator=g, device="cuda") for _ in range(3)]
        results = []
        # Plain launches; GEMM2 waiting for GEMM1's grid; GEMM2 waiting tile by tile.
        waits = ((False, False), (True, False), (True, True))
        for pdl, tile_ready in waits if m * 4 <= FUSED_MAX_PAIRS else waits[:2]:
            outs = [torch.empty_like(x) for x in xs]
            with pin_config(HOPPER, FragmentConfig(**tile, pdl=pdl, tile_ready=tile_ready)):
                for x, lg, out in zip(xs, logits, outs, strict=True):
                    spec.fn.apply(plan, x, prepared, router_logits=lg, out=out)
            results.append(outs)
        for variant in results[1:]:
            for i, (plain, overlapped) in enumerate(zip(results[0], variant, strict=True)):
                assert torch.equal(plain, overlapped), f"M={m}, call {i}"


@pytest.mark.gpu
def test_wgmma_narrow_tiles_change_nothing():
    """Tiles of at most narrow_t tokens in a launch of narrower MMAs of their own (each GEMM
    in two launches; under dependent launch the narrow one starts while the full-tile one
    runs): bit for bit the output of one launch, with plain and dependent launches, for calls
    back to back. Skewed routing gives experts with one token, a few, exactly narrow_t,
    just over it, a whole tile and more than one; even routing at M=300 leaves every tile
    narrow, and at M=2048 (each expert exactly one 64-token tile) none. Skewed routing gives
    expert 0 one token: the narrow launch's first CTA has a tile, and under dependent launch
    its last only waits. The narrow launch on a ring of its own depth (narrow_stages) too."""
    spec, plan, prepared = _wgmma_gpt_oss_layer()
    g = torch.Generator(device="cuda").manual_seed(6)
    cases = (
        (256, (128, 16, 4, 4), (8,), "skewed"),
        (400, (128, 32, 4, 4), (16,), "skewed"),
        (300, (128, 64, 4, 4), (32, 16), "skewed"),
        (1100, (128, 128, 4, 2), (64, 32, (64, 4)), "skewed"),
        (300, (128, 64, 4, 4), (32,), "even"),
        (2048, (128, 64, 4, 4), (32,), "whole tiles"),
    )
    for m, tile, narrows, routing in cases:
        xs = [torch.randn(m, 2880, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2)]
        logits = [torch.randn(m, 128, generator=g, device="cuda") for _ in range(2)]
        if routing == "skewed":
            # Expert e is the first choice of `count` tokens of its own (of up to three, past
            # M tokens): sizes around the tile widths.
            first = 0
            for e, count in enumerate((1, 5, 16, 17, 32, 33, 64, 65, 128, 129, 200)):
                tokens = torch.arange(first, first + count, device="cuda") % m
                for lg in logits:
                    lg[tokens, e] += 30.0
                first += count
        if routing == "whole tiles":
            # Token t picks experts 4t .. 4t + 3 (mod 128): 64 tokens each.
            picks = (
                4 * torch.arange(m, device="cuda")[:, None] + torch.arange(4, device="cuda")
            ) % 128
            for lg in logits:
                lg.scatter_add_(1, picks, torch.full((m, 4), 30.0, device="cuda"))
        for pdl in (False, True):
            results = []
            for narrow in (0, *narrows):
                # narrow_t, or (narrow_t, narrow_stages)
                narrow_t, narrow_stages = narrow if isinstance(narrow, tuple) else (narrow, 0)
                outs = [torch.empty_like(x) for x in xs]
                config = FragmentConfig(
                    *tile, pdl=pdl, narrow_t=narrow_t, narrow_stages=narrow_stages
                )
                with pin_config(HOPPER, config):
                    for x, lg, out in zip(xs, logits, outs, strict=True):
                        spec.fn.apply(plan, x, prepared, router_logits=lg, out=out)
                results.append(outs)
            for narrow, variant in zip(narrows, results[1:], strict=True):
                for i, (one, split) in enumerate(zip(results[0], variant, strict=True)):
                    assert torch.equal(one, split), (
                        f"M={m} ({routing}), narrow {narrow}, pdl={pdl}, call {i}"
                    )


@pytest.mark.gpu
def test_wgmma_warp_specialized_gemms_change_nothing():
    """GEMM1's full tiles in the warp-specialized persistent kernel (a producer warpgroup, two
    consumers on 256 rows, a 4-step mbarrier ring), and GEMM2's too: bit for bit the fragment
    kernel's output
    with and without dependent launch and narrow tiles, for calls back to back. Skewed routing
    gives experts with one token up to more than one tile; the whole layer (45 consumers' rows:
    the last 256-row block's second consumer is all padding), rank 0's TP=8 shard (3 blocks),
    the last TP=8 shard (I = 192: 1.5 blocks), TP=2 and TP=4 shards (2I = 2880 and 1344: a
    consumer's rows half real, half padding), an expert-parallel rank (local experts 32-63) and
    fp8 activations with a static scale (GEMM1 quantizes its own rows) and per-row scales
    (float32 rows for the pass); M=5 leaves most persistent CTAs without work, M=300 with
    narrow_t 32 leaves every tile to the narrow launch. Each variant starts on NaN-filled
    scratch. With fit_widths its tiles of up to 64 and 96 tokens (33, 64, 65 here) multiply 64
    and 64 + 32 columns, bit for bit the same.
    GEMM2 warp-specialized (on fp16 rows: here every layer but the fp8 ones, whose GEMM2 stays
    on the fragment kernel) covers H = 2880 rows in 11.25 blocks, the TP=8 shards' three K
    chunks and the whole layer's 23, into float32 pair rows, and with half_pair_rows into the
    TP=4 and TP=8 shards' fp16 ones (each consumer staging its tile, a 3-step ring). On 132
    SMs GEMM2's 12 blocks and the TP shards' GEMM1 blocks turn by the tile across the
    persistent CTAs (rotates_row_blocks); the whole layer's 23 GEMM1 blocks do not. With
    narrow_t they stride over routing's list of the other tiles (full_tiles; at M=300 with
    narrow_t 32 an empty one), without it over every tile."""
    config = MoEConfig(**GPT_OSS_120B, weight_format="mxfp4", activation_format="bf16")
    spec = get_kernel("moe_apply", HOPPER)
    if spec.platforms[0].mismatch(platform_of(torch.device("cuda"))):
        pytest.skip("no wgmma on this GPU")
    weights = gpt_oss_weights()
    layers = {
        "whole": (config, weights),
        "tp8 rank 0": tensor_parallel_shard(config, weights, rank=0, world_size=8),
        "tp8 rank 7": tensor_parallel_shard(config, weights, rank=7, world_size=8),
        "tp2 rank 1": tensor_parallel_shard(config, weights, rank=1, world_size=2),
        "tp4 rank 3": tensor_parallel_shard(config, weights, rank=3, world_size=4),
        "ep4 rank 1": expert_parallel_shard(config, weights, rank=1, world_size=4),
    }
    fp8 = MoEConfig(**GPT_OSS_120B, weight_format="mxfp4", activation_format="fp8")
    for static in (True, False):
        layers[f"fp8 static={static}"] = (fp8, gpt_oss_weights("fp8", static=static))
    g = torch.Generator(device="cuda").manual_seed(17)
    for name, (layer_config, layer_weights) in layers.items():
        plan = moe_plan_for(spec, layer_config, 4096, "cuda")
        prepared = spec.fn.prepare_weights(plan, layer_weights)
        for m, narrows in ((1100, (0, 32)), (5, (32,)), (300, (32,))):
            xs = [torch.randn(m, 2880, generator=g, device="cuda").to(torch.bfloat16)]
            xs.append(torch.randn(m, 2880, generator=g, device="cuda").to(torch.bfloat16))
            logits = [torch.randn(m, 128, generator=g, device="cuda") for _ in xs]
            first = 0
            for e, count in enumerate((1, 5, 16, 17, 32, 33, 64, 65, 128, 129, 200)):
                tokens = torch.arange(first, first + count, device="cuda") % m
                for lg in logits:
                    lg[tokens, 32 + e] += 30.0  # experts the EP rank holds
                first += count
            for narrow_t in narrows:
                for pdl in (False, True):
                    results = []
                    # (warp_specialized, fit_widths, warp_specialized_gemm2, half_pair_rows)
                    variants = ((False, False, False, False), (True, False, False, False),
                                (True, True, False, False), (True, True, True, False),
                                (False, False, False, True), (True, False, True, True),
                                (True, True, True, True))  # fmt: skip
                    for ws, fit_widths, ws2, half in variants:
                        tile = FragmentConfig(
                            128, 128, 4, 2, pdl=pdl, narrow_t=narrow_t, warp_specialized=ws,
                            warp_specialized_gemm2=ws2, fit_widths=fit_widths,
                            half_pair_rows=half,
                        )  # fmt: skip
                        outs = [torch.empty_like(x) for x in xs]
                        # NaN in every scratch buffer: a variant that left rows unwritten
                        # cannot pass on the rows the variant before it left there.
                        workspace.poison_scratch()
                        with pin_config(HOPPER, tile):
                            for x, lg, out in zip(xs, logits, outs, strict=True):
                                spec.fn.apply(plan, x, prepared, router_logits=lg, out=out)
                        results.append(outs)
                    for i, outs in enumerate(zip(*results, strict=True)):
                        plain, ws1, fitted, ws2, half_plain, half_ws2, half_fitted = outs
                        case = f"{name} M={m} narrow_t={narrow_t} pdl={pdl} call {i}"
                        assert torch.equal(plain, ws1), case
                        assert torch.equal(plain, fitted), f"{case}, fit_widths"
                        assert torch.equal(plain, ws2), f"{case}, GEMM2 too"
                        assert torch.equal(half_plain, half_ws2), f"{case}, fp16 pair rows"
                        assert torch.equal(half_plain, half_fitted), f"{case}, fp16 fitted"
        del prepared


def _wgmma_tp8_shard():
    """The Hopper kernel planned and prepared for rank 0's TP=8 shard of GPT-OSS-120B, and the
    reference's output for it: (spec, plan, prepared, reference_out(x, logits))."""
    config = MoEConfig(**GPT_OSS_120B, weight_format="mxfp4", activation_format="bf16")
    spec = get_kernel("moe_apply", HOPPER)
    if spec.platforms[0].mismatch(platform_of(torch.device("cuda"))):
        pytest.skip("no wgmma on this GPU")
    shard_config, shard = tensor_parallel_shard(config, gpt_oss_weights(), rank=0, world_size=8)
    plan = moe_plan_for(spec, shard_config, 4096, "cuda")
    prepared = spec.fn.prepare_weights(plan, shard)
    reference = get_kernel("moe_apply", "reference.moe_apply")
    ref_plan = moe_plan_for(reference, shard_config, 4096, "cuda")
    ref_prepared = reference.fn.prepare_weights(ref_plan, shard)

    def reference_out(x, logits):
        expected = torch.empty_like(x)
        reference.fn.apply(ref_plan, x, ref_prepared, router_logits=logits, out=expected)
        return expected

    return spec, plan, prepared, reference_out


@pytest.mark.gpu
def test_wgmma_fp16_pair_rows_stay_within_the_tolerance_at_any_row_magnitude():
    """GEMM2's pair rows in fp16 (the prefill tiles of a TP=8 shard), pairs with a row element
    at or above the bound kept exact in float32: against the reference at the bf16 tolerance
    for x scaled so that the rows range from well below the bound to far above it, where the
    SwiGLU clamp saturates and the rows cancel; with the rows below the bound not bit for bit
    the float32 rows' output (fp16 was taken)."""
    spec, plan, prepared, reference_out = _wgmma_tp8_shard()
    g = torch.Generator(device="cuda").manual_seed(9)
    tiles = ((300, (128, 64, 4, 4)), (1100, (128, 128, 4, 2)))
    for m, tile in tiles:
        logits = torch.randn(m, 128, generator=g, device="cuda")
        base = torch.randn(m, 2880, generator=g, device="cuda")
        for scale in (0.25, 1.0, 8.0, 2.0**12):
            x = (base * scale).to(torch.bfloat16)
            expected = reference_out(x, logits)
            outs = []
            for half in (True, False):
                out = torch.empty_like(x)
                tile_config = FragmentConfig(*tile, pdl=True, narrow_t=32, half_pair_rows=half)
                with pin_config(HOPPER, tile_config):
                    spec.fn.apply(plan, x, prepared, router_logits=logits, out=out)
                outs.append(out)
            name = f"out (M={m}, x * {scale})"
            assert_close(outs[0], expected, dtype=torch.bfloat16, name=name)
            if scale <= 1.0:  # rows below the bound: the fp16 rows were taken
                assert not torch.equal(outs[0], outs[1]), name


@pytest.mark.gpu
def test_wgmma_fp16_pair_rows_keep_a_tokens_output_independent_of_its_tile_neighbours():
    """Which tokens share a GEMM2 tile depends on the rest of the batch and on where a token
    stands in it: with fp16 pair rows (TP=8 shard) each element still takes fp16 or float32
    on its own value alone. Tokens far past the bound mixed at random with tokens
    well below it, routed onto a few experts so that each spans several tiles: permuting the
    batch permutes the output bit for bit, at the 64- and 128-token tiles with their narrow
    launches, and the output matches the reference."""
    spec, plan, prepared, reference_out = _wgmma_tp8_shard()
    g = torch.Generator(device="cuda").manual_seed(13)
    m = 700
    logits = torch.randn(m, 128, generator=g, device="cuda")
    logits[:, :6] += 4.0  # most pairs on six experts: several tiles each
    large = torch.rand(m, generator=g, device="cuda") < 0.3
    scale = torch.where(large, 16.0, 0.25)
    x = (torch.randn(m, 2880, generator=g, device="cuda") * scale[:, None]).to(torch.bfloat16)
    perm = torch.randperm(m, generator=g, device="cuda")
    expected = reference_out(x, logits)
    for tile in ((128, 64, 4, 4, 32), (128, 128, 4, 2, 64)):
        tile_config = FragmentConfig(*tile[:4], pdl=True, narrow_t=tile[4], half_pair_rows=True)
        out, permuted = torch.empty_like(x), torch.empty_like(x)
        with pin_config(HOPPER, tile_config):
            spec.fn.apply(plan, x, prepared, router_logits=logits, out=out)
            spec.fn.apply(plan, x[perm], prepared, router_logits=logits[perm], out=permuted)
        assert_close(out, expected, dtype=torch.bfloat16, name=f"out ({tile_config})")
        assert torch.equal(permuted, out[perm]), f"permuted batch ({tile_config})"


@pytest.mark.gpu
def test_wgmma_post_scaling_matches_the_reference_across_row_magnitudes():
    """Post-scaled decode tiles (raw weight halves times x rows the router scaled by powers of
    two, the e8m0 factors on the fp32 partials of block-diagonal activations): rows as large
    as 2^100 and as small as 2^-30, and all-zero rows, next to ordinary ones, match the
    reference; with and without dependent launch, waiting for the grid or tile by tile, one
    or two chunks in flight."""
    spec, plan, prepared = _wgmma_gpt_oss_layer()
    assert (prepared.tensors["w13_decode"], prepared.tensors["w2_decode"]) == ("bf16", "fp16")
    config = MoEConfig(**GPT_OSS_120B, weight_format="mxfp4", activation_format="bf16")
    reference = get_kernel("moe_apply", "reference.moe_apply")
    ref_plan = moe_plan_for(reference, config, 4096, "cuda")
    ref_prepared = reference.fn.prepare_weights(ref_plan, gpt_oss_weights())
    g = torch.Generator(device="cuda").manual_seed(5)
    post = dict(block_w=64, block_t=2, num_warps=4, stages=2, gemm2_split_k=2, chunks=4)
    tiles = (
        FragmentConfig(**post, mma_in_flight=1, post_scale=True),
        FragmentConfig(**post, pdl=True, mma_in_flight=2, post_scale=True),
        FragmentConfig(**post, pdl=True, tile_ready=True, mma_in_flight=1, post_scale=True),
    )
    row_scales = torch.tensor([2.0**100, 1.0, 2.0**-30, 0.0], device="cuda")
    for m in (1, 4, 16):
        x = torch.randn(m, 2880, generator=g, device="cuda") * row_scales.repeat(4)[:m, None]
        x = x.to(torch.bfloat16)
        logits = torch.randn(m, 128, generator=g, device="cuda")
        expected = torch.empty_like(x)
        reference.fn.apply(ref_plan, x, ref_prepared, router_logits=logits, out=expected)
        for tile in tiles:
            out = torch.empty_like(x)
            with pin_config(HOPPER, tile):
                spec.fn.apply(plan, x, prepared, router_logits=logits, out=out)
            assert_close(out, expected, dtype=torch.bfloat16, name=f"out (M={m}, {tile})")


def test_dynamic_fp8_quantizes_only_the_rows_the_gemm_wrote():
    """GEMM1's output scratch holds whole tiles; rows past a tile's end and tiles past the
    count are never written, so the dynamic quantizer leaves them alone (reading them was
    compute-sanitizer initcheck's one finding) and quantizes the rest exactly as untiled."""
    from tokenspeed_kernel_triton.moe.quant import quantize_rows

    tile_m, n = 4, 48
    gen = generator("quant-tiles")
    act = torch.randn(4 * tile_m, n, generator=gen)
    # Two used tiles: rows 0..2 (tile 0 ends at row 3), rows 4..7 (tile 1 full); tiles 2, 3 unused.
    tiles = torch.tensor([0, 3, 1, 8, 0, 0, 0, 0], dtype=torch.int32)
    num_tiles = torch.tensor([2], dtype=torch.int32)
    written = torch.tensor([0, 1, 2, 4, 5, 6, 7])
    act[3], act[8:] = float("nan"), float("inf")
    act, tiles, num_tiles, written = (t.to(DEVICE) for t in (act, tiles, num_tiles, written))
    want_q, want_scale = (t.clone() for t in quantize_rows(act[written], None, "test_plain"))
    q, scale = quantize_rows(act, None, "test_tiled", (tiles, num_tiles, tile_m))
    scale.fill_(-1.0)
    q.view(torch.uint8).fill_(0x7F)
    q, scale = quantize_rows(act, None, "test_tiled", (tiles, num_tiles, tile_m))
    assert torch.equal(q[written].view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale[written], want_scale)
    skipped = torch.tensor([3, *range(8, 16)], device=DEVICE)
    assert (scale[skipped] == -1.0).all()
    assert (q[skipped].view(torch.uint8) == 0x7F).all()


def test_quantized_rows_stored_as_half_values_are_the_e4m3_values():
    """The Hopper kernel's fp8 operands: e4m3 values stored exactly as bf16 (x) or written
    into a bf16 [hi | lo] buffer's hi with lo zeroed (the SwiGLU intermediate), the same
    values and scales as the fp8 quantization, dynamic and static."""
    from tokenspeed_kernel_triton.moe.quant import quantize_rows

    gen = generator("quant-half-values")
    x = torch.randn(5, 40, generator=gen) * torch.tensor([1e-3, 1.0, 30.0, 600.0, 1e5])[:, None]
    x = x.to(DEVICE)
    for static in (None, 0.5):
        q8, scale8 = quantize_rows(x, static, "test_fp8")
        want = q8.float()
        q16, scale16 = quantize_rows(x, static, "test_bf16", values_as=torch.bfloat16)
        assert q16.dtype == torch.bfloat16 and torch.equal(q16.float(), want)
        assert torch.equal(torch.as_tensor(scale16), torch.as_tensor(scale8))
        pairs = torch.full((5, 2 * 48), -7.0, dtype=torch.bfloat16, device=DEVICE)  # [hi | lo]
        quantize_rows(x, static, "test_hilo", into=pairs, lo_offset=48)
        assert torch.equal(pairs[:, :40].float(), want)
        assert (pairs[:, 48:88] == 0).all()
        assert (pairs[:, 40:48] == -7).all() and (pairs[:, 88:] == -7).all()
