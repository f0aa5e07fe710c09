"""Reference points outside the registry for `bench --peers`, used only where importable.

- `peer:fa3`: FlashAttention-3 through `flash_attn_interface` (varlen prefill; paged extend and
  decode through `flash_attn_with_kvcache`), with sinks and sliding windows.
- `peer:torch.sdpa`: `torch.nn.functional.scaled_dot_product_attention` on contiguous tensors. It
  has no sinks and no paging: for decode the visible keys are gathered into contiguous K/V
  before timing, so it shows the cost of the attention math alone, not a paged kernel's.
- `peer:vllm.triton_kernels` (moe_apply): what vLLM 0.26 runs for GPT-OSS's MXFP4 MoE on
  Hopper, its TRITON backend (`fused_moe/oracle/mxfp4.py`): OpenAI's `triton_kernels`, which
  the vLLM wheel vendors at `vllm/third_party/triton_kernels` and which imports as top-level
  `triton_kernels` without vLLM. `TritonKernelsMoE` makes the same calls in the same order as
  vLLM's `triton_kernel_moe_forward` (see its docstring) on our checkpoint weights.

Peers are timed on the same inputs but never selected. The MoE peer rounds where the reference
does not (bf16 SwiGLU intermediate, bf16 per-expert outputs), so tests/tools/test_moe_peer_gpu.py
and benchmarks/bench_moe.py check it against `triton_kernels_moe_emulation`, the reference's
math rounded at those points, and `moe_apply` against the reference.
"""

from __future__ import annotations

import hashlib
import importlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..formats.fp8 import FP8_DTYPE
from ..ops.moe.types import MoEConfig, MoEWeights
from ..testing.compare import Comparison, tolerance
from .workloads import Point

PeerCall = Callable[[], object]


MOE_PEER = "peer:vllm.triton_kernels"
ATTENTION_PEERS = ("peer:fa3", "peer:torch.sdpa")


def peer_names(op: str) -> tuple[str, ...]:
    """The peers `peer_calls` lists for `op` (each listed, importable or not)."""
    if op == "moe_apply":
        return (MOE_PEER,)
    if op in ("mha_prefill", "mha_extend_with_kvcache", "mha_decode_with_kvcache"):
        return ATTENTION_PEERS
    return ()


def peer_calls(
    point: Point, inputs, device: torch.device, moe_weights: MoEWeights | None = None
) -> list[tuple[str, PeerCall | None, str]]:
    """(peer name, call or None, note) for each peer that applies to this op. moe_apply's
    peer runs on `moe_weights`, the checkpoint weights the registered kernels were given."""
    if point.op == "moe_apply":
        try:
            call, note = _moe(point, inputs, device, moe_weights)
        except ImportError as exc:
            call, note = None, f"not importable ({exc})"
        return [(MOE_PEER, call, note)]
    if point.op not in ("mha_prefill", "mha_extend_with_kvcache", "mha_decode_with_kvcache"):
        return []
    found = []
    for name, make in (("peer:fa3", _fa3), ("peer:torch.sdpa", _sdpa)):
        try:
            call, note = make(point, inputs, device)
        except ImportError as exc:
            call, note = None, f"not importable ({exc})"
        found.append((name, call, note))
    return found


def _fa3(point: Point, inputs, device):
    if device.type != "cuda":
        return None, "needs a CUDA GPU"
    fa3 = importlib.import_module("flash_attn_interface")
    s = point.case.shape
    if s.cache_dtype == FP8_DTYPE:
        return None, "fp8 cache not wired up for this peer"
    args, kw = inputs
    window = (s.window_left, 0) if s.window_left >= 0 else (-1, -1)
    # This FA3 build takes bf16 sinks ("sinks must have dtype bfloat16", seen on an H200).
    sinks = None if kw["sinks"] is None else kw["sinks"].to(torch.bfloat16)
    common = dict(softmax_scale=kw["softmax_scale"], causal=True, window_size=window, sinks=sinks)
    q = args[0]
    if point.op == "mha_prefill":
        cu = kw["cu_seqlens"]
        return (
            lambda: fa3.flash_attn_varlen_func(
                q, args[1], args[2], cu, cu, kw["max_seqlen"], kw["max_seqlen"], **common
            )
        ), ""
    paged = dict(page_table=kw["page_table"], cache_seqlens=kw["cache_seqlens"], **common)
    if point.op == "mha_extend_with_kvcache":
        paged.update(cu_seqlens_q=kw["cu_seqlens_q"], max_seqlen_q=kw["max_seqlen_q"])
    return (lambda: fa3.flash_attn_with_kvcache(q, args[1], args[2], **paged)), ""


