"""transformers' GPT-OSS on tokenspeed-kernel ops (transformers 5.x).

    from tokenspeed_kernel.integrations import transformers as tk_hf
    tk_hf.register()            # once: the name "tokenspeed" for attention, masks and experts
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation="tokenspeed",
        experts_implementation="tokenspeed")

or, for a model already loaded, `tk_hf.enable(model)` (registers, switches both
implementations, lays the experts out for the selected MoE kernel now instead of on first use).

Attention (`attention_forward`, registered with `AttentionInterface`): sinks (`s_aux`), sliding
windows (`sliding_window` W means `window_left = W - 1`), GQA, `scaling`. What it serves:
- no cached keys (query length = key length): `mha_prefill`; rows of a batch are separate
  sequences; left- or right-padded rows (a 2-D padding mask whose kept tokens are one run per
  row) are packed before the op, padded query rows come back as zeros; positions that restart
  inside a row (`position_ids` of packed sequences, as transformers detects them) split it into
  sequences; `cu_seq_lens_q` from a padding-free collator is used as given.
- cached keys (query length < key length, transformers' dynamic or sliding-window cache): the
  queries are the last positions of their row. transformers keeps K/V as [B, Hkv, K, D]; the ops
  read a paged [pages, P, Hkv, D] cache, so each call lays the layer's K/V out in pages of 64
  tokens (one copy of K and V, the traffic eager attention spends on `repeat_kv`), then runs
  `mha_decode_with_kvcache` (one new token) or `mha_extend_with_kvcache`. Left-padded batches
  are served (kept keys a suffix of each row); anything else raises `ValueError` naming it, as
  do static caches (key length beyond the mask), fp32 activations and dropout in training.

Experts (`experts_forward`, registered with `ExpertsInterface`): GPT-OSS experts (gate/up rows
interleaved, biases, clamped SwiGLU with the module's alpha and limit) through `moe_plan` /
`moe_prepare_weights` / `moe_apply` with transformers' routing (its top-k ids and softmax
weights). transformers dequantizes a GPT-OSS MXFP4 checkpoint to bf16 where its own MXFP4
kernels are absent (CPU; GPUs without the `kernels` package); `weight_format="auto"` quantizes
those weights back with `formats.quantize_mxfp4` and keeps MXFP4 only if that round trip
reproduces every value exactly (it does for weights that came from MXFP4: each block's scale is
recovered), else serves bf16 weights unchanged. Inference only: weights are laid out once per
device and re-laid out if the parameters change.
"""

from __future__ import annotations

import threading

import torch

from ..formats.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from ..ops.attention import mha_decode_with_kvcache, mha_extend_with_kvcache, mha_prefill
from ..ops.moe import MoEConfig, MoEWeights, SwiGLU, moe_apply, moe_plan, moe_prepare_weights

__all__ = [
    "IMPLEMENTATION",
    "PAGE_SIZE",
    "attention_forward",
    "enable",
    "experts_forward",
    "mask_forward",
    "prepare_experts",
    "register",
]

IMPLEMENTATION = "tokenspeed"
# Page size of the paged view of transformers' cache: one of the sizes every decode kernel
# declares, large enough that the page table stays small at long contexts.
PAGE_SIZE = 64
WEIGHT_FORMATS = ("auto", "mxfp4", "bf16")
_HALF = (torch.bfloat16, torch.float16)
_register_lock = threading.Lock()
_registered = False


def register() -> None:
    """Register "tokenspeed" with transformers' attention, attention-mask and experts interfaces
    (idempotent). After it, `from_pretrained(..., attn_implementation="tokenspeed",
    experts_implementation="tokenspeed")` runs GPT-OSS on tokenspeed ops."""
    global _registered
    with _register_lock:
        if _registered:
            return
        from transformers import AttentionInterface
        from transformers.integrations.moe import ExpertsInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(IMPLEMENTATION, attention_forward)
        AttentionMaskInterface.register(IMPLEMENTATION, mask_forward)
        ExpertsInterface.register(IMPLEMENTATION, experts_forward)
        _registered = True


def enable(model, *, weight_format: str = "auto", max_num_tokens: int = 8192):
    """Register, switch `model` to tokenspeed attention and experts, and prepare every GPT-OSS
    experts module's weights now (on the device they are on). Returns `model`."""
    _check_weight_format("enable", weight_format)
    register()
    _refuse_mxfp4_modules(model)
    model.set_attn_implementation(IMPLEMENTATION)
    model.set_experts_implementation(IMPLEMENTATION)
    for module in model.modules():
        if _is_experts(module):
            prepare_experts(module, weight_format=weight_format, max_num_tokens=max_num_tokens)
    return model


