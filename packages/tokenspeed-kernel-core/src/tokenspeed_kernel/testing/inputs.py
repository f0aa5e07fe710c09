"""Fresh random kernel arguments for conformance cases, in the normalized form the public ops
pass to `kernel.fn` (defaults resolved, `out`/`lse` preallocated, decode q 4-D, float scales).

Everything is drawn from the generator passed in, on that generator's device: `Case.build` seeds
a CPU generator from (case name, seed) and moves the result, so a case builds the same inputs on
every machine; the benchmarks pass a GPU generator to build large inputs quickly. Outputs are
preallocated full of NaN and every cache slot no sequence owns holds large garbage: a kernel that
skips a row or reads outside its sequence shows up as an error instead of passing by luck.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from ..formats.fp8 import FP8_DTYPE
from ..ops.moe.types import MoEConfig, MoEWeights

_FP8_KV_GAIN = 2.0  # fp8 cache entries ~N(0, 2): well inside +-448, many exponents used
_GARBAGE_GAIN = 10.0  # unowned cache slots: large enough that reading one shows


class _CacheDtype:
    """The KV cache's dtype of a shape with `dtype` and an optional `kv_dtype`."""

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.dtype


@dataclass(frozen=True)
class AttentionShape(_CacheDtype):
    """Shapes and options of one attention call.

    seqlens: keys per sequence (the cache_seqlens of paged ops). q_lens: new tokens per sequence
    for extend, (Q,) for decode, unused for prefill. sinks: None, or the mean of the per-head
    sink logits (+30 makes the sink dominate unless q_gain scales the logits up to compete).
    """

    seqlens: tuple[int, ...]
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    kv_dtype: torch.dtype | None = None
    q_lens: tuple[int, ...] = ()
    page_size: int = 0
    causal: bool = True
    window_left: int = -1
    sinks: float | None = None
    sinks_dtype: torch.dtype = torch.float32
    lse: bool = False
    k_scale: float = 1.0
    v_scale: float = 1.0
    q_gain: float = 1.0

    @property
    def out_dtype(self) -> torch.dtype:
        # The contract: an FP8 cache's output is bfloat16 unless `out` is given.
        return torch.bfloat16 if self.cache_dtype == FP8_DTYPE else self.dtype


@dataclass(frozen=True)
class StoreShape(_CacheDtype):
    """kvcache_store: num_tokens new tokens into num_pages pages; `skip` of them padded (-1)."""

    num_tokens: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_pages: int
    dtype: torch.dtype = torch.bfloat16
    kv_dtype: torch.dtype | None = None
    skip: int = 0
    k_scale: float = 1.0
    v_scale: float = 1.0


# MoEShape's layer fields are MoEConfig's, so that they cannot drift apart: all but its
# `activation` (the default SwiGLU) and `routing` (here, how the inputs route).
_MOE_CONFIG_FIELDS = tuple(
    f for f in dataclasses.fields(MoEConfig) if f.name not in ("activation", "routing")
)
_MoEShapeFields = dataclasses.make_dataclass(
    "_MoEShapeFields",
    [
        ("num_tokens", int),
        *((f.name, f.type, dataclasses.field(default=f.default)) for f in _MOE_CONFIG_FIELDS),
        ("bias_dtype", torch.dtype, dataclasses.field(default=torch.float32)),
        ("routing", str, dataclasses.field(default="logits")),
        ("logits_dtype", torch.dtype, dataclasses.field(default=torch.float32)),
        ("static_scales", bool, dataclasses.field(default=False)),
        ("gain", float, dataclasses.field(default=1.0)),
    ],
    frozen=True,
)


class MoEShape(_MoEShapeFields):
    """One MoE layer call: num_tokens, then MoEConfig's num_experts, top_k, hidden_size,
    intermediate_size, weight_format, activation_format and has_bias, then the input options.
    routing: "logits", "ties" (integer logits, many equal) or "precomputed"
    (topk_weights/topk_ids). gain multiplies the weights: 4 pushes many pre-activations past
    the SwiGLU clamp (limit 7)."""

    def config(self) -> MoEConfig:
        return MoEConfig(**{f.name: getattr(self, f.name) for f in _MOE_CONFIG_FIELDS})


def generator(*parts: object) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(parts).encode()))


def _randn(gen: torch.Generator, *shape: int, gain: float = 1.0) -> torch.Tensor:
    return gain * torch.randn(*shape, generator=gen, device=gen.device)


def _randint(gen: torch.Generator, low: int, high: int, shape, dtype=torch.int64) -> torch.Tensor:
    return torch.randint(low, high, tuple(shape), generator=gen, device=gen.device, dtype=dtype)


def _randperm(gen: torch.Generator, n: int) -> torch.Tensor:
    return torch.randperm(n, generator=gen, device=gen.device)


