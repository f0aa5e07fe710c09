"""CPU stand-ins for the libraries the NVIDIA adapters call, for testing the argument mapping.

Each stand-in implements the library function's documented semantics in plain torch (float64)
and records every call, so a test can run an adapter on CPU tensors against the core reference
(the shared conformance cases) and inspect the keywords it passed. Each models exactly the
documented contract we map to; where the documentation is silent, the assumption is named:

- FA3 `flash_attn_3::fwd` (flash_attn_interface.py, tokenspeed-fa3 3.0.0.post20260810): ragged q
  by cu_seqlens_q or batched [B, Sq, Hq, D]; keys from cu_seqlens_k, or pages of page_table up
  to seqused_k; causal/window masks aligned bottom-right (query i of n sits at L - n + i);
  window (left, right) inclusive; sinks bf16 [Hq] in the denominator (exp(sink - max));
  softmax_lse natural log, [Hq, T] ragged or [B, Hq, Sq] batched. Assumed: a row with nothing
  visible writes out 0 and lse +inf (FA3's non-split epilogue; the adapter maps +inf to -inf).
- FlashInfer `trtllm_batch_decode_with_kv_cache(backend="xqa")` (decode.py, 0.6.14/0.7.2):
  logits = bmm1_scale * q.k over the cache's raw values, out = bmm2_scale * sum p v, window
  keys [L-1-W, L-1], sinks float32 [Hq]; out in q's dtype; seq_lens read as uint32.
- FlashInfer `BatchAttentionWithAttentionSinkWrapper` (attention/_core.py + jit variants.py):
  plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, Hq, Hkv, D, P,
  causal=, sm_scale=, window_left=), run(q, (k, v), sink, sm_scale, out=, lse=, return_lse=);
  kv_len = (pages - 1) * P + last_page_len; run needs q.shape[0] == qo_indptr[-1]; lse base 2.
- FlashInfer `cutlass_fused_moe(use_w4_group_scaling=True)` (fused_moe/core.py, vLLM's Hopper
  test): fc1 rows [up; gate], e8m0 scales [E, K/128, N*4] (element (n, 4j+t) of [N, K/32] at
  (j, 4n+t)), bf16 biases, SwiGLU min(g, limit) * sigmoid(alpha g) * (clamp(u) + beta). The
  kernel's intermediate precision is not modelled (float64 here): the GPU test measures it.
  Its weights pass through `interleave_moe_weights_for_sm90_mixed_gemm(w, "fp4")`, whose byte
  order is the library's own (a CUDA kernel, not documented): modelled as a stand-in
  involution that the stand-in kernel undoes, so weights that skipped it decode wrong.
"""

from __future__ import annotations

import contextlib
import math
import types

import torch

from tokenspeed_kernel.formats.mxfp4 import dequantize_mxfp4

F64 = torch.float64


def _attend(q, k, v, *, scale, causal, left, right, sinks):
    """q [n, Hq, D], k/v [L, Hkv, D] (float64); query i at L - n + i. -> (out, lse natural)."""
    n, num_q, _ = q.shape
    length = k.shape[0]
    group = num_q // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q, k) * scale
    qpos = torch.arange(n).unsqueeze(1) + (length - n)
    kpos = torch.arange(length).unsqueeze(0)
    visible = torch.ones(n, length, dtype=torch.bool)
    if causal:
        visible &= kpos <= qpos
    if left >= 0:
        visible &= kpos >= qpos - left
    if right >= 0 and not causal:
        visible &= kpos <= qpos + right
    s = s.masked_fill(~visible, -math.inf)
    m = s.amax(-1, keepdim=True) if length else torch.full((num_q, n, 1), -math.inf, dtype=F64)
    if sinks is not None:
        m = torch.maximum(m, sinks.to(F64).view(-1, 1, 1))
    m = torch.where(torch.isinf(m), 0.0, m)
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sinks.to(F64).view(-1, 1, 1) - m)
    out = torch.einsum("hnl,lhd->nhd", p / torch.where(denom == 0, 1.0, denom), v)
    lse = (m + torch.log(denom)).squeeze(-1)  # [Hq, n]; log 0 = -inf
    return out, lse


