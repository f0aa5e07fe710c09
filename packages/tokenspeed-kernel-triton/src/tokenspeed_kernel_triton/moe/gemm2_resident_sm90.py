"""GEMM2 on short intermediates (a TP=8 shard's 384 channels), warp-specialized and persistent,
each routing tile's SwiGLU rows resident in shared memory (FragmentConfig.resident_gemm2;
wgmma_gemm_sm90.fragment_gemm launches it in place of the fragment kernel's GEMM2 launches).

The fragment kernel's GEMM2 CTA takes one (tile, 128-row block): it copies the tile's 128
activation rows (96 KB over 384 channels) for 24 KB of weight words, again for each of the 23
row blocks of H = 2880, and its three K chunks leave it mostly prologue and epilogue. Here one
CTA per SM walks (tile, group of row blocks) work items: the tile's rows are copied once per
item into a resident [chunks, 128 tokens, 128] buffer, and two consumer warpgroups take
alternate row blocks of the group, each streaming only its weight words through a ring of its
own (cp.async, one K chunk a step, prefetched across row blocks and items) and storing its pair
rows through a staging tile of its own. No CTA barrier joins the two consumers, so one's
epilogue runs under the other's MMAs as two CTAs' do in the fragment kernel; they meet only at
the resident buffer, per chunk on mbarriers: `act_full` when both halves of the next item's
rows landed (each consumer copies 64 of them), `act_empty` when both have multiplied the last
row block of the item that held it. Each consumer copies the next item's rows right after its
last MMA of the current one, so the copy runs under its last epilogue.

Tiles of at most NARROW_T tokens (an expert's last) multiply that many columns rather than
128, in this launch: GEMM2 needs no narrow launch of its own. Decode, MMA order and epilogue are
the fragment kernel's (fragment_steps_sm90.decode_fragment, fragment_epilogue_sm90): its outputs
bit for bit.
"""

from __future__ import annotations

import functools

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
from .fragment_epilogue_sm90 import epilogue_operands, pair_rows_store
from .fragment_layout_sm90 import PANEL_ROWS, kernel_layouts
from .fragment_steps_sm90 import decode_fragment
from .replay import recordable

# Weight ring steps per consumer: with the resident rows and two staging tiles, three fill
# the shared memory (211 KB at 384 channels).
STAGES = 3
WG_ROWS = 128
TOKENS = 128
MAX_CHUNKS = 3
# Row blocks per work item (alternating between the consumers): H = 2880's 23 blocks in two
# items per tile, each copying the tile's rows once.
GROUP_BLOCKS = 12

_STAGES = gl.constexpr(STAGES)
_WG_ROWS = gl.constexpr(WG_ROWS)
_TOKENS = gl.constexpr(TOKENS)
_HALF = gl.constexpr(TOKENS // 2)
_PANEL_ROWS = gl.constexpr(PANEL_ROWS)
_WORKER_REGS = gl.constexpr(256)
_FIRST = gl.constexpr(0)
_SECOND = gl.constexpr(1)
_BASE = kernel_layouts(WG_ROWS, TOKENS, 4)
_MMA = gl.constexpr(_BASE["mma"])
_DOT_A = gl.constexpr(_BASE["dot_a"])
_PAIR_ROWS = gl.constexpr(_BASE["pair_rows_layout"])
_STAGE = gl.constexpr(_BASE["stage_layout"])
_WORDS = gl.constexpr(_BASE["words_layout"])
_ACT_SMEM = gl.constexpr(_BASE["smem_layout"])
_ACT_COPY = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0]))
_WORDS_COPY = gl.constexpr(gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0]))
_SCALES_COPY = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))


def _narrow_layouts(cols: int) -> tuple:
    layouts = kernel_layouts(WG_ROWS, cols, 4)
    return tuple(gl.constexpr(layouts[k]) for k in ("mma", "dot_a", "pair_rows_layout"))


_MMA_32, _DOT_A_32, _PAIR_ROWS_32 = _narrow_layouts(32)


@gluon.jit
def _my_blocks(group, num_blocks, GROUP: gl.constexpr, WG: gl.constexpr):
    """This consumer's row blocks of the group: every second one from its own."""
    count = gl.minimum(num_blocks - group * GROUP, GROUP)
    return (count - WG + 1) // 2


