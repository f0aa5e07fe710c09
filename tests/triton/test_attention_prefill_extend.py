"""Triton mha_prefill / mha_extend_with_kvcache: the shared conformance cases (CPU through the
Triton interpreter in fp16, since its bf16 tl.dot is broken), GPT-OSS-120B shapes on the GPU,
and a few checks specific to these kernels (window skipping, pinned tile configs)."""

from __future__ import annotations

import math

import pytest
import torch

from tokenspeed_kernel.ops.attention.reference import reference_extend, reference_prefill
from tokenspeed_kernel.platform import KNOWN_PLATFORMS, Platform, platform_of
from tokenspeed_kernel.testing import (
    assert_close,
    assert_conformance,
    conformance_params,
)
from tokenspeed_kernel.tuning import pin_config, pinned_config
from tokenspeed_kernel_triton.attention import extend, prefill
from tokenspeed_kernel_triton.attention._common import HEAD_DIMS
from tokenspeed_kernel_triton.attention._tile_config import AttentionConfig, choose_config

OPS = ("mha_prefill", "mha_extend_with_kvcache")
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


def _params(preset=None, dtypes=(torch.float16,)):
    params = []
    for op in OPS:
        for param in conformance_params(op=op, backend="triton", preset=preset, dtypes=dtypes):
            _, case = param.values
            if preset is None or case.preset == preset:
                params.append(param)
    return params


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


def _to_device(kwargs: dict) -> dict:
    """The tensors of a kernel's keyword arguments moved to the test device (the interpreter
    runs on CPU tensors only, a GPU launch on device tensors only)."""
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


