"""One rank's share of an MoE layer, as engines shard it: tensor parallel (each rank holds a
slice of every expert's intermediate channels) or expert parallel (each rank holds a block of
whole experts). Either way each rank calls `moe_apply` on its shard with the same x and
routing input, and the sum of the ranks' outputs (an all-reduce) is the whole layer's.

Tensor parallel splits I at multiples of `tensor_parallel_unit` (32 for MXFP4: one e8m0 scale
covers 32 consecutive K elements of w2, so a split inside a group would need a scale that no
single rank holds). Like vLLM's GPT-OSS loader, every rank but the last holds
ceil(I / unit / world_size) groups and the last one the rest: GPT-OSS-120B's I = 2880 (90
groups) gives 1440 x 2 at TP 2, 736 x 3 + 672 at TP 4 and 384 x 7 + 192 at TP 8 (2880 / 4 =
720 and 2880 / 8 = 360 are not multiples of 32). vLLM then pads each rank's buffer to its
backend's multiple; here the shard's I is its real size and a kernel pads internally
(`MoEPlan.padded_intermediate_size`).

Biases: w13's rows split with the weight; w2's bias is added once per token and expert, so
rank 0 keeps it and the others hold zeros (the all-reduce then adds it exactly once).
Expert parallel follows vLLM's linear placement: with E = q * world_size + r, the first r
ranks hold q + 1 experts, the others q, in order.
"""

from __future__ import annotations

import dataclasses
import numbers

import torch

from .api import check_weights
from .types import MoEConfig, MoEWeights


def _check_rank(op: str, rank: object, world_size: object) -> tuple[int, int]:
    for name, value in (("world_size", world_size), ("rank", rank)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise TypeError(f"{op}: {name} is {type(value).__name__}, expected an int")
    if world_size < 1:
        raise ValueError(f"{op}: world_size is {world_size}, expected an int >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"{op}: rank is {rank}, expected an int in [0, {world_size})")
    return int(rank), int(world_size)


def _check_layer(op: str, config: MoEConfig, weights: MoEWeights) -> None:
    if not isinstance(config, MoEConfig):
        raise TypeError(f"{op}: config is {type(config).__name__}, expected MoEConfig")
    if not isinstance(weights, MoEWeights):
        raise TypeError(f"{op}: weights is {type(weights).__name__}, expected MoEWeights")
    check_weights(op, config, weights, weights.w13.device)


def tensor_parallel_unit(weight_format: str) -> int:
    """The granularity of a tensor-parallel split of I: 32 for MXFP4 (a scale group), else 1."""
    return 32 if weight_format == "mxfp4" else 1


def tensor_parallel_bounds(
    intermediate_size: int, *, rank: int, world_size: int, weight_format: str = "mxfp4"
) -> tuple[int, int]:
    """[start, end) of the intermediate channels `rank` holds (see the module doc)."""
    op = "tensor_parallel_bounds"
    rank, world_size = _check_rank(op, rank, world_size)
    unit = tensor_parallel_unit(weight_format)
    if intermediate_size % unit:
        raise ValueError(
            f"{op}: intermediate_size is {intermediate_size}, expected a multiple of {unit} "
            f"for {weight_format} weights"
        )
    per_rank = -(-intermediate_size // unit // world_size) * unit
    start = min(rank * per_rank, intermediate_size)
    end = min(start + per_rank, intermediate_size)
    if end == start:
        raise ValueError(
            f"{op}: rank {rank} of {world_size} holds no intermediate channels: I = "
            f"{intermediate_size} in chunks of {per_rank} (multiples of {unit}) fills "
            f"{-(-intermediate_size // per_rank)} ranks; use fewer ranks"
        )
    return start, end


def tensor_parallel_shard(
    config: MoEConfig, weights: MoEWeights, *, rank: int, world_size: int
) -> tuple[MoEConfig, MoEWeights]:
    """`rank`'s slice of every expert's intermediate channels: (the shard's config, with its I,
    and its weights). Summing `moe_apply` over the ranks gives the layer's output."""
    op = "tensor_parallel_shard"
    _check_layer(op, config, weights)
    start, end = tensor_parallel_bounds(
        config.intermediate_size,
        rank=rank,
        world_size=world_size,
        weight_format=config.weight_format,
    )
    fmt = config.weight_format
    # w13 rows interleave gate and up: channel c is rows 2c and 2c + 1.
    rows = slice(2 * start, 2 * end)
    if fmt == "mxfp4":
        w2 = weights.w2[:, :, start // 2 : end // 2]
        w2_scale = weights.w2_scale[:, :, start // 32 : end // 32]
    else:
        w2 = weights.w2[:, :, start:end]
        # fp8: one scale per output row of w2 (H), the same on every rank.
        w2_scale = weights.w2_scale
    w2_bias = weights.w2_bias
    if w2_bias is not None and rank != 0:
        w2_bias = torch.zeros_like(w2_bias)
    shard = MoEWeights(
        w13=_own(weights.w13[:, rows]),
        w2=_own(w2),
        w13_scale=None if weights.w13_scale is None else _own(weights.w13_scale[:, rows]),
        w2_scale=None if w2_scale is None else _own(w2_scale),
        w13_bias=None if weights.w13_bias is None else _own(weights.w13_bias[:, rows]),
        w2_bias=None if w2_bias is None else _own(w2_bias),
        w13_input_scale=weights.w13_input_scale,
        w2_input_scale=weights.w2_input_scale,
    )
    return dataclasses.replace(config, intermediate_size=end - start), shard


def expert_parallel_bounds(num_experts: int, *, rank: int, world_size: int) -> tuple[int, int]:
    """(expert_offset, num_local_experts) of `rank` (see the module doc)."""
    op = "expert_parallel_bounds"
    rank, world_size = _check_rank(op, rank, world_size)
    if world_size > num_experts:
        raise ValueError(
            f"{op}: world_size is {world_size}, expected at most num_experts ({num_experts}): "
            "every rank holds at least one expert"
        )
    base, extra = divmod(num_experts, world_size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def expert_parallel_shard(
    config: MoEConfig, weights: MoEWeights, *, rank: int, world_size: int
) -> tuple[MoEConfig, MoEWeights]:
    """`rank`'s block of whole experts: (config with its expert_offset and num_local_experts,
    the weights of those experts). Ids stay global; summing `moe_apply` over the ranks gives
    the layer's output."""
    op = "expert_parallel_shard"
    _check_layer(op, config, weights)
    if config.expert_parallel:
        raise ValueError(
            f"{op}: config holds experts {config.expert_offset}.."
            f"{config.expert_offset + config.num_local_experts - 1} of {config.num_experts}, "
            "expected all of them (shard the whole layer)"
        )
    offset, count = expert_parallel_bounds(config.num_experts, rank=rank, world_size=world_size)
    experts = slice(offset, offset + count)
    tensors = {
        f.name: _own(getattr(weights, f.name)[experts])
        for f in dataclasses.fields(MoEWeights)
        if isinstance(getattr(weights, f.name), torch.Tensor)
    }
    shard = dataclasses.replace(weights, **tensors)
    return dataclasses.replace(config, expert_offset=offset, num_local_experts=count), shard


def _own(t: torch.Tensor) -> torch.Tensor:
    # Contiguous, so a shard is laid out as a checkpoint of its size would be.
    return t.contiguous()
