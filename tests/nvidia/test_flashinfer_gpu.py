"""FlashInfer adapters on the GPU: XQA decode, the attention-sink wrapper (prefill, extend) and
trtllm-gen decode (declines on Hopper: its cases skip with the platform reason) on the shared
conformance cases in bf16 and GPT-OSS-120B's shapes against the core reference; a CUDA-graph
replay of XQA decode with new lengths (its workspace is allocated once, outside the graph).

Every distinct (dtype, head dim, page size, group, window) compiles one FlashInfer module on
first use (about 10-75 s each on an H100); the bf16 cases keep that to a few minutes.
Needs `flashinfer-python` (see the package README for the GPU command)."""

from __future__ import annotations

import pytest
import torch
from nvidia_gpu_helpers import kernel_params, require

from tokenspeed_kernel.ops.attention.reference import reference_decode
from tokenspeed_kernel.testing import assert_close, assert_conformance
from tokenspeed_kernel_nvidia._library import FLASHINFER
from tokenspeed_kernel_nvidia.flashinfer import xqa_decode

pytestmark = pytest.mark.gpu
BF16 = (torch.bfloat16,)
# The decode kernels have no lse and take Q = 1: their cases are the shared ones with lse off
# and one new token, so each still meets every shape (empty sequences, windows, sinks +30).
NO_LSE = dict(lse=False, q_lens=(1,))
KERNELS = (
    ("mha_decode_with_kvcache", "flashinfer.mha_decode_with_kvcache.xqa", NO_LSE),
    ("mha_decode_with_kvcache", "flashinfer.mha_decode_with_kvcache.trtllm_gen", NO_LSE),
    ("mha_prefill", "flashinfer.mha_prefill.sink", {}),
    ("mha_extend_with_kvcache", "flashinfer.mha_extend_with_kvcache.sink", {}),
)


def test_flashinfer_is_usable():
    require(FLASHINFER)


@pytest.mark.parametrize(
    "kernel,case",
    [p for op, name, replace in KERNELS for p in kernel_params(op, name, dtypes=BF16, **replace)],
)
def test_conformance(kernel, case):
    require(FLASHINFER)
    assert_conformance(kernel, case)


def test_xqa_decode_cuda_graph_replay_with_new_lengths():
    """GPT-OSS decode shapes (64/8 heads, D 64, page 64, window 127, float32 sinks): captured
    once, replayed with other lengths written in place, matching the reference each time."""
    require(FLASHINFER)
    gen = torch.Generator(device="cuda").manual_seed(3)
    batch, pages_per_seq, page = 8, 12, 64
    num_pages = batch * pages_per_seq
    cache = dict(generator=gen, device="cuda")
    k_cache = torch.randn(num_pages, page, 8, 64, **cache).to(torch.bfloat16)
    v_cache = torch.randn(num_pages, page, 8, 64, **cache).to(torch.bfloat16)
    q = torch.randn(batch, 1, 64, 64, **cache).to(torch.bfloat16)
    page_table = torch.randperm(num_pages, **cache).to(torch.int32).view(batch, pages_per_seq)
    sinks = torch.randn(64, **cache)
    seqlens = torch.full((batch,), 700, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    args = dict(page_table=page_table, cache_seqlens=seqlens, window_left=127, sinks=sinks,
                softmax_scale=0.125, k_scale=1.0, v_scale=1.0)  # fmt: skip

    def step():
        xqa_decode.mha_decode_with_kvcache(q, k_cache, v_cache, **args, out=out, lse=None)

    step()  # warm-up outside the capture: JIT, workspace allocation
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lengths in ([1, 2, 63, 64, 65, 300, 699, 768], [768, 5, 128, 129, 1, 640, 64, 333]):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        want = torch.empty_like(out)
        reference_decode(q, k_cache, v_cache, **args, out=want, lse=None)
        assert_close(out, want, dtype=torch.bfloat16, name="out")
