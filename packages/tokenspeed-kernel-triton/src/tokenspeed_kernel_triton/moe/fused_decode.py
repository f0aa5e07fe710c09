"""Both GEMMs of a decode step in one launch (the Hopper fragment GEMM, wgmma_gemm.py).

At M=1 each GEMM is 360 CTAs (4 experts x 90 work items), 3 per SM: one wave. As two kernels,
GEMM2's CTAs start only as GEMM1's leave (GEMM1's registers fill the SMs), so the HBM idles
while GEMM1's last steps multiply and GEMM2's CTAs start, read the routing and wait for their
first weights. benchmarks/bench_weight_stream.py streams both GEMMs' bytes 2.4 us faster as one
launch than as two (H200, benchmarks/results/moe_h200_session11.md).

Here CTA p does GEMM1's work item p, counts itself in on its tile's counter, then GEMM2's work
item p in the same shared memory: it streams its first weights at once and waits for its tile's
GEMM1 CTAs (the counter) before it copies their SwiGLU rows. Items of one tile are consecutive
CTAs, as many in both GEMMs, so a CTA waits only for CTAs of its own tile; `fits` asks for the
whole grid to be resident as well, and moe_forward runs the two kernels where it is not.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from . import shift_words
from .fragment_config import gemm2_splits
from .wgmma_gemm import allocate_ring, layouts, lookup_tables, panel_operands, tile_gemm

# Hopper's per-SM limits (sm_90: the only target of wgmma).
_SM_REGISTERS = 65536
_SM_SHARED_BYTES = 228 * 1024
_CTA_RESERVED_SHARED = 1024
_SM_THREADS = 2048
_SM_CTAS = 32
# Registers per thread for 3 CTAs of 4 warps per SM (65536 / 384, in ptxas' units of 8): the
# two GEMMs' code together takes 194 where let be, which leaves 2 CTAs per SM and the M=1 grid
# (360) unresident; capped, ptxas spills 4 registers, outside the main loops.
_MAX_REGISTERS = 168
# The post-scale factors' biases of GEMM1's bf16 and GEMM2's fp16 weight layouts.
_GEMM1_SCALE_BIAS = gl.constexpr(shift_words.POST_SCALE_BIAS["bf16"])
_GEMM2_SCALE_BIAS = gl.constexpr(shift_words.POST_SCALE_BIAS["fp16"])


@gluon.jit
def _fused_decode_kernel(
    x_ptr,
    w13_ptr,
    w13_scale_ptr,
    w13_bias_ptr,
    act_ptr,
    w2_ptr,
    w2_scale_ptr,
    w2_bias_ptr,
    y_ptr,
    route_w_ptr,
    sorted_ptr,
    tiles_ptr,
    num_tiles_ptr,
    table_ptr,
    ready_ptr,
    x_exp_ptr,
    N1,
    K1,
    K1_VALID,
    N1_VALID,
    N2,
    K2,
    K2_VALID,
    N2_VALID,
    stride_xm,
    stride_w1e,
    stride_w1p,
    stride_w1n,
    stride_w1c,
    stride_s1e,
    stride_s1p,
    stride_s1n,
    stride_s1c,
    stride_b1e,
    stride_actm,
    stride_w2e,
    stride_w2p,
    stride_w2n,
    stride_w2c,
    stride_s2e,
    stride_s2p,
    stride_s2n,
    stride_s2c,
    stride_b2e,
    stride_ym,
    ready_target,
    alpha,
    limit,
    TOPK: gl.constexpr,
    BLOCK_W: gl.constexpr,
    BLOCK_T: gl.constexpr,
    STAGES: gl.constexpr,
    CHUNKS: gl.constexpr,
    SPLIT_K: gl.constexpr,
    MMA_IN_FLIGHT: gl.constexpr,
    mma: gl.constexpr,
    dot_a: gl.constexpr,
    words_layout: gl.constexpr,
    copy_layout: gl.constexpr,
    smem_layout: gl.constexpr,
    words_copy: gl.constexpr,
    scales_copy: gl.constexpr,
    words_smem_layout: gl.constexpr,
    scales_smem_layout: gl.constexpr,
    words_step_layout: gl.constexpr,
    scales_step_layout: gl.constexpr,
):
    # The router's outputs are complete from here on; the combine may start its CTAs (it
    # waits for this grid).
    gdc_wait()
    gdc_launch_dependents()
    pid = gl.program_id(0)
    ring = allocate_ring(
        x_ptr.dtype.element_ty,
        BLOCK_W,
        4 * BLOCK_T,
        STAGES,
        CHUNKS,
        False,
        smem_layout,
        words_smem_layout,
        scales_smem_layout,
    )
    # GEMM1 (x, bf16 against bf16-layout words) -> the fp16 SwiGLU rows, then +1 on the tile.
    tile_gemm(
        pid,
        ring,
        x_ptr,
        w13_ptr,
        w13_scale_ptr,
        w13_bias_ptr,
        act_ptr,
        route_w_ptr,
        sorted_ptr,
        tiles_ptr,
        num_tiles_ptr,
        table_ptr,
        ready_ptr,
        x_exp_ptr,
        N1,
        K1,
        K1_VALID,
        N1_VALID,
        stride_xm,
        stride_w1e,
        stride_w1p,
        stride_w1n,
        stride_w1c,
        stride_s1e,
        stride_s1p,
        stride_s1n,
        stride_s1c,
        stride_b1e,
        stride_actm,
        ready_target,
        alpha,
        limit,
        TOPK,
        True,
        False,
        True,
        BLOCK_W,
        BLOCK_T,
        STAGES,
        CHUNKS,
        1,
        True,
        True,
        True,
        MMA_IN_FLIGHT,
        True,
        _GEMM1_SCALE_BIAS,
        mma,
        dot_a,
        words_layout,
        copy_layout,
        words_copy,
        scales_copy,
        words_step_layout,
        scales_step_layout,
    )
    # Every warp is done with the ring (its last reads and wgmmas were waited on) before
    # GEMM2's first copies refill it; its activations are the fp16 rows, in the same bytes.
    gl.thread_barrier()
    act, act_lo, ring_words, ring_scales = ring
    act = act._reinterpret(gl.float16, act.shape, act.type.layout)
    act_lo = act_lo._reinterpret(gl.float16, act_lo.shape, act_lo.type.layout)
    tile_gemm(
        pid,
        (act, act_lo, ring_words, ring_scales),
        act_ptr,
        w2_ptr,
        w2_scale_ptr,
        w2_bias_ptr,
        y_ptr,
        route_w_ptr,
        sorted_ptr,
        tiles_ptr,
        num_tiles_ptr,
        table_ptr,
        ready_ptr,
        x_exp_ptr,
        N2,
        K2,
        K2_VALID,
        N2_VALID,
        stride_actm,
        stride_w2e,
        stride_w2p,
        stride_w2n,
        stride_w2c,
        stride_s2e,
        stride_s2p,
        stride_s2n,
        stride_s2c,
        stride_b2e,
        stride_ym,
        ready_target,
        alpha,
        limit,
        TOPK,
        False,
        False,
        True,
        BLOCK_W,
        BLOCK_T,
        STAGES,
        CHUNKS,
        SPLIT_K,
        True,
        True,
        True,
        MMA_IN_FLIGHT,
        True,
        _GEMM2_SCALE_BIAS,
        mma,
        dot_a,
        words_layout,
        copy_layout,
        words_copy,
        scales_copy,
        words_step_layout,
        scales_step_layout,
    )


def resident_ctas_per_sm(n_regs: int, shared: int, num_warps: int) -> int:
    """CTAs of a kernel that one Hopper SM holds at once (registers are given out per warp in
    units of 256)."""
    warp_registers = -(-n_regs * 32 // 256) * 256
    return min(
        _SM_REGISTERS // (warp_registers * num_warps),
        _SM_SHARED_BYTES // (shared + _CTA_RESERVED_SHARED),
        _SM_THREADS // (32 * num_warps),
        _SM_CTAS,
    )


# Whether the fused grid is resident, by (config, device, shapes): decided once, from the
# kernel compiled for the first call's arguments.
_RESIDENT: dict[tuple, bool] = {}


def fused_decode(x, prepared: dict, act, y, routing, config, ready, x_exp, alpha, limit) -> bool:
    """Both fragment GEMMs of moe_forward in one launch, if they can run so; returns whether
    it ran. Where it did not, nothing was launched and moe_forward runs the two kernels.

    It runs for post-scaled configs on shift-decoded weights with an fp16 intermediate (act
    [rows, Ip] fp16), when GEMM1 and GEMM2 have as many work items per tile and the grid fits
    on the device at once. Arguments as wgmma_gemm.fragment_gemm's two calls; y [pairs * splits,
    H] float32 partial rows; ready: the zeroed per-tile counters."""
    if not (
        config.post_scale
        and prepared["w13_decode"] == "bf16"
        and prepared["w2_decode"] == "fp16"
        and act.dtype == torch.float16
    ):
        return False
    H, I = prepared["hidden_size"], prepared["intermediate_size"]  # noqa: E741
    Ip = prepared["padded_intermediate_size"]
    splits = gemm2_splits(config.gemm2_split_k, Ip)
    items1 = -(-2 * I // config.block_w)
    items2 = -(-H // config.block_w) * splits
    topk_weights, sorted_pairs, tiles, num_tiles, max_tiles, top_k = routing
    if items1 != items2 or ready is None or ready.numel() < max_tiles:
        return False
    w13, s13 = panel_operands(prepared["w13"], prepared["w13_scale"])
    w2, s2 = panel_operands(prepared["w2"], prepared["w2_scale"])
    b13, b2 = prepared["w13_bias"], prepared["w2_bias"]
    if b13 is None or b2 is None:
        return False
    args = (
        x, w13, s13, b13, act, w2, s2, b2, y, topk_weights, sorted_pairs, tiles, num_tiles,
        lookup_tables(x.device), ready, x_exp,
        w13.shape[1] * w13.shape[2], w13.shape[3] * 128, H, 2 * I,
        w2.shape[1] * w2.shape[2], w2.shape[3] * 128, I, H,
        x.stride(0), *w13.stride()[:4], *s13.stride()[:4], b13.stride(0), act.stride(0),
        *w2.stride()[:4], *s2.stride()[:4], b2.stride(0), y.stride(0),
        items1, alpha, limit,
    )  # fmt: skip
    grid = (max_tiles * items1,)
    constexprs = _constexprs(config, top_k, splits)
    key = (config, x.device, H, I, Ip, top_k, max_tiles)
    if key not in _RESIDENT:
        compiled = _fused_decode_kernel.warmup(*args, grid=grid, **constexprs)
        compiled._init_handles()
        per_sm = resident_ctas_per_sm(compiled.n_regs, compiled.metadata.shared, config.num_warps)
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        _RESIDENT[key] = grid[0] <= per_sm * sms
    if not _RESIDENT[key]:
        return False
    _fused_decode_kernel[grid](*args, **constexprs)
    return True


def _constexprs(config, top_k: int, splits: int) -> dict:
    return dict(
        TOPK=top_k,
        BLOCK_W=config.block_w,
        BLOCK_T=config.block_t,
        STAGES=config.stages,
        CHUNKS=config.chunks,
        SPLIT_K=splits,
        MMA_IN_FLIGHT=config.in_flight,
        num_warps=config.num_warps,
        launch_pdl=True,
        maxnreg=_MAX_REGISTERS,
        **layouts(config.block_w, config.mma_n, config.num_warps, config.chunks),
    )