# ---------------------------------------------------------------------------------------------
# Attention


def mask_forward(
    batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
    attention_mask=None, **kwargs,
):  # fmt: skip
    """The mask transformers builds for "tokenspeed": None when no token is padded, else the
    2-D padding mask [B, kv_length] (bool) of the keys; causality and windows are the ops'."""
    if attention_mask is None:
        return None
    mask = attention_mask[:, -kv_length:]
    if mask.shape[-1] == kv_length and bool(mask.all()):
        return None
    return mask


def attention_forward(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0,
    sliding_window=None, s_aux=None, **kwargs,
):  # fmt: skip
    """transformers' attention-interface call: query [B, Hq, S, D], key/value [B, Hkv, K, D]
    (K includes the cached keys). Returns (out [B, S, Hq, D], None)."""
    fn = "tokenspeed attention"
    if dropout and module.training:
        raise ValueError(f"{fn}: dropout is {dropout} in training, expected 0 (inference only)")
    if query.dtype not in _HALF:
        raise ValueError(
            f"{fn}: activations are {query.dtype}, expected bfloat16 or float16 (load the "
            "model with dtype=torch.bfloat16)"
        )
    batch, num_q_heads, q_len, head_dim = query.shape
    k_len = key.shape[2]
    if q_len > k_len:
        raise ValueError(f"{fn}: {q_len} queries over {k_len} keys, expected at most as many")
    sinks = s_aux if s_aux is not None else getattr(module, "sinks", None)
    if sinks is not None and sinks.dtype not in (torch.float32, torch.bfloat16):
        sinks = sinks.float()
    options = dict(
        window_left=sliding_window - 1 if sliding_window else -1,
        sinks=None if sinks is None else sinks.contiguous(),
        softmax_scale=scaling,
    )
    mask = _padding_mask(fn, attention_mask, batch, k_len)
    if q_len == k_len:
        out = _prefill(query, key, value, mask, kwargs, options)
    else:
        out = _cached(fn, query, key, value, mask, options)
    return out.view(batch, q_len, num_q_heads, head_dim), None


def _padding_mask(fn, attention_mask, batch, k_len):
    """The bool padding mask [B, K], or None when every key is kept."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise ValueError(
            f"{fn}: attention_mask has {attention_mask.dim()} dimensions, expected the 2-D "
            f'padding mask of the "{IMPLEMENTATION}" mask function (a custom 4-D mask cannot '
            "be expressed as causal/window attention)"
        )
    if tuple(attention_mask.shape) != (batch, k_len):
        raise ValueError(
            f"{fn}: attention_mask has shape {list(attention_mask.shape)}, expected "
            f"[{batch}, {k_len}] (static caches, whose buffers outrun the mask, are unsupported: "
            "use the default dynamic cache)"
        )
    return attention_mask.bool()


def _tokens_major(x):
    """[B, H, S, D] -> [B*S, H, D] contiguous."""
    batch, heads, seq, dim = x.shape
    return x.transpose(1, 2).reshape(batch * seq, heads, dim)


def _prefill(query, key, value, mask, kwargs, options):
    batch, num_q_heads, seq, head_dim = query.shape
    q, k, v = _tokens_major(query), _tokens_major(key), _tokens_major(value)
    device = q.device
    if mask is None:
        cu_seqlens = kwargs.get("cu_seq_lens_q")
        if cu_seqlens is not None and batch == 1:
            cu_seqlens = cu_seqlens.to(device=device, dtype=torch.int32)
            max_seqlen = int(kwargs.get("max_length_q") or seq)
        else:
            cu_seqlens, max_seqlen = _row_sequences(kwargs.get("position_ids"), batch, seq, device)
        return mha_prefill(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, **options)
    kept = mask.reshape(-1)
    _check_one_run_per_row("tokenspeed attention", mask, suffix=False)
    lengths = mask.sum(dim=1, dtype=torch.int32)
    cu_seqlens = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    torch.cumsum(lengths, 0, out=cu_seqlens[1:])
    index = kept.nonzero().squeeze(1)
    packed = mha_prefill(
        q[index], k[index], v[index],
        cu_seqlens=cu_seqlens, max_seqlen=int(lengths.max()), **options,
    )  # fmt: skip
    out = q.new_zeros(q.shape)
    out[index] = packed
    return out


def _row_sequences(position_ids, batch, seq, device):
    """cu_seqlens over the rows, split where positions restart (packed sequences, found as
    transformers' `find_packed_sequence_indices` finds them: a step other than +1)."""
    rows = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=device)
    if position_ids is None or seq == 1:
        return rows, seq
    positions = position_ids.expand(batch, seq)
    restart = torch.diff(positions, dim=1) != 1
    if not bool(restart.any()):
        return rows, seq
    starts = torch.zeros(batch, seq, dtype=torch.bool, device=device)
    starts[:, 0] = True
    starts[:, 1:] = restart
    begin = starts.reshape(-1).nonzero().squeeze(1).to(torch.int32)
    end = torch.tensor([batch * seq], dtype=torch.int32, device=device)
    cu_seqlens = torch.cat((begin, end))
    return cu_seqlens, int(torch.diff(cu_seqlens).max())


