"""Fixtures for the vLLM plugin tests. These run only where vLLM 0.26 is installed
(`bash scripts/test_vllm_plugin.sh`); every module skips itself otherwise, so nothing here
imports vLLM at module level."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture
def vllm_state():
    """Save and restore what registering the plugin changes in vLLM's globals (and our
    plugin's once-per-process flag), so each test starts unregistered."""
    import vllm.model_executor.layers.quantization as quantization
    import vllm.plugins
    from vllm.v1.attention.backends import registry

    from tokenspeed_kernel_vllm import plugin

    saved = (
        vllm.plugins.plugins_loaded,
        dict(registry._ATTN_OVERRIDES),
        dict(quantization._CUSTOMIZED_METHOD_TO_QUANT_CONFIG),
        list(quantization.QUANTIZATION_METHODS),
        list(plugin._registered),
    )
    vllm.plugins.plugins_loaded = False
    registry._ATTN_OVERRIDES.clear()
    quantization._CUSTOMIZED_METHOD_TO_QUANT_CONFIG.pop("gpt_oss_mxfp4", None)
    plugin._registered.clear()
    try:
        yield
    finally:
        vllm.plugins.plugins_loaded = saved[0]
        registry._ATTN_OVERRIDES.clear()
        registry._ATTN_OVERRIDES.update(saved[1])
        quantization._CUSTOMIZED_METHOD_TO_QUANT_CONFIG.clear()
        quantization._CUSTOMIZED_METHOD_TO_QUANT_CONFIG.update(saved[2])
        quantization.QUANTIZATION_METHODS[:] = saved[3]
        plugin._registered[:] = saved[4]


@pytest.fixture
def plugin_log():
    """Records of the plugin's logger (vLLM's "vllm" logger does not propagate to the root
    logger that caplog listens on)."""
    records: list[logging.LogRecord] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("vllm.tokenspeed_kernel_vllm")
    handler = _Keep(level=logging.DEBUG)
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


@pytest.fixture
def vllm_config():
    """vLLM's default VllmConfig set as the current one, as during model construction. The
    device is named: vLLM cannot infer one on a machine without a GPU."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(config):
        yield config


@pytest.fixture
def no_reference(monkeypatch):
    monkeypatch.delenv("TOKENSPEED_KERNEL_VLLM_REFERENCE", raising=False)


@pytest.fixture
def allow_reference(monkeypatch):
    monkeypatch.setenv("TOKENSPEED_KERNEL_VLLM_REFERENCE", "1")


@pytest.fixture(scope="session")
def gpt_oss_model_config(tmp_path_factory):
    """vLLM's ModelConfig of a small GPT-OSS (8 query heads, 2 KV heads) from a local
    config.json, as `vllm serve` builds it (no weights, no tokenizer, no network)."""
    from transformers import GptOssConfig
    from vllm.config import ModelConfig

    path = tmp_path_factory.mktemp("gpt_oss")
    GptOssConfig(
        num_hidden_layers=2, hidden_size=256, head_dim=64, num_attention_heads=8,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
        intermediate_size=256, vocab_size=1000, sliding_window=128,
    ).save_pretrained(path)  # fmt: skip
    return ModelConfig(model=str(path), skip_tokenizer_init=True, dtype="bfloat16")
