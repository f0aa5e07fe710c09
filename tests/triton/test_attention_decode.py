"""Triton mha_decode_with_kvcache: the shared conformance cases (CPU through the Triton
interpreter in fp16, since its bf16 tl.dot multiplies raw bits), GPT-OSS-120B shapes on the GPU,
and checks specific to this kernel: every split count against the reference (the sink is added
once however the keys are split), pages outside a window never read, the split heuristic, and a
CUDA-graph replay with new sequence lengths."""

from __future__ import annotations

import math

import pytest
import torch

from tokenspeed_kernel.ops.attention.reference import reference_decode
from tokenspeed_kernel.testing import assert_close, assert_conformance, conformance_params
from tokenspeed_kernel.tuning import pin_config
from tokenspeed_kernel_triton.attention.decode import KERNEL_NAME, mha_decode_with_kvcache
from tokenspeed_kernel_triton.attention.decode_config import (
    MAX_SPLITS,
    DecodeConfig,
    choose_num_splits,
)

OP = "mha_decode_with_kvcache"
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPE = torch.bfloat16 if ON_GPU else torch.float16  # the interpreter's bf16 dot is broken


def _params(preset=None, dtypes=(torch.float16,)):
    return [
        p
        for p in conformance_params(op=OP, backend="triton", preset=preset, dtypes=dtypes)
        if preset is None or p.values[1].preset == preset
    ]


@pytest.mark.parametrize("kernel,case", _params())
def test_conformance(kernel, case):
    assert_conformance(kernel, case)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,case", _params("gpt-oss-120b", (torch.bfloat16, torch.float16)))
def test_conformance_gpt_oss_120b(kernel, case):
    assert_conformance(kernel, case)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,case", _params(dtypes=(torch.bfloat16,)))
def test_conformance_bf16_gpu(kernel, case):
    assert_conformance(kernel, case)


