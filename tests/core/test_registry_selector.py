"""Registry, platforms and selector on faked platforms (no GPU needed)."""

from __future__ import annotations

import os

import pytest
import torch

import tokenspeed_kernel as tk
from tokenspeed_kernel import env, registry, selector
from tokenspeed_kernel.platform import KNOWN_PLATFORMS, Platform, PlatformSpec, platform_of
from tokenspeed_kernel.presets import get_preset

OP = "mha_decode_with_kvcache"
PRESET = get_preset("gpt-oss-120b")
DECODE = PRESET.attention_request(OP)
TRAITS = {
    "dtype": {torch.bfloat16},
    "kv_dtype": {torch.bfloat16},
    "head_dim": {64},
    "gqa_ratio": tk.ANY,
    "page_size": tk.ANY,
    "q_len": range(1, 5),
    "sinks": True,
}


@pytest.fixture
def scratch_kernels():
    """Register test kernels; unregister whatever the test registered."""
    before = registry.registered_names()
    yield
    for name in registry.registered_names() - before:
        registry.unregister_kernel(name)


def _register(name, *, platforms=("*",), traits=TRAITS, priority=50, supports=None, op=OP):
    backend = name.split(".")[0]

    def kernel(*args, **kwargs):
        raise AssertionError("selection tests never run kernels")

    tk.register_kernel(
        op,
        name=name,
        backend=backend,
        platforms=platforms,
        traits=traits,
        priority=priority,
        supports=supports,
    )(kernel)


@pytest.mark.parametrize(
    "platform, text, ok",
    [
        ("h100", "nvidia:sm_80+", True),
        ("b200", "nvidia:sm_90..sm_90", False),
        ("b200", "nvidia:sm_90..sm_100", True),
        ("mi300x", "amd:gfx942,gfx950", True),
        ("mi355x", "amd:gfx942", False),
        ("cpu", "nvidia:sm_80+", False),
        ("cpu", "cpu", True),
        ("mi355x", "*", True),
    ],
)
def test_platform_specs(platform, text, ok):
    mismatch = PlatformSpec.parse(text).mismatch(KNOWN_PLATFORMS[platform])
    assert (mismatch == "") == ok
    if not ok:
        assert KNOWN_PLATFORMS[platform].arch in mismatch


def test_platform_spec_rejects_unknown_vendor():
    with pytest.raises(ValueError, match="vendor must be"):
        PlatformSpec.parse("intel:xe")


def test_capabilities_follow_arch():
    assert "wgmma" in KNOWN_PLATFORMS["h200"].capabilities
    assert "mfma_scale" in KNOWN_PLATFORMS["mi355x"].capabilities
    assert "mfma_scale" not in KNOWN_PLATFORMS["mi300x"].capabilities
    spec = PlatformSpec("amd", capabilities=frozenset({"mfma_scale"}))
    assert "lacks" in spec.mismatch(KNOWN_PLATFORMS["mi300x"])


def test_platform_detected_from_tensor_device_and_faked():
    assert platform_of(torch.device("cpu")).vendor == "cpu"
    with tk.fake_platform("mi355x") as fake:
        assert platform_of(torch.device("cpu")) is fake
    assert platform_of(torch.device("cpu")).vendor == "cpu"
    with pytest.raises(ValueError, match="unknown platform 'tpu'"):
        with tk.fake_platform("tpu"):
            pass


@pytest.mark.parametrize("platform", sorted(KNOWN_PLATFORMS))
def test_selection_filters_by_platform(scratch_kernels, platform):
    _register("nv.decode", platforms=["nvidia:sm_90+"], priority=90)
    _register("amd.decode", platforms=["amd:gfx942,gfx950"], priority=80)
    _register(
        "cdna4.decode",
        platforms=[PlatformSpec("amd", capabilities=frozenset({"mfma_scale"}))],
        priority=95,
    )
    expected = {
        "cpu": "reference.mha_decode_with_kvcache",
        "h100": "nv.decode",
        "h200": "nv.decode",
        "b200": "nv.decode",
        "mi300x": "amd.decode",
        "mi355x": "cdna4.decode",
    }[platform]
    assert selector.select(OP, DECODE, KNOWN_PLATFORMS[platform]).name == expected