@gluon.jit
def _issue_rows(act, act_full, act_empty, a_ptr, tile, row_end, wait_phase, K_VALID, stride_am,
                CHUNKS: gl.constexpr, WAIT: gl.constexpr, WG: gl.constexpr):  # fmt: skip
    """This consumer's half (64 of the tile's 128 rows) of each chunk of the tile's SwiGLU rows
    into the resident buffer, each chunk once both consumers released it (WAIT), each thread's
    arrival on the chunk's act_full landing with its copies. Rows past the tile's end and
    channels past K_VALID are zero-filled. Offsets are 32-bit (within one tile's rows) from a
    scalar base: the persistent loop keeps their loop-invariant parts live, and 64-bit address
    tensors would not fit beside the accumulator."""
    first = tile * _TOKENS + WG * _HALF
    t = gl.arange(0, _HALF, layout=gl.SliceLayout(1, _ACT_COPY))
    k_local = gl.arange(0, 128, layout=gl.SliceLayout(0, _ACT_COPY))
    row_ok = (t < row_end - first)[:, None]
    offsets = (t * stride_am)[:, None] + k_local[None, :]
    base = a_ptr + first.to(gl.int64) * stride_am
    for k in gl.static_range(CHUNKS):
        if WAIT:
            mbarrier.wait(act_empty.index(k), wait_phase)
        mask = row_ok & ((k * 128 + k_local) < K_VALID)[None, :]
        dst = act.index(k).slice(WG * _HALF, _HALF)
        async_copy.async_copy_global_to_shared(dst, base + k * 128 + offsets, mask=mask)
        async_copy.mbarrier_arrive(act_full.index(k), increment_count=False)


