"""`mha_decode_with_kvcache` written with the CuTe DSL: one launch, split-KV, for GPT-OSS's
small-batch full-context layers (8 query heads per KV head, head dim 64, sinks, one query).

Why: at B=1 a two-launch split/reduce decode sits about 2x above the copy floor; here the
CTAs of one (sequence, KV head) each reduce a chunk of keys for all 8 query heads, and the
last CTA to finish (an atomic counter) merges the chunks, so the merge costs no second launch.

A CTA is 4 warps; warp w takes key tiles of 16 keys, w, w+4, ... of its chunk. Lane
(kg = lane / 8, dc = lane % 8) holds the 8 heads' query slice q[g, 8dc:8dc+8] and reads 16
bytes of K and of V per key for keys kg, kg+4, kg+8, kg+12 of a tile (one page per tile: the
page size is a multiple of 16). Scores are reduced over the 8 lanes of a key group by
shuffles; softmax runs online in the log2 domain per lane, then lanes, warps (shared memory)
and chunks (global workspace) are merged with the same max/rescale rule. Keys past the
sequence are read at the last visible key's address (never outside the visible cache) and
weighted 0. The per-(sequence, KV head) counters live in a zeroed per-device buffer and are
reset by the last CTA, so the kernel replays in CUDA graphs; two streams must not run this
kernel on the same device at the same time (their counters would mix).

The DSL is needed only to compile (see `_cute_runtime`).
"""

# No `from __future__ import annotations`: the DSL evaluates the kernels' annotations in the
# module's globals, where `cute` (imported lazily, in `_dsl`) is not.
import functools
import math
import threading

import torch

from tokenspeed_kernel.registry import Support, register_kernel

from . import _cute_runtime as rt

KERNEL_NAME = "cute.mha_decode_with_kvcache"
HALF = (torch.bfloat16, torch.float16)
GROUP = 8  # query heads per KV head (GPT-OSS)
HEAD_DIM = 64
WARPS = 4
THREADS = 32 * WARPS
TILE = 16  # keys per warp per iteration: 4 key groups x 4
LOG2E = math.log2(math.e)
# Shared memory: the 4 warps' (m, l, o) for the CTA merge, the counter's old value, and
# slack for the allocator's alignment.
SMEM_BYTES = WARPS * GROUP * (HEAD_DIM + 2) * 4 + 16 + 1024
# Enough CTAs to give every SM two (the kernel's registers allow about that many).
CTAS_PER_SM = 2
MAX_COUNTERS = 1 << 18
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}