def test_undeclared_trait_is_refused(scratch_kernels):
    _register(
        "nosinks.decode", traits={k: v for k, v in TRAITS.items() if k != "sinks"}, priority=90
    )
    h100 = KNOWN_PLATFORMS["h100"]
    verdict = registry.get_kernel(OP, "nosinks.decode").supports(DECODE, h100)
    assert not verdict.ok and verdict.reason == "does not declare sinks"
    assert selector.select(OP, DECODE._replace(sinks=False), h100).name == "nosinks.decode"
    assert selector.select(OP, DECODE, h100).name == "reference.mha_decode_with_kvcache"


def test_trait_value_outside_declared_set(scratch_kernels):
    _register("small.decode", priority=90)
    h100 = KNOWN_PLATFORMS["h100"]
    spec = registry.get_kernel(OP, "small.decode")
    assert spec.supports(DECODE._replace(q_len=4), h100).ok
    verdict = spec.supports(DECODE._replace(q_len=5), h100)
    assert "q_len 5 not in" in verdict.reason
    verdict = spec.supports(DECODE._replace(head_dim=128), h100)
    assert verdict.reason == "head_dim 128 not in {64}"
    verdict = spec.supports(DECODE._replace(kv_dtype=torch.float8_e4m3fn), h100)
    assert verdict.reason == "kv_dtype float8_e4m3fn not in {bfloat16}"


def test_dynamic_supports_and_refusal_needs_reason(scratch_kernels):
    def only_short(request, platform):
        if platform.sm_count < 140:
            return tk.Support.no("needs at least 140 SMs")
        return tk.Support.yes()

    _register("big.decode", supports=only_short, priority=90)
    assert selector.select(OP, DECODE, KNOWN_PLATFORMS["b200"]).name == "big.decode"
    explanation = tk.explain(OP, DECODE, KNOWN_PLATFORMS["h100"])
    big = next(c for c in explanation.candidates if c.name == "big.decode")
    assert not big.accepted and big.reason == "needs at least 140 SMs"
    with pytest.raises(ValueError, match="non-empty reason"):
        tk.Support.no("")


def test_ties_break_by_name(scratch_kernels):
    _register("zeta.decode", priority=70)
    _register("alpha.decode", priority=70)
    assert selector.select(OP, DECODE, KNOWN_PLATFORMS["h100"]).name == "alpha.decode"
    names = [s.name for s in tk.kernels(OP)]
    assert names.index("alpha.decode") < names.index("zeta.decode")


def test_cache_hit_and_invalidation(scratch_kernels):
    h100 = KNOWN_PLATFORMS["h100"]
    first = selector.select(OP, DECODE, h100)
    assert selector.select(OP, DECODE, h100) is first
    assert any(key[0] == OP for key in selector._cache)
    _register("better.decode", priority=99)  # registering must drop cached choices
    assert selector.select(OP, DECODE, h100).name == "better.decode"


def test_register_errors(scratch_kernels):
    _register("dup.decode")
    with pytest.raises(ValueError, match="already registered"):
        _register("dup.decode")
    tk.register_kernel(
        OP,
        name="dup.decode",
        backend="dup",
        platforms=["*"],
        traits=TRAITS,
        priority=3,
        replace=True,
    )(lambda *a, **k: None)
    assert registry.get_kernel(OP, "dup.decode").priority == 3
    with pytest.raises(ValueError, match="expected one of mha_prefill"):
        tk.register_kernel(
            "mha_magic", name="x.y", backend="x", platforms=["*"], traits={}, priority=1
        )
    with pytest.raises(ValueError, match="starting with 'x.'"):
        tk.register_kernel(OP, name="y.decode", backend="x", platforms=["*"], traits={}, priority=1)
    with pytest.raises(ValueError, match="declares no platforms"):
        tk.register_kernel(OP, name="x.decode", backend="x", platforms=[], traits={}, priority=1)
    with pytest.raises(ValueError, match="no kernel named"):
        registry.unregister_kernel("never.registered")


def test_explain_lists_every_candidate(scratch_kernels):
    _register("nv.decode", platforms=["nvidia:sm_90+"], priority=90)
    explanation = tk.explain(OP, DECODE, KNOWN_PLATFORMS["mi300x"])
    text = str(explanation)
    assert "nv.decode (priority 90): rejected: needs nvidia:sm_90+, this is amd gfx942" in text
    assert "* reference.mha_decode_with_kvcache" in text
    assert explanation.selected == "reference.mha_decode_with_kvcache"


