"""Triton MoE on tensor- and expert-parallel shards: the routing groups only a rank's experts,
pairs of other ranks' experts give exact zeros, tensor-parallel shard sizes (GPT-OSS-120B's
I = 2880 split 2/4/8 ways in whole scale groups) pad correctly, each shard matches the reference
on that shard, and the shards' bf16 outputs sum to the unsharded layer within their rounding
(CPU through the interpreter at small shapes; GPT-OSS-120B on the GPU); a damaged shard fails
the sum."""

from __future__ import annotations

import pytest
import torch

import tokenspeed_kernel as tk
from tokenspeed_kernel.ops.moe.reference import topk_softmax
from tokenspeed_kernel.platform import platform_of
from tokenspeed_kernel.registry import get_kernel
from tokenspeed_kernel.testing import assert_close, moe_plan_for, tolerance
from tokenspeed_kernel.testing.inputs import MoEShape, generator, moe_inputs, moe_weights
from tokenspeed_kernel.tuning import pin_config
from tokenspeed_kernel_triton.moe import routing as triton_routing
from tokenspeed_kernel_triton.moe.moe import MoETileConfig
from tokenspeed_kernel_triton.moe.routing import max_tiles, route

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
KERNEL = "triton.moe_apply"
HOPPER = "triton.moe_apply.sm90"
# Wide N blocks: the interpreter runs one numpy program per tile, so fewer programs are faster.
WIDE = MoETileConfig(16, 256, 128, 128, 4, 1)


def _layer(shape: MoEShape, device=DEVICE):
    weights = moe_weights(shape, generator("moe-parallel", shape))
    x, routing = moe_inputs(shape, generator("moe-parallel-inputs", shape))
    weights = tk.MoEWeights(
        **{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(weights).items()}
    )
    routing = {k: None if v is None else v.to(device) for k, v in routing.items()}
    return shape.config(), weights, x.to(device), routing


def _layer_fn(kernel: str, config, weights, max_tokens: int, device):
    """`kernel` planned and prepared for the layer: a function (x, routing) -> out."""
    spec = get_kernel("moe_apply", kernel)
    plan = moe_plan_for(spec, config, max_tokens, device)
    prepared = spec.fn.prepare_weights(plan, weights)

    def apply(x, routing):
        out = torch.full_like(x, float("nan"))
        spec.fn.apply(plan, x, prepared, out=out, **routing)
        return out

    return apply


def _run(kernel: str, config, weights, x, routing) -> torch.Tensor:
    return _layer_fn(kernel, config, weights, max(1, x.shape[0]), x.device)(x, routing)


def half_step(t: torch.Tensor) -> torch.Tensor:
    """Half a bf16 ulp of each value (float64): 2^(floor(log2|t|) - 8), 0 at 0 (bf16 keeps 8
    significant bits, so values in [2^e, 2^(e+1)) are 2^(e-7) apart)."""
    t = t.detach().to(torch.float64)
    _, exponent = torch.frexp(t)  # |t| = m 2^exponent, m in [0.5, 1)
    return torch.where(t == 0, 0.0, torch.ldexp(torch.ones_like(t), exponent - 9))


def sum_allowance(partials, expected: torch.Tensor) -> torch.Tensor:
    """Per-element bound on |sum(partials) - expected| for bf16 partials of a sharded layer.

    p_i* is shard i's output before its bf16 rounding, y* the unsharded one's. Sharding only
    regroups exact sums (TP splits GEMM2's sum over I, w2's bias on one rank; EP splits the sum
    over the top-k pairs), so sum(p_i*) and y* differ by float32 accumulation order alone, well
    inside atol + rtol |y|. Each shard then rounds: |p_i - p_i*| <= half_step(p_i) (rounding
    never moves a value to a lower binade, so the rounded value's half step bounds it); the
    float32 sum of <= 8 bf16 values adds ~2^-24 of their magnitude (negligible); the unsharded
    output rounds once more: |y - y*| <= half_step(y). Hence

        |sum(p_i) - y| <= atol + rtol |y| + sum_i half_step(p_i) + half_step(y).

    The rounding terms follow the partials, not y: where the shards cancel (|p_i| >> |y|) they
    dominate, which a tolerance on |y| alone misses."""
    tol = tolerance(torch.bfloat16)
    y = expected.detach().to(torch.float64)
    rounding = sum(half_step(p) for p in partials) + half_step(y)
    return tol.atol + tol.rtol * y.abs() + rounding.to(y.device)


