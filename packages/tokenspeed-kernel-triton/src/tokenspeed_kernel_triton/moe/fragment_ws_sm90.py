"""The full 128-token tiles of GEMM1 (FragmentConfig.warp_specialized) and of GEMM2
(warp_specialized_gemm2), warp-specialized and persistent (wgmma_gemm_sm90.fragment_gemm launches
it in place of the fragment kernel's full-tile launch).

One CTA per SM walks the (routing tile, 256-row block) work items by grid stride, over the
tiles past narrow_t rows that routing lists (full_tiles; the narrow launch takes the rest),
each tile's blocks turned where the grid would pin them (rotates_row_blocks). A producer
warpgroup copies each K chunk's activation rows [128 tokens, 128] (GEMM1: x gathered by token;
GEMM2: the tile's fp16 SwiGLU rows) and the block's weight words and scales into a ring of
STAGES slots (cp.async; each producer thread's arrival on the slot's `full` mbarrier lands when
its copies have). Two consumer warpgroups, 128 of the block's rows each, decode their words into
wgmma fragments, multiply them by the shared x rows and release the slot on its `empty`
mbarrier. So the copies leave the consumers' instruction stream, no CTA barrier joins the two
consumers (one decodes while the other's wgmmas run), one copy of the x rows serves 256 weight
rows, and the producer fills the ring with the next work item while the consumers run their
epilogues. With FIT_WIDTHS a tile of at most 64 (96) tokens, most often an expert's last,
multiplies 64 (64 + 32) activation rows rather than 128: its MMAs and epilogue shrink with it.

The decode, MMA and epilogue are the fragment kernel's (fragment_steps_sm90,
fragment_epilogue_sm90): its outputs bit for bit. Registers (setmaxnreg): the producer runs
spill-free on 56, since a spilled address reloads from L2 (shared memory leaves L1 little) and
stalls the ring; the consumers need 224 for ptxas not to serialize their wgmmas (C7512).
GEMM2 takes it where its config says (the prefill picks: the whole layer, TP shards and
expert-parallel ranks, whose few experts leave the fragment kernel's CTAs spread unevenly over
the SMs), into float32 pair rows or fp16 ones. fp16 pair rows (the TP=4 and TP=8 shards) go
through each consumer's own 32 KB stage, as the fragment kernel stages them over its ring:
the ring here is the producer's, already filling with the next item. A 3-step ring leaves
shared memory for both stages, and where GEMM2 has three K chunks (TP=8) it still holds a
whole work item ahead of the epilogues.
"""

from __future__ import annotations

import functools
import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mbarrier
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .._launch import bind_launches
from .fragment_epilogue_sm90 import epilogue_operands, pair_rows_store, swiglu_store
from .fragment_layout_sm90 import PANEL_ROWS, kernel_layouts
from .fragment_steps_sm90 import decode_fragment
from .replay import recordable

RING_STAGES = 4
# fp16 pair rows stage each consumer's output tile through 32 KB of its own: one ring step
# fewer leaves room for both (3 x 49 KB + 64 KB of 227 KB).
HALF_ROWS_STAGES = 3
WG_ROWS = 128
CTA_ROWS = 2 * WG_ROWS

