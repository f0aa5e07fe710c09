"""Shared pieces of the Gluon attention kernels: the silicon switch, layouts, memory helpers and
the one attention body that every kernel (prefill, extend, decode) runs.

The silicon-specific parts are chosen by the constexpr `ARCH` around one shared body:
`ARCH` = gfx942 / gfx950 build MFMA layouts, `cdna3.mfma`, buffer loads/stores and (gfx950)
direct-to-LDS async copies; NVIDIA builds `mma_v2` layouts and plain/cp.async loads. The
NVIDIA instantiation exists to check the shared body's numerics on the GPUs we have; the
registered kernels serve gfx942/gfx950 only.

Host-side pieces (arch codes of a launch, offsets width, configs) are in `_launch.py`.
"""

from __future__ import annotations

import math

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.amd import cdna3, cdna4
from triton.experimental.gluon.language.nvidia import ampere

CODE_NVIDIA = 0
CODE_GFX942 = 3  # = AMDMFMALayout version for CDNA3
CODE_GFX950 = 4  # = AMDMFMALayout version for CDNA4
ARCH_CODES = {"nvidia": CODE_NVIDIA, "gfx942": CODE_GFX942, "gfx950": CODE_GFX950}
ARCH_NVIDIA = gl.constexpr(CODE_NVIDIA)  # the same code as a constexpr, for the jit functions

# The softmax runs in base 2: logits are scaled by log2(e), the lse converted back by ln(2).
LOG2E = gl.constexpr(math.log2(math.e))
LN2 = gl.constexpr(math.log(2))


# ---------------------------------------------------------------------------------------------
# Layouts (built at compile time from constexprs)
# ---------------------------------------------------------------------------------------------


@gluon.constexpr_function
def warp_size(arch):
    return 32 if arch == CODE_NVIDIA else 64


