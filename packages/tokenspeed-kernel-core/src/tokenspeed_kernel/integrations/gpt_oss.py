"""A GPT-OSS decoder on the public ops, with a paged KV cache: for end-to-end checks and
benchmarks. Projections, norms, RoPE and the router are torch; attention, the cache write and the
experts are `mha_prefill` / `mha_decode_with_kvcache` / `kvcache_store` / `moe_apply`, whichever
kernel the selector picks on the tensors' device. Weights are random (MXFP4 experts), shaped
like the released models.

Math follows transformers' GptOss: RMSNorm in float32 with an fp32 weight, cast to bf16;
rotary embedding on halves (YaRN frequencies); sinks; even layers use a sliding window of 128
keys, odd layers full attention; the router takes the top-k logits and a softmax over them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..ops.attention import kvcache_store, mha_decode_with_kvcache, mha_prefill
from ..ops.moe import MoEConfig, MoEWeights, SwiGLU, moe_apply, moe_plan, moe_prepare_weights

__all__ = ["PRESETS", "Batch", "GptOssModel", "GptOssShape", "PagedCache", "rope_cos_sin"]


@dataclass(frozen=True)
class GptOssShape:
    num_layers: int
    num_experts: int
    hidden_size: int = 2880
    intermediate_size: int = 2880
    num_q_heads: int = 64
    num_kv_heads: int = 8
    head_dim: int = 64
    top_k: int = 4
    vocab_size: int = 201088
    sliding_window: int = 128
    rms_eps: float = 1e-5
    rope_theta: float = 150000.0
    rope_factor: float = 32.0
    rope_original_max_position: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0

    def is_sliding(self, layer: int) -> bool:
        return layer % 2 == 0


PRESETS = {
    "gpt-oss-20b": GptOssShape(num_layers=24, num_experts=32),
    "gpt-oss-120b": GptOssShape(num_layers=36, num_experts=128),
    # CPU-sized: every feature of the real shapes (GQA 2, sinks, window, MXFP4 experts).
    "tiny": GptOssShape(
        num_layers=2,
        num_experts=8,
        hidden_size=128,
        intermediate_size=64,
        num_q_heads=4,
        num_kv_heads=2,
        top_k=2,
        vocab_size=64,
        sliding_window=8,
    ),  # fmt: skip
}


def rope_inv_freq(shape: GptOssShape) -> tuple[torch.Tensor, float]:
    """YaRN inverse frequencies [D/2] float32 and the attention scaling of cos/sin."""
    dim, base, factor = shape.head_dim, shape.rope_theta, shape.rope_factor

    def correction_dim(rotations):
        orig = shape.rope_original_max_position
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(correction_dim(shape.rope_beta_fast), 0)
    high = min(correction_dim(shape.rope_beta_slow), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv_freq = (1 / (factor * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation
    return inv_freq, 0.1 * math.log(factor) + 1.0


def rope_cos_sin(inv_freq, scaling, positions):
    """cos, sin [T, D/2] bf16 for positions [T] (computed in float32, as transformers does)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return (freqs.cos() * scaling).bfloat16(), (freqs.sin() * scaling).bfloat16()