_RING_STAGES = gl.constexpr(RING_STAGES)
_HALF_ROWS_STAGES = gl.constexpr(HALF_ROWS_STAGES)
_WG_ROWS = gl.constexpr(WG_ROWS)
_CTA_ROWS = gl.constexpr(CTA_ROWS)
_TOKENS = gl.constexpr(128)
_PANEL_ROWS = gl.constexpr(PANEL_ROWS)
_PRODUCER_REGS = gl.constexpr(56)
_CONSUMER_REGS = gl.constexpr(224)
_FIRST = gl.constexpr(0)
_SECOND = gl.constexpr(1)
# The consumers' layouts are the 128 x 128, 4-warp fragment kernel's; the producer copies 16
# bytes per thread (x rows, words) and one scale word per thread.
_BASE = kernel_layouts(WG_ROWS, 128, 4)
_MMA = gl.constexpr(_BASE["mma"])
_DOT_A = gl.constexpr(_BASE["dot_a"])
_MMA_64 = gl.constexpr(kernel_layouts(WG_ROWS, 64, 4)["mma"])
_DOT_A_64 = gl.constexpr(kernel_layouts(WG_ROWS, 64, 4)["dot_a"])
_MMA_32 = gl.constexpr(kernel_layouts(WG_ROWS, 32, 4)["mma"])
_DOT_A_32 = gl.constexpr(kernel_layouts(WG_ROWS, 32, 4)["dot_a"])
_WORDS = gl.constexpr(_BASE["words_layout"])
# bf16's swizzle, which fp16 (GEMM2's rows) shares: both are 16-bit.
_X_SMEM = gl.constexpr(_BASE["smem_layout"])
_X_COPY = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0]))
_WORDS_COPY = gl.constexpr(gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0]))
_SCALES_COPY = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))
_STAGE_SMEM = gl.constexpr(_BASE["stage_layout"])
_PAIR_ROWS = gl.constexpr(_BASE["pair_rows_layout"])


@gluon.jit
def _num_items(num_tiles_ptr, full_ptr, num_w, NARROW_T: gl.constexpr):
    """The launch's work items: (routing tile, 256-row block) pairs, over the tiles past
    NARROW_T rows (routing's full_tiles) where a narrow launch takes the others, so that the
    grid stride shares out only items with work. Skipped in place, a narrow tile's items
    would leave each CTA the real items its sample of the tiles holds, some CTAs several
    more than the mean (H200, EP=8 M=4096: 18% of the layer; docs/decisions.md)."""
    if NARROW_T:
        tiles = gl.load(full_ptr, cache_modifier=".cg")
    else:
        tiles = gl.load(num_tiles_ptr, cache_modifier=".cg")
    return tiles * num_w


@gluon.jit
def _work_item(work, num_w, tiles_ptr, full_ptr, NARROW_T: gl.constexpr,
               ROTATE_BLOCKS: gl.constexpr):  # fmt: skip
    ordinal = work // num_w
    pid_w = work % num_w
    if ROTATE_BLOCKS:
        # Each tile's blocks start one further on (rotates_row_blocks says why); the grid's
        # consecutive items still cover the same tiles' blocks, which share x rows and weights.
        pid_w = (pid_w + ordinal) % num_w
    if NARROW_T:
        tile = gl.load(full_ptr + 1 + ordinal, cache_modifier=".cg")
    else:
        tile = ordinal
    expert = gl.load(tiles_ptr + 2 * tile, cache_modifier=".cg").to(gl.int64)
    row_end = gl.load(tiles_ptr + 2 * tile + 1, cache_modifier=".cg")
    return tile, pid_w, expert, row_end


