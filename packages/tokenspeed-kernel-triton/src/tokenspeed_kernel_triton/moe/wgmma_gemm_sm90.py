"""Hopper grouped GEMM with MXFP4 weights decoded straight into wgmma register fragments (Gluon).

The portable kernel (grouped_gemm.py) dequantizes a weight tile in registers, then Triton stores
it to shared memory and reloads it with ldmatrix for the MMA: that round trip, not HBM, bounds
decode. Here the operands are swapped: out^T = W x^T, the weight tile [BLOCK_W rows, 128 K] is
wgmma's A operand, which may live in registers, and the activations [BLOCK_T tokens, 128 K] are
the B operand in shared memory (cp.async ring). `fragment_layout_sm90.py` permutes the MXFP4
words at prepare time so that the words each thread loads decode, in place, to exactly its
elements of the A fragment: no shuffle, no shared-memory pass for weights, 16-byte coalesced
word loads.

Weights decode with shift_words_sm90 (a shift and a mask per half pair, the subnormal trick,
then the e8m0 multiply) where that is exact for their scale bytes, else with mxfp4_words' byte
permutes ("w13_decode" / "w2_decode" in the prepared weights, chosen by layout.prepare_weights);
w2 for fp8 activations as e4m3 fragments (e4m3_fragments_sm90: byte-permute tables per row and
chunk, FP8 MMAs on e4m3 SwiGLU rows, each row's power of two in the epilogue).

GEMM1 (SWIGLU): B rows are x gathered by token; the prepared w13 puts the gate row of 8
intermediate channels in rows 0-7 of each 16-row group and their up rows in rows 8-15, which
the accumulator layout hands to the same thread, so the SwiGLU epilogue needs no exchange. It
writes `a` in fp16 when w2 was laid out to decode to fp16 (its scale bytes allow it exactly and
the clamp bounds `a`, _common.swiglu_fits_f16); else as bf16 [hi | lo] halves (as the portable
kernel; see grouped_gemm.py). fp16 is as accurate here and halves GEMM2's MMAs and bytes.
GEMM2: B rows are the sorted `a` rows (fp16: weights decoded to fp16; bf16: two wgmmas, hi and
lo, on one decoded fragment); the epilogue adds the bias, multiplies by the routing weight and
writes fp32 rows by pair (split-K: partial rows, summed by the combine).

One kernel body over 80 lines: its prologue, main loop and epilogue share a dozen values.
With FragmentConfig.warp_specialized, GEMM1's full tiles (with warp_specialized_gemm2 GEMM2's
too) run in fragment_ws_sm90's warp-specialized persistent kernel instead (the same decode,
MMAs and epilogue).
"""

from __future__ import annotations

import functools
import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .._launch import bind_launches
from .fragment_config_sm90 import gemm2_splits
from .fragment_epilogue_sm90 import (
    epilogue_operands,
    pair_rows_store,
    swiglu_store,
    token_columns,
)
from .fragment_layout_sm90 import PANEL_ROWS, kernel_layouts, panel_view
from .fragment_steps_sm90 import (
    e4m3_step,
    issue_activations,
    issue_weights,
    mma_step,
    post_scaled_step,
)
from .fragment_ws_sm90 import warp_specialized_fits, warp_specialized_gemm
from .mxfp4_words import LOOKUP_TABLE_WORDS
from .replay import recordable
from .shift_words_sm90 import POST_SCALE_BIAS

_PANEL_ROWS = gl.constexpr(PANEL_ROWS)


