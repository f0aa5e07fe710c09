"""The shared conformance case lists: one per op, used by every backend's tests and by
`tokenspeed-kernel check`.

Default cases are tiny (the CPU and the Triton interpreter run them in seconds) and always cover
odd sizes, one token, empty sequences, head dims 64 and 128, GQA ratios 1 and 8, page sizes 1 and
128, sinks on and off, windows 0/1/127, lse, extend with a partial prefix, decode Q=1 and Q>1, FP8
KV caches with scales; kvcache_store in bf16/fp16/fp8 with padded (negative) slots; MoE with
mxfp4/fp8/bf16 weights, bf16 and fp8 (static and dynamic) activations, bias on and off, logits,
ties and precomputed routing, tensor-parallel shard sizes and expert-parallel ranges.
`preset=` adds a model's real shapes (for GPU runs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..formats.fp8 import FP8_DTYPE
from ..ops.attention.request import AttentionRequest, KVStoreRequest
from ..ops.moe.parallel import expert_parallel_bounds, tensor_parallel_bounds
from ..ops.moe.request import MoERequest
from ..platform import default_device
from ..presets import ModelPreset, get_preset
from ..registry import op_names
from .inputs import (
    AttentionShape,
    MoEShape,
    StoreShape,
    build_decode,
    build_extend,
    build_moe,
    build_prefill,
    build_store,
    generator,
)

_BUILDERS = {
    "mha_prefill": build_prefill,
    "mha_extend_with_kvcache": build_extend,
    "mha_decode_with_kvcache": build_decode,
    "kvcache_store": build_store,
    "moe_apply": build_moe,
}
_FLOAT16 = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Case:
    """One conformance case: `request` is what the selector sees, `shape` how inputs are drawn.

    `build(device, seed)` returns fresh `(args, kwargs)`: for attention ops and kvcache_store,
    exactly the normalized arguments of `kernel.fn`; for "moe_apply", `(config, weights, x)` and the
    routing inputs (see `conformance.run_case` for the plan/prepare/apply flow).
    """

    name: str
    op: str
    request: Any
    shape: AttentionShape | StoreShape | MoEShape
    preset: str | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype (q, k/v, or the MoE input x)."""
        return torch.bfloat16 if self.op == "moe_apply" else self.shape.dtype

    def build(self, device: torch.device | str | None = None, seed: int = 0):
        device = default_device() if device is None else torch.device(device)
        return _BUILDERS[self.op](self.shape, generator(self.name, seed), device)

    def __str__(self) -> str:
        return self.name


def attention_case(name: str, op: str, shape: AttentionShape, preset: str | None = None) -> Case:
    page_size = 0 if op == "mha_prefill" else shape.page_size
    q_len = shape.q_lens[0] if op == "mha_decode_with_kvcache" else 0
    request = AttentionRequest(
        shape.dtype,
        shape.cache_dtype,
        shape.head_dim,
        shape.num_q_heads,
        shape.num_kv_heads,
        page_size,
        q_len,
        shape.causal,
        shape.window_left,
        shape.sinks is not None,
        shape.lse,
    )
    return Case(name, op, request, shape, preset)


def store_case(name: str, shape: StoreShape, preset: str | None = None) -> Case:
    request = KVStoreRequest(
        shape.dtype, shape.cache_dtype, shape.head_dim, shape.num_kv_heads, shape.page_size
    )
    return Case(name, "kvcache_store", request, shape, preset)


def moe_case(name: str, shape: MoEShape, preset: str | None = None) -> Case:
    config = shape.config()
    request = MoERequest(
        shape.weight_format,
        shape.activation_format,
        shape.has_bias,
        "topk_softmax",
        shape.num_experts,
        shape.top_k,
        shape.hidden_size,
        shape.intermediate_size,
        shape.num_tokens,
        config.expert_offset,
        config.num_local_experts,
    )
    return Case(name, "moe_apply", request, shape, preset)


def _both_dtypes(op: str, cases: Iterable[tuple[str, AttentionShape | StoreShape]]) -> list[Case]:
    """Each structural case in bf16 and fp16 (fp16 is what the Triton interpreter can check)."""
    out = []
    for name, shape in cases:
        for dtype in _FLOAT16:
            label = f"{name}-{'bf16' if dtype == torch.bfloat16 else 'fp16'}"
            shape_d = dataclasses.replace(shape, dtype=dtype)
            if op == "kvcache_store":
                out.append(store_case(label, shape_d))
            else:
                out.append(attention_case(label, op, shape_d))
    return out


