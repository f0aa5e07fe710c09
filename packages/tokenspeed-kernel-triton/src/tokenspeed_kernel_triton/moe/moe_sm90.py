"""The Hopper Gluon MoE kernel (`triton.moe_apply.sm90`, sm_90 only: Blackwell has no wgmma):
MXFP4 weights decoded straight into wgmma register fragments (wgmma_gemm_sm90.py), bf16 or fp8
activations (GEMM1: e4m3 values in bf16 operands; GEMM2: e4m3 rows against w2 as e4m3
fragments, FP8 MMAs; their scales on the accumulators). route ->
GEMM1 + bias + SwiGLU -> GEMM2 + bias, routing weight -> combine, with programmatic dependent
launch from GEMM1 on (fragment_config_sm90.CONFIGS).
"""

from __future__ import annotations

import torch

from tokenspeed_kernel.registry import Support, register_kernel
from tokenspeed_kernel.toolchain import triton_support
from tokenspeed_kernel.tuning import first_match, pinned_config

from ._common import layer_experts, route_for_gemms, selection_pairs, swiglu_fits_f16
from .combine import combine
from .fragment_config_sm90 import (
    CONFIGS,
    FragmentConfig,
    for_layer,
    gemm2_splits,
    grid_wait,
    half_pair_rows,
    half_pair_rows_bound,
    scaled_fragments,
)
from .layout import PaddedMoEKernel
from .quant import quantize_rows
from .routing import max_tiles
from .wgmma_gemm_sm90 import fragment_gemm
from .workspace import scratch

KERNEL_NAME = "triton.moe_apply.sm90"
WEIGHT_LAYOUT = "triton-mx4fragment-padded"


def pick_config(num_pairs: int, post_scalable: bool = True) -> FragmentConfig:
    """The tile config for `num_pairs` = tokens x top_k (or the pinned one,
    `tuning.pin_config(KERNEL_NAME, config)`). post_scalable: whether the weights allow
    post-scaling (shift-decoded, fp16 intermediate); where not, a post-scaled pick becomes its
    scaled-fragment form."""
    config = pinned_config(KERNEL_NAME)
    if config is None:
        config = first_match(CONFIGS, num_pairs)
    if config.post_scale and not post_scalable:
        return scaled_fragments(config)
    return config