def _nan(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _offsets(lengths) -> torch.Tensor:
    return torch.tensor(
        [0, *torch.tensor(list(lengths), dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32
    )


def _sinks(shape: AttentionShape, gen, device):
    if shape.sinks is None:
        return None
    sinks = shape.sinks + _randn(gen, shape.num_q_heads)
    return sinks.to(shape.sinks_dtype).to(device)


def _kv(shape: AttentionShape, length: int, gen) -> torch.Tensor:
    gain = _FP8_KV_GAIN if shape.cache_dtype == FP8_DTYPE else 1.0
    x = _randn(gen, length, shape.num_kv_heads, shape.head_dim, gain=gain)
    return x.to(shape.cache_dtype)


def _paged(ks, vs, page_size, gen):
    """Per-sequence K/V [L_b, Hkv, D] scattered into caches [num_pages, P, Hkv, D] through a
    shuffled page table [B, max_pages + 1] int32; spare pages, page tails and the spare
    page-table column hold garbage (valid page ids, large values)."""
    pages_per_seq = [-(-len(k) // page_size) for k in ks]
    num_pages = sum(pages_per_seq) + 2
    max_pages = max(pages_per_seq, default=0) + 1
    head_shape = tuple(ks[0].shape[1:])
    caches = [
        _randn(gen, num_pages, page_size, *head_shape, gain=_GARBAGE_GAIN).to(ks[0].dtype)
        for _ in range(2)
    ]
    page_table = _randint(gen, 0, num_pages, (len(ks), max_pages)).cpu()
    free = _randperm(gen, num_pages).tolist()
    for b, (k, v) in enumerate(zip(ks, vs, strict=True)):
        for p in range(pages_per_seq[b]):
            page = page_table[b, p] = free.pop()
            for cache, x in zip(caches, (k, v), strict=True):
                chunk = x[p * page_size : (p + 1) * page_size]
                cache[page, : len(chunk)] = chunk
    return caches[0], caches[1], page_table.to(torch.int32).to(gen.device)


def _common(shape: AttentionShape, gen, device) -> dict[str, Any]:
    return dict(
        window_left=shape.window_left,
        sinks=_sinks(shape, gen, device),
        softmax_scale=1.0 / math.sqrt(shape.head_dim),
    )


def _q(shape: AttentionShape, gen, *dims: int) -> torch.Tensor:
    return _randn(gen, *dims, shape.num_q_heads, shape.head_dim, gain=shape.q_gain).to(shape.dtype)


def build_prefill(shape: AttentionShape, gen, device):
    total = sum(shape.seqlens)
    q = _q(shape, gen, total)
    k = _randn(gen, total, shape.num_kv_heads, shape.head_dim).to(shape.dtype)
    v = _randn(gen, total, shape.num_kv_heads, shape.head_dim).to(shape.dtype)
    kwargs = dict(
        cu_seqlens=_offsets(shape.seqlens).to(device),
        max_seqlen=max(shape.seqlens, default=0),
        causal=shape.causal,
        **_common(shape, gen, device),
    )
    kwargs.update(_outputs(shape, (total, shape.num_q_heads), device))
    return (q.to(device), k.to(device), v.to(device)), kwargs


def _paged_inputs(shape: AttentionShape, gen, device):
    ks = [_kv(shape, n, gen) for n in shape.seqlens]
    vs = [_kv(shape, n, gen) for n in shape.seqlens]
    k_cache, v_cache, page_table = _paged(ks, vs, shape.page_size, gen)
    kwargs = dict(
        page_table=page_table.to(device),
        cache_seqlens=torch.tensor(shape.seqlens, dtype=torch.int32, device=device),
        **_common(shape, gen, device),
        k_scale=float(shape.k_scale),
        v_scale=float(shape.v_scale),
    )
    return k_cache.to(device), v_cache.to(device), kwargs


def build_extend(shape: AttentionShape, gen, device):
    k_cache, v_cache, kwargs = _paged_inputs(shape, gen, device)
    total = sum(shape.q_lens)
    q = _q(shape, gen, total)
    kwargs.update(
        cu_seqlens_q=_offsets(shape.q_lens).to(device), max_seqlen_q=max(shape.q_lens, default=0)
    )
    kwargs.update(_outputs(shape, (total, shape.num_q_heads), device))
    return (q.to(device), k_cache, v_cache), kwargs


def build_decode(shape: AttentionShape, gen, device):
    k_cache, v_cache, kwargs = _paged_inputs(shape, gen, device)
    batch, q_len = len(shape.seqlens), shape.q_lens[0]
    q = _q(shape, gen, batch, q_len)
    kwargs.update(_outputs(shape, (batch, q_len, shape.num_q_heads), device))
    return (q.to(device), k_cache, v_cache), kwargs


def _outputs(shape: AttentionShape, lead: tuple[int, ...], device) -> dict[str, Any]:
    out = _nan((*lead, shape.head_dim), shape.out_dtype, device)
    lse = _nan(lead, torch.float32, device) if shape.lse else None
    return dict(out=out, lse=lse)


def build_store(shape: StoreShape, gen, device):
    t, h, d = shape.num_tokens, shape.num_kv_heads, shape.head_dim
    gain = 1.0 / shape.k_scale if shape.cache_dtype == FP8_DTYPE else 1.0
    k = _randn(gen, t, h, d, gain=gain).to(shape.dtype)
    v = _randn(gen, t, h, d, gain=gain).to(shape.dtype)
    cache_shape = (shape.num_pages, shape.page_size, h, d)
    k_cache = _randn(gen, *cache_shape, gain=_GARBAGE_GAIN).to(shape.cache_dtype)
    v_cache = _randn(gen, *cache_shape, gain=_GARBAGE_GAIN).to(shape.cache_dtype)
    slots = _randperm(gen, shape.num_pages * shape.page_size)[:t]
    skipped = _randperm(gen, t)[: shape.skip]
    slots[skipped] = -1
    args = tuple(x.to(device) for x in (k, v, k_cache, v_cache))
    return args, dict(
        slot_mapping=slots.to(torch.int64).to(device),
        k_scale=float(shape.k_scale),
        v_scale=float(shape.v_scale),
    )


def _weight(fmt: str, gen, experts: int, rows: int, cols: int, gain: float):
    """One checkpoint-layout weight [E, rows, cols] with entries of std ~gain/sqrt(cols), so
    activations stay O(1) through both GEMMs. Returns (weight, scale or None)."""
    if fmt == "mxfp4":
        codes = _randint(gen, 0, 16, (experts, rows, cols), torch.uint8)
        packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
        # Random codes have RMS ~2.9; aim the e8m0 exponents at gain/sqrt(cols), +-1 octave.
        center = round(127 + math.log2(gain / (2.9 * math.sqrt(cols))))
        scales = _randint(gen, center - 1, center + 2, (experts, rows, cols // 32), torch.uint8)
        return packed, scales
    w = _randn(gen, experts, rows, cols)
    if fmt == "fp8":
        # Codes ~N(0, 64) use most of e4m3's range; per-output-channel scales bring them back.
        scale = 0.5 + torch.rand(experts, rows, generator=gen, device=gen.device)
        scale = scale * gain / (64 * math.sqrt(cols))
        return (64 * w).clamp(-448, 448).to(FP8_DTYPE), scale.to(torch.float32)
    return (w * gain / math.sqrt(cols)).to(torch.bfloat16), None


def moe_weights(shape: MoEShape, gen) -> MoEWeights:
    """Checkpoint-layout weights of `shape` on the generator's device (its local experts)."""
    e, h, i = shape.config().num_local_experts, shape.hidden_size, shape.intermediate_size
    w13, w13_scale = _weight(shape.weight_format, gen, e, 2 * i, h, shape.gain)
    # SwiGLU outputs grow with the first GEMM's gain; the second GEMM brings them back to O(1).
    w2, w2_scale = _weight(shape.weight_format, gen, e, h, i, 1.0 / shape.gain)
    biases = {}
    if shape.has_bias:
        biases = dict(
            w13_bias=_randn(gen, e, 2 * i, gain=0.5).to(shape.bias_dtype),
            w2_bias=_randn(gen, e, h, gain=0.5).to(shape.bias_dtype),
        )
    static = {}
    if shape.activation_format == "fp8" and shape.static_scales:
        # x ~ N(0, 1) peaks near 4; SwiGLU outputs reach ~20: a slightly tight first scale
        # exercises the saturating clamp on a few elements.
        static = dict(w13_input_scale=3.5 / 448, w2_input_scale=24.0 / 448)
    return MoEWeights(w13=w13, w2=w2, w13_scale=w13_scale, w2_scale=w2_scale, **biases, **static)


def moe_inputs(shape: MoEShape, gen) -> tuple[torch.Tensor, dict[str, Any]]:
    """x [M, H] bf16 and the routing keyword arguments (logits, or topk weights and ids)."""
    m, e, k = shape.num_tokens, shape.num_experts, shape.top_k
    x = _randn(gen, m, shape.hidden_size).to(torch.bfloat16)
    routing: dict[str, Any] = dict(router_logits=None, topk_weights=None, topk_ids=None)
    if shape.routing == "precomputed":
        ids = torch.stack([_randperm(gen, e)[:k] for _ in range(m)]).reshape(m, k)
        routing.update(
            topk_weights=torch.softmax(_randn(gen, m, k), dim=-1), topk_ids=ids.to(torch.int32)
        )
    elif shape.routing == "ties":
        routing.update(router_logits=_randint(gen, 0, 3, (m, e)).to(shape.logits_dtype))
    else:
        routing.update(router_logits=_randn(gen, m, e).to(shape.logits_dtype))
    return x, routing


def build_moe(shape: MoEShape, gen, device):
    """args (config, weights: MoEWeights, x [M, H] bf16); kwargs the routing inputs."""
    weights = moe_weights(shape, gen)
    weights = MoEWeights(
        **{f.name: _to(getattr(weights, f.name), device) for f in dataclasses.fields(weights)}
    )
    x, routing = moe_inputs(shape, gen)
    return (shape.config(), weights, x.to(device)), {k: _to(v, device) for k, v in routing.items()}


def _to(value, device):
    return value.to(device) if isinstance(value, torch.Tensor) else value