A = AttentionShape
FP8 = FP8_DTYPE

_PREFILL = [
    ("odd-gqa1-lse", A((1, 7, 13), 2, 2, 64, lse=True)),
    ("gqa8-d128-empty-seq-sinks", A((5, 0, 11), 8, 1, 128, sinks=0.0)),
    ("one-token-gqa4", A((1,), 4, 1, 128, lse=True)),
    ("noncausal-sinks", A((9, 1, 4), 4, 2, 64, causal=False, sinks=0.0, lse=True)),
    ("window0-sinks-lse", A((6, 3), 4, 4, 64, window_left=0, sinks=0.0, lse=True)),
    ("window1-gqa8-sinks-bf16sinks", A((10, 1), 8, 1, 64, window_left=1, sinks=0.0,
                                       sinks_dtype=torch.bfloat16, lse=True)),
    ("window127-gqa2-sinks", A((150, 3), 4, 2, 64, window_left=127, sinks=0.0, lse=True)),
    ("sink+30-competing", A((12, 5), 4, 2, 64, sinks=30.0, q_gain=25.0, lse=True)),
    ("all-empty-but-one", A((0, 3, 0), 4, 1, 64, lse=True)),
]  # fmt: skip

_EXTEND = [
    ("partial-prefix-page16-gqa8", A((7, 20, 1), 8, 1, 64, q_lens=(3, 20, 1), page_size=16,
                                     sinks=0.0, lse=True)),
    ("page1-window1-gqa1", A((9, 4), 4, 4, 64, q_lens=(4, 4), page_size=1, window_left=1,
                             sinks=0.0, lse=True)),
    ("d128-page64-window5-empty-q", A((33, 5, 0), 2, 1, 128, q_lens=(9, 0, 0), page_size=64,
                                      window_left=5, sinks=0.0, sinks_dtype=torch.bfloat16)),
    ("window0-no-sinks", A((8, 5), 4, 2, 64, q_lens=(3, 5), page_size=16, window_left=0)),
    ("window127-page128", A((200, 130), 8, 1, 64, q_lens=(70, 130), page_size=128,
                            window_left=127, sinks=0.0, lse=True)),
    ("fp8-scales-page16", A((12, 6), 8, 2, 64, kv_dtype=FP8, q_lens=(5, 1), page_size=16,
                            sinks=0.0, lse=True, k_scale=0.5, v_scale=2.0)),
]  # fmt: skip

_DECODE = [
    ("q1-gqa8-d128-page16", A((1, 17, 40), 8, 1, 128, q_lens=(1,), page_size=16, sinks=0.0,
                              lse=True)),
    ("q1-page1-window0-gqa1", A((5, 2), 4, 4, 64, q_lens=(1,), page_size=1, window_left=0,
                                sinks=0.0)),
    ("q1-empty-seq-lse", A((0, 6, 1), 4, 2, 64, q_lens=(1,), page_size=16, lse=True)),
    ("q3-window1", A((3, 10, 25), 4, 2, 64, q_lens=(3,), page_size=16, window_left=1, lse=True)),
    ("q1-long-page64-sinks", A((300, 65, 1), 8, 1, 64, q_lens=(1,), page_size=64, sinks=0.0,
                               lse=True)),
    ("q1-sink+30-page128", A((129, 7), 8, 1, 64, q_lens=(1,), page_size=128, sinks=30.0,
                             q_gain=20.0)),
    ("q4-fp8-gqa8-window127", A((150, 4, 300), 16, 2, 64, kv_dtype=FP8, q_lens=(4,),
                                page_size=64, window_left=127, sinks=0.0, lse=True,
                                k_scale=1.5, v_scale=0.25)),
    ("q1-fp8-unit-scale-page128", A((129, 7), 8, 1, 128, kv_dtype=FP8, q_lens=(1,),
                                    page_size=128, sinks=0.0)),
]  # fmt: skip

