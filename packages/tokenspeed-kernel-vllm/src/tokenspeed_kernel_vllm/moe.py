"""GPT-OSS MXFP4 MoE in vLLM through `moe_plan` / `moe_prepare_weights` / `moe_apply`.

The plugin registers `TokenspeedGptOssMxfp4Config` under vLLM's own quantization name
"gpt_oss_mxfp4" (what GPT-OSS checkpoints resolve to), so GPT-OSS's loader and vLLM's expert
weight loader run unchanged. For each MoE layer it hands out `TokenspeedGptOssMxfp4MoEMethod`
when a tokenspeed-kernel kernel (not the reference, see `serving`) serves that rank's layer on
its device, and vLLM's own `GptOssMxfp4MoEMethod` otherwise.

What a rank holds, as vLLM's GPT-OSS loader leaves it:
- tensor parallel: every expert's intermediate channels [start, end) of I, split in whole
  32-channel scale groups (`tensor_parallel_bounds`, the same rule: I = 2880 gives 1440 x 2,
  736 x 3 + 672, 384 x 7 + 192 at TP 2/4/8), in buffers of `maybe_roundup_sizes`' I whose rows
  past the shard stay the zeros `create_weights` wrote. Those padding rows are sliced off, not
  computed on: the plan's I is the shard's. w2_bias is the checkpoint's on TP rank 0 and zeros
  on the others (the loader zeroes them), so the all-reduce adds it once.
- expert parallel: whole experts expert_offset .. expert_offset + n - 1 (vLLM's linear
  placement, read back from the layer's expert map), each with its own biases; topk ids stay
  global and pairs routed to other ranks contribute nothing here.
Either way vLLM sums the ranks' outputs (all-reduce, or the EP combine) after `apply_monolithic`.
"""

from __future__ import annotations

import logging

import torch
from vllm.model_executor.layers.fused_moe import FusedMoEConfig, FusedMoEMethodBase, RoutedExperts
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import RoutingMethodType
from vllm.model_executor.layers.quantization.mxfp4 import GptOssMxfp4Config
from vllm.model_executor.utils import set_weight_attrs

import tokenspeed_kernel as tk
from tokenspeed_kernel.ops.moe.api import request_for
from tokenspeed_kernel.ops.moe.parallel import expert_parallel_bounds, tensor_parallel_bounds

from .serving import decline_reason

# vLLM's loggers print only under "vllm"; under our own name the lines would vanish.
logger = logging.getLogger(f"vllm.{__name__}")

# GPT-OSS's clamped SwiGLU, as vLLM's GptOssMxfp4MoEMethod fixes it (gemm1_alpha, swiglu_limit).
GPT_OSS_SWIGLU = tk.SwiGLU(alpha=1.702, limit=7.0)
MXFP4_GROUP = 32
# top-k then softmax over the k, or softmax then top-k renormalized: the same weights.
_ROUTINGS = (RoutingMethodType.Renormalize, RoutingMethodType.RenormalizeNaive)
_WEIGHTS = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale", "w13_bias", "w2_bias")
_DEFAULT_MAX_TOKENS = 8192
_logged: set[str] = set()


def _log_once(message: str, *args) -> None:
    line = message % args
    if line not in _logged:
        _logged.add(line)
        logger.info(line)


def shard_intermediate_size(moe: FusedMoEConfig) -> int:
    """The intermediate channels this rank holds (vLLM's GPT-OSS split, see the module doc)."""
    par = moe.moe_parallel_config
    if par.tp_size == 1:
        return moe.intermediate_size
    start, end = tensor_parallel_bounds(
        moe.intermediate_size, rank=par.tp_rank, world_size=par.tp_size
    )
    return end - start


def rank_config(moe: FusedMoEConfig, expert_offset: int, num_local_experts: int) -> tk.MoEConfig:
    return tk.MoEConfig(
        num_experts=moe.num_experts,
        top_k=moe.experts_per_token,
        hidden_size=moe.hidden_dim,
        intermediate_size=shard_intermediate_size(moe),
        weight_format="mxfp4",
        activation_format="bf16",
        activation=GPT_OSS_SWIGLU,
        has_bias=moe.has_bias,
        expert_offset=expert_offset,
        num_local_experts=num_local_experts,
    )


