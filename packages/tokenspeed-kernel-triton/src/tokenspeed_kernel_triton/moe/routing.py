"""MoE routing and grouping: top-k softmax over the router logits, then the (token, expert) pairs
sorted by expert into BLOCK_M-row tiles for the grouped GEMMs.

Pair p = token * top_k + j. The sorted layout gives expert e the rows
[tile_begin[e] * BLOCK_M, tile_begin[e] * BLOCK_M + count[e]) of every grouped buffer, padded to
whole tiles, so tile t covers rows t * BLOCK_M .. and one expert. Per tile the kernels read
`tiles[t] = (expert, row_end)`; `num_tiles` is on the device (no host sync, CUDA-graph safe).

Small batches (decode) run everything in one program. Large batches use a top-k kernel over
blocks of tokens that also counts each block's pairs per expert (for precomputed ids a count
kernel does); an align kernel, one program per group of experts, that sums the blocks' counts
down the blocks (each block's first rank per expert, each expert's pairs); and a scatter
kernel that places the experts' rows, writes the tile table and sorts each block's pairs by
their rank within it (with few blocks it sums their counts itself, and no align kernel runs).
Both routers order an expert's rows by pair index (a stable sort, no atomics): the same
routing gives the same rows on every call. H200, GPT-OSS-120B (E=128, top-4), graph-timed
alone, µs, this / the atomic scatter it replaced (one align program summing all counts, atomics
on a cursor per expert): M=64 11.2 / 11.1, M=256 11.7 / 15.2, M=1024 12.5 / 17.0, M=3072
13.1 / 19.1, M=8192 14.7 / 25.7. One align program that also stored each block's prefix
took 19 µs at M=8192.

Narrow tiles: for the GEMMs' launch of narrow tiles (an expert's last tile when it holds at
most narrow_t rows), either router also writes `narrow_tiles[e]`, local expert e's tile index
if its last tile is one, else -1, so that the launch's grid covers the experts rather than every
tile slot: CTAs of slots that hold no narrow tile start only as the full-tile launch's CTAs
drain, and load and exit (H200, TP=8 shard at M=3072, where no tile is narrow: 285.4 against
287.9 µs for a grid of 224 tile slots x 23 row blocks in GEMM2; docs/decisions.md). It also
writes `full_tiles`: the count of the other tiles, then their indices in order, which the
persistent kernel's CTAs share out (fragment_ws_sm90): skipped in place among them, the
narrow tiles' work items left the CTAs uneven shares of the real ones.

Expert parallelism: the layer holds experts expert_offset .. expert_offset + E_local - 1 of the E
the router ranks (ids stay global); tiles name the local expert (id - expert_offset), and the
counts, the tile table and its bound are sized for E_local.

Out-of-range ids: a topk id outside the local range (another rank's expert, or a precomputed entry
outside [0, E), -1 included) is left out of the counts and the sorted rows, so no GEMM reads an
expert's weights for it and its pair contributes nothing (the combine skips it). The cost is an
integer compare per pair where the pairs are counted and sorted. NaN router logits rank as +inf (as
torch.topk ranks NaN above every number): the picked ids stay in [0, E), and a token with a NaN
among its top-k gets NaN weights, as the reference softmax gives; one compare per logit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tokenspeed_kernel.platform import interpreting

from .._launch import bind_launches
from .e4m3 import dynamic_scale, e4m3_of
from .replay import recordable
from .workspace import scratch

# Pairs (tokens x top_k) that one program routes and ranks on its own (the stable rank compares
# every pair with every other): up to the decode tiles' 64, whose tile counters and prescaled x
# only this router writes. Beyond that one program is the bottleneck: H100, GPT-OSS-120B,
# graph-timed end to end, M = 20 / 48 / 64 took 341 / 554 / 584 us through it against 307 / 477 /
# 508 through the multi-kernel router.
FUSED_MAX_PAIRS = 64
# The one-program router runs in one warp up to this many pairs, in four up to the second
# bound (tokens x top_k padded to powers of two), then in eight. H200, router alone,
# graph-timed, µs, one / two / four / eight warps: 4 pairs 2.5 / 3.2 / 3.1 / 3.9, 16 pairs
# 5.1 / 3.7 / 3.1 / 3.6, 32 pairs 9.7 / 5.3 / 3.7 / 3.4, 64 pairs 24.0 / 9.5 / 5.8 / 4.7.
ONE_WARP_MAX_PAIRS = 8
FOUR_WARPS_MAX_PAIRS = 16
_TILE_CHUNK = 128
# Tile table entries per scatter program (the multi-kernel router).
_SCATTER_TILE_CHUNK = 32
# The multi-kernel router's blocks hold at most this many pairs: the scatter ranks a block's
# pairs against each other ([pairs, pairs] compares in one program).
_BLOCK_PAIRS = 128
# Up to this many blocks the scatter sums their counts itself, no align kernel between.
_SCATTER_SUMS_BLOCKS = 16
# The align kernel's experts per program, and block counts it reads in one step.
_ALIGN_EXPERTS = 8
_COUNTS_PER_LOAD = 2048


@triton.jit
def _topk_softmax(
    logits_ptr,
    rows,
    M,
    E,
    stride_lm,
    TOPK: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Rows' top-k experts (ties to the lower index) and the softmax of their logits.

    Returns (ids [BLOCK_T, BLOCK_K] int32, weights [BLOCK_T, BLOCK_K] float32); columns >= TOPK
    are padding."""
    cols = tl.arange(0, BLOCK_E)
    kcols = tl.arange(0, BLOCK_K)
    mask = (rows < M)[:, None] & (cols < E)[None, :]
    vals = tl.load(
        logits_ptr + rows[:, None] * stride_lm + cols[None, :], mask=mask, other=float("-inf")
    ).to(tl.float32)
    # NaN ranks as +inf: max() and `>=` below then always pick an index < E.
    vals = tl.where(vals == vals, vals, float("inf"))
    avail = mask
    top_v = tl.full([rows.shape[0], BLOCK_K], float("-inf"), tl.float32)
    top_i = tl.zeros([rows.shape[0], BLOCK_K], tl.int32)
    for j in tl.static_range(TOPK):
        m = tl.max(tl.where(avail, vals, float("-inf")), axis=1)
        # `avail` (not a -inf sentinel) retires picked experts, so -inf logits are never re-picked.
        idx = tl.min(tl.where(avail & (vals >= m[:, None]), cols[None, :], BLOCK_E), axis=1)
        top_v = tl.where(kcols[None, :] == j, m[:, None], top_v)
        top_i = tl.where(kcols[None, :] == j, idx[:, None], top_i)
        avail = avail & (cols[None, :] != idx[:, None])
    # Picked in descending order: column 0 holds the row maximum.
    p = tl.exp(top_v - tl.max(top_v, axis=1)[:, None])
    p = tl.where(kcols[None, :] < TOPK, p, 0.0)
    return top_i, p / tl.sum(p, axis=1)[:, None]


