"""`kvcache_store` written with the CuTe DSL: new K/V tokens into the paged cache, quantized to
FP8 e4m3 if the cache is.

A pure copy: latency-bound at decode (T = 1..64, one small grid) and bandwidth-bound in prefill.
The grid is flat over vectors: thread i moves one VEC-element vector of K and the same vector of
V (16 bytes of bf16 each when everything is 16-byte aligned), so a T=1 GPT-OSS store (8 heads x
64) is one 64-thread CTA and T=8192 is 4096 CTAs of 128 threads, with no per-token program
overhead. Heads and head dim are compile-time constants so the index split is multiplies and
shifts. A slot outside [0, num_pages * P) (negative: padding) skips its token's vectors. FP8:
x / scale with IEEE division (div.rn), then cvt.rn.satfinite to e4m3: round to nearest even,
saturating to +-448, NaN kept, bit-identical to the core reference.

The DSL is needed only to compile (see `_cute_runtime`): without it the kernel declines, naming
the extra, unless AOT-built cubins for this source are in `TOKENSPEED_KERNEL_CUTE_CUBINS`.
"""

# No `from __future__ import annotations`: the DSL evaluates the kernels' annotations in the
# module's globals, where `cute` (imported lazily, in `_dsl`) is not.
import functools

import torch

from tokenspeed_kernel.registry import ANY, Support, register_kernel

from . import _cute_runtime as rt

KERNEL_NAME = "cute.kvcache_store"
FP8 = torch.float8_e4m3fn
HALF = (torch.bfloat16, torch.float16)
BLOCK = 128
# One thread's vector: 16 bytes of the 16-bit source, the widest global access.
MAX_VEC = 8
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16", FP8: "e4m3"}


