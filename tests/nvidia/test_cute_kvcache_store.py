"""CuTe DSL kvcache_store (`cute.kvcache_store`).

CPU: the module imports and registers without the DSL and declines naming the extra; it
declines off sm_90/sm_100; AOT cubins are found by source hash; with the DSL importable (skipped
otherwise, with the reason), every AOT specialization compiles for sm_90a on this CPU.
GPU (marker gpu): the shared conformance cases, GPT-OSS-120B shapes, FP8 rounding on exact
values, and misaligned views that take narrower vectors.
"""

from __future__ import annotations

import json

import pytest
import torch
from nvidia_gpu_helpers import registered_kernel

from tokenspeed_kernel.ops.attention.request import KVStoreRequest
from tokenspeed_kernel.platform import KNOWN_PLATFORMS, Platform
from tokenspeed_kernel.presets import PRESETS
from tokenspeed_kernel.registry import get_kernel
from tokenspeed_kernel.testing import assert_close, assert_conformance, conformance_params
from tokenspeed_kernel.testing.cases import conformance_cases
from tokenspeed_kernel_nvidia import _cute_runtime as rt
from tokenspeed_kernel_nvidia import cute_kvcache_store as store

FP8 = torch.float8_e4m3fn
H100 = KNOWN_PLATFORMS["h100"]
GPT_OSS = KVStoreRequest(torch.bfloat16, torch.bfloat16, 64, 8, 64)


def _dsl_skip_reason() -> str:
    if rt.dsl_version() is None:
        return "the CuTe DSL is not installed (pip install 'tokenspeed-kernel-nvidia[cute]')"
    return ""


needs_dsl = pytest.mark.skipif(bool(_dsl_skip_reason()), reason=_dsl_skip_reason() or "-")


def _spec():
    return registered_kernel("kvcache_store", store)


def test_registers_below_triton():
    spec = _spec()
    assert spec.backend == "cute"
    assert spec.priority < get_kernel("kvcache_store", "triton.kvcache_store").priority


def test_declines_without_the_dsl_naming_the_extra(no_dsl):
    verdict = _spec().supports(GPT_OSS, H100)
    assert not verdict.ok
    assert "tokenspeed-kernel-nvidia[cute]" in verdict.reason


@pytest.mark.parametrize(
    "platform",
    [
        Platform("nvidia", "sm_80", 0, 108, "A100", 166912, 40 << 20, 167936),
        KNOWN_PLATFORMS["mi300x"],
        KNOWN_PLATFORMS["cpu"],
    ],
    ids=lambda p: p.arch,
)
def test_declines_off_hopper_and_blackwell(platform):
    spec = _spec()
    mismatches = [p.mismatch(platform) for p in spec.platforms]
    assert all(mismatches), f"{spec.name} admits {platform.arch}"
    verdict = spec.supports(GPT_OSS, platform)
    assert not verdict.ok and platform.arch in verdict.reason


def test_aot_cubins_are_found_by_source_hash(no_dsl, tmp_path, monkeypatch):
    """A cubin for this source in TOKENSPEED_KERNEL_CUTE_CUBINS makes the kernel available
    without the DSL; one built from other sources (another hash) is not loaded."""
    build = store.build(torch.bfloat16, torch.bfloat16, 8, 64, 8)
    aot = tmp_path / "aot"
    monkeypatch.setenv(rt.CUBIN_DIR_ENV, str(aot))
    verdict = _spec().supports(GPT_OSS, H100)
    assert not verdict.ok and rt.CUBIN_DIR_ENV in verdict.reason
    stale = aot / f"{build.key}-000000000000.sm_90a"
    aot.mkdir()
    stale.with_suffix(".cubin").write_bytes(b"\x7fELF")
    stale.with_suffix(".json").write_text(json.dumps({"symbol": "k"}))
    assert rt.find_cubin(build, "sm_90a") is None
    rt.write_cubin(aot, build, "sm_90a", rt.Cubin(b"\x7fELF-image", "kernel_symbol"))
    assert rt.find_cubin(build, "sm_90a") == rt.Cubin(b"\x7fELF-image", "kernel_symbol")
    assert _spec().supports(GPT_OSS, H100).ok
    assert rt.find_cubin(build, "sm_100a") is None