@triton.jit
def _block_counts(ids, valid, E_OFF, E_LOCAL, counts_ptr, BLOCK_EL: tl.constexpr):
    """Store how many of a block's pairs (ids, valid: [N], loaded from memory) go to each local
    expert into counts_ptr[program_id, 0:BLOCK_EL]; ids outside the local range count nowhere."""
    local = ids - E_OFF
    hist = tl.histogram(local, BLOCK_EL, mask=valid & (local >= 0) & (local < E_LOCAL))
    experts = tl.arange(0, BLOCK_EL)
    tl.store(counts_ptr + tl.program_id(0) * BLOCK_EL + experts, hist)


@triton.jit
def _block_counts_of_topk(ids, valid, E_OFF, E_LOCAL, counts_ptr, BLOCK_EL: tl.constexpr):
    """_block_counts for the top-k's ids [BLOCK_T, BLOCK_K] as computed. They come out of a
    reduction, whose layout holds each id in several threads, and tl.histogram on the GPU
    counts every copy (3000 pairs of top-2 over 16 experts: counts past the pairs, sorted rows
    never written); a sum over an id-by-expert comparison counts each pair once."""
    experts = tl.arange(0, BLOCK_EL)
    local = (ids - E_OFF)[:, :, None]
    hits = valid[:, :, None] & (local == experts[None, None, :]) & (local < E_LOCAL)
    hist = tl.sum(tl.sum(hits.to(tl.int32), axis=1), axis=0)
    tl.store(counts_ptr + tl.program_id(0) * BLOCK_EL + experts, hist)


@recordable
@bind_launches
@triton.jit
def _topk_kernel(
    logits_ptr,
    ids_ptr,
    weights_ptr,
    counts_ptr,
    M,
    E,
    E_OFF,
    E_LOCAL,
    stride_lm,
    TOPK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_EL: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr,
):
    if LAUNCH_DEPENDENTS:
        gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ids, weights = _topk_softmax(logits_ptr, rows, M, E, stride_lm, TOPK, BLOCK_E, BLOCK_K)
    kcols = tl.arange(0, BLOCK_K)
    offs = rows[:, None] * TOPK + kcols[None, :]
    mask = (rows < M)[:, None] & (kcols < TOPK)[None, :]
    tl.store(ids_ptr + offs, ids, mask=mask)
    tl.store(weights_ptr + offs, weights, mask=mask)
    _block_counts_of_topk(ids, mask, E_OFF, E_LOCAL, counts_ptr, BLOCK_EL)


@recordable
@bind_launches
@triton.jit
def _count_kernel(
    ids_ptr,
    num_pairs,
    E_OFF,
    E_LOCAL,
    counts_ptr,
    CHUNK: tl.constexpr,
    BLOCK_EL: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr,
):
    """_topk_kernel's block counts for precomputed ids, CHUNK pairs per program."""
    if LAUNCH_DEPENDENTS:
        gdc_launch_dependents()
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    ok = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=ok, other=0)
    _block_counts(ids, ok, E_OFF, E_LOCAL, counts_ptr, BLOCK_EL)


