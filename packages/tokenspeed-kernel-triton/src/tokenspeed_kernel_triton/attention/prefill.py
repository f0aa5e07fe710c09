"""Ragged (varlen) flash attention for prefill: causal or not, GQA, sliding window, sinks, lse.

One program computes one tile of BLOCK_M query rows of one sequence (BLOCK_M / H tokens of the
H query heads that share a KV head: GQA packing) and walks only the key blocks those rows can
see: causality bounds the end, the window the start (blocks left of the window are never
loaded). The visited range splits into masked edge blocks (the causal diagonal, the window's
left edge, the sequence tail) and an unmasked middle.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import (
    LOG2E,
    AttentionConfig,
    ConfigPin,
    DeviceKind,
    attn_block_update,
    attn_finalize,
    device_kind,
    key_block_bounds,
    packed_rows,
    store_rows,
)

HEAD_DIMS = (64, 128)


@triton.jit
def _prefill_key_loop(
    acc,
    l_i,
    m_i,
    q,
    k_base,
    v_base,
    rows,
    lo,
    hi,
    seq_k,
    window_left,
    qk_scale,
    stride_kt,
    stride_vt,
    offs_n,
    offs_d,
    BLOCK_N: tl.constexpr,
    MASK: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + offs_n
        # 64-bit block base, 32-bit offsets inside the block: no overflow at any length.
        n0_64 = tl.cast(n0, tl.int64)
        k_ptrs = k_base + n0_64 * stride_kt + offs_n[None, :] * stride_kt + offs_d[:, None]
        v_ptrs = v_base + n0_64 * stride_vt + offs_n[:, None] * stride_vt + offs_d[None, :]
        if MASK:
            # Keys past the sequence end belong to the next sequence (or lie past the tensor).
            k = tl.load(k_ptrs, mask=cols[None, :] < seq_k, other=0.0)
            v = tl.load(v_ptrs, mask=cols[:, None] < seq_k, other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        acc, l_i, m_i = attn_block_update(
            acc,
            l_i,
            m_i,
            q,
            k,
            v,
            qk_scale,
            rows,
            cols,
            seq_k,
            window_left,
            MASK,
            IS_CAUSAL,
            HAS_WINDOW,
        )
    return acc, l_i, m_i


@triton.jit
def _prefill_kernel(
    Q,
    K,
    V,
    Out,
    Lse,
    Sinks,
    CuSeqlens,
    qk_scale,
    window_left,
    num_m_blocks,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lt,
    GROUP: tl.constexpr,
    HEADS_PER_TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_LSE: tl.constexpr,
    SPLIT_MASK: tl.constexpr,
):
    TOKENS: tl.constexpr = BLOCK_M // HEADS_PER_TILE
    pid_m = tl.program_id(0)
    head_base = tl.program_id(1) * HEADS_PER_TILE
    seq = tl.program_id(2)
    if IS_CAUSAL and not HAS_WINDOW:
        # Causal work grows with the block index: launch the heaviest blocks first so the
        # last wave is made of short ones (load balance across SMs).
        pid_m = num_m_blocks - 1 - pid_m
    start = tl.load(CuSeqlens + seq)
    seqlen = tl.load(CuSeqlens + seq + 1) - start
    t0 = pid_m * TOKENS
    if t0 >= seqlen:
        return
    kv_head = head_base // GROUP
    tok0 = start.to(tl.int64)
    rows, heads = packed_rows(t0, head_base, BLOCK_M, HEADS_PER_TILE)
    row_ok = rows < seqlen
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    tile0 = tok0 + t0  # int64 first token of the tile; in-tile offsets stay 32-bit
    local = rows - t0
    q = tl.load(
        Q + tile0 * stride_qt + (local * stride_qt + heads * stride_qh)[:, None] + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    k_base = K + tok0 * stride_kt + kv_head * stride_kh
    v_base = V + tok0 * stride_vt + kv_head * stride_vh

    last_row = tl.minimum(t0 + TOKENS, seqlen) - 1
    lo, full_lo, full_hi, hi = key_block_bounds(
        t0, last_row, seqlen, window_left, BLOCK_N, IS_CAUSAL, HAS_WINDOW
    )

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if not SPLIT_MASK:
        acc, l_i, m_i = _prefill_key_loop(
            acc,
            l_i,
            m_i,
            q,
            k_base,
            v_base,
            rows,
            lo,
            hi,
            seqlen,
            window_left,
            qk_scale,
            stride_kt,
            stride_vt,
            offs_n,
            offs_d,
            BLOCK_N,
            True,
            IS_CAUSAL,
            HAS_WINDOW,
        )
    else:
        if HAS_WINDOW:
            acc, l_i, m_i = _prefill_key_loop(
                acc,
                l_i,
                m_i,
                q,
                k_base,
                v_base,
                rows,
                lo,
                full_lo,
                seqlen,
                window_left,
                qk_scale,
                stride_kt,
                stride_vt,
                offs_n,
                offs_d,
                BLOCK_N,
                True,
                IS_CAUSAL,
                HAS_WINDOW,
            )
        acc, l_i, m_i = _prefill_key_loop(
            acc,
            l_i,
            m_i,
            q,
            k_base,
            v_base,
            rows,
            full_lo,
            full_hi,
            seqlen,
            window_left,
            qk_scale,
            stride_kt,
            stride_vt,
            offs_n,
            offs_d,
            BLOCK_N,
            False,
            IS_CAUSAL,
            HAS_WINDOW,
        )
        acc, l_i, m_i = _prefill_key_loop(
            acc,
            l_i,
            m_i,
            q,
            k_base,
            v_base,
            rows,
            full_hi,
            hi,
            seqlen,
            window_left,
            qk_scale,
            stride_kt,
            stride_vt,
            offs_n,
            offs_d,
            BLOCK_N,
            True,
            IS_CAUSAL,
            HAS_WINDOW,
        )

    acc, lse = attn_finalize(acc, l_i, m_i, Sinks, heads, HAS_SINKS)
    store_rows(
        Out + tile0 * stride_ot,
        Lse + tile0 * stride_lt,
        acc,
        lse,
        local * stride_ot + heads * stride_oh,
        local * stride_lt + heads,
        row_ok,
        offs_d,
        HAS_LSE,
    )


# ----------------------------------------------------------------------------- launcher

_PIN = ConfigPin()


def pin_config(config: AttentionConfig):
    """Context manager: run mha_prefill with `config` instead of the heuristic's choice."""
    return _PIN.pin(config)