@gluon.constexpr_function
def mma_layout(arch, num_warps, block_m, instr_m):
    """Accumulator layout: warps stacked along M as far as M allows, the rest along N."""
    warps_m = max(1, min(num_warps, block_m // instr_m))
    warps = [warps_m, num_warps // warps_m]
    if arch == CODE_NVIDIA:
        return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=warps, instr_shape=[16, 8])
    # 16-bit inputs: K of one MFMA is 8 (32x32) / 16 (16x16) on CDNA3, doubled on CDNA4.
    instr_k = (8 if instr_m == 32 else 16) * (2 if arch == CODE_GFX950 else 1)
    return gl.amd.AMDMFMALayout(
        version=arch, instr_shape=[instr_m, instr_m, instr_k], transposed=True, warps_per_cta=warps
    )


@gluon.constexpr_function
def operand_layout(arch, parent, index):
    """Dot operand layout for 16-bit inputs: k_width is what one lane feeds one instruction."""
    if arch == CODE_NVIDIA:
        k_width = 2
    else:
        k_width = 8 if arch == CODE_GFX950 else 4
    return gl.DotOperandLayout(operand_index=index, parent=parent, k_width=k_width)


@gluon.constexpr_function
def rows_layout(arch, num_warps, head_dim, vec):
    """Blocked [rows, head_dim] layout: `vec` contiguous elements (16 bytes) per lane."""
    lanes_d = min(head_dim // vec, warp_size(arch))
    lanes_r = warp_size(arch) // lanes_d
    return gl.BlockedLayout([1, vec], [lanes_r, lanes_d], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def kv_smem_layout(arch, block_n, head_dim):
    """LDS layout of a [keys, head_dim] tile.

    CDNA: pad every row by 16 bytes, so that the 16 rows one MFMA operand read touches start in
    different banks (row pitch 128/256 bytes would otherwise map them all to one bank group); a
    padded layout also keeps the direct-to-LDS copies of gfx950 legal, which swizzling across
    warps would not. NVIDIA: the usual 128-byte swizzle for ldmatrix.
    """
    if arch == CODE_NVIDIA:
        return gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
    return gl.PaddedSharedLayout.with_identity_for([[head_dim, 8]], [block_n, head_dim], [1, 0])


# ---------------------------------------------------------------------------------------------
# Memory and math helpers
# ---------------------------------------------------------------------------------------------


@gluon.jit
def mma(a, b, acc, ARCH: gl.constexpr):
    if ARCH == ARCH_NVIDIA:
        out = ampere.mma_v2(a, b, acc)
    else:
        out = cdna3.mfma(a, b, acc)
    return out


@gluon.jit
def load(ptr, offsets, mask, BUFFER: gl.constexpr):
    """Masked load (zeros where masked). Buffer loads: scalar base + 32-bit offsets, with the
    hardware's range check instead of a 64-bit address per lane."""
    if BUFFER:
        x = cdna3.buffer_load(ptr, offsets.to(gl.int32), mask=mask, other=0.0)
    else:
        x = gl.load(ptr + offsets, mask=mask, other=0.0)
    return x


@gluon.jit
def store(ptr, offsets, value, mask, BUFFER: gl.constexpr):
    if BUFFER:
        cdna3.buffer_store(value, ptr, offsets.to(gl.int32), mask=mask)
    else:
        gl.store(ptr + offsets, value, mask=mask)


@gluon.jit
def copy_to_smem(
    smem,
    ptr,
    offsets,
    mask,
    ARCH: gl.constexpr,
    BUFFER: gl.constexpr,
    ASYNC: gl.constexpr,
    DTYPE: gl.constexpr,
):
    """Global [rows, D] tile -> LDS. ASYNC: straight into LDS (gfx950 buffer_load_to_shared,
    NVIDIA cp.async), waited on by `wait_copies`; otherwise through registers, converting
    (FP8 -> DTYPE) on the way."""
    if ASYNC:
        if ARCH == ARCH_NVIDIA:
            ampere.async_copy.async_copy_global_to_shared(smem, ptr + offsets, mask=mask)
            ampere.async_copy.commit_group()
        else:
            cdna4.async_copy.buffer_load_to_shared(
                smem, ptr, offsets.to(gl.int32), mask=mask, other=0.0
            )
            cdna4.async_copy.commit_group()
    else:
        smem.store(load(ptr, offsets, mask, BUFFER).to(DTYPE))


@gluon.jit
def wait_copies(ARCH: gl.constexpr, ASYNC: gl.constexpr):
    if ASYNC:
        if ARCH == ARCH_NVIDIA:
            ampere.async_copy.wait_group(0)
        else:
            cdna4.async_copy.wait_group(0)
    gl.thread_barrier()


@gluon.jit
def kv_row_offsets(
    kpos,
    key_ok,
    base,
    page_row_ptr,
    num_pages,
    stride_a,
    stride_b,
    PAGED: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    WIDE: gl.constexpr,
):
    """(element offset of each key's row, whether the key exists). Paged: `page_row[kpos // P]
    * stride_a + (kpos % P) * stride_b + base`, and a page id outside [0, num_pages) makes its
    keys absent (masked: one compare per key); contiguous: `kpos * stride_a + base`. WIDE:
    64-bit (tensors past 2 GiB)."""
    if PAGED:
        page = gl.load(page_row_ptr + kpos // PAGE_SIZE, mask=key_ok, other=0)
        key_ok = key_ok & (page >= 0) & (page < num_pages)
        page = gl.where(key_ok, page, 0)
        if WIDE:
            page = page.to(gl.int64)
        rows = page * stride_a + (kpos % PAGE_SIZE) * stride_b
    else:
        rows = kpos
        if WIDE:
            rows = rows.to(gl.int64)
        rows = rows * stride_a
    return rows + base, key_ok


@gluon.jit
def sequence_bounds(cu_seqlens_ptr, seq, num_tokens):
    """(start, length) of sequence `seq`: offsets clamped to [0, T], and a sequence ending
    before its start is empty, so bad cu_seqlens never address rows outside q/k/v/out."""
    start = gl.minimum(gl.maximum(gl.load(cu_seqlens_ptr + seq), 0), num_tokens)
    end = gl.minimum(gl.maximum(gl.load(cu_seqlens_ptr + seq + 1), 0), num_tokens)
    return start, gl.maximum(end - start, 0)


@gluon.jit
def cached_keys(cache_seqlens_ptr, seq, max_keys):
    """cache_seqlens[seq] clamped to [0, max_keys]: keys past the page table do not exist."""
    return gl.minimum(gl.maximum(gl.load(cache_seqlens_ptr + seq), 0), max_keys)


# ---------------------------------------------------------------------------------------------
# The shared attention body
# ---------------------------------------------------------------------------------------------


@gluon.jit
def attend(
    q, q_pos, k_lo, k_hi, qk_scale, window_left, k_ptr, v_ptr, k_base, v_base, page_row_ptr,
    num_pages, ks_a, ks_b, vs_a, vs_b, k_smem, v_smem,
    ARCH: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    INSTR_M: gl.constexpr, NUM_WARPS: gl.constexpr, PAGED: gl.constexpr,
    PAGE_SIZE: gl.constexpr, CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr,
    BUFFER: gl.constexpr, ASYNC: gl.constexpr, WIDE: gl.constexpr, MIXED_ROWS: gl.constexpr,
):  # fmt: skip
    """Online softmax of the query rows `q` (MMA operand A, [BLOCK_M, HEAD_DIM]; row r at
    position q_pos[r]) over keys k_lo .. k_hi-1, in base 2 (qk_scale includes log2(e)).

    Returns the unnormalized accumulator, the running max and the running sum. Keys are
    visible when < k_hi, and (CAUSAL) <= the row's position, and (HAS_WINDOW) >= position - W,
    and (PAGED) on a page id in [0, num_pages).

    A key masked for a row contributes nothing to it whatever its V, and a row that sees a V
    row holding a NaN or inf gets NaN (the reference's outcome). The tiles mix rows that see a
    key with rows that mask it (causal diagonal, window edge), where a non-finite V would reach
    the masking rows as 0 * NaN in the P.V product; that shows as a non-finite accumulator row,
    and such a tile runs again with EXACT (`_attend_pass`). Finite inputs pay one reduction,
    and the registers the second pass's code takes (docs/decisions.md). MIXED_ROWS=False:
    every row sees the same keys and no key outside them is loaded (decode with one token:
    k_lo and k_hi are its bounds), so one pass is exact.
    """
    acc, m_i, l_i = _attend_pass(
        q, q_pos, k_lo, k_hi, qk_scale, window_left, k_ptr, v_ptr, k_base, v_base, page_row_ptr,
        num_pages, ks_a, ks_b, vs_a, vs_b, k_smem, v_smem, ARCH, BLOCK_M, BLOCK_N, HEAD_DIM,
        INSTR_M, NUM_WARPS, PAGED, PAGE_SIZE, CAUSAL, HAS_WINDOW, BUFFER, ASYNC, WIDE, False,
    )  # fmt: skip
    if MIXED_ROWS:
        # A row sum is finite iff its terms are (an overflowing one only costs the rerun).
        finite = (gl.abs(gl.sum(acc, 1)) < float("inf")).to(gl.int32)
        if gl.min(finite, 0) == 0:
            acc, m_i, l_i = _attend_pass(
                q, q_pos, k_lo, k_hi, qk_scale, window_left, k_ptr, v_ptr, k_base, v_base,
                page_row_ptr, num_pages, ks_a, ks_b, vs_a, vs_b, k_smem, v_smem, ARCH, BLOCK_M,
                BLOCK_N, HEAD_DIM, INSTR_M, NUM_WARPS, PAGED, PAGE_SIZE, CAUSAL, HAS_WINDOW,
                BUFFER, ASYNC, WIDE, True,
            )  # fmt: skip
    return acc, m_i, l_i


@gluon.jit
def _attend_pass(
    q, q_pos, k_lo, k_hi, qk_scale, window_left, k_ptr, v_ptr, k_base, v_base, page_row_ptr,
    num_pages, ks_a, ks_b, vs_a, vs_b, k_smem, v_smem,
    ARCH: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    INSTR_M: gl.constexpr, NUM_WARPS: gl.constexpr, PAGED: gl.constexpr,
    PAGE_SIZE: gl.constexpr, CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr,
    BUFFER: gl.constexpr, ASYNC: gl.constexpr, WIDE: gl.constexpr, EXACT: gl.constexpr,
):  # fmt: skip
    """One pass of `attend`. EXACT: V rows holding a NaN or inf are zeroed for the MMA (the
    dot then gives every row the exact finite sum) and the rows that see one are set to NaN.
    Its V goes through registers in the copy layout, converted to the MMA operand there;
    writing the scrubbed V back to LDS instead needed more VGPRs (gfx942 prefill and extend
    occupancy 2 -> 1)."""
    DTYPE: gl.constexpr = q.dtype
    MMA: gl.constexpr = mma_layout(ARCH, NUM_WARPS, BLOCK_M, INSTR_M)
    VEC: gl.constexpr = 128 // k_ptr.dtype.element_ty.primitive_bitwidth
    LD: gl.constexpr = rows_layout(ARCH, NUM_WARPS, HEAD_DIM, VEC)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LD))
    offs_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, MMA))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, MMA))
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, MMA)
    poisoned = gl.zeros([BLOCK_M], gl.int32, gl.SliceLayout(1, MMA))
    for start in range(k_lo, k_hi, BLOCK_N):
        kpos = start + offs_n
        k_rows, exists = kv_row_offsets(
            kpos, kpos < k_hi, k_base, page_row_ptr, num_pages, ks_a, ks_b, PAGED, PAGE_SIZE,
            WIDE,
        )  # fmt: skip
        v_rows, _ = kv_row_offsets(
            kpos, kpos < k_hi, v_base, page_row_ptr, num_pages, vs_a, vs_b, PAGED, PAGE_SIZE,
            WIDE,
        )  # fmt: skip
        key_ok = gl.expand_dims(exists, 1)
        k_offs = gl.expand_dims(k_rows, 1) + gl.expand_dims(offs_d, 0)
        copy_to_smem(k_smem, k_ptr, k_offs, key_ok, ARCH, BUFFER, ASYNC, DTYPE)
        v_offs = gl.expand_dims(v_rows, 1) + gl.expand_dims(offs_d, 0)
        copy_to_smem(v_smem, v_ptr, v_offs, key_ok, ARCH, BUFFER, ASYNC, DTYPE)
        wait_copies(ARCH, ASYNC)
        kt = k_smem.permute((1, 0)).load(operand_layout(ARCH, MMA, 1))
        s = mma(q, kt, gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA), ARCH) * qk_scale
        spos = gl.expand_dims(start + offs_s, 0)
        visible = spos < k_hi
        if PAGED:
            page_ok = gl.convert_layout(exists, gl.SliceLayout(0, MMA))
            visible = visible & gl.expand_dims(page_ok, 0)
        if CAUSAL:
            visible = visible & (spos <= gl.expand_dims(q_pos, 1))
        if HAS_WINDOW:
            visible = visible & (spos >= gl.expand_dims(q_pos - window_left, 1))
        s = gl.where(visible, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf: shift by 0 so exp2 gives 0, not NaN.
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - gl.expand_dims(m_use, 1))
        l_i = l_i * alpha + gl.sum(p, 1)
        acc = acc * gl.expand_dims(alpha, 1)
        if EXACT:
            v_vals = v_smem.load(LD)
            finite = (gl.abs(v_vals.to(gl.float32)) < float("inf")).to(gl.int32)
            bad = 1 - gl.min(finite, 1)  # per key: 1 where its V row is not all finite
            v_vals = gl.where(gl.expand_dims(bad, 1) > 0, gl.zeros_like(v_vals), v_vals)
            v = gl.convert_layout(v_vals, operand_layout(ARCH, MMA, 1))
            bad_s = gl.expand_dims(gl.convert_layout(bad, gl.SliceLayout(0, MMA)), 0)
            sees_bad = (visible & (bad_s > 0)).to(gl.int32)
            poisoned = gl.maximum(poisoned, gl.max(sees_bad, 1))
        else:
            v = v_smem.load(operand_layout(ARCH, MMA, 1))
        p_op = gl.convert_layout(p.to(DTYPE), operand_layout(ARCH, MMA, 0))
        acc = mma(p_op, v, acc, ARCH)
        m_i = m_new
        # The next tile overwrites the LDS buffers every warp just read.
        gl.thread_barrier()
    if EXACT:
        nan = gl.full([BLOCK_M, HEAD_DIM], float("nan"), gl.float32, MMA)
        acc = gl.where(gl.expand_dims(poisoned, 1) > 0, nan, acc)
    return acc, m_i, l_i


