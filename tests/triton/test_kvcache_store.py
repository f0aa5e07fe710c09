"""Triton kvcache_store: the shared conformance cases (CPU through the Triton interpreter), the
GPT-OSS-120B shapes on the GPU, and FP8 rounding/saturation checks against exact values.

Interpreter shim (CPU only, stated openly): Triton 3.6's interpreter converts float32 to fp8
with round-half-up on the truncated mantissa and drops the carry into the exponent, so e.g.
-7.5 becomes -4 instead of -8 (the "powers of two" bug). Compiled kernels use the hardware
conversion (cvt.rn.satfinite on sm_89+, the CDNA cvt on AMD) and are unaffected. In interpreter
runs the float32 -> fp8e4nv conversion is replaced by torch's correctly rounded cast; every
other conversion and every tolerance stays as it is.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tokenspeed_kernel.testing import assert_close, assert_conformance, conformance_params
from tokenspeed_kernel_triton.attention.kvcache_store import kvcache_store

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
FP8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def interpreter_fp8_rounding_shim(monkeypatch):
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    import triton.language as tl
    from triton.runtime import interpreter

    buggy = interpreter._convert_float

    def convert(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.float8e4nv:
            x = torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy())
            return x.to(FP8).view(torch.uint8).numpy().reshape(data.shape)
        return buggy(data, input_dtype, output_dtype, rounding_mode)

    monkeypatch.setattr(interpreter, "_convert_float", convert)
    yield buggy


def _params(preset=None, dtypes=(torch.float16, torch.bfloat16)):
    return [
        p
        for p in conformance_params(
            op="kvcache_store", backend="triton", preset=preset, dtypes=dtypes
        )
        if preset is None or p.values[1].preset == preset
    ]


@pytest.mark.parametrize("kernel,case", _params())
def test_conformance(kernel, case):
    assert_conformance(kernel, case)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,case", _params("gpt-oss-120b"))
def test_conformance_gpt_oss_120b(kernel, case):
    assert_conformance(kernel, case)


def test_fp8_rounds_to_nearest_even_and_saturates():
    """Values chosen on e4m3 rounding boundaries: ties go to the even code, values past the
    largest code saturate to +-448, a carry out of the mantissa reaches the exponent
    (7.75 -> 8), subnormals round too. Expected codes are written out, not computed by the
    code under test."""
    scale = 0.5
    # x / scale, then the e4m3fn value it must become.
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
    # Every chosen value is exact in fp16, so the input rounding cannot hide an error.
    assert torch.equal(k.float()[:, 0, 0], values)
    v = -k
    k_cache = torch.full((num, 2, 1, 64), 3.0, dtype=FP8)
    v_cache = k_cache.clone()
    slots = torch.arange(num, dtype=torch.int64) * 2 + 1
    args = [t.to(DEVICE) for t in (k, v, k_cache, v_cache)]
    kvcache_store(*args, slot_mapping=slots.to(DEVICE), k_scale=scale, v_scale=scale)
    got_k = args[2][:, 1, 0].float().cpu()
    got_v = args[3][:, 1, 0].float().cpu()
    assert torch.equal(got_k, expected[:, None].expand(num, 64))
    assert torch.equal(got_v, -expected[:, None].expand(num, 64))
    # Slot offset 0 of every page was not addressed and keeps its old contents.
    assert torch.equal(args[2][:, 0].float().cpu(), torch.full((num, 1, 64), 3.0))


@pytest.mark.parametrize("num_kv_heads,head_dim", [(3, 80), (64, 128)])
def test_odd_heads_and_wide_tiles(num_kv_heads, head_dim):
    """Head counts that are not a power of two, head dims that need masking, and a [heads, D]
    tile larger than one program's (split over a second grid axis)."""
    gen = torch.Generator().manual_seed(3)
    tokens, page_size, num_pages = 5, 4, 3
    k = torch.randn(tokens, num_kv_heads, head_dim, generator=gen).half()
    v = torch.randn(tokens, num_kv_heads, head_dim, generator=gen).half()
    cache_shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).half()
    v_cache = torch.randn(cache_shape, generator=gen).half()
    slots = torch.tensor([11, -1, 0, 5, 6], dtype=torch.int64)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want_k[slot // page_size, slot % page_size] = k[t]
            want_v[slot // page_size, slot % page_size] = v[t]
    args = [x.to(DEVICE) for x in (k, v, k_cache, v_cache)]
    kvcache_store(*args, slot_mapping=slots.to(DEVICE), k_scale=1.0, v_scale=1.0)
    assert_close(args[2].cpu(), want_k, dtype=torch.float32, name="k_cache")
    assert_close(args[3].cpu(), want_v, dtype=torch.float32, name="v_cache")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter only")
def test_fp8_store_declines_on_an_interpreter_that_rounds_wrongly(
    interpreter_fp8_rounding_shim, monkeypatch
):
    """Without the shim, the selector must not pick this kernel for an FP8 cache on the CPU:
    it would store wrongly rounded codes. 16-bit caches are unaffected."""
    from triton.runtime import interpreter

    from tokenspeed_kernel.ops.attention.request import KVStoreRequest
    from tokenspeed_kernel.platform import KNOWN_PLATFORMS
    from tokenspeed_kernel.registry import get_kernel

    monkeypatch.setattr(interpreter, "_convert_float", interpreter_fp8_rounding_shim)
    spec = get_kernel("kvcache_store", "triton.kvcache_store")
    cpu = KNOWN_PLATFORMS["cpu"]
    verdict = spec.supports(KVStoreRequest(torch.float16, FP8, 64, 2, 16), cpu)
    assert not verdict.ok and "rounds float32 -> fp8" in verdict.reason
    assert spec.supports(KVStoreRequest(torch.float16, torch.float16, 64, 2, 16), cpu).ok
