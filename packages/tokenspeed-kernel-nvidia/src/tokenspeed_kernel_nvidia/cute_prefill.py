"""`mha_prefill` written with the CuTe DSL: causal self-attention for GPT-OSS's full-context
layers on Hopper (bf16, head dim 64, any GQA grouping, sinks, lse).

Why: at long sequences FA3 leads our Triton prefill, and what separates a Hopper prefill
from the tensor cores' rate is the softmax's per-score FP32 work (FFMA for scale and shift,
FADD for the row sum, FMNMX for the row max), which does not run under the other warpgroups'
wgmmas (docs/decisions.md, issue 21). Here:

- Scores are not shifted by a running max: p = 2^(s * scale * log2 e) is exact in float32
  and bf16 (both have 8 exponent bits) while a row's sum of p stays within [2^-64, 2^64].
  Online softmax subtracts the max only to stay in range; o / l is the same either way. So
  there is no row max, no rescale, and the scale is one FMUL (folding it into Q in bf16
  would cost Q's rounding on every product of the scores, which grows with the logits).
- Row sums are float32 adds, in four chains per row. A wgmma of P against a tile of ones
  instead took longer (H100, S=8192x2: 2.248 against 2.183 ms) and rounds p to bf16.

Per score: an FMUL, an exponential, an add and half a bf16x2 pack (plus a compare and a
select on the diagonal's blocks). A row whose key sum leaves the range (scores past about
64 in exp2's units), or whose output is not finite, lists its tile; a second launch, one CTA
per SM, walks the list and computes those tiles again with the max-shifted online softmax,
writing every row of them. With nothing listed its CTAs read the count and exit. (Both
passes in one kernel made ptxas serialize every wgmma: too few registers at 512 threads.)

A CTA is one producer warpgroup (cp.async into a 3-stage K/V ring, mbarriers) and three
consumer warpgroups of 64 query rows each (192 rows), ping-ponging their wgmmas through
named barriers. S_j is issued before P_{j-1} V_{j-1}, so its exponentials run while that
multiplies. Key blocks are 128; the grid is (heads, row blocks, sequences): longest row
blocks first, one sequence at a time, so that the CTAs in flight share one sequence's K and V
in L2. The DSL is needed only to compile (see `_cute_runtime`).
"""

# No `from __future__ import annotations`: the DSL evaluates the kernels' annotations in the
# module's globals, where `cute` (imported lazily, in `_dsl`) is not.
import functools
import math

import torch

from tokenspeed_kernel.registry import ANY, Support, register_kernel

from . import _cute_runtime as rt

KERNEL_NAME = "cute.mha_prefill"
HEAD_DIM = 64
CONSUMERS = 3  # warpgroups of 64 query rows
BLOCK_M = 64 * CONSUMERS
BLOCK_N = 128  # keys per block
STAGES = 3
THREADS = 128 * (CONSUMERS + 1)
PRODUCER_REGS = 32
CONSUMER_REGS = 160
LOG2E = math.log2(math.e)
# The unshifted pass is exact while a row's key sum l = sum 2^s stays within [2^-64, 2^64]:
# its largest term is then at least 2^-81 (l / 2^17 keys, bounded by int32 offsets well
# before p underflows), so the terms flushed below 2^-126 are negligible, and p, l and o stay
# far from float32's 2^128 (outputs are checked finite too).
SUM_LOW = 2.0**-64
SUM_HIGH = 2.0**64
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "f32"}


def smem_bytes() -> int:
    """Q tile, the K and V rings, and slack for the mbarriers, the redo flag and the
    allocator's 1024-byte alignment of each tile."""
    q_tile = BLOCK_M * HEAD_DIM * 2
    kv_rings = 2 * STAGES * BLOCK_N * HEAD_DIM * 2
    return q_tile + kv_rings + 4 * 1024