def test_vector_width_follows_alignment():
    """16-byte vectors for dense tensors; a K/V view out of a fused QKV row with an odd
    stride, or an odd head dim, takes the widest width every row start allows."""
    k = torch.empty(4, 8, 64, dtype=torch.bfloat16)
    cache = torch.empty(3, 16, 8, 64, dtype=FP8)
    assert store.vector_width(k, k, cache, cache) == 8
    qkv = torch.empty(4, 8 * 64 * 3 + 4, dtype=torch.bfloat16)
    k_view = qkv[:, 2 : 2 + 8 * 64].view(4, 8, 64)
    assert store.vector_width(k_view, k, cache, cache) == 2
    odd = torch.empty(4, 3, 20, dtype=torch.float16)
    odd_cache = torch.empty(2, 4, 3, 20, dtype=torch.float16)
    assert store.vector_width(odd, odd, odd_cache, odd_cache) == 4


def test_aot_builds_cover_every_conformance_case():
    """Each conformance case (presets included) and the odd GPU tests below have their
    16-byte specialization among the AOT builds, so a cubin directory serves them all."""
    keys = {b.key for b in store.cute_builds()}
    cases = list(conformance_cases("kvcache_store"))
    for preset in PRESETS:
        cases += conformance_cases("kvcache_store", preset=preset)
    for case in cases:
        s = case.shape
        vec = 8 if s.head_dim % 8 == 0 else 1
        key = store.build(s.dtype, s.cache_dtype, s.num_kv_heads, s.head_dim, vec).key
        assert key in keys, f"{case.name}: {key} is not built ahead of time"


@needs_dsl
def test_compiles_for_sm90a_on_the_cpu(tmp_path, monkeypatch):
    """Every AOT specialization compiles for sm_90a here, without a GPU, through the same
    `build` command CI and the GPU instructions use; the cubins are then found by name."""
    out = tmp_path / "cubins"
    args = ["build", "--arch", "sm_90a", "--out", str(out), "--modules", "cute_kvcache_store"]
    assert rt.main(args) == 0
    monkeypatch.setenv(rt.CUBIN_DIR_ENV, str(out))
    for build in store.cute_builds():
        cubin = rt.find_cubin(build, "sm_90a")
        assert cubin is not None, build.key
        assert cubin.image[:4] == b"\x7fELF" and "store_kernel" in cubin.symbol


# ---- GPU -------------------------------------------------------------------------------------


