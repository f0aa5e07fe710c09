"""Spike: causal prefill attention forward for GPT-OSS (hd 64, 64 q heads, 8 KV heads, sinks)
in the CuTe DSL for sm_90a. cp.async producer warpgroup + 2 consumer warpgroups in ping-pong
(named barriers), SS wgmma for S = Q K^T, RS wgmma for O += P V.

Compiled on a CPU machine to a cubin; launched with the CUDA driver (no TMA descriptors).
"""

import math

HQ, HKV, D = 64, 8, 64
GROUP = HQ // HKV
BM = 128  # query rows per CTA (2 consumer warpgroups x 64)
BN = 128  # keys per block
STAGES = 3
LOG2E = math.log2(math.e)
Q_ROW = HQ * D  # q / out row stride in elements
KV_ROW = HKV * D
THREADS = 384
PRODUCER_REGS = 40
CONSUMER_REGS = 232


def smem_bytes(bm=BM, stages=STAGES):
    tile = bm * D * 2
    kv = BN * D * 2
    return 1024 + tile + 2 * stages * kv + 1024  # barriers/alignment slack


def _build(cfg):
    TREE = cfg.get('tree', True)
    PFENCE = cfg.get('producer_fence', True)
    CFENCE = cfg.get('consumer_fence', False)
    HEADS_FAST = cfg.get('heads_fast', True)
    NWG = cfg.get('nwg', 2)
    OVERLAP = cfg.get('overlap', False)
    PROBE = cfg.get('probe', ())  # timing probes: drop work from unmasked blocks (wrong output)
    EMU = cfg.get('emu', 0)  # 1 in EMU exponentials of unmasked blocks on the FMA pipe
    BM = 64 * NWG
    THREADS = 128 * (NWG + 1)
    PRODUCER_REGS = cfg.get('producer_regs', 40 if NWG == 2 else 32)
    CONSUMER_REGS = cfg.get('consumer_regs', 232 if NWG == 2 else 160)
    SMEM = smem_bytes(BM)
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as hh
    from cutlass import BFloat16, Float32, Int32, Int64
    from cutlass.cute.nvgpu import cpasync, warpgroup
    from cutlass.utils import LayoutEnum

    try:
        from cutlass.memory import SmemAllocator
    except ImportError:
        from cutlass.utils import SmemAllocator

    neg_inf = float("-inf")
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T, dsl_user_op

    @dsl_user_op
    def ex2_fma(x, *, loc=None, ip=None):
        # 2^x for x <= 0 without MUFU: floor(x) by adding 1.5 * 2^23 rounding down, a degree-3
        # fit of 2^f on [0, 1) (max relative error 8.6e-5), floor(x) added to the exponent.
        # Inputs below -127 give ~2^-127, not 0 (unmasked blocks only: no -inf there).
        return Float32(
            llvm.inline_asm(
                T.f32(),
                [Float32(x).ir_value(loc=loc, ip=ip)],
                "{\n\t.reg .f32 a, b, c, d, e;\n\t.reg .b32 i, j;\n\t"
                "max.ftz.f32 a, $1, 0fC2FE0000;\n\t"
                "add.rm.ftz.f32 b, a, 0f4B400000;\n\t"
                "sub.rn.ftz.f32 c, b, 0f4B400000;\n\t"
                "sub.rn.ftz.f32 d, a, c;\n\t"
                "fma.rn.ftz.f32 e, d, 0f3D9DD4DF, 0f3E691C04;\n\t"
                "fma.rn.ftz.f32 e, e, d, 0f3F31F329;\n\t"
                "fma.rn.ftz.f32 e, e, d, 0f3F800000;\n\t"
                "mov.b32 i, b;\n\tshl.b32 i, i, 23;\n\t"
                "mov.b32 j, e;\n\tadd.s32 j, j, i;\n\tmov.b32 $0, j;\n\t}",
                "=f,f",
                has_side_effects=False,
                is_align_stack=False,
                asm_dialect=llvm.AsmDialect.AD_ATT,
                loc=loc,
                ip=ip,
            )
        )

    def smem_layout(rows, stages):
        atom = warpgroup.make_smem_layout_atom(
            hh.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, BFloat16, D), BFloat16
        )
        if stages is None:
            return cute.tile_to_shape(atom, (rows, D), order=(0, 1))
        return cute.tile_to_shape(atom, (rows, D, stages), order=(0, 1, 2))

    @cute.jit
    def gemm(tiled_mma, acc, t_a, t_b, zero_init: cutlass.Constexpr):
        warpgroup.fence()
        atom = cute.make_mma_atom(tiled_mma.op)
        atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
        for k in cutlass.range_constexpr(cute.size(t_a.shape[2])):
            cute.gemm(atom, acc, t_a[None, None, k], t_b[None, None, k], acc)
            atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    def tree(op, xs):
        while len(xs) > 1:
            nxt = [op(xs[t], xs[t + 1]) for t in range(0, len(xs) - 1, 2)]
            if len(xs) % 2:
                nxt.append(xs[-1])
            xs = nxt
        return xs[0]

    def softmax(acc_S, acc_O, tOrP, tScS, row_max, row_sum, m_block, seqlen, scale_log2,
                masked, nb=None, defer=False):
        n_s = cute.size(acc_S) // 4
        n_o = cute.size(acc_O) // 4
        if masked:
            row0 = m_block * BM
            col0 = nb * BN
            for idx in range(cute.size(acc_S)):
                r = row0 + tScS[idx][0]
                c = col0 + tScS[idx][1]
                lim = cutlass.min(r + 1, seqlen)
                acc_S[idx] = Float32(cutlass.select_(c >= lim, Float32(neg_inf), acc_S[idx]))
        fmax = cute.arch.fmax
        cols = [[e + 2 * i + 4 * j for j in range(n_s) for e in range(2)] for i in range(2)]
        if 'nomax' in PROBE and not masked:
            mxs = [row_max[i] for i in range(2)]
        elif TREE:
            mxs = [tree(fmax, [acc_S[x] for x in cols[i]]) for i in range(2)]
        else:
            mxs = []
            for i in range(2):
                mx = acc_S[cols[i][0]]
                for x in cols[i]:
                    mx = fmax(mx, acc_S[x])
                mxs.append(mx)
        mxs = [fmax(m, cute.arch.shuffle_sync_bfly(m, 1)) for m in mxs]
        mxs = [fmax(m, cute.arch.shuffle_sync_bfly(m, 2)) for m in mxs]
        alphas = []
        for i in range(2):
            m_old = row_max[i]
            m_new = fmax(m_old, mxs[i])
            if NWG == 2:
                alphas.append(cute.math.exp2((m_old - m_new) * scale_log2, fastmath=True))
                neg = -m_new * scale_log2
            else:  # a warpgroup's rows can see no key of a diagonal block: m_new = -inf
                shift = Float32(cutlass.select_(m_new == neg_inf, Float32(0.0), m_new * scale_log2))
                alphas.append(cute.math.exp2(m_old * scale_log2 - shift, fastmath=True))
                neg = -shift
            row_max[i] = m_new
            ps = []
            for n_x, x in enumerate(cols[i]):
                if 'noffma' in PROBE and not masked:
                    p = cute.math.exp2(acc_S[x], fastmath=True)
                elif EMU and not masked and n_x % EMU == EMU - 1:
                    p = ex2_fma(acc_S[x] * scale_log2 + neg)
                else:
                    p = cute.math.exp2(acc_S[x] * scale_log2 + neg, fastmath=True)
                acc_S[x] = p
                ps.append(p)
            if 'nosum' in PROBE and not masked:
                total = ps[0]
            elif TREE:
                total = tree(lambda u, w: u + w, ps)
            else:
                total = Float32(0.0)
                for p in ps:
                    total = total + p
            row_sum[i] = row_sum[i] * alphas[i] + total
        if defer:
            return alphas
        if 'norescale' in PROBE and not masked:
            tOrP.store(acc_S.load().to(BFloat16))
            return alphas
        rescale_convert(acc_S, acc_O, tOrP, alphas)
        return alphas

    def rescale_convert(acc_S, acc_O, tOrP, alphas):
        n_o = cute.size(acc_O) // 4
        for i in range(2):
            for j in range(n_o):
                for e in range(2):
                    idx = e + 2 * i + 4 * j
                    acc_O[idx] = acc_O[idx] * alphas[i]
        tOrP.store(acc_S.load().to(BFloat16))

    @cute.jit
    def release(bar, lane):
        if lane == 0:
            cute.arch.mbarrier_arrive(bar)

    @cute.kernel
    def attn_kernel(
        q: cute.Pointer,
        k: cute.Pointer,
        v: cute.Pointer,
        out: cute.Pointer,
        cu_seqlens: cute.Pointer,
        sinks: cute.Pointer,
        num_m_blocks: Int32,
        scale_log2: Float32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        if cutlass.const_expr(HEADS_FAST):
            h, b, bx = cute.arch.block_idx()
        else:
            bx, h, b = cute.arch.block_idx()
        m_block = num_m_blocks - 1 - bx
        seq_start = cute.make_tensor(cu_seqlens + b, cute.make_layout(1))[0]
        seq_end = cute.make_tensor(cu_seqlens + b + 1, cute.make_layout(1))[0]
        seqlen = seq_end - seq_start
        hk = h // GROUP
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = warp // 4

        smem = SmemAllocator()
        mbar = smem.allocate_array(Int64, 1 + 4 * STAGES)
        q_full = mbar
        k_full = mbar + 1
        k_empty = mbar + 1 + STAGES
        v_full = mbar + 1 + 2 * STAGES
        v_empty = mbar + 1 + 3 * STAGES
        lq = smem_layout(BM, None)
        lkv = smem_layout(BN, STAGES)
        sQ = smem.allocate_tensor(BFloat16, lq.outer, 1024, lq.inner)
        sK = smem.allocate_tensor(BFloat16, lkv.outer, 1024, lkv.inner)
        sV = smem.allocate_tensor(BFloat16, lkv.outer, 1024, lkv.inner)

        if tidx == 0:
            cute.arch.mbarrier_init(q_full, 128)
            for s in cutlass.range_constexpr(STAGES):
                cute.arch.mbarrier_init(k_full + s, 128)
                cute.arch.mbarrier_init(v_full + s, 128)
                cute.arch.mbarrier_init(k_empty + s, 4 * NWG)
                cute.arch.mbarrier_init(v_empty + s, 4 * NWG)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # causal, equal q/k lengths: key blocks [0, n_blocks); blocks >= n_unmasked cross the
        # diagonal (or the sequence end) and are masked
        n_blocks = (cutlass.min((m_block + 1) * BM, seqlen) + BN - 1) // BN
        n_unmasked = (m_block * BM) // BN
        n_masked = n_blocks - n_unmasked
        if m_block * BM < seqlen:
            if wg == 0:
                # ---------------- producer: cp.async, 128 threads ----------------
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
                tKs = thr.partition_D(sK)
                tVs = thr.partition_D(sV)
                prow = tidx // 8
                pcol = (tidx % 8) * 8
                last = seqlen - 1
                # Q rows of this tile (clamped into the sequence)
                for r in cutlass.range_constexpr(BM // 16):
                    row = cutlass.min(m_block * BM + r * 16 + prow, last)
                    off = (Int64(seq_start + row) * Q_ROW + h * D + pcol)
                    dst = tQs[None, r, 0]
                    src = cute.make_tensor(q + cute.assume(off, divby=8), cute.make_layout(dst.shape))
                    cute.copy(atom, src, dst)
                if cutlass.const_expr(PFENCE):
                    cute.arch.cp_async_commit_group()
                else:
                    cute.arch.cp_async_mbarrier_arrive_noinc(q_full)
                for it in cutlass.range(n_blocks, unroll=1):
                    nb = n_blocks - 1 - it
                    s = it % STAGES
                    ph = (it // STAGES) % 2
                    cute.arch.mbarrier_wait(k_empty + s, ph ^ 1)
                    for r in cutlass.range_constexpr(BN // 16):
                        row = cutlass.min(nb * BN + r * 16 + prow, last)
                        off = (Int64(seq_start + row) * KV_ROW + hk * D + pcol)
                        dst = tKs[None, r, 0, s]
                        src = cute.make_tensor(
                            k + cute.assume(off, divby=8), cute.make_layout(dst.shape)
                        )
                        cute.copy(atom, src, dst)
                    if cutlass.const_expr(PFENCE):
                        # K_it issued: the group before it (Q, or V_{it-1}) is complete
                        cute.arch.cp_async_commit_group()
                        cute.arch.cp_async_wait_group(1)
                        cute.arch.fence_view_async_shared()
                        if it == 0:
                            cute.arch.mbarrier_arrive(q_full)
                        else:
                            cute.arch.mbarrier_arrive(v_full + (it - 1) % STAGES)
                    else:
                        cute.arch.cp_async_mbarrier_arrive_noinc(k_full + s)
                    cute.arch.mbarrier_wait(v_empty + s, ph ^ 1)
                    for r in cutlass.range_constexpr(BN // 16):
                        row = cutlass.min(nb * BN + r * 16 + prow, last)
                        off = (Int64(seq_start + row) * KV_ROW + hk * D + pcol)
                        dst = tVs[None, r, 0, s]
                        src = cute.make_tensor(
                            v + cute.assume(off, divby=8), cute.make_layout(dst.shape)
                        )
                        cute.copy(atom, src, dst)
                    if cutlass.const_expr(PFENCE):
                        cute.arch.cp_async_commit_group()
                        cute.arch.cp_async_wait_group(1)
                        cute.arch.fence_view_async_shared()
                        cute.arch.mbarrier_arrive(k_full + s)
                    else:
                        cute.arch.cp_async_mbarrier_arrive_noinc(v_full + s)
                cute.arch.cp_async_wait_group(0)
                if cutlass.const_expr(PFENCE):
                    cute.arch.fence_view_async_shared()
                    cute.arch.mbarrier_arrive(v_full + (n_blocks - 1) % STAGES)
            else:
                # ---------------- consumers: 2 warpgroups x 64 rows ----------------
                cute.arch.setmaxregister_increase(CONSUMER_REGS)
                ctid = tidx - 128
                cw = wg - 1
                lane = tidx % 32
                tiled_qk = hh.make_trivial_tiled_mma(
                    BFloat16, BFloat16, warpgroup.OperandMajorMode.K,
                    warpgroup.OperandMajorMode.K, Float32, (NWG, 1, 1), (64, BN),
                )  # fmt: skip
                tiled_pv = hh.make_trivial_tiled_mma(
                    BFloat16, BFloat16, warpgroup.OperandMajorMode.K,
                    warpgroup.OperandMajorMode.MN, Float32, (NWG, 1, 1), (64, D),
                    a_source=warpgroup.OperandSource.RMEM,
                )  # fmt: skip
                wg_layout = cute.make_layout(NWG, stride=128)
                wg_qk = tiled_qk.get_slice(wg_layout(cw))
                wg_pv = tiled_pv.get_slice(wg_layout(cw))
                thr_qk = tiled_qk.get_slice(ctid)
                thr_pv = tiled_pv.get_slice(ctid)
                sVt = cute.composition(
                    sV, cute.make_ordered_layout((D, BN, STAGES), order=(1, 0, 2))
                )
                tSrQ = wg_qk.make_fragment_A(wg_qk.partition_A(sQ))
                tSrK = wg_qk.make_fragment_B(wg_qk.partition_B(sK))
                tOrV = wg_pv.make_fragment_B(wg_pv.partition_B(sVt))
                acc_S = cute.make_rmem_tensor(wg_qk.partition_shape_C((BM, BN)), Float32)
                acc_O = cute.make_rmem_tensor(wg_pv.partition_shape_C((BM, D)), Float32)
                tOrP = wg_pv.make_fragment_A(wg_pv.partition_shape_A((BM, BN)))
                tScS = thr_qk.partition_C(cute.make_identity_tensor((BM, BN)))
                tOcO = thr_pv.partition_C(cute.make_identity_tensor((BM, D)))
                acc_O.fill(0.0)
                row_max = cute.make_rmem_tensor(2, Float32)
                row_sum = cute.make_rmem_tensor(2, Float32)
                for i in cutlass.range_constexpr(2):
                    row_max[i] = neg_inf
                    row_sum[i] = 0.0
                n_s = cute.size(acc_S) // 4  # 8-col groups per row
                n_o = cute.size(acc_O) // 4

                if cw == 0:
                    cute.arch.barrier_arrive(barrier_id=1, number_of_threads=256)


                # first (diagonal, masked) block
                cute.arch.mbarrier_wait(q_full, 0)
                cute.arch.mbarrier_wait(k_full, 0)
                if cutlass.const_expr(CFENCE):
                    cute.arch.fence_view_async_shared()
                cute.arch.barrier(barrier_id=1 + cw, number_of_threads=256)
                gemm(tiled_qk, acc_S, tSrQ, tSrK[None, None, None, 0], True)
                cute.arch.barrier_arrive(barrier_id=1 + (cw + 1) % NWG, number_of_threads=256)
                warpgroup.wait_group(0)
                release(k_empty, lane)
                softmax(acc_S, acc_O, tOrP, tScS, row_max, row_sum, m_block, seqlen, scale_log2, True, n_blocks - 1)

                for it in cutlass.range(1, n_masked, unroll=1):
                    sp = (it - 1) % STAGES
                    s = it % STAGES
                    php = ((it - 1) // STAGES) % 2
                    ph = (it // STAGES) % 2
                    cute.arch.mbarrier_wait(v_full + sp, php)
                    cute.arch.mbarrier_wait(k_full + s, ph)
                    if cutlass.const_expr(CFENCE):
                        cute.arch.fence_view_async_shared()
                    cute.arch.barrier(barrier_id=1 + cw, number_of_threads=256)
                    if cutlass.const_expr(OVERLAP):
                        # S_it first: its softmax runs while P_{it-1} V_{it-1} multiplies.
                        gemm(tiled_qk, acc_S, tSrQ, tSrK[None, None, None, s], True)
                        gemm(tiled_pv, acc_O, tOrP, tOrV[None, None, None, sp], False)
                        cute.arch.barrier_arrive(barrier_id=1 + (cw + 1) % NWG, number_of_threads=256)
                        warpgroup.wait_group(1)
                        release(k_empty + s, lane)
                        alphas = softmax(acc_S, acc_O, tOrP, tScS, row_max, row_sum, m_block, seqlen, scale_log2, True, n_blocks - 1 - it, True)
                        warpgroup.wait_group(0)
                        release(v_empty + sp, lane)
                        rescale_convert(acc_S, acc_O, tOrP, alphas)
                    else:
                        gemm(tiled_pv, acc_O, tOrP, tOrV[None, None, None, sp], False)
                        gemm(tiled_qk, acc_S, tSrQ, tSrK[None, None, None, s], True)
                        cute.arch.barrier_arrive(barrier_id=1 + (cw + 1) % NWG, number_of_threads=256)
                        warpgroup.wait_group(1)
                        release(v_empty + sp, lane)
                        warpgroup.wait_group(0)
                        release(k_empty + s, lane)
                        softmax(acc_S, acc_O, tOrP, tScS, row_max, row_sum, m_block, seqlen, scale_log2, True, n_blocks - 1 - it)

                for it in cutlass.range(cutlass.max(n_masked, 1), n_blocks, unroll=1):
                    sp = (it - 1) % STAGES
                    s = it % STAGES
                    php = ((it - 1) // STAGES) % 2
                    ph = (it // STAGES) % 2
                    cute.arch.mbarrier_wait(v_full + sp, php)
                    cute.arch.mbarrier_wait(k_full + s, ph)
                    if cutlass.const_expr(CFENCE):
                        cute.arch.fence_view_async_shared()
                    cute.arch.barrier(barrier_id=1 + cw, number_of_threads=256)
                    if cutlass.const_expr(OVERLAP):
                        gemm(tiled_qk, acc_S, tSrQ, tSrK[None, None, None, s], True)
                        gemm(tiled_pv, acc_O, tOrP, tOrV[None, None, None, sp], False)
                        cute.arch.barrier_arrive(barrier_id=1 + (cw + 1) % NWG, number_of_threads=256)
                        warpgroup.wait_group(1)
                        release(k_empty + s, lane)
                        alphas = softmax(acc_S, acc_O, tOrP, tScS, row_max, row_sum, m_block, seqlen, scale_log2, False, None, True)
                        warpgroup.wait_group(0)
                        release(v_empty + sp, lane)
                        rescale_convert(acc_S, acc_O, tOrP, alphas)
                    else:
                        gemm(tiled_pv, acc_O, tOrP, tOrV[None, None, None, sp], False)
                        gemm(tiled_qk, acc_S, tSrQ, tSrK[None, None, None, s], True)
                        cute.arch.barrier_arrive(barrier_id=1 + (cw + 1) % NWG, number_of_threads=256)
                        warpgroup.wait_group(1)
                        release(v_empty + sp, lane)
                        warpgroup.wait_group(0)
                        release(k_empty + s, lane)
                        softmax(acc_S, acc_O, tOrP, tScS, row_max, row_sum, m_block, seqlen, scale_log2, False)

                sl = (n_blocks - 1) % STAGES
                phl = ((n_blocks - 1) // STAGES) % 2
                cute.arch.mbarrier_wait(v_full + sl, phl)
                if cutlass.const_expr(CFENCE):
                    cute.arch.fence_view_async_shared()
                cute.arch.barrier(barrier_id=1 + cw, number_of_threads=256)
                gemm(tiled_pv, acc_O, tOrP, tOrV[None, None, None, sl], False)
                cute.arch.barrier_arrive(barrier_id=1 + (cw + 1) % NWG, number_of_threads=256)
                warpgroup.wait_group(0)
                release(v_empty + sl, lane)

                # epilogue: O / (row sum + sink term), bf16, straight to global
                sink = cute.make_tensor(sinks + h, cute.make_layout(1))[0] * LOG2E
                for i in cutlass.range_constexpr(2):
                    l_i = row_sum[i]
                    l_i = l_i + cute.arch.shuffle_sync_bfly(l_i, 1)
                    l_i = l_i + cute.arch.shuffle_sync_bfly(l_i, 2)
                    term = cute.math.exp2(sink - row_max[i] * scale_log2, fastmath=True)
                    inv = 1.0 / (l_i + term)
                    row = m_block * BM + tOcO[2 * i][0]
                    if row < seqlen:
                        base = Int64(seq_start + row) * Q_ROW + h * D
                        for j in cutlass.range_constexpr(n_o):
                            pair = cute.make_rmem_tensor(2, Float32)
                            pair[0] = acc_O[2 * i + 4 * j] * inv
                            pair[1] = acc_O[1 + 2 * i + 4 * j] * inv
                            col = tOcO[2 * i + 4 * j][1]
                            dst = cute.make_tensor(
                                out + cute.assume(base + col, divby=2), cute.make_layout(2)
                            )
                            dst.store(pair.load().to(BFloat16))

    @cute.jit
    def host(
        q: cute.Pointer,
        k: cute.Pointer,
        v: cute.Pointer,
        out: cute.Pointer,
        cu_seqlens: cute.Pointer,
        sinks: cute.Pointer,
        num_m_blocks: Int32,
        batch: Int32,
        scale_log2: Float32,
        stream,
    ):
        attn_kernel(q, k, v, out, cu_seqlens, sinks, num_m_blocks, scale_log2).launch(
            grid=[HQ, batch, num_m_blocks] if HEADS_FAST else [num_m_blocks, HQ, batch], block=[THREADS, 1, 1], smem=SMEM,
            stream=stream,
        )  # fmt: skip

    return cutlass, cute, host


def compile_cubin(cfg, arch="sm_90a"):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "packages/tokenspeed-kernel-nvidia/src"))
    from tokenspeed_kernel_nvidia import _cute_runtime as rt

    cutlass, cute, host = _build(cfg)
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    def ptr(t, align):
        return make_ptr(t, 0, cute.AddressSpace.gmem, assumed_align=align)

    bf = ptr(cutlass.BFloat16, 16)
    args = [bf, bf, bf, ptr(cutlass.BFloat16, 16), ptr(cutlass.Int32, 4), ptr(cutlass.Float32, 4)]
    args += [cutlass.Int32(1), cutlass.Int32(1), cutlass.Float32(1.0), make_fake_stream()]
    return rt.compile_cubin(host, args, arch)