def _paged_keys(cache, page_table_row, length):
    pages = cache[page_table_row.long()]
    return pages.reshape(-1, *cache.shape[2:])[:length].to(F64)


class FakeFA3:
    """`flash_attn_interface` with `flash_attn_3_gpu.fwd` (keywords as the op schema names)."""

    def __init__(self):
        self.calls: list[dict] = []
        self.flash_attn_3_gpu = types.SimpleNamespace(fwd=self.fwd)

    def fwd(self, q, k, v, *, out, softmax_scale, is_causal, window_size_left,
            window_size_right, sinks=None, cu_seqlens_q=None, cu_seqlens_k=None,
            seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, page_table=None,
            num_splits=0, **rest):  # fmt: skip
        call = dict(q=q, k=k, v=v, out=out, softmax_scale=softmax_scale, is_causal=is_causal,
                    window_size_left=window_size_left, window_size_right=window_size_right,
                    sinks=sinks, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                    seqused_k=seqused_k, page_table=page_table, max_seqlen_q=max_seqlen_q,
                    num_splits=num_splits, **rest)  # fmt: skip
        self.calls.append(call)
        assert sinks is None or sinks.dtype == torch.bfloat16, "sinks must have dtype bfloat16"
        assert q.dtype == k.dtype == v.dtype, "query and key must have the same dtype"
        assert out.dtype == q.dtype and out.stride(-1) == 1
        assert page_table is None or page_table.dtype == torch.int32
        ragged = cu_seqlens_q is not None
        batch = cu_seqlens_q.numel() - 1 if ragged else q.shape[0]
        num_q = q.shape[-2]
        lse = torch.full((num_q, q.shape[0]) if ragged else (batch, num_q, q.shape[1]), 7.0)
        for b in range(batch):
            rows = slice(int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])) if ragged else b
            if page_table is not None:
                length = int(seqused_k[b])
                keys = _paged_keys(k, page_table[b], length)
                vals = _paged_keys(v, page_table[b], length)
            else:
                ks = slice(int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1]))
                keys, vals = k[ks].to(F64), v[ks].to(F64)
            o, row_lse = _attend(
                q[rows].to(F64), keys, vals, scale=softmax_scale, causal=is_causal,
                left=window_size_left, right=window_size_right, sinks=sinks,
            )  # fmt: skip
            row_lse = torch.where(row_lse == -math.inf, math.inf, row_lse)
            out[rows] = o.to(out.dtype)
            if ragged:
                lse[:, rows] = row_lse.float()
            else:
                lse[b] = row_lse.float()
        return out, lse, None, None


