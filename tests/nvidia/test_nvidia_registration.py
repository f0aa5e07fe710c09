"""tokenspeed-kernel-nvidia without its extras: the package imports and registers every
adapter, each declines with a reason naming the distribution and the extra to install (also in
`tokenspeed-kernel explain`), versions outside the accepted range and failing imports decline,
and the trait tables say what each library's source says it supports.

Library limits the trait tables are checked against (read from the wheels):
- tokenspeed-fa3 3.0.0.post20260810: flash_attn_config.py CONFIG["build_flags"] (HDIM64/128/
  192/256 on, HDIM96 off, SM8x off: sm_90 only); _C.abi3.so checks "query and key must have
  the same dtype", "sinks must have dtype bfloat16"; flash_attn_interface.py
  `flash_attn_with_kvcache`: "page_block_size can be arbitrary".
- flashinfer-python 0.6.14 / 0.7.2.post1: jit/xqa.py `gen_xqa_module` (page_size in [16, 32,
  64, 128]; head_dim % 16 == 0 in [16, 256] (0.7: 512); fp16/bf16 input; fp8 e4m3 cache);
  csrc/xqa/mha.cu `static_assert(nbValidRows <= 32u)` (head group <= 32 at Q = 1);
  decode.py `trtllm_batch_decode_with_kv_cache` (xqa: NotImplementedError for return_lse);
  xqa.py (compute capability major 9, 10, 12); attention/_core.py
  `BatchAttentionWithAttentionSinkWrapper` (JIT uri without the head dim: one head dim per
  process, 64 declared); fused_moe/core.py `cutlass_fused_moe` (use_w4_group_scaling: MXFP4
  weights x bf16 input on sm_90), `trtllm_fp4_block_scale_routed_moe` (sm_100).
"""

from __future__ import annotations

import contextlib
import io
import types

import pytest
import torch

from tokenspeed_kernel import cli
from tokenspeed_kernel.ops.attention.request import AttentionRequest
from tokenspeed_kernel.ops.moe.request import MoERequest
from tokenspeed_kernel.platform import KNOWN_PLATFORMS
from tokenspeed_kernel.plugins import load_plugins
from tokenspeed_kernel.registry import ANY, get_kernel, kernels
from tokenspeed_kernel_nvidia._library import FA3, FLASHINFER, Library, parse_version

BF16, FP16, FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
H100, B200 = KNOWN_PLATFORMS["h100"], KNOWN_PLATFORMS["b200"]

DECODE = AttentionRequest(
    dtype=BF16, kv_dtype=BF16, head_dim=64, num_q_heads=64, num_kv_heads=8, page_size=64,
    q_len=1, causal=True, window_left=127, sinks=True, lse=False,
)  # fmt: skip
EXTEND = DECODE._replace(q_len=0)
PREFILL = DECODE._replace(q_len=0, page_size=0)
MOE = MoERequest(
    weight_format="mxfp4", activation_format="bf16", has_bias=True, routing="topk_softmax",
    num_experts=128, top_k=4, hidden_size=2880, intermediate_size=2880, max_num_tokens=64,
)  # fmt: skip

# Every library adapter: (op, request it serves by traits, platform it runs on, library).
ADAPTERS = {
    "fa3.mha_prefill": ("mha_prefill", PREFILL, H100, FA3),
    "fa3.mha_extend_with_kvcache": ("mha_extend_with_kvcache", EXTEND, H100, FA3),
    "fa3.mha_decode_with_kvcache": ("mha_decode_with_kvcache", DECODE, H100, FA3),
    "flashinfer.mha_decode_with_kvcache.xqa": ("mha_decode_with_kvcache", DECODE, H100, FLASHINFER),
    "flashinfer.mha_decode_with_kvcache.trtllm_gen": (
        "mha_decode_with_kvcache", DECODE, B200, FLASHINFER,
    ),
    "flashinfer.mha_prefill.sink": ("mha_prefill", PREFILL, H100, FLASHINFER),
    "flashinfer.mha_extend_with_kvcache.sink": (
        "mha_extend_with_kvcache", EXTEND, H100, FLASHINFER,
    ),
    "flashinfer.moe_apply.cutlass": ("moe_apply", MOE, H100, FLASHINFER),
    "flashinfer.moe_apply.trtllm_fp4": ("moe_apply", MOE, B200, FLASHINFER),
}  # fmt: skip


@pytest.fixture
def libraries_absent(monkeypatch):
    """Both libraries reported not installed, whatever this environment holds."""
    for library in (FA3, FLASHINFER):
        monkeypatch.setattr(library, "installed_version", lambda: None)
        library.reset()
    yield
    for library in (FA3, FLASHINFER):
        library.reset()