def check_sum(partials, expected: torch.Tensor, name: str) -> None:
    """The shards' bf16 outputs, summed in float32, against the unsharded output within
    `sum_allowance`; AssertionError naming the worst element otherwise."""
    total = torch.stack([p.float() for p in partials]).sum(0).to(torch.float64).cpu()
    allowance = sum_allowance([p.cpu() for p in partials], expected.cpu())
    want = expected.detach().to(torch.float64).cpu()
    err = (total - want).abs().nan_to_num(nan=torch.inf)
    bad = err > allowance
    if bad.any():
        flat = int((err - allowance).reshape(-1).argmax())
        at = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), err.shape))
        raise AssertionError(
            f"{name}: {int(bad.sum())}/{err.numel()} outside the sum allowance; max abs "
            f"{float(err.max()):.3e}; worst at {at}: got {float(total[at]):.6g}, expected "
            f"{float(want[at]):.6g}, allowance {float(allowance[at]):.3e}, partials "
            f"{[float(p[at]) for p in partials]}"
        )


def _shard_outputs(kernel, config, weights, split, world_size, x, routing) -> list:
    """Each rank's `kernel` output, checked against the reference on that same shard."""
    outputs = []
    for rank in range(world_size):
        shard_config, shard = split(config, weights, rank=rank, world_size=world_size)
        out = _run(kernel, shard_config, shard, x, routing)
        ref = _run("reference.moe_apply", shard_config, shard, x, routing)
        assert_close(out, ref, dtype=torch.bfloat16, name=f"rank {rank} of {world_size}")
        outputs.append(out)
    return outputs


