"""CuTe DSL causal prefill (`cute.mha_prefill`).

CPU: registration and declines (no DSL: the extra is named; off sm_90; what the traits leave
out), the alignment predicate; with the DSL importable (skipped otherwise, with the reason),
the first launch's and the redo launch's kernels compile for sm_90a here.
GPU (marker gpu): GPT-OSS head shapes and other groupings against the core reference (odd,
empty and long sequences, sinks fp32/bf16/dominant, lse), logits large enough that tiles take
the shifted redo, fused-QKV views, the shared cases it accepts, and CUDA-graph replays.
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
from tokenspeed_kernel_nvidia import cute_prefill as prefill

OP = "mha_prefill"
H100 = KNOWN_PLATFORMS["h100"]
GPT_OSS = AttentionRequest(torch.bfloat16, torch.bfloat16, 64, 64, 8, sinks=True)
DSL_MISSING = "" if rt.dsl_version() else "the CuTe DSL is not installed (pip install '%s')"


def _spec():
    return registered_kernel(OP, prefill)


def test_registers_below_triton_and_fa3():
    """Priority alone never picks it: the measured rankings do, where it leads."""
    from tokenspeed_kernel_nvidia.fa3.prefill import PRIORITY as FA3_PRIORITY

    spec = _spec()
    assert spec.backend == "cute"
    assert spec.priority < min(get_kernel(OP, "triton.mha_prefill").priority, FA3_PRIORITY)


def test_declines_without_the_dsl_naming_the_extra(no_dsl):
    verdict = _spec().supports(GPT_OSS, H100)
    assert not verdict.ok and "tokenspeed-kernel-nvidia[cute]" in verdict.reason


def test_declines_off_hopper():
    spec = _spec()
    a100 = Platform("nvidia", "sm_80", 0, 108, "A100", 166912, 40 << 20, 167936)
    b200 = Platform("nvidia", "sm_100", 0, 148, "B200", 232448, 126 << 20, 233472)
    for platform in (a100, KNOWN_PLATFORMS["mi300x"], KNOWN_PLATFORMS["cpu"]):
        assert all(p.mismatch(platform) for p in spec.platforms), platform.arch
    for platform in (a100, b200, KNOWN_PLATFORMS["cpu"]):
        verdict = prefill.supports(GPT_OSS, platform)
        assert not verdict.ok and platform.arch in verdict.reason


@pytest.mark.parametrize("feature", ["window", "non_causal", "head_dim", "dtype", "kv_dtype"])
def test_traits_exclude_what_the_kernel_does_not_do(feature):
    """Sliding windows, non-causal attention, other head dims and fp16 (unshifted 2^s
    overflows fp16's range; bf16 has float32's) are not declared: the selector never offers
    them to this kernel."""
    changed = {
        "window": dict(window_left=127),
        "non_causal": dict(causal=False),
        "head_dim": dict(head_dim=128),
        "dtype": dict(dtype=torch.float16, kv_dtype=torch.float16),
        "kv_dtype": dict(kv_dtype=torch.float8_e4m3fn),
    }[feature]
    verdict = _spec().supports(GPT_OSS._replace(**changed), H100)
    assert not verdict.ok and feature in verdict.reason


def test_any_gqa_grouping_and_lse_are_declared(monkeypatch):
    monkeypatch.setattr(rt, "available", lambda build, arch: True)
    spec = _spec()
    for request in (GPT_OSS._replace(num_q_heads=8, num_kv_heads=8), GPT_OSS._replace(lse=True)):
        assert spec.supports(request, H100).ok, request


def test_alignment_predicate():
    qkv = torch.empty(5, 64 + 2 * 8, 64, dtype=torch.bfloat16)
    assert prefill._rows_aligned(qkv[:, :64], 8)
    assert prefill._rows_aligned(qkv[:, 64:72], 8)
    # A fused projection whose q starts 4 elements (8 bytes) into the buffer.
    odd = torch.empty(5 * 80 * 64 + 4, dtype=torch.bfloat16)[4:].view(5, 80, 64)
    assert not prefill._rows_aligned(odd[:, :64], 8)
    assert prefill._rows_aligned(odd[:, :64], 2)
    assert not prefill._rows_aligned(qkv[:, :64].transpose(1, 2), 8)


@pytest.mark.skipif(bool(DSL_MISSING), reason=DSL_MISSING % rt.EXTRA if DSL_MISSING else "-")
@pytest.mark.parametrize(
    "sink_dtype,lse,redo", [(torch.float32, False, False), (torch.bfloat16, True, True)]
)
def test_compiles_for_sm90a_on_the_cpu(sink_dtype, lse, redo):
    cubin = prefill.build(sink_dtype, lse, redo).compile_fn("sm_90a")
    assert cubin.image[:4] == b"\x7fELF" and "prefill_kernel" in cubin.symbol


# ---- GPU -------------------------------------------------------------------------------------

A = AttentionShape
_GPT_OSS = dict(num_q_heads=64, num_kv_heads=8, head_dim=64)
CASES = [
    ("b2-8192-sinks", A((8192, 300), sinks=0.0, **_GPT_OSS)),
    ("b6-odd-empty-lse", A((1, 191, 0, 192, 193, 1000), sinks=0.0, lse=True, **_GPT_OSS)),
    ("b3-bf16-sinks-lse", A((4000, 7, 385), sinks=0.0, sinks_dtype=torch.bfloat16, lse=True,
                            **_GPT_OSS)),
    ("b2-nosinks-lse", A((129, 2049), lse=True, **_GPT_OSS)),
    ("b2-sink+30", A((129, 700), sinks=30.0, q_gain=20.0, lse=True, **_GPT_OSS)),
    # Logits far past 2^64 in exp2's units: tiles take the shifted redo.
    ("b2-large-logits-redo", A((777, 64), sinks=0.0, q_gain=40.0, lse=True, **_GPT_OSS)),
    # Row maxima around 64 in exp2's units: rows on both sides of the range check.
    ("b2-logits-at-the-range-bound", A((1000, 257), sinks=0.0, q_gain=14.0, lse=True,
                                       **_GPT_OSS)),
    ("b3-gqa1-heads4", A((65, 300, 2), num_q_heads=4, num_kv_heads=4, head_dim=64, sinks=0.0,
                         lse=True)),
    ("b2-gqa4-heads8", A((1, 500), num_q_heads=8, num_kv_heads=2, head_dim=64, lse=True)),
    ("b2-all-empty", A((0, 0), lse=True, **_GPT_OSS)),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("name,shape", CASES, ids=[c[0] for c in CASES])
def test_gpt_oss_shapes(name, shape):
    assert_conformance(_spec(), attention_case(f"cute-{name}", OP, shape))


def _shared_params(preset=None):
    _spec()
    return [
        p
        for p in conformance_params(op=OP, kernel=prefill.KERNEL_NAME, preset=preset)
        if preset is None or p.values[1].preset == preset
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,case", _shared_params() + _shared_params("gpt-oss-120b"))
def test_shared_conformance_cases(kernel, case):
    assert_conformance(kernel, case)


def _inputs(lengths, gain=1.0, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lengths)
    qkv = torch.randn(total, 64 + 2 * 8, 64, device="cuda", generator=gen).bfloat16()
    qkv[:, :64] *= gain
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    sinks = torch.randn(64, device="cuda", generator=gen)
    return qkv, cu.int(), sinks


def _run(q, k, v, cu, max_seqlen, sinks, out, lse=None):
    prefill.mha_prefill(
        q, k, v, cu_seqlens=cu, max_seqlen=max_seqlen, causal=True, window_left=-1,
        sinks=sinks, softmax_scale=0.125, out=out, lse=lse,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("gain", [1.0, 40.0])
def test_fused_qkv_views_and_a_mixed_batch_match_the_reference(gain):
    """q/k/v as slices of one fused projection (row stride 80 heads), some tiles redone and
    some not: every row still matches the reference."""
    from tokenspeed_kernel.ops.attention.reference import reference_prefill

    _spec()
    lengths = [300, 1, 1000]
    qkv, cu, sinks = _inputs(lengths, gain)
    q, k, v = qkv[:, :64], qkv[:, 64:72], qkv[:, 72:]
    out = torch.full_like(q, float("nan"))
    lse = torch.empty(q.shape[:2], device="cuda")
    _run(q, k, v, cu, max(lengths), sinks, out, lse)
    ref, ref_lse = torch.empty_like(q), torch.empty_like(lse)
    reference_prefill(
        q, k, v, cu_seqlens=cu, max_seqlen=max(lengths), causal=True, window_left=-1,
        sinks=sinks, softmax_scale=0.125, out=ref, lse=ref_lse,
    )  # fmt: skip
    torch.testing.assert_close(out.float(), ref.float(), atol=1.6e-2, rtol=1.6e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-4)


@pytest.mark.gpu
def test_graph_replays_match_eager():
    _spec()
    lengths = [4000, 5, 800]
    qkv, cu, sinks = _inputs(lengths)
    q, k, v = (x.contiguous() for x in (qkv[:, :64], qkv[:, 64:72], qkv[:, 72:]))
    out = torch.empty_like(q)
    _run(q, k, v, cu, max(lengths), sinks, out)
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _run(q, k, v, cu, max(lengths), sinks, out)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
