"""Hopper decode GEMM with the MXFP4 weights streamed straight into registers (Gluon, mma.sync).

The fragment GEMM (wgmma_gemm.py) copies weights through a cp.async ring that the whole CTA
waits on at a barrier every step, and its wgmma couples the CTA's four warps: at M=1 its 12
warps per SM spend half their time waiting for the step's bytes (benchmarks/results/
moe_h200_session9.md). Here every warp is on its own after a single barrier:

- the CTA's activations for its whole K range ([MMA_N, 128] per chunk, block-diagonal with
  POST_SCALE) land in shared memory once, by cp.async, at the start;
- each warp loads its 16 weight rows' words of a chunk (two 16-byte loads per thread, in the
  same fragment order as the fragment GEMM's ring, fragment_layout.py) straight into
  registers, PREFETCH chunks ahead, decodes them in place into mma.sync's A fragments (wgmma's
  A layout per warp is mma.sync's) and multiplies them against the activations' B fragments.

No weight byte passes through shared memory and no barrier paces the stream: a warp waits only
for its own loads. The epilogue is the fragment GEMM's (fragment_epilogue.py).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from . import fragment_epilogue, fragment_steps, shift_words
from .fragment_layout import PANEL_ROWS

_PANEL_ROWS = gl.constexpr(PANEL_ROWS)


@gluon.jit
def _load_chunk(w_ptrs, s_ptrs, stride_wc, stride_sc, c, num_k):
    """Chunk c's words [BLOCK_W, 16] and scale words [BLOCK_W] (zeros from num_k on, which
    decode to zeros)."""
    ok = c < num_k
    words = gl.load(w_ptrs + c * stride_wc, mask=ok, other=0, cache_modifier=".cg")
    scales = gl.load(s_ptrs + c * stride_sc, mask=ok, other=0, cache_modifier=".cg")
    return words, scales


@gluon.jit
def _rows_view(act):
    """[chunks, MMA_N, 128] slots as one [chunks * MMA_N, 128] buffer (the same bytes)."""
    return act._reinterpret(act.dtype, [act.shape[0] * act.shape[1], act.shape[2]], act.layout)


@gluon.jit
def _copy_activations(
    act,
    a_ptr,
    sorted_ptr,
    tile,
    row_end,
    k_first,
    c0,
    num_k,
    K_VALID,
    stride_am,
    TOPK: gl.constexpr,
    SWIGLU: gl.constexpr,
    BLOCK_T: gl.constexpr,
    MMA_N: gl.constexpr,
    GROUP: gl.constexpr,
    BLOCK_DIAGONAL: gl.constexpr,
    copy_layout: gl.constexpr,
):
    """Chunks c0 .. c0 + GROUP - 1 of the activations into act [chunks * MMA_N, 128] (chunk c
    in rows c * MMA_N ..) by 16-byte cp.async. Chunks from num_k on and columns from K_VALID on
    are zero-filled; BLOCK_DIAGONAL: MMA column n keeps only the K elements of scale block
    n // BLOCK_T."""
    q = gl.arange(0, GROUP * MMA_N, layout=gl.SliceLayout(1, copy_layout))
    local = gl.arange(0, 128, layout=gl.SliceLayout(0, copy_layout))
    col = q % MMA_N
    offs_t = tile * BLOCK_T + col % BLOCK_T
    ok = offs_t < row_end
    if SWIGLU:
        pair = gl.load(sorted_ptr + offs_t, mask=ok, other=0, cache_modifier=".cg")
        rows = (pair // TOPK).to(gl.int64)
    else:
        rows = offs_t.to(gl.int64)
    chunk = c0 + q // MMA_N
    cols = (k_first + chunk)[:, None] * 128 + local[None, :]
    ptrs = a_ptr + rows[:, None] * stride_am + cols
    mask = (ok & (chunk < num_k))[:, None] & (cols < K_VALID)
    if BLOCK_DIAGONAL:
        mask = mask & ((local // 32 % 4)[None, :] == (col // BLOCK_T)[:, None])
    async_copy.async_copy_global_to_shared(act.slice(c0 * MMA_N, GROUP * MMA_N), ptrs, mask=mask)


@gluon.jit
def _chunk_product(
    acc,
    words,
    scales,
    act,
    act_lo,
    c,
    lo_table,
    hi_table,
    selector,
    dot_a: gl.constexpr,
    dot_b: gl.constexpr,
    BLOCK_W: gl.constexpr,
    SHIFT_DECODE: gl.constexpr,
    SPLIT_A: gl.constexpr,
    POST_SCALE: gl.constexpr,
):
    """acc + chunk c's product: post-scaled (raw halves against block-diagonal activations, the
    e8m0 factors on the fp32 partial: fragment_steps.post_scaled_step) or with scaled halves."""
    f16: gl.constexpr = act.dtype == gl.float16
    frag = fragment_steps.decode_fragment(
        words, scales, lo_table, hi_table, dot_a, BLOCK_W, SHIFT_DECODE, f16, POST_SCALE
    )
    b = act.index(c).permute((1, 0)).load(dot_b)
    if POST_SCALE:
        part = mma_v2(frag, b, gl.zeros_like(acc))
        rows_scale = gl.convert_layout(scales, gl.SliceLayout(1, acc.type.layout))
        factor = shift_words.float_factors(rows_scale[:, None] + selector * 0, selector, f16)
        acc += part * factor
    else:
        acc = mma_v2(frag, b, acc)
        if SPLIT_A:
            acc = mma_v2(frag, act_lo.index(c).permute((1, 0)).load(dot_b), acc)
    return acc


@gluon.jit
def _stream_gemm_kernel(
    a_ptr,
    w_ptr,
    ws_ptr,
    bias_ptr,
    out_ptr,
    route_w_ptr,
    sorted_ptr,
    tiles_ptr,
    num_tiles_ptr,
    table_ptr,
    ready_ptr,
    x_exp_ptr,
    N,
    K,
    K_VALID,
    N_VALID,
    stride_am,
    stride_we,
    stride_wp,
    stride_wn,
    stride_wc,
    stride_se,
    stride_sp,
    stride_sn,
    stride_sc,
    stride_be,
    stride_om,
    ready_target,
    alpha,
    limit,
    TOPK: gl.constexpr,
    SWIGLU: gl.constexpr,
    SPLIT_A: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    BLOCK_W: gl.constexpr,
    BLOCK_T: gl.constexpr,
    CTA_CHUNKS: gl.constexpr,
    PREFETCH: gl.constexpr,
    SPLIT_K: gl.constexpr,
    SHIFT_DECODE: gl.constexpr,
    PDL: gl.constexpr,
    TILE_READY: gl.constexpr,
    POST_SCALE: gl.constexpr,
    SCALE_BIAS: gl.constexpr,
    mma: gl.constexpr,
    dot_a: gl.constexpr,
    dot_b: gl.constexpr,
    words_layout: gl.constexpr,
    copy_layout: gl.constexpr,
    smem_layout: gl.constexpr,
):
    pid = gl.program_id(0)
    num_w = gl.cdiv(N_VALID, BLOCK_W)
    split = pid % SPLIT_K
    tile = pid // SPLIT_K // num_w
    pid_w = pid // SPLIT_K % num_w
    if PDL:
        # As the fragment GEMM (wgmma_gemm.py): GEMM1 waits for the router; GEMM2 streams its
        # first weights, then waits for GEMM1.
        if SWIGLU:
            gdc_wait()
        gdc_launch_dependents()
    num_tiles = gl.load(num_tiles_ptr, cache_modifier=".cg")
    expert = gl.load(tiles_ptr + 2 * tile, cache_modifier=".cg").to(gl.int64)
    row_end = gl.load(tiles_ptr + 2 * tile + 1, cache_modifier=".cg")
    MMA_N: gl.constexpr = 4 * BLOCK_T if POST_SCALE else BLOCK_T
    if tile >= num_tiles:
        return
    per_split = gl.cdiv(K // 128, SPLIT_K)
    k_first = split * per_split
    num_k = gl.minimum(per_split, K // 128 - k_first)

    # This warp's rows of each chunk, in the fragment order of the words layout.
    wr = pid_w * BLOCK_W + gl.arange(0, BLOCK_W, layout=gl.SliceLayout(1, words_layout))
    wj = gl.arange(0, 16, layout=gl.SliceLayout(0, words_layout))
    w_rows = wr // _PANEL_ROWS * stride_wp + wr % _PANEL_ROWS * stride_wn
    w_ptrs = w_ptr + expert * stride_we + k_first * stride_wc + w_rows[:, None] + wj[None, :]
    s_rows = wr // _PANEL_ROWS * stride_sp + wr % _PANEL_ROWS * stride_sn
    s_ptrs = ws_ptr + expert * stride_se + k_first * stride_sc + s_rows
    lo_table = gl.load(table_ptr)
    hi_table = gl.load(table_ptr + 1)

    # Four chunks in flight per warp before anything else; under PDL GEMM2 issues them before
    # it waits for GEMM1 (they depend on the routing only).
    w0, s0 = _load_chunk(w_ptrs, s_ptrs, stride_wc, stride_sc, 0, num_k)
    w1, s1 = _load_chunk(w_ptrs, s_ptrs, stride_wc, stride_sc, 1, num_k)
    w2, s2 = _load_chunk(w_ptrs, s_ptrs, stride_wc, stride_sc, 2, num_k)
    w3, s3 = _load_chunk(w_ptrs, s_ptrs, stride_wc, stride_sc, 3, num_k)
    if PREFETCH == 8:
        w4, s4 = _load_chunk(w_ptrs, s_ptrs, stride_wc, stride_sc, 4, num_k)
        w5, s5 = _load_chunk(w_ptrs, s_ptrs, stride_wc, stride_sc, 5, num_k)
        w6, s6 = _load_chunk(w_ptrs, s_ptrs, stride_wc, stride_sc, 6, num_k)
        w7, s7 = _load_chunk(w_ptrs, s_ptrs, stride_wc, stride_sc, 7, num_k)
    if PDL:
        if not SWIGLU:
            if TILE_READY:
                while gl.atomic_add(ready_ptr + tile, 0, sem="acquire", scope="gpu") < ready_target:
                    pass
            else:
                gdc_wait()

    # The activations of all of the CTA's chunks (CTA_CHUNKS, a multiple of four: the slots
    # past num_k are zero-filled), one [MMA_N, 128] slot per chunk.
    a_dtype: gl.constexpr = a_ptr.dtype.element_ty
    act = gl.allocate_shared_memory(a_dtype, [CTA_CHUNKS, MMA_N, 128], smem_layout)
    act_lo = gl.allocate_shared_memory(a_dtype, [CTA_CHUNKS if SPLIT_A else 1, MMA_N, 128], smem_layout)
    # A few copies of 8 chunks each (each copy is one write to the buffer: Gluon puts a CTA
    # barrier between two); only those the loop below reads.
    for g in gl.static_range(CTA_CHUNKS // 8):
        if g * 8 < num_k:
            _copy_activations(_rows_view(act), a_ptr, sorted_ptr, tile, row_end, k_first, g * 8, num_k, K_VALID, stride_am, TOPK, SWIGLU, BLOCK_T, MMA_N, 8, POST_SCALE, copy_layout)
            if SPLIT_A:
                _copy_activations(_rows_view(act_lo), a_ptr + K, sorted_ptr, tile, row_end, k_first, g * 8, num_k, K_VALID, stride_am, TOPK, SWIGLU, BLOCK_T, MMA_N, 8, POST_SCALE, copy_layout)
    async_copy.commit_group()

    acc = gl.zeros([BLOCK_W, MMA_N], gl.float32, layout=mma)
    out_layout: gl.constexpr = fragment_epilogue.token_columns(
        acc, POST_SCALE, BLOCK_W, BLOCK_T
    ).type.layout
    epilogue_src = (sorted_ptr, route_w_ptr, bias_ptr, x_exp_ptr, expert, tile, pid_w, row_end)
    operands = fragment_epilogue.epilogue_operands(
        epilogue_src,
        stride_be,
        TOPK,
        SWIGLU,
        HAS_BIAS,
        POST_SCALE,
        SCALE_BIAS,
        BLOCK_W,
        BLOCK_T,
        out_layout,
    )
    cols = gl.arange(0, MMA_N, layout=gl.SliceLayout(0, mma))
    # prmt selector of each post-scaled column's scale byte (its group), zeros above it.
    selector = gl.zeros([BLOCK_W, MMA_N], gl.int32, mma) + (0x4440 + cols // BLOCK_T)[None, :]
    async_copy.wait_group(0)
    gl.thread_barrier()

    for c0 in range(0, num_k, PREFETCH):
        acc = _chunk_product(acc, w0, s0, act, act_lo, c0 + 0, lo_table, hi_table, selector, dot_a, dot_b, BLOCK_W, SHIFT_DECODE, SPLIT_A, POST_SCALE)
        w0, s0 = _load_chunk(w_ptrs, s_ptrs, stride_wc, stride_sc, c0 + 0 + PREFETCH, num_k)
        acc = _chunk_product(acc, w1, s1, act, act_lo, c0 + 1, lo_table, hi_table, selector, dot_a, dot_b, BLOCK_W, SHIFT_DECODE, SPLIT_A, POST_SCALE)
        w1, s1 = _load_chunk(w_ptrs, s_ptrs, stride_wc, stride_sc, c0 + 1 + PREFETCH, num_k)
        acc = _chunk_product(acc, w2, s2, act, act_lo, c0 + 2, lo_table, hi_table, selector, dot_a, dot_b, BLOCK_W, SHIFT_DECODE, SPLIT_A, POST_SCALE)
        w2, s2 = _load_chunk(w_ptrs, s_ptrs, stride_wc, stride_sc, c0 + 2 + PREFETCH, num_k)
        acc = _chunk_product(acc, w3, s3, act, act_lo, c0 + 3, lo_table, hi_table, selector, dot_a, dot_b, BLOCK_W, SHIFT_DECODE, SPLIT_A, POST_SCALE)
        w3, s3 = _load_chunk(w_ptrs, s_ptrs, stride_wc, stride_sc, c0 + 3 + PREFETCH, num_k)
        if PREFETCH == 8:
            acc = _chunk_product(acc, w4, s4, act, act_lo, c0 + 4, lo_table, hi_table, selector, dot_a, dot_b, BLOCK_W, SHIFT_DECODE, SPLIT_A, POST_SCALE)
            w4, s4 = _load_chunk(w_ptrs, s_ptrs, stride_wc, stride_sc, c0 + 4 + PREFETCH, num_k)
        if PREFETCH == 8:
            acc = _chunk_product(acc, w5, s5, act, act_lo, c0 + 5, lo_table, hi_table, selector, dot_a, dot_b, BLOCK_W, SHIFT_DECODE, SPLIT_A, POST_SCALE)
            w5, s5 = _load_chunk(w_ptrs, s_ptrs, stride_wc, stride_sc, c0 + 5 + PREFETCH, num_k)
        if PREFETCH == 8:
            acc = _chunk_product(acc, w6, s6, act, act_lo, c0 + 6, lo_table, hi_table, selector, dot_a, dot_b, BLOCK_W, SHIFT_DECODE, SPLIT_A, POST_SCALE)
            w6, s6 = _load_chunk(w_ptrs, s_ptrs, stride_wc, stride_sc, c0 + 6 + PREFETCH, num_k)
        if PREFETCH == 8:
            acc = _chunk_product(acc, w7, s7, act, act_lo, c0 + 7, lo_table, hi_table, selector, dot_a, dot_b, BLOCK_W, SHIFT_DECODE, SPLIT_A, POST_SCALE)
            w7, s7 = _load_chunk(w_ptrs, s_ptrs, stride_wc, stride_sc, c0 + 7 + PREFETCH, num_k)

    acc = fragment_epilogue.token_columns(acc, POST_SCALE, BLOCK_W, BLOCK_T)
    rows, cols, col_ok, col_pair, bias, col_factor = operands
    if SWIGLU:
        if POST_SCALE:
            acc *= col_factor[None, :]
    if HAS_BIAS:
        if split == 0:
            acc += bias[:, None]
    if SWIGLU:
        fragment_epilogue.swiglu_store(
            out_ptr,
            acc,
            rows,
            cols,
            col_ok,
            N,
            stride_om,
            alpha,
            limit,
            BLOCK_W,
            BLOCK_T,
            out_ptr.dtype.element_ty == gl.float16,
        )
        if TILE_READY:
            gl.thread_barrier()
            gl.atomic_add(ready_ptr + tile, 1, sem="release", scope="gpu")
    else:
        acc *= col_factor[None, :]
        out_row = col_pair.to(gl.int64) * SPLIT_K + split
        ptrs = out_ptr + out_row[None, :] * stride_om + rows[:, None]
        gl.store(ptrs, acc, mask=col_ok[None, :] & (rows < N_VALID)[:, None])