@triton.jit
def _store_tile_entries(
    tiles_ptr, sorted_ptr, t, e, row_end, total, max_tiles, BLOCK_M: tl.constexpr
):
    """Tile table entries t (expert e, row_end) and the zero padding of their sorted rows.

    Every entry of the buffers is written, the unused ones with 0: the tiles past num_tiles and
    the sorted rows no pair fills (an expert's last tile past its count, every tile past
    num_tiles). The GEMMs read a whole tile's table entry and sorted rows before they know
    whether the tile exists or where it ends (one load latency, not two in a row); those
    reads must find written memory (compute-sanitizer initcheck). The real rows are stored
    elsewhere (the caller's sort), never to these addresses: no ordering between the two."""
    ok = t < total
    row_end = tl.where(ok, row_end, 0)
    in_table = t < max_tiles
    tl.store(tiles_ptr + 2 * t, tl.where(ok, e, 0), mask=in_table)
    tl.store(tiles_ptr + 2 * t + 1, row_end, mask=in_table)
    rows = t[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    padding = in_table[:, None] & (rows >= row_end[:, None])
    tl.store(sorted_ptr + rows, tl.zeros(rows.shape, tl.int32), mask=padding)


@triton.jit
def _narrow_flags(counts, ntiles, BLOCK_M: tl.constexpr, NARROW_T: tl.constexpr):
    """1 where an expert's last tile holds at most NARROW_T rows, else 0 (no tiles: 0)."""
    last_rows = counts - (ntiles - 1) * BLOCK_M
    return ((ntiles > 0) & (last_rows <= NARROW_T)).to(tl.int32)


@triton.jit
def _store_narrow_tiles(narrow, counts, ntiles, tile_end, E_LOCAL, BLOCK_M: tl.constexpr,
                        NARROW_T: tl.constexpr):  # fmt: skip
    """narrow_tiles[e] for the local experts e < E_LOCAL and the count of full_tiles (module
    doc; narrow: their pointers); NARROW_T 0: none."""
    if NARROW_T:
        narrow_ptr, full_ptr = narrow
        experts = tl.arange(0, counts.shape[0])
        flags = _narrow_flags(counts, ntiles, BLOCK_M, NARROW_T)
        tl.store(
            narrow_ptr + experts, tl.where(flags > 0, tile_end - 1, -1), mask=experts < E_LOCAL
        )
        tl.store(full_ptr, tl.sum(ntiles - flags, 0))


@triton.jit
def _store_full_tiles(full_ptr, counts, ntiles, tile_end, f, max_tiles, BLOCK_M: tl.constexpr,
                      NARROW_T: tl.constexpr):  # fmt: skip
    """full_tiles' entries f (module doc): the f-th tile past NARROW_T rows is f plus the
    narrow tiles of the experts before its own, each expert's narrow tile being its last."""
    if NARROW_T:
        flags = _narrow_flags(counts, ntiles, BLOCK_M, NARROW_T)
        full = ntiles - flags
        full_end = tl.cumsum(full, 0)
        expert = _expert_of_tiles(full_end, f)
        narrow_before = tile_end - ntiles - (full_end - full)
        skipped = tl.gather(narrow_before, tl.minimum(expert, counts.shape[0] - 1), 0)
        ok = (f < tl.sum(full, 0)) & (f < max_tiles)
        tl.store(full_ptr + 1 + f, f + skipped, mask=ok)


@triton.jit
def _expert_of_tiles(tile_end, t):
    """Expert of each tile t: how many experts' tile ranges end at or before it."""
    return tl.sum((tile_end[None, :] <= t[:, None]).to(tl.int32), axis=1)


@triton.jit
def _write_expert_tiles(
    tiles_ptr,
    num_tiles_ptr,
    sorted_ptr,
    counts,
    max_tiles,
    narrow,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    TILE_CHUNK: tl.constexpr,
    NARROW_T: tl.constexpr,
):
    """Tile table from per-expert counts, in one program: each expert writes its own tiles'
    entries and its last tile's padding rows, then the tiles past the last are zeroed (every
    entry written, as _store_tile_entries explains), and narrow_tiles and full_tiles (narrow:
    their pointers and E_LOCAL). Returns each expert's first sorted row.
    O(experts + tiles) work, where the multi-kernel router's [tiles, experts] compares
    (_expert_of_tiles) and [pairs, experts] counts would cost a decode step's router 8.7 µs
    against 4.7 (H200, 64 pairs over 128 experts)."""
    experts = tl.arange(0, BLOCK_E)
    ntiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(ntiles, 0)
    tile_begin = tile_end - ntiles
    total = tl.sum(ntiles, 0)
    tl.store(num_tiles_ptr, total)
    narrow_ptr, full_ptr, E_LOCAL = narrow
    _store_narrow_tiles(
        (narrow_ptr, full_ptr), counts, ntiles, tile_end, E_LOCAL, BLOCK_M, NARROW_T
    )
    row_begin = tile_begin * BLOCK_M
    row_end = row_begin + counts
    for j in range(0, tl.max(ntiles, 0)):
        t = tile_begin + j
        mine = j < ntiles
        tl.store(tiles_ptr + 2 * t, experts, mask=mine)
        tl.store(tiles_ptr + 2 * t + 1, row_end, mask=mine)
    pad = row_end[:, None] + tl.arange(0, BLOCK_M)[None, :]
    tl.store(
        sorted_ptr + pad, tl.zeros(pad.shape, tl.int32), mask=pad < (tile_end * BLOCK_M)[:, None]
    )
    for t0 in range(0, max_tiles, TILE_CHUNK):
        t = t0 + tl.arange(0, TILE_CHUNK)
        past = (t >= total) & (t < max_tiles)
        tl.store(tiles_ptr + 2 * t, tl.zeros([TILE_CHUNK], tl.int32), mask=past)
        tl.store(tiles_ptr + 2 * t + 1, tl.zeros([TILE_CHUNK], tl.int32), mask=past)
        rows = t[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        tl.store(sorted_ptr + rows, tl.zeros(rows.shape, tl.int32), mask=past[:, None])
        _store_full_tiles(full_ptr, counts, ntiles, tile_end, t, max_tiles, BLOCK_M, NARROW_T)
    return row_begin


@triton.jit
def _prescale_row(
    x_ptr,
    scaled_ptr,
    exp_ptr,
    row,
    H,
    stride_x,
    stride_s,
    quant,
    BLOCK_H: tl.constexpr,
    QUANT: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Row `row` of x (bf16, at most BLOCK_H long) times 2^(126 - E), with E = floor(log2
    max|row|) clamped to [0, 126], into scaled_ptr, and E into exp_ptr[row]. Exact: a power
    of two at least 1, and the row's largest element stays below 2^127. Raw bf16 MXFP4 halves
    (value * 2^-126) times the scaled row are normal fp32 products (the post-scaled Hopper
    GEMM). QUANT (FP8 activations; quant = (static scale, per-row scales)): the row's e4m3
    values are scaled instead, with 1 the static scale, 2 the row's own (stored to the
    per-row scales)."""
    offs = tl.arange(0, BLOCK_H)
    x = tl.load(x_ptr + row * stride_x + offs, mask=offs < H, other=0.0).to(tl.float32)
    if QUANT != 0:
        static_scale, scale_ptr = quant
        if QUANT == 2:
            scale = dynamic_scale(x)
            tl.store(scale_ptr + row, scale)
        else:
            scale = static_scale
        x = e4m3_of(x, scale, INTERPRETED).to(tl.float32)
    bits = tl.max(tl.abs(x), axis=0).to(tl.int32, bitcast=True)
    exponent = tl.minimum(tl.maximum(((bits >> 23) & 0xFF) - 127, 0), 126)
    factor = ((253 - exponent) << 23).to(tl.float32, bitcast=True)
    tl.store(scaled_ptr + row * stride_s + offs, (x * factor).to(tl.bfloat16), mask=offs < H)
    tl.store(exp_ptr + row, exponent)


@recordable
@bind_launches
@triton.jit
def _route_small_kernel(
    logits_ptr,
    ids_ptr,
    weights_ptr,
    sorted_ptr,
    tiles_ptr,
    num_tiles_ptr,
    ready_ptr,
    narrow_ptr,
    full_ptr,
    x_ptr,
    scaled_ptr,
    exp_ptr,
    x_scale_ptr,
    x_static_scale,
    M,
    E,
    E_OFF,
    E_LOCAL,
    H,
    stride_lm,
    stride_x,
    stride_s,
    max_tiles,
    TOPK: tl.constexpr,
    HAS_LOGITS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_EL: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_CHUNK: tl.constexpr,
    NARROW_T: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr,
    CLEAR_READY: tl.constexpr,
    PRESCALE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    QUANT: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Everything for M <= BLOCK_T tokens in one program (decode: one launch instead of three);
    with PRESCALE, M more programs scale x's rows for the post-scaled GEMM.
    LAUNCH_DEPENDENTS: let a GEMM launched behind this kernel with programmatic dependent
    launch start its CTAs now (they wait for this kernel's writes). CLEAR_READY: zero
    ready[0:max_tiles] (the GEMMs' per-tile counters)."""
    if LAUNCH_DEPENDENTS:
        gdc_launch_dependents()
    if PRESCALE:
        # Programs 1..M scale x's rows (_prescale_row); program 0 routes.
        if tl.program_id(0) > 0:
            _prescale_row(
                x_ptr, scaled_ptr, exp_ptr, tl.program_id(0) - 1, H, stride_x, stride_s,
                (x_static_scale, x_scale_ptr), BLOCK_H, QUANT, INTERPRETED,
            )  # fmt: skip
            return
    if CLEAR_READY:
        for t0 in range(0, max_tiles, TILE_CHUNK):
            t = t0 + tl.arange(0, TILE_CHUNK)
            tl.store(ready_ptr + t, tl.zeros([TILE_CHUNK], tl.int32), mask=t < max_tiles)
    rows = tl.arange(0, BLOCK_T)
    kcols = tl.arange(0, BLOCK_K)
    offs = rows[:, None] * TOPK + kcols[None, :]
    valid = (rows < M)[:, None] & (kcols < TOPK)[None, :]
    if HAS_LOGITS:
        ids, weights = _topk_softmax(logits_ptr, rows, M, E, stride_lm, TOPK, BLOCK_E, BLOCK_K)
        tl.store(ids_ptr + offs, ids, mask=valid)
        tl.store(weights_ptr + offs, weights, mask=valid)
    else:
        ids = tl.load(ids_ptr + offs, mask=valid, other=0)
    # An id outside the local range is no pair here: not counted, never sorted (module doc).
    ids = ids - E_OFF
    valid = valid & (ids >= 0) & (ids < E_LOCAL)
    ids = tl.reshape(ids, [BLOCK_T * BLOCK_K])
    pairs = tl.reshape(offs, [BLOCK_T * BLOCK_K])
    valid = tl.reshape(valid, [BLOCK_T * BLOCK_K])
    # Invalid pairs histogram into no bin and gather expert 0's row (their store is masked).
    local = tl.where(valid, ids, 0)
    counts = tl.histogram(local, BLOCK_EL, mask=valid)
    row_begin = _write_expert_tiles(
        tiles_ptr, num_tiles_ptr, sorted_ptr, counts, max_tiles, (narrow_ptr, full_ptr, E_LOCAL),
        BLOCK_M, BLOCK_EL, TILE_CHUNK, NARROW_T,
    )  # fmt: skip
    # Stable rank within the expert: earlier pairs (lower index) of the same expert come first.
    same = (ids[:, None] == ids[None, :]) & valid[None, :] & (pairs[None, :] < pairs[:, None])
    rank = tl.sum(same.to(tl.int32), axis=1)
    tl.store(sorted_ptr + tl.gather(row_begin, local, 0) + rank, pairs, mask=valid)


@triton.jit
def _wait_then_launch_dependents(PDL: tl.constexpr):
    """A router launch after the first under programmatic dependent launch: wait for the
    launch before it (whose outputs it reads), then let the next one start its CTAs, which
    wait in turn, so each launch's start leaves the critical path. H200, GPT-OSS-120B, same
    run, five interleaved rounds, graph-timed over 4 layers, µs, chained / not: TP=8 shard
    M=1024 172.7 / 174.7, M=3072 287.9 / 289.6; M=32-256 and the whole layer within 0.3%."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@recordable
@bind_launches
@triton.jit
def _align_kernel(
    block_counts_ptr,
    num_blocks,
    block_base_ptr,
    counts_ptr,
    BLOCK_E: tl.constexpr,
    EXPERTS: tl.constexpr,
    BLOCKS_PER_LOAD: tl.constexpr,
    PDL: tl.constexpr,
):
    """The blocks' pair counts ([num_blocks, BLOCK_E]) of EXPERTS experts per program summed
    down the blocks, BLOCKS_PER_LOAD a load: into block_base_ptr, each block's rank among the
    expert's pairs of its first pair (the counts of the blocks before it), and into
    counts_ptr the expert's pairs. Experts are independent, so the programs are too.
    PDL: launched with programmatic dependent launch behind the counting kernel."""
    _wait_then_launch_dependents(PDL)
    experts = tl.program_id(0) * EXPERTS + tl.arange(0, EXPERTS)
    counts = tl.zeros([EXPERTS], tl.int32)
    for first in range(0, num_blocks, BLOCKS_PER_LOAD):
        blocks = first + tl.arange(0, BLOCKS_PER_LOAD)
        at = blocks[:, None] * BLOCK_E + experts[None, :]
        ok = (blocks < num_blocks)[:, None]
        block = tl.load(block_counts_ptr + at, mask=ok, other=0)
        tl.store(block_base_ptr + at, counts[None, :] + tl.cumsum(block, 0) - block, mask=ok)
        counts += tl.sum(block, axis=0)
    tl.store(counts_ptr + experts, counts)


@recordable
@bind_launches
@triton.jit
def _scatter_kernel(
    ids_ptr,
    num_pairs,
    block_pairs,
    num_blocks,
    E_OFF,
    E,
    block_base_ptr,
    counts_ptr,
    sorted_ptr,
    tiles_ptr,
    num_tiles_ptr,
    max_tiles,
    narrow_ptr,
    full_ptr,
    PAIRS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    TILE_CHUNK: tl.constexpr,
    SUM_BLOCKS: tl.constexpr,
    NARROW_T: tl.constexpr,
    PDL: tl.constexpr,
):
    """Per program: one block's pairs (block_pairs of them, at most PAIRS) into their experts'
    sorted rows, each at the expert's first row, plus the block's first rank (the align
    kernel's), plus its rank among the block's pairs of that expert; and TILE_CHUNK entries
    of the tile table (_store_tile_entries). Each program places the experts' rows from their
    counts itself (a cumsum over BLOCK_E), where a launch of its own would cost more.
    SUM_BLOCKS (a power of two at least num_blocks, else 0): no align kernel ran; each
    program sums the blocks' counts (block_base_ptr) itself, the align kernel's sums.
    NARROW_T: program 0 also writes narrow_tiles and full_tiles' count, each program
    TILE_CHUNK of its entries (module doc).
    PDL: launched with programmatic dependent launch behind the kernel before it."""
    _wait_then_launch_dependents(PDL)
    pid = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    if SUM_BLOCKS:
        blocks = tl.arange(0, SUM_BLOCKS)
        at = blocks[:, None] * BLOCK_E + experts[None, :]
        block = tl.load(block_base_ptr + at, mask=(blocks < num_blocks)[:, None], other=0)
        counts = tl.sum(block, axis=0)
        block_first = tl.sum(tl.where((blocks < pid)[:, None], block, 0), axis=0)
    else:
        counts = tl.load(counts_ptr + experts)
    ntiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(ntiles, 0)
    row_begin = (tile_end - ntiles) * BLOCK_M
    total = tl.sum(ntiles, 0)
    if pid == 0:
        tl.store(num_tiles_ptr, total)
        _store_narrow_tiles((narrow_ptr, full_ptr), counts, ntiles, tile_end, E, BLOCK_M, NARROW_T)
    if pid < num_blocks:
        lane = tl.arange(0, PAIRS)
        offs = pid * block_pairs + lane
        ok = (lane < block_pairs) & (offs < num_pairs)
        ids = tl.load(ids_ptr + offs, mask=ok, other=0) - E_OFF
        ok = ok & (ids >= 0) & (ids < E)
        earlier = (ids[:, None] == ids[None, :]) & ok[None, :] & (lane[None, :] < lane[:, None])
        rank = tl.sum(earlier.to(tl.int32), axis=1)
        # ids outside the local range gather from expert 0 and are masked at the store.
        local = tl.where(ok, ids, 0)
        if SUM_BLOCKS:
            first = tl.gather(row_begin + block_first, local, 0)
        else:
            first = tl.gather(row_begin, local, 0)
            first += tl.load(block_base_ptr + pid * BLOCK_E + local, mask=ok, other=0)
        tl.store(sorted_ptr + first + rank, offs, mask=ok)
    if pid * TILE_CHUNK < max_tiles:
        t = pid * TILE_CHUNK + tl.arange(0, TILE_CHUNK)
        e = _expert_of_tiles(tile_end, t)
        # Tiles past the last (e = BLOCK_E) gather any row end: _store_tile_entries zeroes it.
        row_end = tl.gather(row_begin + counts, tl.minimum(e, BLOCK_E - 1), 0)
        _store_tile_entries(tiles_ptr, sorted_ptr, t, e, row_end, total, max_tiles, BLOCK_M)
        _store_full_tiles(full_ptr, counts, ntiles, tile_end, t, max_tiles, BLOCK_M, NARROW_T)


# ----------------------------------------------------------------------------- host side


def max_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on tiles: each active expert wastes at most block_m - 1 rows."""
    active = min(num_experts, num_pairs)
    return max(1, (num_pairs + active * (block_m - 1)) // block_m)


def route(
    router_logits,
    topk_weights,
    topk_ids,
    *,
    top_k: int,
    num_experts: int,
    block_m: int,
    expert_offset: int = 0,
    num_local_experts: int | None = None,
    launch_dependents: bool = False,
    ready: torch.Tensor | None = None,
    prescale: tuple | None = None,
    narrow: tuple | None = None,
):
    """Route M tokens and group the pairs by expert. On CUDA sm_90+, launch_dependents lets a
    kernel launched behind the router with programmatic dependent launch start its CTAs early
    (the multi-kernel router chains its own launches so too). For the one-program decode
    kernel (at most FUSED_MAX_PAIRS pairs): ready, int32 [>= max_tiles], is zeroed for
    the GEMMs' per-tile counters; prescale = (x [M, H] bf16, scaled [M, H] bf16, exponents [M]
    int32) also writes `_prescale_row` of each row of x into scaled and exponents; with a
    fourth entry, (static scale or None, per-row scales [M] float32 or None), of the e4m3
    values of x's rows (FP8 activations: static, or dynamic with each row's scale written).
    router_logits [M, E] (or None with precomputed topk_weights [M, k] float32 and topk_ids [M, k]
    int32); num_experts = E (the logits' width), num_local_experts (None: E) of them from
    expert_offset on held here: only their pairs are grouped. narrow = (narrow_tiles int32
    [num_local_experts], narrow_t, full_tiles int32 [1 + max_tiles(...)]): also write each
    local expert's narrow tile and the list of the other tiles (module doc).
    Returns (topk_weights, topk_ids, sorted_pairs [max_tiles * block_m] int32, tiles
    [max_tiles, 2] int32 (expert, row_end), num_tiles [1] int32, max_tiles)."""
    has_logits = router_logits is not None
    M = router_logits.shape[0] if has_logits else topk_ids.shape[0]
    device = router_logits.device if has_logits else topk_ids.device
    num_pairs = M * top_k
    local = num_experts if num_local_experts is None else num_local_experts
    n_tiles = max_tiles(num_pairs, local, block_m)
    if has_logits:
        topk_ids = scratch("topk_ids", (M, top_k), torch.int32, device)
        topk_weights = scratch("topk_weights", (M, top_k), torch.float32, device)
    sorted_pairs = scratch("sorted_pairs", (n_tiles * block_m,), torch.int32, device)
    tiles = scratch("tiles", (n_tiles, 2), torch.int32, device)
    num_tiles = scratch("num_tiles", (1,), torch.int32, device)
    block_e = triton.next_power_of_2(num_experts)
    block_k = triton.next_power_of_2(top_k)
    stride = router_logits.stride(0) if has_logits else 0
    logits = router_logits if has_logits else topk_ids
    # The tile table is written TILE_CHUNK tiles at a time, each against every expert: no wider
    # than the table itself (a decode step has a handful of tiles).
    tile_chunk = min(_TILE_CHUNK, triton.next_power_of_2(n_tiles))
    _check_one_program_options(num_pairs, n_tiles, ready, prescale)
    narrow_tiles, full_tiles, narrow_t = _checked_narrow(narrow, local, block_m, n_tiles, num_tiles)
    if num_pairs <= FUSED_MAX_PAIRS:
        block_t = triton.next_power_of_2(M)
        x, scaled, exponents = prescale[:3] if prescale is not None else (logits, logits, num_tiles)
        static_scale, x_scales = prescale[3] if prescale and len(prescale) > 3 else (None, None)
        quant = 0 if prescale is None or len(prescale) == 3 else 1 if x_scales is None else 2
        hidden = x.shape[1] if prescale is not None else 0
        _route_small_kernel[(1 + (M if prescale is not None else 0),)](
            logits,
            topk_ids,
            topk_weights,
            sorted_pairs,
            tiles,
            num_tiles,
            ready if ready is not None else num_tiles,
            narrow_tiles,
            full_tiles,
            x,
            scaled,
            exponents,
            x_scales if x_scales is not None else num_tiles,
            1.0 if static_scale is None else static_scale,
            M,
            num_experts,
            expert_offset,
            local,
            hidden,
            stride,
            x.stride(0) if prescale is not None else 0,
            scaled.stride(0) if prescale is not None else 0,
            n_tiles,
            TOPK=top_k,
            HAS_LOGITS=has_logits,
            BLOCK_T=block_t,
            BLOCK_E=block_e,
            BLOCK_EL=triton.next_power_of_2(local),
            BLOCK_K=block_k,
            BLOCK_M=block_m,
            TILE_CHUNK=tile_chunk,
            NARROW_T=narrow_t,
            LAUNCH_DEPENDENTS=launch_dependents,
            CLEAR_READY=ready is not None,
            PRESCALE=prescale is not None,
            BLOCK_H=triton.next_power_of_2(hidden) if prescale is not None else 1,
            QUANT=quant,
            INTERPRETED=interpreting(),
            num_warps=_one_program_warps(num_pairs, block_t * block_k, quant),
        )
        return topk_weights, topk_ids, sorted_pairs, tiles, num_tiles, n_tiles
    grouping = (sorted_pairs, tiles, num_tiles, n_tiles, (narrow_tiles, full_tiles), narrow_t)
    experts = (num_experts, expert_offset, local)
    _route_large(
        router_logits, topk_weights, topk_ids, grouping, top_k, block_m, experts, launch_dependents
    )
    return topk_weights, topk_ids, sorted_pairs, tiles, num_tiles, n_tiles


def _one_program_warps(num_pairs: int, padded_pairs: int, quant: int) -> int:
    """Warps of the one-program router: one for a decode step's handful of pairs (every
    reduction stays in shuffles) unless it quantizes x's rows (an IEEE division per element),
    then four, and eight from 32 padded pairs, where the [pairs, pairs] rank compares and the
    top-k over [tokens, experts] logits are worth more warps."""
    if num_pairs <= ONE_WARP_MAX_PAIRS and not quant:
        return 1
    return 4 if padded_pairs <= FOUR_WARPS_MAX_PAIRS else 8


def _check_one_program_options(num_pairs: int, n_tiles: int, ready, prescale) -> None:
    """route's options that only the one-program router implements, checked before a launch."""
    if ready is not None and (
        num_pairs > FUSED_MAX_PAIRS or ready.numel() < n_tiles or ready.dtype != torch.int32
    ):
        raise ValueError(
            f"route: `ready` needs at most {FUSED_MAX_PAIRS} pairs (got {num_pairs}) and "
            f"{n_tiles} int32 counters (got {ready.numel()} {ready.dtype})"
        )
    if prescale is not None and num_pairs > FUSED_MAX_PAIRS:
        raise ValueError(f"route: prescale needs at most {FUSED_MAX_PAIRS} pairs, got {num_pairs}")


def _checked_narrow(narrow, local: int, block_m: int, n_tiles: int, placeholder: torch.Tensor):
    """route's narrow option -> (narrow_tiles, full_tiles, narrow_t), placeholders and 0 for
    none, checked."""
    if narrow is None:
        return placeholder, placeholder, 0
    narrow_tiles, narrow_t, full_tiles = narrow
    if (
        narrow_tiles.dtype != torch.int32
        or narrow_tiles.numel() < local
        or not narrow_tiles.is_contiguous()
        or not 1 <= narrow_t < block_m
    ):
        raise ValueError(
            f"route: narrow needs int32 narrow_tiles of {local} local experts, contiguous, and "
            f"narrow_t in [1, {block_m}); got {narrow_tiles.dtype} x {narrow_tiles.numel()}, "
            f"narrow_t {narrow_t}"
        )
    if (
        full_tiles.dtype != torch.int32
        or full_tiles.numel() < 1 + n_tiles
        or not full_tiles.is_contiguous()
    ):
        raise ValueError(
            f"route: narrow needs int32 full_tiles of 1 + {n_tiles} entries (the count, then "
            f"the tile bound's), contiguous; got {full_tiles.dtype} x {full_tiles.numel()}"
        )
    return narrow_tiles, full_tiles, narrow_t


def _route_large(
    router_logits, topk_weights, topk_ids, grouping, top_k, block_m, experts, pdl=False
):
    """route beyond FUSED_MAX_PAIRS pairs: top-k over token blocks counting each block's pairs
    per expert (or, for precomputed ids, the count kernel over blocks of pairs), then the
    align kernel (beyond _SCATTER_SUMS_BLOCKS blocks) and the scatter. grouping:
    (sorted_pairs, tiles, num_tiles, tile-count bound, (narrow_tiles, full_tiles), narrow_t);
    experts: (E,
    expert_offset, E_local).
    pdl (route's launch_dependents): each launch after the first, and the kernel after the
    router, start under programmatic dependent launch."""
    sorted_pairs, tiles, num_tiles, n_tiles, (narrow_tiles, full_tiles), narrow_t = grouping
    num_experts, expert_offset, local = experts
    has_logits = router_logits is not None
    M, num_pairs = topk_ids.shape[0], topk_ids.shape[0] * top_k
    block_e = triton.next_power_of_2(num_experts)
    block_k = triton.next_power_of_2(top_k)
    stride = router_logits.stride(0) if has_logits else 0
    device = topk_ids.device
    block_el = triton.next_power_of_2(local)
    # Keep one top-k program's [BLOCK_T, BLOCK_E] logits tile near 4K elements, and its pairs
    # within the scatter's block.
    block_t = max(1, min(64, 4096 // block_e, _BLOCK_PAIRS // block_k))
    block_pairs = block_t * top_k if has_logits else _BLOCK_PAIRS
    num_blocks = triton.cdiv(num_pairs, block_pairs)
    counts = scratch("block_counts", (num_blocks, block_el), torch.int32, device)
    if has_logits:
        _topk_kernel[(num_blocks,)](
            router_logits,
            topk_ids,
            topk_weights,
            counts,
            M,
            num_experts,
            expert_offset,
            local,
            stride,
            TOPK=top_k,
            BLOCK_T=block_t,
            BLOCK_E=block_e,
            BLOCK_EL=block_el,
            BLOCK_K=block_k,
            LAUNCH_DEPENDENTS=pdl,
        )
    else:
        _count_kernel[(num_blocks,)](
            topk_ids,
            num_pairs,
            expert_offset,
            local,
            counts,
            CHUNK=block_pairs,
            BLOCK_EL=block_el,
            LAUNCH_DEPENDENTS=pdl,
        )
    chained = {"PDL": pdl, **({"launch_pdl": True} if pdl else {})}
    # Few blocks: the scatter sums their counts itself (one launch fewer).
    sum_blocks = triton.next_power_of_2(num_blocks) if num_blocks <= _SCATTER_SUMS_BLOCKS else 0
    block_base = counts
    expert_counts = counts
    if not sum_blocks:
        block_base = scratch("block_base", (num_blocks, block_el), torch.int32, device)
        expert_counts = scratch("expert_counts", (block_el,), torch.int32, device)
        experts_per_program = min(block_el, _ALIGN_EXPERTS)
        per_load = min(
            triton.next_power_of_2(num_blocks), max(1, _COUNTS_PER_LOAD // experts_per_program)
        )
        _align_kernel[(block_el // experts_per_program,)](
            counts,
            num_blocks,
            block_base,
            expert_counts,
            BLOCK_E=block_el,
            EXPERTS=experts_per_program,
            BLOCKS_PER_LOAD=per_load,
            **chained,
        )
    programs = max(num_blocks, triton.cdiv(n_tiles, _SCATTER_TILE_CHUNK))
    _scatter_kernel[(programs,)](
        topk_ids,
        num_pairs,
        block_pairs,
        num_blocks,
        expert_offset,
        local,
        block_base,
        expert_counts,
        sorted_pairs,
        tiles,
        num_tiles,
        n_tiles,
        narrow_tiles,
        full_tiles,
        PAIRS=triton.next_power_of_2(block_pairs),
        BLOCK_M=block_m,
        BLOCK_E=block_el,
        TILE_CHUNK=_SCATTER_TILE_CHUNK,
        SUM_BLOCKS=sum_blocks,
        NARROW_T=narrow_t,
        **chained,
    )