def test_the_plugin_loads_and_registers_every_adapter():
    result = next(r for r in load_plugins() if r.name == "nvidia")
    assert result.status == "loaded", result.error
    assert set(ADAPTERS) <= set(result.kernels)


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_without_its_extra_each_adapter_declines_naming_it(name, libraries_absent):
    op, request, platform, library = ADAPTERS[name]
    verdict = get_kernel(op, name).supports(request, platform)
    assert not verdict.ok
    assert f"{library.distribution} is not installed" in verdict.reason
    assert f"pip install tokenspeed-kernel-nvidia[{library.extra}]" in verdict.reason


@pytest.mark.parametrize("library", [FA3, FLASHINFER], ids=lambda lib: lib.extra)
def test_this_environment_without_the_extra_declines_naming_it(library):
    if library.installed_version() is not None:
        pytest.skip(f"{library.distribution} is installed here")
    library.reset()
    assert library.verdict().reason == (
        f"{library.distribution} is not installed (pip install tokenspeed-kernel-nvidia"
        f"[{library.extra}])"
    )


def test_explain_shows_the_install_hint(libraries_absent):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli.main(["--platform", "h100", "explain", "mha_decode_with_kvcache", "--window"])
    text = out.getvalue()
    assert "flashinfer.mha_decode_with_kvcache.xqa" in text
    assert (
        "flashinfer-python is not installed (pip install tokenspeed-kernel-nvidia[flashinfer])"
        in text
    )
    assert "tokenspeed-fa3 is not installed (pip install tokenspeed-kernel-nvidia[fa3])" in text


@pytest.mark.parametrize(
    "version,accepted",
    [("0.6.13", False), ("0.6.14", True), ("0.7.2.post1", True), ("0.7.9", True),
     ("0.8.0", False), ("0.8.0rc1", False), ("1.0.0", False)],
)  # fmt: skip
def test_flashinfer_versions_outside_the_range_decline(version, accepted, monkeypatch):
    monkeypatch.setattr(FLASHINFER, "installed_version", lambda: version)
    verdict = FLASHINFER.version_verdict()
    assert verdict.ok is accepted, verdict.reason
    if not accepted:
        assert f"flashinfer-python {version} is installed" in verdict.reason
        assert ">=0.6.14,<0.8" in verdict.reason


def test_fa3_versions_outside_the_range_decline(monkeypatch):
    monkeypatch.setattr(FA3, "installed_version", lambda: "3.0.0.post20250101")
    assert not FA3.version_verdict().ok
    monkeypatch.setattr(FA3, "installed_version", lambda: "3.0.0.post20260810")
    assert FA3.version_verdict().ok


def test_a_failing_import_declines_with_the_error(monkeypatch):
    library = Library("some-dist", "tokenspeed_no_such_module", "extra", "1.0", "2.0")
    monkeypatch.setattr(library, "installed_version", lambda: "1.5")
    verdict = library.verdict()
    assert not verdict.ok
    assert "some-dist is installed but `import tokenspeed_no_such_module` failed" in verdict.reason
    with pytest.raises(ImportError, match="tokenspeed_no_such_module"):
        library.load()


def test_an_importable_library_in_range_is_accepted(monkeypatch):
    library = Library("some-dist", "tokenspeed_fake_ok", "extra", "1.0", "2.0")
    monkeypatch.setattr(library, "installed_version", lambda: "1.0")
    monkeypatch.setitem(__import__("sys").modules, "tokenspeed_fake_ok", types.ModuleType("x"))
    assert library.verdict().ok
    assert library.load() is __import__("sys").modules["tokenspeed_fake_ok"]


@pytest.mark.parametrize(
    "low,high",
    [("0.6.13", "0.6.14"), ("0.6.14", "0.7.0"), ("0.7.2", "0.7.2.post1"), ("0.8.0rc1", "0.8.0"),
     ("3.0.0.post20260408", "3.0.0.post20260810"), ("3.0", "3.0.0.post1"), ("0.7.9", "0.8")],
)  # fmt: skip
def test_parse_version_orders_releases(low, high):
    assert parse_version(low) < parse_version(high)


def test_parse_version_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="not a version"):
        parse_version("banana")


def _traits(name):
    op = ADAPTERS[name][0]
    return get_kernel(op, name).traits