@recordable
@bind_launches
@gluon.jit
def _fragment_gemm_kernel(
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
    in_scale_ptr,
    wide_ptr,
    row_scale_ptr,
    narrow_tiles_ptr,
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
    in_scale,
    out_scale,
    wide_from_bits,
    TOPK: gl.constexpr,
    SWIGLU: gl.constexpr,
    SPLIT_A: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    BLOCK_W: gl.constexpr,
    BLOCK_T: gl.constexpr,
    TILE_ROWS: gl.constexpr,
    SKIP_AT_MOST: gl.constexpr,
    STAGES: gl.constexpr,
    CHUNKS: gl.constexpr,
    SPLIT_K: gl.constexpr,
    SHIFT_DECODE: gl.constexpr,
    PDL: gl.constexpr,
    TILE_READY: gl.constexpr,
    MMA_IN_FLIGHT: gl.constexpr,
    POST_SCALE: gl.constexpr,
    SCALE_BIAS: gl.constexpr,
    IN_SCALE: gl.constexpr,
    OUT_QUANT: gl.constexpr,
    HALF_ROWS: gl.constexpr,
    E4M3: gl.constexpr,
    mma: gl.constexpr,
    dot_a: gl.constexpr,
    words_layout: gl.constexpr,
    copy_layout: gl.constexpr,
    smem_layout: gl.constexpr,
    words_copy: gl.constexpr,
    scales_copy: gl.constexpr,
    words_smem_layout: gl.constexpr,
    scales_smem_layout: gl.constexpr,
    words_step_layout: gl.constexpr,
    scales_step_layout: gl.constexpr,
    pair_rows_layout: gl.constexpr,
    stage_layout: gl.constexpr,
):
    pid = gl.program_id(0)
    # Row blocks of the real rows only: GEMM1's rows past 2I are zero padding (their SwiGLU
    # columns are zero-filled by GEMM2's copies, never written).
    num_w = gl.cdiv(N_VALID, BLOCK_W)
    split = pid % SPLIT_K
    tile = pid // SPLIT_K // num_w
    pid_w = pid // SPLIT_K % num_w
    # A launch narrower than the routing tiles (BLOCK_T < TILE_ROWS) takes the tiles of at
    # most BLOCK_T tokens, which the launch before it, of full tiles, left to it (SKIP_AT_MOST):
    # their MMAs need only BLOCK_T columns (fragment_config_sm90.FragmentConfig.narrow_t).
    NARROW: gl.constexpr = BLOCK_T < TILE_ROWS
    WIDE_GEMM2: gl.constexpr = SKIP_AT_MOST != 0 and not SWIGLU and not TILE_READY
    if PDL:
        # Programmatic dependent launch: GEMM1 follows the routing kernel, whose outputs it
        # reads from here on. GEMM2 launches once every GEMM1 CTA got here, so the routing
        # outputs were complete before it started (it reads them from L2, never a stale L1
        # line); it waits for GEMM1's SwiGLU rows before reading them: for the whole grid, or
        # with TILE_READY tile by tile (ready_ptr).
        # A narrow launch follows the full-tile launch of the same GEMM, whose outputs it does
        # not read: its CTAs start once every full-tile CTA triggered or exited, past that
        # launch's wait for the kernel before it, so they need no wait of their own. One CTA
        # more than its work (the last, fragment_gemm) waits for the full-tile launch and
        # exits, so that the kernel after, waiting for this grid, also waits for that launch;
        # a working CTA that waited would run its tile after every full tile (H200, TP=8 shard
        # at M=4096: 413.9 against 393.9 us). GEMM2's full-tile CTAs trigger after their wait
        # for GEMM1, and their first one waits before it can exit (a launch may have no full
        # tiles at all).
        if NARROW:
            if pid == gl.num_programs(0) - 1:
                gdc_wait()
                return
        elif WIDE_GEMM2:
            if pid == 0:
                gdc_wait()
        elif SWIGLU:
            gdc_wait()
        if not WIDE_GEMM2:
            gdc_launch_dependents()
    if NARROW:
        # Its grid covers the local experts: each one's narrow tile, or -1 (routing's
        # narrow_tiles, written before the full-tile launch started).
        tile = gl.load(narrow_tiles_ptr + tile, cache_modifier=".cg")
        if tile < 0:
            return
    # The routing outputs this CTA reads, all at once rather than one latency after another:
    # the buffers hold max_tiles tiles, so the reads past num_tiles stay in bounds, and the
    # router writes every entry (routing._write_expert_tiles), so they read initialized memory.
    num_tiles = gl.load(num_tiles_ptr, cache_modifier=".cg")
    expert = gl.load(tiles_ptr + 2 * tile, cache_modifier=".cg").to(gl.int64)
    row_end = gl.load(tiles_ptr + 2 * tile + 1, cache_modifier=".cg")
    # Activation rows of this tile (B operand), in the copy layout: the MMA's columns, one per
    # token, or with POST_SCALE four groups of the tile's tokens (post_scaled_step).
    MMA_N: gl.constexpr = 4 * BLOCK_T if POST_SCALE else BLOCK_T
    mma_col = gl.arange(0, MMA_N, layout=gl.SliceLayout(1, copy_layout))
    first_row = tile * TILE_ROWS
    offs_t = first_row + mma_col % BLOCK_T
    if SWIGLU:
        pair = gl.load(sorted_ptr + offs_t, cache_modifier=".cg")
    if tile >= num_tiles:
        return
    if NARROW:
        if row_end - first_row > BLOCK_T:
            return
    if SKIP_AT_MOST != 0:
        if row_end - first_row <= SKIP_AT_MOST:
            return
    t_ok = offs_t < row_end
    if SWIGLU:
        a_rows = (gl.where(t_ok, pair, 0) // TOPK).to(gl.int64)
    else:
        a_rows = offs_t.to(gl.int64)
    # This CTA's K chunks: split SPLIT_K ways (GEMM2 only: its epilogue is linear, and the
    # partial rows are summed by the combine).
    per_split = gl.cdiv(K // 128, SPLIT_K)
    k_first = split * per_split
    num_k = gl.minimum(per_split, K // 128 - k_first)
    a_dtype: gl.constexpr = a_ptr.dtype.element_ty
    # The ring: STAGES steps of CHUNKS K chunks (128 columns) each. A step's activations are
    # one [BLOCK_T, CHUNKS * 128] tile; its chunk c of words and scales is buffer s * CHUNKS + c
    # (the copy sees each step as one [CHUNKS, ...] view: fragment_steps_sm90.step_view).
    act = gl.allocate_shared_memory(a_dtype, [STAGES, MMA_N, CHUNKS * 128], smem_layout)
    act_lo = gl.allocate_shared_memory(
        a_dtype, [STAGES if SPLIT_A else 1, MMA_N, CHUNKS * 128], smem_layout
    )
    ring_words = gl.allocate_shared_memory(
        gl.int32, [STAGES * CHUNKS, BLOCK_W, 16], words_smem_layout
    )
    ring_scales = gl.allocate_shared_memory(
        gl.int32, [STAGES * CHUNKS, BLOCK_W], scales_smem_layout
    )

    # This CTA's weight rows: 16 words (one K chunk) and one scale word (its four e8m0 bytes)
    # per row and chunk (row r at panel r // 64, row r % 64 of it: strides _wp / _sp, _wn / _sn;
    # chunks: _wc / _sc), through the cp.async ring with the activations. The ring keeps
    # STAGES - 1 steps of HBM reads in flight, which small batches need: each CTA has little
    # else to overlap (M=1: 46.3 us against 51.5 loading them into registers one step ahead).
    # A row block may overhang the padded rows (256-row blocks over rows padded to 128): its
    # rows past N reread row N - 1, and the epilogue stores only rows below N_VALID.
    wc = gl.arange(0, CHUNKS, layout=gl.SliceLayout(1, gl.SliceLayout(2, words_copy)))
    wr = pid_w * BLOCK_W + gl.arange(
        0, BLOCK_W, layout=gl.SliceLayout(0, gl.SliceLayout(2, words_copy))
    )
    wr = gl.minimum(wr, N - 1)
    wj = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, words_copy)))
    w_rows = wr // _PANEL_ROWS * stride_wp + wr % _PANEL_ROWS * stride_wn
    w_copy_ptrs = (
        w_ptr
        + expert * stride_we
        + w_rows[None, :, None]
        + ((k_first + wc) * stride_wc)[:, None, None]
        + wj[None, None, :]
    )
    sc = gl.arange(0, CHUNKS, layout=gl.SliceLayout(1, scales_copy))
    sr = pid_w * BLOCK_W + gl.arange(0, BLOCK_W, layout=gl.SliceLayout(0, scales_copy))
    sr = gl.minimum(sr, N - 1)
    s_rows = sr // _PANEL_ROWS * stride_sp + sr % _PANEL_ROWS * stride_sn
    s_copy_ptrs = (
        ws_ptr + expert * stride_se + s_rows[None, :] + ((k_first + sc) * stride_sc)[:, None]
    )

    # Loaded, not immediates: ptxas would re-materialize an immediate table word into a register
    # before every lookup.
    lo_table = gl.load(table_ptr)
    hi_table = gl.load(table_ptr + 1)

    # What the ring copies read (fragment_steps_sm90.issue_weights, issue_activations) and
    # what its steps multiply (mma_step, post_scaled_step).
    weights_src = (ring_words, ring_scales, w_copy_ptrs, s_copy_ptrs, stride_wc, stride_sc, num_k)
    acts_src = (a_ptr, a_rows, t_ok, k_first, num_k, K, K_VALID, stride_am, mma_col // BLOCK_T)
    ring = (ring_words, ring_scales, act, act_lo, lo_table, hi_table)
    # Prologue: the first STAGES - 1 steps into the ring, weights first. They depend on nothing
    # the previous kernel writes, so under PDL GEMM2 streams them while GEMM1 finishes.
    num_steps = gl.cdiv(num_k, CHUNKS)
    for p in gl.static_range(STAGES - 1):
        if p < num_steps:
            issue_weights(weights_src, p, words_step_layout, scales_step_layout, CHUNKS)
    if PDL:
        if not SWIGLU:
            if TILE_READY:
                # GEMM1's CTAs of this tile all stored their SwiGLU rows (each counted itself
                # in with release semantics after a CTA barrier; this acquires them).
                while gl.atomic_add(ready_ptr + tile, 0, sem="acquire", scope="gpu") < ready_target:
                    pass
            elif not NARROW:
                gdc_wait()  # all of GEMM1
                if WIDE_GEMM2:
                    gdc_launch_dependents()
    for p in gl.static_range(STAGES - 1):
        if p < num_steps:
            issue_activations(act, act_lo, acts_src, p, copy_layout, CHUNKS, SPLIT_A, POST_SCALE)
        async_copy.commit_group()

    acc = gl.zeros([BLOCK_W, MMA_N], gl.float32, layout=mma)
    # The epilogue's layout: the accumulator's, or with POST_SCALE its sum over the groups.
    out_layout: gl.constexpr = token_columns(acc, POST_SCALE, BLOCK_W, BLOCK_T).type.layout
    # Small tiles load what the epilogue reads now: its latency hides behind the main loop
    # instead of following it (a few registers; 64-token tiles would hold 32 per thread).
    PRELOAD: gl.constexpr = BLOCK_T <= 8
    epilogue_ptrs = (
        sorted_ptr, route_w_ptr, bias_ptr, x_exp_ptr, stride_be, in_scale_ptr, in_scale
    )  # fmt: skip
    epilogue = (epilogue_ptrs, expert, first_row, pid_w, row_end, N_VALID)
    if PRELOAD:
        operands = epilogue_operands(
            epilogue, TOPK, SWIGLU, HAS_BIAS, POST_SCALE, SCALE_BIAS, IN_SCALE, BLOCK_W, BLOCK_T,
            out_layout,
        )  # fmt: skip

    # Iteration `it` copies step `it` into the ring and computes step it - (STAGES - 1). A
    # step's chunks past num_k are zeros (which decode to zeros) rather than branches around
    # the MMA chain.
    for it in range(STAGES - 1, num_steps + STAGES - 1):
        # The step computed below landed (this thread's copies, then everyone's). Past this
        # barrier every warp is done with the previous iteration (its ring reads, and its
        # wgmmas, which are waited on), whose slot step `it` reuses.
        async_copy.wait_group(STAGES - 2)
        gl.thread_barrier()
        if it < num_steps:
            issue_weights(weights_src, it, words_step_layout, scales_step_layout, CHUNKS)
            issue_activations(act, act_lo, acts_src, it, copy_layout, CHUNKS, SPLIT_A, POST_SCALE)
        async_copy.commit_group()
        slot = (it - (STAGES - 1)) % STAGES
        # The step's copies (generic proxy) before the wgmmas that read them (async proxy):
        # one fence for all of its chunks.
        fence_async_shared()
        if E4M3:
            acc = e4m3_step(acc, ring, slot, words_layout, dot_a, CHUNKS)
        elif POST_SCALE:
            acc = post_scaled_step(
                acc, ring, slot, words_layout, dot_a, BLOCK_T, CHUNKS, MMA_IN_FLIGHT
            )
        else:
            acc = mma_step(
                acc, ring, slot, words_layout, dot_a, CHUNKS, SHIFT_DECODE, SPLIT_A, MMA_IN_FLIGHT
            )
    async_copy.wait_group(0)

    acc = token_columns(acc, POST_SCALE, BLOCK_W, BLOCK_T)
    if not PRELOAD:
        operands = epilogue_operands(
            epilogue, TOPK, SWIGLU, HAS_BIAS, POST_SCALE, SCALE_BIAS, IN_SCALE, BLOCK_W, BLOCK_T,
            out_layout,
        )  # fmt: skip
    # Epilogue in the accumulator layout: rows are weight rows, columns tokens.
    rows, cols, col_ok, col_pair, bias, pre_factor, post_factor = operands
    if E4M3:
        # Each weight row's power of two (e4m3_fragments_sm90: its blocks decode relative to
        # its largest).
        row_factor = gl.load(row_scale_ptr + expert * N + rows, mask=rows < N, other=0.0)
        acc *= row_factor[:, None]
    if (SWIGLU and POST_SCALE) or IN_SCALE != 0:
        acc *= pre_factor[None, :]
    if HAS_BIAS:
        if split == 0:  # one split adds the bias
            acc += bias[:, None]
    if SWIGLU:
        out_rows = (out_ptr, N, stride_om, rows, cols, col_ok)
        swiglu_store(out_rows, acc, alpha, limit, out_scale, BLOCK_W, BLOCK_T, OUT_QUANT)
        if TILE_READY:
            # Every thread's rows are stored (the barrier), then one release increment.
            gl.thread_barrier()
            gl.atomic_add(ready_ptr + tile, 1, sem="release", scope="gpu")
    else:
        acc *= post_factor[None, :]  # the routing weight
        if HALF_ROWS:
            # The output tile's staging buffer over the ring's activations (fp16 or bf16).
            ACT_BYTES: gl.constexpr = a_dtype.primitive_bitwidth // 8
            gl.static_assert(STAGES * MMA_N * CHUNKS * 128 * ACT_BYTES >= 2 * BLOCK_W * BLOCK_T)
            stage = act._reinterpret(gl.float16, [BLOCK_W, BLOCK_T], stage_layout)
            pair_rows_store(
                out_ptr, wide_ptr, acc, stage, wide_from_bits, sorted_ptr, (first_row, row_end),
                pid_w, N_VALID, stride_om, BLOCK_W, BLOCK_T, pair_rows_layout,
            )  # fmt: skip
        else:
            # Row pair * SPLIT_K + split: the combine sums a token's top_k * SPLIT_K rows.
            out_row = col_pair.to(gl.int64) * SPLIT_K + split
            ptrs = out_ptr + out_row[None, :] * stride_om + rows[:, None]
            gl.store(ptrs, acc, mask=col_ok[None, :] & (rows < N_VALID)[:, None])


# ----------------------------------------------------------------------------- host side


@functools.cache
def _layouts(block_w: int, block_t: int, num_warps: int, chunks: int, e4m3: bool) -> dict:
    return kernel_layouts(block_w, block_t, num_warps, chunks, e4m3)


@functools.cache
def _lookup_tables(device: torch.device) -> torch.Tensor:
    words = [w - (1 << 32) if w >= 1 << 31 else w for w in LOOKUP_TABLE_WORDS]
    return torch.tensor(words, dtype=torch.int32, device=device)


def fragment_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    routing,
    *,
    gemm1: bool,
    decode: str,
    k_valid: int,
    n_valid: int,
    config,
    split_k: int = 1,
    ready: torch.Tensor | None = None,
    ready_target: int = 0,
    x_exp: torch.Tensor | None = None,
    in_scale: torch.Tensor | float | None = None,
    out_scale: float | None = None,
    alpha: float = 0.0,
    limit: float = 0.0,
    wide: torch.Tensor | None = None,
    half_bound: float = 0.0,
    row_scale: torch.Tensor | None = None,
    narrow_tiles: torch.Tensor | None = None,
    full_tiles: torch.Tensor | None = None,
) -> None:
    """One grouped GEMM over the tiles of `routing` (routing.route with block_m = block_t).

    a [rows, K]: x (bf16) for GEMM1, gathered by token; for GEMM2 the sorted SwiGLU rows,
    either bf16 [hi | lo] halves, fp16, or float8_e4m3fn at their MMA positions (e4m3
    weights). GEMM1's `out` dtype (bf16 [rows, 2 Ip], fp16, float8_e4m3fn or float32
    [rows, Ip]) picks the form it writes. w [E, N / 64, 64, K / 128, 16] int32 words in
    fragment order (fragment_layout_sm90.py; prepare_weights stores them panel-major, any strides
    do; row-major [E, N, K / 8] is taken too), encoded as `decode` says (prepared["w13_decode"]
    / ["w2_decode"]: shift_words' "bf16" or "fp16" layout, "prmt", or "e4m3": words in K
    order, table bytes for scales, row_scale [E, N] float32 the rows' factors); w_scale [E,
    N / 64, 64, K / 128, 4] uint8 (or [E, N, K / 32] with row-major words), a row's 16 words
    (4 bytes) of a chunk contiguous; bias [E, N] float32 or None. Outputs as
    grouped_gemm.grouped_gemm, except that GEMM2 with split_k > 1 (gemm2_splits) writes
    split_k partial rows per pair: row pair * split_k + split of `out` [pairs * split_k, H],
    for the combine to sum. Only row blocks below n_valid are computed (GEMM1 skips its
    zero-padded rows past 2I; GEMM2 then takes k_valid = I, its copies zero-filling the
    columns GEMM1 did not write; with e4m3 rows GEMM1 computes the padding's zero rows and
    GEMM2 reads all Ip, since a channel's MMA position is not in a copy's K order).

    in_scale, with fp8 activations: the scale of a's rows (their e4m3 values stored as a's
    half type, or as e4m3), a float for all or float32 per row (GEMM1: [tokens]; GEMM2:
    [sorted rows]), applied to the accumulator before the bias. out_scale (GEMM1, fp8
    activations with a static intermediate scale): write the e4m3 values of the SwiGLU rows /
    out_scale into out (fp16, bf16 [hi | lo] or e4m3), as quant.quantize_rows would from
    float32 rows.

    With config.tile_ready, ready [tile-count bound] int32, zero before GEMM1 (the router
    clears it): GEMM1's CTAs count themselves in per tile when their rows are stored, and
    GEMM2's CTAs start a tile once its count reaches ready_target (GEMM1's CTAs per tile).

    GEMM2 into fp16 `out` (unsplit): its pair rows in fp16, except that an element that does
    not round below half_bound in magnitude has NaN in `out` and its exact float32 value at the
    same index of `wide` (float32, out's shape), which combine.combine reads back so
    (fragment_epilogue_sm90.pair_rows_store).

    With config.narrow_t, narrow_tiles: routing.route's int32 [local experts], written with
    the config's narrow_t; the launch of narrow tiles runs one CTA per expert and row block.
    full_tiles (routing.route's, written with the same narrow_t): the other tiles, which the
    warp-specialized kernel shares out where it runs."""
    if w.dim() == 3:
        w, w_scale = panel_view(w), panel_view(w_scale)
    if out_scale is not None and (not gemm1 or out.dtype == torch.float32):
        raise ValueError(
            "fragment_gemm: out_scale quantizes GEMM1's SwiGLU rows into fp16 or bf16 [hi | lo]"
        )
    operand = _check_operands(a, w, w_scale, gemm1, decode, split_k, config, routing, ready, x_exp)
    e4m3 = operand == "e4m3"
    if e4m3 and (
        row_scale is None
        or row_scale.dtype != torch.float32
        or row_scale.shape != (w.shape[0], w.shape[1] * w.shape[2])
        or not row_scale.is_contiguous()
    ):
        raise ValueError("fragment_gemm: e4m3 weights need row_scale, float32 [E, N] contiguous")
    if config.narrow_t and (
        narrow_tiles is None or narrow_tiles.dtype != torch.int32 or narrow_tiles.dim() != 1
    ):
        raise ValueError("fragment_gemm: narrow_t needs narrow_tiles, int32 [local experts]")
    if config.narrow_t and (
        full_tiles is None or full_tiles.dtype != torch.int32 or full_tiles.dim() != 1
    ):
        raise ValueError("fragment_gemm: narrow_t needs full_tiles, int32 [1 + tile bound]")
    half_rows = not gemm1 and out.dtype == torch.float16
    if half_rows and (
        split_k != 1
        or not 2.0**-13 <= half_bound <= 2.0**15
        or math.frexp(half_bound)[0] != 0.5
        or wide is None
        or wide.dtype != torch.float32
        or wide.shape != out.shape
        or wide.stride() != out.stride()
    ):
        raise ValueError(
            "fragment_gemm: fp16 pair rows need an unsplit GEMM2, a power of two half_bound "
            "from 2^-13 to 2^15 and `wide`, float32 of their shape and strides"
        )
    N, K = w.shape[1] * w.shape[2], w.shape[3] * 128
    topk_weights, sorted_pairs, tiles, num_tiles, max_tiles, top_k = routing
    # A row's four e8m0 bytes of one 128-element K chunk, as one int32: [E, N / 64, 64, K / 128].
    scale_words = w_scale.view(torch.int32)[..., 0]
    wide_from_bits = fp16_wide_threshold_bits(half_bound) if half_rows else 0
    grid = (max_tiles * -(-n_valid // config.block_w) * split_k,)
    args = (
        a,
        w,
        scale_words,
        bias if bias is not None else scale_words,
        out,
        topk_weights,
        sorted_pairs,
        tiles,
        num_tiles,
        _lookup_tables(a.device),
        ready if ready is not None else num_tiles,
        x_exp if x_exp is not None else num_tiles,
        in_scale if isinstance(in_scale, torch.Tensor) else num_tiles,
        wide if half_rows else num_tiles,
        row_scale if row_scale is not None else num_tiles,
        narrow_tiles if narrow_tiles is not None else num_tiles,
        N,
        K,
        k_valid,
        n_valid,
        a.stride(0),
        *w.stride()[:4],
        *scale_words.stride(),
        bias.stride(0) if bias is not None else 0,
        out.stride(0),
        ready_target,
        alpha,
        limit,
        in_scale if isinstance(in_scale, float) else 1.0,
        out_scale if out_scale is not None else 1.0,
        wide_from_bits,
    )
    constexprs = dict(
        TOPK=top_k,
        SWIGLU=gemm1,
        SPLIT_A=not gemm1 and a.dtype == torch.bfloat16,
        HAS_BIAS=bias is not None,
        SPLIT_K=split_k,
        SHIFT_DECODE=decode != "prmt",
        SCALE_BIAS=POST_SCALE_BIAS.get(operand, 0),
        IN_SCALE=0 if in_scale is None else 1 if isinstance(in_scale, float) else 2,
        OUT_QUANT=out_scale is not None,
        HALF_ROWS=half_rows,
        E4M3=e4m3,
    )
    # With narrow_t, the tiles of at most narrow_t tokens run in a launch of their own.
    fits = dict(split_k=split_k, scaled=in_scale is not None)
    if warp_specialized_fits(config, a, w, gemm1, n_valid, **fits):
        warp_specialized_gemm(
            a, w, scale_words, bias, out, routing, full_tiles, _lookup_tables(a.device),
            in_scale, wide if half_rows else None, gemm1=gemm1, k_valid=k_valid, n_valid=n_valid,
            alpha=alpha, limit=limit, out_scale=out_scale, wide_from_bits=wide_from_bits,
            config=config, constexprs=constexprs,
        )  # fmt: skip
    else:
        _fragment_gemm_kernel[grid](*args, **constexprs, **_config_constexprs(config, False, e4m3))
    if config.narrow_t:
        # One CTA per local expert and row block, and under PDL one that only waits.
        narrow_grid = (narrow_tiles.numel() * -(-n_valid // config.block_w) * split_k + config.pdl,)
        narrow = _config_constexprs(config, True, e4m3)
        _fragment_gemm_kernel[narrow_grid](*args, **constexprs, **narrow)


@functools.cache
def fp16_wide_threshold_bits(half_bound: float) -> int:
    """The float32 bits of the smallest magnitude that rounds (to nearest even) to an fp16 at
    or above the power of two half_bound: 2^e - 2^(e - 12), the tie between 2^e and the fp16
    below it, 2^e - 2^(e - 11) (from e = -13 on: below 2^-14 fp16's steps are finer). A pair
    row element from it on is stored exact, so that the combine's test of the fp16 value
    against half_bound picks out the same elements."""
    threshold = half_bound - half_bound * 2.0**-12
    return int(torch.tensor(threshold, dtype=torch.float32).view(torch.int32))


def _config_constexprs(config, narrow: bool, e4m3: bool) -> dict:
    """The kernel's compile-time arguments and launch options that come from its
    FragmentConfig alone, for its full-tile launch or (narrow) the launch of its narrow
    tiles."""
    block_t = config.narrow_t if narrow else config.block_t
    mma_n = config.narrow_t if narrow else config.mma_n  # narrow_t excludes post_scale
    post_scale = config.post_scale
    if e4m3 and post_scale:
        # e4m3 fragments are scaled: a post-scaled config's GEMM2 multiplies its few-token
        # tiles as wgmma's narrowest N, 8 columns (those past a tile's rows masked).
        block_t = mma_n = 8
        post_scale = False
    return dict(
        BLOCK_W=config.block_w,
        BLOCK_T=block_t,
        TILE_ROWS=config.block_t,
        SKIP_AT_MOST=0 if narrow else config.narrow_t,
        STAGES=(config.narrow_stages or config.stages) if narrow else config.stages,
        CHUNKS=config.chunks,
        PDL=config.pdl,
        TILE_READY=config.tile_ready,
        MMA_IN_FLIGHT=config.in_flight,
        POST_SCALE=post_scale,
        num_warps=config.num_warps,
        launch_pdl=config.pdl,
        **_layouts(config.block_w, mma_n, config.num_warps, config.chunks, e4m3),
    )


def _check_operands(a, w, w_scale, gemm1, decode, split_k, config, routing, ready, x_exp) -> str:
    """fragment_gemm's checks of what its caller passed; returns the A operand's half type."""
    if w.stride(4) != 1 or w_scale.stride(4) != 1:
        raise ValueError("fragment_gemm: a chunk's words (scale bytes) of a row must be contiguous")
    K = w.shape[3] * 128
    if split_k != 1 and (gemm1 or split_k != gemm2_splits(split_k, K)):
        raise ValueError(f"fragment_gemm: split_k {split_k} for GEMM{1 if gemm1 else 2}")
    if decode == "e4m3" or a.dtype == torch.float8_e4m3fn:
        # e4m3 fragments against e4m3 activations in MMA order, K columns of them.
        if decode != "e4m3" or a.dtype != torch.float8_e4m3fn or a.shape[1] != K:
            raise ValueError(
                f"fragment_gemm: e4m3 weights take float8_e4m3fn activations of {K} columns, "
                f"got {decode} weights and {a.dtype} x {a.shape[1]}"
            )
        return "e4m3"
    # The weights decode to the A operand's type: x's bf16 for GEMM1, a's type for GEMM2.
    operand = "bf16" if gemm1 or a.dtype == torch.bfloat16 else "fp16"
    if decode not in (operand, "prmt") or (decode == "prmt" and operand == "fp16"):
        raise ValueError(f"fragment_gemm: {decode} weights for a {operand} operand")
    if not gemm1:
        width = {torch.float16: K, torch.bfloat16: 2 * K}.get(a.dtype)
        if a.shape[1] != width:
            raise ValueError(
                f"fragment_gemm: GEMM2 rows are {a.dtype} x {a.shape[1]}, expected fp16 x {K} "
                f"or bf16 x {2 * K} ([hi | lo])"
            )
    tile_bound = routing[4]
    if config.tile_ready and (
        ready is None or ready.dtype != torch.int32 or ready.numel() < tile_bound
    ):
        raise ValueError("fragment_gemm: tile_ready needs `ready`, one zeroed int32 per tile")
    # Post-scaling needs raw halves that multiply exactly: shift-decoded fp16 weights, or
    # bf16 weights against x rows scaled up by 2^(126 - x_exp) (routing's _prescale_row).
    if config.post_scale and (decode == "prmt" or not (gemm1 or operand == "fp16")):
        raise ValueError(
            f"fragment_gemm: post_scale needs shift-decoded weights for GEMM1 or an "
            f"fp16 GEMM2, got {decode} weights for a {operand} operand"
        )
    if config.post_scale and gemm1 and x_exp is None:
        raise ValueError("fragment_gemm: post-scaled GEMM1 needs x_exp (route's prescale)")
    return operand