def moe_forward_sm90(
    x: torch.Tensor,
    prepared: dict,
    *,
    top_k: int,
    out: torch.Tensor,
    activation_format: str = "bf16",
    w13_input_scale: float | None = None,
    w2_input_scale: float | None = None,
    alpha: float = 1.702,
    limit: float = 7.0,
    expert_offset: int = 0,
    num_experts: int | None = None,
    **routing_inputs,
) -> torch.Tensor:
    """moe_forward (moe.py, the same routing_inputs, expert_offset and FP8 activations) on
    Hopper for x [M, H] bf16 and weights prepared in fragment order
    (layout.prepare_weights(..., word_order="fragment")). FP8 activations: x and the SwiGLU
    intermediate are quantized to e4m3 as moe.py's are (static per-tensor scales when given,
    else per token / per pair row), x's values stored exactly in GEMM1's bf16 operand, the
    SwiGLU rows' in e4m3 for GEMM2's FP8 MMAs where w2 was prepared as e4m3 fragments (else in
    GEMM2's half type), their scales applied to the accumulators. num_experts: the layer's
    experts across all ranks (None: `layer_experts`), which sets an expert-parallel rank's
    tiles (selection_pairs)."""
    # The SwiGLU intermediate: fp16 where prepare_weights laid w2 out to decode to fp16 (one MMA
    # per K step, and as accurate as bf16 hi + lo); else bf16 [hi | lo] halves.
    M = x.shape[0]
    if M == 0:
        return out
    fp8 = activation_format == "fp8"
    # w2 as e4m3 fragments (prepared for fp8 activations where every w2 row fits): GEMM2's
    # FP8 MMAs on e4m3 SwiGLU rows written at their MMA positions (e4m3_fragments_sm90).
    # GEMM1 keeps half-precision operands: its exact sums round the intermediate to e4m3 as
    # the reference does, where FP8 MMAs' sums would move some of those roundings.
    e4m3 = prepared["w2_decode"] == "e4m3"
    if e4m3 and not fp8:
        raise ValueError(
            "moe_forward_sm90: w2 was prepared as e4m3 fragments, which take fp8 activations"
        )
    f16_intermediate = prepared["w2_decode"] == "fp16"
    if f16_intermediate and not swiglu_fits_f16(alpha, limit):
        raise ValueError(
            f"moe_forward_sm90: the weights were prepared for an fp16 SwiGLU intermediate, "
            f"which alpha={alpha}, limit={limit} do not bound; prepare them with "
            f"f16_intermediate=False"
        )
    # Post-scaling needs raw shift-decoded halves in both GEMMs, or in GEMM1 beside e4m3 w2
    # (fragment_gemm runs a post-scaled config's GEMM2 on it as scaled fragments).
    post_scalable = prepared["w13_decode"] == "bf16" and (f16_intermediate or e4m3)
    Ip = prepared["padded_intermediate_size"]
    if num_experts is None:
        num_experts = layer_experts(prepared, routing_inputs.get("router_logits"), expert_offset)
    pairs = selection_pairs(M, top_k, prepared["num_experts"], num_experts)
    config = for_layer(pick_config(pairs, post_scalable), Ip, prepared["num_experts"])
    routing_inputs = dict(routing_inputs, expert_offset=expert_offset)
    # With a static intermediate scale GEMM1 quantizes its own SwiGLU rows; per-row scales
    # need whole rows, which a pass quantizes between the GEMMs (GEMM2 then waits for it,
    # not for GEMM1's tiles).
    act_pass = fp8 and w2_input_scale is None
    x_scale = None
    if fp8:
        config = grid_wait(config) if act_pass else config
        if config.post_scale:
            # The one-program router quantizes x's rows as it scales them (no launch of
            # their own before it).
            x_scale = w13_input_scale
            if x_scale is None:
                x_scale = scratch("x_scale", (M,), torch.float32, x.device)
        else:
            x, x_scale = quantize_rows(x, w13_input_scale, "x", values_as=torch.bfloat16)
    quant = (w13_input_scale, None if w13_input_scale is not None else x_scale) if fp8 else None
    routing, ids_to_check, ready, narrow, x_exp, x_in = _route(
        x, prepared, top_k, config, routing_inputs, quant
    )
    H, I = prepared["hidden_size"], prepared["intermediate_size"]  # noqa: E741
    rows = routing[4] * config.block_t  # the tile-count bound
    if e4m3:
        act = scratch("act", (rows, Ip), torch.float8_e4m3fn, x.device)
    elif f16_intermediate:
        act = scratch("act", (rows, Ip), torch.float16, x.device)
    else:
        act = scratch("act", (rows, 2 * Ip), torch.bfloat16, x.device)
    # For the pass GEMM1 writes float32 rows, quantized into act below.
    act32 = scratch("act32", (rows, Ip), torch.float32, x.device) if act_pass else act
    common = dict(config=config, ready=ready, narrow_tiles=narrow[0], full_tiles=narrow[1])
    w13 = (prepared["w13"], prepared["w13_scale"], prepared["w13_bias"])
    # GEMM1 writes channels up to I; with e4m3 rows written in place (a static scale) it
    # computes the zero padding's rows too, whose zeros GEMM2's e4m3 copies read (a channel's
    # MMA position is not in a copy's K order).
    gemm1_rows = 2 * Ip if e4m3 and not act_pass else 2 * I
    fragment_gemm(
        x_in,
        *w13,
        act32,
        routing,
        gemm1=True,
        decode=prepared["w13_decode"],
        k_valid=H,
        n_valid=gemm1_rows,
        x_exp=x_exp,
        in_scale=x_scale,
        out_scale=w2_input_scale if fp8 and not act_pass else None,
        alpha=alpha,
        limit=limit,
        **common,
    )
    act_scale = w2_input_scale if fp8 else None
    if act_pass:
        # e4m3 values in the intermediate's half type (bf16 [hi | lo]: hi, lo zeroed).
        tiles = (routing[2], routing[3], config.block_t)
        lo_offset = 0 if f16_intermediate else Ip
        _, act_scale = quantize_rows(
            act32[:, :I], w2_input_scale, "act", tiles, into=act,
            lo_offset=0 if e4m3 else lo_offset, pdl=config.pdl, mma_order=e4m3,
        )  # fmt: skip
    splits = gemm2_splits(config.gemm2_split_k, Ip)
    y = scratch("y", (M * top_k * splits, H), torch.float32, x.device)
    w2 = (prepared["w2"], prepared["w2_scale"], prepared["w2_bias"])
    half_rows = {}
    if half_pair_rows(config, Ip, splits):
        y16 = scratch("y16", tuple(y.shape), torch.float16, x.device)
        half_rows = dict(wide=y, half_bound=half_pair_rows_bound(top_k))
        y = y16
    # GEMM1 wrote channels up to I only (k_valid); the rest are zero-filled. ready_target:
    # GEMM1's CTAs per tile.
    fragment_gemm(
        act,
        *w2,
        y,
        routing,
        gemm1=False,
        decode=prepared["w2_decode"],
        k_valid=Ip if e4m3 else I,
        n_valid=H,
        split_k=splits,
        in_scale=act_scale,
        ready_target=-(-gemm1_rows // config.block_w),
        row_scale=prepared.get("w2_row_scale"),
        **common,
        **half_rows,
    )
    # A token's rows: its top_k pairs, each in `splits` consecutive partial rows.
    combine(
        y, out, top_k=top_k, splits=splits, topk_ids=ids_to_check,
        num_experts=prepared["num_experts"], expert_offset=expert_offset, pdl=config.pdl,
        **half_rows,
    )  # fmt: skip
    return out


def _route(x, prepared, top_k, config, routing_inputs: dict, quant=None):
    """Routing for the fragment GEMMs: (routing, ids the combine checks, ready, (narrow
    tiles, full tiles), x exponents, GEMM1's x). With config.narrow_t the router also writes
    each expert's narrow tile, which the narrow launches take, and the list of the other
    tiles, which the warp-specialized kernel shares out (routing.route's narrow). With
    config.post_scale the router also writes x's rows scaled up by powers of two (GEMM1's x)
    and their exponents, with quant = (static scale, per-row scales) of their e4m3 values
    (routing.route's prescale); with config.tile_ready it zeroes the per-tile counters
    `ready` that GEMM2 waits on (programmatic dependent launch: each kernel after the router
    starts its CTAs while the previous one finishes)."""
    M = x.shape[0]
    prescale = None
    if config.post_scale:
        scaled = scratch("x_scaled", tuple(x.shape), x.dtype, x.device)
        prescale = (x, scaled, scratch("x_exponents", (M,), torch.int32, x.device))
        if quant is not None:
            prescale += (quant,)
    bound = max_tiles(M * top_k, prepared["num_experts"], config.block_t)
    ready = None
    if config.tile_ready:
        ready = scratch("ready", (bound,), torch.int32, x.device)
    narrow_tiles = full_tiles = narrow = None
    if config.narrow_t:
        narrow_tiles = scratch("narrow_tiles", (prepared["num_experts"],), torch.int32, x.device)
        full_tiles = scratch("full_tiles", (1 + bound,), torch.int32, x.device)
        narrow = (narrow_tiles, config.narrow_t, full_tiles)
    routing, ids_to_check = route_for_gemms(
        prepared,
        top_k,
        config.block_t,
        **routing_inputs,
        launch_dependents=config.pdl,
        ready=ready,
        prescale=prescale,
        narrow=narrow,
    )
    lists = (narrow_tiles, full_tiles)
    if prescale is None:
        return routing, ids_to_check, ready, lists, None, x
    return routing, ids_to_check, ready, lists, prescale[2], prescale[1]


class TritonMoESm90(PaddedMoEKernel):
    """The registered "moe_apply" kernel object for Hopper: MXFP4 words in fragment order,
    decoded in registers into wgmma's A operand; bf16 or fp8 activations."""

    name = KERNEL_NAME
    weight_layout = WEIGHT_LAYOUT
    word_order = "fragment"
    forward = staticmethod(moe_forward_sm90)

    def prepare_options(self, config) -> dict:
        return dict(e4m3_w2=config.activation_format == "fp8")

    def forward_options(self, config, tensors: dict) -> dict:
        return dict(
            num_experts=config.num_experts,
            activation_format=config.activation_format,
            w13_input_scale=tensors["w13_input_scale"],
            w2_input_scale=tensors["w2_input_scale"],
        )


def supports(request, platform) -> Support:
    # The fragment GEMM calls gl.thread_barrier, which Triton 3.8 no longer has.
    toolchain = triton_support("thread_barrier")
    if not toolchain.ok:
        return toolchain
    if request.hidden_size % 16:
        return Support.no(
            f"copies x rows in 16-byte cp.async vectors: hidden_size {request.hidden_size} is "
            "not a multiple of 16"
        )
    return Support.yes()


# GPT-OSS-120B's H = I = 2880, top-4, 8 experts (a whole layer's picks do not depend on the count).
# M = 1, 4 and 16 take the decode tiles (grid wait; tile by tile), 64 and 256 the serving tiles,
# 1536 the 64-token tiles, 2048 the 128-token ones with a 4-step narrow ring, 4096 the prefill tile
# (both GEMMs warp-specialized; at a TP=8 shard's I = 384 GEMM1 only, with fp16 pair rows). The
# weight gain moves the e8m0 scales (centre 127 + log2(gain) - 7 for w13, - log2(gain) for w2),
# which picks each weight's decode: gain 1 shift-decodes w13 to bf16 and w2 to fp16 (fp16
# intermediate, post-scaled decode tiles); 2^17 puts w13's bytes above bf16's shift range (prmt) and
# w2's below fp16's (bf16 hi + lo intermediate); 2^-10 puts w2's above bf16's (prmt). FP8
# activations (w2 as e4m3 fragments, GEMM2 on FP8 MMAs) at a decode tile (post-scaled GEMM1) and the
# prefill tile, per-row and static scales (GEMM1 quantizes its own rows), and with 2^17 beside w13's
# prmt decode.
_GPT_OSS = dict(num_experts=8, top_k=4, hidden_size=2880, intermediate_size=2880)
AOT_CASES = (
    dict(_GPT_OSS, num_tokens=1),
    dict(_GPT_OSS, num_tokens=4),
    dict(_GPT_OSS, num_tokens=16),
    dict(_GPT_OSS, num_tokens=64),
    dict(_GPT_OSS, num_tokens=256),
    dict(_GPT_OSS, num_tokens=384),
    dict(_GPT_OSS, num_tokens=512, intermediate_size=384),
    dict(_GPT_OSS, num_tokens=1536),
    dict(_GPT_OSS, num_tokens=2048),
    dict(_GPT_OSS, num_tokens=4096),
    dict(_GPT_OSS, num_tokens=4096, intermediate_size=384),
    dict(_GPT_OSS, num_tokens=4096, gain=2.0**17),
    dict(_GPT_OSS, num_tokens=4096, gain=2.0**-10),
    dict(_GPT_OSS, num_tokens=1, activation_format="fp8"),
    dict(_GPT_OSS, num_tokens=1, activation_format="fp8", static_scales=True),
    dict(_GPT_OSS, num_tokens=4096, activation_format="fp8"),
    dict(_GPT_OSS, num_tokens=4096, activation_format="fp8", static_scales=True),
    dict(_GPT_OSS, num_tokens=4096, activation_format="fp8", gain=2.0**17),
)


def register() -> None:
    register_kernel(
        "moe_apply",
        name=KERNEL_NAME,
        backend="triton",
        platforms=["nvidia:sm_90"],
        traits={
            "weight_format": {"mxfp4"},
            "activation_format": {"bf16", "fp8"},
            "routing": {"topk_softmax"},
            "bias": True,
            "expert_parallel": True,
        },
        priority=110,
        supports=supports,
        description="Gluon wgmma grouped GEMMs, MXFP4 words decoded straight into register "
        "fragments (no shared-memory pass), fused bias+SwiGLU",
        aot_cases=AOT_CASES,
    )(TritonMoESm90())