@functools.cache
def _dsl():
    """The kernel and its host launcher, built on first use (imports the DSL, about 3 s)."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as hh
    from cutlass import BFloat16, Float32, Int32, Int64
    from cutlass.cute.nvgpu import cpasync, warpgroup
    from cutlass.utils import LayoutEnum

    try:  # DSL 4.8 moved it (the old name still works there, with a DeprecationWarning)
        from cutlass.memory import SmemAllocator
    except ImportError:
        from cutlass.utils import SmemAllocator

    neg_inf = float("-inf")
    ln2 = math.log(2.0)
    # Named barriers: 0 is the CTA's; 1..3 the consumers' ping-pong; 4 the tile's end, where
    # the consumers tell the producer whether to redo the tile.
    pingpong = 1
    tile_end = 1 + CONSUMERS

    def tile_layout(rows, stages):
        atom = warpgroup.make_smem_layout_atom(
            hh.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, BFloat16, HEAD_DIM), BFloat16
        )
        if stages is None:
            return cute.tile_to_shape(atom, (rows, HEAD_DIM), order=(0, 1))
        return cute.tile_to_shape(atom, (rows, HEAD_DIM, stages), order=(0, 1, 2))

    @cute.jit
    def gemm(tiled_mma, acc, t_a, t_b, zero_init: cutlass.Constexpr):
        warpgroup.fence()
        atom = cute.make_mma_atom(tiled_mma.op)
        atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
        for kk in cutlass.range_constexpr(cute.size(t_a.shape[2])):
            cute.gemm(atom, acc, t_a[None, None, kk], t_b[None, None, kk], acc)
            atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def release(bar, lane):
        if lane == 0:
            cute.arch.mbarrier_arrive(bar)

    def row_cols(acc):
        """The accumulator indices of this thread's two rows (wgmma's C layout)."""
        n = cute.size(acc) // 4
        return [[e + 2 * i + 4 * j for j in range(n) for e in range(2)] for i in range(2)]

    def mask(acc_S, tScS, m_block, seqlen, key_block):
        # Causal, equal q/k lengths: row r sees keys [0, r]; keys past the sequence (read at
        # its last row's address) are masked too. In wgmma's accumulator layout a thread's
        # element e + 2i + 4j sits in row i (of its two) and column 8j + e past its first, so
        # one threshold per row leaves a compare with an immediate and a select per score.
        col0 = key_block * BLOCK_N + tScS[0][1]
        for cols in row_cols(acc_S):
            limit = cutlass.min(m_block * BLOCK_M + tScS[cols[0]][0] + 1, seqlen) - col0
            for idx in cols:
                hidden = limit <= 8 * (idx // 4) + idx % 2
                acc_S[idx] = Float32(cutlass.select_(hidden, Float32(neg_inf), acc_S[idx]))

    def scale_rows(acc, alphas):
        for i, cols in enumerate(row_cols(acc)):
            for idx in cols:
                acc[idx] = acc[idx] * alphas[i]

    def exp2_scores(acc_S, row_max, row_sum, acc_O, scale_log2, SHIFTED):
        """acc_S (raw scores q.k) becomes p, and this thread's row sums take its p.
        Unshifted: p = 2^(s * scale * log2 e). Shifted: online softmax, p = 2^((s - m) *
        scale * log2 e) with m the running row max, o and the sums rescaled."""
        fmax = cute.arch.fmax
        alphas = []
        for i, cols in enumerate(row_cols(acc_S)):
            shift = Float32(0.0)
            if SHIFTED:
                block_max = acc_S[cols[0]]
                for idx in cols:
                    block_max = fmax(block_max, acc_S[idx])
                block_max = fmax(block_max, cute.arch.shuffle_sync_bfly(block_max, 1))
                block_max = fmax(block_max, cute.arch.shuffle_sync_bfly(block_max, 2))
                m_new = fmax(row_max[i], block_max)
                # A row that has seen no key keeps m = -inf: shift by 0, so 2^-inf = 0.
                shift = Float32(cutlass.select_(m_new == neg_inf, Float32(0.0), m_new * scale_log2))
                alphas.append(cute.math.exp2(row_max[i] * scale_log2 - shift, fastmath=True))
                row_max[i] = m_new
            # Four chains of adds rather than one: a quarter of the latency between them.
            partial = [Float32(0.0)] * 4
            for n, idx in enumerate(cols):
                if SHIFTED:
                    acc_S[idx] = cute.math.exp2(acc_S[idx] * scale_log2 - shift, fastmath=True)
                else:
                    acc_S[idx] = cute.math.exp2(acc_S[idx] * scale_log2, fastmath=True)
                partial[n % 4] = partial[n % 4] + acc_S[idx]
            total = (partial[0] + partial[1]) + (partial[2] + partial[3])
            row_sum[i] = row_sum[i] * alphas[i] + total if SHIFTED else row_sum[i] + total
        if SHIFTED:
            scale_rows(acc_O, alphas)

    def tile_of(
        t, block, redo_tiles, cu_seqlens, num_tokens, num_m_blocks, num_q_heads, batch, REDO
    ):
        """(head, sequence, row block, sequence start, length, key blocks, masked blocks) of
        the first launch's tile (its block index) or of the redo launch's list entry t."""
        h, b, m_block = block[0], block[2], num_m_blocks - 1 - block[1]
        if REDO:
            code = cute.make_tensor(redo_tiles + t, cute.make_layout(1))[0]
            h = code % num_q_heads
            b = (code // num_q_heads) % batch
            m_block = code // num_q_heads // batch
        # Offsets clamped into [0, T]; a sequence that ends before it starts is empty.
        cu = cute.make_tensor(cu_seqlens + b, cute.make_layout(2))
        seq_start = cutlass.max(cutlass.min(cu[0], num_tokens), 0)
        seqlen = cutlass.max(cutlass.min(cu[1], num_tokens), 0) - seq_start
        # Key blocks [0, n_blocks), the diagonal's first; from n_masked on unmasked.
        n_blocks = (cutlass.min((m_block + 1) * BLOCK_M, seqlen) + BLOCK_N - 1) // BLOCK_N
        n_masked = n_blocks - (m_block * BLOCK_M) // BLOCK_N
        return h, b, m_block, seq_start, seqlen, n_blocks, n_masked

    @cute.jit
    def produce(
        atom, tKs, tVs, k, v, mbars, base, n_blocks, seq_start, last, hk, prow, pcol,
        stride_kt, stride_kh, stride_vt, stride_vh, FIRST: cutlass.Constexpr,
    ):  # fmt: skip
        """One pass of the producer over the tile's key blocks, the diagonal's first: K_j and
        V_j into ring slot (base + j) % STAGES, each announced once the copy group after it is
        issued (cp.async groups complete in order)."""
        q_full, k_full, k_empty, v_full, v_empty = mbars
        for i in cutlass.range(n_blocks, unroll=1):
            it = base + i
            nb = n_blocks - 1 - i
            s = it % STAGES
            ph = (it // STAGES) % 2
            cute.arch.mbarrier_wait(k_empty + s, ph ^ 1)
            for r in cutlass.range_constexpr(BLOCK_N // 16):
                # Rows past the sequence read its last row (never outside it), then masked.
                row = cutlass.min(nb * BLOCK_N + r * 16 + prow, last)
                off = Int64(seq_start + row) * stride_kt + Int64(hk) * stride_kh + pcol
                dst = tKs[None, r, 0, s]
                src = cute.make_tensor(k + cute.assume(off, divby=8), cute.make_layout(dst.shape))
                cute.copy(atom, src, dst)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(1)
            cute.arch.fence_view_async_shared()
            if i > 0:
                cute.arch.mbarrier_arrive(v_full + (it - 1) % STAGES)
            elif cutlass.const_expr(FIRST):
                cute.arch.mbarrier_arrive(q_full)
            cute.arch.mbarrier_wait(v_empty + s, ph ^ 1)
            for r in cutlass.range_constexpr(BLOCK_N // 16):
                row = cutlass.min(nb * BLOCK_N + r * 16 + prow, last)
                off = Int64(seq_start + row) * stride_vt + Int64(hk) * stride_vh + pcol
                dst = tVs[None, r, 0, s]
                src = cute.make_tensor(v + cute.assume(off, divby=8), cute.make_layout(dst.shape))
                cute.copy(atom, src, dst)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(1)
            cute.arch.fence_view_async_shared()
            cute.arch.mbarrier_arrive(k_full + s)
        cute.arch.cp_async_wait_group(0)
        cute.arch.fence_view_async_shared()
        cute.arch.mbarrier_arrive(v_full + (base + n_blocks - 1) % STAGES)

    @cute.kernel
    def prefill_kernel(
        q: cute.Pointer,
        k: cute.Pointer,
        v: cute.Pointer,
        out: cute.Pointer,
        cu_seqlens: cute.Pointer,
        sinks: cute.Pointer,
        lse: cute.Pointer,
        redo_count: cute.Pointer,
        redo_tiles: cute.Pointer,
        stride_qt: Int64,
        stride_qh: Int64,
        stride_kt: Int64,
        stride_kh: Int64,
        stride_vt: Int64,
        stride_vh: Int64,
        stride_ot: Int64,
        stride_oh: Int64,
        stride_lt: Int64,
        stride_lh: Int64,
        num_tokens: Int32,
        num_m_blocks: Int32,
        num_q_heads: Int32,
        batch: Int32,
        group: Int32,
        scale_log2: Float32,
        HAS_SINKS: cutlass.Constexpr,
        HAS_LSE: cutlass.Constexpr,
        REDO: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, bz = cute.arch.block_idx()
        grid_x, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = warp // 4
        lane = tidx % 32
        SHIFTED = REDO

        smem = SmemAllocator()
        mbar = smem.allocate_array(Int64, 1 + 4 * STAGES)
        q_full, k_full, k_empty, v_full, v_empty = (
            mbar, mbar + 1, mbar + 1 + STAGES, mbar + 1 + 2 * STAGES, mbar + 1 + 3 * STAGES
        )  # fmt: skip
        flag = smem.allocate_array(Int32, 1)
        lq = tile_layout(BLOCK_M, None)
        lkv = tile_layout(BLOCK_N, STAGES)
        sQ = smem.allocate_tensor(BFloat16, lq.outer, 1024, lq.inner)
        sK = smem.allocate_tensor(BFloat16, lkv.outer, 1024, lkv.inner)
        sV = smem.allocate_tensor(BFloat16, lkv.outer, 1024, lkv.inner)
        cute.arch.fence_view_async_shared()
        if tidx == 0:
            flag[0] = Int32(0)
            cute.arch.mbarrier_init(q_full, 128)
            for s in cutlass.range_constexpr(STAGES):
                cute.arch.mbarrier_init(k_full + s, 128)
                cute.arch.mbarrier_init(v_full + s, 128)
                cute.arch.mbarrier_init(k_empty + s, 4 * CONSUMERS)
                cute.arch.mbarrier_init(v_empty + s, 4 * CONSUMERS)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # The first launch runs its grid's one tile (heads, row blocks longest first,
        # sequences). The redo launch (REDO) loops over the tiles the first one listed, shifted;
        # the producer and the consumers walk the same list, their ring counts carried along.
        first = Int32(0)
        todo = Int32(1)
        step = Int32(1)
        if cutlass.const_expr(REDO):
            first = bx
            todo = cute.make_tensor(redo_count, cute.make_layout(1))[0]
            step = grid_x

        if wg == 0:
            # ---- producer: 128 threads of cp.async, 16 bytes each ----
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            atom = cute.make_copy_atom(
                cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                BFloat16,
                num_bits_per_copy=128,
            )
            tiled = cute.make_tiled_copy_tv(
                atom, cute.make_layout((16, 8), stride=(8, 1)), cute.make_layout((1, 8))
            )
            thr = tiled.get_slice(tidx)
            tQs = thr.partition_D(sQ)
            t = first
            base = Int32(0)  # key blocks streamed before this tile: the ring's count
            while t < todo:
                h, b, m_block, seq_start, seqlen, n_blocks, n_masked = tile_of(
                    t,
                    (bx, by, bz),
                    redo_tiles,
                    cu_seqlens,
                    num_tokens,
                    num_m_blocks,
                    num_q_heads,
                    batch,
                    REDO,
                )
                hk = h // group
                if m_block * BLOCK_M < seqlen:
                    prow = tidx // 8
                    pcol = (tidx % 8) * 8
                    last = seqlen - 1
                    for r in cutlass.range_constexpr(BLOCK_M // 16):
                        row = cutlass.min(m_block * BLOCK_M + r * 16 + prow, last)
                        off = Int64(seq_start + row) * stride_qt + Int64(h) * stride_qh + pcol
                        dst = tQs[None, r, 0]
                        src = cute.make_tensor(
                            q + cute.assume(off, divby=8), cute.make_layout(dst.shape)
                        )
                        cute.copy(atom, src, dst)
                    cute.arch.cp_async_commit_group()
                    produce(
                        atom, thr.partition_D(sK), thr.partition_D(sV), k, v,
                        (q_full, k_full, k_empty, v_full, v_empty), base, n_blocks, seq_start,
                        last, hk, prow, pcol, stride_kt, stride_kh, stride_vt, stride_vh, True,
                    )  # fmt: skip
                if cutlass.const_expr(REDO):
                    # Q's slot is refilled for the next tile once the consumers are done.
                    cute.arch.barrier(barrier_id=tile_end, number_of_threads=THREADS)
                base = base + n_blocks
                t = t + step
        else:
            # ---- consumers: three warpgroups of 64 query rows ----
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            ctid = tidx - 128
            cw = wg - 1
            tiled_qk = hh.make_trivial_tiled_mma(
                BFloat16, BFloat16, warpgroup.OperandMajorMode.K,
                warpgroup.OperandMajorMode.K, Float32, (CONSUMERS, 1, 1), (64, BLOCK_N),
            )  # fmt: skip
            tiled_pv = hh.make_trivial_tiled_mma(
                BFloat16, BFloat16, warpgroup.OperandMajorMode.K,
                warpgroup.OperandMajorMode.MN, Float32, (CONSUMERS, 1, 1), (64, HEAD_DIM),
                a_source=warpgroup.OperandSource.RMEM,
            )  # fmt: skip
            wg_layout = cute.make_layout(CONSUMERS, stride=128)
            wg_qk = tiled_qk.get_slice(wg_layout(cw))
            wg_pv = tiled_pv.get_slice(wg_layout(cw))
            thr_qk = tiled_qk.get_slice(ctid)
            thr_pv = tiled_pv.get_slice(ctid)
            sVt = cute.composition(
                sV, cute.make_ordered_layout((HEAD_DIM, BLOCK_N, STAGES), order=(1, 0, 2))
            )
            tSrQ = wg_qk.make_fragment_A(wg_qk.partition_A(sQ))
            tSrK = wg_qk.make_fragment_B(wg_qk.partition_B(sK))
            tOrV = wg_pv.make_fragment_B(wg_pv.partition_B(sVt))
            tScS = thr_qk.partition_C(cute.make_identity_tensor((BLOCK_M, BLOCK_N)))
            tOrP = wg_pv.make_fragment_A(wg_pv.partition_shape_A((BLOCK_M, BLOCK_N)))
            tOcO = thr_pv.partition_C(cute.make_identity_tensor((BLOCK_M, HEAD_DIM)))
            acc_S = cute.make_rmem_tensor(wg_qk.partition_shape_C((BLOCK_M, BLOCK_N)), Float32)
            acc_O = cute.make_rmem_tensor(wg_pv.partition_shape_C((BLOCK_M, HEAD_DIM)), Float32)
            row_max = cute.make_rmem_tensor(2, Float32)
            row_sum = cute.make_rmem_tensor(2, Float32)
            n_o = cute.size(acc_O) // 4
            fmax = cute.arch.fmax
            turn = pingpong + cw
            after = pingpong + (cw + 1) % CONSUMERS
            t = first
            done = Int32(0)  # tiles this warpgroup finished: Q's mbarrier phase
            base = Int32(0)
            while t < todo:
                h, b, m_block, seq_start, seqlen, n_blocks, n_masked = tile_of(
                    t,
                    (bx, by, bz),
                    redo_tiles,
                    cu_seqlens,
                    num_tokens,
                    num_m_blocks,
                    num_q_heads,
                    batch,
                    REDO,
                )
                if m_block * BLOCK_M < seqlen:
                    sink_log2 = Float32(neg_inf)
                    if cutlass.const_expr(HAS_SINKS):
                        sink_log2 = (
                            Float32(cute.make_tensor(sinks + h, cute.make_layout(1))[0]) * LOG2E
                        )
                    acc_O.fill(0.0)
                    for i in cutlass.range_constexpr(2):
                        row_max[i] = neg_inf
                        row_sum[i] = 0.0
                    cute.arch.mbarrier_wait(q_full, done % 2)
                    if done == 0:
                        if cw == 0:
                            # Warpgroup 0 goes first; then each one's arrival lets the next
                            # issue (on the CTA's next tile, the last one's final arrival).
                            cute.arch.barrier_arrive(barrier_id=pingpong, number_of_threads=256)

                    # The first block: the diagonal's, always masked.
                    s0 = base % STAGES
                    cute.arch.mbarrier_wait(k_full + s0, (base // STAGES) % 2)
                    cute.arch.barrier(barrier_id=turn, number_of_threads=256)
                    gemm(tiled_qk, acc_S, tSrQ, tSrK[None, None, None, s0], True)
                    cute.arch.barrier_arrive(barrier_id=after, number_of_threads=256)
                    warpgroup.wait_group(0)
                    release(k_empty + s0, lane)
                    mask(acc_S, tScS, m_block, seqlen, n_blocks - 1)
                    exp2_scores(acc_S, row_max, row_sum, acc_O, scale_log2, SHIFTED)
                    tOrP.store(acc_S.load().to(BFloat16))

                    for i in cutlass.range(1, n_blocks, unroll=1):
                        it = base + i
                        sp = (it - 1) % STAGES
                        s = it % STAGES
                        cute.arch.mbarrier_wait(v_full + sp, ((it - 1) // STAGES) % 2)
                        cute.arch.mbarrier_wait(k_full + s, (it // STAGES) % 2)
                        cute.arch.barrier(barrier_id=turn, number_of_threads=256)
                        if cutlass.const_expr(SHIFTED):
                            gemm(tiled_pv, acc_O, tOrP, tOrV[None, None, None, sp], False)
                            gemm(tiled_qk, acc_S, tSrQ, tSrK[None, None, None, s], True)
                            cute.arch.barrier_arrive(barrier_id=after, number_of_threads=256)
                            warpgroup.wait_group(0)
                            release(k_empty + s, lane)
                        else:
                            # S_j first: its exponentials run while P_{j-1} V_{j-1} multiplies.
                            gemm(tiled_qk, acc_S, tSrQ, tSrK[None, None, None, s], True)
                            gemm(tiled_pv, acc_O, tOrP, tOrV[None, None, None, sp], False)
                            cute.arch.barrier_arrive(barrier_id=after, number_of_threads=256)
                            warpgroup.wait_group(1)
                            release(k_empty + s, lane)
                        if i < n_masked:
                            mask(acc_S, tScS, m_block, seqlen, n_blocks - 1 - i)
                        if cutlass.const_expr(SHIFTED):
                            # Rescaling o waits for the wgmmas accumulating it.
                            warpgroup.wait_group(0)
                            release(v_empty + sp, lane)
                            exp2_scores(acc_S, row_max, row_sum, acc_O, scale_log2, SHIFTED)
                        else:
                            exp2_scores(acc_S, row_max, row_sum, acc_O, scale_log2, SHIFTED)
                            warpgroup.wait_group(0)
                            release(v_empty + sp, lane)
                        tOrP.store(acc_S.load().to(BFloat16))

                    it = base + n_blocks - 1
                    sl = it % STAGES
                    cute.arch.mbarrier_wait(v_full + sl, (it // STAGES) % 2)
                    cute.arch.barrier(barrier_id=turn, number_of_threads=256)
                    gemm(tiled_pv, acc_O, tOrP, tOrV[None, None, None, sl], False)
                    cute.arch.barrier_arrive(barrier_id=after, number_of_threads=256)
                    warpgroup.wait_group(0)
                    release(v_empty + sl, lane)

                    # o / (l + sink term) as bf16 rows straight to global memory (and lse).
                    bad = Int32(0)
                    for i in cutlass.range_constexpr(2):
                        # The row's sum over the four threads that share it.
                        key_sum = row_sum[i]
                        key_sum = key_sum + cute.arch.shuffle_sync_bfly(key_sum, 1)
                        key_sum = key_sum + cute.arch.shuffle_sync_bfly(key_sum, 2)
                        top = Float32(0.0)
                        if cutlass.const_expr(SHIFTED):
                            # Shifted sums are relative to the keys' max m; the sink may be
                            # far above it: scale both to the larger, top.
                            keys_max = row_max[i] * scale_log2  # -inf: no key seen
                            top = fmax(keys_max, sink_log2)
                            top = Float32(cutlass.select_(top == neg_inf, Float32(0.0), top))
                            key_scale = cute.math.exp2(keys_max - top, fastmath=True)
                            denom = key_sum * key_scale + cute.math.exp2(
                                sink_log2 - top, fastmath=True
                            )
                        else:
                            key_scale = Float32(1.0)
                            denom = key_sum + cute.math.exp2(sink_log2, fastmath=True)
                        # No key and no sink: zeros (and lse -inf), not 0 / 0.
                        inv = Float32(cutlass.select_(denom > 0.0, key_scale / denom, Float32(0.0)))
                        # The unshifted pass is exact where the key sum and the sink term are
                        # in range and the outputs finite (checked below); else the redo.
                        ok = (
                            (key_sum >= SUM_LOW) & (key_sum <= SUM_HIGH) & (denom < Float32(3.0e38))
                        )
                        row = m_block * BLOCK_M + tOcO[2 * i][0]
                        if row < seqlen:
                            base_o = Int64(seq_start + row) * stride_ot + Int64(h) * stride_oh
                            for j in cutlass.range_constexpr(n_o):
                                pair = cute.make_rmem_tensor(2, Float32)
                                pair[0] = acc_O[2 * i + 4 * j] * inv
                                pair[1] = acc_O[1 + 2 * i + 4 * j] * inv
                                size = fmax(fmax(pair[0], -pair[0]), fmax(pair[1], -pair[1]))
                                ok = ok & (size < Float32(3.0e38))  # false for inf and NaN
                                col = tOcO[2 * i + 4 * j][1]
                                dst = cute.make_tensor(
                                    out + cute.assume(base_o + col, divby=2), cute.make_layout(2)
                                )
                                dst.store(pair.load().to(BFloat16))
                            if cutlass.const_expr(HAS_LSE):
                                if lane % 4 == 0:
                                    value = (top + cute.math.log2(denom, fastmath=True)) * ln2
                                    lse_off = (
                                        Int64(seq_start + row) * stride_lt + Int64(h) * stride_lh
                                    )
                                    cute.make_tensor(lse + lse_off, cute.make_layout(1))[0] = value
                            bad = bad | Int32(cutlass.select_(ok, Int32(0), Int32(1)))
                    if cutlass.const_expr(not REDO):
                        # A row out of the unshifted range: list the tile for the redo launch.
                        if cute.arch.vote_any_sync(bad != 0):
                            if lane == 0:
                                flag[0] = Int32(1)
                        cute.arch.barrier(barrier_id=tile_end, number_of_threads=THREADS - 128)
                        if ctid == 0:
                            if flag[0] != 0:
                                slot = cute.arch.atomic_add(
                                    redo_count, Int32(1), sem="relaxed", scope="gpu"
                                )
                                code = (m_block * batch + b) * num_q_heads + h
                                cute.make_tensor(redo_tiles + slot, cute.make_layout(1))[0] = code
                if cutlass.const_expr(REDO):
                    cute.arch.barrier(barrier_id=tile_end, number_of_threads=THREADS)
                base = base + n_blocks
                done = done + 1
                t = t + step

    @cute.jit
    def host(
        q: cute.Pointer,
        k: cute.Pointer,
        v: cute.Pointer,
        out: cute.Pointer,
        cu_seqlens: cute.Pointer,
        sinks: cute.Pointer,
        lse: cute.Pointer,
        redo_count: cute.Pointer,
        redo_tiles: cute.Pointer,
        stride_qt: Int64,
        stride_qh: Int64,
        stride_kt: Int64,
        stride_kh: Int64,
        stride_vt: Int64,
        stride_vh: Int64,
        stride_ot: Int64,
        stride_oh: Int64,
        stride_lt: Int64,
        stride_lh: Int64,
        num_tokens: Int32,
        num_m_blocks: Int32,
        num_q_heads: Int32,
        batch: Int32,
        group: Int32,
        scale_log2: Float32,
        stream,
        HAS_SINKS: cutlass.Constexpr,
        HAS_LSE: cutlass.Constexpr,
        REDO: cutlass.Constexpr,
    ):
        # The grid here only serves the compile: launches set their own (mha_prefill).
        prefill_kernel(
            q, k, v, out, cu_seqlens, sinks, lse, redo_count, redo_tiles, stride_qt, stride_qh,
            stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lt,
            stride_lh, num_tokens, num_m_blocks, num_q_heads, batch, group, scale_log2,
            HAS_SINKS, HAS_LSE, REDO,
        ).launch(
            grid=[num_q_heads, num_m_blocks, batch], block=[THREADS, 1, 1], smem=smem_bytes(),
            stream=stream,
        )  # fmt: skip

    return cutlass, cute, host


def _compile(sink_dtype, has_lse, redo, arch) -> rt.Cubin:
    cutlass, cute, host = _dsl()
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    types = {torch.bfloat16: cutlass.BFloat16, torch.float32: cutlass.Float32}

    def ptr(dtype, align):
        return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=align)

    rows = ptr(cutlass.BFloat16, 16)  # 16-byte aligned rows: checked at launch
    pointers = [rows, rows, rows, ptr(cutlass.BFloat16, 4), ptr(cutlass.Int32, 4)]
    pointers += [ptr(types[sink_dtype or torch.float32], 4), ptr(cutlass.Float32, 4)]
    pointers += [ptr(cutlass.Int32, 4), ptr(cutlass.Int32, 4)]
    scalars = [cutlass.Int64(1)] * 10 + [cutlass.Int32(1)] * 5 + [cutlass.Float32(1.0)]
    args = [*pointers, *scalars, make_fake_stream(), sink_dtype is not None, has_lse, redo]
    return rt.compile_cubin(host, args, arch)


def build(sink_dtype, has_lse: bool, redo: bool) -> rt.Build:
    """One kernel: the unshifted first launch, or (redo) the shifted launch over the tiles
    the first one listed."""
    sink = _DTYPE_NAMES[sink_dtype] if sink_dtype is not None else "none"
    key = f"prefill-bf16-d{HEAD_DIM}-sink_{sink}-lse{int(has_lse)}-{'redo' if redo else 'main'}"
    return rt.Build(__name__, key, functools.partial(_compile, sink_dtype, has_lse, redo))


_PARAMS = [rt.POINTER] * 9 + [rt.INT64] * 10 + [rt.INT32] * 5 + [rt.FLOAT32]


@functools.cache
def _loaded(sink_dtype, has_lse, redo, arch) -> rt.LoadedKernel:
    cubin = rt.cubin_for(build(sink_dtype, has_lse, redo), arch)
    return rt.LoadedKernel(cubin, _PARAMS, shared_bytes=smem_bytes())


def _rows_aligned(x: torch.Tensor, elements: int) -> bool:
    """Whether x's rows and heads start at multiples of `elements` (and its last dim is
    dense): the kernel reads q/k/v rows 16 bytes at a time and writes out 4 bytes at a time."""
    return (
        x.stride(2) == 1
        and (x.stride(0) | x.stride(1) | (x.data_ptr() // x.element_size())) % elements == 0
    )


def mha_prefill(
    q, k, v, *, cu_seqlens, max_seqlen, causal, window_left, sinks, softmax_scale, out, lse
) -> None:
    """q [T, Hq, 64] bf16, k/v [T, Hkv, 64] bf16 ragged by cu_seqlens [B+1] int32 (clamped
    into [0, T]); writes out [T, Hq, 64] and lse [T, Hq] float32 if given. Causal, no window
    (the traits keep other requests away)."""
    from tokenspeed_kernel.platform import platform_of

    num_tokens, num_q_heads, _ = q.shape
    batch = cu_seqlens.shape[0] - 1
    if num_tokens == 0 or batch <= 0 or max_seqlen <= 0:
        return
    num_m_blocks = -(-max_seqlen // BLOCK_M)
    num_tiles = num_q_heads * batch * num_m_blocks
    # The redo list codes a tile as one int32.
    if batch > 65535 or num_m_blocks > 65535 or num_tiles >= 1 << 31:
        raise ValueError(
            f"{KERNEL_NAME}: {batch} sequences x {num_m_blocks} row blocks of {BLOCK_M} x "
            f"{num_q_heads} heads exceed the grid (65535 per dimension) or int32 tile codes"
        )
    # Views the 16-byte reads cannot serve (fused-QKV slices at odd offsets) are copied:
    # one pass over the tensor, small beside the attention itself.
    q, k, v = (x if _rows_aligned(x, 8) else x.contiguous() for x in (q, k, v))
    target = (
        out
        if _rows_aligned(out, 2)
        else torch.empty_like(out, memory_format=torch.contiguous_format)
    )
    sink_dtype = None
    if sinks is not None:
        if sinks.dtype not in _DTYPE_NAMES:
            sinks = sinks.float()
        sink_dtype = sinks.dtype
    platform = platform_of(q.device)
    arch = rt.compile_arch(platform.arch)
    # The tiles the first launch lists for the shifted redo: their count, then their codes.
    redo = torch.empty(num_tiles + 1, dtype=torch.int32, device=q.device)
    redo[:1].zero_()
    args = [
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        target.data_ptr(),
        cu_seqlens.data_ptr(),
        sinks.data_ptr() if sinks is not None else cu_seqlens.data_ptr(),
        lse.data_ptr() if lse is not None else cu_seqlens.data_ptr(),
        redo.data_ptr(),
        redo.data_ptr() + 4,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        target.stride(0),
        target.stride(1),
        lse.stride(0) if lse is not None else 0,
        lse.stride(1) if lse is not None else 0,
        num_tokens,
        num_m_blocks,
        num_q_heads,
        batch,
        num_q_heads // k.shape[1],
        float(softmax_scale) * LOG2E,
    ]
    has_lse = lse is not None
    first = _loaded(sink_dtype, has_lse, False, arch)
    first.launch_grid(q.device, (num_q_heads, num_m_blocks, batch), THREADS, args)
    # One CTA per SM walks the listed tiles; with none listed each reads the count and exits.
    second = _loaded(sink_dtype, has_lse, True, arch)
    second.launch_grid(q.device, (min(num_tiles, platform.sm_count), 1, 1), THREADS, args)
    if target is not out:
        out.copy_(target)


def supports(request, platform) -> Support:
    arch = rt.compile_arch(platform.arch)
    if arch != "sm_90a":
        return Support.no(f"the kernel's wgmma pipeline is built for sm_90, not {platform.arch}")
    for redo in (False, True):
        build_ = build(torch.float32 if request.sinks else None, request.lse, redo)
        if not rt.available(build_, arch):
            return Support.no(rt.missing_reason(build_, arch))
    return Support.yes()


def cute_builds() -> list[rt.Build]:
    return [
        build(sink_dtype, has_lse, redo)
        for sink_dtype in (None, torch.float32, torch.bfloat16)
        for has_lse in (False, True)
        for redo in (False, True)
    ]


def register() -> None:
    register_kernel(
        "mha_prefill",
        name=KERNEL_NAME,
        backend="cute",
        platforms=["nvidia:sm_90"],
        traits=dict(
            dtype=(torch.bfloat16,),
            kv_dtype=(torch.bfloat16,),
            head_dim=(HEAD_DIM,),
            gqa_ratio=ANY,
            sinks=True,
            lse=True,
        ),
        # Below triton.mha_prefill (100) and FA3 (95): the measured ranking selects it where
        # it leads (long causal sequences).
        priority=85,
        supports=supports,
        description="CuTe DSL causal prefill, unshifted exp2 (shifted redo per tile), hd 64",
    )(mha_prefill)
