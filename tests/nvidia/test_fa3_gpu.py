"""FA3 adapters on the GPU: the shared conformance cases (bf16 and fp16, odd shapes, empty
sequences, windows 0/1/127, sinks +30, lse) and GPT-OSS-120B's shapes against the core
reference; the sink merge path (float32 sinks, lse) and the native path (bf16 sinks, no lse)
against each other; a CUDA-graph replay of decode with new lengths.

Needs `tokenspeed-fa3` (see the package README for the GPU command)."""

from __future__ import annotations

import pytest
import torch
from nvidia_gpu_helpers import kernel_params, require

from tokenspeed_kernel.ops.attention.reference import reference_decode
from tokenspeed_kernel.testing import assert_close, assert_conformance
from tokenspeed_kernel_nvidia._library import FA3
from tokenspeed_kernel_nvidia.fa3 import decode as fa3_decode

pytestmark = pytest.mark.gpu
OPS = ("mha_prefill", "mha_extend_with_kvcache", "mha_decode_with_kvcache")


def test_fa3_is_usable():
    require(FA3)


@pytest.mark.parametrize("kernel,case", [p for op in OPS for p in kernel_params(op, f"fa3.{op}")])
def test_conformance(kernel, case):
    require(FA3)
    assert_conformance(kernel, case)


def _decode_inputs(batch, ctx, *, seed, sinks_dtype):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    heads_q, heads_kv, dim, page = 64, 8, 64, 64
    pages_per_seq = -(-ctx // page)
    num_pages = batch * pages_per_seq
    k_cache = torch.randn(num_pages, page, heads_kv, dim, generator=gen, device="cuda")
    v_cache = torch.randn(num_pages, page, heads_kv, dim, generator=gen, device="cuda")
    q = torch.randn(batch, 1, heads_q, dim, generator=gen, device="cuda").to(torch.bfloat16)
    page_table = torch.randperm(num_pages, generator=gen, device="cuda").to(torch.int32)
    sinks = torch.randn(heads_q, generator=gen, device="cuda").to(sinks_dtype)
    return dict(
        q=q,
        k_cache=k_cache.to(torch.bfloat16),
        v_cache=v_cache.to(torch.bfloat16),
        page_table=page_table.view(batch, pages_per_seq),
        sinks=sinks,
    )


def _run(fn, inputs, seqlens, *, lse, window_left=-1):
    q = inputs["q"]
    out = torch.empty_like(q)
    lse_t = torch.empty(q.shape[:-1], dtype=torch.float32, device="cuda") if lse else None
    fn(
        q, inputs["k_cache"], inputs["v_cache"], page_table=inputs["page_table"],
        cache_seqlens=seqlens, window_left=window_left, sinks=inputs["sinks"],
        softmax_scale=0.125, k_scale=1.0, v_scale=1.0, out=out, lse=lse_t,
    )  # fmt: skip
    return out, lse_t


@pytest.mark.parametrize("window_left", [-1, 127])
def test_native_bf16_sinks_match_the_exact_merge(window_left):
    """bf16 sinks without lse go to FA3 natively; with lse they take the float32 merge. Both
    must agree (and match the reference, which the conformance cases check)."""
    require(FA3)
    inputs = _decode_inputs(16, 1000, seed=1, sinks_dtype=torch.bfloat16)
    seqlens = torch.randint(1, 1001, (16,), device="cuda", dtype=torch.int32)
    native, _ = _run(fa3_decode.mha_decode_with_kvcache, inputs, seqlens, lse=False,
                     window_left=window_left)  # fmt: skip
    merged, _ = _run(fa3_decode.mha_decode_with_kvcache, inputs, seqlens, lse=True,
                     window_left=window_left)  # fmt: skip
    assert_close(native, merged, dtype=torch.bfloat16, name="native vs merged")


def test_decode_cuda_graph_replay_with_new_lengths():
    """Captured once, replayed with other lengths in place: matches the reference each time."""
    require(FA3)
    inputs = _decode_inputs(8, 700, seed=2, sinks_dtype=torch.float32)
    seqlens = torch.full((8,), 700, dtype=torch.int32, device="cuda")
    out = torch.empty_like(inputs["q"])
    lse = torch.empty(inputs["q"].shape[:-1], dtype=torch.float32, device="cuda")

    def step():
        fa3_decode.mha_decode_with_kvcache(
            inputs["q"], inputs["k_cache"], inputs["v_cache"], page_table=inputs["page_table"],
            cache_seqlens=seqlens, window_left=-1, sinks=inputs["sinks"], softmax_scale=0.125,
            k_scale=1.0, v_scale=1.0, out=out, lse=lse,
        )  # fmt: skip

    step()  # warm-up outside the capture (first-use allocations)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lengths in ([1, 2, 63, 64, 65, 300, 699, 700], [700, 5, 128, 129, 1, 640, 64, 333]):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        want_out = torch.empty_like(out)
        want_lse = torch.empty_like(lse)
        reference_decode(
            inputs["q"], inputs["k_cache"], inputs["v_cache"], page_table=inputs["page_table"],
            cache_seqlens=seqlens, window_left=-1, sinks=inputs["sinks"], softmax_scale=0.125,
            k_scale=1.0, v_scale=1.0, out=want_out, lse=want_lse,
        )  # fmt: skip
        assert_close(out, want_out, dtype=torch.bfloat16, name="out")
        assert_close(lse, want_lse, dtype=torch.float32, name="lse")
