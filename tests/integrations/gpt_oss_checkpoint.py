"""A tiny random GPT-OSS written as an MXFP4 checkpoint in the released checkpoints' layout.

transformers cannot quantize GPT-OSS experts to MXFP4 without its Triton kernels (absent on a
CPU), so the checkpoint is written here: `save_pretrained` of a bf16 model, then each experts
weight replaced by `<name>_blocks [E, N, K/32, 16]` and `<name>_scales [E, N, K/32]` (rows N of
the [E, N, K] matrix, as in openai/gpt-oss-*: gate/up rows interleaved) and the config given
`quantization_config = {"quant_method": "mxfp4", ...}`. transformers' loader dequantizes those
to bf16 where its MXFP4 kernels are absent.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tokenspeed_kernel.formats.mxfp4 import quantize_mxfp4

NOT_CONVERTED = [
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
]


def tiny_config(**overrides):
    from transformers import GptOssConfig

    options = dict(
        vocab_size=128, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=8,
        num_experts_per_tok=2, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"], initializer_range=0.1,
        max_position_embeddings=131072,
    )  # fmt: skip
    options.update(overrides)
    return GptOssConfig(**options)


def write_mxfp4_checkpoint(path: Path, *, seed: int = 0, **overrides) -> Path:
    """Random tiny GPT-OSS (bf16, experts MXFP4) saved under `path`; returns `path`."""
    from safetensors.torch import load_file, save_file
    from transformers import GptOssForCausalLM

    torch.manual_seed(seed)
    model = GptOssForCausalLM(tiny_config(**overrides)).to(torch.bfloat16)
    model.save_pretrained(path)
    weights_file = path / "model.safetensors"
    state = load_file(weights_file)
    for name in list(state):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            w = state.pop(name).transpose(1, 2).contiguous()  # [E, N, K]: the kernels' rows
            packed, scales = quantize_mxfp4(w)
            state[name + "_blocks"] = packed.reshape(*scales.shape, 16)
            state[name + "_scales"] = scales
    save_file(state, weights_file, metadata={"format": "pt"})
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": NOT_CONVERTED,
    }
    config_file.write_text(json.dumps(config, indent=2))
    return path


def load(path: Path, implementation: str, device: str = "cpu"):
    """The checkpoint loaded in bf16 with `implementation` ("eager" or "tokenspeed") for both
    attention and experts; MXFP4 experts dequantized by transformers."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation=implementation,
        experts_implementation=implementation,
        quantization_config=Mxfp4Config(dequantize=True),
    )  # fmt: skip
    return model.to(device).eval()
