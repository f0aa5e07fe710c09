"""Public ops end to end on the CPU: normalized arguments reach the kernel, outputs come back
in the caller's shapes."""

from __future__ import annotations

import pytest
import torch

import tokenspeed_kernel as tk
from tokenspeed_kernel.ops.attention.reference import reference_decode

BF16, FP8, I32 = torch.bfloat16, torch.float8_e4m3fn, torch.int32


def _paged(batch=3, q_len=None, heads=(8, 2), dim=32, page=4, dtype=BF16, seed=0):
    g = torch.Generator().manual_seed(seed)
    hq, hkv = heads
    shape = (batch, hq, dim) if q_len is None else (batch, q_len, hq, dim)
    q = torch.randn(shape, generator=g).to(BF16)
    k = torch.randn(12, page, hkv, dim, generator=g).to(dtype)
    v = torch.randn(12, page, hkv, dim, generator=g).to(dtype)
    table = torch.randperm(12, generator=g)[: batch * 4].view(batch, 4).to(I32)
    lens = torch.tensor([5, 16, 9][:batch], dtype=I32)
    return q, k, v, table, lens


def test_decode_3d_matches_4d_and_lse_shapes():
    q, k, v, table, lens = _paged()
    sinks = torch.randn(8)
    out3, lse3 = tk.mha_decode_with_kvcache(
        q, k, v, page_table=table, cache_seqlens=lens, sinks=sinks, return_lse=True
    )
    out4, lse4 = tk.mha_decode_with_kvcache(
        q[:, None], k, v, page_table=table, cache_seqlens=lens, sinks=sinks, return_lse=True
    )
    assert out3.shape == q.shape and lse3.shape == (3, 8) and lse3.dtype == torch.float32
    assert out4.shape == (3, 1, 8, 32) and lse4.shape == (3, 1, 8)
    torch.testing.assert_close(out3, out4[:, 0], rtol=0, atol=0)
    torch.testing.assert_close(lse3, lse4[:, 0], rtol=0, atol=0)


def test_decode_passes_normalized_arguments(monkeypatch):
    seen = {}

    def spy(q, k_cache, v_cache, **kwargs):
        seen.update(kwargs, q_shape=tuple(q.shape))
        reference_decode(q, k_cache, v_cache, **kwargs)

    tk.register_kernel(
        "mha_decode_with_kvcache",
        name="spy.decode",
        backend="spy",
        platforms=["cpu"],
        priority=1000,
        traits={
            "dtype": tk.ANY,
            "kv_dtype": tk.ANY,
            "head_dim": tk.ANY,
            "gqa_ratio": tk.ANY,
            "page_size": tk.ANY,
            "q_len": tk.ANY,
        },
    )(spy)
    try:
        q, k, v, table, lens = _paged()
        out = torch.empty_like(q)
        result = tk.mha_decode_with_kvcache(q, k, v, page_table=table, cache_seqlens=lens, out=out)
        assert result is out
        assert seen["q_shape"] == (3, 1, 8, 32)
        assert seen["softmax_scale"] == pytest.approx(32**-0.5)
        assert (seen["k_scale"], seen["v_scale"], seen["window_left"]) == (1.0, 1.0, -1)
        assert seen["lse"] is None and seen["out"].shape == (3, 1, 8, 32)
        assert seen["out"].data_ptr() == out.data_ptr()  # a view, so the kernel writes in place
    finally:
        tk.registry.unregister_kernel("spy.decode")


def test_fp8_cache_output_defaults_to_bf16():
    q, k, v, table, lens = _paged(dtype=FP8)
    q16 = q.half()
    out = tk.mha_decode_with_kvcache(
        q16, k, v, page_table=table, cache_seqlens=lens, k_scale=0.5, v_scale=2.0
    )
    assert out.dtype == BF16
    given = torch.empty(q.shape, dtype=torch.float16)
    assert (
        tk.mha_decode_with_kvcache(
            q16, k, v, page_table=table, cache_seqlens=lens, k_scale=0.5, out=given
        )
        is given
    )


def test_kvcache_store_then_decode_round_trip():
    g = torch.Generator().manual_seed(3)
    k = torch.randn(6, 2, 32, generator=g).to(BF16)
    v = torch.randn(6, 2, 32, generator=g).to(BF16)
    k_cache = torch.zeros(4, 4, 2, 32, dtype=BF16)
    v_cache = torch.zeros_like(k_cache)
    table = torch.tensor([[2, 0]], dtype=I32)
    slots = torch.tensor([8, 9, 10, 11, 0, 1], dtype=torch.int64)  # page 2 then page 0
    tk.kvcache_store(k, v, k_cache, v_cache, slot_mapping=slots)
    q = torch.randn(1, 6, 8, 32, generator=g).to(BF16)
    decoded = tk.mha_decode_with_kvcache(
        q, k_cache, v_cache, page_table=table, cache_seqlens=torch.tensor([6], dtype=I32)
    )
    prefilled = tk.mha_prefill(q[0], k, v, cu_seqlens=torch.tensor([0, 6], dtype=I32), max_seqlen=6)
    torch.testing.assert_close(decoded[0], prefilled, rtol=0, atol=0)


def test_extend_of_whole_sequence_equals_prefill():
    g = torch.Generator().manual_seed(4)
    k = torch.randn(7, 1, 32, generator=g).to(BF16)
    v = torch.randn(7, 1, 32, generator=g).to(BF16)
    q = torch.randn(7, 4, 32, generator=g).to(BF16)
    cache_k = k.view(7, 1, 1, 32)  # page size 1: token p lives in page p
    cache_v = v.view(7, 1, 1, 32)
    table = torch.arange(7, dtype=I32).flip(0).view(1, 7)
    out = tk.mha_extend_with_kvcache(
        q,
        cache_k.flip(0).contiguous(),
        cache_v.flip(0).contiguous(),
        cu_seqlens_q=torch.tensor([0, 7], dtype=I32),
        page_table=table,
        cache_seqlens=torch.tensor([7], dtype=I32),
        max_seqlen_q=7,
        window_left=2,
    )
    expected = tk.mha_prefill(
        q, k, v, cu_seqlens=torch.tensor([0, 7], dtype=I32), max_seqlen=7, window_left=2
    )
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_moe_plan_is_printable_and_runs_on_cpu():
    config = tk.MoEConfig(8, 2, 64, 96, weight_format="bf16")
    plan = tk.moe_plan(config, device="cpu", max_num_tokens=4)
    text = str(plan)
    assert "reference.moe_apply" in text and "layout checkpoint" in text
    assert "max_num_tokens 4" in text
    g = torch.Generator().manual_seed(5)
    weights = tk.MoEWeights(
        w13=(torch.randn(8, 192, 64, generator=g) * 0.1).to(BF16),
        w2=(torch.randn(8, 64, 96, generator=g) * 0.1).to(BF16),
        w13_bias=torch.randn(8, 192, generator=g),
        w2_bias=torch.randn(8, 64, generator=g),
    )
    prepared = tk.moe_prepare_weights(plan, weights)
    x = torch.randn(3, 64, generator=g).to(BF16)
    logits = torch.randn(3, 8, generator=g)
    out = tk.moe_apply(plan, x, prepared, logits)
    weights_k, ids = tk.ops.moe.reference.topk_softmax(logits, 2)
    again = tk.moe_apply(plan, x, prepared, topk_weights=weights_k, topk_ids=ids)
    torch.testing.assert_close(out, again, rtol=0, atol=0)
    assert out.shape == x.shape and out.dtype == BF16