def test_no_kernel_error_lists_candidates(scratch_kernels):
    fp32_request = DECODE._replace(dtype=torch.float32, kv_dtype=torch.float32)
    with pytest.raises(tk.UnsupportedError) as info:
        selector.select(OP, fp32_request, KNOWN_PLATFORMS["h100"])
    message = str(info.value)
    assert "no kernel supports" in message
    assert (
        "reference.mha_decode_with_kvcache (priority 0): rejected: dtype float32 not in" in message
    )
    assert isinstance(info.value, NotImplementedError)
    assert info.value.candidates[0].name == "reference.mha_decode_with_kvcache"


def test_use_kernel_forces_and_validates(scratch_kernels):
    _register("fast.decode", priority=90)
    h100 = KNOWN_PLATFORMS["h100"]
    with tk.use_kernel(OP, "reference.mha_decode_with_kvcache"):
        assert selector.select(OP, DECODE, h100).name == "reference.mha_decode_with_kvcache"
    assert selector.select(OP, DECODE, h100).name == "fast.decode"
    with tk.use_kernel(OP, "fast.decode"):
        with pytest.raises(tk.UnsupportedError, match="forced kernel fast.decode cannot serve"):
            selector.select(OP, DECODE._replace(head_dim=128), h100)
    with pytest.raises(ValueError, match="no kernel named 'nope'"):
        with tk.use_kernel(OP, "nope"):
            pass


def test_force_env(scratch_kernels, monkeypatch):
    _register("fast.decode", priority=90)
    h100 = KNOWN_PLATFORMS["h100"]
    monkeypatch.setattr(env, "get", lambda name: os.environ.get(name))  # re-read every call
    monkeypatch.setenv("TOKENSPEED_KERNEL_FORCE", f"{OP}=reference.mha_decode_with_kvcache")
    assert selector.select(OP, DECODE, h100).name == "reference.mha_decode_with_kvcache"
    monkeypatch.setenv("TOKENSPEED_KERNEL_FORCE", f"{OP}=missing.kernel")
    with pytest.raises(ValueError, match="no kernel named 'missing.kernel'"):
        selector.select(OP, DECODE, h100)
    monkeypatch.setenv("TOKENSPEED_KERNEL_FORCE", "mha_magic=x")
    with pytest.raises(ValueError, match="op 'mha_magic' in 'mha_magic=x' is unknown"):
        selector.select(OP, DECODE, h100)
    monkeypatch.setenv("TOKENSPEED_KERNEL_FORCE", "garbage")
    with pytest.raises(ValueError, match="not of the form op=kernel"):
        selector.select(OP, DECODE, h100)
    monkeypatch.delenv("TOKENSPEED_KERNEL_FORCE")
    assert selector.select(OP, DECODE, h100).name == "fast.decode"
    assert "TOKENSPEED_KERNEL_FORCE" not in os.environ


def test_public_op_refuses_forced_kernel_it_cannot_use(scratch_kernels):
    _register("bf16only.decode", priority=-5)
    q = torch.randn(2, 8, 64, dtype=torch.float16)
    cache = torch.randn(4, 16, 2, 64, dtype=torch.float16)
    with tk.use_kernel(OP, "bf16only.decode"):
        with pytest.raises(tk.UnsupportedError, match="dtype float16 not in"):
            tk.mha_decode_with_kvcache(
                q,
                cache,
                cache,
                page_table=torch.zeros(2, 1, dtype=torch.int32),
                cache_seqlens=torch.ones(2, dtype=torch.int32),
            )


def test_platform_hash_is_cached():
    p = Platform("nvidia", "sm_90", 0, 132, "x")
    assert hash(p) == hash(Platform("nvidia", "sm_90", 0, 132, "x"))
    assert p == Platform("nvidia", "sm_90", 0, 132, "x")


@pytest.mark.parametrize("heads", [(64, 0), (64, -8), (64, 7)])
def test_explain_refuses_impossible_head_counts(heads):
    request = tk.AttentionRequest(torch.bfloat16, torch.bfloat16, 64, *heads, 64, 1)
    with pytest.raises(ValueError, match="KV heads"):
        tk.explain("mha_decode_with_kvcache", request, KNOWN_PLATFORMS["h100"])
