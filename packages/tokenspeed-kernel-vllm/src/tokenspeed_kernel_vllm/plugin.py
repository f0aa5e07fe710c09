"""Entry point of the `vllm.general_plugins` group (vLLM runs it in every process it starts).

Registers, in vLLM's own registries:
- attention: `AttentionBackendEnum.CUSTOM` -> `TokenspeedAttentionBackend`, chosen with
  `--attention-backend CUSTOM`; its `validate_configuration` declines (with every kernel's
  reason) where no tokenspeed-kernel kernel serves the layer on this device.
- MoE: the "gpt_oss_mxfp4" quantization config -> `TokenspeedGptOssMxfp4Config`, which hands
  each GPT-OSS MoE layer to tokenspeed-kernel where a kernel serves it and to vLLM's own
  method elsewhere. TOKENSPEED_KERNEL_VLLM_MOE=0 leaves vLLM's config registered instead.
Neither touches the GPU: what serves is decided per layer when vLLM builds the model. A part
that fails to register (another vLLM version) is logged and skipped; vLLM keeps working.
"""

from __future__ import annotations

import logging
import os

# vLLM's loggers print only under "vllm"; under our own name the line would vanish.
logger = logging.getLogger(f"vllm.{__name__}")

ATTENTION_BACKEND = "tokenspeed_kernel_vllm.attention.TokenspeedAttentionBackend"
MOE_ENV = "TOKENSPEED_KERNEL_VLLM_MOE"
SUPPORTED_VLLM = "0.26."
_registered: list[str] = []


def register() -> None:
    """Register once per process (vLLM may call general plugins more than once)."""
    if _registered:
        return
    import vllm

    parts, failed = [], []
    for name, step in (("attention", _register_attention), ("moe", _register_moe)):
        try:
            what = step()
        except Exception as exc:  # noqa: BLE001  a broken part must not stop vLLM
            failed.append(f"{name} ({type(exc).__name__}: {exc})")
        else:
            if what:
                parts.append(what)
    _registered.extend(parts or ["nothing"])
    version = vllm.__version__
    note = "" if version.startswith(SUPPORTED_VLLM) else f" (built for vLLM {SUPPORTED_VLLM}x)"
    what = "; ".join(parts) or "nothing"
    line = f"tokenspeed-kernel plugin for vLLM {version}{note}: registered {what}"
    if failed:
        logger.warning("%s; failed: %s", line, "; ".join(failed))
    else:
        logger.info("%s", line)


def _register_attention() -> str:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, ATTENTION_BACKEND)
    return f"attention backend CUSTOM -> {ATTENTION_BACKEND}"


def _register_moe() -> str | None:
    value = os.environ.get(MOE_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{MOE_ENV} is {value!r}, expected 1 (default) or 0")
    if value == "0":
        return None
    from vllm.model_executor.layers.quantization import register_quantization_config

    from .moe import TokenspeedGptOssMxfp4Config

    register_quantization_config("gpt_oss_mxfp4")(TokenspeedGptOssMxfp4Config)
    return "quantization gpt_oss_mxfp4 -> TokenspeedGptOssMxfp4Config (GPT-OSS MXFP4 MoE)"
