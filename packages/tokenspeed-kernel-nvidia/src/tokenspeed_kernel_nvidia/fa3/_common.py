"""What the three FA3 adapters share: traits read from the wheel, the verdict, the call.

The wheel (`tokenspeed-fa3` 3.0.0.post20260810) ships `flash_attn_interface.py` and a prebuilt
`flash_attn_3/_C.abi3.so`; its limits, read from them:
- `flash_attn_config.CONFIG["build_flags"]`: head dims 64, 128, 192, 256 compiled (96 disabled),
  fp16/bf16/e4m3 compiled, SM8x disabled (sm_90 only), paged KV, split-KV, local (window) on,
  softcap and backward off.
- op schema `flash_attn_3::fwd(q, k, v, ..., Tensor(out!)? out, cu_seqlens_q, ..., seqused_k,
  max_seqlen_q, ..., page_table, ..., softmax_scale, is_causal, window_size_left,
  window_size_right, ..., num_splits, pack_gqa, sm_margin, Tensor? sinks)`: writes `out` in
  place and returns (out, softmax_lse, out_accum, lse_accum); softmax_lse is natural-log,
  [Hq, total_q] for ragged q, [B, Hq, Sq] for batched q.
- `_C` checks: "sinks must have dtype bfloat16", "query and key must have the same dtype",
  "For FP8 input, output must have dtype BF16", "Number of heads in key/value must divide
  number of heads in query"; `flash_attn_with_kvcache`'s docstring: "page_block_size can be
  arbitrary (e.g, 1, 2, 3, 64, etc.)", causal masks aligned bottom-right (the contract's
  extend/decode positions).

FP8 caches are declined: FA3 takes e4m3 only with q in e4m3 too, and quantizing q would add
an error the contract does not allow. Sinks: FA3 reads them as bf16 only, so bf16 sinks go to
the kernel as they are when no lse is asked for; float32 sinks, or any sinks with lse, run
FA3 without the sink and merge it exactly in float32 afterwards (`_attention.sink_merge`: a few
small elementwise kernels on out and the lse).
"""

from __future__ import annotations

import torch

from tokenspeed_kernel.registry import ANY, Support, register_kernel

from .._attention import dense_last_dim, no_key_lse, sink_merge
from .._library import FA3

HALF = (torch.bfloat16, torch.float16)
HEAD_DIMS = (64, 128, 192, 256)
TRAITS = dict(
    dtype=HALF, kv_dtype=HALF, head_dim=HEAD_DIMS, gqa_ratio=ANY, window=True, sinks=True, lse=True
)
PLATFORMS = ("nvidia:sm_90",)


def supports(request, platform) -> Support:
    verdict = FA3.verdict()
    if not verdict.ok:
        return verdict
    if request.kv_dtype != request.dtype:
        return Support.no("FA3 needs q and the KV cache in one dtype")
    return Support.yes()


def fa3_forward(q, k, v, *, out, lse, sinks, softmax_scale, causal, window_left, rows, **kw):
    """One `flash_attn_3::fwd` call writing `out`, then the sink merge or the lse copy.

    `rows(softmax_lse)` views FA3's lse as out's rows [..., Hq]; `kw` are the op's index
    arguments (cu_seqlens_q, seqused_k, page_table, max_seqlen_q, num_splits, ...).
    `covered` in kw (popped) is a [rows] bool mask of the rows some sequence owns, or None:
    rows outside it keep what out and lse held (the contract's unwritten rows).
    """
    covered = kw.pop("covered", None)
    fwd = FA3.load().flash_attn_3_gpu.fwd
    native = sinks is not None and sinks.dtype == torch.bfloat16 and lse is None
    target = out if out.stride(-1) == 1 else torch.empty_like(out)
    result = fwd(
        dense_last_dim(q), dense_last_dim(k), dense_last_dim(v), out=target,
        softmax_scale=softmax_scale, is_causal=causal, window_size_left=window_left,
        window_size_right=0 if causal else -1, sinks=sinks if native else None, **kw,
    )  # fmt: skip
    if target is not out:
        out.copy_(target)
    if native or (sinks is None and lse is None):
        return
    rows_lse = no_key_lse(rows(result[1]))
    if sinks is not None:
        weight, rows_lse = sink_merge(rows_lse, sinks)
        if covered is not None:
            weight = torch.where(covered.unsqueeze(-1), weight, 1.0)
        out.mul_(weight.unsqueeze(-1))
    if lse is not None:
        if covered is not None:
            rows_lse = torch.where(covered.unsqueeze(-1), rows_lse, lse)
        lse.copy_(rows_lse)


def covered_rows(cu_seqlens: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[T] bool: rows between the first and the last (clamped, non-decreasing) offset."""
    row = torch.arange(num_rows, device=cu_seqlens.device)
    return (row >= cu_seqlens[0]) & (row < cu_seqlens[-1])


def register_fa3(op: str, launcher, traits: dict, description: str, priority: int) -> None:
    register_kernel(
        op,
        name=f"fa3.{op}",
        backend="fa3",
        platforms=PLATFORMS,
        traits=traits,
        priority=priority,
        supports=supports,
        description=description,
    )(launcher)