@gluon.jit
def add_sink(acc, m_i, l_i, sink):
    """Fold a per-row sink logit (base 2) into the softmax state: it joins the denominator
    only. Rows without a sink pass sink = -inf."""
    m_new = gl.maximum(m_i, sink)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    # sink = +inf takes all the mass (out 0, lse +inf): its term is 1, not exp2(inf - inf).
    l_new = l_i * alpha + gl.where(sink == m_use, 1.0, gl.exp2(sink - m_use))
    return acc * gl.expand_dims(alpha, 1), m_new, l_new


@gluon.jit
def normalize(acc, m_i, l_i):
    """(acc / l, lse in base 2). Rows that saw nothing (l = 0) give zeros and lse = -inf."""
    l_safe = gl.where(l_i > 0.0, l_i, 1.0)
    out = acc / gl.expand_dims(l_safe, 1)
    m_use = gl.where(m_i == float("-inf"), 0.0, m_i)
    lse2 = gl.where(l_i > 0.0, m_use + gl.log2(l_safe), float("-inf"))
    return out, lse2


@gluon.jit
def row_coords(m_start, BLOCK_M: gl.constexpr, H_PACK: gl.constexpr, LAYOUT: gl.constexpr):
    """Rows pack H_PACK query heads per token, token-major: row r is token m_start + r // H_PACK,
    head offset r % H_PACK. One K/V tile then serves every head of a GQA group."""
    r = gl.arange(0, BLOCK_M, layout=LAYOUT)
    return m_start + r // H_PACK, r % H_PACK