S = StoreShape
_STORE = [
    ("page16-padded-slots", S(13, 2, 64, 16, 4, skip=3)),
    ("page1-d128-gqa-heads8", S(5, 8, 128, 1, 9)),
    ("page64-one-token", S(1, 1, 64, 64, 2)),
    ("page128-all-padding", S(4, 2, 64, 128, 1, skip=4)),
    ("fp8-scales-padded", S(11, 2, 64, 16, 3, kv_dtype=FP8, skip=2, k_scale=0.5, v_scale=2.0)),
    ("fp8-unit-scale-page128-d128", S(9, 4, 128, 128, 1, kv_dtype=FP8)),
]  # fmt: skip

M = MoEShape
_MOE = [
    ("mxfp4-bf16-bias-logits", M(7, 8, 2, 128, 128)),
    ("mxfp4-bf16-odd-sizes-k=E", M(5, 4, 4, 160, 96, bias_dtype=torch.bfloat16)),
    ("mxfp4-bf16-one-token", M(1, 8, 4, 128, 128, logits_dtype=torch.bfloat16)),
    ("mxfp4-bf16-nobias-precomputed", M(6, 8, 2, 128, 128, has_bias=False,
                                        routing="precomputed")),
    ("mxfp4-bf16-ties", M(9, 8, 4, 128, 128, routing="ties")),
    ("mxfp4-bf16-clamped", M(5, 8, 2, 128, 128, gain=4.0)),
    ("mxfp4-bf16-33-tokens-E16", M(33, 16, 4, 128, 128)),
    ("mxfp4-fp8-dynamic", M(7, 8, 2, 128, 128, activation_format="fp8")),
    ("mxfp4-fp8-static", M(7, 8, 2, 128, 128, activation_format="fp8", static_scales=True)),
    ("fp8-bf16-bias", M(7, 8, 2, 128, 96, weight_format="fp8")),
    ("fp8-fp8-dynamic-nobias", M(5, 8, 2, 128, 128, weight_format="fp8",
                                 activation_format="fp8", has_bias=False)),
    ("bf16-bf16-bias", M(7, 8, 2, 96, 128, weight_format="bf16")),
    ("bf16-bf16-nobias-precomputed", M(4, 4, 1, 128, 64, weight_format="bf16", has_bias=False,
                                       routing="precomputed")),
    # Tensor-parallel shards are ordinary layers with a small I: GPT-OSS-120B's last TP 8 shard
    # (192) and 7 scale groups (224), both padded by the kernels.
    ("mxfp4-bf16-tp-shard-I192", M(7, 8, 2, 128, 192)),
    ("mxfp4-bf16-tp-shard-I224-nobias", M(5, 8, 4, 128, 224, has_bias=False)),
    # Expert parallel: a rank's middle and last experts (global ids; pairs of the other
    # experts contribute nothing), logits and precomputed ids, the multi-kernel router.
    ("mxfp4-bf16-ep-experts-2-4", M(9, 8, 2, 128, 128, expert_offset=2, num_local_experts=3)),
    ("mxfp4-bf16-ep-last-precomputed", M(6, 8, 4, 128, 96, expert_offset=4, num_local_experts=4,
                                         routing="precomputed")),
    ("mxfp4-bf16-ep-70-tokens-E16", M(70, 16, 4, 128, 128, expert_offset=4,
                                      num_local_experts=4)),
    ("mxfp4-fp8-ep-first", M(5, 8, 2, 128, 128, activation_format="fp8", num_local_experts=3)),
    ("bf16-bf16-ep-one-expert", M(7, 8, 2, 96, 128, weight_format="bf16", expert_offset=7,
                                  num_local_experts=1)),
]  # fmt: skip

_DEFAULT: dict[str, list[Case]] = {
    "mha_prefill": _both_dtypes("mha_prefill", (("prefill-" + n, s) for n, s in _PREFILL)),
    "mha_extend_with_kvcache": _both_dtypes(
        "mha_extend_with_kvcache", (("extend-" + n, s) for n, s in _EXTEND)
    ),
    "mha_decode_with_kvcache": _both_dtypes(
        "mha_decode_with_kvcache", (("decode-" + n, s) for n, s in _DECODE)
    ),
    "kvcache_store": _both_dtypes("kvcache_store", (("store-" + n, s) for n, s in _STORE)),
    "moe_apply": [moe_case("moe-" + n, s) for n, s in _MOE],
}


