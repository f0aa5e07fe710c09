"""`mha_decode_with_kvcache` written with the CuTe DSL: one launch, split-KV, for GPT-OSS's
small-batch full-context layers (8 query heads per KV head, head dim 64, sinks, one query).

Why: at B=1 a two-launch split/reduce decode sits about 2x above the copy floor; here the
CTAs of one (sequence, KV head) each reduce a chunk of keys for all 8 query heads, and the
last CTA to finish (an atomic counter) merges the chunks, so the merge costs no second launch.

A CTA is 4 warps; warp w takes key tiles of 16 keys, w, w+4, ... of its chunk (one page per
tile: the page size is a multiple of 16). Scores and P@V run on tensor cores (mma.sync
m16n8k16, the 8 heads in rows 0..7 of A) straight from registers, with no shared memory: the
MMAs' reduction indices are permuted so that every lane's operands are 16 contiguous bytes
of a K or V row (see the kernel's comments), and P's accumulator fragment is the next MMA's
A fragment as it stands. Softmax runs online in the log2 domain; warps (shared memory) and
chunks (global workspace) merge with the same max/rescale rule. Keys past the sequence are
read at the last visible key's address (never outside the visible cache) and weighted 0.
The per-(sequence, KV head) counters live in a zeroed per-device buffer that the last CTA
resets, so the kernel replays in CUDA graphs; two streams must not run it on one device at
the same time (their counters would mix).

The DSL is needed only to compile (see `_cute_runtime`).
"""

# No `from __future__ import annotations`: the DSL evaluates the kernels' annotations in the
# module's globals, where `cute` (imported lazily, in `_dsl`) is not.
import functools
import math
import threading
from dataclasses import dataclass

import torch

from tokenspeed_kernel.registry import Support, register_kernel
from tokenspeed_kernel.tuning import pinned_config

from . import _cute_runtime as rt

KERNEL_NAME = "cute.mha_decode_with_kvcache"
HALF = (torch.bfloat16, torch.float16)
GROUP = 8  # query heads per KV head (GPT-OSS)
HEAD_DIM = 64
TILE = 16  # keys per warp per iteration: 4 key groups x 4
LOG2E = math.log2(math.e)


def smem_bytes(warps: int) -> int:
    """The warps' (m, l, o) for the CTA merge, the counter's old value, and slack for the
    allocator's alignment."""
    return warps * GROUP * (HEAD_DIM + 2) * 4 + 16 + 1024


MAX_COUNTERS = 1 << 18
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}


@dataclass(frozen=True)
class DecodeConfig:
    """`warps` per CTA (each takes every `warps`-th 16-key tile of the CTA's chunk) and how
    many chunks a (sequence, KV head) is split into: enough for `ctas_per_sm` CTAs on every
    SM. Benchmarks pin others with `tuning.pin_config(KERNEL_NAME, ...)`."""

    ctas_per_sm: int
    warps: int = 8


# Two CTAs per SM: the kernel's 128 registers would allow four, but every extra chunk adds
# to the last CTA's merge, which no other work overlaps. Eight warps: a warp's iterations
# are each about one memory latency (its next tile's loads are one iteration ahead and the
# math is short), so more, shorter warps finish a chunk sooner.
DEFAULT_CONFIG = DecodeConfig(ctas_per_sm=2, warps=8)
CONFIG_WARPS = (4, 8)


