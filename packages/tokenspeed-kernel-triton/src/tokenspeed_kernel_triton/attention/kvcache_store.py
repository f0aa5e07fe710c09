"""Write new K/V tokens into the paged cache (`kvcache_store`), quantizing to FP8 if the cache is.

One program stores one token's [heads, D] tile of both K and V: a pure copy, memory-bound, so
the only goals are full-width accesses and no wasted launches. A slot outside the cache
(negative: padding; past num_pages * P: a bad device value) masks the whole program's stores.
FP8: fp8(clamp(x / scale, -448, 448)) with IEEE division and round-to-nearest-even,
bit-identical to the core reference.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tokenspeed_kernel.registry import ANY, Support

from .._launch import bind_launches
from ._common import (
    FP8,
    HALF,
    fp8_verdict,
    register_attention_kernel,
)

KERNEL_NAME = "triton.kvcache_store"
# Elements of one program's [heads, D] tile per tensor: 4096 fp32 values over 4 warps is 32
# registers a thread, before spilling would start.
_MAX_TILE = 4096


@triton.jit
def _store_tile(Src, Dst, src_off, dst_off, scale, mask, IS_FP8: tl.constexpr):
    x = tl.load(Src + src_off, mask=mask)
    if IS_FP8:
        # e4m3fn has no inf: saturate first, then round to nearest even.
        y = tl.math.div_rn(x.to(tl.float32), scale)
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        y = y.to(Dst.dtype.element_ty, fp_downcast_rounding="rtne")
    else:
        y = x.to(Dst.dtype.element_ty)
    tl.store(Dst + dst_off, y, mask=mask)


@bind_launches
@triton.jit
def _kvcache_store_kernel(
    K,
    V,
    KCache,
    VCache,
    Slots,
    k_scale,
    v_scale,
    num_kv_heads,
    num_slots,
    stride_st,
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
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_FP8: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    slot = tl.load(Slots + token * stride_st)
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    # A slot outside [0, num_pages * P) (negative: padding) skips the token: one more scalar
    # compare per program, folded into the store predicate.
    slot_ok = (slot >= 0) & (slot < num_slots)
    mask = slot_ok & (heads[:, None] < num_kv_heads) & (offs_d[None, :] < HEAD_DIM)
    k_off = token * stride_kt + heads[:, None] * stride_kh + offs_d[None, :]
    v_off = token * stride_vt + heads[:, None] * stride_vh + offs_d[None, :]
    kc_off = page * stride_kcp + offset * stride_kcs + heads[:, None] * stride_kch + offs_d[None, :]
    vc_off = page * stride_vcp + offset * stride_vcs + heads[:, None] * stride_vch + offs_d[None, :]
    _store_tile(K, KCache, k_off, kc_off, k_scale, mask, IS_FP8)
    _store_tile(V, VCache, v_off, vc_off, v_scale, mask, IS_FP8)


def kvcache_store(k, v, k_cache, v_cache, *, slot_mapping, k_scale, v_scale) -> None:
    """k/v [T, Hkv, D] into k_cache/v_cache [num_pages, P, Hkv, D] at slot_mapping [T] int64
    (slot = page * P + offset; negative or >= num_pages * P = skip); FP8 caches store
    fp8(x / scale)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, _MAX_TILE // block_d))
    tile = block_h * block_d
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _kvcache_store_kernel[grid](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        float(k_scale),
        float(v_scale),
        num_kv_heads,
        k_cache.shape[0] * k_cache.shape[1],
        slot_mapping.stride(0),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        HEAD_DIM=head_dim,
        PAGE_SIZE=k_cache.shape[1],
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        IS_FP8=k_cache.dtype == FP8,
        # A warp moves 512 B of bf16 per 16-byte access round; one warp per 512 elements.
        num_warps=max(1, min(4, tile // 512)),
    )


def _interpreter_fp8_ok() -> bool:
    """Whether the Triton interpreter's float32 -> fp8 e4m3 cast rounds to nearest even.

    Triton 3.6's interpreter rounds half up on the truncated mantissa and drops the carry into
    the exponent (7.75 -> 4 instead of 8), so a quantizing store run on the CPU would be wrong;
    probed at selection time (a few microseconds) so a fixed interpreter, or the tests' openly
    documented shim, is accepted. Any failure to probe counts as broken.
    """
    try:
        import numpy as np
        from triton.runtime import interpreter

        rtne = interpreter._ir.ROUNDING_MODE.RTNE
        got = interpreter._convert_float(
            np.array([7.75], np.float32), tl.float32, tl.float8e4nv, rtne
        )
        return int(np.asarray(got).view(np.uint8).reshape(-1)[0]) == 0x50  # e4m3fn 8.0
    except Exception:  # noqa: BLE001 - a private interpreter API; unknown means unsafe
        return False


def supports(request, platform) -> Support:
    if platform.vendor == "cpu" and request.kv_dtype == FP8 and not _interpreter_fp8_ok():
        return Support.no(
            "this Triton interpreter rounds float32 -> fp8 e4m3 wrongly (7.75 does not become 8)"
        )
    return fp8_verdict(request, platform)


# GPT-OSS-shaped stores (8 KV heads, D=64) into bf16 and FP8 caches.
_AOT_CASE = dict(num_tokens=16, num_kv_heads=8, head_dim=64, page_size=64, num_pages=4)
AOT_CASES = (_AOT_CASE, dict(_AOT_CASE, kv_dtype=FP8))


def register() -> None:
    traits = dict(dtype=HALF, kv_dtype=(*HALF, FP8), head_dim=ANY, page_size=ANY)
    description = "paged K/V store; slots outside the cache skipped; FP8 saturating RNE"
    register_attention_kernel(kvcache_store, KERNEL_NAME, traits, supports, description, AOT_CASES)