def _sdpa(point: Point, inputs, device):
    s = point.case.shape
    sdpa = torch.nn.functional.scaled_dot_product_attention
    args, kw = inputs
    gqa = s.num_q_heads != s.num_kv_heads
    if point.op == "mha_prefill":
        if s.window_left >= 0 or len(set(s.seqlens)) != 1:
            return None, "no sliding window / needs equal lengths"
        batch, n = len(s.seqlens), s.seqlens[0]

        def split(x):
            return x.view(batch, n, x.shape[1], x.shape[2]).transpose(1, 2)

        q, k, v = (split(x) for x in args)
        return (
            lambda: sdpa(q, k, v, is_causal=True, scale=kw["softmax_scale"], enable_gqa=gqa)
        ), "no sinks"
    if point.op != "mha_decode_with_kvcache" or s.q_lens[0] != 1 or s.cache_dtype == FP8_DTYPE:
        return None, "decode Q=1 bf16/fp16 only"
    if len(set(s.seqlens)) != 1:
        return None, "needs equal lengths"
    length = s.seqlens[0]
    first = 0 if s.window_left < 0 else max(0, length - 1 - s.window_left)
    k, v = (_contiguous(cache, kw["page_table"], first, length) for cache in args[1:3])
    q = args[0].transpose(1, 2)  # [B, Hq, 1, D]
    return (
        lambda: sdpa(q, k, v, scale=kw["softmax_scale"], enable_gqa=gqa)
    ), "no sinks, contiguous KV (no paging)"


