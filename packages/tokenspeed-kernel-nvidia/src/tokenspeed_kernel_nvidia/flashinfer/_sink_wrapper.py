"""FlashInfer's attention-sink wrapper (`flashinfer.BatchAttentionWithAttentionSinkWrapper`,
0.6.14 and 0.7.x), shared by the prefill and extend adapters.

The wrapper is a paged prefill (`BatchPrefillWithPagedKVCacheWrapper`) JIT-specialised with the
"AttentionSink" variant (jit/attention/variants.py): the sink enters the softmax as
`sink[h] * log2(e)` in the log2 domain of the scaled logits, i.e. the contract's unscaled
sink logit; its extra arguments are the float32 `sink` [Hq] tensor and the `sm_scale` scalar,
passed positionally to `run`. The variant always adds a sink, so requests without one are
declined. Its lse is base 2 (m and log2(d) of the scaled logits): multiplied by ln 2 here.

`plan()` reads the ragged offsets on the host (a device-to-host copy and a synchronisation on
every call): the adapters are correct but not CUDA-graph capturable, and rank last among the
NVIDIA attention kernels (priority 20). One wrapper per (device, dtypes, head dim, sliding or
not) is kept, all sharing one float workspace per device.
"""

from __future__ import annotations

import math

import torch

from tokenspeed_kernel.registry import Support

from .._attention import workspace
from ._common import PREFILL_WORKSPACE_BYTES, flashinfer, library_verdict

PRIORITY = 20
# The wrapper's JIT module name (uri) is "batch_prefill_attention_sink_{dtype}_swa_{bool}_
# {backend}" in 0.6.14 and 0.7.2 (attention/_core.py): the head dim is not part of it, so two
# head dims in one process would load the module compiled first for both. GPT-OSS's 64 only.
HEAD_DIMS = (64,)
_LN2 = math.log(2.0)
_wrappers: dict[tuple, object] = {}


def supports(request, platform) -> Support:
    verdict = library_verdict()
    if not verdict.ok:
        return verdict
    if not request.sinks:
        return Support.no("the sink wrapper's variant always adds a sink; this request has none")
    if request.kv_dtype != request.dtype:
        return Support.no("the sink wrapper needs q and k/v in one dtype")
    return Support.yes()


def _wrapper(fi, q, kv_dtype, window_left: int):
    key = (q.device, q.dtype, kv_dtype, q.shape[-1], window_left >= 0)
    wrapper = _wrappers.get(key)
    if wrapper is None:
        wrapper = fi.BatchAttentionWithAttentionSinkWrapper(
            workspace("flashinfer.prefill", q.device, PREFILL_WORKSPACE_BYTES),
            kv_layout="NHD",
            backend="auto",
            q_data_type=q.dtype,
            kv_data_type=kv_dtype,
            head_dim_qk=q.shape[-1],
            head_dim_vo=q.shape[-1],
            window_left=window_left,
        )
        _wrappers[key] = wrapper
    return wrapper


def host_offsets(cu_seqlens: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Ragged offsets on the host, clamped to [0, T] and made non-decreasing (plan() needs
    lengths >= 0): one device-to-host copy."""
    return torch.cummax(cu_seqlens.clamp(0, num_rows).cpu().to(torch.int64), 0).values


def run_paged(q, k_pages, v_pages, pages, *, causal, window_left, sinks, softmax_scale, out, lse):
    """q [T, Hq, D] rows cu[0] .. cu[B] ragged by pages["cu"] (host int64 [B+1]); k/v_pages
    [num_pages, P, Hkv, D] (NHD); pages["kv_indptr"] (host), ["kv_indices"] (device) and
    ["last_page_len"] (host) describe each sequence's pages. Rows outside [cu[0], cu[B]) are
    not written (FlashInfer wants exactly cu[B] - cu[0] rows)."""
    cu = pages["cu"]
    start, end = int(cu[0]), int(cu[-1])
    if end == start:
        return
    device = q.device
    fi = flashinfer()
    wrapper = _wrapper(fi, q, k_pages.dtype, window_left)
    wrapper.plan(
        (cu - start).to(device=device, dtype=torch.int32),
        pages["kv_indptr"].to(device=device, dtype=torch.int32),
        pages["kv_indices"].to(torch.int32),
        pages["last_page_len"].to(device=device, dtype=torch.int32),
        q.shape[1],
        k_pages.shape[2],
        q.shape[2],
        k_pages.shape[1],
        causal=causal,
        sm_scale=softmax_scale,
        window_left=window_left,
        q_data_type=q.dtype,
        kv_data_type=k_pages.dtype,
    )
    rows = slice(start, end)
    out_rows = out[rows]
    target = out_rows if out_rows.is_contiguous() else torch.empty_like(out_rows)
    lse_rows = None if lse is None else torch.empty_like(lse[rows])
    wrapper.run(
        q[rows],
        (k_pages, v_pages),
        sinks.to(torch.float32),
        softmax_scale,
        out=target,
        lse=lse_rows,
        return_lse=lse is not None,
    )
    if target is not out_rows:
        out_rows.copy_(target)
    if lse is not None:
        lse[rows].copy_(lse_rows.mul_(_LN2))