@functools.cache
def _dsl():
    """The kernel and its host launcher, built on first use (imports the DSL, about 3 s)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T, dsl_user_op

    try:  # DSL 4.8 moved it (the old name still works there, with a DeprecationWarning)
        from cutlass.memory import SmemAllocator
    except ImportError:
        from cutlass.utils import SmemAllocator

    neg_inf = float("-inf")

    def row(ptr, offset, n):
        return cute.make_tensor(ptr + cute.assume(offset, divby=n), cute.make_layout(n))

    def scalar(ptr, offset):
        return cute.make_tensor(ptr + offset, cute.make_layout(1))[0]

    def shift_of(m):
        # Rows with nothing seen keep m = -inf: shift by 0 so exp2(-inf - 0) = 0, not NaN.
        return Float32(cutlass.select_(m == neg_inf, Float32(0.0), m))

    def page_of(page_table, b, stride_pt, kb, page_size, max_pages, num_pages):
        """The page holding key kb; the column and the id clamped into the table and cache."""
        column = cutlass.max(cutlass.min(kb // page_size, max_pages - 1), 0)
        page = scalar(page_table, Int64(b) * stride_pt + column)
        return Int64(cutlass.max(cutlass.min(page, num_pages - 1), 0))

    def key_slot(key, hi, page_start):
        """The page slot read for `key`: past the sequence, the last visible key, or slot 0
        where the whole tile lies past it (never outside the page)."""
        return Int64(cutlass.max(cutlass.min(key, hi - 1) - page_start, 0))

    def load_k(buf, cache, page, kb, hi, g, head_off, stride_p, stride_s, page_size):
        """Lane g's K rows of the two 8-key tiles (keys kb+g, kb+8+g): 16 dims, 8 words each."""
        page_start = kb - kb % page_size
        base = page * stride_p + head_off
        for j in range(2):
            offset = base + key_slot(kb + 8 * j + g, hi, page_start) * stride_s
            for half in range(2):
                words = row(cache, offset + 4 * half, 4).load()
                for i in range(4):
                    buf[j, 4 * half + i] = words[i]

    def load_v(buf, cache, page, kb, hi, t, head_off, stride_p, stride_s, page_size):
        """Lane t's V rows (keys kb+2t, +1, kb+8+2t, +1): 8 dims, 4 words each."""
        page_start = kb - kb % page_size
        base = page * stride_p + head_off
        for r in range(4):
            key = kb + 2 * t + r % 2 + 8 * (r // 2)
            words = row(cache, base + key_slot(key, hi, page_start) * stride_s, 4).load()
            for i in range(4):
                buf[r, i] = words[i]

    @dsl_user_op
    def mma(a0, a2, b0, b1, c0, c1, kind: str, *, loc=None, ip=None):
        """One m16n8k16 tensor-core MMA whose A rows 8..15 are zero: (c0, c1) += row
        lane/4 of A times columns 2*(lane%4) and +1 of B (fp32 accumulate)."""
        operands = [x.ir_value(loc=loc, ip=ip) for x in (a0, a2, b0, b1, c0, c1)]
        result = llvm.inline_asm(
            llvm.StructType.get_literal([T.f32(), T.f32()]),
            operands,
            "{\n\t.reg .f32 z0, z1, z2, z3;\n\t.reg .b32 zr;\n\t"
            "mov.b32 zr, 0;\n\tmov.b32 z0, 0;\n\tmov.b32 z1, 0;\n\t"
            f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 "
            "{$0, $1, z2, z3}, {$2, zr, $3, zr}, {$4, $5}, {$6, $7, z0, z1};\n\t}",
            "=f,=f,r,r,r,r,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
            loc=loc,
            ip=ip,
        )
        return (
            Float32(llvm.extractvalue(T.f32(), result, [0], loc=loc, ip=ip)),
            Float32(llvm.extractvalue(T.f32(), result, [1], loc=loc, ip=ip)),
        )

    @dsl_user_op
    def pack(lo, hi, kind: str, *, loc=None, ip=None):
        """Two fp32 values rounded to a 16-bit pair: lo in the low half."""
        return Int32(
            llvm.inline_asm(
                T.i32(),
                [hi.ir_value(loc=loc, ip=ip), lo.ir_value(loc=loc, ip=ip)],
                f"cvt.rn.{kind}x2.f32 $0, $1, $2;",
                "=r,f,f",
                has_side_effects=False,
                is_align_stack=False,
                asm_dialect=llvm.AsmDialect.AD_ATT,
                loc=loc,
                ip=ip,
            )
        )

    @dsl_user_op
    def prmt(a, b, selector: int, *, loc=None, ip=None):
        return Int32(
            llvm.inline_asm(
                T.i32(),
                [a.ir_value(loc=loc, ip=ip), b.ir_value(loc=loc, ip=ip)],
                f"prmt.b32 $0, $1, $2, {selector:#x};",
                "=r,r,r",
                has_side_effects=False,
                is_align_stack=False,
                asm_dialect=llvm.AsmDialect.AD_ATT,
                loc=loc,
                ip=ip,
            )
        )

    @cute.kernel
    def decode_kernel(
        q: cute.Pointer,
        k_cache: cute.Pointer,
        v_cache: cute.Pointer,
        page_table: cute.Pointer,
        seqlens: cute.Pointer,
        sinks: cute.Pointer,
        out: cute.Pointer,
        lse: cute.Pointer,
        part_o: cute.Pointer,
        part_ml: cute.Pointer,
        counters: cute.Pointer,
        stride_qb: Int64,
        stride_qh: Int64,
        stride_kp: Int64,
        stride_ks: Int64,
        stride_kh: Int64,
        stride_vp: Int64,
        stride_vs: Int64,
        stride_vh: Int64,
        stride_pt: Int64,
        stride_ob: Int64,
        stride_oh: Int64,
        stride_lb: Int64,
        stride_lh: Int64,
        num_pages: Int32,
        max_pages: Int32,
        page_size: Int32,
        chunk: Int32,
        num_splits: Int32,
        num_kv_heads: Int32,
        scale_log2: Float32,
        HAS_SINKS: cutlass.Constexpr,
        HAS_LSE: cutlass.Constexpr,
        IS_BF16: cutlass.Constexpr,
        WARPS: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        split, h, b = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32
        g = lane // 4  # the query head of this lane's MMA rows (and its V dims 8g..8g+7)
        t = lane % 4
        kind = "bf16" if cutlass.const_expr(IS_BF16) else "f16"
        bh = Int64(b) * num_kv_heads + h

        seqlen = scalar(seqlens, Int64(b))
        seqlen = cutlass.max(cutlass.min(seqlen, max_pages * page_size), 0)
        lo = split * chunk
        hi = cutlass.min(lo + chunk, seqlen)

        # q, K and V are read as 32-bit words (strides in words). The MMA's reduction index
        # is permuted so that each lane's operands are 16 contiguous dims of a row: in k-step
        # ks, lane t's columns (2t, 2t+1, 2t+8, 2t+9) are dims 16t + 4ks + (0, 1, 2, 3). Q
        # (A) and K (B) use the same permutation, so the dot products are unchanged.
        qw = cute.make_rmem_tensor(8, Int32)
        q_off = Int64(b) * stride_qb + Int64(h * GROUP + g) * stride_qh + t * 8
        for half in cutlass.range_constexpr(2):
            words = row(q, q_off + half * 4, 4).load()
            for i in cutlass.range_constexpr(4):
                qw[half * 4 + i] = words[i]
        acc = cute.make_rmem_tensor((8, 2), Float32)
        for nt in cutlass.range_constexpr(8):
            acc[nt, 0] = 0.0
            acc[nt, 1] = 0.0
        m_run = Float32(neg_inf)
        l_run = Float32(0.0)

        # Per warp, 16 keys an iteration (two 8-key QK tiles, one 16-key PV step); K of the
        # next tile and the page id of the one after are in flight while this one computes,
        # V is loaded at the top of its own tile and arrives during the scores.
        pages = cute.make_rmem_tensor(3, Int64)
        k_cur = cute.make_rmem_tensor((2, 8), Int32)
        k_next = cute.make_rmem_tensor((2, 8), Int32)
        v_cur = cute.make_rmem_tensor((4, 4), Int32)
        ml = cute.make_rmem_tensor(2, Float32)
        ml[0] = m_run
        ml[1] = l_run
        k_head = Int64(h) * stride_kh + t * 8
        v_head = Int64(h) * stride_vh + g * 4
        kb0 = lo + warp * TILE
        step = WARPS * TILE
        pages[0] = page_of(page_table, b, stride_pt, kb0, page_size, max_pages, num_pages)
        pages[1] = page_of(page_table, b, stride_pt, kb0 + step, page_size, max_pages, num_pages)
        load_k(k_cur, k_cache, pages[0], kb0, hi, g, k_head, stride_kp, stride_ks, page_size)
        for kb in cutlass.range(kb0, hi, step, unroll=1):
            load_v(v_cur, v_cache, pages[0], kb, hi, t, v_head, stride_vp, stride_vs, page_size)
            load_k(
                k_next, k_cache, pages[1], kb + step, hi, g, k_head, stride_kp, stride_ks,
                page_size,
            )  # fmt: skip
            pages[2] = page_of(
                page_table, b, stride_pt, kb + 2 * step, page_size, max_pages, num_pages
            )
            s = cute.make_rmem_tensor(4, Float32)
            for j in cutlass.range_constexpr(2):
                c0 = Float32(0.0)
                c1 = Float32(0.0)
                for ks in cutlass.range_constexpr(4):
                    c0, c1 = mma(
                        qw[2 * ks], qw[2 * ks + 1], k_cur[j, 2 * ks], k_cur[j, 2 * ks + 1],
                        c0, c1, kind,
                    )  # fmt: skip
                key = kb + 8 * j + 2 * t
                s[2 * j] = Float32(cutlass.select_(key < hi, c0 * scale_log2, Float32(neg_inf)))
                s[2 * j + 1] = Float32(
                    cutlass.select_(key + 1 < hi, c1 * scale_log2, Float32(neg_inf))
                )
            m_old = ml[0]
            m_new = cute.arch.fmax(cute.arch.fmax(s[0], s[1]), cute.arch.fmax(s[2], s[3]))
            m_new = cute.arch.fmax(m_new, m_old)
            m_new = cute.arch.fmax(m_new, cute.arch.shuffle_sync_bfly(m_new, 1))
            m_new = cute.arch.fmax(m_new, cute.arch.shuffle_sync_bfly(m_new, 2))
            shift = shift_of(m_new)
            alpha = cute.math.exp2(m_old - shift, fastmath=True)
            p0 = cute.math.exp2(s[0] - shift, fastmath=True)
            p1 = cute.math.exp2(s[1] - shift, fastmath=True)
            p2 = cute.math.exp2(s[2] - shift, fastmath=True)
            p3 = cute.math.exp2(s[3] - shift, fastmath=True)
            ml[1] = ml[1] * alpha + (p0 + p1) + (p2 + p3)
            ml[0] = m_new
            # P as the A operand of the PV MMA: columns 2t, 2t+1 are keys kb+2t, +1 (tile 0);
            # columns 2t+8, 2t+9 are keys kb+8+2t, +1 (tile 1). V (B) rows are the same keys;
            # its column n of n-tile nt is dim 8n + nt, so lane g's 16 bytes of V feed it.
            pa0 = pack(p0, p1, kind)
            pa2 = pack(p2, p3, kind)
            for nt in cutlass.range_constexpr(8):
                selector = 0x5410 if nt % 2 == 0 else 0x7632
                b0 = prmt(v_cur[0, nt // 2], v_cur[1, nt // 2], selector)
                b1 = prmt(v_cur[2, nt // 2], v_cur[3, nt // 2], selector)
                acc[nt, 0], acc[nt, 1] = mma(
                    pa0, pa2, b0, b1, acc[nt, 0] * alpha, acc[nt, 1] * alpha, kind
                )
            for j in cutlass.range_constexpr(2):
                for i in cutlass.range_constexpr(8):
                    k_cur[j, i] = k_next[j, i]
            pages[0] = pages[1]
            pages[1] = pages[2]

        # The 4 lanes of a head hold partial row sums; lane (g, t) holds dims 16t + nt and
        # 16t + 8 + nt of head g. Then the 4 warps merge through shared memory.
        l_run = ml[1]
        l_run = l_run + cute.arch.shuffle_sync_bfly(l_run, 1)
        l_run = l_run + cute.arch.shuffle_sync_bfly(l_run, 2)
        smem = SmemAllocator()
        sm_o = smem.allocate_tensor(
            Float32,
            cute.make_layout((WARPS, GROUP, HEAD_DIM), stride=(GROUP * HEAD_DIM, HEAD_DIM, 1)),
            byte_alignment=16,
        )
        sm_ml = smem.allocate_tensor(
            Float32,
            cute.make_layout((WARPS, GROUP, 2), stride=(GROUP * 2, 2, 1)),
            byte_alignment=16,
        )
        sm_flag = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=16)
        for nt in cutlass.range_constexpr(8):
            sm_o[warp, g, 16 * t + nt] = acc[nt, 0]
            sm_o[warp, g, 16 * t + 8 + nt] = acc[nt, 1]
        if t == 0:
            sm_ml[warp, g, 0] = ml[0]
            sm_ml[warp, g, 1] = l_run
        cute.arch.sync_threads()

        part = (bh * num_splits + split) * GROUP
        if tidx < GROUP * 8:
            gg = tidx // 8
            d0 = (tidx % 8) * 8
            m_cta = sm_ml[0, gg, 0]
            for w in cutlass.range_constexpr(1, WARPS):
                m_cta = cute.arch.fmax(m_cta, sm_ml[w, gg, 0])
            shift = shift_of(m_cta)
            l_cta = Float32(0.0)
            o = cute.make_rmem_tensor(8, Float32)
            for j in cutlass.range_constexpr(8):
                o[j] = 0.0
            for w in cutlass.range_constexpr(WARPS):
                scale = cute.math.exp2(sm_ml[w, gg, 0] - shift, fastmath=True)
                l_cta = l_cta + sm_ml[w, gg, 1] * scale
                for j in cutlass.range_constexpr(8):
                    o[j] = o[j] + sm_o[w, gg, d0 + j] * scale
            row(part_o, (part + gg) * HEAD_DIM + d0, 8).store(o.load())
            if tidx % 8 == 0:
                cute.make_tensor(part_ml + (part + gg) * 2, cute.make_layout(1))[0] = m_cta
                cute.make_tensor(part_ml + (part + gg) * 2 + 1, cute.make_layout(1))[0] = l_cta
        # Publish this chunk before counting it (threadFenceReduction's order).
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_threads()
        if tidx == 0:
            old = cute.arch.atomic_add(counters + bh, Int32(1), sem="acq_rel", scope="gpu")
            sm_flag[0] = old
        cute.arch.sync_threads()
        # The merge below maps 16 threads to a head: the first 128 threads do it.
        if sm_flag[0] == num_splits - 1 and tidx < GROUP * 16:
            cute.arch.fence_acq_rel_gpu()
            finish(part_o, part_ml, sinks, out, lse, counters, tidx, b, h, bh, num_splits,
                   stride_ob, stride_oh, stride_lb, stride_lh, HAS_SINKS, HAS_LSE)  # fmt: skip

    @cute.jit
    def finish(part_o, part_ml, sinks, out, lse, counters, tidx, b, h, bh, num_splits,
               stride_ob, stride_oh, stride_lb, stride_lh, HAS_SINKS: cutlass.Constexpr,
               HAS_LSE: cutlass.Constexpr):  # fmt: skip
        """The last CTA of (b, h): merge every chunk, add the sink, write out and lse."""
        g = tidx // 16
        d0 = (tidx % 16) * 4
        first = bh * num_splits * GROUP + g
        # One pass, merging chunk by chunk: the loads of 8 chunks are independent and in
        # flight together; only the running (m, l, o) chains.
        run = cute.make_rmem_tensor(2, Float32)  # the running (m, l)
        run[0] = neg_inf
        run[1] = 0.0
        o = cute.make_rmem_tensor(4, Float32)
        for j in cutlass.range_constexpr(4):
            o[j] = 0.0
        for sp in cutlass.range(num_splits, unroll=8):
            at = first + sp * GROUP
            m_sp = cute.arch.load(part_ml + at * 2, Float32, cop="cg")
            l_sp = cute.arch.load(part_ml + at * 2 + 1, Float32, cop="cg")
            o_sp = [
                cute.arch.load(part_o + at * HEAD_DIM + d0 + j, Float32, cop="cg") for j in range(4)
            ]
            m_new = cute.arch.fmax(run[0], m_sp)
            shift = shift_of(m_new)
            a = cute.math.exp2(run[0] - shift, fastmath=True)
            c = cute.math.exp2(m_sp - shift, fastmath=True)
            run[1] = run[1] * a + l_sp * c
            for j in cutlass.range_constexpr(4):
                o[j] = o[j] * a + o_sp[j] * c
            run[0] = m_new
        m_all = run[0]
        l_all = run[1]
        head = h * GROUP + g
        m_fin = m_all
        l_fin = l_all
        if cutlass.const_expr(HAS_SINKS):
            sink = scalar(sinks, head).to(Float32) * LOG2E
            m_fin = cute.arch.fmax(m_all, sink)
            shift_fin = shift_of(m_fin)
            alpha = cute.math.exp2(m_all - shift_fin, fastmath=True)
            # sink == shift: the term is exactly 1, also for sink = +inf (sink - shift is NaN).
            term = cute.math.exp2(sink - shift_fin, fastmath=True)
            term = Float32(cutlass.select_(sink == shift_fin, Float32(1.0), term))
            l_fin = l_all * alpha + term
            for j in cutlass.range_constexpr(4):
                o[j] = o[j] * alpha
        inv = Float32(cutlass.select_(l_fin > 0.0, 1.0 / l_fin, Float32(0.0)))
        for j in cutlass.range_constexpr(4):
            o[j] = o[j] * inv
        o_off = Int64(b) * stride_ob + Int64(head) * stride_oh + d0
        row(out, o_off, 4).store(o.load().to(out.value_type))
        if cutlass.const_expr(HAS_LSE):
            if tidx % 16 == 0:
                value = (m_fin + cute.math.log2(l_fin, fastmath=True)) * math.log(2.0)
                lse_off = Int64(b) * stride_lb + Int64(head) * stride_lh
                cute.make_tensor(lse + lse_off, cute.make_layout(1))[0] = value
        if tidx == 0:
            cute.make_tensor(counters + bh, cute.make_layout(1))[0] = Int32(0)

    @cute.jit
    def host(
        q: cute.Pointer,
        k_cache: cute.Pointer,
        v_cache: cute.Pointer,
        page_table: cute.Pointer,
        seqlens: cute.Pointer,
        sinks: cute.Pointer,
        out: cute.Pointer,
        lse: cute.Pointer,
        part_o: cute.Pointer,
        part_ml: cute.Pointer,
        counters: cute.Pointer,
        stride_qb: Int64,
        stride_qh: Int64,
        stride_kp: Int64,
        stride_ks: Int64,
        stride_kh: Int64,
        stride_vp: Int64,
        stride_vs: Int64,
        stride_vh: Int64,
        stride_pt: Int64,
        stride_ob: Int64,
        stride_oh: Int64,
        stride_lb: Int64,
        stride_lh: Int64,
        num_pages: Int32,
        max_pages: Int32,
        page_size: Int32,
        chunk: Int32,
        num_splits: Int32,
        num_kv_heads: Int32,
        batch: Int32,
        scale_log2: Float32,
        stream,
        HAS_SINKS: cutlass.Constexpr,
        HAS_LSE: cutlass.Constexpr,
        IS_BF16: cutlass.Constexpr,
        WARPS: cutlass.Constexpr,
    ):
        decode_kernel(
            q, k_cache, v_cache, page_table, seqlens, sinks, out, lse, part_o, part_ml,
            counters, stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp,
            stride_vs, stride_vh, stride_pt, stride_ob, stride_oh, stride_lb, stride_lh,
            num_pages, max_pages, page_size, chunk, num_splits, num_kv_heads, scale_log2,
            HAS_SINKS, HAS_LSE, IS_BF16, WARPS,
        ).launch(
            grid=[num_splits, num_kv_heads, batch], block=[32 * WARPS, 1, 1], stream=stream
        )  # fmt: skip

    return cutlass, cute, host


def _compile(dtype, sink_dtype, has_lse, warps, arch) -> rt.Cubin:
    cutlass, cute, host = _dsl()
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    types = {
        torch.bfloat16: cutlass.BFloat16,
        torch.float16: cutlass.Float16,
        torch.float32: cutlass.Float32,
        torch.int32: cutlass.Int32,
    }

    def ptr(torch_dtype, align):
        return make_ptr(types[torch_dtype], 0, cute.AddressSpace.gmem, assumed_align=align)

    # q and the caches are read as 32-bit words (16-byte aligned rows, checked at launch).
    words = ptr(torch.int32, 16)
    f32 = ptr(torch.float32, 16)
    i32 = ptr(torch.int32, 4)
    sinks = ptr(sink_dtype or torch.float32, 4)
    pointers = [words, words, words, i32, i32, sinks, ptr(dtype, 8), ptr(torch.float32, 4)]
    pointers += [f32, f32, i32]
    scalars = [cutlass.Int64(1)] * 13 + [cutlass.Int32(1)] * 7 + [cutlass.Float32(1.0)]
    flags = [sink_dtype is not None, has_lse, dtype == torch.bfloat16, warps]
    args = [*pointers, *scalars, make_fake_stream(), *flags]
    return rt.compile_cubin(host, args, arch)


def build(dtype, sink_dtype, has_lse: bool, warps: int = DEFAULT_CONFIG.warps) -> rt.Build:
    sink = _DTYPE_NAMES[sink_dtype] if sink_dtype is not None else "none"
    key = f"decode-{_DTYPE_NAMES[dtype]}-g{GROUP}-d{HEAD_DIM}-sink_{sink}-lse{int(has_lse)}"
    key += f"-w{warps}"
    compile_fn = functools.partial(_compile, dtype, sink_dtype, has_lse, warps)
    return rt.Build(__name__, key, compile_fn)


_PARAMS = [rt.POINTER] * 11 + [rt.INT64] * 13 + [rt.INT32] * 6 + [rt.FLOAT32]


@functools.cache
def _loaded(dtype, sink_dtype, has_lse, warps, arch) -> rt.LoadedKernel:
    cubin = rt.cubin_for(build(dtype, sink_dtype, has_lse, warps), arch)
    return rt.LoadedKernel(cubin, _PARAMS, shared_bytes=smem_bytes(warps))


_counters: dict[torch.device, torch.Tensor] = {}
_counters_lock = threading.Lock()


def _counters_for(device: torch.device) -> torch.Tensor:
    """The device's zeroed (sequence, KV head) counters; every launch leaves them zero."""
    counters = _counters.get(device)
    if counters is None:
        with _counters_lock:
            counters = _counters.get(device)
            if counters is None:
                counters = _counters[device] = torch.zeros(
                    MAX_COUNTERS, dtype=torch.int32, device=device
                )
    return counters


def _aligned(q, k_cache, v_cache, out) -> bool:
    """Whether the kernel's accesses are aligned: 16 bytes of q and of cache rows, 8 of out."""
    bits = q.stride(0) | q.stride(2) | (q.data_ptr() // q.element_size())
    for cache in (k_cache, v_cache):
        bits |= cache.stride(0) | cache.stride(1) | cache.stride(2)
        bits |= cache.data_ptr() // cache.element_size()
    out_bits = out.stride(0) | out.stride(2) | (out.data_ptr() // out.element_size())
    return bits % 8 == 0 and out_bits % 4 == 0


def plan_splits(
    sm_count: int,
    batch: int,
    num_kv_heads: int,
    capacity: int,
    config: DecodeConfig = DEFAULT_CONFIG,
) -> tuple[int, int]:
    """(chunk, splits): chunks of whole 16-key tiles, enough CTAs for `config.ctas_per_sm` on
    every SM, and no chunk under 64 keys (a merge costs about as much as reading 64 keys)."""
    wanted = max(1, -(-config.ctas_per_sm * sm_count // (batch * num_kv_heads)))
    splits = max(1, min(wanted, -(-capacity // 64)))
    chunk = -(-max(capacity, 1) // splits)
    chunk = -(-chunk // TILE) * TILE
    return chunk, max(1, -(-capacity // chunk))


def mha_decode_with_kvcache(
    q, k_cache, v_cache, *, page_table, cache_seqlens, window_left, sinks, softmax_scale, k_scale,
    v_scale, out, lse,
):  # fmt: skip
    """Decode attention over a paged cache (normalized arguments of the public op).

    q [B, 1, Hq, D]; k_cache/v_cache [num_pages, P, Hkv, D] bf16/fp16, P a multiple of 16;
    page_table [B, max_pages] int32; cache_seqlens [B] int32; sinks [Hq] or None; out
    [B, 1, Hq, D]; lse [B, 1, Hq] float32 or None. cache_seqlens is clamped to
    [0, max_pages * P], page ids into [0, num_pages).
    """
    from tokenspeed_kernel.platform import platform_of

    batch, _, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_cache.shape
    if batch == 0:
        return
    if num_pages == 0 or page_table.shape[1] == 0 or not _aligned(q, k_cache, v_cache, out):
        # Nothing to read (every sequence is empty), or a view the 16-byte accesses cannot
        # serve: the reference computes it (no engine passes such inputs on a hot path).
        from tokenspeed_kernel.ops.attention.reference import reference_decode

        reference_decode(
            q, k_cache, v_cache, page_table=page_table, cache_seqlens=cache_seqlens,
            window_left=window_left, sinks=sinks, softmax_scale=softmax_scale,
            k_scale=k_scale, v_scale=v_scale, out=out, lse=lse,
        )  # fmt: skip
        return
    if batch * num_kv_heads > MAX_COUNTERS:
        raise ValueError(
            f"{KERNEL_NAME}: {batch} sequences x {num_kv_heads} KV heads exceed the "
            f"{MAX_COUNTERS} merge counters"
        )
    platform = platform_of(q.device)
    capacity = page_table.shape[1] * page_size
    config = pinned_config(KERNEL_NAME) or DEFAULT_CONFIG
    chunk, splits = plan_splits(platform.sm_count, batch, num_kv_heads, capacity, config)
    sink_dtype = sinks.dtype if sinks is not None else None
    arch = rt.compile_arch(platform.arch)
    kernel = _loaded(q.dtype, sink_dtype, lse is not None, config.warps, arch)
    part_o = torch.empty(batch * num_kv_heads * splits * GROUP * HEAD_DIM, device=q.device)
    part_ml = torch.empty(batch * num_kv_heads * splits * GROUP * 2, device=q.device)
    lse_t = lse if lse is not None else part_ml
    lse_strides = (lse.stride(0), lse.stride(2)) if lse is not None else (0, 0)
    args = [
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        page_table.data_ptr(),
        cache_seqlens.data_ptr(),
        sinks.data_ptr() if sinks is not None else part_ml.data_ptr(),
        out.data_ptr(),
        lse_t.data_ptr(),
        part_o.data_ptr(),
        part_ml.data_ptr(),
        _counters_for(q.device).data_ptr(),
        # q and cache strides in 32-bit words (even: the alignment check above).
        q.stride(0) // 2,
        q.stride(2) // 2,
        *(x // 2 for x in k_cache.stride()[:3]),
        *(x // 2 for x in v_cache.stride()[:3]),
        page_table.stride(0),
        out.stride(0),
        out.stride(2),
        *lse_strides,
        num_pages,
        page_table.shape[1],
        page_size,
        chunk,
        splits,
        num_kv_heads,
        float(softmax_scale) * LOG2E,
    ]
    kernel.launch_grid(q.device, (splits, num_kv_heads, batch), 32 * config.warps, args)


def supports(request, platform) -> Support:
    arch = rt.compile_arch(platform.arch)
    if arch is None:
        return Support.no(f"CuTe DSL cubins are built for sm_90 and sm_100, not {platform.arch}")
    if request.page_size % TILE:
        return Support.no(f"page size {request.page_size} is not a multiple of {TILE}")
    build_ = build(request.dtype, torch.float32 if request.sinks else None, request.lse)
    if not rt.available(build_, arch):
        return Support.no(rt.missing_reason(build_, arch))
    return Support.yes()


def cute_builds() -> list[rt.Build]:
    return [
        build(dtype, sink_dtype, has_lse, warps)
        for dtype in HALF
        for sink_dtype in (None, torch.float32, torch.bfloat16)
        for has_lse in (False, True)
        for warps in CONFIG_WARPS
    ]


def register() -> None:
    register_kernel(
        "mha_decode_with_kvcache",
        name=KERNEL_NAME,
        backend="cute",
        platforms=["nvidia:sm_90,sm_100"],
        traits=dict(
            dtype=HALF,
            kv_dtype=HALF,
            head_dim=(HEAD_DIM,),
            gqa_ratio=(GROUP,),
            page_size=(16, 32, 64, 128),
            q_len=(1,),
            sinks=True,
            lse=True,
        ),
        # Below triton.mha_decode_with_kvcache (100) until a measured ranking says otherwise.
        priority=80,
        supports=supports,
        description="CuTe DSL single-launch split-KV decode; last CTA merges; GPT-OSS heads",
    )(mha_decode_with_kvcache)