def choose_config(kind: DeviceKind, head_dim: int, window: bool) -> AttentionConfig:
    """Tile config for a device kind; each branch names the hardware reason."""
    if kind.vendor == "interpreter":
        # The interpreter runs every block op in numpy: small tiles keep CPU tests fast while
        # short sequences still cross several blocks (masked and unmasked paths both run).
        return AttentionConfig(32, 16, 1, 1, heads_per_tile=2)
    if kind.vendor == "amd":
        # CDNA: 64-wide wavefronts, 4 warps fill a CU's SIMDs; LDS is 64 KB on gfx942 (160 KB on
        # gfx950) so hd 128 drops to single-buffered K/V there.
        stages = 1 if head_dim > 64 and kind.arch == "gfx942" else 2
        return AttentionConfig(128, 64, 4, stages, heads_per_tile=8)
    if kind.sm == 90:
        # Hopper: GQA packing puts 8 heads x 16 tokens in a 128-row tile over 8 warps (two
        # warpgroups, wgmma m64 each); K/V load once per 8 heads; 3 stages of 64-key blocks
        # measured best (H100: 411-435 TFLOP/s causal hd 64, vs 329-368 with 128-key blocks).
        # A sliding window (memory-bound: each tile visits ~5 key blocks) wants short tiles
        # (8 tokens x 8 heads) on 32-key blocks in one masked loop: little masked waste, one
        # pipeline warm-up per tile.
        if window:
            return AttentionConfig(64, 32, 4, 3, heads_per_tile=8, split_mask=False)
        return AttentionConfig(128, 64, 8, 3, heads_per_tile=8)
    # Ampere/Ada (mma.sync) and newer parts: 4 warps x 32 rows; 2-3 cp.async stages fit
    # 100-164 KB of shared memory.
    return AttentionConfig(128, 64, 4, 3 if head_dim <= 64 else 2, heads_per_tile=8)


