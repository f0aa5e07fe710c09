"""Triton MoE on bad device values (CPU through the Triton interpreter): a precomputed
topk_ids entry outside [0, num_experts) (-1 included) makes its (token, slot) pair contribute
nothing, without a read of any expert's weights for it; NaN router logits never pick an id out
of range. Both router paths: the one-program decode router (at most 64 pairs) and the multi-kernel
one beyond."""

from __future__ import annotations

import pytest
import torch

from tokenspeed_kernel.ops.moe.reference import topk_softmax
from tokenspeed_kernel.platform import interpreting, platform_of
from tokenspeed_kernel.registry import get_kernel
from tokenspeed_kernel.testing import assert_close, moe_plan_for
from tokenspeed_kernel.testing.inputs import MoEShape, generator, moe_weights
from tokenspeed_kernel_triton.moe.routing import route

KERNEL = "triton.moe_apply"
DEVICE = "cpu"
# E = 6 pads the routers' expert axis to 8: ids 6 and 7 land in padding columns, which must
# not count as experts either.
NUM_EXPERTS = 6
BAD_IDS = (-1, NUM_EXPERTS, NUM_EXPERTS + 1, 1000, -7, 2**31 - 1)
# The CPU cases hand CPU tensors to the Triton kernels, which run them only through the
# interpreter (what `pytest` sets up); a run that keeps the GPU has the GPU case below.
on_the_interpreter = pytest.mark.skipif(
    not interpreting(), reason="CPU tensors through the Triton interpreter"
)


def _ids_with_bad_entries(tokens: int, top_k: int, seed: str):
    gen = generator("moe-bad-ids", seed)
    ids = torch.stack(
        [torch.randperm(NUM_EXPERTS, generator=gen)[:top_k] for _ in range(tokens)]
    ).to(torch.int32)
    bad = torch.rand(tokens, top_k, generator=gen) < 0.3
    bad[0, :] = True  # a token with no valid pair at all
    choices = torch.tensor(BAD_IDS, dtype=torch.int32)
    ids[bad] = choices[torch.randint(0, len(BAD_IDS), (int(bad.sum()),), generator=gen)]
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    return weights, ids, bad


@on_the_interpreter
@pytest.mark.parametrize("tokens,top_k", [(5, 2), (70, 4)])
def test_routing_leaves_out_of_range_ids_out(tokens, top_k):
    weights, ids, bad = _ids_with_bad_entries(tokens, top_k, "route")
    _, _, sorted_pairs, tiles, num_tiles, _ = route(
        None, weights, ids, top_k=top_k, num_experts=NUM_EXPERTS, block_m=16
    )
    flat = ids.reshape(-1).long()
    seen = []
    for t in range(int(num_tiles)):
        expert, row_end = (int(v) for v in tiles[t])
        assert 0 <= expert < NUM_EXPERTS
        rows = sorted_pairs[t * 16 : min((t + 1) * 16, row_end)].long()
        assert torch.all(flat[rows] == expert)
        seen += rows.tolist()
    assert sorted(seen) == torch.nonzero(~bad.reshape(-1)).reshape(-1).tolist()


@on_the_interpreter
@pytest.mark.parametrize(
    "tokens,top_k,block_m", [(1, 4, 2), (5, 2, 16), (16, 4, 8), (16, 4, 2), (70, 4, 16)]
)
def test_routing_writes_every_entry_the_gemms_read(monkeypatch, tokens, top_k, block_m):
    """The GEMMs read a whole tile's table entry and sorted rows before knowing whether the
    tile exists or where it ends: tiles past num_tiles and the padding rows of each tile hold 0,
    not whatever the allocation held (compute-sanitizer initcheck)."""
    weights, ids, bad = _ids_with_bad_entries(tokens, top_k, "write-all")
    real_empty = torch.empty

    def filled_empty(*args, **kwargs):
        return real_empty(*args, **kwargs).fill_(-12345)

    monkeypatch.setattr(torch, "empty", filled_empty)
    _, _, sorted_pairs, tiles, num_tiles, bound = route(
        None, weights, ids, top_k=top_k, num_experts=NUM_EXPERTS, block_m=block_m
    )
    monkeypatch.undo()
    n = int(num_tiles)
    assert (tiles[n:] == 0).all() and (tiles[:n] >= 0).all()
    assert sorted_pairs.numel() == bound * block_m
    for t in range(bound):
        rows = sorted_pairs[t * block_m : (t + 1) * block_m]
        filled = max(0, min(block_m, int(tiles[t, 1]) - t * block_m)) if t < n else 0
        assert (rows[filled:] == 0).all(), f"tile {t}: padding rows {rows[filled:].tolist()}"
        assert (rows[:filled] >= 0).all()