class FakeFlashInfer:
    """`flashinfer` with decode.trtllm_batch_decode_with_kv_cache, the attention-sink wrapper
    and fused_moe.cutlass_fused_moe / trtllm_fp4_block_scale_routed_moe (recording)."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []
        self.decode = types.SimpleNamespace(trtllm_batch_decode_with_kv_cache=self.trtllm_decode)
        self.tuning = False
        self.fused_moe = types.SimpleNamespace(
            cutlass_fused_moe=self.cutlass_fused_moe,
            interleave_moe_weights_for_sm90_mixed_gemm=self.interleave_sm90_weights,
            trtllm_fp4_block_scale_routed_moe=self.trtllm_fp4_routed_moe,
        )
        fake = self

        class Wrapper(_SinkWrapper):
            def __init__(self, *args, **kwargs):
                super().__init__(fake, *args, **kwargs)

        self.BatchAttentionWithAttentionSinkWrapper = Wrapper

    def trtllm_decode(self, *, query, kv_cache, workspace_buffer, block_tables, seq_lens,
                      max_seq_len, bmm1_scale, bmm2_scale, window_left, out, sinks,
                      kv_layout, backend, q_len_per_req):  # fmt: skip
        self.calls.append(("trtllm_batch_decode_with_kv_cache", dict(locals())))
        k_cache, v_cache = kv_cache
        assert kv_layout == "NHD" and q_len_per_req == 1
        assert workspace_buffer.dtype == torch.uint8 and not workspace_buffer.any()
        assert seq_lens.dtype == torch.int32 and block_tables.dtype == torch.int32
        assert sinks is None or (sinks.dtype == torch.float32 and sinks.shape == query.shape[1:2])
        assert backend != "xqa" or out.dtype == query.dtype, "Output and query must match"
        for b in range(query.shape[0]):
            length = int(seq_lens[b])
            keys = _paged_keys(k_cache, block_tables[b], length)
            vals = _paged_keys(v_cache, block_tables[b], length)
            o, _ = _attend(query[b : b + 1].to(F64), keys, vals * bmm2_scale, scale=bmm1_scale,
                           causal=True, left=window_left, right=-1, sinks=sinks)  # fmt: skip
            out[b] = o[0].to(out.dtype)
        return out

    @contextlib.contextmanager
    def autotune(self, tune_mode=True):
        """`flashinfer.autotune`: the calls inside it record `tuning`."""
        self.calls.append(("autotune", {"tune_mode": tune_mode}))
        self.tuning = tune_mode
        try:
            yield
        finally:
            self.tuning = False

    def interleave_sm90_weights(self, weight, quant_type):
        self.calls.append(("interleave_moe_weights_for_sm90_mixed_gemm", dict(locals())))
        assert weight.dtype == torch.uint8 and weight.dim() == 3 and quant_type == "fp4"
        return sm90_weight_interleave(weight)

    def cutlass_fused_moe(
        self, *, input, token_selected_experts, token_final_scales, fc1_expert_weights,
        fc2_expert_weights, output_dtype, quant_scales, fc1_expert_biases, fc2_expert_biases,
        swiglu_alpha, swiglu_beta, swiglu_limit, output, use_w4_group_scaling,
        tune_max_num_tokens,
    ):  # fmt: skip
        self.calls.append(("cutlass_fused_moe", dict(locals(), tuning=self.tuning)))
        assert use_w4_group_scaling and input.dtype == torch.bfloat16
        assert token_selected_experts.dtype == torch.int32
        assert token_final_scales.dtype == torch.float32
        fc1, fc2 = (sm90_weight_interleave(w) for w in (fc1_expert_weights, fc2_expert_weights))
        w1 = _dequant_interleaved(fc1, quant_scales[0])  # [E, 2I, H]
        w2 = _dequant_interleaved(fc2, quant_scales[1])  # [E, H, I]
        inter = w1.shape[1] // 2
        x = input.to(F64)
        acc = torch.zeros(x.shape, dtype=F64)
        for t in range(x.shape[0]):
            for j in range(token_selected_experts.shape[1]):
                e = int(token_selected_experts[t, j])
                h = w1[e] @ x[t]
                if fc1_expert_biases is not None:
                    h = h + fc1_expert_biases[e].to(F64)
                up, gate = h[:inter], h[inter:]
                if swiglu_limit is not None:
                    limit = float(swiglu_limit[e])
                    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
                a = (
                    gate
                    * torch.sigmoid(float(swiglu_alpha[e]) * gate)
                    * (up + float(swiglu_beta[e]))
                )
                y = w2[e] @ a
                if fc2_expert_biases is not None:
                    y = y + fc2_expert_biases[e].to(F64)
                acc[t] += float(token_final_scales[t, j]) * y
        output.copy_(acc.to(output_dtype))
        return output

    def trtllm_fp4_routed_moe(self, **kwargs):
        self.calls.append(("trtllm_fp4_block_scale_routed_moe", kwargs))
        kwargs["output"].zero_()
        return [kwargs["output"]]

    # trtllm-gen weight preparation helpers: recorded identities (their layouts are the
    # library's; only that each is applied where vLLM applies it is checked on the CPU).
    def reorder_rows_for_gated_act_gemm(self, x):
        self.calls.append(("reorder_rows_for_gated_act_gemm", dict(shape=tuple(x.shape))))
        return x

    def shuffle_matrix_a(self, x, epilogue_tile_m):
        self.calls.append(("shuffle_matrix_a", dict(shape=tuple(x.shape), tile=epilogue_tile_m)))
        return x

    def shuffle_matrix_sf_a(self, x, epilogue_tile_m):
        self.calls.append(("shuffle_matrix_sf_a", dict(shape=tuple(x.shape), tile=epilogue_tile_m)))
        return x


def sm90_weight_interleave(weight: torch.Tensor) -> torch.Tensor:
    """The stand-in byte order of the sm90 mixed-input weights: each run of 8 bytes along K
    reversed (its own inverse; K/2 is a multiple of 64 after the 128 padding)."""
    E, N, half_k = weight.shape
    return weight.reshape(E, N, half_k // 8, 8).flip(-1).reshape(E, N, half_k).contiguous()


def _dequant_interleaved(weights: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The W4A16 layout read back: scales [E, K/128, N*4], entry (j, 4n + t) is row n's
    K-block 4j + t."""
    E, N, half_k = weights.shape
    groups = scales.shape[1]
    linear = torch.empty(E, N, groups * 4, dtype=torch.uint8)
    for j in range(groups):
        for t in range(4):
            linear[:, :, 4 * j + t] = scales[:, j, t::4]
    return dequantize_mxfp4(weights, linear, dtype=F64)