def _rotate(x, cos, sin):
    first, second = x.chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def _rms_norm(x, weight, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(x.dtype)


@dataclass
class PagedCache:
    """K and V pages of every layer: [num_pages, page_size, Hkv, D] each."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    page_size: int


@dataclass
class Batch:
    """Where the tokens of one forward go. Prefill: whole prompts (cu_seqlens [B+1] int32,
    max_seqlen); decode: one token per sequence (cache_seqlens [B] int32 including it).
    slot_mapping [T] int64 and page_table [B, max_pages] int32 in both."""

    slot_mapping: torch.Tensor
    page_table: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    cache_seqlens: torch.Tensor | None = None

    @property
    def is_decode(self) -> bool:
        return self.cache_seqlens is not None


class GptOssModel:
    """Random-weight GPT-OSS of `shape` on `device` (bf16, MXFP4 experts)."""

    def __init__(self, shape: GptOssShape, *, device, seed: int = 0, max_num_tokens: int = 8192):
        self.shape = shape
        self.device = torch.device(device)
        g = torch.Generator(device=self.device).manual_seed(seed)
        self._g = g
        H, V = shape.hidden_size, shape.vocab_size  # noqa: N806
        self.embed = self._randn(V, H, std=1.0)
        self.final_norm = 1 + 0.1 * self._randn(H, dtype=torch.float32)
        self.lm_head = self._randn(V, H, std=H**-0.5)
        config = MoEConfig(
            num_experts=shape.num_experts, top_k=shape.top_k, hidden_size=H,
            intermediate_size=shape.intermediate_size, weight_format="mxfp4",
            activation=SwiGLU(), has_bias=True,
        )  # fmt: skip
        self.moe_plan = moe_plan(config, device=self.device, max_num_tokens=max_num_tokens)
        self.layers = [self._layer() for _ in range(shape.num_layers)]
        inv_freq, self.rope_scaling = rope_inv_freq(shape)
        self.inv_freq = inv_freq.to(self.device)
        del self._g

    def _randn(self, *size, std=1.0, dtype=torch.bfloat16):
        x = torch.randn(*size, generator=self._g, device=self.device, dtype=torch.float32)
        return (x * std).to(dtype)

    def _mxfp4(self, rows, cols):
        E = self.shape.num_experts  # noqa: N806
        packed = torch.randint(
            0, 256, (E, rows, cols // 2), generator=self._g, device=self.device, dtype=torch.uint8
        )
        # 2^-8 .. 2^-6: e2m1 values (mean |v| about 2.6) keep the expert outputs O(1).
        scales = torch.randint(
            119, 122, (E, rows, cols // 32), generator=self._g, device=self.device,
            dtype=torch.uint8,
        )  # fmt: skip
        return packed, scales

    def _layer(self) -> dict:
        s = self.shape
        H, I, E = s.hidden_size, s.intermediate_size, s.num_experts  # noqa: N806, E741
        q_out, kv_out = s.num_q_heads * s.head_dim, s.num_kv_heads * s.head_dim
        w13, w13_scale = self._mxfp4(2 * I, H)
        w2, w2_scale = self._mxfp4(H, I)
        experts = MoEWeights(
            w13=w13, w13_scale=w13_scale, w2=w2, w2_scale=w2_scale,
            w13_bias=self._randn(E, 2 * I, std=0.1), w2_bias=self._randn(E, H, std=0.1),
        )  # fmt: skip
        return dict(
            input_norm=1 + 0.1 * self._randn(H, dtype=torch.float32),
            post_norm=1 + 0.1 * self._randn(H, dtype=torch.float32),
            qkv=self._randn(q_out + 2 * kv_out, H, std=H**-0.5),
            qkv_bias=self._randn(q_out + 2 * kv_out, std=0.1),
            o=self._randn(H, q_out, std=q_out**-0.5),
            o_bias=self._randn(H, std=0.1),
            sinks=self._randn(s.num_q_heads, std=1.0),
            router=self._randn(E, H, std=H**-0.5),
            router_bias=self._randn(E, std=0.1),
            experts=experts,
            prepared=moe_prepare_weights(self.moe_plan, experts),
        )

    def new_cache(self, num_pages: int, page_size: int = 64) -> PagedCache:
        s = self.shape
        size = (num_pages, page_size, s.num_kv_heads, s.head_dim)
        k = [torch.zeros(size, dtype=torch.bfloat16, device=self.device) for _ in self.layers]
        v = [torch.zeros(size, dtype=torch.bfloat16, device=self.device) for _ in self.layers]
        return PagedCache(k, v, page_size)

    def layer_forward(self, index, x, cos, sin, cache: PagedCache, batch: Batch):
        """x [T, H] bf16 -> [T, H]: one decoder layer (attention and MoE blocks, residuals)."""
        return self.moe_block(index, self.attention_block(index, x, cos, sin, cache, batch))

    def attention_block(self, index, x, cos, sin, cache: PagedCache, batch: Batch):
        """x [T, H] -> x + attention(norm(x)) [T, H]; writes the tokens' K/V into the cache."""
        s, w = self.shape, self.layers[index]
        T = x.shape[0]  # noqa: N806
        q_out, kv_out = s.num_q_heads * s.head_dim, s.num_kv_heads * s.head_dim
        h = _rms_norm(x, w["input_norm"], s.rms_eps)
        qkv = torch.nn.functional.linear(h, w["qkv"], w["qkv_bias"])
        q = _rotate(qkv[:, :q_out].view(T, s.num_q_heads, s.head_dim), cos, sin)
        k = _rotate(qkv[:, q_out : q_out + kv_out].view(T, s.num_kv_heads, s.head_dim), cos, sin)
        v = qkv[:, q_out + kv_out :].view(T, s.num_kv_heads, s.head_dim)
        k_cache, v_cache = cache.k[index], cache.v[index]
        kvcache_store(k, v, k_cache, v_cache, slot_mapping=batch.slot_mapping)
        window = s.sliding_window - 1 if s.is_sliding(index) else -1
        if batch.is_decode:
            attn = mha_decode_with_kvcache(
                q, k_cache, v_cache, page_table=batch.page_table,
                cache_seqlens=batch.cache_seqlens, window_left=window, sinks=w["sinks"],
            )  # fmt: skip
        else:
            attn = mha_prefill(
                q, k, v, cu_seqlens=batch.cu_seqlens, max_seqlen=batch.max_seqlen,
                window_left=window, sinks=w["sinks"],
            )  # fmt: skip
        return x + torch.nn.functional.linear(attn.view(T, q_out), w["o"], w["o_bias"])

    def moe_inputs(self, index, x):
        """x [T, H] (the MoE block's input) -> (normalized x [T, H], router logits [T, E])."""
        w = self.layers[index]
        h = _rms_norm(x, w["post_norm"], self.shape.rms_eps)
        return h, torch.nn.functional.linear(h, w["router"], w["router_bias"])

    def moe_block(self, index, x):
        """x [T, H] -> x + experts(norm(x)) [T, H]."""
        h, logits = self.moe_inputs(index, x)
        return x + moe_apply(self.moe_plan, h, self.layers[index]["prepared"], logits)

    def forward(self, token_ids, positions, cache: PagedCache, batch: Batch, *, last=None):
        """token_ids, positions [T] -> logits [R, V] of the rows `last` [R] (default: all)."""
        x = self.embed[token_ids]
        cos, sin = rope_cos_sin(self.inv_freq, self.rope_scaling, positions)
        for index in range(len(self.layers)):
            x = self.layer_forward(index, x, cos, sin, cache, batch)
        if last is not None:
            x = x[last]
        x = _rms_norm(x, self.final_norm, self.shape.rms_eps)
        return torch.nn.functional.linear(x, self.lm_head)

    def truncated(self, num_layers: int) -> GptOssModel:
        """The same weights with only the first `num_layers` layers (0: embedding and head)."""
        other = object.__new__(GptOssModel)
        other.__dict__.update(self.__dict__)
        other.shape = replace(self.shape, num_layers=num_layers)
        other.layers = self.layers[:num_layers]
        return other


def prefill_batch(lengths, page_size, pages_per_seq, device) -> tuple[Batch, torch.Tensor]:
    """Batch of whole prompts of `lengths` on pages [b * pages_per_seq, ...); and positions."""
    page_table = torch.arange(len(lengths) * pages_per_seq, dtype=torch.int32, device=device)
    page_table = page_table.view(len(lengths), pages_per_seq)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])
    seq = torch.cat(
        [torch.full((n,), b, dtype=torch.long, device=device) for b, n in enumerate(lengths)]
    )
    slots = page_table[seq, positions // page_size].long() * page_size + positions % page_size
    cu = torch.tensor([0, *lengths], dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
    batch = Batch(slots, page_table, cu_seqlens=cu, max_seqlen=max(lengths))
    return batch, positions


def decode_batch(context, page_size, pages_per_seq, device) -> tuple[Batch, torch.Tensor]:
    """One new token per sequence after `context` [B] cached tokens; and its positions."""
    context = torch.as_tensor(context, dtype=torch.long, device=device)
    count = context.shape[0]
    page_table = torch.arange(count * pages_per_seq, dtype=torch.int32, device=device)
    page_table = page_table.view(count, pages_per_seq)
    rows = torch.arange(count, device=device)
    slots = page_table[rows, context // page_size].long() * page_size + context % page_size
    batch = Batch(slots, page_table, cache_seqlens=(context + 1).to(torch.int32))
    return batch, context


def transformers_layer(model: GptOssModel, index: int):
    """transformers' GptOssDecoderLayer holding layer `index`'s weights (experts dequantized
    to bf16), in bf16 with fp32 norms as `from_pretrained(dtype=bfloat16)` loads it; and the
    config. Needs transformers."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssDecoderLayer

    from ..formats.mxfp4 import dequantize_mxfp4

    s, w = model.shape, model.layers[index]
    config = transformers_config(s)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    with torch.device("meta"):
        layer = GptOssDecoderLayer(config, index)
    layer = layer.to_empty(device=model.device).to(torch.bfloat16)
    q_out, kv_out = s.num_q_heads * s.head_dim, s.num_kv_heads * s.head_dim
    attn, mlp, e = layer.self_attn, layer.mlp, w["experts"]
    with torch.no_grad():
        parts = ((attn.q_proj, 0, q_out), (attn.k_proj, q_out, kv_out))
        parts += ((attn.v_proj, q_out + kv_out, kv_out),)
        for proj, start, size in parts:
            proj.weight.copy_(w["qkv"][start : start + size])
            proj.bias.copy_(w["qkv_bias"][start : start + size])
        attn.o_proj.weight.copy_(w["o"])
        attn.o_proj.bias.copy_(w["o_bias"])
        attn.sinks.copy_(w["sinks"])
        mlp.router.weight.copy_(w["router"])
        mlp.router.bias.copy_(w["router_bias"])
        for expert in range(s.num_experts):  # one at a time: bounded float32 temporaries
            gate_up = dequantize_mxfp4(e.w13[expert], e.w13_scale[expert])
            mlp.experts.gate_up_proj[expert].copy_(gate_up.t())
            down = dequantize_mxfp4(e.w2[expert], e.w2_scale[expert])
            mlp.experts.down_proj[expert].copy_(down.t())
        mlp.experts.gate_up_proj_bias.copy_(e.w13_bias)
        mlp.experts.down_proj_bias.copy_(e.w2_bias)
    layer.input_layernorm.float().weight.data.copy_(w["input_norm"])
    layer.post_attention_layernorm.float().weight.data.copy_(w["post_norm"])
    return layer.eval(), config


def transformers_config(shape: GptOssShape):
    """transformers' GptOssConfig of `shape`. Needs transformers."""
    from transformers import GptOssConfig

    layer_types = [
        "sliding_attention" if shape.is_sliding(i) else "full_attention"
        for i in range(shape.num_layers)
    ]
    return GptOssConfig(
        num_hidden_layers=shape.num_layers, num_local_experts=shape.num_experts,
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, head_dim=shape.head_dim,
        num_attention_heads=shape.num_q_heads, num_key_value_heads=shape.num_kv_heads,
        num_experts_per_tok=shape.top_k, sliding_window=shape.sliding_window,
        rms_norm_eps=shape.rms_eps, layer_types=layer_types, max_position_embeddings=131072,
        rope_parameters=dict(
            rope_type="yarn", rope_theta=shape.rope_theta, factor=shape.rope_factor,
            beta_fast=shape.rope_beta_fast, beta_slow=shape.rope_beta_slow, truncate=False,
            original_max_position_embeddings=shape.rope_original_max_position,
        ),
    )  # fmt: skip