@gluon.jit
def _producer(pointers, ring, sizes, strides, TOPK: gl.constexpr, NARROW_T: gl.constexpr,
              SWIGLU: gl.constexpr, ROTATE_BLOCKS: gl.constexpr):  # fmt: skip
    x_ptr, w_ptr, ws_ptr, sorted_ptr, tiles_ptr, num_tiles_ptr, full_tiles_ptr = pointers
    x_ring, words_ring, scales_ring, full, empty = ring
    STAGES: gl.constexpr = full.shape[0]
    N, K, K_VALID, N_VALID, grid = sizes
    word_strides, scale_strides = strides
    stride_xm, stride_we, stride_wp, stride_wn, stride_wc = word_strides
    stride_se, stride_sp, stride_sn, stride_sc = scale_strides
    num_w = gl.cdiv(N_VALID, _CTA_ROWS)
    num_items = _num_items(num_tiles_ptr, full_tiles_ptr, num_w, NARROW_T)
    t_local = gl.arange(0, _TOKENS, layout=gl.SliceLayout(1, _X_COPY))
    k_local = gl.arange(0, 128, layout=gl.SliceLayout(0, _X_COPY))
    w_local = gl.arange(0, _CTA_ROWS, layout=gl.SliceLayout(1, _WORDS_COPY))
    wj = gl.arange(0, 16, layout=gl.SliceLayout(0, _WORDS_COPY))
    s_local = gl.arange(0, _CTA_ROWS, layout=_SCALES_COPY)
    count = 0
    for work in range(gl.program_id(0), num_items, grid):
        tile, pid_w, expert, row_end = _work_item(
            work, num_w, tiles_ptr, full_tiles_ptr, NARROW_T, ROTATE_BLOCKS
        )
        first_row = tile * _TOKENS
        # Loop-invariant 32-bit offsets (the host checks their range) from per-step scalar
        # bases keep the producer within its registers.
        offs_t = first_row + t_local
        t_ok = offs_t < row_end
        if SWIGLU:
            pair = gl.load(sorted_ptr + offs_t, mask=t_ok, other=0, cache_modifier=".cg")
            x_rows = pair // TOPK
        else:
            x_rows = offs_t
        x_offs = (x_rows * stride_xm)[:, None] + k_local[None, :]
        # Rows past N (a block overhanging the padded rows) reread row N - 1.
        wr = gl.minimum(pid_w * _CTA_ROWS + w_local, N - 1)
        w_offs = (wr // _PANEL_ROWS * stride_wp + wr % _PANEL_ROWS * stride_wn)[:, None]
        w_offs = w_offs + wj[None, :]
        sr = gl.minimum(pid_w * _CTA_ROWS + s_local, N - 1)
        s_offs = sr // _PANEL_ROWS * stride_sp + sr % _PANEL_ROWS * stride_sn
        w_expert = w_ptr + expert * stride_we
        s_expert = ws_ptr + expert * stride_se
        for k in range(K // 128):
            slot = count % STAGES
            # Both consumers released the slot's previous use (none in the first lap).
            mbarrier.wait(empty.index(slot), (count // STAGES + 1) & 1, pred=count >= STAGES)
            # A row ends at K_VALID (x's H, GEMM2's I); the weights' zero padding past it
            # meets zeros.
            mask = t_ok[:, None] & ((k * 128 + k_local) < K_VALID)[None, :]
            async_copy.async_copy_global_to_shared(
                x_ring.index(slot), x_ptr + k * 128 + x_offs, mask=mask
            )
            async_copy.async_copy_global_to_shared(
                words_ring.index(slot), w_expert + k * stride_wc + w_offs
            )
            async_copy.async_copy_global_to_shared(
                scales_ring.index(slot), s_expert + k * stride_sc + s_offs
            )
            async_copy.mbarrier_arrive(full.index(slot), increment_count=False)
            count += 1


@gluon.jit
def _fragment(ring, slot, lo_table, hi_table, SHIFT_DECODE: gl.constexpr, F16: gl.constexpr,
              WG: gl.constexpr, dot_a: gl.constexpr):  # fmt: skip
    """This consumer's decoded [128 rows, 128 K] fragment of the ring's slot, once it is full."""
    x_ring, words_ring, scales_ring, full, empty = ring
    words = words_ring.index(slot).slice(WG * _WG_ROWS, _WG_ROWS).load(_WORDS)
    scales = scales_ring.index(slot).slice(WG * _WG_ROWS, _WG_ROWS)
    scales = scales.load(gl.SliceLayout(1, _WORDS))
    return decode_fragment(
        words, scales, lo_table, hi_table, dot_a, _WG_ROWS, SHIFT_DECODE, F16, False
    )


@gluon.jit
def _epilogue(acc, epilogue, out_rows, swiglu_args, TOPK: gl.constexpr, SWIGLU: gl.constexpr,
              HAS_BIAS: gl.constexpr, IN_SCALE: gl.constexpr, OUT_QUANT: gl.constexpr,
              COLS: gl.constexpr, mma: gl.constexpr):  # fmt: skip
    """The fragment kernel's epilogue for this consumer's [128 rows, COLS tokens]: GEMM1 bias
    and SwiGLU into the intermediate's rows; GEMM2 bias and routing weight into its pair rows,
    float32, or fp16 (out's type) with the elements not below the bound exact in `wide`
    (pair_rows_store, through this consumer's stage)."""
    alpha, limit, out_scale = swiglu_args
    operands = epilogue_operands(
        epilogue, TOPK, SWIGLU, HAS_BIAS, False, 0, IN_SCALE, _WG_ROWS, COLS, mma
    )
    rows, cols, col_ok, pair, bias, pre_factor, post_factor = operands
    if IN_SCALE != 0:
        acc *= pre_factor[None, :]
    if HAS_BIAS:
        acc += bias[:, None]
    out_ptr, N, n_valid, stride_om, wide_ptr, wide_from_bits, stage = out_rows
    if SWIGLU:
        swiglu_store(
            (out_ptr, N, stride_om, rows, cols, col_ok), acc, alpha, limit, out_scale, _WG_ROWS,
            COLS, OUT_QUANT,
        )  # fmt: skip
    elif out_ptr.dtype.element_ty == gl.float16:
        acc *= post_factor[None, :]  # the routing weight
        pointers, expert, first_row, row_block, row_end, n_rows = epilogue
        sorted_ptr = pointers[0]
        pair_rows_store(
            out_ptr, wide_ptr, acc, stage._reinterpret(gl.float16, [_WG_ROWS, COLS], _STAGE_SMEM),
            wide_from_bits, sorted_ptr, (first_row, row_end), row_block, n_valid, stride_om,
            _WG_ROWS, COLS, _PAIR_ROWS,
        )  # fmt: skip
    else:
        acc *= post_factor[None, :]  # the routing weight
        ptrs = out_ptr + pair.to(gl.int64)[None, :] * stride_om + rows[:, None]
        gl.store(ptrs, acc, mask=col_ok[None, :] & (rows < n_valid)[:, None])


@gluon.jit
def _tile(ring, count, epilogue, lo_table, hi_table, out_rows, swiglu_args, K,
          TOPK: gl.constexpr, SWIGLU: gl.constexpr, HAS_BIAS: gl.constexpr,
          SHIFT_DECODE: gl.constexpr, IN_SCALE: gl.constexpr, OUT_QUANT: gl.constexpr,
          WG: gl.constexpr, COLS: gl.constexpr, mma: gl.constexpr,
          dot_a: gl.constexpr):  # fmt: skip
    """One consumer's work item: its 128 rows' product with the ring's first COLS activation
    rows over K, then the epilogue; returns the ring count past its steps."""
    x_ring, words_ring, scales_ring, full, empty = ring
    STAGES: gl.constexpr = full.shape[0]
    acc = gl.zeros([_WG_ROWS, COLS], gl.float32, layout=mma)
    for _step in range(K // 128):
        slot = count % STAGES
        mbarrier.wait(full.index(slot), (count // STAGES) & 1)
        # The producer's copies (generic proxy) before the wgmma reads them (async).
        fence_async_shared()
        frag = _fragment(ring, slot, lo_table, hi_table, SHIFT_DECODE, not SWIGLU, WG, dot_a)
        b = x_ring.index(slot).slice(0, COLS).permute((1, 0))
        acc = warpgroup_mma(frag, b, acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        # Gluon puts the partition's barrier before the single arrival: every warp of this
        # consumer is done with the slot.
        mbarrier.arrive(empty.index(slot))
        count += 1
    _epilogue(
        acc, epilogue, out_rows, swiglu_args, TOPK, SWIGLU, HAS_BIAS, IN_SCALE, OUT_QUANT, COLS,
        mma,
    )  # fmt: skip
    return count


@gluon.jit
def _pass(ring, count, K):
    """A consumer wholly in the zero padding: its share of the ring's protocol without decode
    or MMA (it would store nothing). Waiting for each slot to fill keeps its arrivals on
    `empty` in step with the other consumer's."""
    x_ring, words_ring, scales_ring, full, empty = ring
    STAGES: gl.constexpr = full.shape[0]
    for _step in range(K // 128):
        slot = count % STAGES
        mbarrier.wait(full.index(slot), (count // STAGES) & 1)
        mbarrier.arrive(empty.index(slot))
        count += 1
    return count


@gluon.jit
def _tile_96(ring, count, epilogue, lo_table, hi_table, out_rows, swiglu_args, K,
             TOPK: gl.constexpr, SWIGLU: gl.constexpr, HAS_BIAS: gl.constexpr,
             SHIFT_DECODE: gl.constexpr, IN_SCALE: gl.constexpr, OUT_QUANT: gl.constexpr,
             WG: gl.constexpr):  # fmt: skip
    """_tile over 96 tokens, as 64 and 32 columns (tensor shapes are powers of two): each
    fragment multiplies both."""
    x_ring, words_ring, scales_ring, full, empty = ring
    acc_a = gl.zeros([_WG_ROWS, 64], gl.float32, layout=_MMA_64)
    acc_b = gl.zeros([_WG_ROWS, 32], gl.float32, layout=_MMA_32)
    STAGES: gl.constexpr = full.shape[0]
    for _step in range(K // 128):
        slot = count % STAGES
        mbarrier.wait(full.index(slot), (count // STAGES) & 1)
        fence_async_shared()
        frag = _fragment(ring, slot, lo_table, hi_table, SHIFT_DECODE, not SWIGLU, WG, _DOT_A_64)
        x_rows = x_ring.index(slot)
        acc_a = warpgroup_mma(frag, x_rows.slice(0, 64).permute((1, 0)), acc_a, is_async=True)
        frag_b = gl.convert_layout(frag, _DOT_A_32, assert_trivial=True)
        acc_b = warpgroup_mma(frag_b, x_rows.slice(64, 32).permute((1, 0)), acc_b, is_async=True)
        acc_a, acc_b = warpgroup_mma_wait(0, deps=[acc_a, acc_b])
        mbarrier.arrive(empty.index(slot))
        count += 1
    _epilogue(
        acc_a, epilogue, out_rows, swiglu_args, TOPK, SWIGLU, HAS_BIAS, IN_SCALE, OUT_QUANT, 64,
        _MMA_64,
    )  # fmt: skip
    pointers, expert, first_row, row_block, row_end, n_valid = epilogue
    second = (pointers, expert, first_row + 64, row_block, row_end, n_valid)
    _epilogue(
        acc_b, second, out_rows, swiglu_args, TOPK, SWIGLU, HAS_BIAS, IN_SCALE, OUT_QUANT, 32,
        _MMA_32,
    )  # fmt: skip
    return count


@gluon.jit
def _consumer(
    pointers, ring, sizes, epilogue_args, stage,
    TOPK: gl.constexpr, SWIGLU: gl.constexpr, HAS_BIAS: gl.constexpr, NARROW_T: gl.constexpr,
    FIT_WIDTHS: gl.constexpr, SHIFT_DECODE: gl.constexpr, IN_SCALE: gl.constexpr,
    OUT_QUANT: gl.constexpr, WG: gl.constexpr, ROTATE_BLOCKS: gl.constexpr,
):  # fmt: skip
    (bias_ptr, out_ptr, route_w_ptr, sorted_ptr, tiles_ptr, num_tiles_ptr, full_tiles_ptr,
     table_ptr, in_scale_ptr, wide_ptr) = pointers  # fmt: skip
    N, K, K_VALID, N_VALID, grid = sizes
    stride_be, stride_om, alpha, limit, in_scale, out_scale, wide_from_bits = epilogue_args
    num_w = gl.cdiv(N_VALID, _CTA_ROWS)
    num_items = _num_items(num_tiles_ptr, full_tiles_ptr, num_w, NARROW_T)
    lo_table = gl.load(table_ptr)
    hi_table = gl.load(table_ptr + 1)
    # x's exponents are not these tiles' (unscaled x): a placeholder.
    epilogue_ptrs = (
        sorted_ptr, route_w_ptr, bias_ptr, sorted_ptr, stride_be, in_scale_ptr, in_scale
    )  # fmt: skip
    out_rows = (out_ptr, N, N_VALID, stride_om, wide_ptr, wide_from_bits, stage)
    swiglu_args = (alpha, limit, out_scale)
    count = 0
    for work in range(gl.program_id(0), num_items, grid):
        tile, pid_w, expert, row_end = _work_item(
            work, num_w, tiles_ptr, full_tiles_ptr, NARROW_T, ROTATE_BLOCKS
        )
        first_row = tile * _TOKENS
        row_block = 2 * pid_w + WG
        epilogue = (epilogue_ptrs, expert, first_row, row_block, row_end, N_VALID)
        n = row_end - first_row
        # A consumer wholly past the real rows (the last block where 2I or H is not a
        # multiple of 256) would store nothing: it only keeps the ring going.
        if row_block * _WG_ROWS >= N_VALID:
            count = _pass(ring, count, K)
        elif not FIT_WIDTHS or n > 96:
            count = _tile(
                ring, count, epilogue, lo_table, hi_table, out_rows, swiglu_args, K,
                TOPK, SWIGLU, HAS_BIAS, SHIFT_DECODE, IN_SCALE, OUT_QUANT, WG, _TOKENS, _MMA,
                _DOT_A,
            )  # fmt: skip
        elif n > 64:
            count = _tile_96(
                ring, count, epilogue, lo_table, hi_table, out_rows, swiglu_args, K,
                TOPK, SWIGLU, HAS_BIAS, SHIFT_DECODE, IN_SCALE, OUT_QUANT, WG,
            )  # fmt: skip
        else:
            count = _tile(
                ring, count, epilogue, lo_table, hi_table, out_rows, swiglu_args, K,
                TOPK, SWIGLU, HAS_BIAS, SHIFT_DECODE, IN_SCALE, OUT_QUANT, WG, 64, _MMA_64,
                _DOT_A_64,
            )  # fmt: skip


@recordable
@bind_launches
@gluon.jit
def _warp_specialized_kernel(
    x_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, route_w_ptr, sorted_ptr, tiles_ptr, num_tiles_ptr,
    full_tiles_ptr, table_ptr, in_scale_ptr, wide_ptr,
    N, K, K_VALID, N_VALID, grid,
    stride_xm, stride_we, stride_wp, stride_wn, stride_wc, stride_se, stride_sp, stride_sn,
    stride_sc, stride_be, stride_om,
    alpha, limit, in_scale, out_scale, wide_from_bits,
    TOPK: gl.constexpr, SWIGLU: gl.constexpr, HAS_BIAS: gl.constexpr, NARROW_T: gl.constexpr,
    FIT_WIDTHS: gl.constexpr, SHIFT_DECODE: gl.constexpr, IN_SCALE: gl.constexpr,
    OUT_QUANT: gl.constexpr, PDL: gl.constexpr, ROTATE_BLOCKS: gl.constexpr,
):  # fmt: skip
    # GEMM2's activation rows are fp16 (its weights decode to fp16; fragment_gemm checks).
    gl.static_assert(SWIGLU or x_ptr.dtype.element_ty == gl.float16)
    if PDL:
        # The kernel before is complete past the wait (GEMM1: the routing outputs; GEMM2: all
        # of GEMM1, whose narrow launch waits for its full tiles); the launch after (the
        # narrow tiles') starts as SMs free up.
        gdc_wait()
        gdc_launch_dependents()
    # GEMM2 into fp16 pair rows (wgmma_gemm_sm90.fragment_gemm's half_rows) stages each
    # consumer's output tile: a ring step fewer for the two stages.
    HALF_ROWS: gl.constexpr = not SWIGLU and out_ptr.dtype.element_ty == gl.float16
    STAGES: gl.constexpr = _HALF_ROWS_STAGES if HALF_ROWS else _RING_STAGES
    STAGE_ROWS: gl.constexpr = _WG_ROWS if HALF_ROWS else 8
    x_ring = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [STAGES, _TOKENS, 128], _X_SMEM)
    # Plain row-major slots (a layout of a slot's rank).
    words_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    scales_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    words_ring = gl.allocate_shared_memory(gl.int32, [STAGES, _CTA_ROWS, 16], words_smem)
    scales_ring = gl.allocate_shared_memory(gl.int32, [STAGES, _CTA_ROWS], scales_smem)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    first_stage = gl.allocate_shared_memory(gl.float16, [STAGE_ROWS, STAGE_ROWS], _STAGE_SMEM)
    second_stage = gl.allocate_shared_memory(gl.float16, [STAGE_ROWS, STAGE_ROWS], _STAGE_SMEM)
    for s in gl.static_range(STAGES):
        mbarrier.init(full.index(s), count=128)  # the producer warpgroup's threads
        mbarrier.init(empty.index(s), count=2)  # the two consumers
    ring = (x_ring, words_ring, scales_ring, full, empty)
    sizes = (N, K, K_VALID, N_VALID, grid)
    consumer_pointers = (
        bias_ptr, out_ptr, route_w_ptr, sorted_ptr, tiles_ptr, num_tiles_ptr, full_tiles_ptr,
        table_ptr, in_scale_ptr, wide_ptr,
    )  # fmt: skip
    epilogue_args = (stride_be, stride_om, alpha, limit, in_scale, out_scale, wide_from_bits)
    producer_pointers = (
        x_ptr, w_ptr, ws_ptr, sorted_ptr, tiles_ptr, num_tiles_ptr, full_tiles_ptr
    )  # fmt: skip
    strides = (
        (stride_xm, stride_we, stride_wp, stride_wn, stride_wc),
        (stride_se, stride_sp, stride_sn, stride_sc),
    )
    # Constexprs stay constexprs only as top-level entries of a partition's arguments (inside
    # a tuple built here they would reach the partition as run-time values).
    gl.warp_specialize(
        [
            (_consumer, (consumer_pointers, ring, sizes, epilogue_args, first_stage, TOPK,
                         SWIGLU, HAS_BIAS, NARROW_T, FIT_WIDTHS, SHIFT_DECODE, IN_SCALE,
                         OUT_QUANT, _FIRST, ROTATE_BLOCKS)),
            (_consumer, (consumer_pointers, ring, sizes, epilogue_args, second_stage, TOPK,
                         SWIGLU, HAS_BIAS, NARROW_T, FIT_WIDTHS, SHIFT_DECODE, IN_SCALE,
                         OUT_QUANT, _SECOND, ROTATE_BLOCKS)),
            (_producer, (producer_pointers, ring, sizes, strides, TOPK, NARROW_T, SWIGLU,
                         ROTATE_BLOCKS)),
        ],
        [4, 4],
        [_CONSUMER_REGS, _PRODUCER_REGS],
    )  # fmt: skip


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the AOT check compiles on the CPU: an H100's count
    return torch.cuda.get_device_properties(device).multi_processor_count


def rotates_row_blocks(grid: int, row_blocks: int) -> bool:
    """Whether the persistent CTAs' work items turn each routing tile's 256-row blocks by the
    tile. Taken tile by tile, a CTA's items (its index plus multiples of the grid) hold only
    the blocks of one residue class where the grid and a tile's blocks share a factor: H =
    2880's 12 blocks on 132 SMs give every CTA one block, and the 11 CTAs holding the last
    (a quarter real rows, its second consumer idle) run only those and end early while the
    others run full ones. Where they share none the stride already turns the blocks, and
    turning them again only reshuffles expert-parallel ranks' few items (H200, EP=8 M=4096,
    measured over every tile: 3.4% slower; docs/decisions.md)."""
    return math.gcd(grid, row_blocks) > 1


def warp_specialized_fits(
    config,
    a: torch.Tensor,
    w: torch.Tensor,
    gemm1: bool,
    n_valid: int,
    *,
    split_k: int = 1,
    scaled: bool = False,
) -> bool:
    """Whether the warp-specialized kernel takes this call's full tiles: config.warp_specialized
    and 32-bit copy offsets, and for GEMM1 bf16 x in whole 256-row blocks of the padded rows,
    for GEMM2 config.warp_specialized_gemm2, fp16 SwiGLU rows, no K splits and no fp8 scales
    (scaled: the rows hold e4m3 values); its pair rows float32 or fp16. A GEMM1 consumer whose
    rows start below n_valid stores them all (the SwiGLU epilogue masks no rows): those past
    n_valid are the zero padding, whose zeros land in the intermediate's padded channels, which
    GEMM2 never reads (its k_valid), as the fragment kernel's 128-row blocks do past an odd
    2I / 128.
    GEMM2's epilogue stores only rows below n_valid, and its copies reread the last row past the
    padded ones."""
    if not (config.warp_specialized and a.numel() < 2**31 and w.numel() // w.shape[0] < 2**31):
        return False
    if gemm1:
        padded_rows = w.shape[1] * w.shape[2]
        return a.dtype == torch.bfloat16 and padded_rows % CTA_ROWS == 0 and n_valid <= padded_rows
    return (
        config.warp_specialized_gemm2 and a.dtype == torch.float16 and split_k == 1 and not scaled
    )


def warp_specialized_gemm(
    a, w, scale_words, bias, out, routing, full_tiles, table, in_scale, wide, *, gemm1: bool,
    k_valid: int,
    n_valid: int, alpha: float, limit: float, out_scale: float | None, wide_from_bits: int,
    config, constexprs: dict,
) -> None:  # fmt: skip
    """GEMM1 + bias + SwiGLU, or GEMM2 + bias and routing weight, over the routing tiles of more
    than config.narrow_t tokens, as wgmma_gemm_sm90.fragment_gemm computes them (its checked
    operands; `constexprs` its kernel's call-dependent ones). With config.narrow_t,
    full_tiles: routing.route's list of the tiles past it, whose items the CTAs share out
    (fragment_gemm checks it)."""
    N, K = w.shape[1] * w.shape[2], w.shape[3] * 128
    topk_weights, sorted_pairs, tiles, num_tiles, max_tiles, top_k = routing
    grid = min(_sm_count(a.device), max_tiles * -(-n_valid // CTA_ROWS))
    _warp_specialized_kernel[(grid,)](
        a, w, scale_words, bias if bias is not None else scale_words, out, topk_weights,
        sorted_pairs, tiles, num_tiles, full_tiles if config.narrow_t else num_tiles, table,
        in_scale if isinstance(in_scale, torch.Tensor) else num_tiles,
        wide if wide is not None else num_tiles,
        N, K, k_valid, n_valid, grid,
        a.stride(0), *w.stride()[:4], *scale_words.stride(),
        bias.stride(0) if bias is not None else 0, out.stride(0),
        alpha, limit, in_scale if isinstance(in_scale, float) else 1.0,
        out_scale if out_scale is not None else 1.0, wide_from_bits,
        TOPK=top_k, SWIGLU=gemm1, HAS_BIAS=bias is not None, NARROW_T=config.narrow_t,
        FIT_WIDTHS=config.fit_widths,
        SHIFT_DECODE=constexprs["SHIFT_DECODE"], IN_SCALE=constexprs["IN_SCALE"],
        OUT_QUANT=constexprs["OUT_QUANT"], PDL=config.pdl,
        ROTATE_BLOCKS=rotates_row_blocks(grid, -(-n_valid // CTA_ROWS)), num_warps=4,
        launch_pdl=config.pdl,
    )  # fmt: skip
