"""The public ops as `torch.library` custom ops in the namespace `tokenspeed`, for torch.compile.

Each public function calls the wrapper of the same name here when `torch.compiler.is_compiling()`
is true. The wrapper, traced by Dynamo, allocates what the caller did not give (`out`, and `lse`
when asked for) and calls `torch.ops.tokenspeed.<op>`, which mutates them in place and returns
nothing; its fake implementation therefore only has to accept the arguments (the shapes are
those of the tensors the wrapper allocated). At run time the op runs the public function's eager
path (`*_into`: checks, selection, kernel), so no ContextVar lookup or device query is traced.

moe_apply's plan and prepared weights are Python objects a schema cannot carry: the op takes
`id()` of each, which Dynamo turns into a constant (guarding on the object's identity), and
resolves them through `moe.api.live`, a weak registry filled by moe_plan and
moe_prepare_weights. One compiled graph per layer object is therefore the unit: a function
compiled once and called with many layers' objects recompiles per layer (compile the model).

The module registers the ops on import; the public functions import it on their first trace,
so importing tokenspeed_kernel pays nothing for it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .attention.api import _new_lse, _new_out, decode_into, extend_into, prefill_into, store_into
from .moe.api import apply_into, live

_LIB = "tokenspeed"


@torch.library.custom_op(f"{_LIB}::mha_prefill", mutates_args=("out", "lse"))
def _mha_prefill(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, causal: bool,
    window_left: int, sinks: Tensor | None, softmax_scale: float | None,
    out: Tensor, lse: Tensor | None,
) -> None:  # fmt: skip
    options = (window_left, sinks, softmax_scale, lse is not None)
    prefill_into(q, k, v, cu_seqlens, max_seqlen, causal, options, out, lse)


@torch.library.custom_op(f"{_LIB}::mha_extend_with_kvcache", mutates_args=("out", "lse"))
def _mha_extend(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens_q: Tensor, page_table: Tensor,
    cache_seqlens: Tensor, max_seqlen_q: int, window_left: int, sinks: Tensor | None,
    softmax_scale: float | None, out: Tensor, lse: Tensor | None,
    k_scale: float | None, v_scale: float | None,
) -> None:  # fmt: skip
    cache = (k_cache, v_cache, page_table, cache_seqlens)
    options = (window_left, sinks, softmax_scale, lse is not None)
    extend_into(q, (cu_seqlens_q, max_seqlen_q), cache, options, out, lse, k_scale, v_scale)


@torch.library.custom_op(f"{_LIB}::mha_decode_with_kvcache", mutates_args=("out", "lse"))
def _mha_decode(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor, cache_seqlens: Tensor,
    window_left: int, sinks: Tensor | None, softmax_scale: float | None,
    out: Tensor, lse: Tensor | None, k_scale: float | None, v_scale: float | None,
) -> None:  # fmt: skip
    cache = (k_cache, v_cache, page_table, cache_seqlens)
    options = (window_left, sinks, softmax_scale, lse is not None)
    decode_into(q, cache, options, out, lse, k_scale, v_scale)


@torch.library.custom_op(f"{_LIB}::kvcache_store", mutates_args=("k_cache", "v_cache"))
def _kvcache_store(
    k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
    k_scale: float | None, v_scale: float | None,
) -> None:  # fmt: skip
    store_into(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


@torch.library.custom_op(f"{_LIB}::moe_apply", mutates_args=("out",))
def _moe_apply(
    plan: int, x: Tensor, weights: int, router_logits: Tensor | None,
    topk_weights: Tensor | None, topk_ids: Tensor | None, out: Tensor,
) -> None:  # fmt: skip
    routing = (router_logits, topk_weights, topk_ids)
    apply_into(_resolve("plan", plan), x, _resolve("weights", weights), routing, out)


def _resolve(name: str, handle: int):
    found = live.get(handle)
    if found is None:
        raise TypeError(
            f"moe_apply: {name} was not returned by moe_plan / moe_prepare_weights "
            "(a compiled moe_apply takes only those objects)"
        )
    return found


def _shapes_only(*args, **kwargs) -> None:
    """Every op writes tensors the traced wrapper allocated: no new output to describe."""


for _op in (_mha_prefill, _mha_extend, _mha_decode, _kvcache_store, _moe_apply):
    _op.register_fake(_shapes_only)


def _outputs(q, kv_dtype, return_lse, out):
    out = _new_out(q, kv_dtype) if out is None else out
    return out, (_new_lse(q) if return_lse else None)


def mha_prefill(q, k, v, cu_seqlens, max_seqlen, causal, options, out):
    window_left, sinks, softmax_scale, return_lse = options
    out, lse = _outputs(q, q.dtype, return_lse, out)
    _mha_prefill(
        q, k, v, cu_seqlens, max_seqlen, causal, window_left, sinks, softmax_scale, out, lse
    )
    return (out, lse) if return_lse else out


def mha_extend_with_kvcache(q, ragged, cache, options, out, k_scale, v_scale):
    window_left, sinks, softmax_scale, return_lse = options
    out, lse = _outputs(q, cache[0].dtype, return_lse, out)
    _mha_extend(
        q, cache[0], cache[1], ragged[0], cache[2], cache[3], ragged[1],
        window_left, sinks, softmax_scale, out, lse, k_scale, v_scale,
    )  # fmt: skip
    return (out, lse) if return_lse else out


def mha_decode_with_kvcache(q, cache, options, out, k_scale, v_scale):
    window_left, sinks, softmax_scale, return_lse = options
    out, lse = _outputs(q, cache[0].dtype, return_lse, out)
    _mha_decode(q, *cache, window_left, sinks, softmax_scale, out, lse, k_scale, v_scale)
    return (out, lse) if return_lse else out


def kvcache_store(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    _kvcache_store(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def moe_apply(plan, x, weights, routing, out):
    out = torch.empty_like(x) if out is None else out
    _moe_apply(plan, x, weights, *routing, out)
    return out
