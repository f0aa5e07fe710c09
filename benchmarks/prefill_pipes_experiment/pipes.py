"""Microbenchmark: can one SM sub-partition run wgmma (tensor pipe) and MUFU ex2 at once?
Two warpgroups per CTA, one CTA per SM; each warpgroup plays a role per iteration:
  mma : S = Q K^T (SS, m64n128k64) then O += P V (RS, m64n64k128), waited: 512 tensor cycles
        per warp at the dense bf16 rate; ss: the S GEMM only, twice (SS only).
  mufu: 64 ex2 per thread (64 independent chains): 512 MUFU cycles per warp at 16/clk/SM.
  fma : 64 x 8 dependent-free FFMA per thread: 512 FMA-pipe issue cycles per warp.
  idle: nothing.
"""
import math
D, BN = 64, 128


def _build(roles):
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as hh
    from cutlass import BFloat16, Float32, Int32
    from cutlass.cute.nvgpu import warpgroup
    from cutlass.utils import LayoutEnum
    try:
        from cutlass.memory import SmemAllocator
    except ImportError:
        from cutlass.utils import SmemAllocator
    NWG = len(roles)
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T, dsl_user_op

    INT_OPS = {
        "lop3": "lop3.b32 $0, $1, $2, 0x80008000, 0xF8;",
        "shl": "shl.b32 $0, $1, 3;",
        "shf": "shf.l.wrap.b32 $0, $1, $2, 3;",
        "imad": "mad.lo.u32 $0, $1, $2, 12345;",
        "hmul2": "mul.rn.bf16x2 $0, $1, $2;",
        "prmt": "prmt.b32 $0, $1, $2, 0x3715;",
        "iadd": "add.u32 $0, $1, $2;",
    }

    @dsl_user_op
    def int_op(x, y, op: str, *, loc=None, ip=None):
        return Int32(llvm.inline_asm(
            T.i32(), [Int32(x).ir_value(loc=loc, ip=ip), Int32(y).ir_value(loc=loc, ip=ip)],
            INT_OPS[op], "=r,r,r", has_side_effects=False, is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))

    def smem_layout(rows, cols=D):
        atom = warpgroup.make_smem_layout_atom(
            hh.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, BFloat16, cols), BFloat16)
        return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))

    @cute.jit
    def gemm(tiled_mma, acc, t_a, t_b, zero_init: cutlass.Constexpr):
        warpgroup.fence()
        atom = cute.make_mma_atom(tiled_mma.op)
        atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
        for k in cutlass.range_constexpr(cute.size(t_a.shape[2])):
            cute.gemm(atom, acc, t_a[None, None, k], t_b[None, None, k], acc)
            atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.kernel
    def kern(out: cute.Pointer, iters: Int32, c: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = warp // 4
        ctid = tidx % 128
        smem = SmemAllocator()
        lq = smem_layout(64)
        lk = smem_layout(BN)
        sQ = smem.allocate_tensor(BFloat16, lq.outer, 1024, lq.inner)
        sK = smem.allocate_tensor(BFloat16, lk.outer, 1024, lk.inner)
        sV = smem.allocate_tensor(BFloat16, lk.outer, 1024, lk.inner)
        lp = smem_layout(64, BN)
        sP = smem.allocate_tensor(BFloat16, lp.outer, 1024, lp.inner)
        # zero the operands (garbage bits could be NaN; the rate does not care, the sums do)
        for i in cutlass.range(tidx, 64 * D, 128 * NWG, unroll=1):
            sQ[i] = BFloat16(0.0)
        for i in cutlass.range(tidx, BN * D, 128 * NWG, unroll=1):
            sK[i] = BFloat16(0.0)
            sV[i] = BFloat16(0.0)
        for i in cutlass.range(tidx, 64 * BN, 128 * NWG, unroll=1):
            sP[i] = BFloat16(0.0)
        cute.arch.sync_threads()
        tiled_qk = hh.make_trivial_tiled_mma(
            BFloat16, BFloat16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            Float32, (1, 1, 1), (64, BN))
        tiled_pv = hh.make_trivial_tiled_mma(
            BFloat16, BFloat16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
            Float32, (1, 1, 1), (64, D), a_source=warpgroup.OperandSource.RMEM)
        tiled_pvs = hh.make_trivial_tiled_mma(
            BFloat16, BFloat16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
            Float32, (1, 1, 1), (64, D))
        sVt = cute.composition(sV, cute.make_ordered_layout((D, BN), order=(1, 0)))
        w_qk = tiled_qk.get_slice(0)
        w_pv = tiled_pv.get_slice(0)
        tSrQ = w_qk.make_fragment_A(w_qk.partition_A(sQ))
        tSrK = w_qk.make_fragment_B(w_qk.partition_B(sK))
        tOrV = w_pv.make_fragment_B(w_pv.partition_B(sVt))
        w_pvs = tiled_pvs.get_slice(0)
        tOsP = w_pvs.make_fragment_A(w_pvs.partition_A(sP))
        tOsV = w_pvs.make_fragment_B(w_pvs.partition_B(sVt))
        acc_S = cute.make_rmem_tensor(w_qk.partition_shape_C((64, BN)), Float32)
        acc_O = cute.make_rmem_tensor(w_pv.partition_shape_C((64, D)), Float32)
        tOrP = w_pv.make_fragment_A(w_pv.partition_shape_A((64, BN)))
        acc_O.fill(0.0)
        acc_S.fill(0.0)
        tOrP.store(acc_S.load().to(BFloat16))
        total = Float32(0.0)
        for r in cutlass.range_constexpr(NWG):
            if wg == r:
                role = roles[r]
                if cutlass.const_expr(role == "mma"):
                    for _ in cutlass.range(iters, unroll=1):
                        gemm(tiled_qk, acc_S, tSrQ, tSrK, True)
                        gemm(tiled_pv, acc_O, tOrP, tOrV, False)
                        warpgroup.wait_group(0)
                    for x in cutlass.range_constexpr(cute.size(acc_S)):
                        total = total + acc_S[x]
                    for x in cutlass.range_constexpr(cute.size(acc_O)):
                        total = total + acc_O[x]
                if cutlass.const_expr(role == "mmass"):
                    for _ in cutlass.range(iters, unroll=1):
                        gemm(tiled_qk, acc_S, tSrQ, tSrK, True)
                        gemm(tiled_pvs, acc_O, tOsP, tOsV, False)
                        warpgroup.wait_group(0)
                    for x in cutlass.range_constexpr(cute.size(acc_S)):
                        total = total + acc_S[x]
                    for x in cutlass.range_constexpr(cute.size(acc_O)):
                        total = total + acc_O[x]
                if cutlass.const_expr(role in INT_OPS):
                    acc_I = cute.make_rmem_tensor(cute.make_layout(64), Int32)
                    for x in cutlass.range_constexpr(64):
                        acc_I[x] = Int32(tidx * 64 + x)
                    y = Int32(iters) | Int32(0x3F803F80)
                    for _ in cutlass.range(iters, unroll=1):
                        for rep in cutlass.range_constexpr(8):
                            for x in cutlass.range_constexpr(64):
                                acc_I[x] = int_op(acc_I[x], y, role)
                    isum = Int32(0)
                    for x in cutlass.range_constexpr(64):
                        isum = isum ^ acc_I[x]
                    total = Float32(isum)
                if cutlass.const_expr(role == "rs"):
                    for _ in cutlass.range(iters, unroll=1):
                        gemm(tiled_pv, acc_O, tOrP, tOrV, False)
                        gemm(tiled_pv, acc_O, tOrP, tOrV, False)
                        warpgroup.wait_group(0)
                    for x in cutlass.range_constexpr(cute.size(acc_O)):
                        total = total + acc_O[x]
                if cutlass.const_expr(role == "ss"):
                    for _ in cutlass.range(iters, unroll=1):
                        gemm(tiled_qk, acc_S, tSrQ, tSrK, True)
                        gemm(tiled_qk, acc_S, tSrQ, tSrK, False)
                        warpgroup.wait_group(0)
                    for x in cutlass.range_constexpr(cute.size(acc_S)):
                        total = total + acc_S[x]
                if cutlass.const_expr(role == "mufu"):
                    for _ in cutlass.range(iters, unroll=1):
                        for x in cutlass.range_constexpr(cute.size(acc_S)):
                            acc_S[x] = cute.math.exp2(acc_S[x] * c - 1.0, fastmath=True)
                    for x in cutlass.range_constexpr(cute.size(acc_S)):
                        total = total + acc_S[x]
                if cutlass.const_expr(role == "fadd"):
                    for _ in cutlass.range(iters, unroll=1):
                        for rep in cutlass.range_constexpr(8):
                            for x in cutlass.range_constexpr(cute.size(acc_S)):
                                acc_S[x] = acc_S[x] + c
                    for x in cutlass.range_constexpr(cute.size(acc_S)):
                        total = total + acc_S[x]
                if cutlass.const_expr(role == "fmnmx"):
                    for _ in cutlass.range(iters, unroll=1):
                        for rep in cutlass.range_constexpr(8):
                            for x in cutlass.range_constexpr(cute.size(acc_S)):
                                acc_S[x] = cute.arch.fmax(acc_S[x], c + Float32(rep))
                    for x in cutlass.range_constexpr(cute.size(acc_S)):
                        total = total + acc_S[x]
                if cutlass.const_expr(role == "mix"):
                    # an attention softmax's per-element work: max, FFMA, ex2, sum, bf16 pack
                    row_sum = Float32(0.0)
                    for _ in cutlass.range(iters, unroll=1):
                        mx = acc_S[0]
                        for x in cutlass.range_constexpr(cute.size(acc_S)):
                            mx = cute.arch.fmax(mx, acc_S[x])
                        for x in cutlass.range_constexpr(cute.size(acc_S)):
                            acc_S[x] = cute.math.exp2(acc_S[x] * c - mx, fastmath=True)
                            row_sum = row_sum + acc_S[x]
                        tOrP.store(acc_S.load().to(BFloat16))
                        for x in cutlass.range_constexpr(cute.size(acc_S)):
                            acc_S[x] = acc_S[x] + Float32(tOrP[x % 64])
                    total = row_sum
                if cutlass.const_expr(role == "fma"):
                    for _ in cutlass.range(iters, unroll=1):
                        for rep in cutlass.range_constexpr(8):
                            for x in cutlass.range_constexpr(cute.size(acc_S)):
                                acc_S[x] = acc_S[x] * c + 0.5
                    for x in cutlass.range_constexpr(cute.size(acc_S)):
                        total = total + acc_S[x]
        o = cute.make_tensor(out + (bidx * 128 * NWG + tidx), cute.make_layout(1))
        o[0] = total

    @cute.jit
    def host(out: cute.Pointer, iters: Int32, c: Float32, stream):
        kern(out, iters, c).launch(grid=[132, 1, 1], block=[128 * NWG, 1, 1],
                                   smem=4096 + (64 + 2 * BN) * D * 2 + 64 * BN * 2, stream=stream)

    return cutlass, cute, host


def compile_cubin(roles, arch="sm_90a"):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "packages/tokenspeed-kernel-nvidia/src"))
    from tokenspeed_kernel_nvidia import _cute_runtime as rt
    cutlass, cute, host = _build(roles)
    from cutlass.cute.runtime import make_fake_stream, make_ptr
    args = [make_ptr(cutlass.Float32, 0, cute.AddressSpace.gmem, assumed_align=4),
            cutlass.Int32(1), cutlass.Float32(1.0), make_fake_stream()]
    return rt.compile_cubin(host, args, arch)


ROLESETS = [("mma",)] + [r for op in ("lop3", "shl", "shf", "imad", "hmul2", "prmt", "iadd")
                          for r in ((op,), ("mma", op))] + [("mma", "fadd")]

if __name__ == "__main__":
    import json, time
    from pathlib import Path
    out = Path(__file__).resolve().parent / "cubin"
    out.mkdir(exist_ok=True)
    for roles in ROLESETS:
        name = "_".join(roles)
        t = time.time()
        cub = compile_cubin(roles)
        (out / f"{name}.cubin").write_bytes(cub.image)
        (out / f"{name}.json").write_text(json.dumps(dict(symbol=cub.symbol, roles=roles,
                                                         smem=4096 + (64 + 2 * BN) * D * 2 + 64 * BN * 2)))
        print(name, "%.1fs" % (time.time() - t))