@functools.cache
def _dsl():
    """The kernel and its host launcher, built on first use (imports the DSL, about 3 s)."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils as utils
    from cutlass import Float32, Int32, Int64

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

    def load_tile(buf, cache, page, stride_p, stride_s, head_off, kb, kg, hi, page_size):
        """16 bytes of keys kb+kg, +4, +8, +12 (one page) into buf [4, 8]; keys past hi read
        the last visible key, or slot 0 where the tile lies past it."""
        page_start = kb - kb % page_size
        base = page * stride_p + head_off
        for u in range(4):
            slot = cutlass.max(cutlass.min(kb + kg + 4 * u, hi - 1) - page_start, 0)
            buf[u, None].store(row(cache, base + Int64(slot) * stride_s, 8).load())

    @cute.jit
    def merge_lanes(m_r, l_r, acc, offset: cutlass.Constexpr):
        """Merge each head's (m, l, acc) with the lane `offset` away (butterfly)."""
        for g in cutlass.range_constexpr(GROUP):
            m_o = cute.arch.shuffle_sync_bfly(m_r[g], offset)
            l_o = cute.arch.shuffle_sync_bfly(l_r[g], offset)
            m_new = cute.arch.fmax(m_r[g], m_o)
            shift = shift_of(m_new)
            a = cute.math.exp2(m_r[g] - shift, fastmath=True)
            b = cute.math.exp2(m_o - shift, fastmath=True)
            l_r[g] = l_r[g] * a + l_o * b
            for j in cutlass.range_constexpr(8):
                acc_o = cute.arch.shuffle_sync_bfly(acc[g, j], offset)
                acc[g, j] = acc[g, j] * a + acc_o * b
            m_r[g] = m_new

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
    ):
        tidx, _, _ = cute.arch.thread_idx()
        split, h, b = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32
        kg = lane // 8
        dc = lane % 8
        bh = Int64(b) * num_kv_heads + h

        seqlen = scalar(seqlens, Int64(b))
        seqlen = cutlass.max(cutlass.min(seqlen, max_pages * page_size), 0)
        lo = split * chunk
        hi = cutlass.min(lo + chunk, seqlen)

        qf = cute.make_rmem_tensor((GROUP, 8), Float32)
        for g in cutlass.range_constexpr(GROUP):
            q_off = Int64(b) * stride_qb + Int64(h * GROUP + g) * stride_qh + dc * 8
            qv = row(q, q_off, 8).load().to(Float32)
            for j in cutlass.range_constexpr(8):
                qf[g, j] = qv[j] * scale_log2
        m_r = cute.make_rmem_tensor(GROUP, Float32)
        l_r = cute.make_rmem_tensor(GROUP, Float32)
        acc = cute.make_rmem_tensor((GROUP, 8), Float32)
        for g in cutlass.range_constexpr(GROUP):
            m_r[g] = neg_inf
            l_r[g] = 0.0
            for j in cutlass.range_constexpr(8):
                acc[g, j] = 0.0

        # Software pipeline, per warp: K of the next tile and the page id of the one after
        # are in flight while this tile computes; V is loaded at the top of its own tile and
        # arrives during the scores. Every address is inside the cache: tiles past the
        # sequence read the last visible key (or slot 0 of a clamped page) and weigh 0.
        pages = cute.make_rmem_tensor(3, Int64)
        k_cur = cute.make_rmem_tensor((4, 8), k_cache.value_type)
        k_next = cute.make_rmem_tensor((4, 8), k_cache.value_type)
        v_cur = cute.make_rmem_tensor((4, 8), v_cache.value_type)
        s = cute.make_rmem_tensor((4, GROUP), Float32)
        k_head = Int64(h) * stride_kh + dc * 8
        v_head = Int64(h) * stride_vh + dc * 8
        kb0 = lo + warp * TILE
        step = WARPS * TILE
        pages[0] = page_of(page_table, b, stride_pt, kb0, page_size, max_pages, num_pages)
        pages[1] = page_of(page_table, b, stride_pt, kb0 + step, page_size, max_pages, num_pages)
        load_tile(k_cur, k_cache, pages[0], stride_kp, stride_ks, k_head, kb0, kg, hi, page_size)
        for kb in cutlass.range(kb0, hi, step, unroll=1):
            load_tile(v_cur, v_cache, pages[0], stride_vp, stride_vs, v_head, kb, kg, hi, page_size)
            load_tile(
                k_next,
                k_cache,
                pages[1],
                stride_kp,
                stride_ks,
                k_head,
                kb + step,
                kg,
                hi,
                page_size,
            )
            pages[2] = page_of(
                page_table, b, stride_pt, kb + 2 * step, page_size, max_pages, num_pages
            )
            for u in cutlass.range_constexpr(4):
                kf = k_cur[u, None].load().to(Float32)
                for g in cutlass.range_constexpr(GROUP):
                    dot = qf[g, 0] * kf[0]
                    for j in cutlass.range_constexpr(1, 8):
                        dot = dot + qf[g, j] * kf[j]
                    dot = dot + cute.arch.shuffle_sync_bfly(dot, 1)
                    dot = dot + cute.arch.shuffle_sync_bfly(dot, 2)
                    dot = dot + cute.arch.shuffle_sync_bfly(dot, 4)
                    visible = kb + kg + 4 * u < hi
                    s[u, g] = Float32(cutlass.select_(visible, dot, Float32(neg_inf)))
            v0 = v_cur[0, None].load().to(Float32)
            v1 = v_cur[1, None].load().to(Float32)
            v2 = v_cur[2, None].load().to(Float32)
            v3 = v_cur[3, None].load().to(Float32)
            for g in cutlass.range_constexpr(GROUP):
                m_new = m_r[g]
                for u in cutlass.range_constexpr(4):
                    m_new = cute.arch.fmax(m_new, s[u, g])
                shift = shift_of(m_new)
                alpha = cute.math.exp2(m_r[g] - shift, fastmath=True)
                p0 = cute.math.exp2(s[0, g] - shift, fastmath=True)
                p1 = cute.math.exp2(s[1, g] - shift, fastmath=True)
                p2 = cute.math.exp2(s[2, g] - shift, fastmath=True)
                p3 = cute.math.exp2(s[3, g] - shift, fastmath=True)
                l_r[g] = l_r[g] * alpha + (p0 + p1) + (p2 + p3)
                for j in cutlass.range_constexpr(8):
                    pv = p0 * v0[j] + p1 * v1[j] + p2 * v2[j] + p3 * v3[j]
                    acc[g, j] = acc[g, j] * alpha + pv
                m_r[g] = m_new
            k_cur.store(k_next.load())
            pages[0] = pages[1]
            pages[1] = pages[2]

        # Lanes of the 4 key groups hold the same dims: merge them, then the 4 warps.
        merge_lanes(m_r, l_r, acc, 8)
        merge_lanes(m_r, l_r, acc, 16)
        smem = utils.SmemAllocator()
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
        if kg == 0:
            for g in cutlass.range_constexpr(GROUP):
                for j in cutlass.range_constexpr(8):
                    sm_o[warp, g, dc * 8 + j] = acc[g, j]
                if dc == 0:
                    sm_ml[warp, g, 0] = m_r[g]
                    sm_ml[warp, g, 1] = l_r[g]
        cute.arch.sync_threads()

        part = (bh * num_splits + split) * GROUP
        if tidx < GROUP * 8:
            g = tidx // 8
            d0 = (tidx % 8) * 8
            m_cta = sm_ml[0, g, 0]
            for w in cutlass.range_constexpr(1, WARPS):
                m_cta = cute.arch.fmax(m_cta, sm_ml[w, g, 0])
            shift = shift_of(m_cta)
            l_cta = Float32(0.0)
            o = cute.make_rmem_tensor(8, Float32)
            for j in cutlass.range_constexpr(8):
                o[j] = 0.0
            for w in cutlass.range_constexpr(WARPS):
                scale = cute.math.exp2(sm_ml[w, g, 0] - shift, fastmath=True)
                l_cta = l_cta + sm_ml[w, g, 1] * scale
                for j in cutlass.range_constexpr(8):
                    o[j] = o[j] + sm_o[w, g, d0 + j] * scale
            row(part_o, (part + g) * HEAD_DIM + d0, 8).store(o.load())
            if tidx % 8 == 0:
                cute.make_tensor(part_ml + (part + g) * 2, cute.make_layout(1))[0] = m_cta
                cute.make_tensor(part_ml + (part + g) * 2 + 1, cute.make_layout(1))[0] = l_cta
        # Publish this chunk before counting it (threadFenceReduction's order).
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_threads()
        if tidx == 0:
            old = cute.arch.atomic_add(counters + bh, Int32(1), sem="acq_rel", scope="gpu")
            sm_flag[0] = old
        cute.arch.sync_threads()
        if sm_flag[0] == num_splits - 1:
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
        m_all = Float32(neg_inf)
        for sp in cutlass.range(num_splits, unroll=4):
            m_sp = cute.arch.load(part_ml + (first + sp * GROUP) * 2, Float32, cop="cg")
            m_all = cute.arch.fmax(m_all, m_sp)
        shift = shift_of(m_all)
        l_all = Float32(0.0)
        o = cute.make_rmem_tensor(4, Float32)
        for j in cutlass.range_constexpr(4):
            o[j] = 0.0
        for sp in cutlass.range(num_splits, unroll=4):
            at = first + sp * GROUP
            m_sp = cute.arch.load(part_ml + at * 2, Float32, cop="cg")
            l_sp = cute.arch.load(part_ml + at * 2 + 1, Float32, cop="cg")
            scale = cute.math.exp2(m_sp - shift, fastmath=True)
            l_all = l_all + l_sp * scale
            for j in cutlass.range_constexpr(4):
                o_sp = cute.arch.load(part_o + at * HEAD_DIM + d0 + j, Float32, cop="cg")
                o[j] = o[j] + o_sp * scale
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
    ):
        decode_kernel(
            q, k_cache, v_cache, page_table, seqlens, sinks, out, lse, part_o, part_ml,
            counters, stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp,
            stride_vs, stride_vh, stride_pt, stride_ob, stride_oh, stride_lb, stride_lh,
            num_pages, max_pages, page_size, chunk, num_splits, num_kv_heads, scale_log2,
            HAS_SINKS, HAS_LSE,
        ).launch(
            grid=[num_splits, num_kv_heads, batch], block=[THREADS, 1, 1], stream=stream
        )  # fmt: skip

    return cutlass, cute, host


