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
an error the contract does not allow. Sinks: FA3 reads them as bf16 only. Without lse, sinks
that bf16 holds exactly go to the kernel (bf16 sinks as they are; float32 sinks, in eager
calls, as a bf16 copy once `native_sinks` has found them exact: GPT-OSS's come from a bf16
checkpoint); other float32 sinks, or any sinks with lse, run FA3 without the sink and merge
it exactly in float32 afterwards (`_attention.sink_merge`: a few small elementwise kernels on
out and the lse).
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
    arguments (cu_seqlens_q, seqused_k, page_table, max_seqlen_q, num_splits, ...). With
    ragged q (cu_seqlens_q, clamped), rows no sequence owns keep what out and lse held (the
    contract's unwritten rows): FA3 leaves them, and the merge and the lse copy skip them.
    """
    fwd = FA3.load().flash_attn_3_gpu.fwd
    kernel_sinks = native_sinks(sinks) if sinks is not None and lse is None else None
    native = kernel_sinks is not None
    target = out if out.stride(-1) == 1 else torch.empty_like(out)
    result = fwd(
        dense_last_dim(q), dense_last_dim(k), dense_last_dim(v), out=target,
        softmax_scale=softmax_scale, is_causal=causal, window_size_left=window_left,
        window_size_right=0 if causal else -1, sinks=kernel_sinks, **kw,
    )  # fmt: skip
    if target is not out:
        out.copy_(target)
    if native or (sinks is None and lse is None):
        return
    ragged = kw.get("cu_seqlens_q")
    covered = None if ragged is None else covered_rows(ragged, out.shape[0])
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


# Attribute a float32 sinks tensor carries once checked: (its version, the bf16 copy or None).
_NATIVE = "_tokenspeed_fa3_bf16_sinks"


def native_sinks(sinks: torch.Tensor) -> torch.Tensor | None:
    """`sinks` as FA3's kernel takes them (bf16) where that is exact, else None (merge after).

    bf16 sinks are returned as they are. Float32 sinks, in an eager call, are read back once to
    check that every value is finite and equal to its bf16 rounding; the verdict and the bf16
    copy stay on the tensor object, keyed by its version counter (an in-place update, such as
    a weight reload, checks again), so a layer's sinks parameter costs one host read in its
    first call and nothing after. A CUDA-graph capture merges instead: a replay must read the
    live sinks (weights reloaded in place keep their graphs), not a copy made before. So do
    sinks that cannot carry a verdict (inference tensors keep no version counter).
    """
    if sinks.dtype == torch.bfloat16:
        return sinks
    if capturing(sinks):
        return None
    try:
        version = sinks._version
    except RuntimeError:  # an inference tensor: no version counter to key a verdict on
        return None
    cached = getattr(sinks, _NATIVE, None)
    if cached is None or cached[0] != version:
        as_bf16 = sinks.detach().to(torch.bfloat16)
        exact = bool(torch.isfinite(sinks).all()) and torch.equal(as_bf16.to(sinks.dtype), sinks)
        cached = (version, as_bf16 if exact else None)
        setattr(sinks, _NATIVE, cached)
    return cached[1]


def capturing(tensor: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on the current stream of `tensor`'s device."""
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


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
