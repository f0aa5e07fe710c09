"""Public MoE operators: plan once (select the kernel), lay the weights out for it, apply.

Under torch.compile, moe_apply hands its tensors to the custom op `tokenspeed::moe_apply`
(`ops.library`) with the plan and prepared weights named by handle: `id()` of each, which
Dynamo bakes into the graph as a constant (guarding on the object), resolved through `live`.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from ... import capture, env
from ...platform import default_device, platform_of
from ...selector import explain, select
from ...validation import (
    FP8_DTYPES,
    check_device,
    check_int,
    check_scale,
    check_tensor,
    device_error,
    dtype_error,
    shape_error,
    stride_error,
    type_error,
)
from .. import index_checks
from .request import MoERequest
from .types import MoEConfig, MoEPlan, MoEWeights, PreparedMoEWeights

_BIAS_DTYPES = (torch.float32, torch.bfloat16)
_ROUTER_DTYPES = (torch.float32, torch.bfloat16)
_X_DTYPES = (torch.bfloat16,)
# Where an MoE argument's expected device comes from, for device errors.
_PLAN_DEVICE = "the plan's device"
_compiling = torch.compiler.is_compiling
# Plans and prepared weights by id(), for the custom op; weak, so a dropped layer frees its weights.
live: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()


def moe_plan(config: MoEConfig, *, device=None, max_num_tokens: int = 8192) -> MoEPlan:
    """Select the kernel for an MoE layer, up front (weights must be laid out for it)."""
    op = "moe_plan"
    if not isinstance(config, MoEConfig):
        raise TypeError(f"{op}: config is {type(config).__name__}, expected MoEConfig")
    check_int(op, "max_num_tokens", max_num_tokens, minimum=1)
    device = default_device() if device is None else check_device(op, "device", device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    request = request_for(config, max_num_tokens)
    platform = platform_of(device)
    spec = select("moe_apply", request, platform)
    padded_h, padded_i = spec.fn.padded_sizes(config)
    plan = MoEPlan(
        config,
        spec.name,
        _reason(request, platform, spec.name),
        spec.fn.weight_layout,
        padded_h,
        padded_i,
        max_num_tokens,
        device,
        spec.fn,
    )
    live[id(plan)] = plan
    return plan


def request_for(config: MoEConfig, max_num_tokens: int) -> MoERequest:
    return MoERequest(
        config.weight_format,
        config.activation_format,
        config.has_bias,
        config.routing,
        config.num_experts,
        config.top_k,
        config.hidden_size,
        config.intermediate_size,
        max_num_tokens,
        config.expert_offset,
        config.num_local_experts,
    )


def _reason(request, platform, selected: str) -> str:
    explanation = explain("moe_apply", request, platform)
    if explanation.forced:
        return f"forced ({explanation.forced})"
    if explanation.measured is not None:
        return str(explanation.measured)
    chosen = next(c for c in explanation.candidates if c.name == selected)
    passed = [
        c.name for c in explanation.candidates if not c.accepted and c.priority >= chosen.priority
    ]
    reason = f"highest priority ({chosen.priority}) that accepts on {platform.arch}"
    return reason + (f"; declined: {', '.join(passed)}" if passed else "")


def moe_prepare_weights(plan: MoEPlan, weights: MoEWeights) -> PreparedMoEWeights:
    """Lay checkpoint weights out for the plan's kernel; `weights` is never mutated."""
    op = "moe_prepare_weights"
    if not isinstance(plan, MoEPlan):
        raise TypeError(f"{op}: plan is {type(plan).__name__}, expected MoEPlan")
    if not isinstance(weights, MoEWeights):
        raise TypeError(f"{op}: weights is {type(weights).__name__}, expected MoEWeights")
    check_weights(op, plan.config, weights, plan.device)
    prepared = plan.impl.prepare_weights(plan, weights)
    if not isinstance(prepared, PreparedMoEWeights) or prepared.kernel != plan.kernel:
        raise RuntimeError(f"{op}: kernel {plan.kernel} returned weights for another kernel")
    live[id(prepared)] = prepared
    return prepared