def _inputs(
    seqlens,
    q_len,
    heads_q,
    heads_kv,
    dim,
    page_size,
    *,
    seed,
    window_left=-1,
    poison_outside_window=False,
):
    """Random decode inputs with a shuffled page table and garbage in unowned slots. With
    `poison_outside_window`, keys left of every query's window hold NaN and the page-table
    entries of pages wholly left of it are -1 (freed pages an engine may have reused)."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(seqlens)
    max_pages = max(-(-n // page_size) for n in seqlens) + 1
    num_pages = batch * max_pages + 1
    shape = (num_pages, page_size, heads_kv, dim)
    k_cache = (10 * torch.randn(shape, generator=gen)).to(DTYPE)
    v_cache = (10 * torch.randn(shape, generator=gen)).to(DTYPE)
    page_table = torch.randperm(num_pages, generator=gen)[: batch * max_pages]
    page_table = page_table.reshape(batch, max_pages).to(torch.int32)
    clean_k, clean_v = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(seqlens):
        for p in range(-(-n // page_size)):
            page = int(page_table[b, p])
            for cache, clean in ((k_cache, clean_k), (v_cache, clean_v)):
                clean[page] = cache[page] = torch.randn(page_size, heads_kv, dim, generator=gen).to(
                    DTYPE
                )
    poisoned_table = page_table.clone()
    if poison_outside_window:
        for b, n in enumerate(seqlens):
            first_visible = max(n - q_len - window_left, 0)
            for pos in range(first_visible):
                page = int(page_table[b, pos // page_size])
                k_cache[page, pos % page_size] = float("nan")
                v_cache[page, pos % page_size] = float("nan")
            poisoned_table[b, : first_visible // page_size] = -1
    q = torch.randn(batch, q_len, heads_q, dim, generator=gen).to(DTYPE)
    sinks = torch.randn(heads_q, generator=gen)
    kwargs = dict(
        cache_seqlens=torch.tensor(seqlens, dtype=torch.int32),
        window_left=window_left,
        sinks=sinks,
        softmax_scale=1 / math.sqrt(dim),
        k_scale=1.0,
        v_scale=1.0,
    )
    return q, (k_cache, v_cache, poisoned_table), (clean_k, clean_v, page_table), kwargs


def _run(fn, q, caches, kwargs):
    k_cache, v_cache, page_table = caches
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full(q.shape[:-1], float("nan"), dtype=torch.float32, device=q.device)
    args = {k: v.to(q.device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    fn(
        q,
        k_cache.to(q.device),
        v_cache.to(q.device),
        page_table=page_table.to(q.device),
        out=out,
        lse=lse,
        **args,
    )
    return out, lse


@pytest.mark.parametrize("num_splits", [1, 2, 5, 40])
@pytest.mark.parametrize("page_size,block_n", [(32, 16), (4, 16)])
def test_split_counts_agree_with_reference(num_splits, page_size, block_n):
    """Q=2, GQA 4, sinks and lse; lengths 0, Q, short and long. Whether a split holds many
    blocks, one or none, the merged result equals the reference (sink counted once). page 32
    with 16-key blocks reads one page per block; page 4 gathers four pages per block."""
    q, caches, _, kwargs = _inputs((0, 2, 9, 77), 2, 8, 2, 64, page_size, seed=num_splits)
    q = q.to(DEVICE)
    with pin_config(KERNEL_NAME, DecodeConfig(block_n, 1 if not ON_GPU else 4, 1, 1, num_splits)):
        out, lse = _run(mha_decode_with_kvcache, q, caches, kwargs)
    want, want_lse = _run(reference_decode, q.cpu(), caches, kwargs)
    assert_close(out.cpu(), want, dtype=DTYPE, name="out")
    assert_close(lse.cpu(), want_lse, dtype=torch.float32, name="lse")


@pytest.mark.parametrize("num_splits", [1, 3])
def test_window_never_reads_outside(num_splits):
    """Keys left of the window hold NaN and their page-table entries are -1: a kernel that
    visited those pages (or multiplied a masked probability 0 by a NaN value) returns NaN or
    faults. The result must equal the reference on the clean cache."""
    window, q_len = 5, 3
    q, poisoned, clean, kwargs = _inputs(
        (70, 13, 3), q_len, 4, 1, 64, 4, seed=11, window_left=window, poison_outside_window=True
    )
    q = q.to(DEVICE)
    with pin_config(KERNEL_NAME, DecodeConfig(16, 1 if not ON_GPU else 4, 1, 1, num_splits)):
        out, lse = _run(mha_decode_with_kvcache, q, poisoned, kwargs)
    want, want_lse = _run(reference_decode, q.cpu(), clean, kwargs)
    assert_close(out.cpu(), want, dtype=DTYPE, name="out")
    assert_close(lse.cpu(), want_lse, dtype=torch.float32, name="lse")


@pytest.mark.parametrize("window_left", [-1, 5])
def test_many_query_rows_and_strided_metadata(window_left):
    """Q=9 tokens x GQA 8 = 72 rows: two query tiles of 64, the second starting at token 8,
    each bounding its own key range. The page table and sequence lengths are strided views
    (every other column / element of a larger tensor), which the kernel must follow."""
    q, caches, _, kwargs = _inputs((40, 9, 23), 9, 8, 1, 64, 16, seed=2, window_left=window_left)
    k_cache, v_cache, page_table = caches
    wide = torch.full((page_table.shape[0], 2 * page_table.shape[1]), -1, dtype=torch.int32)
    wide[:, ::2] = page_table
    lens = torch.zeros(page_table.shape[0], 2, dtype=torch.int32)
    lens[:, 0] = kwargs["cache_seqlens"]
    # Sliced on the device: moving a strided view would make it contiguous.
    wide, lens = wide.to(DEVICE), lens.to(DEVICE)
    assert wide[:, ::2].stride(1) == 2 and lens[:, 0].stride(0) == 2
    strided = dict(kwargs, cache_seqlens=lens[:, 0])
    with pin_config(KERNEL_NAME, DecodeConfig(16, 1 if not ON_GPU else 4, 1, 1, 2)):
        out, lse = _run(
            mha_decode_with_kvcache, q.to(DEVICE), (k_cache, v_cache, wide[:, ::2]), strided
        )
    want, want_lse = _run(reference_decode, q, caches, kwargs)
    assert_close(out.cpu(), want, dtype=DTYPE, name="out")
    assert_close(lse.cpu(), want_lse, dtype=torch.float32, name="lse")


def test_split_heuristic_fills_the_device_and_stays_whole_when_full():
    """H100-like numbers (132 SMs, 4 resident programs each): GPT-OSS decode at B=1 over 8192
    keys (8 KV heads, 128 blocks of 64) must spread over enough splits to give every SM work;
    at B=64 the 512 programs already fill the device, so splitting only adds a reduce."""
    splits_b1 = choose_num_splits(8, 128, 132, 4)
    assert 8 * splits_b1 >= 132 and 128 % splits_b1 == 0
    assert choose_num_splits(512, 128, 132, 4) == 1
    assert choose_num_splits(512, 3, 132, 4) == 1  # window 127: three blocks at most
    assert choose_num_splits(8, 1, 132, 4) == 1  # one block cannot be split
    assert choose_num_splits(1, 10_000, 132, 4) <= MAX_SPLITS


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA graphs")
def test_cuda_graph_replay_with_new_lengths():
    """The launch must not read device values on the host: capture once, change the sequence
    lengths in place, replay, and the result must follow the new lengths."""
    q, caches, _, kwargs = _inputs((300, 40, 1000, 7), 1, 64, 8, 64, 64, seed=5)
    q = q.cuda()
    k_cache, v_cache, page_table = (x.cuda() for x in caches)
    seqlens = kwargs.pop("cache_seqlens").cuda()
    sinks = kwargs.pop("sinks").cuda()
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device="cuda")

    def step():
        mha_decode_with_kvcache(
            q,
            k_cache,
            v_cache,
            page_table=page_table,
            cache_seqlens=seqlens,
            sinks=sinks,
            out=out,
            lse=lse,
            **kwargs,
        )

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lengths in ((1000, 1, 513, 64), (0, 999, 2, 128)):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        want, want_lse = torch.empty_like(out), torch.empty_like(lse)
        reference_decode(
            q,
            k_cache,
            v_cache,
            page_table=page_table,
            cache_seqlens=seqlens,
            sinks=sinks,
            out=want,
            lse=want_lse,
            **kwargs,
        )
        assert_close(out, want, dtype=torch.bfloat16, name="out")
        assert_close(lse, want_lse, dtype=torch.float32, name="lse")