def _check_one_run_per_row(fn, mask, *, suffix):
    """Kept tokens must form at most one run per row (with `suffix`, one that ends the row):
    other patterns are not causal attention over contiguous positions."""
    kept = mask.to(torch.int8)
    runs = kept[:, 0] + (torch.diff(kept, dim=1) == 1).sum(dim=1)
    bad = runs > 1
    what = "one run of kept tokens per row (left or right padding)"
    if suffix:
        bad |= kept[:, -1] == 0
        what = "left padding (the kept keys end each row)"
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"{fn}: attention_mask row {row} is {mask[row].int().tolist()}, expected {what}"
        )


def _cached(fn, query, key, value, mask, options):
    """Queries are the last q_len positions of their row; keys are laid out in pages."""
    batch, num_q_heads, q_len, head_dim = query.shape
    num_kv_heads, k_len = key.shape[1], key.shape[2]
    device = query.device
    pages_per_row = -(-k_len // PAGE_SIZE)
    shape = (batch, pages_per_row * PAGE_SIZE, num_kv_heads, head_dim)
    k_cache = key.new_empty(shape)
    v_cache = value.new_empty(shape)
    if mask is None:
        k_cache[:, :k_len] = key.transpose(1, 2)
        v_cache[:, :k_len] = value.transpose(1, 2)
        cache_seqlens = torch.full((batch,), k_len, dtype=torch.int32, device=device)
    else:
        _check_one_run_per_row(fn, mask, suffix=True)
        lengths = mask.sum(dim=1)
        if bool((lengths < q_len).any()):
            raise ValueError(
                f"{fn}: attention_mask keeps fewer keys than the {q_len} new tokens in some row, "
                "expected the new tokens kept (left padding)"
            )
        # Row b's kept keys start at K - lengths[b]: move them to position 0 of its pages.
        start = (k_len - lengths).unsqueeze(1)
        source = (start + torch.arange(k_len, device=device)).clamp_(max=k_len - 1)
        rows = torch.arange(batch, device=device).unsqueeze(1)
        k_cache[:, :k_len] = key.transpose(1, 2)[rows, source]
        v_cache[:, :k_len] = value.transpose(1, 2)[rows, source]
        cache_seqlens = lengths.to(torch.int32)
    k_cache = k_cache.view(-1, PAGE_SIZE, num_kv_heads, head_dim)
    v_cache = v_cache.view(-1, PAGE_SIZE, num_kv_heads, head_dim)
    page_table = torch.arange(batch * pages_per_row, dtype=torch.int32, device=device).view(
        batch, pages_per_row
    )
    cache = dict(page_table=page_table, cache_seqlens=cache_seqlens)
    if q_len == 1:
        q = query[:, :, 0, :].contiguous()
        return mha_decode_with_kvcache(q, k_cache, v_cache, **cache, **options)
    q = _tokens_major(query)
    cu_seqlens_q = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=device)
    return mha_extend_with_kvcache(
        q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=q_len, **cache, **options
    )


# ---------------------------------------------------------------------------------------------
# Experts


def _is_experts(module) -> bool:
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    return isinstance(module, GptOssExperts)


def _refuse_mxfp4_modules(model) -> None:
    """transformers' own MXFP4 experts (its Triton-kernel path) hold weights in a swizzled
    layout and do not dispatch through the experts interface: say how to load instead."""
    for name, module in model.named_modules():
        if type(module).__name__ == "Mxfp4GptOssExperts":
            raise ValueError(
                f"enable: {name} is transformers' Mxfp4GptOssExperts, expected GptOssExperts: "
                "load with quantization_config=Mxfp4Config(dequantize=True); tokenspeed "
                "quantizes those weights back to MXFP4 exactly"
            )


def _check_weight_format(fn, weight_format):
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(
            f"{fn}: weight_format is {weight_format!r}, expected one of {', '.join(WEIGHT_FORMATS)}"
        )


def _check_gpt_oss_experts(fn, module) -> None:
    layout = (
        getattr(module, "is_concatenated", True),
        getattr(module, "is_transposed", False),
        getattr(module, "has_bias", False),
    )
    if layout != (False, True, True) or not hasattr(module, "limit"):
        raise TypeError(
            f"{fn}: {type(module).__name__} is not a GPT-OSS experts module (interleaved "
            "gate/up, [E, H, 2I] weights, biases, clamped SwiGLU), the only one tokenspeed serves"
        )