def check_bad_ids_against_reference(spec, tokens: int, top_k: int, hidden: int, device: str):
    """Run `spec` on ids with bad entries and compare with the reference on the valid pairs
    only: the bad pairs there point at expert 0 with weight 0, which contributes nothing."""
    shape = MoEShape(tokens, NUM_EXPERTS, top_k, hidden, hidden)
    config = shape.config()
    weights = moe_weights(shape, generator("moe-bad-ids-layer", shape))
    weights = type(weights)(
        **{k: v.to(device) if torch.is_tensor(v) else v for k, v in vars(weights).items()}
    )
    plan = moe_plan_for(spec, config, tokens, device)
    prepared = spec.fn.prepare_weights(plan, weights)
    gen = generator("moe-bad-ids-x", tokens)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).to(device)
    topk_weights, ids, bad = (t.to(device) for t in _ids_with_bad_entries(tokens, top_k, tokens))
    out = torch.full_like(x, float("nan"))
    spec.fn.apply(
        plan, x, prepared, router_logits=None, topk_weights=topk_weights, topk_ids=ids, out=out
    )
    reference = get_kernel("moe_apply", "reference.moe_apply")
    ref_plan = moe_plan_for(reference, config, tokens, device)
    ref_out = torch.empty_like(x)
    reference.fn.apply(
        ref_plan,
        x,
        reference.fn.prepare_weights(ref_plan, weights),
        router_logits=None,
        topk_weights=torch.where(bad, 0.0, topk_weights),
        topk_ids=torch.where(bad, 0, ids),
        out=ref_out,
    )
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # every pair of token 0 is bad
    assert_close(out, ref_out, dtype=torch.bfloat16, name="out")


@on_the_interpreter
@pytest.mark.parametrize("tokens,top_k", [(5, 2), (70, 4)])
def test_out_of_range_ids_contribute_nothing(tokens, top_k):
    check_bad_ids_against_reference(get_kernel("moe_apply", KERNEL), tokens, top_k, 64, DEVICE)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("kernel", [KERNEL, "triton.moe_apply.sm90"])
@pytest.mark.parametrize("tokens", [1, 3, 300])
def test_out_of_range_ids_contribute_nothing_on_the_gpu(kernel, tokens):
    """Compiled kernels: decode (one-program router; split-K GEMM2 rows in the Hopper combine)
    and the multi-kernel router. Small layers: a few MB of weights."""
    spec = get_kernel("moe_apply", kernel)
    platform = platform_of(torch.device("cuda"))
    if all(p.mismatch(platform) for p in spec.platforms):
        pytest.skip(f"{kernel} does not run on {platform.arch}")
    check_bad_ids_against_reference(spec, tokens, 4, 256, "cuda")


@on_the_interpreter
@pytest.mark.parametrize("tokens", [3, 100])
def test_nan_logits_pick_ids_in_range(tokens):
    """NaN ranks as +inf (torch.topk's order): ids stay in range and distinct per token, a
    token with a NaN among its picks gets NaN weights, as the reference softmax does; the
    other tokens route exactly as the reference."""
    top_k = 4
    gen = generator("moe-nan-logits", tokens)
    logits = torch.randn(tokens, NUM_EXPERTS, generator=gen)
    logits[0, 3] = float("nan")
    logits[1, :] = float("nan")
    logits[2, 1::2] = float("nan")
    weights, ids, sorted_pairs, tiles, num_tiles, _ = route(
        logits, None, None, top_k=top_k, num_experts=NUM_EXPERTS, block_m=16
    )
    assert ids.min() >= 0 and ids.max() < NUM_EXPERTS
    for row in ids.tolist():
        assert len(set(row)) == top_k
    assert ids[0, 0] == 3 and ids[1].tolist() == [0, 1, 2, 3] and ids[2, :3].tolist() == [1, 3, 5]
    assert torch.isnan(weights[:3]).all()
    ref_w, ref_ids = topk_softmax(logits[3:], top_k)
    assert torch.equal(ids[3:], ref_ids)
    assert_close(weights[3:], ref_w, dtype=torch.float32, name="topk_weights")
    assert int(num_tiles) >= 1 and int(tiles[: int(num_tiles), 0].max()) < NUM_EXPERTS