def test_fa3_traits_match_the_wheel():
    for name in ("fa3.mha_prefill", "fa3.mha_extend_with_kvcache", "fa3.mha_decode_with_kvcache"):
        traits = _traits(name)
        assert traits["head_dim"] == {64, 128, 192, 256}
        assert traits["dtype"] == traits["kv_dtype"] == {BF16, FP16}  # no FP8 cache with bf16 q
        assert traits["sinks"] is traits["window"] is traits["lse"] is True
        assert traits["gqa_ratio"] is ANY
    assert _traits("fa3.mha_decode_with_kvcache")["page_size"] is ANY
    assert _traits("fa3.mha_prefill")["non_causal"] is True
    platforms = get_kernel("mha_prefill", "fa3.mha_prefill").platforms
    assert [str(p) for p in platforms] == ["nvidia:sm_90"]


def test_xqa_traits_match_flashinfer():
    traits = _traits("flashinfer.mha_decode_with_kvcache.xqa")
    assert traits["page_size"] == {16, 32, 64, 128}
    assert traits["head_dim"] == set(range(16, 257, 16))
    assert traits["gqa_ratio"] == set(range(1, 33))
    assert traits["q_len"] == {1}
    # The library takes e4m3 caches; the adapter declines them until its scale mapping passes
    # conformance on the GPU (it failed there, 2026-11-25).
    assert traits["kv_dtype"] == {BF16, FP16}
    assert "lse" not in traits and "non_causal" not in traits
    spec = get_kernel("mha_decode_with_kvcache", "flashinfer.mha_decode_with_kvcache.xqa")
    assert spec.platforms[0].archs == {"sm_90", "sm_100", "sm_103", "sm_120", "sm_121"}


def test_sink_wrapper_traits_and_its_sink_requirement(monkeypatch):
    for name in ("flashinfer.mha_prefill.sink", "flashinfer.mha_extend_with_kvcache.sink"):
        assert _traits(name)["head_dim"] == {64}
    monkeypatch.setitem(__import__("sys").modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setattr(FLASHINFER, "installed_version", lambda: "0.6.14")
    FLASHINFER.reset()
    try:
        spec = get_kernel("mha_prefill", "flashinfer.mha_prefill.sink")
        verdict = spec.supports(PREFILL._replace(sinks=False), H100)
        assert not verdict.ok and "always adds a sink" in verdict.reason
        assert spec.supports(PREFILL, H100).ok
    finally:
        FLASHINFER.reset()


def test_moe_traits():
    for name in ("flashinfer.moe_apply.cutlass", "flashinfer.moe_apply.trtllm_fp4"):
        traits = _traits(name)
        assert traits["weight_format"] == {"mxfp4"} and traits["activation_format"] == {"bf16"}
        assert "expert_parallel" not in traits  # a rank's subset of experts is not mapped
    gpt_oss = types.SimpleNamespace(hidden_size=2880, intermediate_size=2880)
    cutlass = get_kernel("moe_apply", "flashinfer.moe_apply.cutlass")
    assert cutlass.fn.padded_sizes(gpt_oss) == (2944, 2944)  # multiples of 128
    trtllm = get_kernel("moe_apply", "flashinfer.moe_apply.trtllm_fp4")
    assert trtllm.fn.padded_sizes(gpt_oss) == (3072, 3072)  # multiples of 256


@pytest.mark.parametrize(
    "op", ["mha_prefill", "mha_extend_with_kvcache", "mha_decode_with_kvcache", "moe_apply"]
)
def test_library_kernels_rank_below_ours_until_measured(op):
    specs = kernels(op)
    ours = [s.priority for s in specs if s.backend == "triton"]
    theirs = [s.priority for s in specs if s.backend in ("fa3", "flashinfer")]
    if not ours:
        pytest.skip("tokenspeed-kernel-triton is not installed here")
    assert theirs and max(theirs) < min(ours)


def test_traits_agree_with_the_installed_flashinfer_source():
    """Where flashinfer is installed (the extras environment), its source still says what the
    trait tables encode."""
    if FLASHINFER.installed_version() is None:
        pytest.skip("flashinfer-python is not installed here")
    import inspect

    from flashinfer.jit import xqa

    source = inspect.getsource(xqa.gen_xqa_module)
    assert "if page_size not in [16, 32, 64, 128]" in source
    assert "head_dim % 16 != 0" in source


def test_traits_agree_with_the_installed_fa3_build():
    if FA3.installed_version() is None:
        pytest.skip("tokenspeed-fa3 is not installed here")
    from flash_attn_config import CONFIG

    flags = CONFIG["build_flags"]
    compiled = {d for d in (64, 96, 128, 192, 256) if not flags[f"FLASHATTENTION_DISABLE_HDIM{d}"]}
    assert _traits("fa3.mha_prefill")["head_dim"] == compiled
    assert flags["FLASHATTENTION_DISABLE_SM8x"] and not flags["FLASHATTENTION_DISABLE_PAGEDKV"]