def _paged(kv: torch.Tensor, page_size: int, gen: torch.Generator):
    """Scatter one sequence's [L, Hkv, D] keys into shuffled pages; returns cache, page row."""
    length, heads, dim = kv.shape
    num_pages = -(-length // page_size) + 2
    order = torch.randperm(num_pages, generator=gen)
    cache = torch.full((num_pages, page_size, heads, dim), float("nan"), dtype=kv.dtype)
    for p in range(-(-length // page_size)):
        chunk = kv[p * page_size : (p + 1) * page_size]
        cache[order[p], : chunk.shape[0]] = chunk
    return cache, order[: -(-length // page_size)].to(torch.int32)


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_extend_never_reads_keys_outside_the_window(page_size):
    """Keys left of the window and cache slots past the sequence end hold NaN; a kernel that
    loaded them (or multiplied a masked probability 0 by them) would return NaN."""
    gen = torch.Generator().manual_seed(7)
    seq_len, n_q, window, heads_q, heads_kv, dim = 100, 10, 7, 4, 2, 64
    q = torch.randn(n_q, heads_q, dim, generator=gen).half()
    k = torch.randn(seq_len, heads_kv, dim, generator=gen).half()
    v = torch.randn(seq_len, heads_kv, dim, generator=gen).half()
    want = torch.empty_like(q)
    cache_args = {}
    for name, x in (("k", k), ("v", v)):
        cache_args[name], page_row = _paged(x, page_size, torch.Generator().manual_seed(1))
    kwargs = dict(
        cu_seqlens_q=torch.tensor([0, n_q], dtype=torch.int32),
        page_table=page_row[None],
        cache_seqlens=torch.tensor([seq_len], dtype=torch.int32),
        max_seqlen_q=n_q,
        window_left=window,
        sinks=None,
        softmax_scale=1 / math.sqrt(dim),
        k_scale=1.0,
        v_scale=1.0,
        lse=None,
    )
    reference_extend(q, cache_args["k"], cache_args["v"], out=want, **kwargs)
    # The first visible key is 90 - 7 = 83; with 16-key blocks nothing below 80 is needed.
    first_needed = (seq_len - n_q - window) // 16 * 16
    for name in ("k", "v"):
        cache = cache_args[name]
        for pos in range(first_needed):
            cache[page_row[pos // page_size], pos % page_size] = float("nan")
    q, kwargs = q.to(DEVICE), _to_device(kwargs)
    got = torch.full_like(q, float("nan"))
    with pin_config(extend.KERNEL_NAME, AttentionConfig(16, 16, 1, 1)):
        extend.mha_extend_with_kvcache(
            q, cache_args["k"].to(DEVICE), cache_args["v"].to(DEVICE), out=got, **kwargs
        )
    assert_close(got, want.to(DEVICE), dtype=torch.float16, name="out")


@pytest.mark.parametrize(
    "config",
    [
        AttentionConfig(32, 16, 4, 1),
        AttentionConfig(16, 32, 4, 1),
        AttentionConfig(32, 16, 4, 1, heads_per_tile=4),
        AttentionConfig(32, 16, 4, 1, split_mask=False),
    ],
)
@pytest.mark.parametrize("causal,window", [(True, -1), (True, 20), (False, -1)])
def test_prefill_pinned_configs(config, causal, window):
    """Tile shapes where BLOCK_M != BLOCK_N move the masked/unmasked split boundaries; GQA
    packing (4 heads x 8 tokens) changes which rows share a tile."""
    gen = torch.Generator().manual_seed(3)
    lens = [45, 1, 70]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    total, heads_q, heads_kv, dim = sum(lens), 4, 1, 64
    q, k, v = (
        torch.randn(total, h, dim, generator=gen).half() for h in (heads_q, heads_kv, heads_kv)
    )
    sinks = torch.randn(heads_q, generator=gen)
    kwargs = dict(
        cu_seqlens=cu,
        max_seqlen=max(lens),
        causal=causal,
        window_left=window,
        sinks=sinks,
        softmax_scale=0.125,
    )
    want, want_lse = torch.empty_like(q), torch.empty(total, heads_q)
    reference_prefill(q, k, v, out=want, lse=want_lse, **kwargs)
    q, k, v, kwargs = q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), _to_device(kwargs)
    got = torch.full_like(q, float("nan"))
    got_lse = torch.full((total, heads_q), float("nan"), device=DEVICE)
    with pin_config(prefill.KERNEL_NAME, config):
        prefill.mha_prefill(q, k, v, out=got, lse=got_lse, **kwargs)
    assert_close(got, want.to(DEVICE), dtype=torch.float16, name="out")
    assert_close(got_lse, want_lse.to(DEVICE), dtype=torch.float32, name="lse")


def _growing_score_keys(length, dim, block_n, scale, dtype, gen):
    """Keys whose log2-domain scores against a near-constant query grow by ~12 per key block
    over the first third of the sequence (every block moves the running max past the lazy
    rescale's slack), by ~3 per block over the second (the max is carried stale, p above 1),
    then fall."""
    pos = torch.arange(length, dtype=torch.float64)
    third = length // 3
    step = torch.where(pos < third, 12.0, torch.where(pos < 2 * third, 3.0, -6.0)) / block_n
    log2_score = step.cumsum(0) + torch.randn(length, generator=gen, dtype=torch.float64)
    magnitude = log2_score / (scale * dim * math.log2(math.e))
    return magnitude[:, None, None].expand(length, 1, dim).to(dtype)


def test_prefill_running_max_growth():
    """Scores that keep growing along the sequence: the unmasked blocks' lazy rescale both
    fires (max outgrows its slack) and skips (stale max, probabilities up to 2^8) against the
    reference's exact softmax, with sinks and lse."""
    gen = torch.Generator().manual_seed(11)
    dtype = torch.bfloat16 if ON_GPU else torch.float16
    length, heads_q, dim, scale = (1024 if ON_GPU else 192), 8, 64, 0.125
    config = choose_config(platform_of(torch.device(DEVICE)), dim, False)
    k = _growing_score_keys(length, dim, config.block_n, scale, dtype, gen).to(DEVICE)
    v = torch.randn(length, 1, dim, generator=gen).to(dtype).to(DEVICE)
    q = (1 + 0.05 * torch.randn(length, heads_q, dim, generator=gen)).to(dtype).to(DEVICE)
    kwargs = dict(
        cu_seqlens=torch.tensor([0, length], dtype=torch.int32, device=DEVICE),
        max_seqlen=length, causal=True, window_left=-1,
        sinks=torch.randn(heads_q, generator=gen).to(DEVICE), softmax_scale=scale,
    )  # fmt: skip
    want = torch.empty_like(q)
    want_lse = torch.empty(length, heads_q, device=DEVICE)
    reference_prefill(q, k, v, out=want, lse=want_lse, **kwargs)
    got, got_lse = torch.full_like(q, float("nan")), torch.full_like(want_lse, float("nan"))
    prefill.mha_prefill(q, k, v, out=got, lse=got_lse, **kwargs)
    assert_close(got, want, dtype=dtype, name="out")
    assert_close(got_lse, want_lse, dtype=torch.float32, name="lse")


def test_pin_config_is_scoped():
    pinned = AttentionConfig(16, 16, 1, 1)
    with pin_config(prefill.KERNEL_NAME, pinned):
        assert pinned_config(prefill.KERNEL_NAME) == pinned
        assert pinned_config(extend.KERNEL_NAME) is None
    assert pinned_config(prefill.KERNEL_NAME) is None
    assert choose_config(KNOWN_PLATFORMS["h100"], 64, False).block_m == 128


@pytest.mark.parametrize(
    "platform",
    [
        KNOWN_PLATFORMS["h100"],
        Platform("nvidia", "sm_80", 0, 108, "NVIDIA A100"),
        KNOWN_PLATFORMS["mi300x"],
        KNOWN_PLATFORMS["mi355x"],
    ],
    ids=lambda platform: platform.arch,
)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_configs_tile_the_head_dim(platform, head_dim):
    for window in (False, True):
        config = choose_config(platform, head_dim, window)
        assert config.block_m >= 16 and config.block_n >= 16
        assert config.block_m & (config.block_m - 1) == 0
        assert config.block_n & (config.block_n - 1) == 0
