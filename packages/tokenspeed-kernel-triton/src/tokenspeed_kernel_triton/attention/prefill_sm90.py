"""Causal ragged prefill on Hopper, warp-specialized (Gluon): a TMA producer warp and two
consumer warpgroups that never meet at a CTA barrier.

The Triton kernel (`prefill.py`) loads K/V with cp.async into a ring that all 8 warps guard with
CTA barriers, so its two warpgroups run their wgmmas and their softmax in step and the tensor
cores idle during the softmax. Here one warp streams K/V blocks by TMA into a shared-memory ring
(mbarriers: ready when the bytes land, empty when both consumers are done with them), and each
consumer warpgroup owns 64 query rows (GQA packing: 8 tokens x 8 heads at GQA 8) and runs its
own schedule, overlapping its softmax with its own wgmmas: while it exponentiates block j, the
tensor cores run S_{j+1} = Q K_{j+1}^T and O += P_{j-1} V_{j-1}.

The tile geometry (128 rows, the GQA packing, heavy tiles first) is the Triton kernel's, so a
tile whose accumulator is not finite sets the same flag and the Triton fix-up launch recomputes
it exactly (`_fixup.py`).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from tokenspeed_kernel.platform import platform_of
from tokenspeed_kernel.registry import ANY, register_kernel

from . import prefill
from ._common import GPT_OSS_AOT_CASE, HALF, HEAD_DIMS, LN2, LOG2E
from ._fixup import tile_flags
from ._tile_config import AttentionConfig, launch_meta

KERNEL_NAME = "triton.mha_prefill.sm90"

ROWS_PER_WARPGROUP = 64  # one wgmma m64 row block per consumer
CONSUMERS = 3
STAGES = 3
import os

REGS = gl.constexpr(int(os.environ.get("TS_REGS", "160")))


def block_n(head_dim: int) -> int:
    """Keys per ring stage: 128 at hd 64 (fewer rescales and waits per key); at hd 128 three
    such stages and two Q slots would overflow shared memory (256 KB), so 64."""
    return 128 if head_dim <= 64 else 64


# The Triton kernel's tile geometry on sm_90 (BLOCK_M and GQA packing), which the fix-up launch
# recomputes flagged tiles with.
FIXUP_CONFIG = AttentionConfig(ROWS_PER_WARPGROUP, 64, 4, 3, heads_per_tile=8)


@gluon.jit
def _tile(
    i, num_m_blocks, num_head_tiles, num_seqs, CuSeqlens, num_tokens, TILE_TOKENS: gl.constexpr
):
    """Tile i of the persistent schedule: (flag index, head tile, first token of the sequence,
    its length, first token of the tile in it). Tiles go heaviest first (the last query
    blocks see the most keys), so the short ones make up the tail."""
    per_block = num_head_tiles * num_seqs
    pid_m = i // per_block
    pid_h = i % num_head_tiles
    seq = i % per_block // num_head_tiles
    start = gl.minimum(gl.maximum(gl.load(CuSeqlens + seq), 0), num_tokens)
    end = gl.minimum(gl.maximum(gl.load(CuSeqlens + seq + 1), 0), num_tokens)
    t0 = (num_m_blocks - 1 - pid_m) * TILE_TOKENS
    return seq, pid_h, start, end - start, t0


@gluon.jit
def _load_partition(
    q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, kv_ready, kv_empty,
    CuSeqlens, num_m_blocks, num_head_tiles, num_seqs, num_tokens,
    GROUP: gl.constexpr, HEADS: gl.constexpr, TOKENS: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
):  # fmt: skip
    """The producer warp: per tile, both consumers' Q slices into one of two Q slots, then the
    K/V blocks into the ring; a slot or stage is refilled once both consumers released it,
    so the next tile's loads run under this tile's last blocks and epilogue."""
    num_tiles = num_m_blocks * num_head_tiles * num_seqs
    n = 0  # tiles this program has loaded
    it = 0  # K/V blocks this program has loaded
    for i in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        _, pid_h, start, seqlen, t0 = _tile(
            i, num_m_blocks, num_head_tiles, num_seqs, CuSeqlens, num_tokens, 3 * TOKENS
        )
        if t0 < seqlen:
            slot = n % 2
            # A fresh barrier counts as having completed the phase before its first: the
            # first pass over the slots and the ring does not wait.
            mbarrier.wait(q_empty.index(slot), ((n // 2) & 1) ^ 1)
            mbarrier.expect(q_ready.index(slot), 3 * q_desc.block_type.nbytes)
            for w in gl.static_range(3):
                tma.async_copy_global_to_shared(
                    q_desc, [start + t0 + w * TOKENS, pid_h * HEADS, 0], q_ready.index(slot),
                    q_smem.index(3 * slot + w),
                )  # fmt: skip
            kv_head = pid_h * HEADS // GROUP
            num_blocks = gl.cdiv(gl.minimum(t0 + 3 * TOKENS, seqlen), BLOCK_N)
            for j in range(num_blocks):
                stage = it % STAGES
                mbarrier.wait(kv_empty.index(stage), ((it // STAGES) & 1) ^ 1)
                ready = kv_ready.index(stage)
                mbarrier.expect(ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
                row = start + j * BLOCK_N
                tma.async_copy_global_to_shared(
                    k_desc, [row, kv_head, 0], ready, k_smem.index(stage)
                )
                tma.async_copy_global_to_shared(
                    v_desc, [row, kv_head, 0], ready, v_smem.index(stage)
                )
                it += 1
            n += 1


@gluon.jit
def _keys_t(k_smem, it, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    """K^T [D, BLOCK_N] of ring block `it`, a view (wgmma reads it transposed)."""
    return k_smem.index(it % STAGES).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))


@gluon.jit
def _values(v_smem, it, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    return v_smem.index(it % STAGES).reshape([BLOCK_N, HEAD_DIM])


@gluon.jit
def _issue_scores(
    q, k_smem, kv_ready, it, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    STAGES: gl.constexpr, s_layout: gl.constexpr,
):  # fmt: skip
    """S = Q K^T of ring block `it`, issued once its bytes landed (not waited for). The zero
    accumulator is made here: a zero tile kept live across the loop would hold 64 registers."""
    mbarrier.wait(kv_ready.index(it % STAGES), (it // STAGES) & 1)
    ROWS: gl.constexpr = q.shape[0]
    zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    return warpgroup_mma(
        q, _keys_t(k_smem, it, BLOCK_N, HEAD_DIM, STAGES), zero, use_acc=False, is_async=True
    )


@gluon.jit
def _rescale(acc, alpha, o_layout: gl.constexpr):
    return acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]


@gluon.jit
def _softmax_block(
    s, m_i, l_i, qk_scale, rows, j, MASKED: gl.constexpr, BLOCK_N: gl.constexpr,
    s_layout: gl.constexpr, p_layout: gl.constexpr, dtype: gl.constexpr,
):  # fmt: skip
    """Online softmax of score block j (keys j * BLOCK_N..): (P as the PV wgmma's register
    operand, the accumulator's rescale, new max, new sum). Scores are in the log2 domain;
    MASKED blocks hide the keys after each row's token. Causal rows all see key 0, so the
    max is finite from the first block on."""
    if MASKED:
        # Column offsets against each row's last visible key in this block: two registers per
        # thread beside the lane's column constants.
        last_key = rows - j * BLOCK_N
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(cols[None, :] <= last_key[:, None], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        p = gl.exp2(s - m_new[:, None])
    else:
        # qk_scale > 0: max(s) * scale == max(s * scale), and the scale folds into one FMA.
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


@gluon.jit
def _attend_blocks(
    lo, hi, it0, p, acc, m_i, l_i, q, k_smem, v_smem, kv_ready, kv_empty, qk_scale, rows,
    MASKED: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
    p_layout: gl.constexpr, dtype: gl.constexpr,
):  # fmt: skip
    """Key blocks [lo, hi) of a tile whose block 0 is ring block it0, P_{lo-1} in `p`: per block
    j, S_j = Q K_j^T and O += P_{j-1} V_{j-1} are issued, and P_j is computed from S_j while
    the second one runs. Both are waited for within the iteration (an accumulator in flight
    across the loop's back edge gets copied there, and ptxas then serializes every wgmma of
    the loop: C7514). Returns (P_{hi-1}, O without it, max, sum)."""
    for j in range(lo, hi):
        it = it0 + j
        s = _issue_scores(q, k_smem, kv_ready, it, BLOCK_N, HEAD_DIM, STAGES, s_layout)
        acc = warpgroup_mma(
            p, _values(v_smem, it - 1, BLOCK_N, HEAD_DIM, STAGES), acc, is_async=True
        )
        # wgmma groups retire in order: one left in flight means S_j is complete.
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
        p32, alpha, m_i, l_i = _softmax_block(
            s, m_i, l_i, qk_scale, rows, j, MASKED, BLOCK_N, s_layout, p_layout, dtype
        )
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(kv_empty.index((it - 1) % STAGES), count=1)
        acc = _rescale(acc, alpha, o_layout)
        # P_j takes P_{j-1}'s registers once its wgmma is done.
        p = gl.convert_layout(p32.to(dtype), p_layout)
    return p, acc, m_i, l_i


@gluon.jit
def _attend_tile(
    wg, q, k_smem, v_smem, kv_ready, kv_empty, it0, num_blocks, t0, qk_scale,
    HEADS: gl.constexpr, TOKENS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
    p_layout: gl.constexpr, dtype: gl.constexpr,
):  # fmt: skip
    """(O, max, sum) of this warpgroup's rows over the tile's key blocks (ring blocks it0..)."""
    ROWS: gl.constexpr = TOKENS * HEADS
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    first_tok = t0 + wg * TOKENS
    rows = first_tok + gl.arange(0, ROWS, layout=row_layout) // HEADS
    # Blocks every row of this warpgroup sees whole run unmasked.
    full_blocks = (first_tok + 1) // BLOCK_N
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([ROWS], gl.float32, layout=row_layout)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)

    s = _issue_scores(q, k_smem, kv_ready, it0, BLOCK_N, HEAD_DIM, STAGES, s_layout)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    if full_blocks > 0:
        p32, alpha, m_i, l_i = _softmax_block(
            s, m_i, l_i, qk_scale, rows, 0, False, BLOCK_N, s_layout, p_layout, dtype
        )
    else:
        p32, alpha, m_i, l_i = _softmax_block(
            s, m_i, l_i, qk_scale, rows, 0, True, BLOCK_N, s_layout, p_layout, dtype
        )
    p = gl.convert_layout(p32.to(dtype), p_layout)
    # Unmasked blocks, then the diagonal ones, each loop free of branches (a branch between a
    # wgmma and its wait makes ptxas serialize the wgmmas).
    split = gl.maximum(gl.minimum(full_blocks, num_blocks), 1)
    p, acc, m_i, l_i = _attend_blocks(
        1, split, it0, p, acc, m_i, l_i, q, k_smem, v_smem, kv_ready, kv_empty, qk_scale, rows,
        False, HEAD_DIM, BLOCK_N, STAGES, s_layout, o_layout, p_layout, dtype,
    )  # fmt: skip
    p, acc, m_i, l_i = _attend_blocks(
        split, num_blocks, it0, p, acc, m_i, l_i, q, k_smem, v_smem, kv_ready, kv_empty,
        qk_scale, rows, True, HEAD_DIM, BLOCK_N, STAGES, s_layout, o_layout,
        p_layout, dtype,
    )  # fmt: skip
    last = it0 + num_blocks - 1
    acc = warpgroup_mma(p, _values(v_smem, last, BLOCK_N, HEAD_DIM, STAGES), acc)
    mbarrier.arrive(kv_empty.index(last % STAGES), count=1)
    return acc, m_i, l_i


@gluon.jit
def _store_tile(
    acc, m_i, l_i, wg, Out, Lse, Sinks, flag, start, t0, seqlen, head0, stride_ot, stride_oh,
    stride_lt, HEADS: gl.constexpr, TOKENS: gl.constexpr, HEAD_DIM: gl.constexpr,
    o_layout: gl.constexpr, HAS_SINKS: gl.constexpr, HAS_LSE: gl.constexpr,
):  # fmt: skip
    """The sinks, the normalization, the stores of this warpgroup's valid rows and the tile's
    non-finite flag."""
    ROWS: gl.constexpr = TOKENS * HEADS
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    local = wg * TOKENS + r // HEADS  # token in the tile
    heads = head0 + r % HEADS
    row_ok = t0 + local < seqlen
    m_o = gl.convert_layout(m_i, gl.SliceLayout(1, o_layout))
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))

    # Non-finite rows send the tile to the exact fix-up launch (`_fixup.py`).
    row_sum = gl.sum(acc, 1)
    bad = row_ok & ((gl.abs(row_sum) < float("inf")) == 0)
    gl.store(flag + gl.zeros_like(r), gl.full_like(r, 1).to(gl.int8), mask=bad)

    if HAS_SINKS:
        # The sink term 2^sink joins the denominator once; the limits as `merge_sink`.
        sink = gl.load(Sinks + heads).to(gl.float32) * LOG2E
        m_fin = gl.maximum(m_o, sink)
        m_fin = gl.where(m_fin == float("-inf"), 0.0, m_fin)
        alpha = gl.exp2(m_o - m_fin)
        l_fin = l_o * alpha + gl.exp2(gl.where(sink == m_fin, 0.0, sink - m_fin))
        acc = acc * (alpha / gl.where(l_fin == 0.0, 1.0, l_fin))[:, None]
    else:
        m_fin = m_o
        l_fin = l_o
        acc = acc / gl.where(l_fin == 0.0, 1.0, l_fin)[:, None]

    # 64-bit tile base, 32-bit offsets inside the tile: no overflow at any length.
    tile0 = (start + t0).to(gl.int64)
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    out_rows = Out + tile0 * stride_ot + local * stride_ot + heads * stride_oh
    gl.store(
        out_rows[:, None] + offs_d[None, :], acc.to(Out.dtype.element_ty), mask=row_ok[:, None]
    )
    if HAS_LSE:
        lse = (m_fin + gl.log2(l_fin)) * LN2
        gl.store(Lse + tile0 * stride_lt + local * stride_lt + heads, lse, mask=row_ok)


@gluon.jit
def _consumer_partition(
    wg, q_smem, k_smem, v_smem, q_ready, q_empty, kv_ready, kv_empty, Out, Lse, Sinks,
    CuSeqlens, Flags, qk_scale, num_m_blocks, num_head_tiles, num_seqs, num_tokens,
    num_fix_blocks, stride_ot, stride_oh, stride_lt, HEADS: gl.constexpr, TOKENS: gl.constexpr,
    HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    HAS_SINKS: gl.constexpr, HAS_LSE: gl.constexpr,
):  # fmt: skip
    """Consumer warpgroup `wg`: the 64 rows (TOKENS tokens x HEADS heads) it owns in each of
    the program's tiles, in the producer's order."""
    ROWS: gl.constexpr = TOKENS * HEADS
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    num_tiles = num_m_blocks * num_head_tiles * num_seqs
    n = 0
    it = 0
    for i in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        seq, pid_h, start, seqlen, t0 = _tile(
            i, num_m_blocks, num_head_tiles, num_seqs, CuSeqlens, num_tokens, 3 * TOKENS
        )
        if t0 < seqlen:
            slot = n % 2
            num_blocks = gl.cdiv(gl.minimum(t0 + 3 * TOKENS, seqlen), BLOCK_N)
            q = q_smem.index(3 * slot + wg).reshape([ROWS, HEAD_DIM])
            mbarrier.wait(q_ready.index(slot), (n // 2) & 1)
            acc, m_i, l_i = _attend_tile(
                wg, q, k_smem, v_smem, kv_ready, kv_empty, it, num_blocks, t0, qk_scale, HEADS,
                TOKENS, HEAD_DIM, BLOCK_N, STAGES, s_layout, o_layout, p_layout,
                Out.dtype.element_ty,
            )  # fmt: skip
            mbarrier.arrive(q_empty.index(slot), count=1)
            _store_tile(
                acc, m_i, l_i, wg, Out, Lse, Sinks, Flags + (num_fix_blocks - 1 - (t0 // TOKENS + wg)) + num_fix_blocks * (pid_h + num_head_tiles * seq), start, t0, seqlen,
                pid_h * HEADS, stride_ot, stride_oh, stride_lt, HEADS, TOKENS, HEAD_DIM,
                o_layout, HAS_SINKS, HAS_LSE,
            )  # fmt: skip
            it += num_blocks
            n += 1


@gluon.jit
def _prefill_sm90_kernel(
    q_desc, k_desc, v_desc, Out, Lse, Sinks, CuSeqlens, Flags,
    qk_scale, num_m_blocks, num_head_tiles, num_seqs, num_tokens, num_fix_blocks, stride_ot,
    stride_oh, stride_lt, GROUP: gl.constexpr, HEADS: gl.constexpr, HEAD_DIM: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_SINKS: gl.constexpr,
    HAS_LSE: gl.constexpr,
):  # fmt: skip
    """Persistent: program p runs tiles p, p + programs, ... of `_tile`'s schedule."""
    TOKENS: gl.constexpr = 64 // HEADS
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [6] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(
        k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout
    )
    v_smem = gl.allocate_shared_memory(
        v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout
    )
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=3)
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=3)
    gl.warp_specialize(
        [
            (
                _load_partition,
                (
                    q_desc,
                    k_desc,
                    v_desc,
                    q_smem,
                    k_smem,
                    v_smem,
                    q_ready,
                    q_empty,
                    kv_ready,
                    kv_empty,
                    CuSeqlens,
                    num_m_blocks,
                    num_head_tiles,
                    num_seqs,
                    num_tokens,
                    GROUP,
                    HEADS,
                    TOKENS,
                    BLOCK_N,
                    STAGES,
                ),
            ),
            (
                _consumer_partition,
                (
                    0,
                    q_smem,
                    k_smem,
                    v_smem,
                    q_ready,
                    q_empty,
                    kv_ready,
                    kv_empty,
                    Out,
                    Lse,
                    Sinks,
                    CuSeqlens,
                    Flags,
                    qk_scale,
                    num_m_blocks,
                    num_head_tiles,
                    num_seqs,
                    num_tokens,
                    num_fix_blocks,
                    stride_ot,
                    stride_oh,
                    stride_lt,
                    HEADS,
                    TOKENS,
                    HEAD_DIM,
                    BLOCK_N,
                    STAGES,
                    HAS_SINKS,
                    HAS_LSE,
                ),
            ),
            (
                _consumer_partition,
                (
                    1,
                    q_smem,
                    k_smem,
                    v_smem,
                    q_ready,
                    q_empty,
                    kv_ready,
                    kv_empty,
                    Out,
                    Lse,
                    Sinks,
                    CuSeqlens,
                    Flags,
                    qk_scale,
                    num_m_blocks,
                    num_head_tiles,
                    num_seqs,
                    num_tokens,
                    num_fix_blocks,
                    stride_ot,
                    stride_oh,
                    stride_lt,
                    HEADS,
                    TOKENS,
                    HEAD_DIM,
                    BLOCK_N,
                    STAGES,
                    HAS_SINKS,
                    HAS_LSE,
                ),
            ),
            (
                _consumer_partition,
                (
                    2,
                    q_smem,
                    k_smem,
                    v_smem,
                    q_ready,
                    q_empty,
                    kv_ready,
                    kv_empty,
                    Out,
                    Lse,
                    Sinks,
                    CuSeqlens,
                    Flags,
                    qk_scale,
                    num_m_blocks,
                    num_head_tiles,
                    num_seqs,
                    num_tokens,
                    num_fix_blocks,
                    stride_ot,
                    stride_oh,
                    stride_lt,
                    HEADS,
                    TOKENS,
                    HEAD_DIM,
                    BLOCK_N,
                    STAGES,
                    HAS_SINKS,
                    HAS_LSE,
                ),
            ),
        ],  # fmt: skip
        [4, 4, 4],
        [REGS, REGS, REGS],
    )


