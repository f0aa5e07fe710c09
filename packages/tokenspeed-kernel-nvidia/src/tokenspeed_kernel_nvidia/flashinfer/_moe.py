"""What the FlashInfer MoE adapters share: our checkpoint layout split into gate and up halves
and padded, the routing inputs in the form the libraries take, and the padded activations.

Our MXFP4 weights (the contract): w13 [E, 2I, H/2] uint8, rows interleaving gate (even) and up
(odd), two e2m1 per byte along K (low nibble = even element); scales [E, 2I, H/32] e8m0;
w2 [E, H, I/2], w2_scale [E, H, I/32]; biases w13_bias [E, 2I], w2_bias [E, H]. Padding adds
zero weights (e2m1 code 0) and unit scales (e8m0 127; 255 would be NaN) along K, and zero
rows: a padded gate/up row gives h = 0, a = 0 * sigmoid(0) * (0 + 1) = 0, so padded
intermediate columns contribute nothing to GEMM2, and padded output columns are dropped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenspeed_kernel.ops.moe.reference import topk_softmax

UNIT_SCALE = 127  # e8m0 2^0


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def pad_last2(x: torch.Tensor, rows: int, cols: int, value: int = 0) -> torch.Tensor:
    """[E, r, c] -> [E, rows, cols], new cells `value`."""
    return F.pad(x, (0, cols - x.shape[-1], 0, rows - x.shape[-2]), value=value)


def split_gate_up(w13: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows (or bias entries) of w13 [E, 2I, ...] -> (gate [E, I, ...], up [E, I, ...])."""
    return w13[:, 0::2], w13[:, 1::2]


def routing(config, router_logits, topk_weights, topk_ids):
    """(weights [M, k] float32, ids [M, k] int32), every id a valid expert.

    From logits: the core's top-k softmax (ties to the lower index, softmax over the k). Given
    ids outside [0, E) (-1 included) contribute nothing in the contract: they become expert 0
    with weight 0, so the libraries never index past their weights.
    """
    if router_logits is not None:
        return topk_softmax(router_logits, config.top_k)
    valid = (topk_ids >= 0) & (topk_ids < config.num_experts)
    weights = torch.where(valid, topk_weights, 0.0).contiguous()
    ids = torch.where(valid, topk_ids, 0).to(torch.int32).contiguous()
    return weights, ids


def padded_input(x: torch.Tensor, hidden: int) -> torch.Tensor:
    """x [M, H] bf16 -> [M, hidden] (zero columns appended), x itself when H == hidden."""
    if x.shape[1] == hidden and x.is_contiguous():
        return x
    return F.pad(x, (0, hidden - x.shape[1]))


def swiglu_tensors(config, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-expert alpha, beta (1: our `u + 1`) and limit (None: no clamp) as float32 [E]."""
    E = config.num_experts
    act = config.activation
    alpha = torch.full((E,), act.alpha, dtype=torch.float32, device=device)
    beta = torch.ones(E, dtype=torch.float32, device=device)
    limit = None
    if act.limit != float("inf"):
        limit = torch.full((E,), act.limit, dtype=torch.float32, device=device)
    return alpha, beta, limit