def _max_num_tokens() -> int:
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is None or config.scheduler_config is None:
        return _DEFAULT_MAX_TOKENS
    return config.scheduler_config.max_num_batched_tokens


def unsupported_reason(moe: FusedMoEConfig) -> str | None:
    """Why this rank's GPT-OSS MoE layer stays on vLLM's own method (None: ours serves it)."""
    par = moe.moe_parallel_config
    checks = (
        (moe.activation == MoEActivation.SWIGLUOAI, f"activation {moe.activation.value}"),
        (moe.routing_method in _ROUTINGS, f"routing {moe.routing_method.name}"),
        (moe.in_dtype == torch.bfloat16, f"activations in {moe.in_dtype}, not bfloat16"),
        (moe.swiglu_beta in (None, 1.0), f"swiglu_beta {moe.swiglu_beta}"),
        (not par.enable_eplb, "expert load balancing (EPLB)"),
        (not moe.is_lora_enabled, "LoRA on the experts"),
        (not moe.rocm_aiter_fmoe_enabled, "ROCm AITER fused MoE (expert mask, not map)"),
    )
    for ok, what in checks:
        if not ok:
            return f"{what} is not supported"
    offset, count = 0, moe.num_experts
    if par.use_ep:
        offset, count = expert_parallel_bounds(
            moe.num_experts, rank=par.ep_rank, world_size=par.ep_size
        )
    try:
        config = rank_config(moe, offset, count)
    except ValueError as exc:
        return str(exc)
    device = torch.device(moe.device)
    platform = tk.platform_of(device)
    return decline_reason("moe_apply", request_for(config, _max_num_tokens()), platform)


class TokenspeedGptOssMxfp4Config(GptOssMxfp4Config):
    """vLLM's "gpt_oss_mxfp4" config, handing MoE layers to tokenspeed-kernel where it serves."""

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if isinstance(layer, RoutedExperts):
            reason = unsupported_reason(layer.moe_config)
            if reason is None:
                return TokenspeedGptOssMxfp4MoEMethod(layer.moe_config)
            _log_once("tokenspeed-kernel: vLLM's own MXFP4 MoE serves GPT-OSS here: %s", reason)
        return super().get_quant_method(layer, prefix)