def _params(preset=None):
    _spec()
    return [
        p
        for p in conformance_params(op="kvcache_store", backend="cute", preset=preset)
        if preset is None or p.values[1].preset == preset
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,case", _params())
def test_conformance(kernel, case):
    assert_conformance(kernel, case)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,case", _params("gpt-oss-120b"))
def test_conformance_gpt_oss_120b(kernel, case):
    assert_conformance(kernel, case)


@pytest.mark.gpu
def test_fp8_rounds_to_nearest_even_and_saturates():
    """e4m3 boundaries: ties to even, saturation to +-448, the mantissa carry into the
    exponent (7.75 -> 8), subnormals; expected codes written out."""
    scale = 0.5
    pairs = [
        (7.75, 8.0),
        (-7.75, -8.0),
        (1.0625, 1.0),
        (1.1875, 1.25),
        (8.5, 8.0),
        (9.5, 10.0),
        (460.0, 448.0),
        (1.2e5, 448.0),
        (-1.2e5, -448.0),
        (0.0, 0.0),
        (2.0**-9, 2.0**-9),
        (3 * 2.0**-10, 2.0**-8),
        (7.5, 7.5),
    ]
    values = torch.tensor([p[0] * scale for p in pairs], dtype=torch.float32)
    expected = torch.tensor([p[1] for p in pairs], dtype=torch.float32)
    num = values.numel()
    k = values.reshape(num, 1, 1).expand(num, 1, 64).to(torch.float16).contiguous()
    assert torch.equal(k.float()[:, 0, 0], values)
    k_cache = torch.full((num, 2, 1, 64), 3.0, dtype=FP8)
    args = [t.cuda() for t in (k, -k, k_cache, k_cache.clone())]
    slots = (torch.arange(num, dtype=torch.int64) * 2 + 1).cuda()
    store.kvcache_store(*args, slot_mapping=slots, k_scale=scale, v_scale=scale)
    assert torch.equal(args[2][:, 1, 0].float().cpu(), expected[:, None].expand(num, 64))
    assert torch.equal(args[3][:, 1, 0].float().cpu(), -expected[:, None].expand(num, 64))
    assert torch.equal(args[2][:, 0].float().cpu(), torch.full((num, 1, 64), 3.0))


@pytest.mark.gpu
@pytest.mark.parametrize("heads,head_dim,offset", [(3, 80, 1), (64, 128, 0), (8, 64, 2)])
def test_views_odd_shapes_and_bad_slots(heads, head_dim, offset):
    """K and V as views into a fused row at an element offset (narrower vectors), odd heads and
    dims, and slots negative or past the cache: skipped, nothing else written."""
    gen = torch.Generator().manual_seed(heads)
    tokens, page_size, num_pages = 7, 4, 3
    row = heads * head_dim
    qkv = torch.randn(tokens, 3 * row + offset, generator=gen).half()
    k = qkv[:, offset + row : offset + 2 * row].view(tokens, heads, head_dim)
    v = qkv[:, offset + 2 * row : offset + 3 * row].view(tokens, heads, head_dim)
    cache_shape = (num_pages, page_size, heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).half()
    v_cache = torch.randn(cache_shape, generator=gen).half()
    slots = torch.tensor([11, -1, 0, 5, num_pages * page_size, 6, -7], dtype=torch.int64)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if 0 <= slot < num_pages * page_size:
            want_k[slot // page_size, slot % page_size] = k[t]
            want_v[slot // page_size, slot % page_size] = v[t]
    qkv_gpu = qkv.cuda()
    k_gpu = qkv_gpu[:, offset + row : offset + 2 * row].view(tokens, heads, head_dim)
    v_gpu = qkv_gpu[:, offset + 2 * row : offset + 3 * row].view(tokens, heads, head_dim)
    caches = [k_cache.cuda(), v_cache.cuda()]
    if offset:
        assert store.vector_width(k_gpu, v_gpu, *caches) < 8
    store.kvcache_store(k_gpu, v_gpu, *caches, slot_mapping=slots.cuda(), k_scale=1.0, v_scale=1.0)
    assert_close(caches[0].cpu(), want_k, dtype=torch.float32, name="k_cache")
    assert_close(caches[1].cpu(), want_v, dtype=torch.float32, name="v_cache")


@pytest.mark.gpu
def test_captures_in_a_cuda_graph():
    """The launch goes to torch's current stream, so a graph records and replays it."""
    k = torch.randn(16, 8, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    k_cache = torch.zeros(4, 64, 8, 64, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(16, device="cuda", dtype=torch.int64) * 3
    store.kvcache_store(k, v, k_cache, v_cache, slot_mapping=slots, k_scale=1.0, v_scale=1.0)
    k_cache.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        store.kvcache_store(k, v, k_cache, v_cache, slot_mapping=slots, k_scale=1.0, v_scale=1.0)
    assert not k_cache.any()
    graph.replay()
    torch.cuda.synchronize()
    flat = k_cache.view(-1, 8, 64)
    assert torch.equal(flat[slots], k)