def _contiguous(cache: torch.Tensor, page_table: torch.Tensor, first: int, end: int):
    """Positions first..end-1 of every sequence as [B, Hkv, end - first, D]."""
    page_size = cache.shape[1]
    pos = torch.arange(first, end, device=cache.device)
    pages = page_table[:, pos // page_size].long()
    return cache[pages, pos % page_size].transpose(1, 2).contiguous()


# ------------------------------------------------------------------------------------ MoE peer

# sha256 over the vendored package's *.py files (relative path, NUL, bytes, NUL; sorted by
# path) as the vllm==0.26.0 wheel ships them at vllm/third_party/triton_kernels.
VLLM_0_26_TRITON_KERNELS_SHA256 = "a3e52239bbf2b00f4efd365356203efa844e4ba7c73930bbb4f519e402f6d19b"
# vLLM's TRITON MXFP4 backend rounds I up to a multiple of 64 and leaves H as it is
# (`mxfp4_round_up_hidden_size_and_intermediate_size`); GPT-OSS's 2880 needs no padding.
INTERMEDIATE_MULTIPLE = 64
# On sm_90 vLLM pads each weight's number of e8m0 scale groups along K to a multiple of 4
# before swizzling (`_swizzle_mxfp4`).
SCALE_GROUP_MULTIPLE = 4
SCALE_WARPS = 8  # `_swizzle_mxfp4`'s default num_warps for the Hopper scale layout
# compare_to_emulation: how many outputs may round one step the other way (see there).
FLIP_FRACTION = 1 / 4000
FLIP_FLOOR = 4


def source_sha256(root: Path) -> str:
    """sha256 over a package's .py files: each one's path relative to `root`, then its bytes."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def triton_kernels_origin() -> str:
    """Where `triton_kernels` is imported from and whether it is vLLM 0.26.0's vendored copy
    (by content hash); raises ImportError where it is not importable."""
    tk = importlib.import_module("triton_kernels")
    root = Path(tk.__file__).resolve().parent
    sha = source_sha256(root)
    if sha == VLLM_0_26_TRITON_KERNELS_SHA256:
        # The hash names it: where a machine keeps its copy does not go into results files.
        return (
            f"triton_kernels (sha256 {sha[:12]}, vLLM 0.26.0 wheel's vendored copy "
            "(vllm/third_party/triton_kernels))"
        )
    # Relative where it can be: the origin goes into committed results files.
    where = os.path.relpath(root) if root.is_relative_to(Path.cwd()) else root.name
    return f"triton_kernels at {where} (sha256 {sha[:12]}, not vLLM 0.26.0's vendored copy)"


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True, eq=False)
class TritonKernelsWeights:
    """One MoE layer in the logical layout triton_kernels' matmul_ogs takes for MXFP4 weights,
    before its Hopper swizzle: W[e] is [K, N] (y = x @ W[e]), packed two e2m1 codes a byte
    along K (low nibble = even k; K is the stride-1 dim), one e8m0 scale per 32 K-elements.

    w13 [E, H/2, 2Ip] with w13_scale [E, Hs, 2Ip] and w13_bias [E, 2Ip] float32: output
    columns interleave gate (even) and up (odd) as the checkpoint's rows do, which is what
    triton_kernels' swiglu reads (`_swiglu_fn` splits pairs into gelu, linear).
    w2 [E, Ip/2, H] with w2_scale [E, Is, H] and w2_bias [E, H] float32.
    Ip = I rounded up to INTERMEDIATE_MULTIPLE (zero codes, zero scale bytes, zero biases:
    padded gate/up pairs give swiglu(0, 0) = 0 and padded w2 rows add nothing); Hs, Is =
    H/32, Ip/32 rounded up to SCALE_GROUP_MULTIPLE (groups past K are never read).
    Tensors are transposed views of [E, N, K/2]-contiguous copies, as vLLM passes them.
    """

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w13_bias: torch.Tensor | None
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w2_bias: torch.Tensor | None
    intermediate_size: int  # Ip


def moe_peer_unsupported(config: MoEConfig) -> str:
    """Why the triton_kernels peer cannot run `config` ("" when it can): vLLM runs it for
    MXFP4 weights, bf16 activations, top-k softmax routing and SwiGLU only."""
    if config.weight_format != "mxfp4":
        return f"MXFP4 weights only (got {config.weight_format})"
    if config.activation_format != "bf16":
        return f"bf16 activations only (got {config.activation_format})"
    if config.routing != "topk_softmax":
        return f"top-k softmax routing only (got {config.routing})"
    if config.expert_parallel and (
        config.expert_offset != 0 or config.num_experts % config.num_local_experts
    ):
        return (
            f"expert-parallel rank 0 of an even split only (got experts {config.expert_offset}"
            f"..{config.expert_offset + config.num_local_experts - 1} of {config.num_experts}): "
            "triton_kernels simulates expert parallelism by keeping the first E/ep experts"
        )
    return ""


def triton_kernels_layout(config: MoEConfig, weights: MoEWeights) -> TritonKernelsWeights:
    """Our checkpoint-layout MXFP4 weights -> triton_kernels' logical layout (plain torch,
    any device; new tensors, `weights` untouched)."""
    reason = moe_peer_unsupported(config)
    if reason:
        raise ValueError(f"triton_kernels_layout: {reason}")
    e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
    ip = _round_up(i, INTERMEDIATE_MULTIPLE)
    want = {
        "w13": (e, 2 * i, h // 2),
        "w13_scale": (e, 2 * i, h // 32),
        "w2": (e, h, i // 2),
        "w2_scale": (e, h, i // 32),
    }
    for name, shape in want.items():
        t = getattr(weights, name)
        if t is None or tuple(t.shape) != shape or t.dtype != torch.uint8:
            got = "None" if t is None else f"{tuple(t.shape)} {t.dtype}"
            raise ValueError(f"triton_kernels_layout: {name} is {got}, expected {shape} uint8")

    def pad(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        # [E, R, C] -> [E, rows, cols], zeros after the end of each dim.
        return torch.nn.functional.pad(t, (0, cols - t.shape[2], 0, rows - t.shape[1]))

    def groups(k: int) -> int:
        return _round_up(k // 32, SCALE_GROUP_MULTIPLE)

    # Checkpoint rows are output features (N) and the packed bytes run along K: padding
    # appends gate/up pairs after the last (interleave kept) and K columns to w2.
    w13 = pad(weights.w13, 2 * ip, h // 2)
    s13 = pad(weights.w13_scale, 2 * ip, groups(h))
    w2 = pad(weights.w2, h, ip // 2)
    s2 = pad(weights.w2_scale, h, groups(ip))
    b13 = b2 = None
    if config.has_bias:
        if weights.w13_bias is None or weights.w2_bias is None:
            raise ValueError("triton_kernels_layout: has_bias is set but a bias is None")
        b13 = torch.nn.functional.pad(weights.w13_bias.float(), (0, 2 * ip - 2 * i))
        b2 = weights.w2_bias.to(torch.float32, copy=True)
    return TritonKernelsWeights(
        w13=w13.transpose(1, 2),
        w13_scale=s13.transpose(1, 2),
        w13_bias=b13,
        w2=w2.transpose(1, 2),
        w2_scale=s2.transpose(1, 2),
        w2_bias=b2,
        intermediate_size=ip,
    )


class TritonKernelsMoE:
    """vLLM 0.26's GPT-OSS MoE on Hopper (TRITON MXFP4 backend) on our checkpoint weights.

    Weights (vLLM's `convert_gpt_oss_weight_to_mxfp4_moe_kernel_format` for TRITON, then
    `_swizzle_mxfp4`): biases to float32; on sm_90 matmul_ogs is constrained to split_k=1;
    each weight and its scales are wrapped as FP4 / e8m0 tensors in the logical layout above
    and converted to the default MXFP4 value layout (mx_axis=1) and scale layout (mx_axis=1,
    8 warps); a PrecisionConfig carries the scales with an identity InFlexData.
    Forward (`triton_kernel_moe_forward` with renormalize=True, no expert map, the vendored
    triton_kernels' legacy API): `routing(logits, k, sm_first=False)` (top-k, then softmax over
    the k); matmul_ogs(x, w13, b13) gathering rows by the gather index with swiglu (alpha,
    limit; pairs reduced 2 -> 1) fused, into a [1, M*k, Ip] bf16 intermediate; matmul_ogs of
    that with w2, b2, scattered and summed per token with gammas = the routing weights.

    An expert-parallel config runs as rank 0 of an even split: `routing`'s `simulated_ep`
    keeps the pairs of the first E/ep experts after the softmax over the global k, where vLLM
    maps global ids through its expert map before building the same routing data; the matmuls
    are the same. A token routed to no local expert gets no row from the scatter's reduction
    (`reduce_grouped` writes nothing for an empty group): `out` keeps what it held there, so
    a fresh one is zeroed and a caller's is the caller's to clear.
    """

    def __init__(self, config: MoEConfig, weights: MoEWeights):
        reason = moe_peer_unsupported(config)
        if reason:
            raise ValueError(f"TritonKernelsMoE: {reason}")
        from triton_kernels.matmul_ogs import FlexCtx, FnSpecs, FusedActivation, PrecisionConfig
        from triton_kernels.matmul_ogs_details import opt_flags
        from triton_kernels.numerics import InFlexData
        from triton_kernels.swiglu import swiglu_fn
        from triton_kernels.tensor import FP4, convert_layout, wrap_torch_tensor
        from triton_kernels.tensor_details import layout

        device = weights.w13.device
        if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
            raise ValueError(
                f"TritonKernelsMoE: reproduces vLLM's sm_90 path; {device} is not an sm_90 GPU"
            )
        self.config = config
        self.simulated_ep = config.num_experts // config.num_local_experts
        logical = triton_kernels_layout(config, weights)
        self.intermediate_size = logical.intermediate_size
        opt_flags.update_opt_flags_constraints({"split_k": 1})
        value_layout, value_opts = layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
        scale_layout, scale_opts = layout.make_default_matmul_mxfp4_w_scale_layout(
            mx_axis=1, num_warps=SCALE_WARPS
        )

        def swizzle(w: torch.Tensor, s: torch.Tensor):
            value = convert_layout(wrap_torch_tensor(w, dtype=FP4), value_layout, **value_opts)
            scale = convert_layout(wrap_torch_tensor(s), scale_layout, **scale_opts)
            precision = PrecisionConfig(weight_scale=scale, flex_ctx=FlexCtx(rhs_data=InFlexData()))
            return value, precision

        self.w13, self.w13_precision = swizzle(logical.w13, logical.w13_scale)
        self.w2, self.w2_precision = swizzle(logical.w2, logical.w2_scale)
        self.w13_bias, self.w2_bias = logical.w13_bias, logical.w2_bias
        swiglu = config.activation
        self.activation = FusedActivation(
            FnSpecs("swiglu", swiglu_fn, ("alpha", "limit")), (swiglu.alpha, swiglu.limit), 2
        )

    def __call__(
        self, x: torch.Tensor, router_logits: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """out [M, H] bf16 for x [M, H] bf16 and router_logits [M, E]."""
        from triton_kernels.matmul_ogs import matmul_ogs
        from triton_kernels.routing import routing

        m, h = x.shape
        k = self.config.top_k
        if out is None:
            out = torch.zeros_like(x) if self.simulated_ep > 1 else torch.empty_like(x)
        routing_data, gather, scatter = routing(
            router_logits, k, sm_first=False, simulated_ep=self.simulated_ep
        )
        intermediate = torch.empty(
            (1, m * k, self.intermediate_size), device=x.device, dtype=x.dtype
        )
        matmul_ogs(
            x,
            self.w13,
            self.w13_bias,
            routing_data,
            gather_indx=gather,
            precision_config=self.w13_precision,
            fused_activation=self.activation,
            y=intermediate,
        )
        matmul_ogs(
            intermediate.view(m * k, self.intermediate_size),
            self.w2,
            self.w2_bias,
            routing_data,
            scatter_indx=scatter,
            precision_config=self.w2_precision,
            gammas=routing_data.gate_scal,
            y=out.view(1, m, h),
        )
        return out


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(torch.float32)


def bf16_ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values (8 significant bits) at each |t|, as float32; 0 where t is 0."""
    mantissa, exponent = torch.frexp(t.float())
    return torch.where(mantissa == 0, 0.0, torch.exp2(exponent - 8.0))


