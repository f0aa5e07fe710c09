"""Model presets: the shapes a model's layers send to each op.

Used by the CLI's report and `explain`, and by the check/bench tools.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .ops.attention.request import AttentionRequest, KVStoreRequest
from .ops.moe.request import MoERequest


@dataclass(frozen=True)
class ModelPreset:
    name: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    window_left: int  # sliding layers; the others are full attention
    page_size: int
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    dtype: torch.dtype = torch.bfloat16
    decode_batch: int = 64
    prefill_batch: int = 8192

    def attention_request(
        self, op: str, *, window: bool = False, q_len: int = 1, kv_dtype: torch.dtype | None = None
    ) -> AttentionRequest:
        paged = op != "mha_prefill"
        return AttentionRequest(
            self.dtype,
            kv_dtype or self.dtype,
            self.head_dim,
            self.num_q_heads,
            self.num_kv_heads,
            self.page_size if paged else 0,
            q_len if op == "mha_decode_with_kvcache" else 0,
            True,
            self.window_left if window else -1,
            True,
            False,
        )

    def kvcache_store_request(self, kv_dtype: torch.dtype | None = None) -> KVStoreRequest:
        return KVStoreRequest(
            self.dtype, kv_dtype or self.dtype, self.head_dim, self.num_kv_heads, self.page_size
        )

    def moe_request(
        self, max_num_tokens: int, *, weight_format: str = "mxfp4", activation_format: str = "bf16"
    ) -> MoERequest:
        return MoERequest(
            weight_format,
            activation_format,
            True,
            "topk_softmax",
            self.num_experts,
            self.top_k,
            self.hidden_size,
            self.intermediate_size,
            max_num_tokens,
        )


PRESETS: dict[str, ModelPreset] = {
    "gpt-oss-120b": ModelPreset("gpt-oss-120b", 64, 8, 64, 127, 64, 128, 4, 2880, 2880),
    "gpt-oss-20b": ModelPreset("gpt-oss-20b", 64, 8, 64, 127, 64, 32, 4, 2880, 2880),
    # Small enough for the CPU and the Triton interpreter, same structure as GPT-OSS.
    "tiny": ModelPreset("tiny", 8, 2, 64, 15, 16, 8, 2, 128, 128, decode_batch=4, prefill_batch=64),
}


def get_preset(name: str) -> ModelPreset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}, expected one of {', '.join(PRESETS)}")
    return PRESETS[name]


def report_calls(preset: ModelPreset) -> list[tuple[str, str, object]]:
    """(label, registry op, request) for each call a serving step of the model makes."""
    return [
        ("prefill (full)", "mha_prefill", preset.attention_request("mha_prefill")),
        (
            "prefill (sliding window)",
            "mha_prefill",
            preset.attention_request("mha_prefill", window=True),
        ),
        (
            "extend (full)",
            "mha_extend_with_kvcache",
            preset.attention_request("mha_extend_with_kvcache"),
        ),
        (
            "decode (full)",
            "mha_decode_with_kvcache",
            preset.attention_request("mha_decode_with_kvcache"),
        ),
        (
            "decode (sliding window)",
            "mha_decode_with_kvcache",
            preset.attention_request("mha_decode_with_kvcache", window=True),
        ),
        ("kvcache_store", "kvcache_store", preset.kvcache_store_request()),
        (
            f"moe decode batch (M<={preset.decode_batch})",
            "moe_apply",
            preset.moe_request(preset.decode_batch),
        ),
        (
            f"moe prefill batch (M<={preset.prefill_batch})",
            "moe_apply",
            preset.moe_request(preset.prefill_batch),
        ),
    ]