def mha_prefill(
    q,
    k,
    v,
    *,
    cu_seqlens,
    max_seqlen,
    causal,
    window_left,
    sinks,
    softmax_scale,
    out,
    lse,
):
    """Ragged self-attention; writes `out` and, unless None, `lse`.

    q [T, Hq, D], k/v [T, Hkv, D] bf16/fp16 (last dim contiguous); cu_seqlens [B+1] int32;
    max_seqlen >= every sequence length; sinks [Hq] float32/bfloat16 or None;
    out [T, Hq, D]; lse [T, Hq] float32 or None. Arguments arrive validated.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs = cu_seqlens.shape[0] - 1
    if num_tokens == 0 or num_seqs == 0 or max_seqlen == 0:
        return
    has_window = window_left >= 0
    config = _PIN.pinned or choose_config(device_kind(q.device), head_dim, has_window)
    group = num_q_heads // k.shape[1]
    heads_per_tile = config.packing(group)
    num_m_blocks = triton.cdiv(max_seqlen, config.block_m // heads_per_tile)
    grid = (num_m_blocks, num_q_heads // heads_per_tile, num_seqs)
    _prefill_kernel[grid](
        q,
        k,
        v,
        out,
        out if lse is None else lse,
        q if sinks is None else sinks,
        cu_seqlens,
        softmax_scale * LOG2E,
        window_left,
        num_m_blocks,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        0 if lse is None else lse.stride(0),
        GROUP=group,
        HEADS_PER_TILE=heads_per_tile,
        HEAD_DIM=head_dim,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        IS_CAUSAL=causal,
        HAS_WINDOW=has_window,
        HAS_SINKS=sinks is not None,
        HAS_LSE=lse is not None,
        SPLIT_MASK=config.split_mask,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


# ----------------------------------------------------------------------------- AOT specs


def aot_specs(kind: DeviceKind) -> list:
    """Specializations GPT-OSS-like models launch on `kind`, with the launcher's config, for
    the ahead-of-time compile check (tokenspeed_kernel_triton.aot)."""
    from ..aot import AotSpec

    strides = (
        "stride_qt",
        "stride_qh",
        "stride_kt",
        "stride_kh",
        "stride_vt",
        "stride_vh",
        "stride_ot",
        "stride_oh",
        "stride_lt",
    )
    specs = []
    # bf16 at every structure GPT-OSS-like models launch; fp16 once (same code, other dtype).
    for dtype, head_dim, window in (
        ("bf16", 64, False),
        ("bf16", 64, True),
        ("bf16", 128, False),
        ("fp16", 64, True),
    ):
        config = choose_config(kind, head_dim, window)
        signature = {
            "Q": f"*{dtype}",
            "K": f"*{dtype}",
            "V": f"*{dtype}",
            "Out": f"*{dtype}",
            "Lse": "*fp32",
            "Sinks": "*fp32",
            "CuSeqlens": "*i32",
            "qk_scale": "fp32",
            "window_left": "i32",
            "num_m_blocks": "i32",
            **dict.fromkeys(strides, "i32"),
        }
        constexprs = dict(
            GROUP=8,
            HEADS_PER_TILE=config.packing(8),
            HEAD_DIM=head_dim,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            IS_CAUSAL=True,
            HAS_WINDOW=window,
            HAS_SINKS=True,
            HAS_LSE=True,
            SPLIT_MASK=config.split_mask,
        )
        name = f"prefill_{dtype}_hd{head_dim}{'_window' if window else ''}"
        specs.append(
            AotSpec(
                name, _prefill_kernel, signature, constexprs, config.num_warps, config.num_stages
            )
        )
    return specs