class TokenspeedGptOssMxfp4MoEMethod(FusedMoEMethodBase):
    """One GPT-OSS MoE layer (this rank's shard) on a tokenspeed-kernel MoE plan."""

    def __init__(self, moe: FusedMoEConfig):
        super().__init__(moe)
        self.weight_dtype = "gpt_oss_mxfp4"  # GPT-OSS's loader keys its MXFP4 path on it
        self.max_num_tokens = _max_num_tokens()
        self.plan: tk.MoEPlan | None = None
        self.prepared: tk.PreparedMoEWeights | None = None

    @property
    def is_monolithic(self) -> bool:
        return True  # routing from the router logits happens inside moe_apply

    def maybe_roundup_sizes(self, hidden_size, intermediate_size_per_partition, act_dtype,
                            moe_parallel_config):  # fmt: skip
        """vLLM allocates I // tp per rank, but its GPT-OSS loader hands rank r up to
        ceil(I / 32 / tp) * 32 channels (736 at TP 4): the buffers hold the larger."""
        size = -(-intermediate_size_per_partition // MXFP4_GROUP) * MXFP4_GROUP
        if moe_parallel_config.tp_size > 1:
            start, end = tensor_parallel_bounds(
                self.moe.intermediate_size, rank=0, world_size=moe_parallel_config.tp_size
            )
            size = max(size, end - start)
        return hidden_size, size

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition,
                       params_dtype, **extra_weight_attrs):  # fmt: skip
        """The parameters vLLM's GPT-OSS loader fills, as GptOssMxfp4MoEMethod names them.
        Zeros, so rows past a rank's shard are zeros too."""
        E, H, I = num_experts, hidden_size, intermediate_size_per_partition  # noqa: E741
        shapes = {
            "w13_weight": ((E, 2 * I, H // 2), torch.uint8),
            "w13_weight_scale": ((E, 2 * I, H // MXFP4_GROUP), torch.uint8),
            "w2_weight": ((E, H, I // 2), torch.uint8),
            "w2_weight_scale": ((E, H, I // MXFP4_GROUP), torch.uint8),
        }
        if self.moe.has_bias:
            shapes["w13_bias"] = ((E, 2 * I), torch.bfloat16)
            shapes["w2_bias"] = ((E, H), torch.bfloat16)
        for name, (shape, dtype) in shapes.items():
            param = torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(param, extra_weight_attrs)
        layer.params_dtype = params_dtype
        layer.num_experts = num_experts

    def local_experts(self, layer) -> tuple[int, int]:
        """(expert_offset, num_local_experts) from the layer's expert map (global -> local id,
        -1 elsewhere): the ids this rank holds must be one range, in order."""
        count = layer.local_num_experts
        expert_map = layer.expert_map
        if expert_map is None:
            return 0, count
        local = expert_map.cpu()
        owned = torch.nonzero(local >= 0).flatten()
        offset = int(owned[0]) if owned.numel() else 0
        expected = torch.arange(offset, offset + count)
        if not (
            torch.equal(owned, expected) and torch.equal(local[owned].long(), torch.arange(count))
        ):
            raise NotImplementedError(
                "tokenspeed-kernel MoE: this rank's experts are not one range in order "
                f"(global ids {owned.tolist()}); only linear expert placement is supported"
            )
        return offset, count

    def rank_weights(self, layer, shard_size: int) -> tk.MoEWeights:
        """The layer's buffers cut to the shard's I (the rows past it are padding)."""
        i2, k2, k32 = 2 * shard_size, shard_size // 2, shard_size // MXFP4_GROUP

        def cut(t: torch.Tensor, index) -> torch.Tensor:
            return t[index].contiguous()

        has_bias = self.moe.has_bias
        return tk.MoEWeights(
            w13=cut(layer.w13_weight, (slice(None), slice(0, i2))),
            w13_scale=cut(layer.w13_weight_scale, (slice(None), slice(0, i2))),
            w2=cut(layer.w2_weight, (..., slice(0, k2))),
            w2_scale=cut(layer.w2_weight_scale, (..., slice(0, k32))),
            w13_bias=cut(layer.w13_bias, (slice(None), slice(0, i2))) if has_bias else None,
            w2_bias=layer.w2_bias.data if has_bias else None,
        )

    def process_weights_after_loading(self, layer) -> None:
        offset, count = self.local_experts(layer)
        config = rank_config(self.moe, offset, count)
        weights = self.rank_weights(layer, config.intermediate_size)
        self.plan = tk.moe_plan(
            config, device=weights.w13.device, max_num_tokens=self.max_num_tokens
        )
        self.prepared = tk.moe_prepare_weights(self.plan, weights)
        _log_once("tokenspeed-kernel: GPT-OSS MoE layers run %s", self.plan)
        # The prepared weights are the kernel's own copy: drop vLLM's buffers so the experts
        # are not held twice (GPT-OSS-120B's are ~60 GB).
        for name in _WEIGHTS:
            old = getattr(layer, name, None)
            if old is not None:
                empty = torch.empty(0, dtype=old.dtype, device=old.device)
                setattr(layer, name, torch.nn.Parameter(empty, requires_grad=False))

    def get_fused_moe_quant_config(self, layer):
        return None  # the plan holds the format; no vLLM modular kernel runs these layers

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        raise NotImplementedError(
            "tokenspeed-kernel MoE is monolithic: vLLM calls apply_monolithic with the logits"
        )

    def apply_monolithic(self, layer, x: torch.Tensor, router_logits: torch.Tensor,
                         input_ids: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """out [M, H] = this rank's share of the layer for x [M, H] bf16, router_logits
        [M, E]; a batch beyond the plan's max_num_tokens runs in chunks."""
        if self.plan is None:
            raise RuntimeError("tokenspeed-kernel MoE: apply before process_weights_after_loading")
        out = torch.empty_like(x)
        step = self.plan.max_num_tokens
        for i in range(0, x.shape[0], step):
            rows = slice(i, i + step)
            tk.moe_apply(self.plan, x[rows], self.prepared, router_logits[rows], out=out[rows])
        return out
