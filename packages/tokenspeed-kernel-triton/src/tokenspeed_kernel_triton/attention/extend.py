"""Chunked prefill over a paged KV cache ("NHD" pages [num_pages, P, Hkv, D]).

The n_b query rows of sequence b sit at positions cache_seqlens[b]-n_b .. cache_seqlens[b]-1;
keys come from the cache, token p at page_table[b, p // P] * P + p % P. When a key block fits
in a page (P a multiple of BLOCK_N) one page id serves the block; otherwise every key's address
is computed per token, so any page size works (page size 1 included). FP8 (e4m3) caches are
converted to the query dtype in registers; k_scale folds into the logit scale and v_scale into
the final normalization.
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
def _extend_key_loop(
    acc,
    l_i,
    m_i,
    q,
    K,
    V,
    page_row,
    rows,
    lo,
    hi,
    seq_k,
    window_left,
    qk_scale,
    kv_head_k,
    kv_head_v,
    stride_kp,
    stride_kt,
    stride_vp,
    stride_vt,
    offs_n,
    offs_d,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + offs_n
        in_seq = cols < seq_k
        if PAGE_SIZE % BLOCK_N == 0:
            # Loop bounds are BLOCK_N-aligned, so the block lies in one page: one page-table
            # read, and contiguous rows the compiler can see as such.
            page = tl.load(page_row + n0 // PAGE_SIZE).to(tl.int64)
            slot_in_page = n0 % PAGE_SIZE + offs_n
        else:
            if MASK:
                page = tl.load(page_row + cols // PAGE_SIZE, mask=in_seq, other=0)
            else:
                page = tl.load(page_row + cols // PAGE_SIZE)
            page = page.to(tl.int64)
            slot_in_page = cols % PAGE_SIZE
        k_rows = page * stride_kp + slot_in_page * stride_kt
        v_rows = page * stride_vp + slot_in_page * stride_vt
        k_ptrs = K + kv_head_k + k_rows[None, :] + offs_d[:, None]
        v_ptrs = V + kv_head_v + v_rows[:, None] + offs_d[None, :]
        if MASK:
            k = tl.load(k_ptrs, mask=in_seq[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=in_seq[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        acc, l_i, m_i = attn_block_update(
            acc,
            l_i,
            m_i,
            q,
            k.to(q.dtype),
            v.to(q.dtype),
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
def _extend_kernel(
    Q,
    K,
    V,
    Out,
    Lse,
    Sinks,
    CuSeqlensQ,
    PageTable,
    CacheSeqlens,
    qk_scale,
    v_scale,
    window_left,
    num_m_blocks,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_vp,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_pt,
    GROUP: tl.constexpr,
    HEADS_PER_TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_LSE: tl.constexpr,
    SPLIT_MASK: tl.constexpr,
):
    TOKENS: tl.constexpr = BLOCK_M // HEADS_PER_TILE
    pid_m = tl.program_id(0)
    head_base = tl.program_id(1) * HEADS_PER_TILE
    seq = tl.program_id(2)
    if not HAS_WINDOW:
        # Later query blocks see more keys: launch them first for load balance.
        pid_m = num_m_blocks - 1 - pid_m
    q_start = tl.load(CuSeqlensQ + seq)
    n_q = tl.load(CuSeqlensQ + seq + 1) - q_start
    t0 = pid_m * TOKENS
    if t0 >= n_q:
        return
    seq_k = tl.load(CacheSeqlens + seq)
    pos0 = seq_k - n_q  # absolute position of query row 0
    kv_head = head_base // GROUP
    tok0 = q_start.to(tl.int64)
    toks, heads = packed_rows(t0, head_base, BLOCK_M, HEADS_PER_TILE)
    row_ok = toks < n_q
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    tile0 = tok0 + t0  # int64 first token of the tile; in-tile offsets stay 32-bit
    local = toks - t0
    q = tl.load(
        Q + tile0 * stride_qt + (local * stride_qt + heads * stride_qh)[:, None] + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    page_row = PageTable + seq.to(tl.int64) * stride_pt

    last_row = pos0 + tl.minimum(t0 + TOKENS, n_q) - 1
    lo, full_lo, full_hi, hi = key_block_bounds(
        pos0 + t0, last_row, seq_k, window_left, BLOCK_N, True, HAS_WINDOW
    )

    rows = pos0 + toks
    kh_k = kv_head * stride_kh
    kh_v = kv_head * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if not SPLIT_MASK:
        acc, l_i, m_i = _extend_key_loop(
            acc,
            l_i,
            m_i,
            q,
            K,
            V,
            page_row,
            rows,
            lo,
            hi,
            seq_k,
            window_left,
            qk_scale,
            kh_k,
            kh_v,
            stride_kp,
            stride_kt,
            stride_vp,
            stride_vt,
            offs_n,
            offs_d,
            PAGE_SIZE,
            BLOCK_N,
            True,
            True,
            HAS_WINDOW,
        )
    else:
        if HAS_WINDOW:
            acc, l_i, m_i = _extend_key_loop(
                acc,
                l_i,
                m_i,
                q,
                K,
                V,
                page_row,
                rows,
                lo,
                full_lo,
                seq_k,
                window_left,
                qk_scale,
                kh_k,
                kh_v,
                stride_kp,
                stride_kt,
                stride_vp,
                stride_vt,
                offs_n,
                offs_d,
                PAGE_SIZE,
                BLOCK_N,
                True,
                True,
                HAS_WINDOW,
            )
        acc, l_i, m_i = _extend_key_loop(
            acc,
            l_i,
            m_i,
            q,
            K,
            V,
            page_row,
            rows,
            full_lo,
            full_hi,
            seq_k,
            window_left,
            qk_scale,
            kh_k,
            kh_v,
            stride_kp,
            stride_kt,
            stride_vp,
            stride_vt,
            offs_n,
            offs_d,
            PAGE_SIZE,
            BLOCK_N,
            False,
            True,
            HAS_WINDOW,
        )
        acc, l_i, m_i = _extend_key_loop(
            acc,
            l_i,
            m_i,
            q,
            K,
            V,
            page_row,
            rows,
            full_hi,
            hi,
            seq_k,
            window_left,
            qk_scale,
            kh_k,
            kh_v,
            stride_kp,
            stride_kt,
            stride_vp,
            stride_vt,
            offs_n,
            offs_d,
            PAGE_SIZE,
            BLOCK_N,
            True,
            True,
            HAS_WINDOW,
        )

    acc, lse = attn_finalize(acc, l_i, m_i, Sinks, heads, HAS_SINKS)
    # FP8 caches: p @ v_fp8 used unscaled values; v_scale is linear in the output.
    acc = acc * v_scale
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
    """Context manager: run mha_extend_with_kvcache with `config` instead of the heuristic."""
    return _PIN.pin(config)


def choose_config(kind: DeviceKind, head_dim: int, window: bool) -> AttentionConfig:
    """Tile config for a device kind; each branch names the hardware reason."""
    if kind.vendor == "interpreter":
        # numpy-executed blocks: small tiles keep CPU tests fast yet cross page boundaries.
        return AttentionConfig(32, 16, 1, 1, heads_per_tile=2)
    if kind.vendor == "amd":
        # CDNA: 4 wavefronts per CU; gathered K/V rows go through LDS, 64 KB on gfx942.
        stages = 1 if head_dim > 64 and kind.arch == "gfx942" else 2
        return AttentionConfig(128, 64, 4, stages, heads_per_tile=8)
    if kind.sm == 90:
        # Hopper: gathered rows cannot use TMA, so cp.async pipelining (3 stages) hides the
        # page-table indirection; 8 warps give each warpgroup a 64-row wgmma tile.
        if window:
            return AttentionConfig(64, 32, 4, 3, heads_per_tile=8, split_mask=False)
        return AttentionConfig(128, 64, 8, 3, heads_per_tile=8)
    # Ampere/Ada mma.sync: 4 warps, 2-3 cp.async stages within 100-164 KB of shared memory.
    return AttentionConfig(128, 64, 4, 3 if head_dim <= 64 else 2, heads_per_tile=8)


def mha_extend_with_kvcache(
    q,
    k_cache,
    v_cache,
    *,
    cu_seqlens_q,
    page_table,
    cache_seqlens,
    max_seqlen_q,
    window_left,
    sinks,
    softmax_scale,
    k_scale,
    v_scale,
    out,
    lse,
):
    """Writes `out` (and `lse` unless None) for the new tokens of each sequence.

    q [T, Hq, D] bf16/fp16; k_cache/v_cache [num_pages, P, Hkv, D] (q's dtype or
    float8_e4m3fn); cu_seqlens_q [B+1] int32; page_table [B, max_pages] int32;
    cache_seqlens [B] int32; max_seqlen_q >= every n_b; out [T, Hq, D]; lse [T, Hq] float32.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_tokens == 0 or num_seqs == 0 or max_seqlen_q == 0:
        return
    has_window = window_left >= 0
    config = _PIN.pinned or choose_config(device_kind(q.device), head_dim, has_window)
    group = num_q_heads // k_cache.shape[2]
    heads_per_tile = config.packing(group)
    num_m_blocks = triton.cdiv(max_seqlen_q, config.block_m // heads_per_tile)
    grid = (num_m_blocks, num_q_heads // heads_per_tile, num_seqs)
    _extend_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        out if lse is None else lse,
        q if sinks is None else sinks,
        cu_seqlens_q,
        page_table,
        cache_seqlens,
        softmax_scale * k_scale * LOG2E,
        v_scale,
        window_left,
        num_m_blocks,
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        out.stride(0),
        out.stride(1),
        0 if lse is None else lse.stride(0),
        page_table.stride(0),
        GROUP=group,
        HEADS_PER_TILE=heads_per_tile,
        HEAD_DIM=head_dim,
        PAGE_SIZE=k_cache.shape[1],
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        HAS_WINDOW=has_window,
        HAS_SINKS=sinks is not None,
        HAS_LSE=lse is not None,
        SPLIT_MASK=config.split_mask,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


# ----------------------------------------------------------------------------- AOT specs


def aot_specs(kind: DeviceKind) -> list:
    """Specializations GPT-OSS-like engines launch on `kind` (page 16 and 64, bf16 and FP8
    caches), with the launcher's config, for tokenspeed_kernel_triton.aot."""
    from ..aot import AotSpec

    strides = (
        "stride_qt",
        "stride_qh",
        "stride_kp",
        "stride_kt",
        "stride_kh",
        "stride_vp",
        "stride_vt",
        "stride_vh",
        "stride_ot",
        "stride_oh",
        "stride_lt",
        "stride_pt",
    )
    specs = []
    for kv_dtype, page_size, window in (
        ("bf16", 64, False),
        ("bf16", 64, True),
        ("bf16", 16, False),
        ("fp8e4nv", 64, False),
    ):
        config = choose_config(kind, 64, window)
        signature = {
            "Q": "*bf16",
            "K": f"*{kv_dtype}",
            "V": f"*{kv_dtype}",
            "Out": "*bf16",
            "Lse": "*fp32",
            "Sinks": "*fp32",
            "CuSeqlensQ": "*i32",
            "PageTable": "*i32",
            "CacheSeqlens": "*i32",
            "qk_scale": "fp32",
            "v_scale": "fp32",
            "window_left": "i32",
            "num_m_blocks": "i32",
            **dict.fromkeys(strides, "i32"),
        }
        constexprs = dict(
            GROUP=8,
            HEADS_PER_TILE=config.packing(8),
            HEAD_DIM=64,
            PAGE_SIZE=page_size,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            HAS_WINDOW=window,
            HAS_SINKS=True,
            HAS_LSE=True,
            SPLIT_MASK=config.split_mask,
        )
        name = f"extend_{kv_dtype}_page{page_size}{'_window' if window else ''}"
        specs.append(
            AotSpec(
                name, _extend_kernel, signature, constexprs, config.num_warps, config.num_stages
            )
        )
    return specs
