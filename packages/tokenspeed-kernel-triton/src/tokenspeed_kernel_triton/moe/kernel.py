"""GPT-OSS MoE forward with the Triton kernels: route -> GEMM1 + bias + SwiGLU -> GEMM2 + bias,
routing weight -> combine. Imports no core: an engine can call `moe_forward` directly with the
tensors from `layout.prepare_weights`.
"""

from __future__ import annotations

import math

import torch

from ._common import WEIGHT_FORMAT_CODES, device_info, has_ptx_decode, interpreting, pick_config
from .combine import combine
from .grouped_gemm import grouped_gemm
from .quant import quantize_rows
from .routing import max_tiles as tile_bound
from .routing import route


def moe_forward(
    x: torch.Tensor,
    prepared: dict,
    *,
    top_k: int,
    out: torch.Tensor,
    router_logits: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    topk_ids: torch.Tensor | None = None,
    activation_format: str = "bf16",
    w13_input_scale: float | None = None,
    w2_input_scale: float | None = None,
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """out [M, H] = sum_e r_e (W2[e] swiglu(W13[e] x + b13[e]) + b2[e]) for x [M, H] bf16.

    Routing from router_logits [M, E] (top-k, ties to the lower index, softmax over the k) or
    precomputed topk_weights [M, k] float32 + topk_ids [M, k] int32. FP8 activations: static
    per-tensor input scales when given, else dynamic per-token (per pair for the second GEMM).
    """
    M = x.shape[0]
    if M == 0:
        return out
    if prepared.get("word_order") == "fragment":
        if activation_format != "bf16":
            raise ValueError(
                f"moe_forward: weights prepared in fragment order take bf16 activations, got "
                f"{activation_format}"
            )
        return _forward_fragment(
            x, prepared, top_k, out, router_logits, topk_weights, topk_ids, alpha, limit
        )
    info = device_info(x.device)
    config = pick_config(M * top_k, info)
    ptx_decode = has_ptx_decode(info)
    routing = _route(prepared, top_k, config.block_m, router_logits, topk_weights, topk_ids)
    w_format = WEIGHT_FORMAT_CODES[prepared["weight_format"]]
    H = prepared["hidden_size"]
    Ip = prepared["padded_intermediate_size"]
    interpreted = interpreting()
    fp8 = activation_format == "fp8"
    a_in, a_in_scale = quantize_rows(x, w13_input_scale) if fp8 else (x, None)
    # SwiGLU rows: bf16 [hi | lo] halves (the reference's float32 intermediate, read by GEMM2
    # without conversions); FP8 straight from the epilogue with a static scale; float32 for a
    # dynamic FP8 scale, which needs each row's amax first.
    rows = routing[4] * config.block_m  # the tile-count bound
    if not fp8:
        act = torch.empty(rows, 2 * Ip, dtype=torch.bfloat16, device=x.device)
    elif w2_input_scale is not None:
        act = torch.empty(rows, Ip, dtype=torch.float8_e4m3fn, device=x.device)
    else:
        act = torch.empty(rows, Ip, dtype=torch.float32, device=x.device)
    grouped_gemm(
        a_in,
        a_in_scale,
        prepared["w13"],
        prepared["w13_scale"],
        prepared["w13_bias"],
        act,
        routing,
        w_format=w_format,
        gemm1=True,
        k_valid=H,
        n_valid=2 * Ip,
        config=config,
        interpreted=interpreted,
        ptx_decode=ptx_decode,
        out_scale=w2_input_scale if fp8 else None,
        alpha=alpha,
        limit=limit,
    )
    act_scale = w2_input_scale if fp8 else None
    if fp8 and w2_input_scale is None:
        act, act_scale = quantize_rows(act, None)
    y = torch.empty(M * top_k, H, dtype=torch.float32, device=x.device)
    grouped_gemm(
        act,
        act_scale,
        prepared["w2"],
        prepared["w2_scale"],
        prepared["w2_bias"],
        y,
        routing,
        w_format=w_format,
        gemm1=False,
        k_valid=Ip,
        n_valid=H,
        config=config,
        interpreted=interpreted,
        ptx_decode=ptx_decode,
    )
    combine(y, out, top_k=top_k)
    return out


def _route(
    prepared,
    top_k,
    block_m,
    router_logits,
    topk_weights,
    topk_ids,
    pdl=False,
    ready=None,
    prescale=None,
) -> tuple:
    """routing.route for the grouped GEMMs: (weights, sorted pairs, tiles, tile count on the
    device, tile-count bound, top_k). pdl: the router lets GEMM1 start early; ready: the
    GEMMs' per-tile counters, which it zeroes (wgmma_gemm.fragment_gemm); prescale: x's rows
    scaled for the post-scaled GEMM1 (routing.route)."""
    weights, _, sorted_pairs, tiles, num_tiles, max_tiles = route(
        router_logits,
        topk_weights,
        topk_ids,
        top_k=top_k,
        num_experts=prepared["num_experts"],
        block_m=block_m,
        launch_dependents=pdl,
        ready=ready,
        prescale=prescale,
    )
    return weights, sorted_pairs, tiles, num_tiles, max_tiles, top_k


def _forward_fragment(x, prepared, top_k, out, router_logits, topk_weights, topk_ids, alpha, limit):
    """moe_forward on Hopper with weights prepared in fragment order (bf16 activations)."""
    from .fragment_config import gemm2_splits, pick_fragment_config
    from .wgmma_gemm import fragment_gemm

    # The SwiGLU intermediate: fp16 where prepare_weights laid w2 out to decode to fp16 (one MMA
    # per K step, and as accurate as bf16 hi + lo: scripts/moe_intermediate_precision.py); else
    # bf16 [hi | lo] halves.
    f16_intermediate = prepared["w2_decode"] == "fp16"
    if f16_intermediate and not swiglu_fits_f16(alpha, limit):
        raise ValueError(
            f"moe_forward: the weights were prepared for an fp16 SwiGLU intermediate, which "
            f"alpha={alpha}, limit={limit} do not bound; prepare them with "
            f"f16_intermediate=False"
        )
    M = x.shape[0]
    # Post-scaling needs raw shift-decoded halves in both GEMMs.
    post_scalable = prepared["w13_decode"] == "bf16" and f16_intermediate
    config = pick_fragment_config(M * top_k, post_scalable)
    prescale = None
    if config.post_scale:
        # GEMM1 multiplies x's rows scaled up by powers of two (the router writes them).
        prescale = (x, torch.empty_like(x), torch.empty(M, dtype=torch.int32, device=x.device))
    # Programmatic dependent launch (config.pdl): each kernel after the router starts its CTAs
    # while the previous one finishes; with tile_ready GEMM2 waits for GEMM1's rows tile by
    # tile through `ready`, zeroed by the router (wgmma_gemm.py).
    ready = None
    if config.tile_ready:
        bound = tile_bound(M * top_k, prepared["num_experts"], config.block_t)
        ready = torch.empty(bound, dtype=torch.int32, device=x.device)
    routing = _route(
        prepared,
        top_k,
        config.block_t,
        router_logits,
        topk_weights,
        topk_ids,
        config.pdl,
        ready,
        prescale,
    )
    H = prepared["hidden_size"]
    I = prepared["intermediate_size"]  # noqa: E741
    Ip = prepared["padded_intermediate_size"]
    rows = routing[4] * config.block_t  # the tile-count bound
    if f16_intermediate:
        act = torch.empty(rows, Ip, dtype=torch.float16, device=x.device)
    else:
        act = torch.empty(rows, 2 * Ip, dtype=torch.bfloat16, device=x.device)
    fragment_gemm(
        x if prescale is None else prescale[1],
        prepared["w13"],
        prepared["w13_scale"],
        prepared["w13_bias"],
        act,
        routing,
        gemm1=True,
        decode=prepared["w13_decode"],
        k_valid=H,
        n_valid=2 * I,
        config=config,
        ready=ready,
        x_exp=None if prescale is None else prescale[2],
        alpha=alpha,
        limit=limit,
    )
    splits = gemm2_splits(config.gemm2_split_k, Ip)
    y = torch.empty(M * top_k * splits, H, dtype=torch.float32, device=x.device)
    fragment_gemm(
        act,
        prepared["w2"],
        prepared["w2_scale"],
        prepared["w2_bias"],
        y,
        routing,
        gemm1=False,
        decode=prepared["w2_decode"],
        k_valid=I,  # GEMM1 wrote channels up to I only; the rest are zero-filled
        n_valid=H,
        config=config,
        split_k=splits,
        ready=ready,
        ready_target=-(-2 * I // config.block_w),  # GEMM1's CTAs per tile
    )
    # A token's rows: its top_k pairs, each in `splits` consecutive partial rows.
    combine(y, out, top_k=top_k * splits, pdl=config.pdl)
    return out


def swiglu_fits_f16(alpha: float, limit: float) -> bool:
    """Whether |min(g, limit) * sigmoid(alpha * g) * (clamp(u, -limit, limit) + 1)| stays
    below fp16's max for every g, u: the gate factor is at most max(limit, 0.2785 / alpha)
    in size (g * sigmoid(alpha * g) >= -0.2785 / alpha), the up factor at most limit + 1."""
    if not (alpha > 0 and 0 <= limit < math.inf):
        return False
    return max(limit, 0.2785 / alpha) * (limit + 1) < 60000