@gluon.jit
def load_q(
    q_ptr,
    m_start,
    n_rows,
    head0,
    stride_t,
    stride_h,
    ARCH: gl.constexpr,
    BLOCK_M: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    H_PACK: gl.constexpr,
    INSTR_M: gl.constexpr,
    NUM_WARPS: gl.constexpr,
    BUFFER: gl.constexpr,
):
    """Q rows [BLOCK_M, HEAD_DIM] of tokens m_start.. (< n_rows) as MMA operand A."""
    LD: gl.constexpr = rows_layout(ARCH, NUM_WARPS, HEAD_DIM, 8)
    MMA: gl.constexpr = mma_layout(ARCH, NUM_WARPS, BLOCK_M, INSTR_M)
    tok, g = row_coords(m_start, BLOCK_M, H_PACK, gl.SliceLayout(1, LD))
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LD))
    rows = tok * stride_t + (head0 + g) * stride_h
    offs = gl.expand_dims(rows, 1) + gl.expand_dims(d, 0)
    q = load(q_ptr, offs, gl.expand_dims(tok < n_rows, 1), BUFFER)
    return gl.convert_layout(q, operand_layout(ARCH, MMA, 0))


@gluon.jit
def load_sinks(
    sinks_ptr,
    head0,
    HAS_SINKS: gl.constexpr,
    BLOCK_M: gl.constexpr,
    H_PACK: gl.constexpr,
    LAYOUT: gl.constexpr,
):
    """Per-row sink logit in base 2; -inf (no sink) without sinks."""
    tok, g = row_coords(0, BLOCK_M, H_PACK, LAYOUT)
    if HAS_SINKS:
        sink = gl.load(sinks_ptr + head0 + g).to(gl.float32) * LOG2E
    else:
        sink = gl.full([BLOCK_M], float("-inf"), gl.float32, LAYOUT)
    return sink