@functools.cache
def _dsl():
    """The kernel and its host launcher, built on first use (imports the DSL, about 3 s)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int64
    from cutlass._mlir.dialects import arith, llvm
    from cutlass.cutlass_dsl import T, dsl_user_op

    @dsl_user_op
    def pin(x, *, loc=None, ip=None):
        """An opaque use of x's first element: LLVM would otherwise sink the load of x into
        the branch that stores it, after the slot's load instead of beside it."""
        word = arith.bitcast(T.i16(), x[0].ir_value(loc=loc, ip=ip), loc=loc, ip=ip)
        llvm.inline_asm(
            T.i16(),
            [word],
            "mov.b16 $0, $1;",
            "=h,h",
            has_side_effects=True,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
            loc=loc,
            ip=ip,
        )

    def vector(ptr, offset, VEC):
        return cute.make_tensor(ptr + cute.assume(offset, divby=VEC), cute.make_layout(VEC))

    def convert(x, scale, dtype, IS_FP8):
        if cutlass.const_expr(IS_FP8):
            # satfinite conversion: saturates to +-448 and keeps NaN, as torch's clamp + cast.
            return (x.to(Float32) / scale).to(dtype)
        return x

    @cute.kernel
    def store_kernel(
        k: cute.Pointer,
        v: cute.Pointer,
        k_cache: cute.Pointer,
        v_cache: cute.Pointer,
        slots: cute.Pointer,
        num_vectors: Int64,
        num_slots: Int64,
        page_size: Int64,
        stride_kt: Int64,
        stride_kh: Int64,
        stride_vt: Int64,
        stride_vh: Int64,
        stride_kcp: Int64,
        stride_kcs: Int64,
        stride_kch: Int64,
        stride_vcp: Int64,
        stride_vcs: Int64,
        stride_vch: Int64,
        k_scale: Float32,
        v_scale: Float32,
        HEADS: cutlass.Constexpr,
        HEAD_DIM: cutlass.Constexpr,
        VEC: cutlass.Constexpr,
        IS_FP8: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = Int64(bidx) * BLOCK + Int64(tidx)
        if i < num_vectors:
            vectors_per_head = HEAD_DIM // VEC
            token = i // (HEADS * vectors_per_head)
            rest = i - token * (HEADS * vectors_per_head)
            head = rest // vectors_per_head
            d = (rest - head * vectors_per_head) * VEC
            # The slot, K and V loads are independent (the sources are in bounds whatever the
            # slot): issued together, a decode-time store waits for one memory round trip
            # before its stores, not two.
            slot = cute.make_tensor(slots + token, cute.make_layout(1))[0]
            kx = vector(k, token * stride_kt + head * stride_kh + d, VEC).load()
            vx = vector(v, token * stride_vt + head * stride_vh + d, VEC).load()
            pin(kx)
            pin(vx)
            if slot >= 0 and slot < num_slots:
                page = slot // page_size
                offset = slot - page * page_size
                k_off = page * stride_kcp + offset * stride_kcs + head * stride_kch + d
                v_off = page * stride_vcp + offset * stride_vcs + head * stride_vch + d
                vector(k_cache, k_off, VEC).store(convert(kx, k_scale, k_cache.value_type, IS_FP8))
                vector(v_cache, v_off, VEC).store(convert(vx, v_scale, v_cache.value_type, IS_FP8))

    @cute.jit
    def host(
        k: cute.Pointer,
        v: cute.Pointer,
        k_cache: cute.Pointer,
        v_cache: cute.Pointer,
        slots: cute.Pointer,
        num_vectors: Int64,
        num_slots: Int64,
        page_size: Int64,
        stride_kt: Int64,
        stride_kh: Int64,
        stride_vt: Int64,
        stride_vh: Int64,
        stride_kcp: Int64,
        stride_kcs: Int64,
        stride_kch: Int64,
        stride_vcp: Int64,
        stride_vcs: Int64,
        stride_vch: Int64,
        k_scale: Float32,
        v_scale: Float32,
        stream,
        HEADS: cutlass.Constexpr,
        HEAD_DIM: cutlass.Constexpr,
        VEC: cutlass.Constexpr,
        IS_FP8: cutlass.Constexpr,
    ):
        store_kernel(
            k,
            v,
            k_cache,
            v_cache,
            slots,
            num_vectors,
            num_slots,
            page_size,
            stride_kt,
            stride_kh,
            stride_vt,
            stride_vh,
            stride_kcp,
            stride_kcs,
            stride_kch,
            stride_vcp,
            stride_vcs,
            stride_vch,
            k_scale,
            v_scale,
            HEADS,
            HEAD_DIM,
            VEC,
            IS_FP8,
        ).launch(
            grid=[(num_vectors + BLOCK - 1) // BLOCK, 1, 1], block=[BLOCK, 1, 1], stream=stream
        )

    return cutlass, cute, host


def _compile(dtype, kv_dtype, heads, head_dim, vec, arch) -> rt.Cubin:
    cutlass, cute, host = _dsl()
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    types = {
        torch.bfloat16: cutlass.BFloat16,
        torch.float16: cutlass.Float16,
        FP8: cutlass.Float8E4M3FN,
        torch.int64: cutlass.Int64,
    }

    def ptr(torch_dtype, align):
        return make_ptr(types[torch_dtype], 0, cute.AddressSpace.gmem, assumed_align=align)

    src, dst = ptr(dtype, vec * dtype.itemsize), ptr(kv_dtype, vec * kv_dtype.itemsize)
    scalars = [cutlass.Int64(1)] * 13 + [cutlass.Float32(1.0)] * 2
    args = [src, src, dst, dst, ptr(torch.int64, 8), *scalars, make_fake_stream()]
    return rt.compile_cubin(host, [*args, heads, head_dim, vec, kv_dtype == FP8], arch)


def build(dtype, kv_dtype, heads: int, head_dim: int, vec: int) -> rt.Build:
    names = (_DTYPE_NAMES[dtype], _DTYPE_NAMES[kv_dtype])
    key = f"kvcache_store-{names[0]}-{names[1]}-h{heads}-d{head_dim}-v{vec}"
    return rt.Build(
        __name__, key, functools.partial(_compile, dtype, kv_dtype, heads, head_dim, vec)
    )


_PARAMS = [rt.POINTER] * 5 + [rt.INT64] * 13 + [rt.FLOAT32] * 2


@functools.cache
def _loaded(dtype, kv_dtype, heads, head_dim, vec, arch) -> rt.LoadedKernel:
    # A library loaded context-independently serves every device of the process.
    cubin = rt.cubin_for(build(dtype, kv_dtype, heads, head_dim, vec), arch)
    return rt.LoadedKernel(cubin, _PARAMS)


def vector_width(k, v, k_cache, v_cache) -> int:
    """The widest vector (<= 16 bytes of source) that every row start and base pointer of the
    four tensors is aligned to; 1 always works (the last dim is dense, the op checks it)."""
    # A vector of `vec` elements is aligned iff every stride and every base address, counted
    # in elements, is a multiple of vec: OR them all and look at the low bits.
    bits = k.shape[2]
    for t, dims in ((k, 2), (v, 2), (k_cache, 3), (v_cache, 3)):
        bits |= t.data_ptr() // t.element_size()
        for stride in t.stride()[:dims]:
            bits |= stride
    vec = MAX_VEC
    while bits & (vec - 1):
        vec //= 2
    return vec


def kvcache_store(k, v, k_cache, v_cache, *, slot_mapping, k_scale, v_scale) -> None:
    """k/v [T, Hkv, D] into k_cache/v_cache [num_pages, P, Hkv, D] at slot_mapping [T] int64
    (slot = page * P + offset; negative or >= num_pages * P = skip); FP8 caches store
    fp8(x / scale)."""
    num_tokens, heads, head_dim = k.shape
    num_vectors = num_tokens * heads * head_dim
    if num_vectors == 0:
        return
    vec = vector_width(k, v, k_cache, v_cache)
    num_vectors //= vec
    kernel = _loaded(k.dtype, k_cache.dtype, heads, head_dim, vec, _arch(k.device))
    num_pages, page_size = k_cache.shape[:2]
    args = [
        k.data_ptr(),
        v.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slot_mapping.data_ptr(),
        num_vectors,
        num_pages * page_size,
        page_size,
        *k.stride()[:2],
        *v.stride()[:2],
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        float(k_scale),
        float(v_scale),
    ]
    grid = (num_vectors + BLOCK - 1) // BLOCK
    kernel.launch(k.device, grid, BLOCK, args)


def _arch(device: torch.device) -> str:
    from tokenspeed_kernel.platform import platform_of

    return rt.compile_arch(platform_of(device).arch) or ""


def supports(request, platform) -> Support:
    arch = rt.compile_arch(platform.arch)
    if arch is None:
        return Support.no(f"CuTe DSL cubins are built for sm_90 and sm_100, not {platform.arch}")
    # The specialization a well-aligned tensor set uses; a misaligned one falls back to a
    # narrower vector, compiled (or found) at its first use.
    vec = MAX_VEC
    while request.head_dim % vec:
        vec //= 2
    spec_build = build(request.dtype, request.kv_dtype, request.num_kv_heads, request.head_dim, vec)
    if not rt.available(spec_build, arch):
        return Support.no(rt.missing_reason(spec_build, arch))
    return Support.yes()


# The specializations the AOT build compiles: GPT-OSS (8 KV heads, D=64) into bf16 and FP8
# caches, the shared conformance cases' head counts and dims, and the tests' odd shapes, each
# at every vector width (a misaligned view takes a narrower one).
_AOT_SHAPES = ((8, 64), (1, 64), (2, 64), (4, 128), (8, 128), (3, 80), (64, 128))


def cute_builds() -> list[rt.Build]:
    return [
        build(dtype, kv_dtype, heads, head_dim, vec)
        for dtype in HALF
        for kv_dtype in (dtype, FP8)
        for heads, head_dim in _AOT_SHAPES
        for vec in (8, 4, 2, 1)
        if head_dim % vec == 0
    ]


def register() -> None:
    register_kernel(
        "kvcache_store",
        name=KERNEL_NAME,
        backend="cute",
        platforms=["nvidia:sm_90,sm_100"],
        traits=dict(dtype=HALF, kv_dtype=(*HALF, FP8), head_dim=ANY, page_size=ANY),
        # Below triton.kvcache_store (100) until a measured ranking says otherwise.
        priority=90,
        supports=supports,
        description="CuTe DSL paged K/V store; flat vector grid; FP8 saturating RNE",
    )(kvcache_store)