class _SinkWrapper:
    def __init__(self, fake, float_workspace_buffer, *, kv_layout, backend, q_data_type,
                 kv_data_type, head_dim_qk, head_dim_vo, window_left):  # fmt: skip
        assert kv_layout == "NHD" and float_workspace_buffer.dtype == torch.uint8
        self.fake = fake
        self.init = dict(window_left=window_left, head_dim=head_dim_qk, dtype=q_data_type)
        self.planned = None

    def plan(
        self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
        num_qo_heads, num_kv_heads, head_dim_qk, page_size, *, causal, sm_scale, window_left,
        q_data_type, kv_data_type,
    ):  # fmt: skip
        self.planned = dict(locals())
        for t in (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len):
            assert t.dtype == torch.int32
        assert (window_left >= 0) == (self.init["window_left"] >= 0)
        assert head_dim_qk == self.init["head_dim"] and q_data_type == self.init["dtype"]
        self.fake.calls.append(("plan", self.planned))

    def run(self, q, kv, sink, sm_scale, *, out, lse, return_lse):
        plan = self.planned
        qo, kv_indptr = plan["qo_indptr"], plan["paged_kv_indptr"]
        assert q.shape[0] == int(qo[-1]), "q.shape[0] does not match qo_indptr[-1]"
        assert sink.dtype == torch.float32 and (lse is not None) == return_lse
        k_pages, v_pages = kv
        page = plan["page_size"]
        self.fake.calls.append(
            ("run", dict(self=self, q=q, paged_kv_cache=kv, args=(sink, sm_scale), out=out,
                         lse=lse, return_lse=return_lse))
        )  # fmt: skip
        for b in range(qo.numel() - 1):
            rows = slice(int(qo[b]), int(qo[b + 1]))
            ids = plan["paged_kv_indices"][int(kv_indptr[b]) : int(kv_indptr[b + 1])]
            length = (ids.numel() - 1) * page + int(plan["paged_kv_last_page_len"][b])
            keys = _paged_keys(k_pages, ids, length)
            vals = _paged_keys(v_pages, ids, length)
            o, row_lse = _attend(q[rows].to(F64), keys, vals, scale=sm_scale,
                                 causal=plan["causal"], left=plan["window_left"], right=-1,
                                 sinks=sink)  # fmt: skip
            out[rows] = o.to(out.dtype)
            if lse is not None:
                lse[rows] = (row_lse.t() / math.log(2.0)).float()
