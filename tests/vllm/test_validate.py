"""validate_configuration: accepts GPT-OSS layers where a tokenspeed-kernel kernel serves every
op, declines with every candidate's reason where none does, and is what vLLM's own CUDA
platform consults for --attention-backend CUSTOM."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("vllm", reason="needs vLLM 0.26: run bash scripts/test_vllm_plugin.sh")

import torch  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backend import AttentionType  # noqa: E402

import tokenspeed_kernel as tk  # noqa: E402
from tokenspeed_kernel_vllm.attention import TokenspeedAttentionBackend  # noqa: E402

H100 = DeviceCapability(9, 0)
A100 = tk.Platform("nvidia", "sm_80", 0, 108, "NVIDIA A100", 166912, 40 << 20, 167936)


def validate(**overrides) -> list[str]:
    """GPT-OSS's attention layer as vLLM describes it to a backend, with `overrides`."""
    args = dict(
        head_size=64, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=None,
        use_mla=False, has_sink=True, use_sparse=False, use_mm_prefix=False,
        use_per_head_quant_scales=False, device_capability=H100,
        attn_type=AttentionType.DECODER, has_sliding_window=True,
    )  # fmt: skip
    args.update(overrides)
    return TokenspeedAttentionBackend.validate_configuration(**args)


@pytest.mark.usefixtures("no_reference", "vllm_config")
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"has_sliding_window": False},
        {"kv_cache_dtype": "fp8"},
        {"kv_cache_dtype": "fp8_e4m3", "block_size": 64},
        {"dtype": torch.float16, "head_size": 128, "has_sink": False},
    ],
    ids=["sliding", "full", "fp8", "fp8-page64", "fp16-d128"],
)
def test_gpt_oss_layers_are_accepted_on_h100(overrides):
    with tk.fake_platform("h100"):
        assert validate(**overrides) == []


@pytest.mark.usefixtures("no_reference", "vllm_config")
@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"head_size": 96}, "only the pure-torch reference kernel serves .*head_dim 96"),
        ({"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype not supported"),
        ({"block_size": 48}, "block size 48 is not one of 16, 32, 64, 128, 256"),
        ({"use_mla": True}, "MLA not supported"),
        ({"attn_type": AttentionType.ENCODER_ONLY}, "attention type .*ENCODER_ONLY not supported"),
        ({"dtype": torch.float32}, "dtype not supported"),
    ],
    ids=["head96", "e5m2", "page48", "mla", "encoder", "fp32"],
)
def test_unserved_configs_are_declined_with_reasons(overrides, reason):
    with tk.fake_platform("h100"):
        reasons = validate(**overrides)
    assert reasons
    assert any(re.search(reason, r) for r in reasons), reasons


@pytest.mark.usefixtures("no_reference", "vllm_config")
def test_fp8_cache_is_declined_before_sm89_with_the_kernels_reason():
    with tk.fake_platform(A100):
        reasons = validate(kv_cache_dtype="fp8")
    assert reasons
    assert all("FP8 e4m3 conversion needs sm_89+, this is sm_80" in r for r in reasons[1:]), reasons


@pytest.mark.usefixtures("no_reference", "vllm_config")
def test_cpu_declines_unless_the_reference_is_allowed(monkeypatch):
    reasons = {r.split(":")[0]: r for r in validate()}
    # (The store may be served here: test sessions run Triton through its CPU interpreter.)
    for op in ("mha_prefill", "mha_extend_with_kvcache", "mha_decode_with_kvcache"):
        assert "only the pure-torch reference kernel serves" in reasons[op]
        assert "TOKENSPEED_KERNEL_VLLM_REFERENCE=1 runs it anyway" in reasons[op]
    monkeypatch.setenv("TOKENSPEED_KERNEL_VLLM_REFERENCE", "1")
    assert validate() == []


@pytest.mark.usefixtures("vllm_state", "no_reference", "vllm_config")
def test_called_as_vllm_cuda_platform_calls_it():
    """CudaPlatform.get_attn_backend_cls (which cannot be imported without libcuda) resolves
    --attention-backend CUSTOM through the registry and calls validate_configuration with
    vLLM's AttentionSelectorConfig fields as keywords; the same call here."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    from tokenspeed_kernel_vllm import plugin

    plugin.register()
    gpt_oss = AttentionSelectorConfig(
        head_size=64, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=None,
        has_sink=True, has_sliding_window=True,
    )  # fmt: skip
    backend = AttentionBackendEnum.CUSTOM.get_class()
    with tk.fake_platform("h100"):
        assert backend.validate_configuration(device_capability=H100, **gpt_oss._asdict()) == []
        bad = gpt_oss._replace(head_size=96)._asdict()
        assert backend.validate_configuration(device_capability=H100, **bad)


@pytest.mark.usefixtures("allow_reference", "vllm_config")
def test_layer_construction_checks_its_real_heads():
    from tokenspeed_kernel_vllm.attention import TokenspeedAttentionImpl

    with pytest.raises(ValueError, match="sinks has shape \\[4\\], expected \\[8\\]"):
        TokenspeedAttentionImpl(8, 64, 0.125, 2, None, None, "auto", sinks=torch.zeros(4))
    with pytest.raises(NotImplementedError, match="a logits soft cap is not supported"):
        TokenspeedAttentionImpl(8, 64, 0.125, 2, None, None, "auto", logits_soft_cap=30.0)
    with pytest.raises(NotImplementedError, match="kv_cache_dtype 'int8_per_token_head'"):
        TokenspeedAttentionImpl(8, 64, 0.125, 2, None, None, "int8_per_token_head")
    with pytest.raises(NotImplementedError, match="cannot serve this layer"):
        TokenspeedAttentionImpl(8, 64, 0.125, 3, None, None, "auto")  # 8 heads over 3 KV heads


@pytest.mark.usefixtures("no_reference")
def test_validate_reads_the_heads_of_the_model_being_built(gpt_oss_model_config):
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    config = VllmConfig(model_config=gpt_oss_model_config, device_config=DeviceConfig("cpu"))
    with set_current_vllm_config(config), tk.fake_platform("h100"):
        assert validate() == []
        reasons = validate(head_size=96)
    assert reasons and all("heads 8/2" in r for r in reasons), reasons