def check_weights(op: str, config: MoEConfig, w: MoEWeights, device: torch.device) -> None:
    # Expert-parallel layers hold only their local experts.
    E, H, I = config.num_local_experts, config.hidden_size, config.intermediate_size  # noqa: E741
    fmt = config.weight_format
    if fmt == "mxfp4":
        layout = {
            "w13": ((E, 2 * I, H // 2), (torch.uint8,)),
            "w13_scale": ((E, 2 * I, H // 32), (torch.uint8,)),
            "w2": ((E, H, I // 2), (torch.uint8,)),
            "w2_scale": ((E, H, I // 32), (torch.uint8,)),
        }
    elif fmt == "fp8":
        layout = {
            "w13": ((E, 2 * I, H), FP8_DTYPES),
            "w13_scale": ((E, 2 * I), (torch.float32,)),
            "w2": ((E, H, I), FP8_DTYPES),
            "w2_scale": ((E, H), (torch.float32,)),
        }
    else:
        layout = {"w13": ((E, 2 * I, H), (torch.bfloat16,)), "w2": ((E, H, I), (torch.bfloat16,))}
    if config.has_bias:
        layout["w13_bias"] = ((E, 2 * I), _BIAS_DTYPES)
        layout["w2_bias"] = ((E, H), _BIAS_DTYPES)
    for name in ("w13", "w2", "w13_scale", "w2_scale", "w13_bias", "w2_bias"):
        value = getattr(w, name)
        if name in layout:
            shape, dtypes = layout[name]
            if value is None:
                raise ValueError(
                    f"{op}: weights.{name} is None, expected a tensor of shape "
                    f"{list(shape)} for {fmt} weights"
                )
            check_tensor(
                op,
                f"weights.{name}",
                value,
                shape=shape,
                dtypes=dtypes,
                device=device,
                device_of=_PLAN_DEVICE,
            )
        elif value is not None:
            why = "has_bias=False" if "bias" in name else f"{fmt} weights"
            raise ValueError(f"{op}: weights.{name} is a tensor, expected None with {why}")
    for name in ("w13_input_scale", "w2_input_scale"):
        value = getattr(w, name)
        if value is not None and config.activation_format != "fp8":
            raise ValueError(
                f"{op}: weights.{name} is {value}, expected None with "
                f"{config.activation_format} activations"
            )
        if value is not None:
            check_scale(op, f"weights.{name}", value)


def moe_apply(plan, x, weights, router_logits=None, *, topk_weights=None, topk_ids=None, out=None):
    """out [M, H] = Σ_e r_e (W2[e] swiglu(W13[e] x + b13[e]) + b2[e]) for x [M, H] bf16.

    Route with router_logits [M, E] (top-k, ties to the lower index, softmax over the k), or
    pass precomputed topk_weights [M, k] float32 and topk_ids [M, k] int32 instead.
    """
    routing = (router_logits, topk_weights, topk_ids)
    if _compiling():
        from .. import library

        return library.moe_apply(id(plan), x, id(weights), routing, out)
    return apply_into(plan, x, weights, routing, out)


def apply_into(plan, x, weights, routing, out):
    """Check and run moe_apply (the custom op's implementation too); `routing` =
    (router_logits, topk_weights, topk_ids)."""
    op = "moe_apply"
    if not isinstance(plan, MoEPlan):
        raise TypeError(f"{op}: plan is {type(plan).__name__}, expected MoEPlan")
    if not isinstance(weights, PreparedMoEWeights):
        raise TypeError(
            f"{op}: weights is {type(weights).__name__}, expected the "
            "PreparedMoEWeights returned by moe_prepare_weights"
        )
    # Weights prepared for this plan hold its config object: the field comparison (~0.5 us
    # per call) only runs for another plan's equal config.
    if weights.kernel != plan.kernel or (
        weights.config is not plan.config and weights.config != plan.config
    ):
        raise ValueError(f"{op}: weights do not match the plan: {_mismatch(plan, weights)}")
    config, device = plan.config, plan.device
    # check_tensor and check_contiguous_last_dim on x, out and router_logits, inlined: their
    # calls are a third of this function's cost, which every eager call pays.
    if not isinstance(x, torch.Tensor):
        raise type_error(op, "x", x, "a torch.Tensor")
    shape = x.shape
    if len(shape) != 2 or shape[1] != config.hidden_size:
        raise shape_error(op, "x", x, (None, config.hidden_size))
    if x.dtype not in _X_DTYPES:
        raise dtype_error(op, "x", x, _X_DTYPES)
    if x.device != device:
        raise device_error(op, "x", x, device, _PLAN_DEVICE)
    if not (x.is_contiguous() or x.stride(-1) == 1):
        raise stride_error(op, "x", x)
    num_tokens = shape[0]
    if num_tokens > plan.max_num_tokens:
        raise ValueError(
            f"{op}: x has {num_tokens} tokens, expected at most the plan's "
            f"max_num_tokens ({plan.max_num_tokens})"
        )
    router_logits, topk_weights, topk_ids = routing
    _check_routing(op, config, device, num_tokens, router_logits, topk_weights, topk_ids)
    if env.checked and topk_ids is not None:
        index_checks.check_moe_apply(topk_ids, config.num_experts)
    if out is None:
        out = torch.empty_like(x)
    else:
        if not isinstance(out, torch.Tensor):
            raise type_error(op, "out", out, "a torch.Tensor")
        if out.shape != shape:
            raise shape_error(op, "out", out, shape)
        if out.dtype not in _X_DTYPES:
            raise dtype_error(op, "out", out, _X_DTYPES)
        if out.device != device:
            raise device_error(op, "out", out, device, _PLAN_DEVICE)
        if not (out.is_contiguous() or out.stride(-1) == 1):
            raise stride_error(op, "out", out)
    if capture.active():
        routing = dict(router_logits=router_logits, topk_weights=topk_weights, topk_ids=topk_ids)
        capture.record(op, plan.kernel, {"x": x, **routing, **dataclasses.asdict(config)})
    plan.impl.apply(
        plan,
        x,
        weights,
        router_logits=router_logits,
        topk_weights=topk_weights,
        topk_ids=topk_ids,
        out=out,
    )
    return out


def _mismatch(plan: MoEPlan, weights: PreparedMoEWeights) -> str:
    """Which of kernel and config fields differ, with both values."""
    differences = []
    if weights.kernel != plan.kernel:
        differences.append(f"prepared for kernel {weights.kernel}, the plan uses {plan.kernel}")
    for f in dataclasses.fields(MoEConfig):
        prepared, planned = getattr(weights.config, f.name), getattr(plan.config, f.name)
        if prepared != planned:
            differences.append(
                f"config.{f.name} is {prepared!r} in the weights, {planned!r} in the plan"
            )
    return "; ".join(differences)


def _check_routing(op, config, device, num_tokens, router_logits, topk_weights, topk_ids):
    """Exactly one routing input: router_logits [M, E], or topk_weights [M, k] float32 with
    topk_ids [M, k] int32, both contiguous (kernels index them by token * top_k + j)."""
    routed = (topk_weights is not None, topk_ids is not None)
    if router_logits is not None:
        if any(routed):
            raise ValueError(
                f"{op}: router_logits and topk_weights/topk_ids are both given, "
                "expected exactly one routing input"
            )
        logits, shape = router_logits, (num_tokens, config.num_experts)
        if not isinstance(logits, torch.Tensor):
            raise type_error(op, "router_logits", logits, "a torch.Tensor")
        if logits.shape != shape:
            raise shape_error(op, "router_logits", logits, shape)
        if logits.dtype not in _ROUTER_DTYPES:
            raise dtype_error(op, "router_logits", logits, _ROUTER_DTYPES)
        if logits.device != device:
            raise device_error(op, "router_logits", logits, device, _PLAN_DEVICE)
        if not (logits.is_contiguous() or logits.stride(-1) == 1):
            raise stride_error(op, "router_logits", logits)
        return
    if not all(routed):
        raise ValueError(
            f"{op}: router_logits is None, expected router_logits or both topk_weights and topk_ids"
        )
    shape = (num_tokens, config.top_k)
    for name, t, dtype in (
        ("topk_weights", topk_weights, torch.float32),
        ("topk_ids", topk_ids, torch.int32),
    ):
        check_tensor(
            op, name, t, shape=shape, dtypes=(dtype,), device=device, device_of=_PLAN_DEVICE
        )
        if not t.is_contiguous():
            raise ValueError(f"{op}: {name} has strides {list(t.stride())}, expected contiguous")