def triton_kernels_moe_emulation(
    config: MoEConfig,
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`TritonKernelsMoE`'s function in plain torch, rounded where its kernels round, so the
    peer can be checked against it rather than against the float32 reference, which it
    legitimately misses by more than the bf16 tolerance (tests/tools/test_moe_peer.py measures
    how far at GPT-OSS sizes).

    Weights are the reference's float32 dequantized checkpoint tensors: w13 [E, 2I, H],
    w2 [E, H, I], biases [E, 2I] / [E, H] (ReferenceMoE.prepare_weights), E the config's local
    experts: pairs routed to other ranks' experts contribute nothing. Every GEMM accumulates
    in float32; the rounding points, as triton_kernels 0.26's matmul_ogs has them on sm_90:
    - routing: top-k of the logits, softmax over the k in float32, stored in the logits' dtype
      (`topk` forward), used as the second GEMM's gammas;
    - GEMM1 epilogue: + bias (float32), swiglu in float32, stored as the bf16 intermediate;
    - GEMM2 epilogue: (acc + bias) * gamma in float32, stored per (token, expert) in bf16 (the
      scatter with k > 1 is not fused: matmul_ogs writes an [M*k, H] scratch in the output dtype);
    - `reduce_grouped`: the k bf16 rows summed in float32, stored in bf16.

    Returns (out [M, H] bf16, steps [M, H] float32): steps is the sum over the k experts of one
    bf16 step at each stored per-expert value. The peer accumulates in another order, so a
    per-expert value near a rounding boundary may round one step the other way: the peer is
    within atol + rtol |out| of `out` (bf16 tolerance) plus `steps`.
    """
    from ..ops.moe.reference import topk_softmax

    m, h = x.shape
    k = config.top_k
    alpha, limit = config.activation.alpha, config.activation.limit
    gammas, ids = topk_softmax(router_logits, k)
    gammas = gammas.to(router_logits.dtype).float().reshape(-1)
    flat_ids = ids.reshape(-1).long()
    flat_tokens = torch.arange(m, device=x.device).repeat_interleave(k)
    xf = x.float()
    per_expert = torch.zeros(m * k, h, dtype=torch.float32, device=x.device)
    local_ids = flat_ids - config.expert_offset
    for e in local_ids.unique().tolist():
        if not 0 <= e < config.num_local_experts:
            continue
        rows = (local_ids == e).nonzero().squeeze(1)
        pre = xf[flat_tokens[rows]] @ w13[e].T
        if w13_bias is not None:
            pre = pre + w13_bias[e]
        gate = pre[:, 0::2].clamp(max=limit)
        up = pre[:, 1::2].clamp(-limit, limit)
        s = gate / (1 + torch.exp(-alpha * gate))
        a = _bf16(s * up + s)
        y = a @ w2[e].T
        if w2_bias is not None:
            y = y + w2_bias[e]
        per_expert[rows] = _bf16(y * gammas[rows, None])
    per_expert = per_expert.view(m, k, h)
    out = per_expert.sum(dim=1).to(torch.bfloat16)
    return out, bf16_ulp(per_expert).sum(dim=1)


def compare_to_emulation(
    got: torch.Tensor, emulated: torch.Tensor, steps: torch.Tensor, *, name: str
) -> Comparison:
    """The peer's output against `triton_kernels_moe_emulation`'s (out, steps): every element
    within the bf16 tolerance of out plus steps, and at most FLIP_FRACTION of them (or
    FLIP_FLOOR) beyond the bf16 tolerance alone. A per-expert value rounds the other way only
    where the two accumulation orders straddle a rounding boundary, which is rare: at GPT-OSS
    sizes (tests/tools/test_moe_peer.py) summing in another order moved 87 of 184320 outputs,
    1 beyond the bf16 tolerance, while the float32 reference, which does not round there, is
    beyond it at 0.08-0.7% of the elements: the check tells the peer's rounding from none."""
    tol = tolerance(torch.bfloat16)
    a = got.detach().to("cpu", torch.float64)
    e = emulated.detach().to("cpu", torch.float64)
    err = (a - e).abs().nan_to_num(nan=math.inf)
    plain = tol.atol + tol.rtol * e.abs()
    excess = err - (plain + steps.detach().to("cpu", torch.float64))
    bad = excess > 0
    beyond = int((err > plain).sum())
    flips = max(FLIP_FLOOR, int(FLIP_FRACTION * a.numel()))
    index = tuple(int(i) for i in torch.unravel_index(excess.reshape(-1).argmax(), a.shape))
    result = Comparison(
        name=f"{name} vs its emulation (+ one bf16 step per expert)",
        ok=not bool(bad.any()) and beyond <= flips,
        max_abs=float(err.max()),
        max_rel=float((err / e.abs().clamp(min=tol.atol)).max()),
        rms=float(err.pow(2).mean().sqrt()),
        worst_index=index,
        actual=float(a[index]),
        expected=float(e[index]),
        num_bad=int(bad.sum()),
        numel=a.numel(),
        atol=tol.atol,
        rtol=tol.rtol,
    )
    if result.ok or result.num_bad:
        return result
    return replace(
        result,
        message=f"{beyond}/{a.numel()} beyond the bf16 tolerance (atol={tol.atol:g} "
        f"rtol={tol.rtol:g}), more than the {flips} rounding flips allowed; max abs "
        f"{result.max_abs:.3e}, rms {result.rms:.3e}",
    )


# The last peer built: bench asks once per point, and every point of one MoE config shares
# its checkpoint weights.
_last_moe_peer: list = []


def moe_peer_for(config: MoEConfig, weights: MoEWeights) -> TritonKernelsMoE:
    """The peer for these weights, built once for consecutive calls with the same objects."""
    if _last_moe_peer and _last_moe_peer[0] is weights and _last_moe_peer[1] == config:
        return _last_moe_peer[2]
    _last_moe_peer.clear()
    peer = TritonKernelsMoE(config, weights)
    _last_moe_peer.extend((weights, config, peer))
    return peer


def _moe(point: Point, inputs, device, moe_weights: MoEWeights | None):
    origin = triton_kernels_origin()  # ImportError where triton_kernels is absent
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return None, "reproduces vLLM's sm_90 (Hopper) path; needs an sm_90 GPU"
    config = point.case.shape.config()
    reason = moe_peer_unsupported(config)
    if reason:
        return None, reason
    (x,), routing = inputs
    if routing.get("router_logits") is None:
        return None, "router logits only (vLLM's GPT-OSS path routes inside the layer)"
    if moe_weights is None:
        return None, "no checkpoint weights given"
    try:
        peer = moe_peer_for(config, moe_weights)
    except Exception as exc:  # a shape its layouts refuse is reported, not fatal to the run
        return None, f"cannot lay out these weights: {type(exc).__name__}: {exc}"[:300]
    logits = routing["router_logits"]
    out = torch.empty_like(x)
    return (lambda: peer(x, logits, out)), origin
