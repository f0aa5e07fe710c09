"""Benchmark workloads: a preset's shapes per op, their inputs, and the work they represent.

FLOPs and bytes are counted from the shapes on the host (never from device values):
attention FLOPs = 4·Hq·D·(visible keys summed over queries); paged attention bytes = K and V of
the keys some query of the sequence can see (plus q and out); prefill bytes = q, k, v and out;
kvcache_store bytes = k/v read plus the cache rows written; MoE FLOPs = M·k·2·(H·2I + I·H) and
MoE bytes = the distinct selected experts' weights and scales, plus x and out.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..formats.fp8 import FP8_DTYPE
from ..presets import ModelPreset, get_preset
from ..registry import KernelSpec
from ..testing.cases import Case, attention_case, moe_case, store_case
from ..testing.conformance import moe_plan_for
from ..testing.inputs import (
    AttentionShape,
    MoEShape,
    StoreShape,
    build_decode,
    build_extend,
    build_prefill,
    build_store,
    moe_inputs,
    moe_weights,
)


@dataclass(frozen=True)
class Point:
    """One benchmark shape: `series` groups points into one plot line family (full / sliding
    layers, cache dtype...), `x` is the plotted size (batch, sequence length or tokens)."""

    case: Case
    series: str
    x: int
    xlabel: str
    label: str

    @property
    def op(self) -> str:
        return self.case.op


def bench_points(op: str, preset: ModelPreset | str) -> list[Point]:
    p = get_preset(preset) if isinstance(preset, str) else preset
    tiny = p.name == "tiny"
    heads = (p.num_q_heads, p.num_kv_heads, p.head_dim)
    # Sinks as GPT-OSS's checkpoints and the engines hold them: a bf16 parameter.
    base = dict(dtype=p.dtype, sinks=0.0, sinks_dtype=torch.bfloat16)
    layers = (("full", -1), (f"window {p.window_left}", p.window_left))
    points: list[Point] = []
    if op == "mha_prefill":
        sizes = ((16, 4), (64, 2)) if tiny else ((1024, 16), (4096, 4), (8192, 2))
        for series, window in layers:
            for seqlen, batch in sizes:
                shape = AttentionShape((seqlen,) * batch, *heads, window_left=window, **base)
                points.append(
                    _attention(op, p, shape, series, seqlen, "seq_len", f"S={seqlen} x{batch}")
                )
    elif op == "mha_extend_with_kvcache":
        new, batch = (8, 2) if tiny else (1024, 4)
        for series, window in layers:
            for ctx in (32, 64) if tiny else (2048, 8192, 32768):
                shape = AttentionShape(
                    (ctx,) * batch,
                    *heads,
                    q_lens=(new,) * batch,
                    page_size=p.page_size,
                    window_left=window,
                    **base,
                )
                points.append(
                    _attention(op, p, shape, series, ctx, "context", f"ctx={ctx} +{new} x{batch}")
                )
    elif op == "mha_decode_with_kvcache":
        ctx = 64 if tiny else 8192
        for series, window in layers:
            for batch in (1, 4) if tiny else (1, 16, 64, 128):
                shape = AttentionShape(
                    (ctx,) * batch,
                    *heads,
                    q_lens=(1,),
                    page_size=p.page_size,
                    window_left=window,
                    **base,
                )
                points.append(
                    _attention(op, p, shape, series, batch, "batch", f"B={batch} ctx={ctx}")
                )
    elif op == "kvcache_store":
        for series, kv_dtype in (("bf16 cache", None), ("fp8 cache", FP8_DTYPE)):
            for tokens in (1, 16) if tiny else (1, 64, 1024, 8192):
                pages = -(-2 * tokens // p.page_size)
                shape = StoreShape(
                    tokens, p.num_kv_heads, p.head_dim, p.page_size, pages, p.dtype, kv_dtype
                )
                case = store_case(f"{p.name}-store-{series}-t{tokens}", shape, p.name)
                points.append(Point(case, series, tokens, "tokens", f"T={tokens}"))
    elif op == "moe_apply":
        for tokens in (1, 4, 16) if tiny else (1, 16, 64, 256, 1024, 4096):
            shape = MoEShape(tokens, p.num_experts, p.top_k, p.hidden_size, p.intermediate_size)
            case = moe_case(f"{p.name}-moe-m{tokens}", shape, p.name)
            points.append(Point(case, "mxfp4 x bf16", tokens, "tokens", f"M={tokens}"))
    else:
        raise ValueError(f"bench: no workloads for op {op!r}")
    return points


def _attention(op, preset, shape, series, x, xlabel, label) -> Point:
    name = f"{preset.name}-{op}-{series.replace(' ', '')}-{label.replace(' ', '-')}"
    return Point(attention_case(name, op, shape, preset.name), series, x, xlabel, label)


_BUILD = {
    "mha_prefill": build_prefill,
    "mha_extend_with_kvcache": build_extend,
    "mha_decode_with_kvcache": build_decode,
    "kvcache_store": build_store,
}


def generator_on(device: torch.device, seed: int = 0) -> torch.Generator:
    return torch.Generator(device).manual_seed(seed)


def build_inputs(case: Case, device: torch.device, seed: int = 0) -> tuple[tuple, dict]:
    """Inputs drawn directly on `device` (fast for large shapes). MoE: ((x,), routing)."""
    gen = generator_on(device, seed)
    if case.op == "moe_apply":
        x, routing = moe_inputs(case.shape, gen)
        return (x,), routing
    return _BUILD[case.op](case.shape, gen, device)


class MoEWeightsCache:
    """Checkpoint weights per MoE config, and each kernel's prepared weights, built once."""

    def __init__(self, device: torch.device):
        self.device = device
        self._weights: dict[Any, Any] = {}
        self._prepared: dict[Any, Any] = {}

    def checkpoint(self, shape: MoEShape):
        """The checkpoint-layout MoEWeights every kernel (and peer) of this config is given."""
        key = (shape.config(), shape.gain, shape.static_scales)
        if key not in self._weights:
            self._weights[key] = moe_weights(shape, generator_on(self.device, 1))
        return self._weights[key]

    def prepared(self, spec: KernelSpec, shape: MoEShape, max_tokens: int):
        weights = self.checkpoint(shape)
        pkey = (spec.name, shape.config(), shape.gain, shape.static_scales, max_tokens)
        if pkey not in self._prepared:
            plan = moe_plan_for(spec, shape.config(), max_tokens, self.device)
            self._prepared[pkey] = (plan, spec.fn.prepare_weights(plan, weights))
        return self._prepared[pkey]

    def clear(self) -> None:
        self._weights.clear()
        self._prepared.clear()