@gluon.jit
def store_rows(
    out_ptr,
    lse_ptr,
    out,
    lse2,
    m_start,
    n_rows,
    head0,
    stride_t,
    stride_h,
    lse_stride_t,
    lse_stride_h,
    ARCH: gl.constexpr,
    BLOCK_M: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    H_PACK: gl.constexpr,
    NUM_WARPS: gl.constexpr,
    HAS_LSE: gl.constexpr,
    BUFFER: gl.constexpr,
):
    """Store normalized rows (and lse, natural log) of tokens m_start.. (< n_rows)."""
    LD: gl.constexpr = rows_layout(ARCH, NUM_WARPS, HEAD_DIM, 8)
    tok, g = row_coords(m_start, BLOCK_M, H_PACK, gl.SliceLayout(1, LD))
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LD))
    offs = gl.expand_dims(tok * stride_t + (head0 + g) * stride_h, 1) + gl.expand_dims(d, 0)
    value = gl.convert_layout(out, LD).to(out_ptr.dtype.element_ty)
    store(out_ptr, offs, value, gl.expand_dims(tok < n_rows, 1), BUFFER)
    if HAS_LSE:
        lse = gl.convert_layout(lse2, gl.SliceLayout(1, LD)) * LN2
        store(lse_ptr, tok * lse_stride_t + (head0 + g) * lse_stride_h, lse, tok < n_rows, BUFFER)


@gluon.jit
def finish_rows(
    acc, m_i, l_i, sinks_ptr, out_ptr, lse_ptr, base, out_base_stride, lse_base_stride,
    m_start, n_rows, head0, stride_t, stride_h, lse_stride_t, lse_stride_h,
    ARCH: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, H_PACK: gl.constexpr,
    NUM_WARPS: gl.constexpr, HAS_SINKS: gl.constexpr, HAS_LSE: gl.constexpr,
    BUFFER: gl.constexpr, ROW_LAYOUT: gl.constexpr,
):  # fmt: skip
    """The single-pass epilogue: add the sink, normalize, store the rows (and their lse) at
    `out_ptr + base * out_base_stride` (`lse_ptr + base * lse_base_stride`)."""
    sink = load_sinks(sinks_ptr, head0, HAS_SINKS, BLOCK_M, H_PACK, ROW_LAYOUT)
    acc, m_i, l_i = add_sink(acc, m_i, l_i, sink)
    out, lse2 = normalize(acc, m_i, l_i)
    store_rows(
        out_ptr + base * out_base_stride, lse_ptr + base * lse_base_stride, out, lse2, m_start,
        n_rows, head0, stride_t, stride_h, lse_stride_t, lse_stride_h, ARCH, BLOCK_M, HEAD_DIM,
        H_PACK, NUM_WARPS, HAS_LSE, BUFFER,
    )  # fmt: skip