def _source_key(module, device):
    params = (module.gate_up_proj, module.down_proj)
    params += (module.gate_up_proj_bias, module.down_proj_bias)
    return (device, *((p.data_ptr(), p._version) for p in params))


def prepare_experts(module, *, weight_format="auto", max_num_tokens=8192, device=None):
    """Plan and lay out `module`'s (GptOssExperts) weights on `device` (default: theirs);
    kept on the module for `experts_forward`. Returns the MoEPlan."""
    fn = "prepare_experts"
    _check_gpt_oss_experts(fn, module)
    _check_weight_format(fn, weight_format)
    device = module.gate_up_proj.device if device is None else torch.device(device)
    gate_up = module.gate_up_proj.detach().to(device).transpose(1, 2)  # [E, 2I, H]
    down = module.down_proj.detach().to(device).transpose(1, 2)  # [E, H, I]
    num_experts, hidden = gate_up.shape[0], gate_up.shape[2]
    intermediate = down.shape[2]
    fmt = weight_format
    if fmt in ("auto", "mxfp4"):
        w13, w13_scale, exact13 = _mxfp4_per_expert(gate_up)
        w2, w2_scale, exact2 = _mxfp4_per_expert(down)
        if fmt == "auto":
            fmt = "mxfp4" if exact13 and exact2 else "bf16"
    if fmt == "bf16":
        w13, w2 = gate_up.to(torch.bfloat16).contiguous(), down.to(torch.bfloat16).contiguous()
        w13_scale = w2_scale = None
    config = MoEConfig(
        num_experts=num_experts,
        top_k=int(module.config.num_experts_per_tok),
        hidden_size=hidden,
        intermediate_size=intermediate,
        weight_format=fmt,
        activation=SwiGLU(alpha=float(getattr(module, "alpha", 1.702)), limit=float(module.limit)),
        has_bias=True,
    )
    plan = moe_plan(config, device=device, max_num_tokens=max_num_tokens)
    weights = MoEWeights(
        w13=w13, w2=w2, w13_scale=w13_scale, w2_scale=w2_scale,
        w13_bias=_bias(module.gate_up_proj_bias, device),
        w2_bias=_bias(module.down_proj_bias, device),
    )  # fmt: skip
    prepared = moe_prepare_weights(plan, weights)
    module._tokenspeed_moe = (_source_key(module, device), plan, prepared)
    return plan


def _bias(bias, device):
    bias = bias.detach().to(device)
    return bias if bias.dtype in (torch.float32, torch.bfloat16) else bias.float()


def _mxfp4_per_expert(w):
    """MXFP4 of w [E, N, K] one expert at a time (bounded float32 temporaries), and whether
    dequantizing gives w back exactly."""
    packed = torch.empty(*w.shape[:2], w.shape[2] // 2, dtype=torch.uint8, device=w.device)
    scales = torch.empty(*w.shape[:2], w.shape[2] // 32, dtype=torch.uint8, device=w.device)
    exact = True
    for e in range(w.shape[0]):
        source = w[e].float()
        packed[e], scales[e] = quantize_mxfp4(source)
        exact = exact and torch.equal(dequantize_mxfp4(packed[e], scales[e]), source)
    return packed, scales, exact


def experts_forward(module, hidden_states, top_k_index, top_k_weights):
    """transformers' experts call: hidden_states [N, H] bf16, top_k_index [N, k] expert ids,
    top_k_weights [N, k] routing weights. Returns [N, H]."""
    fn = "tokenspeed experts"
    if hidden_states.dtype != torch.bfloat16:
        raise ValueError(
            f"{fn}: hidden_states are {hidden_states.dtype}, expected bfloat16 (load the model "
            "with dtype=torch.bfloat16)"
        )
    state = getattr(module, "_tokenspeed_moe", None)
    if state is None or state[0] != _source_key(module, hidden_states.device):
        prepare_experts(module, device=hidden_states.device)
        state = module._tokenspeed_moe
    _, plan, prepared = state
    x = hidden_states.contiguous()
    ids = top_k_index.to(torch.int32).contiguous()
    weights = top_k_weights.to(torch.float32).contiguous()
    out = torch.empty_like(x)
    step = plan.max_num_tokens
    for start in range(0, x.shape[0], step):
        end = start + step
        moe_apply(
            plan, x[start:end], prepared,
            topk_weights=weights[start:end], topk_ids=ids[start:end], out=out[start:end],
        )  # fmt: skip
    return out