@gluon.jit
def _issue_weights(ring, slot, w_ptr, ws_ptr, expert, row_block, k, N, word_strides,
                   scale_strides):  # fmt: skip
    """One K chunk of one 128-row block's words and scale words into the consumer's ring slot
    (32-bit offsets within the block from a scalar base, as _issue_rows). Rows past N (the
    last block overhanging the padded rows) are zero-filled; the epilogue stores none."""
    words_ring, scales_ring = ring
    stride_we, stride_wp, stride_wn, stride_wc = word_strides
    stride_se, stride_sp, stride_sn, stride_sc = scale_strides
    # A block is two whole panels of PANEL_ROWS rows.
    panel = row_block * (_WG_ROWS // _PANEL_ROWS)
    rows_left = N - row_block * _WG_ROWS
    r = gl.arange(0, _WG_ROWS, layout=gl.SliceLayout(1, _WORDS_COPY))
    wj = gl.arange(0, 16, layout=gl.SliceLayout(0, _WORDS_COPY))
    offsets = (r // _PANEL_ROWS * stride_wp + r % _PANEL_ROWS * stride_wn)[:, None] + wj[None, :]
    base = w_ptr + expert * stride_we + k * stride_wc + panel * stride_wp
    async_copy.async_copy_global_to_shared(
        words_ring.index(slot), base + offsets, mask=(r < rows_left)[:, None]
    )
    sr = gl.arange(0, _WG_ROWS, layout=_SCALES_COPY)
    s_offsets = sr // _PANEL_ROWS * stride_sp + sr % _PANEL_ROWS * stride_sn
    s_base = ws_ptr + expert * stride_se + k * stride_sc + panel * stride_sp
    async_copy.async_copy_global_to_shared(
        scales_ring.index(slot), s_base + s_offsets, mask=sr < rows_left
    )


@gluon.jit
def _prefetch(ring, prefetch, work_args, w_ptr, ws_ptr, tiles_ptr, N, word_strides,
              scale_strides, CHUNKS: gl.constexpr, GROUP: gl.constexpr,
              WG: gl.constexpr):  # fmt: skip
    """Copy the weights of the next step of this consumer's stream (its row blocks of its
    CTA's work items, K chunk by K chunk) into its ring, commit them as one copy group (an
    empty one past the stream's end) and return the stream's position after it."""
    work, block, k, expert, blocks, count = prefetch
    total, grid, num_groups, num_blocks = work_args
    if work < total:
        group = work % num_groups
        row_block = group * GROUP + WG + 2 * block
        _issue_weights(
            ring, count % _STAGES, w_ptr, ws_ptr, expert, row_block, k, N, word_strides,
            scale_strides,
        )  # fmt: skip
    async_copy.commit_group()
    count += 1
    k += 1
    if k == CHUNKS:
        k = 0
        block += 1
        if block == blocks:
            block = 0
            work += grid
            if work < total:
                tile = work // num_groups
                expert = gl.load(tiles_ptr + 2 * tile, cache_modifier=".cg").to(gl.int64)
                blocks = _my_blocks(work % num_groups, num_blocks, GROUP, WG)
    return work, block, k, expert, blocks, count


@gluon.jit
def _issue_following_rows(act, act_full, act_empty, loads, following, num_groups, phase,
                          CHUNKS: gl.constexpr, WG: gl.constexpr):  # fmt: skip
    """_issue_rows for work item `following`, once both consumers released this one."""
    a_ptr, _, _, tiles_ptr, _, K_VALID, stride_am, _, _ = loads
    tile = following // num_groups
    row_end = gl.load(tiles_ptr + 2 * tile + 1, cache_modifier=".cg")
    _issue_rows(
        act, act_full, act_empty, a_ptr, tile, row_end, phase, K_VALID, stride_am, CHUNKS, True,
        WG,
    )  # fmt: skip


@gluon.jit
def _block(acc, bufs, stream, work_args, item, stores, wide_from_bits, TOPK: gl.constexpr,
           HAS_BIAS: gl.constexpr, HALF_ROWS: gl.constexpr, CHUNKS: gl.constexpr,
           GROUP: gl.constexpr, SHIFT_DECODE: gl.constexpr, WG: gl.constexpr,
           dot_a: gl.constexpr, pair_rows_layout: gl.constexpr):  # fmt: skip
    """One row block of the consumer's work item: its product with the resident rows' first
    COLS (acc's width) tokens, K chunk by K chunk from the consumer's ring (each step
    prefetching a later one), then its pair rows. On the item's last block it releases the
    resident rows and copies its half of the next item's: before the epilogue where the other
    consumer has as many blocks of the item (it is releasing them about now), after it where
    the other has one more (its last block's MMAs run meanwhile). Returns the stream's state
    past it."""
    act, ring, stage, act_full, act_empty = bufs
    prefetch, count, lo_table, hi_table, loads = stream
    (a_ptr, w_ptr, ws_ptr, tiles_ptr, N, K_VALID, stride_am, word_strides,
     scale_strides) = loads  # fmt: skip
    total, grid, num_groups, num_blocks = work_args
    work, phase, first_block, last_block, rows_first, epilogue = item
    words_ring, scales_ring = ring
    mma: gl.constexpr = acc.type.layout
    COLS: gl.constexpr = acc.shape[1]
    for k in gl.static_range(CHUNKS):
        # This step's copies landed (this thread's, then the consumer's: a partition barrier,
        # past which every warp is also done with the slot the prefetch below refills).
        async_copy.wait_group(_STAGES - 2)
        gl.thread_barrier()
        prefetch = _prefetch(
            ring, prefetch, work_args, w_ptr, ws_ptr, tiles_ptr, N, word_strides, scale_strides,
            CHUNKS, GROUP, WG,
        )  # fmt: skip
        slot = count % _STAGES
        if first_block:
            mbarrier.wait(act_full.index(k), phase)
        # The copies (generic proxy) before the wgmma reads them (async).
        fence_async_shared()
        words = words_ring.index(slot).load(_WORDS)
        scales = scales_ring.index(slot).load(gl.SliceLayout(1, _WORDS))
        frag = decode_fragment(
            words, scales, lo_table, hi_table, dot_a, _WG_ROWS, SHIFT_DECODE, True, False
        )
        b = act.index(k).slice(0, COLS).permute((1, 0))
        acc = warpgroup_mma(frag, b, acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        if last_block:
            # Gluon puts the partition's barrier before the single arrival: every warp of
            # this consumer is done with the chunk.
            mbarrier.arrive(act_empty.index(k))
        count += 1
    following = work + grid
    if last_block and rows_first and following < total:
        _issue_following_rows(
            act, act_full, act_empty, loads, following, num_groups, phase, CHUNKS, WG
        )
    operands = epilogue_operands(epilogue, TOPK, False, HAS_BIAS, False, 0, 0, _WG_ROWS, COLS, mma)
    rows, cols, col_ok, col_pair, bias, _, post_factor = operands
    out_ptr, wide_ptr, sorted_ptr, stride_om = stores
    _, _, first_row, row_block, row_end, n_valid = epilogue
    if HAS_BIAS:
        acc += bias[:, None]
    acc *= post_factor[None, :]  # the routing weight
    if HALF_ROWS:
        tile_stage = stage._reinterpret(gl.float16, [_WG_ROWS, COLS], _STAGE)
        pair_rows_store(
            out_ptr, wide_ptr, acc, tile_stage, wide_from_bits, sorted_ptr, (first_row, row_end),
            row_block, n_valid, stride_om, _WG_ROWS, COLS, pair_rows_layout,
        )  # fmt: skip
    else:
        ptrs = out_ptr + col_pair.to(gl.int64)[None, :] * stride_om + rows[:, None]
        gl.store(ptrs, acc, mask=col_ok[None, :] & (rows < n_valid)[:, None])
    if last_block and not rows_first and following < total:
        _issue_following_rows(
            act, act_full, act_empty, loads, following, num_groups, phase, CHUNKS, WG
        )
    return prefetch, count


@gluon.jit
def _consumer(pointers, bufs, sizes, strides, wide_from_bits, TOPK: gl.constexpr,
              HAS_BIAS: gl.constexpr, HALF_ROWS: gl.constexpr, CHUNKS: gl.constexpr,
              GROUP: gl.constexpr, NARROW_T: gl.constexpr, SHIFT_DECODE: gl.constexpr,
              WG: gl.constexpr):  # fmt: skip
    (a_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, wide_ptr, route_w_ptr, sorted_ptr, tiles_ptr,
     num_tiles_ptr, table_ptr) = pointers  # fmt: skip
    act, words_ring, scales_ring, stage, act_full, act_empty = bufs
    N, K_VALID, N_VALID, grid = sizes
    stride_am, word_strides, scale_strides, stride_be, stride_om = strides
    ring = (words_ring, scales_ring)
    block_bufs = (act, ring, stage, act_full, act_empty)
    lo_table = gl.load(table_ptr)
    hi_table = gl.load(table_ptr + 1)
    num_tiles = gl.load(num_tiles_ptr, cache_modifier=".cg")
    num_blocks = gl.cdiv(N_VALID, _WG_ROWS)
    num_groups = gl.cdiv(num_blocks, GROUP)
    total = num_tiles * num_groups
    work_args = (total, grid, num_groups, num_blocks)
    loads = (a_ptr, w_ptr, ws_ptr, tiles_ptr, N, K_VALID, stride_am, word_strides, scale_strides)
    pid = gl.program_id(0)
    # GEMM2's x_exp and in_scale are not read: placeholders.
    epilogue_ptrs = (sorted_ptr, route_w_ptr, bias_ptr, sorted_ptr, stride_be, sorted_ptr, 1.0)
    stores = (out_ptr, wide_ptr, sorted_ptr, stride_om)

    # The first item's rows, then the first STAGES - 1 steps of the weight stream. The grid
    # stays within the routing buffers' max_tiles tiles, every entry of which the router
    # writes, so a CTA past the work reads initialized memory.
    first_tile = pid // num_groups
    expert = gl.load(tiles_ptr + 2 * first_tile, cache_modifier=".cg").to(gl.int64)
    row_end = gl.load(tiles_ptr + 2 * first_tile + 1, cache_modifier=".cg")
    if pid < total:
        _issue_rows(
            act, act_full, act_empty, a_ptr, first_tile, row_end, 0, K_VALID, stride_am, CHUNKS,
            False, WG,
        )  # fmt: skip
    prefetch = (pid, 0, 0, expert, _my_blocks(pid % num_groups, num_blocks, GROUP, WG), 0)
    for _ in gl.static_range(_STAGES - 1):
        prefetch = _prefetch(
            ring, prefetch, work_args, w_ptr, ws_ptr, tiles_ptr, N, word_strides, scale_strides,
            CHUNKS, GROUP, WG,
        )  # fmt: skip
    # One loop over this consumer's row blocks, (work item, block) carried: nested loops let
    # the compiler hoist a work item's epilogue values (the tile's columns, masks) out of
    # the block loop, where they stay live across the main loops and spill.
    work = pid
    block = 0
    blocks = prefetch[4]
    count = 0
    phase = 0
    while work < total:
        tile = work // num_groups
        expert = gl.load(tiles_ptr + 2 * tile, cache_modifier=".cg").to(gl.int64)
        row_end = gl.load(tiles_ptr + 2 * tile + 1, cache_modifier=".cg")
        first_row = tile * _TOKENS
        row_block = work % num_groups * GROUP + WG + 2 * block
        epilogue = (epilogue_ptrs, expert, first_row, row_block, row_end, N_VALID)
        group = work % num_groups
        rows_first = blocks >= _my_blocks(group, num_blocks, GROUP, 1 - WG)
        item = (work, phase, block == 0, block == blocks - 1, rows_first, epilogue)
        stream = (prefetch, count, lo_table, hi_table, loads)
        if NARROW_T != 0 and row_end - first_row <= NARROW_T:
            acc_narrow = gl.zeros([_WG_ROWS, NARROW_T], gl.float32, layout=_MMA_32)
            prefetch, count = _block(
                acc_narrow, block_bufs, stream, work_args, item, stores, wide_from_bits, TOPK,
                HAS_BIAS, HALF_ROWS, CHUNKS, GROUP, SHIFT_DECODE, WG, _DOT_A_32, _PAIR_ROWS_32,
            )  # fmt: skip
        else:
            acc = gl.zeros([_WG_ROWS, _TOKENS], gl.float32, layout=_MMA)
            prefetch, count = _block(
                acc, block_bufs, stream, work_args, item, stores, wide_from_bits, TOPK,
                HAS_BIAS, HALF_ROWS, CHUNKS, GROUP, SHIFT_DECODE, WG, _DOT_A, _PAIR_ROWS,
            )  # fmt: skip
        block += 1
        if block == blocks:
            block = 0
            phase ^= 1
            work += grid
            blocks = _my_blocks(work % num_groups, num_blocks, GROUP, WG)
    async_copy.wait_group(0)


@recordable
@bind_launches
@gluon.jit
def _resident_gemm2_kernel(
    a_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, wide_ptr, route_w_ptr, sorted_ptr, tiles_ptr,
    num_tiles_ptr, table_ptr,
    N, K_VALID, N_VALID, grid,
    stride_am, stride_we, stride_wp, stride_wn, stride_wc, stride_se, stride_sp, stride_sn,
    stride_sc, stride_be, stride_om,
    wide_from_bits,
    TOPK: gl.constexpr, HAS_BIAS: gl.constexpr, HALF_ROWS: gl.constexpr, CHUNKS: gl.constexpr,
    GROUP: gl.constexpr, NARROW_T: gl.constexpr, SHIFT_DECODE: gl.constexpr, PDL: gl.constexpr,
):  # fmt: skip
    if PDL:
        # GEMM1's SwiGLU rows (and, before them, the routing outputs) are complete past the
        # wait; the combine starts its CTAs as SMs free up.
        gdc_wait()
        gdc_launch_dependents()
    act = gl.allocate_shared_memory(gl.float16, [CHUNKS, _TOKENS, 128], _ACT_SMEM)
    # Plain row-major slots (a layout of a slot's rank).
    words_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    scales_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    words_0 = gl.allocate_shared_memory(gl.int32, [_STAGES, _WG_ROWS, 16], words_smem)
    words_1 = gl.allocate_shared_memory(gl.int32, [_STAGES, _WG_ROWS, 16], words_smem)
    scales_0 = gl.allocate_shared_memory(gl.int32, [_STAGES, _WG_ROWS], scales_smem)
    scales_1 = gl.allocate_shared_memory(gl.int32, [_STAGES, _WG_ROWS], scales_smem)
    stage_0 = gl.allocate_shared_memory(gl.float16, [_WG_ROWS, _TOKENS], _STAGE)
    stage_1 = gl.allocate_shared_memory(gl.float16, [_WG_ROWS, _TOKENS], _STAGE)
    act_full = gl.allocate_shared_memory(gl.int64, [CHUNKS, 1], mbarrier.MBarrierLayout())
    act_empty = gl.allocate_shared_memory(gl.int64, [CHUNKS, 1], mbarrier.MBarrierLayout())
    for k in gl.static_range(CHUNKS):
        mbarrier.init(act_full.index(k), count=2 * 128)  # both consumers' threads
        mbarrier.init(act_empty.index(k), count=2)  # both consumers
    pointers = (
        a_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, wide_ptr, route_w_ptr, sorted_ptr, tiles_ptr,
        num_tiles_ptr, table_ptr,
    )  # fmt: skip
    sizes = (N, K_VALID, N_VALID, grid)
    strides = (
        stride_am, (stride_we, stride_wp, stride_wn, stride_wc),
        (stride_se, stride_sp, stride_sn, stride_sc), stride_be, stride_om,
    )  # fmt: skip
    bufs_0 = (act, words_0, scales_0, stage_0, act_full, act_empty)
    bufs_1 = (act, words_1, scales_1, stage_1, act_full, act_empty)
    # Constexprs stay constexprs only as top-level entries of a partition's arguments.
    gl.warp_specialize(
        [
            (_consumer, (pointers, bufs_0, sizes, strides, wide_from_bits, TOPK, HAS_BIAS,
                         HALF_ROWS, CHUNKS, GROUP, NARROW_T, SHIFT_DECODE, _FIRST)),
            (_consumer, (pointers, bufs_1, sizes, strides, wide_from_bits, TOPK, HAS_BIAS,
                         HALF_ROWS, CHUNKS, GROUP, NARROW_T, SHIFT_DECODE, _SECOND)),
        ],
        [4],
        [_WORKER_REGS],
    )  # fmt: skip


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the AOT check compiles on the CPU: an H100's count
    return torch.cuda.get_device_properties(device).multi_processor_count


def _row_groups(n_valid: int) -> tuple[int, int]:
    """The row blocks of n_valid rows, and the work items they make per tile."""
    blocks = -(-n_valid // WG_ROWS)
    return blocks, -(-blocks // GROUP_BLOCKS)


def resident_gemm2_fits(config, a: torch.Tensor, w: torch.Tensor, *, gemm1: bool, decode: str,
                        split_k: int, n_valid: int, unscaled: bool) -> bool:  # fmt: skip
    """Whether the resident kernel takes this call's GEMM2: config.resident_gemm2 (which
    FragmentConfig checks against its tile), fp16 SwiGLU rows against shift-decoded fp16
    weights, no split, no activation scales (`unscaled`), at most MAX_CHUNKS K chunks, and a
    last group of row blocks that gives both consumers one."""
    K = w.shape[3] * 128
    blocks, groups = _row_groups(n_valid)
    last_group = blocks - (groups - 1) * GROUP_BLOCKS
    return (
        config.resident_gemm2
        and not gemm1
        and a.dtype == torch.float16
        and decode == "fp16"
        and split_k == 1
        and unscaled
        and K <= MAX_CHUNKS * 128
        and last_group >= 2
    )


def resident_gemm2(a, w, scale_words, bias, out, routing, table, *, k_valid: int, n_valid: int,
                   wide: torch.Tensor | None, wide_from_bits: int, config) -> None:  # fmt: skip
    """GEMM2 + bias + routing weight over every routing tile, as wgmma_gemm_sm90.fragment_gemm
    computes it (its checked operands): fp16 pair rows with `wide` beside them, or float32
    rows into `out`."""
    N, K = w.shape[1] * w.shape[2], w.shape[3] * 128
    topk_weights, sorted_pairs, tiles, num_tiles, max_tiles, top_k = routing
    _, groups = _row_groups(n_valid)
    grid = min(_sm_count(a.device), max_tiles * groups)
    half_rows = out.dtype == torch.float16
    _resident_gemm2_kernel[(grid,)](
        a, w, scale_words, bias if bias is not None else scale_words, out,
        wide if half_rows else out, topk_weights, sorted_pairs, tiles, num_tiles, table,
        N, k_valid, n_valid, grid,
        a.stride(0), *w.stride()[:4], *scale_words.stride(),
        bias.stride(0) if bias is not None else 0, out.stride(0),
        wide_from_bits,
        TOPK=top_k, HAS_BIAS=bias is not None, HALF_ROWS=half_rows, CHUNKS=K // 128,
        GROUP=GROUP_BLOCKS, NARROW_T=config.narrow_t, SHIFT_DECODE=True, PDL=config.pdl,
        num_warps=4, launch_pdl=config.pdl,
    )  # fmt: skip
