"""The AMD attention kernels (their NVIDIA instantiation) on bad device values and edge inputs:
masked keys never reach a row whatever their values (a row that sees a non-finite V is NaN),
sinks = +inf gives out 0 and lse +inf, and bad page ids, cache_seqlens and cu_seqlens stay
inside the tensors. GPU machine only."""

from __future__ import annotations

import pytest
import torch

from tokenspeed_kernel.registry import get_kernel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]
D, HQ, HKV = 64, 8, 1


def _launcher(op: str):
    return get_kernel(op, f"amd.{op}").fn


def _qkv(tokens: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (
        torch.randn(tokens, h, D, generator=g, device="cuda").to(torch.bfloat16)
        for h in (HQ, HKV, HKV)
    )
    return q, k, v


def _prefill(q, k, v, cu, **kw):
    return _launcher("mha_prefill")(
        q, k, v, cu_seqlens=cu, max_seqlen=q.shape[0], arch="nvidia", **kw
    )


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_prefill_window_keeps_masked_non_finite_values_out(poison):
    """100 tokens, window 3, V (and K) rows 0..49 poisoned: rows 53.. see none of them."""
    q, k, v = _qkv(100)
    cu = torch.tensor([0, 100], dtype=torch.int32, device="cuda")
    clean = _prefill(q, k, v, cu, window_left=3)
    k2, v2 = k.clone(), v.clone()
    k2[:50], v2[:50] = poison, poison
    out = _prefill(q, k2, v2, cu, window_left=3)
    assert torch.equal(out[53:], clean[53:])


def test_extend_window_keeps_masked_non_finite_values_out():
    q, k, v = _qkv(128)
    page = 16
    k_cache = k.view(8, page, HKV, D).clone()
    v_cache = v.view(8, page, HKV, D).clone()
    table = torch.arange(8, dtype=torch.int32, device="cuda")[None]
    kw = dict(
        cu_seqlens_q=torch.tensor([0, 64], dtype=torch.int32, device="cuda"),
        page_table=table,
        cache_seqlens=torch.tensor([128], dtype=torch.int32, device="cuda"),
        max_seqlen_q=64,
        window_left=3,
        arch="nvidia",
    )
    fn = _launcher("mha_extend_with_kvcache")
    clean = fn(q[64:], k_cache, v_cache, **kw)
    v_cache.view(128, HKV, D)[:70] = float("nan")
    out = fn(q[64:], k_cache, v_cache, **kw)
    # Query i sits at position 64 + i; positions < 70 are outside its window from i = 9 on.
    assert torch.equal(out[9:], clean[9:])


POISONED = 41


def _sees_poisoned(positions, window):
    sees = positions >= POISONED
    return sees & (positions <= POISONED + window) if window >= 0 else sees


@pytest.mark.parametrize("window", [-1, 3, 20])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_prefill_poisoned_value_reaches_only_rows_that_see_it(window, value):
    """V of key 41 poisoned: rows before it (causal diagonal) and past its window match the
    clean call bit for bit; the rows that see it are not finite."""
    q, k, v = _qkv(100)
    cu = torch.tensor([0, 100], dtype=torch.int32, device="cuda")
    clean = _prefill(q, k, v, cu, window_left=window)
    v2 = v.clone()
    v2[POISONED] = value
    out = _prefill(q, k, v2, cu, window_left=window)
    sees = _sees_poisoned(torch.arange(100, device="cuda"), window)
    assert torch.equal(out[~sees], clean[~sees])
    assert not out[sees].isfinite().all(dim=-1).any()


@pytest.mark.parametrize("window", [-1, 3])
def test_decode_poisoned_value_reaches_only_rows_that_see_it(window):
    """16 new tokens at positions 34..49 in one tile, V of key 41 NaN."""
    q, k, v = _qkv(64)
    k_cache, v_cache = k.view(8, 8, HKV, D), v.view(8, 8, HKV, D).clone()
    kw = dict(
        page_table=torch.arange(8, dtype=torch.int32, device="cuda")[None],
        cache_seqlens=torch.tensor([50], dtype=torch.int32, device="cuda"),
        window_left=window, arch="nvidia",
    )  # fmt: skip
    fn = _launcher("mha_decode_with_kvcache")
    qd = q[:16].view(1, 16, HQ, D)
    clean = fn(qd, k_cache, v_cache, **kw)
    v_cache.view(64, HKV, D)[POISONED] = float("nan")
    out = fn(qd, k_cache, v_cache, **kw)
    sees = _sees_poisoned(torch.arange(34, 50, device="cuda"), window)
    assert torch.equal(out[0, ~sees], clean[0, ~sees])
    assert not out[0, sees].isfinite().all(dim=-1).any()


def test_infinite_sink_takes_all_the_mass():
    q, k, v = _qkv(40)
    cu = torch.tensor([0, 40], dtype=torch.int32, device="cuda")
    sinks = torch.zeros(HQ, device="cuda")
    sinks[2] = float("inf")
    lse = torch.empty(40, HQ, device="cuda")
    out = _prefill(q, k, v, cu, sinks=sinks, lse=lse)
    assert torch.equal(out[:, 2], torch.zeros_like(out[:, 2]))
    assert torch.isinf(lse[:, 2]).all() and (lse[:, 2] > 0).all()
    assert torch.isfinite(out).all() and torch.isfinite(lse[:, [0, 1, 3]]).all()
    # Decode, one split and several (the reduce adds the sink).
    pages = torch.arange(4, dtype=torch.int32, device="cuda")[None]
    qd = q[:1].view(1, 1, HQ, D)
    k_cache, v_cache = k[:32].view(4, 8, HKV, D), v[:32].view(4, 8, HKV, D)
    for splits in (1, 3):
        from tokenspeed_kernel.tuning import pin_config
        from tokenspeed_kernel_amd.attention.decode import KERNEL_NAME, decode_config

        cfg = decode_config(0, D)
        with pin_config(KERNEL_NAME, type(cfg)(**{**vars(cfg), "num_splits": splits})):
            lse_d = torch.empty(1, 1, HQ, device="cuda")
            out_d = _launcher("mha_decode_with_kvcache")(
                qd, k_cache, v_cache, page_table=pages,
                cache_seqlens=torch.tensor([32], dtype=torch.int32, device="cuda"),
                sinks=sinks, lse=lse_d, arch="nvidia",
            )  # fmt: skip
        assert torch.equal(out_d[..., 2, :], torch.zeros_like(out_d[..., 2, :]))
        assert torch.isinf(lse_d[..., 2]).all() and torch.isfinite(out_d).all()


@pytest.mark.parametrize("op", ["mha_extend_with_kvcache", "mha_decode_with_kvcache"])
def test_bad_page_ids_and_cache_seqlens_stay_in_bounds(op):
    """Page ids 1000 and -1 read as masked keys (the same as dropping those pages' keys);
    cache_seqlens < 0 reads as 0 (zeros out), past the table as the table's coverage."""
    q, k, v = _qkv(64)
    k_cache, v_cache = k.view(8, 8, HKV, D), v.view(8, 8, HKV, D)
    good = torch.arange(8, dtype=torch.int32, device="cuda")[None].repeat(3, 1)
    bad = good.clone()
    bad[0, 2], bad[0, 5] = 1000, -1
    lens = torch.tensor([64, -5, 10**6], dtype=torch.int32, device="cuda")
    fn = _launcher(op)
    if op == "mha_decode_with_kvcache":
        qx = q[:3].view(3, 1, HQ, D)
        kw = dict(page_table=bad, cache_seqlens=lens, arch="nvidia")
    else:
        qx = q[:3]
        cu = torch.tensor([0, 1, 2, 3], dtype=torch.int32, device="cuda")
        kw = dict(cu_seqlens_q=cu, page_table=bad, cache_seqlens=lens, max_seqlen_q=1)
        kw["arch"] = "nvidia"
    out = fn(qx, k_cache, v_cache, **kw).reshape(3, HQ, D)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    full = fn(qx, k_cache, v_cache, **{**kw, "page_table": good}).reshape(3, HQ, D)
    assert torch.equal(out[2], full[2]) and not torch.equal(out[0], full[0])


def test_prefill_clamps_cu_seqlens():
    """Offsets past T clamp to T, a decreasing pair is an empty sequence: nothing outside
    q/k/v/out is touched and covered rows match the clean layout. Sequences 0 ([0, 16)) and 2
    ([8, 48) after clamping) both write rows 8..15, so those rows are left unchecked."""
    q, k, v = _qkv(48)
    cu = torch.tensor([0, 16, 8, 10**6], dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    _launcher("mha_prefill")(q, k, v, cu_seqlens=cu, max_seqlen=64, arch="nvidia", out=out)
    torch.cuda.synchronize()
    clean = _prefill(q, k, v, torch.tensor([0, 16, 16, 48], dtype=torch.int32, device="cuda"))
    assert torch.equal(out[:8], clean[:8])
    # Sequence 2 is [8, 48) after clamping.
    tail = _prefill(q[8:], k[8:], v[8:], torch.tensor([0, 40], dtype=torch.int32, device="cuda"))
    assert torch.equal(out[16:], tail[8:])
