"""CuTe DSL decode attention (`cute.mha_decode_with_kvcache`).

CPU: registration and declines (no DSL: the extra is named; off sm_90/sm_100; page sizes that
are not whole 16-key tiles), the split plan, the alignment predicate; with the DSL importable
(skipped otherwise, with the reason), the GPT-OSS specializations compile for sm_90a here.
GPU (marker gpu): GPT-OSS head shapes against the core reference (odd and empty sequences,
page sizes 16-128, sinks fp32/bf16/dominant, lse), the shared cases it accepts, and CUDA-graph
replays (the merge counters must come back to zero).
"""

from __future__ import annotations

import pytest
import torch
from nvidia_gpu_helpers import registered_kernel

from tokenspeed_kernel.ops.attention.request import AttentionRequest
from tokenspeed_kernel.platform import KNOWN_PLATFORMS, Platform
from tokenspeed_kernel.registry import get_kernel
from tokenspeed_kernel.testing import assert_conformance, conformance_params
from tokenspeed_kernel.testing.cases import attention_case
from tokenspeed_kernel.testing.inputs import AttentionShape
from tokenspeed_kernel_nvidia import _cute_runtime as rt
from tokenspeed_kernel_nvidia import cute_decode as decode

OP = "mha_decode_with_kvcache"
H100 = KNOWN_PLATFORMS["h100"]
GPT_OSS = AttentionRequest(torch.bfloat16, torch.bfloat16, 64, 64, 8, 64, 1, sinks=True, lse=True)
DSL_MISSING = "" if rt.dsl_version() else "the CuTe DSL is not installed (pip install '%s')"


def _spec():
    return registered_kernel(OP, decode)


def test_registers_below_triton():
    spec = _spec()
    assert spec.backend == "cute"
    assert spec.priority < get_kernel(OP, "triton.mha_decode_with_kvcache").priority


def test_declines_without_the_dsl_naming_the_extra(no_dsl):
    verdict = _spec().supports(GPT_OSS, H100)
    assert not verdict.ok and "tokenspeed-kernel-nvidia[cute]" in verdict.reason


def test_declines_off_hopper_and_blackwell_and_partial_tiles():
    spec = _spec()
    a100 = Platform("nvidia", "sm_80", 0, 108, "A100", 166912, 40 << 20, 167936)
    for platform in (a100, KNOWN_PLATFORMS["mi300x"], KNOWN_PLATFORMS["cpu"]):
        assert all(p.mismatch(platform) for p in spec.platforms), platform.arch
        verdict = spec.supports(GPT_OSS, platform)
        assert not verdict.ok and platform.arch in verdict.reason
    assert not spec.supports(GPT_OSS._replace(page_size=24), H100).ok
    verdict = decode.supports(GPT_OSS._replace(page_size=24), H100)
    assert not verdict.ok and "multiple of 16" in verdict.reason


@pytest.mark.parametrize("feature", ["window", "q_len", "gqa_ratio", "head_dim", "kv_dtype"])
def test_traits_exclude_what_the_kernel_does_not_do(feature):
    """Sliding windows, Q > 1, other head groupings and dims, FP8 caches: not declared, so
    the selector never offers them to this kernel."""
    changed = {
        "window": dict(window_left=127),
        "q_len": dict(q_len=2),
        "gqa_ratio": dict(num_q_heads=32),
        "head_dim": dict(head_dim=128),
        "kv_dtype": dict(kv_dtype=torch.float8_e4m3fn),
    }[feature]
    verdict = _spec().supports(GPT_OSS._replace(**changed), H100)
    assert not verdict.ok and feature in verdict.reason


