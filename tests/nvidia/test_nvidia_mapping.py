"""The adapters' argument mapping, on the CPU, against recording stand-ins of FA3 and FlashInfer
(nvidia_fakes.py: each implements the library function's documented semantics in float64).

An adapter that maps our normalized arguments wrongly (positions, page lists, scales, the lse
layout or base, the sink merge, gate/up order, scale interleave, padding) fails the shared
conformance cases against the core reference here; the keyword checks pin what each call
passes (clamped indices, workspaces allocated once, routing, dtypes). What this cannot catch
is a library whose real behaviour differs from its documentation: the GPU tests do that.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import sys

import pytest
import torch
from nvidia_fakes import FakeFA3, FakeFlashInfer, sm90_weight_interleave

from tokenspeed_kernel import selector
from tokenspeed_kernel.ops.moe.types import MoEConfig, MoEWeights
from tokenspeed_kernel.platform import fake_platform
from tokenspeed_kernel.registry import get_kernel
from tokenspeed_kernel.testing import assert_conformance, conformance_cases
from tokenspeed_kernel.testing.cases import attention_case
from tokenspeed_kernel.testing.conformance import moe_plan_for
from tokenspeed_kernel_nvidia import _attention
from tokenspeed_kernel_nvidia._library import FA3, FLASHINFER
from tokenspeed_kernel_nvidia.fa3 import decode as fa3_decode
from tokenspeed_kernel_nvidia.flashinfer import _common as fi_common
from tokenspeed_kernel_nvidia.flashinfer import _sink_wrapper, xqa_decode
from tokenspeed_kernel_nvidia.flashinfer.cutlass_moe import interleave_scales

DECODE, EXTEND, PREFILL = "mha_decode_with_kvcache", "mha_extend_with_kvcache", "mha_prefill"


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    """Small workspaces, no wrapper or selection carried over between tests."""
    monkeypatch.setattr(fi_common, "DECODE_WORKSPACE_BYTES", 1 << 16)
    monkeypatch.setattr(fi_common, "PREFILL_WORKSPACE_BYTES", 1 << 16)
    monkeypatch.setattr(_attention, "_workspaces", {})
    monkeypatch.setattr(_sink_wrapper, "_wrappers", {})
    yield
    selector._clear_cache()


def _install(monkeypatch, library, module_name, fake, version):
    monkeypatch.setitem(sys.modules, module_name, fake)
    monkeypatch.setattr(library, "installed_version", lambda: version)
    library.reset()


@pytest.fixture
def fa3(monkeypatch):
    fake = FakeFA3()
    _install(monkeypatch, FA3, "flash_attn_interface", fake, "3.0.0.post20260810")
    yield fake
    FA3.reset()


@pytest.fixture
def fi(monkeypatch):
    fake = FakeFlashInfer()
    _install(monkeypatch, FLASHINFER, "flashinfer", fake, "0.6.14")
    yield fake
    FLASHINFER.reset()


def _cases(op, **replace):
    """The shared cases of `op` (both dtypes), with `replace` applied to their shapes."""
    cases = conformance_cases(op)
    if not replace:
        return cases
    return [
        attention_case(f"{c.name}-{'-'.join(replace)}", op, dataclasses.replace(c.shape, **replace))
        for c in cases
    ]


def _params(op, **replace):
    return [pytest.param(c, id=c.name) for c in _cases(op, **replace)]


# --- FA3 --------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", [PREFILL, EXTEND, DECODE])
def test_fa3_conformance_through_the_stand_in(op, fa3):
    ran = 0
    for case in _cases(op):
        spec = get_kernel(op, f"fa3.{op}")
        with fake_platform("h100"):
            if not spec.supports(case.request, _h100()).ok:
                continue
            assert_conformance(spec, case, "cpu")
        ran += 1
    assert ran >= len(_cases(op)) // 2  # FP8 caches are the only declines


def _h100():
    from tokenspeed_kernel.platform import KNOWN_PLATFORMS

    return KNOWN_PLATFORMS["h100"]


def _decode_args(*, sinks_dtype=torch.float32, batch=3, lse=True, window_left=-1):
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(8, 16, 2, 64, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(8, 16, 2, 64, generator=gen).to(torch.bfloat16)
    q = torch.randn(batch, 1, 8, 64, generator=gen).to(torch.bfloat16)
    page_table = torch.tensor([[0, 1], [2, 99], [-4, 5]], dtype=torch.int32)[:batch]
    return dict(
        q=q, k_cache=k_cache, v_cache=v_cache, page_table=page_table,
        cache_seqlens=torch.tensor([5, 40, -3], dtype=torch.int32)[:batch],
        window_left=window_left, sinks=torch.randn(8, generator=gen).to(sinks_dtype),
        softmax_scale=0.125, k_scale=1.0, v_scale=1.0, out=torch.empty_like(q),
        lse=torch.empty(batch, 1, 8) if lse else None,
    )  # fmt: skip


def _call(fn, args):
    args = dict(args)
    return fn(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), **args)


def test_fa3_decode_keywords(fa3):
    args = _decode_args(window_left=127)
    _call(fa3_decode.mha_decode_with_kvcache, args)
    call = fa3.calls[-1]
    assert call["out"] is args["out"]
    assert call["is_causal"] and (call["window_size_left"], call["window_size_right"]) == (127, 0)
    assert call["num_splits"] == 0 and call["softmax_scale"] == 0.125
    # Out-of-range ids and lengths are clamped before FA3 sees them (the contract).
    assert call["page_table"].tolist() == [[0, 1], [2, 7], [0, 5]]
    assert call["seqused_k"].tolist() == [5, 32, 0]
    assert call["sinks"] is None  # float32 sinks: merged afterwards


def test_fa3_bf16_sinks_go_native_without_lse_and_merge_with_it(fa3):
    native = _decode_args(sinks_dtype=torch.bfloat16, lse=False)
    _call(fa3_decode.mha_decode_with_kvcache, native)
    assert fa3.calls[-1]["sinks"] is native["sinks"]
    merged = dict(native, out=torch.empty_like(native["out"]), lse=torch.empty(3, 1, 8))
    _call(fa3_decode.mha_decode_with_kvcache, merged)
    assert fa3.calls[-1]["sinks"] is None
    torch.testing.assert_close(merged["out"], native["out"], atol=1e-2, rtol=1.6e-2)


def test_fa3_float32_sinks_bf16_holds_go_native_once_checked(fa3, monkeypatch):
    """GPT-OSS's float32 sinks come from a bf16 checkpoint: FA3 takes their bf16 copy, made and
    checked on the first call only; an in-place update checks again, and sinks bf16 cannot
    hold (or non-finite ones) are merged afterwards, as before."""
    from tokenspeed_kernel_nvidia.fa3 import _common

    args = _decode_args(sinks_dtype=torch.bfloat16, lse=False)
    want = dict(args, out=torch.empty_like(args["out"]))
    _call(fa3_decode.mha_decode_with_kvcache, want)
    sinks = args["sinks"].float()
    reads = []
    real_isfinite = torch.isfinite
    monkeypatch.setattr(_common.torch, "isfinite", lambda t: reads.append(t) or real_isfinite(t))
    for _ in range(3):
        _call(fa3_decode.mha_decode_with_kvcache, dict(args, sinks=sinks))
        assert fa3.calls[-1]["sinks"].dtype == torch.bfloat16
        assert torch.equal(fa3.calls[-1]["sinks"], args["sinks"])
    assert len(reads) == 1  # checked once: the verdict stays on the tensor
    assert torch.equal(args["out"], want["out"])
    sinks.add_(2**-12)  # in place: the version moves, bf16 no longer holds it
    _call(fa3_decode.mha_decode_with_kvcache, dict(args, sinks=sinks))
    assert fa3.calls[-1]["sinks"] is None and len(reads) == 2
    for bad in (torch.full((8,), math.inf), torch.full((8,), math.nan)):
        assert _common.native_sinks(bad) is None


def test_fa3_float32_sinks_merge_inside_a_graph_capture(fa3, monkeypatch):
    """A replay reads the live sinks (a weight reload in place keeps the graph), so a capture
    merges even where an eager call already found the sinks exact."""
    from tokenspeed_kernel_nvidia.fa3 import _common

    args = _decode_args(sinks_dtype=torch.bfloat16, lse=False)
    sinks = args["sinks"].float()
    _call(fa3_decode.mha_decode_with_kvcache, dict(args, sinks=sinks))
    assert fa3.calls[-1]["sinks"] is not None
    monkeypatch.setattr(_common, "capturing", lambda tensor: True)
    _call(fa3_decode.mha_decode_with_kvcache, dict(args, sinks=sinks))
    assert fa3.calls[-1]["sinks"] is None
    assert _common.native_sinks(args["sinks"]) is args["sinks"]  # bf16 sinks: live already


def test_fa3_inference_tensor_sinks_merge_without_a_host_read(fa3):
    """Inference tensors keep no version counter to key a verdict on: merged, never read."""
    args = _decode_args(sinks_dtype=torch.bfloat16, lse=False)
    with torch.inference_mode():
        sinks = args["sinks"].float()
    _call(fa3_decode.mha_decode_with_kvcache, dict(args, sinks=sinks))
    assert fa3.calls[-1]["sinks"] is None


def test_fa3_prefill_leaves_rows_no_sequence_owns(fa3):
    spec = get_kernel(PREFILL, "fa3.mha_prefill")
    q = torch.randn(10, 4, 64).to(torch.bfloat16)
    k = torch.randn(10, 2, 64).to(torch.bfloat16)
    out = torch.full_like(q, 3.0)
    lse = torch.full((10, 4), 5.0)
    spec.fn(
        q, k, k.clone(), cu_seqlens=torch.tensor([2, 5, 7], dtype=torch.int32), max_seqlen=3,
        causal=True, window_left=-1, sinks=torch.zeros(4), softmax_scale=0.125, out=out, lse=lse,
    )  # fmt: skip
    for rows in (slice(0, 2), slice(7, 10)):
        assert (out[rows] == 3.0).all() and (lse[rows] == 5.0).all()
    assert (lse[2:7] != 5.0).all()


# --- FlashInfer XQA and trtllm-gen decode --------------------------------------------------------


@pytest.mark.parametrize("case", _params(DECODE, lse=False, q_lens=(1,)))
def test_xqa_conformance_through_the_stand_in(case, fi):
    spec = get_kernel(DECODE, "flashinfer.mha_decode_with_kvcache.xqa")
    with fake_platform("h100"):
        assert_conformance(spec, case, "cpu")


@pytest.mark.parametrize("case", _params(DECODE, lse=False, q_lens=(1,)))
def test_trtllm_gen_conformance_through_the_stand_in(case, fi):
    spec = get_kernel(DECODE, "flashinfer.mha_decode_with_kvcache.trtllm_gen")
    with fake_platform("b200"):
        assert_conformance(spec, case, "cpu")


def test_xqa_keywords_and_one_workspace(fi):
    args = _decode_args(sinks_dtype=torch.bfloat16, lse=False, window_left=127)
    fp8 = dict(args, k_scale=0.5, v_scale=2.0)
    _call(xqa_decode.mha_decode_with_kvcache, fp8)
    _, first = fi.calls[-1]
    assert first["backend"] == "xqa" and first["kv_layout"] == "NHD"
    assert first["bmm1_scale"] == 0.125 * 0.5 and first["bmm2_scale"] == 2.0
    assert first["window_left"] == 127 and first["max_seq_len"] == 32
    assert first["sinks"].dtype == torch.float32
    assert torch.equal(first["sinks"], args["sinks"].float())
    assert first["block_tables"].tolist() == [[0, 1], [2, 7], [0, 5]]
    assert first["seq_lens"].tolist() == [5, 32, 0]
    _call(xqa_decode.mha_decode_with_kvcache, dict(args, out=torch.empty_like(args["out"])))
    _, second = fi.calls[-1]
    assert second["workspace_buffer"] is first["workspace_buffer"]  # allocated once


def test_xqa_refuses_caches_with_different_strides(fi):
    args = _decode_args(lse=False)
    args["v_cache"] = args["v_cache"].transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(ValueError, match="XQA addresses both with the K cache's strides"):
        _call(xqa_decode.mha_decode_with_kvcache, args)


# --- FlashInfer attention-sink wrapper -----------------------------------------------------------


@pytest.mark.parametrize("op", [PREFILL, EXTEND])
def test_sink_wrapper_conformance_through_the_stand_in(op, fi):
    spec = get_kernel(op, f"flashinfer.{op}.sink")
    ran = 0
    for case in _cases(op):
        with fake_platform("h100"):
            if not spec.supports(case.request, _h100()).ok:
                continue
            assert_conformance(spec, case, "cpu")
        ran += 1
    assert ran >= 4


def test_sink_extend_page_list_and_one_wrapper(fi):
    spec = get_kernel(EXTEND, "flashinfer.mha_extend_with_kvcache.sink")
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(6, 4, 1, 64, generator=gen).to(torch.bfloat16)
    q = torch.randn(4, 2, 64, generator=gen).to(torch.bfloat16)
    page_table = torch.tensor([[3, 1, 9], [4, 0, 2]], dtype=torch.int32)
    kwargs = dict(
        cu_seqlens_q=torch.tensor([0, 3, 4], dtype=torch.int32), page_table=page_table,
        cache_seqlens=torch.tensor([9, 0], dtype=torch.int32), max_seqlen_q=3, window_left=-1,
        sinks=torch.zeros(2), softmax_scale=0.125, k_scale=1.0, v_scale=1.0, lse=None,
    )  # fmt: skip
    for _ in range(2):
        spec.fn(q, cache, cache.clone(), out=torch.empty_like(q), **kwargs)
    plans = [c for name, c in fi.calls if name == "plan"]
    assert len(plans) == 2 and plans[0]["self"] is plans[1]["self"]  # one wrapper, re-planned
    plan = plans[-1]
    assert plan["paged_kv_indptr"].tolist() == [0, 3, 3]
    assert plan["paged_kv_indices"].tolist() == [3, 1, 5]  # 9 clamped into the 6 pages
    assert plan["paged_kv_last_page_len"].tolist() == [1, 4]  # a length-0 sequence: (0 - 1) * 4 + 4
    assert plan["qo_indptr"].tolist() == [0, 3, 4]


# --- FlashInfer CUTLASS fused MoE ----------------------------------------------------------------


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c.name) for c in conformance_cases("moe_apply")]
)
def test_cutlass_moe_conformance_through_the_stand_in(case, fi):
    spec = get_kernel("moe_apply", "flashinfer.moe_apply.cutlass")
    with fake_platform("h100"):
        assert_conformance(spec, case, "cpu")


def test_interleave_scales_moves_each_block_where_the_kernel_reads_it():
    scales = torch.arange(2 * 3 * 8, dtype=torch.int32).view(2, 3, 8)
    out = interleave_scales(scales)
    assert out.shape == (2, 2, 12)
    for e in range(2):
        for n in range(3):
            for j in range(2):
                for t in range(4):
                    assert out[e, j, 4 * n + t] == scales[e, n, 4 * j + t]


def _moe(config, seed=0):
    from tokenspeed_kernel.formats.mxfp4 import quantize_mxfp4

    gen = torch.Generator().manual_seed(seed)
    E, H, I = config.num_experts, config.hidden_size, config.intermediate_size  # noqa: E741
    w13, s13 = quantize_mxfp4(torch.randn(E, 2 * I, H, generator=gen))
    w2, s2 = quantize_mxfp4(torch.randn(E, H, I, generator=gen))
    return MoEWeights(w13, w2, s13, s2, torch.randn(E, 2 * I, generator=gen),
                      torch.randn(E, H, generator=gen))  # fmt: skip


def test_cutlass_moe_layout_and_call(fi):
    spec = get_kernel("moe_apply", "flashinfer.moe_apply.cutlass")
    config = MoEConfig(num_experts=4, top_k=2, hidden_size=160, intermediate_size=96)
    plan = moe_plan_for(spec, config, 8, "cpu")
    assert (plan.padded_hidden_size, plan.padded_intermediate_size) == (256, 128)
    weights = _moe(config)
    prepared = spec.fn.prepare_weights(plan, weights)
    t = prepared.tensors
    assert t["fc1"].shape == (4, 256, 128) and t["fc2"].shape == (4, 256, 64)
    assert t["fc1_scale"].shape == (4, 2, 256 * 4) and t["fc2_scale"].shape == (4, 1, 256 * 4)
    assert t["fc1_bias"].dtype == torch.bfloat16
    interleaved = [
        c for name, c in fi.calls if name == "interleave_moe_weights_for_sm90_mixed_gemm"
    ]
    assert [c["weight"].shape for c in interleaved[-2:]] == [(4, 256, 128), (4, 256, 64)]
    # Rows: up (odd rows of w13) first, then gate (even rows), each padded from 96 to 128.
    fc1 = sm90_weight_interleave(t["fc1"])
    assert torch.equal(fc1[:, :96, :80], weights.w13[:, 1::2])
    assert torch.equal(fc1[:, 128:224, :80], weights.w13[:, 0::2])
    assert not fc1[:, 96:128].any() and not fc1[:, :, 80:].any()
    x = torch.randn(3, 160).to(torch.bfloat16)
    ids = torch.tensor([[0, -1], [3, 99], [2, 1]], dtype=torch.int32)
    out = torch.empty_like(x)
    spec.fn.apply(plan, x, prepared, router_logits=None, topk_ids=ids,
                  topk_weights=torch.full((3, 2), 0.5), out=out)  # fmt: skip
    _, call = fi.calls[-1]
    assert call["input"].shape == (3, 256) and call["output"].shape == (3, 256)
    assert call["token_selected_experts"].tolist() == [[0, 0], [3, 0], [2, 1]]
    assert call["token_final_scales"].tolist() == [[0.5, 0.0], [0.5, 0.0], [0.5, 0.5]]
    assert call["swiglu_limit"].tolist() == [7.0] * 4 and call["swiglu_beta"].tolist() == [1.0] * 4


def test_cutlass_moe_tunes_on_the_first_call_of_each_layer_shape(fi):
    """FlashInfer's autotuner runs around the first call of a plan's shape only (it keeps its
    choice per token bucket for the process)."""
    spec = get_kernel("moe_apply", "flashinfer.moe_apply.cutlass")
    config = MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=128)
    weights = _moe(config, seed=2)
    x = torch.randn(3, 128).to(torch.bfloat16)
    routing = dict(router_logits=torch.randn(3, 4), topk_ids=None, topk_weights=None)
    tuned = []
    for max_tokens in (16, 16, 32):
        plan = moe_plan_for(spec, config, max_tokens, "cpu")
        prepared = spec.fn.prepare_weights(plan, weights)
        spec.fn.apply(plan, x, prepared, out=torch.empty_like(x), **routing)
        _, call = fi.calls[-1]
        tuned.append((call["tuning"], call["tune_max_num_tokens"]))
    assert tuned == [(True, 16), (False, 16), (True, 32)]


# --- FlashInfer trtllm-gen FP4 MoE ---------------------------------------------------------------


def test_trtllm_fp4_moe_preparation_and_call(fi):
    spec = get_kernel("moe_apply", "flashinfer.moe_apply.trtllm_fp4")
    config = MoEConfig(num_experts=2, top_k=2, hidden_size=160, intermediate_size=96)
    plan = moe_plan_for(spec, config, 8, "cpu")
    assert (plan.padded_hidden_size, plan.padded_intermediate_size) == (256, 256)
    weights = _moe(config, seed=1)
    prepared = spec.fn.prepare_weights(plan, weights)
    names = [name for name, _ in fi.calls]
    assert names.count("reorder_rows_for_gated_act_gemm") == 2 * 3  # gemm1 w, scale, bias
    assert names.count("shuffle_matrix_sf_a") == 2 * 2
    assert names.count("shuffle_matrix_a") == 2 * 4  # weights and biases of both GEMMs
    (w1, s1, b1), (w2, s2, b2) = prepared.tensors["gemm1"], prepared.tensors["gemm2"]
    assert w1.shape == (2, 512, 128) and s1.shape == (2, 512, 8) and s1.dtype == torch.float8_e4m3fn
    assert b1.shape == (2, 512) and b1.dtype == torch.float32
    assert w2.shape == (2, 256, 128) and s2.shape == (2, 256, 8) and b2.shape == (2, 256)
    assert torch.equal(w1[:, :96, :80], weights.w13[:, 1::2])  # up first (identity shuffles)
    x = torch.randn(3, 160).to(torch.bfloat16)
    out = torch.full_like(x, 9.0)
    spec.fn.apply(plan, x, prepared, router_logits=torch.randn(3, 2), topk_ids=None,
                  topk_weights=None, out=out)  # fmt: skip
    name, call = fi.calls[-1]
    assert name == "trtllm_fp4_block_scale_routed_moe"
    ids, routing_weights = call["topk_ids"]
    assert ids.dtype == torch.int32 and routing_weights.dtype == torch.bfloat16
    assert call["routing_method_type"] == 5 and call["intermediate_size"] == 256
    assert call["hidden_states"].shape == (3, 256) and call["output"].shape == (3, 256)
    assert (out == 0).all()  # the stand-in's zero output, cut back to H columns


# --- the recorded calls against the installed libraries' real signatures ------------------------


@pytest.fixture
def real_flashinfer():
    """The installed flashinfer (imported before a stand-in replaces it), else skip."""
    if FLASHINFER.installed_version() is None:
        pytest.skip("flashinfer-python is not installed here")
    import importlib

    return importlib.import_module("flashinfer")


def _bind(real, call: dict) -> None:
    """Raises TypeError if `real` does not take these arguments (names, required ones)."""
    kwargs = dict(call)
    args = kwargs.pop("args", ())
    if "paged_kv_cache" in kwargs:  # run(self, q, paged_kv_cache, *args, ...)
        inspect.signature(real).bind(kwargs.pop("self"), kwargs.pop("q"),
                                     kwargs.pop("paged_kv_cache"), *args, **kwargs)  # fmt: skip
    else:
        inspect.signature(real).bind(**kwargs)


def test_recorded_flashinfer_calls_bind_to_the_installed_library(real_flashinfer, fi):
    decode = real_flashinfer.decode
    real = {
        "trtllm_batch_decode_with_kv_cache": decode.trtllm_batch_decode_with_kv_cache,
        "cutlass_fused_moe": real_flashinfer.fused_moe.cutlass_fused_moe,
        "trtllm_fp4_block_scale_routed_moe": (
            real_flashinfer.fused_moe.trtllm_fp4_block_scale_routed_moe
        ),
        "plan": real_flashinfer.BatchAttentionWithAttentionSinkWrapper.plan,
        "run": real_flashinfer.BatchAttentionWithAttentionSinkWrapper.run,
    }
    _call(xqa_decode.mha_decode_with_kvcache, _decode_args(lse=False))
    test_sink_extend_page_list_and_one_wrapper(fi)
    test_cutlass_moe_layout_and_call(fi)
    test_trtllm_fp4_moe_preparation_and_call(fi)
    checked = set()
    for name, call in fi.calls:
        if name in real:
            _bind(
                real[name],
                {k: v for k, v in call.items() if k != "self" or name in ("plan", "run")},
            )
            checked.add(name)
    assert checked == set(real)
    for name in ("reorder_rows_for_gated_act_gemm", "shuffle_matrix_a", "shuffle_matrix_sf_a"):
        assert callable(getattr(real_flashinfer, name))


def test_recorded_fa3_call_names_exist_in_the_installed_op_schema(monkeypatch):
    if not _real_fa3_available():
        pytest.skip("tokenspeed-fa3 is not installed (or does not load) here")
    schema = {a.name for a in torch.ops.flash_attn_3.fwd.default._schema.arguments}
    fake = FakeFA3()
    _install(monkeypatch, FA3, "flash_attn_interface", fake, "3.0.0.post20260810")
    try:
        _call(fa3_decode.mha_decode_with_kvcache, _decode_args())
    finally:
        FA3.reset()
    names = set(fake.calls[-1]) - {"q", "k", "v"}
    assert names <= schema, names - schema


def _real_fa3_available() -> bool:
    try:
        import importlib.metadata

        importlib.metadata.version("tokenspeed-fa3")
        import importlib

        importlib.import_module("flash_attn_interface")
    except Exception:  # noqa: BLE001 - absent or unloadable: nothing to compare with
        return False
    return True


def test_cutlass_moe_passes_one_workspace_where_the_library_takes_it(fi):
    """FlashInfer 0.7 takes a caller-owned scratch buffer sized by
    `cutlass_fused_moe_workspace_size`: allocated once per device and layer shape."""
    sizes = []

    def workspace_size(max_num_tokens, hidden, inter, experts, top_k, **kwargs):
        sizes.append((max_num_tokens, hidden, inter, experts, top_k, kwargs))
        return 4096

    def cutlass_fused_moe_07(*, workspace_buffer=None, **kwargs):
        fi.calls.append(("workspace", dict(buffer=workspace_buffer)))
        return fi.cutlass_fused_moe(**kwargs)

    fi.fused_moe.cutlass_fused_moe = cutlass_fused_moe_07
    fi.fused_moe.cutlass_fused_moe_workspace_size = workspace_size
    for _ in range(2):
        test_cutlass_moe_layout_and_call(fi)
    buffers = [c["buffer"] for name, c in fi.calls if name == "workspace"]
    assert len(buffers) == 2 and buffers[0] is buffers[1] and buffers[0].numel() == 4096
    assert len(sizes) == 1 and sizes[0][:5] == (8, 256, 128, 4, 2)
    assert sizes[0][5]["use_w4_group_scaling"] and sizes[0][5]["weight_dtype"] == torch.uint8


def test_cutlass_workspace_size_call_binds_to_the_installed_library(real_flashinfer):
    size = getattr(real_flashinfer.fused_moe, "cutlass_fused_moe_workspace_size", None)
    if size is None:
        pytest.skip("this flashinfer allocates the CUTLASS MoE workspace itself (0.6.x)")
    inspect.signature(size).bind(
        8, 256, 128, 4, 2, x_dtype=torch.bfloat16, weight_dtype=torch.uint8,
        use_w4_group_scaling=True, device=torch.device("cpu"),
    )  # fmt: skip
