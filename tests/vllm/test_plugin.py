"""The plugin as vLLM loads it: its own load_general_plugins() finds our entry point, the
VLLM_PLUGINS allow-list governs it, and what it registers resolves through vLLM's registries."""

from __future__ import annotations

import logging
from importlib.metadata import entry_points

import pytest

pytest.importorskip("vllm", reason="needs vLLM 0.26: run bash scripts/test_vllm_plugin.sh")

import vllm.plugins  # noqa: E402
from vllm.model_executor.layers.quantization import get_quantization_config  # noqa: E402
from vllm.model_executor.layers.quantization.mxfp4 import GptOssMxfp4Config  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

from tokenspeed_kernel_vllm import plugin  # noqa: E402
from tokenspeed_kernel_vllm.attention import TokenspeedAttentionBackend  # noqa: E402
from tokenspeed_kernel_vllm.moe import TokenspeedGptOssMxfp4Config  # noqa: E402

pytestmark = pytest.mark.usefixtures("vllm_state")


def test_entry_point_is_declared():
    (ep,) = [
        ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "tokenspeed_kernel"
    ]
    assert ep.value == "tokenspeed_kernel_vllm.plugin:register"


def test_load_general_plugins_registers_backend_and_moe(monkeypatch, plugin_log):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    with pytest.raises(ValueError, match="must be registered"):
        AttentionBackendEnum.CUSTOM.get_class()
    vllm.plugins.load_general_plugins()
    assert AttentionBackendEnum.CUSTOM.get_class() is TokenspeedAttentionBackend
    # vLLM's attention layer looks its backend up by name.
    assert (
        AttentionBackendEnum[TokenspeedAttentionBackend.get_name()] is AttentionBackendEnum.CUSTOM
    )
    assert get_quantization_config("gpt_oss_mxfp4") is TokenspeedGptOssMxfp4Config
    lines = [r.getMessage() for r in plugin_log if r.name == "vllm.tokenspeed_kernel_vllm.plugin"]
    assert len(lines) == 1
    assert lines[0].startswith("tokenspeed-kernel plugin for vLLM 0.26.0: registered attention")
    assert "gpt_oss_mxfp4 -> TokenspeedGptOssMxfp4Config" in lines[0]


def test_allow_list_naming_it_loads_it(monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "tokenspeed_kernel")
    vllm.plugins.load_general_plugins()
    assert AttentionBackendEnum.CUSTOM.get_class() is TokenspeedAttentionBackend


def test_allow_list_without_it_registers_nothing(monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin")
    vllm.plugins.load_general_plugins()
    assert not AttentionBackendEnum.CUSTOM.is_overridden()
    assert get_quantization_config("gpt_oss_mxfp4") is GptOssMxfp4Config


def test_register_twice_registers_once(plugin_log):
    plugin.register()
    plugin.register()
    assert len([r for r in plugin_log if r.name.endswith(".plugin")]) == 1


def test_moe_switch_off_keeps_vllm_moe(monkeypatch, plugin_log):
    monkeypatch.setenv("TOKENSPEED_KERNEL_VLLM_MOE", "0")
    plugin.register()
    assert AttentionBackendEnum.CUSTOM.get_class() is TokenspeedAttentionBackend
    assert get_quantization_config("gpt_oss_mxfp4") is GptOssMxfp4Config
    assert "gpt_oss_mxfp4" not in plugin_log[-1].getMessage()


def test_a_failing_part_is_logged_and_the_rest_registered(monkeypatch, plugin_log):
    monkeypatch.setenv("TOKENSPEED_KERNEL_VLLM_MOE", "yes")
    plugin.register()  # must not raise: vLLM does not catch a plugin's register() errors
    assert AttentionBackendEnum.CUSTOM.get_class() is TokenspeedAttentionBackend
    (record,) = [r for r in plugin_log if r.name.endswith(".plugin")]
    assert record.levelno == logging.WARNING
    assert "failed: moe (ValueError: TOKENSPEED_KERNEL_VLLM_MOE is 'yes'" in record.getMessage()