@pytest.mark.parametrize("batch", [1, 2, 3, 16, 64, 128])
@pytest.mark.parametrize("capacity", [1, 16, 100, 4096, 8192, 131072])
def test_split_plan_covers_the_cache_in_whole_tiles(batch, capacity):
    chunk, splits = decode.plan_splits(132, batch, 8, capacity)
    assert chunk % decode.TILE == 0 and chunk >= decode.TILE
    assert splits * chunk >= capacity > (splits - 1) * chunk
    assert chunk >= min(64, -(-capacity // decode.TILE) * decode.TILE)


def test_split_plan_fills_the_gpu_at_batch_one():
    chunk, splits = decode.plan_splits(132, 1, 8, 8192)
    assert (chunk, splits) == (256, 32)


def test_pinned_config_changes_the_split_plan():
    """More CTAs per SM, more (shorter) chunks; the plan still covers the cache."""
    base = decode.plan_splits(132, 1, 8, 8192)
    more = decode.plan_splits(132, 1, 8, 8192, decode.DecodeConfig(ctas_per_sm=4))
    fewer = decode.plan_splits(132, 1, 8, 8192, decode.DecodeConfig(ctas_per_sm=1))
    assert fewer[1] < base[1] < more[1]
    assert all(chunk * splits >= 8192 for chunk, splits in (base, more, fewer))


def test_alignment_predicate():
    q = torch.empty(2, 1, 64, 64, dtype=torch.bfloat16)
    cache = torch.empty(4, 64, 8, 64, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    assert decode._aligned(q, cache, cache, out)
    fused = torch.empty(2, 1, 64 * 64 + 4, dtype=torch.bfloat16)
    q_view = fused[:, :, 4:].view(2, 1, 64, 64)
    assert not decode._aligned(q_view, cache, cache, out)


@pytest.mark.skipif(bool(DSL_MISSING), reason=DSL_MISSING % rt.EXTRA if DSL_MISSING else "-")
@pytest.mark.parametrize(
    "dtype,sink_dtype,lse,warps",
    [(torch.bfloat16, torch.float32, True, 8), (torch.float16, None, False, 4)],
)
def test_compiles_for_sm90a_on_the_cpu(dtype, sink_dtype, lse, warps):
    cubin = decode.build(dtype, sink_dtype, lse, warps).compile_fn("sm_90a")
    assert cubin.image[:4] == b"\x7fELF" and "decode_kernel" in cubin.symbol


# ---- GPU -------------------------------------------------------------------------------------

A = AttentionShape
_GPT_OSS = dict(num_q_heads=64, num_kv_heads=8, head_dim=64, q_lens=(1,))
CASES = [
    ("b1-ctx8192-page64-sinks-lse", A((8192,), page_size=64, sinks=0.0, lse=True, **_GPT_OSS)),
    ("b3-empty-one-odd-page16", A((0, 1, 1000), page_size=16, sinks=0.0, lse=True, **_GPT_OSS)),
    (
        "b16-mixed-page64-nosinks",
        A((17, 64, 65, 300, 2049, 1, 8191, 33, 128, 129, 0, 4000, 63, 16, 15, 777), page_size=64,
          **_GPT_OSS),
    ),
    ("b2-sink+30-page128", A((129, 7), page_size=128, sinks=30.0, q_gain=20.0, **_GPT_OSS)),
    (
        "b2-bf16-sinks-page32-lse",
        A((500, 4097), page_size=32, sinks=0.0, sinks_dtype=torch.bfloat16, lse=True, **_GPT_OSS),
    ),
    ("b4-fp16-page64-lse", A((1, 2, 3, 5000), dtype=torch.float16, page_size=64, lse=True,
                             **_GPT_OSS)),
    ("b2-empty-nosinks-lse", A((0, 0), page_size=64, lse=True, **_GPT_OSS)),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("name,shape", CASES, ids=[c[0] for c in CASES])
def test_gpt_oss_shapes(name, shape):
    assert_conformance(_spec(), attention_case(f"cute-{name}", OP, shape))


def _shared_params(preset=None):
    _spec()
    return [
        p
        for p in conformance_params(op=OP, backend="cute", preset=preset)
        if preset is None or p.values[1].preset == preset
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,case", _shared_params() + _shared_params("gpt-oss-120b"))
def test_shared_conformance_cases(kernel, case):
    assert_conformance(kernel, case)


@pytest.mark.gpu
def test_graph_replays_reset_the_merge_counters():
    """Replayed in a CUDA graph, every replay gives the eager result: the last CTA of each
    (sequence, KV head) puts its counter back to zero."""
    case = attention_case("cute-graph", OP, A((300, 8192, 5), page_size=64, sinks=0.0, **_GPT_OSS))
    args, kwargs = case.build("cuda", 0)
    fn = _spec().fn
    fn(*args, **kwargs)
    eager = kwargs["out"].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*args, **kwargs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*args, **kwargs)
    for _ in range(3):
        kwargs["out"].zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(kwargs["out"], eager)
    assert not decode._counters_for(kwargs["out"].device).any()