@pytest.mark.parametrize("small_blocks", [False, True])
@pytest.mark.parametrize("precomputed", [False, True])
@pytest.mark.parametrize("tokens,top_k", [(5, 2), (70, 4), (1500, 2)])
def test_routing_groups_only_the_local_experts(
    tokens, top_k, precomputed, small_blocks, monkeypatch
):
    """Experts 5..10 of 16: tiles name local experts 0..5 in order, every local pair once,
    no other pair, each expert's pairs in pair order (a stable sort); the one-program (10
    pairs) and multi-kernel (280 and 3000 pairs) routers, from logits or from precomputed ids
    with -1 and ids past E among them. The multi-kernel router's blocks at their default size
    (3 blocks at 280 pairs, which the scatter sums itself; 24 at 3000, summed by the align
    kernel) and at 8 pairs (35 and 375 blocks), 4 experts an align program and 4 blocks a
    step (many programs, many steps). Every entry of the tile table and every sorted row is
    written on each call, the unused ones with 0 (the GEMMs read whole tiles): a second call
    into the same buffers, filled with -7 in between, leaves none of it. Each local expert's
    narrow tile (its last, if it holds at most 2 of the 4 rows; else -1) is written too."""
    if small_blocks:
        monkeypatch.setattr(triton_routing, "_BLOCK_PAIRS", 8)
        monkeypatch.setattr(triton_routing, "_COUNTS_PER_LOAD", 16)
        monkeypatch.setattr(triton_routing, "_ALIGN_EXPERTS", 4)
    gen = generator("moe-ep-routing", tokens, top_k)
    logits = torch.randn(tokens, 16, generator=gen).to(DEVICE)
    given = (None, None)
    if precomputed:
        given_w, given_ids = topk_softmax(logits, top_k)
        given_ids = given_ids.to(torch.int32)
        given_ids[::3, 0] = -1
        given_ids[1::7, -1] = 16
        given, logits = (given_w, given_ids), None

    narrow_tiles = torch.empty(6, dtype=torch.int32, device=DEVICE)
    full_tiles = torch.empty(1 + max_tiles(tokens * top_k, 6, 4), dtype=torch.int32, device=DEVICE)

    def routed():
        return route(
            logits, *given, top_k=top_k, num_experts=16, block_m=4, expert_offset=5,
            num_local_experts=6, narrow=(narrow_tiles, 2, full_tiles),
        )  # fmt: skip

    # sorted pairs, tiles, narrow tiles, full tiles
    for buffer in (*routed()[2:4], narrow_tiles, full_tiles):
        buffer.fill_(-7)
    weights, ids, sorted_pairs, tiles, num_tiles, bound = routed()
    assert (sorted_pairs != -7).all() and (tiles != -7).all()
    last_tiles = {}
    for t in range(int(num_tiles)):
        expert, row_end = (int(v) for v in tiles[t].cpu())
        last_tiles[expert] = (t, row_end - 4 * t)
    narrow = [last_tiles[e][0] if last_tiles.get(e, (0, 4))[1] <= 2 else -1 for e in range(6)]
    assert narrow_tiles.cpu().tolist() == narrow
    full = [t for t in range(int(num_tiles)) if t not in narrow]
    assert full_tiles[: 1 + len(full)].cpu().tolist() == [len(full), *full]
    flat = ids.reshape(-1).long().cpu() - 5
    local = torch.nonzero((flat >= 0) & (flat < 6)).reshape(-1).tolist()
    seen, last = [], -1
    for t in range(int(num_tiles)):
        expert, row_end = (int(v) for v in tiles[t].cpu())
        assert last <= expert < 6
        last = expert
        rows = sorted_pairs[t * 4 : min((t + 1) * 4, row_end)].long().cpu()
        assert len(rows) and torch.all(flat[rows] == expert)
        if seen and flat[seen[-1]] == expert:
            rows = torch.cat([torch.tensor(seen[-1:]), rows])
            seen.pop()
        assert torch.all(rows[1:] > rows[:-1]), f"expert {expert}: pairs out of order"
        seen += rows.tolist()
    assert sorted(seen) == local
    assert int(num_tiles) <= bound == max(1, (tokens * top_k + 6 * 3) // 4)


def test_pairs_of_other_ranks_are_exact_zeros():
    """Rows whose every pair is another rank's come out as zeros (no bias, no garbage from
    the unwritten GEMM rows), with precomputed ids and with logits."""
    shape = MoEShape(4, 8, 2, 64, 64, expert_offset=2, num_local_experts=2)
    config, weights, x, _ = _layer(shape)
    ids = torch.tensor([[0, 1], [2, 5], [3, 2], [7, 6]], dtype=torch.int32, device=DEVICE)
    routing = dict(topk_weights=torch.full((4, 2), 0.5, device=DEVICE), topk_ids=ids)
    out = _run(KERNEL, config, weights, x, routing)
    assert torch.count_nonzero(out[0]) == 0 and torch.count_nonzero(out[3]) == 0
    ref = _run("reference.moe_apply", config, weights, x, routing)
    assert_close(out, ref, dtype=torch.bfloat16, name="out")
    logits = torch.full((4, 8), -5.0, device=DEVICE)
    logits[:, 6:] = 5.0  # every token picks experts 6 and 7, none of them here
    out = _run(KERNEL, config, weights, x, dict(router_logits=logits))
    assert torch.count_nonzero(out) == 0


@pytest.mark.parametrize("intermediate", [1440, 736, 672, 384, 192])
def test_tensor_parallel_shard_sizes_pad_correctly(intermediate):
    """GPT-OSS-120B's shards (TP 2: 1440; TP 4: 736, last 672; TP 8: 384, last 192) padded to
    whole 128-channel blocks (1536, 768, 768, 384, 256) match the reference."""
    config, weights, x, routing = _layer(MoEShape(2, 2, 2, 128, intermediate))
    with pin_config(KERNEL, WIDE):
        out = _run(KERNEL, config, weights, x, routing)
    ref = _run("reference.moe_apply", config, weights, x, routing)
    assert_close(out, ref, dtype=torch.bfloat16, name=f"out (I={intermediate})")


def test_gpt_oss_hidden_size_with_the_last_tp8_shard():
    """H = 2880 (padded to 2944) with I = 192 (padded to 256), the TP 8 rank with the rest."""
    config, weights, x, routing = _layer(MoEShape(1, 2, 1, 2880, 192))
    with pin_config(KERNEL, WIDE):
        out = _run(KERNEL, config, weights, x, routing)
    ref = _run("reference.moe_apply", config, weights, x, routing)
    assert_close(out, ref, dtype=torch.bfloat16, name="out")


@pytest.mark.parametrize(
    "shape",
    [
        pytest.param(MoEShape(5, 8, 2, 64, 160), id="mxfp4-logits"),
        pytest.param(MoEShape(4, 8, 4, 64, 96, weight_format="bf16", routing="precomputed"),
                     id="bf16-precomputed"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("mode,world_size", [("tp", 2), ("tp", 3), ("ep", 3)])
def test_shards_sum_to_the_unsharded_layer(shape, mode, world_size):
    config, weights, x, routing = _layer(shape)
    split = tk.tensor_parallel_shard if mode == "tp" else tk.expert_parallel_shard
    outputs = _shard_outputs(KERNEL, config, weights, split, world_size, x, routing)
    ref = _run("reference.moe_apply", config, weights, x, routing)
    check_sum(outputs, ref, name=f"{mode} {world_size}")


def test_expert_parallel_multi_kernel_router_sums():
    """280 pairs (the top-k, align and scatter kernels) over EP 2 ranks of 16 experts."""
    config, weights, x, routing = _layer(MoEShape(70, 16, 4, 64, 64))
    outputs = _shard_outputs(KERNEL, config, weights, tk.expert_parallel_shard, 2, x, routing)
    ref = _run("reference.moe_apply", config, weights, x, routing)
    check_sum(outputs, ref, name="EP 2")


def test_half_step_bounds_bf16_rounding():
    x = torch.randn(4096, generator=generator("moe-half-step"), dtype=torch.float64) * 37
    rounded = x.to(torch.bfloat16)
    assert torch.all((rounded.double() - x).abs() <= half_step(rounded))
    assert half_step(torch.tensor([0.0, 1.0, -1.5, 3.0, 2.0**-20])).tolist() == [
        0.0, 2.0**-8, 2.0**-8, 2.0**-7, 2.0**-28,
    ]  # fmt: skip


def _damage(kind: str, config, shard):
    """One shard broken the way a sharding bug would break it."""
    if kind == "tp-bias-missing":  # rank 0 holds w2's bias: drop it
        return config, tk.MoEWeights(**{**vars(shard), "w2_bias": torch.zeros_like(shard.w2_bias)})
    if kind == "ep-offset-off-by-one":  # the rank's weights meet its neighbour's tokens
        return tk.MoEConfig(**{**vars(config), "expert_offset": config.expert_offset - 1}), shard
    # "ep-expert-dropped": the rank's second expert contributes nothing (zero codes and bias)
    w2, w2_bias = shard.w2.clone(), shard.w2_bias.clone()
    w2[1], w2_bias[1] = 0, 0.0
    return config, tk.MoEWeights(**{**vars(shard), "w2": w2, "w2_bias": w2_bias})


@pytest.mark.parametrize(
    "kind,rank", [("tp-bias-missing", 0), ("ep-offset-off-by-one", 1), ("ep-expert-dropped", 1)]
)
def test_a_damaged_shard_fails_the_sum(kind, rank):
    """The damaged shard still matches the reference on itself (the per-shard check cannot see
    a sharding bug); the sum check must, with the rounding allowance of the partials."""
    config, weights, x, routing = _layer(MoEShape(24, 8, 2, 64, 160))
    split = tk.tensor_parallel_shard if kind.startswith("tp") else tk.expert_parallel_shard
    outputs = []
    for r in range(2):
        shard_config, shard = split(config, weights, rank=r, world_size=2)
        if r == rank:
            shard_config, shard = _damage(kind, shard_config, shard)
        with pin_config(KERNEL, WIDE):
            out = _run(KERNEL, shard_config, shard, x, routing)
        ref = _run("reference.moe_apply", shard_config, shard, x, routing)
        assert_close(out, ref, dtype=torch.bfloat16, name=f"{kind} rank {r}")
        outputs.append(out)
    ref = _run("reference.moe_apply", config, weights, x, routing)
    with pytest.raises(AssertionError, match="outside the sum allowance"):
        check_sum(outputs, ref, name=kind)


# ----------------------------------------------------------------------------- GPU

GPT_OSS_120B = dict(num_experts=128, top_k=4, hidden_size=2880, intermediate_size=2880)


@pytest.fixture(scope="module")
def gpt_oss_layer():
    """GPT-OSS-120B MXFP4 experts built on the GPU (1.7 GB), shared by the GPU tests: random
    e2m1 codes, e8m0 scales aimed at entries ~1/sqrt(K), biases ~0.5."""
    E, H, I = 128, 2880, 2880  # noqa: E741
    g = torch.Generator(device="cuda").manual_seed(0)
    u8 = dict(generator=g, device="cuda", dtype=torch.uint8)

    def mx(rows, cols):
        center = 120  # 127 + log2(1 / (2.9 * sqrt(2880))): random codes have RMS ~2.9
        codes = torch.randint(0, 256, (E, rows, cols // 2), **u8)
        return codes, torch.randint(center - 1, center + 2, (E, rows, cols // 32), **u8)

    w13, s13 = mx(2 * I, H)
    w2, s2 = mx(H, I)
    weights = tk.MoEWeights(
        w13=w13, w2=w2, w13_scale=s13, w2_scale=s2,
        w13_bias=0.5 * torch.randn(E, 2 * I, generator=g, device="cuda"),
        w2_bias=0.5 * torch.randn(E, H, generator=g, device="cuda"),
    )  # fmt: skip
    return tk.MoEConfig(**GPT_OSS_120B), weights


@pytest.fixture(scope="module")
def shard_references():
    """Reference outputs per (mode, world size, rank), shared by both kernels' tests."""
    return {}


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [KERNEL, HOPPER])
@pytest.mark.parametrize("mode,world_size", [(m, n) for m in ("tp", "ep") for n in (2, 4, 8)])
def test_gpt_oss_120b_shards_sum_to_one_gpu(
    gpt_oss_layer, shard_references, kernel, mode, world_size
):
    """TP shards (1440 x 2; 736 x 3 + 672; 384 x 7 + 192) and EP blocks (64/32/16 experts), each
    prepared, run and freed in turn at M = 1, 12, 64, 1024, 3072 (at 12 an EP rank runs the
    decode tiles of its share of the pairs, _common.selection_pairs; at 3072 both GEMMs run
    warp-specialized where GEMM2 writes float32 pair rows, TP=2 and the EP ranks): every shard
    matches the reference on that shard at the bf16 tolerance, and their sum matches the
    unsharded layer on the same kernel within `sum_allowance` (one GPU's result against N ranks'
    bf16 partials)."""
    config, weights = gpt_oss_layer
    spec = get_kernel("moe_apply", kernel)
    if all(p.mismatch(platform_of(torch.device("cuda"))) for p in spec.platforms):
        pytest.skip(f"{kernel} does not run on this GPU")
    g = torch.Generator(device="cuda").manual_seed(7)
    inputs = []
    for m in (1, 12, 64, 1024, 3072):
        x = torch.randn(m, 2880, generator=g, device="cuda").to(torch.bfloat16)
        inputs.append((x, dict(router_logits=torch.randn(m, 128, generator=g, device="cuda"))))
    unsharded = _layer_fn(kernel, config, weights, 3072, "cuda")
    expected = [unsharded(x, routing) for x, routing in inputs]
    del unsharded
    partials = [[] for _ in inputs]
    split = tk.tensor_parallel_shard if mode == "tp" else tk.expert_parallel_shard
    for rank in range(world_size):
        shard_config, shard = split(config, weights, rank=rank, world_size=world_size)
        layer = _layer_fn(kernel, shard_config, shard, 3072, "cuda")
        key = (mode, world_size, rank)
        if key not in shard_references:
            reference = _layer_fn("reference.moe_apply", shard_config, shard, 3072, "cuda")
            shard_references[key] = [reference(x, routing) for x, routing in inputs]
            del reference
        for parts, want, (x, routing) in zip(partials, shard_references[key], inputs, strict=True):
            out = layer(x, routing)
            name = f"{mode} {world_size} rank {rank} M={x.shape[0]}"
            assert_close(out, want, dtype=torch.bfloat16, name=name)
            parts.append(out)
        del shard, layer
    for parts, want, (x, _) in zip(partials, expected, inputs, strict=True):
        check_sum(parts, want, name=f"{mode} {world_size} M={x.shape[0]}")
