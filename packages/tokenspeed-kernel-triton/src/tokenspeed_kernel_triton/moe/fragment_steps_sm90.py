"""Device-side pieces of the Hopper fragment GEMM (wgmma_gemm_sm90.py): the cp.async ring's copies
and one ring step of decode + wgmma, with the e8m0 factors multiplied into the weight halves
(`mma_step`), applied to fp32 partials after the MMA (`post_scaled_step`, POST_SCALE), or on
e4m3 fragments (`e4m3_step`, FP8 MMAs)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

from . import shift_words_sm90
from .mxfp4_words import bf16_scale_factors, decode_word_slots_tables


@gluon.jit
def decode_fragment(
    words,
    scale_words,
    lo_table,
    hi_table,
    dot_a: gl.constexpr,
    BLOCK_W: gl.constexpr,
    SHIFT: gl.constexpr,
    F16: gl.constexpr,
    RAW: gl.constexpr,
):
    """words [BLOCK_W, 16] int32 in the words layout and scale_words [BLOCK_W] int32 (a row's
    four e8m0 bytes of this K chunk, in the words layout's row slice) -> [BLOCK_W, 128] bf16
    (fp16 with F16) in wgmma's A-operand layout. Word j = 4 * jhi + jlo holds K elements
    32 * jlo + 16 * b2 + 8 * b1 + 2 * jhi + b0 in slot 4 * b2 + 2 * b1 + b0 (fragment_layout_sm90),
    so it is scaled by byte jlo. SHIFT: words in shift_words' layout for the output type; else
    mxfp4_words' byte-permute layout (bf16 only), whose lo_table / hi_table scalars
    (LOOKUP_TABLE_WORDS) are loaded at run time so that they stay in registers. RAW: shift
    words without their factors (shift_words_sm90.RAW_EXPONENT; scale_words unused)."""
    jlo = gl.arange(0, 16, layout=gl.SliceLayout(0, words.type.layout)) % 4
    zero = gl.zeros_like(words)
    selector = (jlo * 0x0101 + 0x4040)[None, :] + zero
    if RAW:
        if F16:
            e0, e1, e2, e3, e4, e5, e6, e7 = shift_words_sm90.decode_word_slots_raw_f16(words)
        else:
            e0, e1, e2, e3, e4, e5, e6, e7 = shift_words_sm90.decode_word_slots_raw_bf16(words)
    elif SHIFT:
        factor = shift_words_sm90.scale_factors(scale_words[:, None] + zero, selector, F16)
        if F16:
            e0, e1, e2, e3, e4, e5, e6, e7 = shift_words_sm90.decode_word_slots_f16(words, factor)
        else:
            e0, e1, e2, e3, e4, e5, e6, e7 = shift_words_sm90.decode_word_slots_bf16(words, factor)
    else:
        factor = bf16_scale_factors(scale_words[:, None] + zero, selector)
        e0, e1, e2, e3, e4, e5, e6, e7 = decode_word_slots_tables(
            words, factor, lo_table + zero, hi_table + zero
        )
    low = gl.join(gl.join(e0, e1), gl.join(e2, e3))
    high = gl.join(gl.join(e4, e5), gl.join(e6, e7))
    slots = gl.join(low, high)  # [W, 16, b0, b1, b2]
    slots = gl.reshape(slots, [BLOCK_W, 4, 4, 2, 2, 2])  # [W, jhi, jlo, b0, b1, b2]
    frag = gl.permute(slots, (0, 2, 5, 4, 1, 3))  # [W, jlo, b2, b1, jhi, b0]: K order
    frag = gl.reshape(frag, [BLOCK_W, 128])
    return gl.convert_layout(frag, dot_a, assert_trivial=True)


@gluon.jit
def step_view(ring, slot, CHUNKS: gl.constexpr, step_layout: gl.constexpr):
    """Ring step `slot` of an unswizzled ring [STAGES * CHUNKS, ...] as one [CHUNKS, ...] view of
    its buffers (the same row-major bytes), for the step's single copy. A copy per chunk would
    make Gluon's barrier analysis put a CTA barrier between them (a write after a write to one
    allocation)."""
    if len(ring.shape) == 3:
        shape: gl.constexpr = [ring.shape[0] // CHUNKS, CHUNKS, ring.shape[1], ring.shape[2]]
    else:
        shape: gl.constexpr = [ring.shape[0] // CHUNKS, CHUNKS, ring.shape[1]]
    return ring._reinterpret(ring.dtype, shape, step_layout).index(slot)


@gluon.jit
def issue_activations(
    act,
    act_lo,
    source,
    step,
    copy_layout: gl.constexpr,
    CHUNKS: gl.constexpr,
    SPLIT_A: gl.constexpr,
    BLOCK_DIAGONAL: gl.constexpr,
):
    """The activations of cp.async ring step `step` (this CTA's K chunks CHUNKS * step + c,
    c < CHUNKS, counted from chunk k_first) into ring slot step % STAGES: one [BLOCK_T, CHUNKS *
    128] copy (and the lo half, K columns further, for GEMM2). source: (a_ptr, a_rows, row_ok,
    k_first, num_k, K, K_VALID, stride_am, row_block). Columns of chunks from num_k on, and from
    K_VALID on (x's row ends at H, the weights are padded beyond it), are zero-filled, never
    read. BLOCK_DIAGONAL (POST_SCALE): tile row r takes only the K elements of scale block
    row_block[r] of each chunk; the rest is zero-filled."""
    a_ptr, a_rows, row_ok, k_first, num_k, K, K_VALID, stride_am, row_block = source
    chunk0 = step * CHUNKS
    local = gl.arange(0, CHUNKS * 128, layout=gl.SliceLayout(0, copy_layout))
    cols = (k_first + chunk0) * 128 + local
    ptrs = a_ptr + a_rows[:, None] * stride_am + cols[None, :]
    cols_ok = (cols < K_VALID) & (cols < (k_first + num_k) * 128)
    mask = row_ok[:, None] & cols_ok[None, :]
    if BLOCK_DIAGONAL:
        mask = mask & ((local // 32 % 4)[None, :] == row_block[:, None])
    slot = step % act.shape[0]
    async_copy.async_copy_global_to_shared(act.index(slot), ptrs, mask=mask)
    if SPLIT_A:
        async_copy.async_copy_global_to_shared(act_lo.index(slot), ptrs + K, mask=mask)


@gluon.jit
def issue_weights(
    source,
    step,
    words_step: gl.constexpr,
    scales_step: gl.constexpr,
    CHUNKS: gl.constexpr,
):
    """The weight words and scale words of ring step `step` into its slot, one copy per buffer.
    source: (ring_words, ring_scales, w_ptrs [CHUNKS, BLOCK_W, 16], s_ptrs [CHUNKS, BLOCK_W],
    the words' and scales' chunk strides, num_k), the pointers at the CTA's chunks k_first + c.
    Chunks from num_k on are zero-filled (nothing is read)."""
    ring_words, ring_scales, w_ptrs, s_ptrs, words_chunk_stride, scales_chunk_stride, num_k = source
    chunk0 = step * CHUNKS
    slot = step % (ring_words.shape[0] // CHUNKS)
    words_layout: gl.constexpr = w_ptrs.type.layout
    words_c = gl.arange(0, CHUNKS, layout=gl.SliceLayout(1, gl.SliceLayout(2, words_layout)))
    words_ok = (chunk0 + words_c)[:, None, None] + gl.zeros(w_ptrs.shape, gl.int32, words_layout)
    async_copy.async_copy_global_to_shared(
        step_view(ring_words, slot, CHUNKS, words_step),
        w_ptrs + chunk0 * words_chunk_stride,
        mask=words_ok < num_k,
    )
    scales_layout: gl.constexpr = s_ptrs.type.layout
    scales_c = gl.arange(0, CHUNKS, layout=gl.SliceLayout(1, scales_layout))
    scales_ok = (chunk0 + scales_c)[:, None] + gl.zeros(s_ptrs.shape, gl.int32, scales_layout)
    async_copy.async_copy_global_to_shared(
        step_view(ring_scales, slot, CHUNKS, scales_step),
        s_ptrs + chunk0 * scales_chunk_stride,
        mask=scales_ok < num_k,
    )


@gluon.jit
def post_scaled_step(
    acc,
    ring,
    ring_step,
    words_layout: gl.constexpr,
    dot_a: gl.constexpr,
    BLOCK_T: gl.constexpr,
    CHUNKS: gl.constexpr,
    IN_FLIGHT: gl.constexpr,
):
    """One ring step with the e8m0 factors applied after the MMA (POST_SCALE). The activation
    tile is block-diagonal: MMA column 4-way group g holds the tile's BLOCK_T tokens at the K
    elements of scale block g (32 * g .. of each chunk) and zeros elsewhere, so each chunk's
    product [BLOCK_W, 4 * BLOCK_T] holds per-block partial sums, and a thread's columns all
    belong to one block: its accumulator takes them times one fp32 factor per row. That costs
    a few FMAs per chunk instead of a half multiply per weight pair; the epilogue sums the
    four groups. ring: (words, scales, activations, lo activations) ring buffers and the
    byte-permute lookup tables (unused here); acc [BLOCK_W, 4 * BLOCK_T] in wgmma's layout."""
    ring_words, ring_scales, act, _, _, _ = ring
    BLOCK_W: gl.constexpr = ring_words.shape[1]
    mma: gl.constexpr = acc.type.layout
    cols = gl.arange(0, 4 * BLOCK_T, layout=gl.SliceLayout(0, mma))
    # prmt selector of each column's scale byte (its group), zeros above it.
    selector = gl.zeros([BLOCK_W, 4 * BLOCK_T], gl.int32, mma) + (0x4440 + cols // BLOCK_T)[None, :]
    # The partials and factors of the last two chunks (set from chunk 0 on): chunk c - IN_FLIGHT
    # joins `acc` once chunk c's wgmma is issued, so IN_FLIGHT chunks multiply meanwhile.
    prev = acc
    factor = acc
    older = acc
    older_factor = acc
    for c in gl.static_range(CHUNKS):
        slot = ring_step * CHUNKS + c
        words = ring_words.index(slot).load(words_layout)
        scale_words = ring_scales.index(slot).load(gl.SliceLayout(1, words_layout))
        frag = decode_fragment(
            words, scale_words, 0, 0, dot_a, BLOCK_W, True, act.dtype == gl.float16, True
        )
        b = act.index(ring_step).slice(c * 128, 128, dim=1).permute((1, 0))
        part = warpgroup_mma(frag, b, acc, use_acc=False, is_async=True)
        if IN_FLIGHT == 1:
            if c > 0:
                prev = warpgroup_mma_wait(1, deps=[prev])
                acc += prev * factor
        else:
            if c > 1:
                older = warpgroup_mma_wait(2, deps=[older])
                acc += older * older_factor
            older = prev
            older_factor = factor
        rows_scale = gl.convert_layout(scale_words, gl.SliceLayout(1, mma))
        factor = shift_words_sm90.float_factors(
            rows_scale[:, None] + selector * 0, selector, act.dtype == gl.float16
        )
        prev = part
    if IN_FLIGHT == 2:
        if CHUNKS > 1:
            older = warpgroup_mma_wait(1, deps=[older])
            acc += older * older_factor
    prev = warpgroup_mma_wait(0, deps=[prev])
    return acc + prev * factor


@gluon.jit
def mma_step(
    acc,
    ring,
    ring_step,
    words_layout: gl.constexpr,
    dot_a: gl.constexpr,
    CHUNKS: gl.constexpr,
    SHIFT_DECODE: gl.constexpr,
    SPLIT_A: gl.constexpr,
    MMA_IN_FLIGHT: gl.constexpr,
):
    """One ring step with scaled fragments (the e8m0 factor multiplied into the halves). ring:
    as post_scaled_step, with the byte-permute lookup tables (lo, hi) last."""
    ring_words, ring_scales, act, act_lo, lo_table, hi_table = ring
    BLOCK_W: gl.constexpr = ring_words.shape[1]
    for c in gl.static_range(CHUNKS):
        slot = ring_step * CHUNKS + c
        words = ring_words.index(slot).load(words_layout)
        scale_words = ring_scales.index(slot).load(gl.SliceLayout(1, words_layout))
        frag = decode_fragment(
            words,
            scale_words,
            lo_table,
            hi_table,
            dot_a,
            BLOCK_W,
            SHIFT_DECODE,
            act.dtype == gl.float16,
            False,
        )
        # Asynchronous, so that the next chunk decodes while this one multiplies; its
        # A registers stay untouched until the wait below (a fresh value per chunk).
        b = act.index(ring_step).slice(c * 128, 128, dim=1).permute((1, 0))
        acc = warpgroup_mma(frag, b, acc, is_async=True)
        if SPLIT_A:
            b_lo = act_lo.index(ring_step).slice(c * 128, 128, dim=1)
            b_lo = b_lo.permute((1, 0))
            acc = warpgroup_mma(frag, b_lo, acc, is_async=True)
        if c >= MMA_IN_FLIGHT:
            # At most MMA_IN_FLIGHT chunks multiply while the next one decodes: the
            # registers of older fragments are free again (long steps, few registers).
            acc = warpgroup_mma_wait(MMA_IN_FLIGHT * (2 if SPLIT_A else 1), deps=[acc])
    return warpgroup_mma_wait(0, deps=[acc])


# One word's 8 elements -> two registers of 4 e4m3 bytes (e4m3_fragments_sm90's word layout):
# the sign-cleared magnitude nibbles of each half-word select bytes of the block's tables ($6:
# codes 0-3, $10: codes 4-7), and one lop3 moves the 4 signs of each register onto its bytes'
# top bits (low half: bits 3, 11, 19, 27 of word << 4; high half: bits 7, 15, 23, 31).
_E4M3_DECODE = gl.constexpr("""{
.reg .b32 m, s;
and.b32 m, $2, 0x7777;
prmt.b32 $0, $6, $10, m;
shl.b32 s, $2, 4;
lop3.b32 $0, s, 0x80808080, $0, 0xEA;
shr.u32 m, $2, 16;
and.b32 m, m, 0x7777;
prmt.b32 $1, $6, $10, m;
lop3.b32 $1, $2, 0x80808080, $1, 0xEA;
}""")
# A block's table: its byte B (byte $2 & 3 of the scale word, or 0 where the selector says 4)
# into each byte, plus the code's offset from 0.5 * 2^R.
_E4M3_TABLE = gl.constexpr("{ .reg .b32 r; prmt.b32 r, $1, 0, $2; add.s32 $0, r, $3; }")


@gluon.jit
def e4m3_fragment(words, scale_words, words_layout: gl.constexpr, dot_a: gl.constexpr):
    """words [BLOCK_W, 4 quads, 4] int32 in Slice(3, words_layout) (word 4q + c of the chunk)
    and scale_words [BLOCK_W] (the row's four table bytes B_q of this chunk) -> [BLOCK_W, 128]
    e4m3 in wgmma's A-operand layout, MMA position 32c + 16h + 4q + i from word 4q + c's
    element 4h + i (e4m3_fragments_sm90)."""
    L3: gl.constexpr = gl.SliceLayout(3, words_layout)
    BLOCK_W: gl.constexpr = words.shape[0]
    quads: gl.constexpr = gl.SliceLayout(2, L3)
    q = gl.arange(0, 4, layout=gl.SliceLayout(0, quads))[None, :]
    zero = gl.zeros([BLOCK_W, 4], gl.int32, quads)
    sw = gl.convert_layout(scale_words, gl.SliceLayout(1, quads))[:, None] + zero
    # Codes 4-7 (2, 3, 4, 6): B + 16, 20, 24, 28; codes 0-3 (0, 0.5, 1, 1.5): 0, B, B + 8, 12.
    high = gl.inline_asm_elementwise(
        _E4M3_TABLE, "=r,r,r,r", [sw, q * 0x1111 + zero, zero + 0x1C181410],
        dtype=gl.int32, is_pure=True, pack=1,
    )  # fmt: skip
    low = gl.inline_asm_elementwise(
        _E4M3_TABLE, "=r,r,r,r", [sw, q * 0x1110 + 4 + zero, zero + 0x0C080000],
        dtype=gl.int32, is_pure=True, pack=1,
    )  # fmt: skip
    zero4 = gl.zeros([BLOCK_W, 4, 4, 4], gl.int32, words_layout)
    low4 = gl.expand_dims(gl.expand_dims(low, 2), 3) + zero4
    high4 = gl.expand_dims(gl.expand_dims(high, 2), 3) + zero4
    half0, half1 = gl.inline_asm_elementwise(
        _E4M3_DECODE, "=r,=r" + ",r" * 12, [gl.expand_dims(words, 3) + zero4, low4, high4],
        dtype=(gl.float8e4nv, gl.float8e4nv), is_pure=True, pack=4,
    )  # fmt: skip
    frag = gl.join(half0, half1)  # [W, q, c, i, h]
    frag = gl.permute(frag, (0, 2, 4, 1, 3))  # [W, c, h, q, i]: MMA order
    frag = gl.reshape(frag, [BLOCK_W, 128])
    return gl.convert_layout(frag, dot_a, assert_trivial=True)


@gluon.jit
def e4m3_step(acc, ring, ring_step, words_layout: gl.constexpr, dot_a: gl.constexpr,
              CHUNKS: gl.constexpr):  # fmt: skip
    """One ring step on e4m3 fragments and activations (FP8 wgmma: GEMM2 only, whose sums
    are rounded once, into the output; FP8 wgmma's running sums err by up to ~6e-4 of
    sum |a||b| over K = 2944, which in GEMM1 would move some of the SwiGLU's e4m3
    roundings). Each chunk's wgmma is waited for before the next chunk decodes: an 8-bit
    fragment cannot be kept live across a wait (Gluon rejects 8-bit deps), and ptxas reuses
    its registers under a running wgmma. The SM's other CTAs overlap decode and MMA
    instead. ring: as mma_step."""
    ring_words, ring_scales, act, _, _, _ = ring
    BLOCK_W: gl.constexpr = ring_words.shape[1]
    L3: gl.constexpr = gl.SliceLayout(3, words_layout)
    quad_words = ring_words._reinterpret(
        gl.int32, [ring_words.shape[0], BLOCK_W, 4, 4], gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
    )  # fmt: skip
    for c in gl.static_range(CHUNKS):
        slot = ring_step * CHUNKS + c
        words = quad_words.index(slot).load(L3)
        scale_words = ring_scales.index(slot).load(gl.SliceLayout(1, gl.SliceLayout(2, L3)))
        frag = e4m3_fragment(words, scale_words, words_layout, dot_a)
        b = act.index(ring_step).slice(c * 128, 128, dim=1).permute((1, 0))
        acc = warpgroup_mma(frag, b, acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
    return acc
