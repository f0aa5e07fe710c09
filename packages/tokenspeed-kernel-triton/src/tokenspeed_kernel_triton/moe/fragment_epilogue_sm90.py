"""The Hopper fragment GEMM's epilogue (wgmma_gemm_sm90.py), in the accumulator layout: the token
columns of a post-scaled accumulator, the operands the epilogue reads besides it, and GEMM1's
clamped SwiGLU store."""

from __future__ import annotations

from triton import language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .e4m3 import e4m3_of


@gluon.jit
def token_columns(acc, POST_SCALE: gl.constexpr, BLOCK_W: gl.constexpr, BLOCK_T: gl.constexpr):
    """The accumulator [BLOCK_W, BLOCK_T] by token: with POST_SCALE the sum of its four
    scale-block groups (across a quad's lanes)."""
    if POST_SCALE:
        acc = gl.sum(gl.reshape(acc, [BLOCK_W, 4, BLOCK_T]), axis=1)
    return acc


@gluon.jit
def epilogue_operands(
    source,
    TOPK: gl.constexpr,
    SWIGLU: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    POST_SCALE: gl.constexpr,
    SCALE_BIAS: gl.constexpr,
    IN_SCALE: gl.constexpr,
    BLOCK_W: gl.constexpr,
    BLOCK_T: gl.constexpr,
    out_layout: gl.constexpr,
):
    """What the epilogue reads besides the accumulator, in its layout: the weight rows, the
    token columns, which of them are valid, their pairs, the bias of the rows (zeros without
    one), a factor per column before the bias and one after it. Before: GEMM1 post-scaled
    2^(E_t - SCALE_BIAS), since x's row of token t was multiplied by 2^(126 - E_t)
    (x_exp_ptr: E_t), which the raw bf16 weights' 2^-126 and the factors' bias leave as
    2^(SCALE_BIAS - E_t); times, with fp8 activations, the scale of the operand's row
    (IN_SCALE 1: one for all, in_scale; 2: per row, in_scale_ptr, GEMM1 by token, GEMM2 by
    sorted row); else ones. After: GEMM2 the routing weight; GEMM1 ones (unused). source:
    ((sorted_ptr, route_w_ptr, bias_ptr, x_exp_ptr, stride_be, in_scale_ptr, in_scale),
    expert, the tile's first sorted row, pid_w, row_end, n_valid: the rows the bias has)."""
    pointers, expert, first_row, pid_w, row_end, n_valid = source
    sorted_ptr, route_w_ptr, bias_ptr, x_exp_ptr, stride_be, in_scale_ptr, in_scale = pointers
    out_cols: gl.constexpr = gl.SliceLayout(0, out_layout)
    # The accumulator layout repeats each column's values over a warp's lanes and warps (32 a
    # thread at 128 tokens): wide tiles load them one per thread and convert, a shared-memory
    # pass instead of a load, its address and mask per value. The serving tiles' 2 to 4 a
    # thread stay loads.
    WIDE: gl.constexpr = BLOCK_T >= 32
    load_cols: gl.constexpr = (
        gl.BlockedLayout([1], [32], [gl.num_warps()], [0]) if WIDE else out_cols
    )
    rows = pid_w * BLOCK_W + gl.arange(0, BLOCK_W, layout=gl.SliceLayout(1, out_layout))
    cols = first_row + gl.arange(0, BLOCK_T, layout=load_cols)
    col_ok = cols < row_end
    pair = gl.load(sorted_ptr + cols, mask=col_ok, other=0, cache_modifier=".cg")
    bias = gl.zeros([BLOCK_W], gl.float32, gl.SliceLayout(1, out_layout))
    if HAS_BIAS:
        bias = gl.load(bias_ptr + expert * stride_be + rows, mask=rows < n_valid, other=0.0)
    pre = gl.full([BLOCK_T], 1.0, gl.float32, load_cols)
    post = gl.full([BLOCK_T], 1.0, gl.float32, load_cols)
    if SWIGLU:
        if POST_SCALE:
            e = gl.load(x_exp_ptr + pair // TOPK, mask=col_ok, other=SCALE_BIAS)
            pre = ((e - SCALE_BIAS + 127) << 23).to(gl.float32, bitcast=True)
    else:
        post = gl.load(route_w_ptr + pair, mask=col_ok, other=0.0, cache_modifier=".cg")
    if IN_SCALE == 1:
        pre = pre * in_scale
    if IN_SCALE == 2:
        operand_row = pair // TOPK if SWIGLU else cols
        pre = pre * gl.load(in_scale_ptr + operand_row, mask=col_ok, other=0.0)
    cols = first_row + gl.arange(0, BLOCK_T, layout=out_cols)
    col_ok = cols < row_end
    pair = gl.convert_layout(pair, out_cols)
    pre = gl.convert_layout(pre, out_cols)
    post = gl.convert_layout(post, out_cols)
    return rows, cols, col_ok, pair, bias, pre, post


@gluon.jit
def _gate_up(x, BLOCK_W: gl.constexpr, BLOCK_T: gl.constexpr):
    """[W, T] with rows (16-row group, gate|up, 8 channels) -> gate, up [W/16, 8, T]."""
    x = gl.reshape(x, [BLOCK_W // 16, 2, 8, BLOCK_T])
    return gl.split(gl.permute(x, (0, 2, 3, 1)))


@gluon.jit
def swiglu_store(
    out_rows,
    acc,
    alpha,
    limit,
    out_scale,
    BLOCK_W: gl.constexpr,
    BLOCK_T: gl.constexpr,
    OUT_QUANT: gl.constexpr,
):
    """GEMM1's clamped SwiGLU of acc into its rows of out, in out's form: fp16, bf16 [hi | lo]
    halves, e4m3 (OUT_QUANT, for GEMM2's e4m3 fragments: each channel at its MMA position,
    e4m3_fragments_sm90), or float32 (for fp8 activations with per-row scales, quantized
    from it by a pass of their own: the reference rounds the exact value to e4m3, and a
    half-precision step first would round some ties the other way). OUT_QUANT (fp8
    activations, a static scale): the e4m3 values of act / out_scale, exact in either half
    form (lo is then zero).
    out_rows: (out_ptr, N, stride_om, the weight rows, the token columns, which columns are
    valid)."""
    out_ptr, N, stride_om, rows, cols, col_ok = out_rows
    g, u = _gate_up(acc, BLOCK_W, BLOCK_T)
    # Index tensors go through the same reshape so that they share g's layout.
    zero = gl.zeros_like(acc).to(gl.int32)
    channel, _ = _gate_up((rows // 16 * 8 + rows % 8)[:, None] + zero, BLOCK_W, BLOCK_T)
    row, _ = _gate_up(cols[None, :] + zero, BLOCK_W, BLOCK_T)
    ok, _ = _gate_up(col_ok[None, :].to(gl.int32) + zero, BLOCK_W, BLOCK_T)
    g = gl.minimum(g, limit)
    u = gl.minimum(gl.maximum(u, -limit), limit)
    act = g / (1.0 + gl.exp(-alpha * g)) * (u + 1.0)
    OUT_TYPE: gl.constexpr = out_ptr.dtype.element_ty
    if OUT_TYPE == gl.float8e4nv:
        t = channel % 128
        position = channel - t + t // 8 % 4 * 32 + t // 4 % 2 * 16 + t // 32 * 4 + t % 4
        ptrs = out_ptr + row.to(gl.int64) * stride_om + position
        gl.store(ptrs, e4m3_of(act, out_scale, False), mask=ok != 0)
        return
    if OUT_QUANT:
        act = e4m3_of(act, out_scale, False).to(gl.float32)
    ptrs = out_ptr + row.to(gl.int64) * stride_om + channel
    if OUT_TYPE == gl.float32:
        gl.store(ptrs, act, mask=ok != 0)
    elif OUT_TYPE == gl.float16:
        # One fp16 row (the host checked that alpha and limit bound |act| below fp16's max).
        gl.store(ptrs, act.to(gl.float16), mask=ok != 0)
    else:
        hi = act.to(gl.bfloat16)
        lo = (act - hi.to(gl.float32)).to(gl.bfloat16)
        gl.store(ptrs, hi, mask=ok != 0)
        gl.store(ptrs + N // 2, lo, mask=ok != 0)


@gluon.jit
def _max_keeping_nan(a, b):
    return gl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@gluon.jit
def not_below(x, bound):
    """|x| >= bound, or x NaN."""
    return (gl.abs(x) < bound) == 0


@gluon.jit
def pair_rows_store(
    out_ptr,
    wide_ptr,
    acc,
    stage,
    wide_from_bits,
    sorted_ptr,
    tile_rows,
    pid_w,
    n_valid,
    stride_om,
    BLOCK_W: gl.constexpr,
    BLOCK_T: gl.constexpr,
    pair_rows_layout: gl.constexpr,
):
    """GEMM2's pair rows in half the bytes: each element in fp16 into out_ptr where it rounds
    below the bound b in magnitude (from wide_from_bits on, float32 bits, it rounds to b or
    above; b a power of two), which rounds it by at most b * 2^-12
    (fragment_config_sm90.half_pair_rows_bound bounds a token's top_k rows together); any
    other element (NaN included) exact in float32 into wide_ptr, at the same index, and NaN
    into out_ptr, which tells combine.combine to read it there. Each element decides for
    itself: a token's output never depends on which tokens share its tile (the rest of the
    batch decides that). tile_rows: (the tile's first sorted row, its row end).

    The fp16 tile goes to global memory from a layout of 8 consecutive columns per thread
    (whole 16-byte stores), through `stage`, [BLOCK_W, BLOCK_T] fp16 over the ring's shared
    memory: one stmatrix store and one load, where a layout conversion steps through a small
    scratch tile with two CTA barriers a step. The pair indices are loaded again for the
    layout that uses them rather than held across the epilogue: 32 registers each per thread
    in the accumulator's column layout (as int64 offsets 64) made ptxas spill."""
    first_row, row_end = tile_rows
    rows = pid_w * BLOCK_W + gl.arange(0, BLOCK_W, layout=gl.SliceLayout(1, acc.type.layout))
    # One CTA-wide test keeps the float32 stores off the common path. Its max keeps NaN,
    # which a plain float max drops.
    wide_from = wide_from_bits.to(gl.float32, bitcast=True)
    peak = gl.reduce(gl.reduce(gl.abs(acc), 1, _max_keeping_nan), 0, _max_keeping_nan)
    if not (peak < wide_from):
        wide = not_below(acc, wide_from)
        cols = first_row + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, acc.type.layout))
        pair = gl.load(sorted_ptr + cols, mask=cols < row_end, other=0, cache_modifier=".cg")
        ptrs = wide_ptr + pair.to(gl.int64)[None, :] * stride_om + rows[:, None]
        ok = wide & (cols < row_end)[None, :] & (rows < n_valid)[:, None]
        gl.store(ptrs, acc, mask=ok)
        acc = gl.where(wide, float("nan"), acc)
    # Every warp is past its last wgmma, so the ring is free.
    gl.thread_barrier()
    stage.store(acc.to(gl.float16))
    gl.thread_barrier()
    tile = stage.load(pair_rows_layout)
    cols = first_row + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, pair_rows_layout))
    pair = gl.load(sorted_ptr + cols, mask=cols < row_end, other=0, cache_modifier=".cg")
    rows = pid_w * BLOCK_W + gl.arange(0, BLOCK_W, layout=gl.SliceLayout(1, pair_rows_layout))
    ok = (cols < row_end)[None, :] & (rows < n_valid)[:, None]
    gl.store(out_ptr + pair.to(gl.int64)[None, :] * stride_om + rows[:, None], tile, mask=ok)