def _compile(dtype, sink_dtype, has_lse, arch) -> rt.Cubin:
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

    half = ptr(dtype, 16)
    f32 = ptr(torch.float32, 16)
    i32 = ptr(torch.int32, 4)
    sinks = ptr(sink_dtype or torch.float32, 4)
    pointers = [half, half, half, i32, i32, sinks, ptr(dtype, 8), ptr(torch.float32, 4), f32, f32]
    pointers.append(i32)
    scalars = [cutlass.Int64(1)] * 13 + [cutlass.Int32(1)] * 7 + [cutlass.Float32(1.0)]
    args = [*pointers, *scalars, make_fake_stream(), sink_dtype is not None, has_lse]
    return rt.compile_cubin(host, args, arch)


def build(dtype, sink_dtype, has_lse: bool) -> rt.Build:
    sink = _DTYPE_NAMES[sink_dtype] if sink_dtype is not None else "none"
    key = f"decode-{_DTYPE_NAMES[dtype]}-g{GROUP}-d{HEAD_DIM}-sink_{sink}-lse{int(has_lse)}"
    return rt.Build(__name__, key, functools.partial(_compile, dtype, sink_dtype, has_lse))


_PARAMS = [rt.POINTER] * 11 + [rt.INT64] * 13 + [rt.INT32] * 6 + [rt.FLOAT32]