def kernel_call(
    spec: KernelSpec, case: Case, inputs, device, weights: MoEWeightsCache, max_tokens: int = 0
) -> Callable[[], None]:
    """A zero-argument call of the kernel on prebuilt inputs (outputs preallocated)."""
    args, kwargs = inputs
    if case.op != "moe_apply":
        return lambda: spec.fn(*args, **kwargs)
    plan, prepared = weights.prepared(spec, case.shape, max(max_tokens, case.shape.num_tokens))
    x = args[0]
    out = torch.empty_like(x)
    return lambda: spec.fn.apply(plan, x, prepared, out=out, **kwargs)


def _visible(lo: int, hi: int, window: int) -> int:
    """Σ over query positions p in [lo, hi) of the keys p sees: min(p + 1, W + 1), 0 if p < 0."""
    lo = max(lo, 0)
    if hi <= lo:
        return 0
    cap = hi if window < 0 else window + 1  # keys seen once a query is past the window
    ramp_end = min(hi, cap)  # queries p < cap see p + 1 keys
    ramp = (sum_to(ramp_end) - sum_to(lo)) if lo < ramp_end else 0
    return ramp + cap * max(0, hi - max(lo, cap))


def sum_to(n: int) -> int:
    """1 + 2 + ... + n."""
    return n * (n + 1) // 2


def work(case: Case, topk_ids: torch.Tensor | None = None) -> tuple[float, float]:
    """(FLOPs, bytes) of one call of `case`."""
    s = case.shape
    if case.op == "moe_apply":
        return _moe_work(s, topk_ids)
    if case.op == "kvcache_store":
        written = s.num_tokens - s.skip
        return 0.0, float(
            2 * s.num_tokens * s.num_kv_heads * s.head_dim * s.dtype.itemsize
            + 2 * written * s.num_kv_heads * s.head_dim * s.cache_dtype.itemsize
        )
    hq, hkv, d = s.num_q_heads, s.num_kv_heads, s.head_dim
    item, kv_item = s.dtype.itemsize, s.cache_dtype.itemsize
    if case.op == "mha_prefill":
        if s.causal:
            keys = sum(_visible(0, n, s.window_left) for n in s.seqlens)
        else:
            keys = sum(n * n for n in s.seqlens)
        tokens = sum(s.seqlens)
        return 4.0 * hq * d * keys, float(tokens * d * (2 * hq * item + 2 * hkv * item))
    q_lens = s.q_lens if case.op == "mha_extend_with_kvcache" else s.q_lens * len(s.seqlens)
    keys = kv_rows = 0
    for n, length in zip(q_lens, s.seqlens, strict=True):
        keys += _visible(length - n, length, s.window_left)
        first = 0 if s.window_left < 0 else max(0, length - n - s.window_left)
        kv_rows += length - first if n else 0
    tokens = sum(q_lens)
    qo = tokens * hq * d * (item + s.out_dtype.itemsize)
    return 4.0 * hq * d * keys, float(2 * kv_rows * hkv * d * kv_item + qo)


def _expert_bytes(s: MoEShape) -> float:
    h, i = s.hidden_size, s.intermediate_size
    elements = 2 * i * h + h * i
    if s.weight_format == "mxfp4":
        per = elements / 2 + elements / 32  # packed e2m1 + one e8m0 byte per 32
    elif s.weight_format == "fp8":
        per = elements + 4 * (2 * i + h)  # one float32 scale per output channel
    else:
        per = 2 * elements
    if s.has_bias:
        per += s.bias_dtype.itemsize * (2 * i + h)
    return per


def _moe_work(s: MoEShape, topk_ids: torch.Tensor | None) -> tuple[float, float]:
    m, k, h, i = s.num_tokens, s.top_k, s.hidden_size, s.intermediate_size
    flops = m * k * 2.0 * (h * 2 * i + i * h)
    if topk_ids is not None:
        experts = int(torch.unique(topk_ids).numel())
    else:  # expected distinct experts when m*k picks are spread uniformly
        experts = s.num_experts * (1 - (1 - 1 / s.num_experts) ** (m * k))
        experts = min(s.num_experts, max(math.ceil(experts), min(k, s.num_experts)))
    return flops, experts * _expert_bytes(s) + 2.0 * m * h * 2


def routing_ids(case: Case, inputs) -> torch.Tensor | None:
    """The top-k expert ids a MoE call will use (for its byte count)."""
    if case.op != "moe_apply":
        return None
    _, routing = inputs
    if routing.get("topk_ids") is not None:
        return routing["topk_ids"]
    logits = routing["router_logits"].float()
    return torch.sort(logits, dim=-1, descending=True, stable=True)[1][:, : case.shape.top_k]