def preset_cases(op: str, preset: ModelPreset | str) -> list[Case]:
    """A model's real shapes for `op`: full and sliding-window layers, a few batch sizes."""
    p = get_preset(preset) if isinstance(preset, str) else preset
    tiny = p.name == "tiny"
    # Long enough to cross the window and several pages, short enough for the reference.
    ctx = (40, 23, 1) if tiny else (2048, 777, 1)
    heads = (p.num_q_heads, p.num_kv_heads, p.head_dim)
    base = dict(dtype=p.dtype, sinks=0.0, lse=True)
    cases: list[Case] = []

    def add(label: str, shape):
        name = f"{p.name}-{label}"
        if op == "kvcache_store":
            cases.append(store_case(name, shape, p.name))
        elif op == "moe_apply":
            cases.append(moe_case(name, shape, p.name))
        else:
            cases.append(attention_case(name, op, shape, p.name))

    for layer, window in (("full", -1), ("sliding", p.window_left)):
        if op == "mha_prefill":
            add(f"prefill-{layer}", A(ctx, *heads, window_left=window, **base))
        elif op == "mha_extend_with_kvcache":
            q_lens = tuple(max(1, n // 3) for n in ctx)
            add(
                f"extend-{layer}",
                A(ctx, *heads, q_lens=q_lens, page_size=p.page_size, window_left=window, **base),
            )
        elif op == "mha_decode_with_kvcache":
            for batch in (1, 4) if tiny else (1, 16, 64):
                lens = tuple(ctx[b % len(ctx)] + b for b in range(batch))
                add(
                    f"decode-{layer}-b{batch}",
                    A(lens, *heads, q_lens=(1,), page_size=p.page_size, window_left=window, **base),
                )
    if op == "mha_decode_with_kvcache":
        lens = tuple(ctx[b % len(ctx)] + b for b in range(4))
        add(
            "decode-fp8-kv-q2",
            A(
                lens,
                *heads,
                kv_dtype=FP8,
                q_lens=(2,),
                page_size=p.page_size,
                window_left=p.window_left,
                k_scale=0.5,
                v_scale=2.0,
                **base,
            ),
        )
    elif op == "kvcache_store":
        for kv_dtype in (None, FP8):
            tokens = 37 if tiny else 1000
            pages = -(-2 * tokens // p.page_size)
            label = "store-fp8" if kv_dtype else "store"
            add(
                label,
                S(
                    tokens,
                    p.num_kv_heads,
                    p.head_dim,
                    p.page_size,
                    pages,
                    p.dtype,
                    kv_dtype,
                    skip=3,
                ),
            )
    elif op == "moe_apply":
        layer = (p.num_experts, p.top_k, p.hidden_size, p.intermediate_size)
        for m in (1, 7) if tiny else (1, 16, 128):
            add(f"moe-mxfp4-bf16-m{m}", M(m, *layer))
        # One rank's shard, as engines shard the layer (ops/moe/parallel.py): the last
        # tensor-parallel slice of I (GPT-OSS at TP 8: 192 channels) and an expert block.
        world, m = (2, 7) if tiny else (8, 16)
        start, end = tensor_parallel_bounds(p.intermediate_size, rank=world - 1, world_size=world)
        add(f"moe-mxfp4-bf16-tp{world}-last-m{m}", M(m, *layer[:3], end - start))
        offset, count = expert_parallel_bounds(p.num_experts, rank=world // 2, world_size=world)
        shard = dict(expert_offset=offset, num_local_experts=count)
        add(f"moe-mxfp4-bf16-ep{world}-rank{world // 2}-m{m}", M(m, *layer, **shard))
    return cases


def conformance_cases(
    op: str, *, preset: str | None = None, dtypes: Iterable[torch.dtype] | None = None
) -> list[Case]:
    """The shared cases of `op` (one of `tokenspeed_kernel.op_names()`), plus `preset`'s shapes.

    dtypes keeps the cases whose activation dtype (`Case.dtype`) is listed; MoE cases are
    bfloat16 (the contract's only activation input dtype).
    """
    if op not in op_names():
        raise ValueError(
            f"conformance_cases: op is {op!r}, expected one of {', '.join(op_names())}"
        )
    cases = list(_DEFAULT[op])
    if preset is not None:
        cases += preset_cases(op, preset)
    if dtypes is not None:
        keep = set(dtypes)
        cases = [c for c in cases if c.dtype in keep]
    return cases