@functools.cache
def _loaded(dtype, sink_dtype, has_lse, arch) -> rt.LoadedKernel:
    cubin = rt.cubin_for(build(dtype, sink_dtype, has_lse), arch)
    return rt.LoadedKernel(cubin, _PARAMS, shared_bytes=SMEM_BYTES)


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


def plan_splits(sm_count: int, batch: int, num_kv_heads: int, capacity: int) -> tuple[int, int]:
    """(chunk, splits): chunks of whole 16-key tiles, enough CTAs to give every SM two, and no
    chunk under 64 keys (a merge costs about as much as reading 64 keys)."""
    wanted = max(1, -(-CTAS_PER_SM * sm_count // (batch * num_kv_heads)))
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
    chunk, splits = plan_splits(platform.sm_count, batch, num_kv_heads, capacity)
    sink_dtype = sinks.dtype if sinks is not None else None
    kernel = _loaded(q.dtype, sink_dtype, lse is not None, rt.compile_arch(platform.arch))
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
        q.stride(0),
        q.stride(2),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
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
    kernel.launch_grid(q.device, (splits, num_kv_heads, batch), THREADS, args)


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
        build(dtype, sink_dtype, has_lse)
        for dtype in HALF
        for sink_dtype in (None, torch.float32, torch.bfloat16)
        for has_lse in (False, True)
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