def _descriptor(x: torch.Tensor, block: list[int]) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPE[x.dtype])
    return TensorDescriptor(x, list(x.shape), list(x.stride()), block, layout)


_GL_DTYPE = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def mha_prefill(
    q, k, v, *, cu_seqlens, max_seqlen, causal, window_left, sinks, softmax_scale, out, lse
):
    """Causal ragged self-attention, the contract of `prefill.mha_prefill` (q [T, Hq, D], k/v
    [T, Hkv, D], ...); the request arrives validated and within `supports`."""
    num_seqs = cu_seqlens.shape[0] - 1
    if q.shape[0] == 0 or num_seqs == 0 or max_seqlen == 0:
        return
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    group = num_q_heads // k.shape[1]
    heads = FIXUP_CONFIG.packing(group)
    tokens = ROWS_PER_WARPGROUP // heads
    num_m_blocks = triton.cdiv(max_seqlen, CONSUMERS * tokens)
    # Flags per warpgroup slice: the fix-up runs the Triton kernel on 64-row tiles.
    grid = (triton.cdiv(max_seqlen, tokens), num_q_heads // heads, num_seqs)
    num_flags = grid[0] * grid[1] * grid[2]
    flags = tile_flags(q.device, num_flags)
    if not _tma_ready(q, k, v):
        # Views TMA cannot address (odd offsets or strides): the cp.async kernel reads them.
        prefill.mha_prefill(
            q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, causal=causal,
            window_left=window_left, sinks=sinks, softmax_scale=softmax_scale, out=out, lse=lse,
        )  # fmt: skip
        return
    if out.data_ptr() == q.data_ptr():
        q = q.clone()  # the fix-up reads q after the fast launch wrote out
    programs = min(num_m_blocks * grid[1] * num_seqs, platform_of(q.device).sm_count)
    _prefill_sm90_kernel[(programs,)](
        _descriptor(q, [tokens, heads, head_dim]),
        _descriptor(k, [block_n(head_dim), 1, head_dim]),
        _descriptor(v, [block_n(head_dim), 1, head_dim]),
        out, out if lse is None else lse, q if sinks is None else sinks, cu_seqlens, flags,
        softmax_scale * LOG2E.value, num_m_blocks, grid[1], num_seqs, q.shape[0], grid[0],
        *out.stride()[:2], 0 if lse is None else lse.stride(0),
        GROUP=group, HEADS=heads, HEAD_DIM=head_dim, BLOCK_N=block_n(head_dim), STAGES=STAGES,
        HAS_SINKS=sinks is not None, HAS_LSE=lse is not None, num_warps=4,
    )  # fmt: skip
    args = prefill.launch_args(
        q, k, v, out, lse, sinks, cu_seqlens, flags, softmax_scale, window_left, grid
    )
    meta = launch_meta(FIXUP_CONFIG, group, head_dim, False, sinks is not None, lse is not None)
    prefill.fix_flagged_tiles(args, meta, True, q.device, num_flags)


def _tma_ready(*tensors: torch.Tensor) -> bool:
    """TMA descriptors need 16-byte aligned bases and strides (the last dim contiguous)."""
    for x in tensors:
        size = x.element_size()
        if x.data_ptr() % 16 or any(s * size % 16 for s in x.stride()[:-1]):
            return False
    return True


# GPT-OSS-like structure (GQA 8, sinks, lse), bf16 at hd 64 and 128, and fp16 once.
_AOT_CASE = dict(GPT_OSS_AOT_CASE, seqlens=(128,), num_q_heads=16, num_kv_heads=2)
AOT_CASES = (_AOT_CASE, dict(_AOT_CASE, head_dim=128), dict(_AOT_CASE, dtype=torch.float16))


def register() -> None:
    register_kernel(
        "mha_prefill",
        name=KERNEL_NAME,
        backend="triton",
        platforms=["nvidia:sm_90"],
        traits=dict(
            dtype=HALF, kv_dtype=HALF, head_dim=HEAD_DIMS, gqa_ratio=ANY, sinks=True, lse=True
        ),
        priority=90,
        description="causal; Gluon, TMA producer warp feeding two warpgroups that overlap "
        "their softmax with their own wgmmas",
        aot_cases=AOT_CASES,
    )(mha_prefill)
