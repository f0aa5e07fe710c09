"""MXFP4 weights re-encoded as 32-bit words that decode to bf16 in a few instructions.

Checkpoint MXFP4 packs two e2m1 codes per byte (low nibble = even K element). Dequantizing that
in Triton costs ~10 integer and conversion instructions per weight (nibble split, fp16 bit
placement, fp16 -> fp32 -> bf16 conversions), which made the MoE GEMMs ALU-bound instead of
HBM- or MMA-bound. `moe_prepare_weights` therefore rewrites each run of 8 consecutive K elements
into one int32 word (same 4 bits per element, so the same bytes are read):

- element i's magnitude (the code's low 3 bits) sits in bits 4i .. 4i+2 of the word;
- element i's sign sits in bit SIGN_BITS[i] = 15, 31, 11, 27, 7, 23, 3, 19 (the top bits of the
  nibbles, permuted).

On NVIDIA sm_90+ (`decode_words_ptx`) the word becomes four bf16x2 registers [e0|e1], [e2|e3],
[e4|e5], [e6|e7]: two byte-permute lookups (prmt) produce the low and high bytes of the bf16
magnitudes, two more interleave them, and the permuted sign bits make each pair's signs one
`(word << 4j) & 0x80008000` away (a single lop3 merges them). One packed bf16 multiply applies the
e8m0 scale. That is about 2.6 instructions per weight instead of ~10. Elsewhere (AMD, the
interpreter, sm_80/89) `decode_words` decodes the same words with portable Triton arithmetic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import round_to_bf16

WORD_ELEMENTS = 8
SIGN_BITS = (15, 31, 11, 27, 7, 23, 3, 19)


def encode_words(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] uint8 checkpoint MXFP4 -> [..., K/8] int32 words (K a multiple of 8).

    Returns a new tensor; `packed` is only read."""
    if packed.shape[-1] % 4:
        raise ValueError(f"encode_words: K/2 = {packed.shape[-1]} is not a multiple of 4")
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).to(torch.int64)
    codes = codes.reshape(*packed.shape[:-1], packed.shape[-1] // 4, WORD_ELEMENTS)
    magnitude_shift = torch.arange(0, 4 * WORD_ELEMENTS, 4, device=packed.device)
    sign_shift = torch.tensor(SIGN_BITS, device=packed.device)
    word = ((codes & 7) << magnitude_shift).sum(-1) + ((codes >> 3) << sign_shift).sum(-1)
    # Wrap the unsigned 32-bit value into int32's range (two's complement).
    word = torch.where(word >= 2**31, word - 2**32, word)
    return word.to(torch.int32)


def decode_words_reference(words: torch.Tensor) -> torch.Tensor:
    """[..., K/8] int32 words -> [..., K/2] uint8 checkpoint packing (the inverse, for tests)."""
    word = words.to(torch.int64) & 0xFFFFFFFF
    magnitude_shift = torch.arange(0, 4 * WORD_ELEMENTS, 4, device=words.device)
    sign_shift = torch.tensor(SIGN_BITS, device=words.device)
    magnitude = (word[..., None] >> magnitude_shift) & 7
    codes = magnitude | (((word[..., None] >> sign_shift) & 1) << 3)
    codes = codes.reshape(*words.shape[:-1], -1, 2)
    return (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8)


@triton.jit
def decode_words(
    words, scale, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr
):
    """words [BLOCK_N, BLOCK_K/8] int32, scale [BLOCK_N, BLOCK_K/32] uint8 e8m0 ->
    [BLOCK_N, BLOCK_K] bf16 = e2m1 * 2^(scale - 127), exactly (scale bytes <= 240).

    Portable arithmetic: the magnitude shifted into an fp16's exponent/mantissa (`m << 9`) is
    exactly value * 2^-14 (code 1, 0.5, lands on the fp16 subnormal 2^-15), so each element is
    `fp16_bits * 2^(scale - 113)`, the power of two built from its float32 exponent bits.
    Scale bytes 0 and 1 make float32-subnormal products (|w| < 2^-125), which devices that flush
    denormals return as zeros; the PTX decoder works in bf16 and keeps them."""
    lane = tl.arange(0, 8)
    sign_bit = tl.where(lane % 2 == 0, 15 - 2 * lane, 33 - 2 * lane)
    w = words.to(tl.uint32, bitcast=True)[:, :, None]
    magnitude = (w >> (4 * lane)[None, None, :]) & 7
    sign = (w >> sign_bit[None, None, :]) & 1
    bits = ((magnitude << 9) | (sign << 15)).to(tl.uint16)
    value = bits.to(tl.float16, bitcast=True).to(tl.float32).reshape(BLOCK_N, BLOCK_K)
    factor = ((scale.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)
    factor = tl.broadcast_to(factor[:, :, None], (BLOCK_N, BLOCK_K // 32, 32))
    return round_to_bf16(value * factor.reshape(BLOCK_N, BLOCK_K), INTERPRETED)


def _decode_word_ptx(lo_table: str, hi_table: str) -> str:
    """PTX for one word -> 8 bf16 (outputs $0..$7 = elements 0..7); $8 = word,
    $9 = {factor, factor}. `lo_table` / `hi_table` name the first operand of the low / high byte
    lookups: an immediate, or $10 / $11 when the caller keeps the table in a register."""
    lines = [
        "{",
        ".reg .b32 m, mh, lo, hi, r0, r1, r2, r3, s;",
        "and.b32 m, $8, 0x77777777;",
        "shr.u32 mh, m, 16;",
    ]
    for half, (ra, rb) in (("m", ("r0", "r1")), ("mh", ("r2", "r3"))):
        lines += [
            f"prmt.b32 lo, {lo_table}, 0xC0804000, {half};",
            f"prmt.b32 hi, {hi_table}, 0x40404040, {half};",
            f"prmt.b32 {ra}, lo, hi, 0x5140;",
            f"prmt.b32 {rb}, lo, hi, 0x7362;",
        ]
    lines.append("lop3.b32 r0, r0, $8, 0x80008000, 0xF8;")
    for i, shift in ((1, 4), (2, 8), (3, 12)):
        lines += [f"shl.b32 s, $8, {shift};", f"lop3.b32 r{i}, r{i}, s, 0x80008000, 0xF8;"]
    lines += [f"mul.rn.bf16x2 r{i}, r{i}, $9;" for i in range(4)]
    lines += [f"mov.b32 {{${2 * i}, ${2 * i + 1}}}, r{i};" for i in range(4)]
    return "\n".join([*lines, "}"])


# One word -> 8 bf16. prmt tables: bf16 of the magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 is 0000
# 3F00 3F80 3FC0 4000 4040 4080 40C0; LO/HI hold their low/high bytes (C0800000 C0804000 /
# 3F3F3F00 40404040), indexed by the 3-bit magnitude (the selector nibble's bit 3, prmt's
# sign-replicate flag, is cleared by the 0x77777777 mask).
PTX_DECODE_WORD = tl.constexpr(_decode_word_ptx("0xC0800000", "0x3F3F3F00"))
# The same with the tables' first words in registers ($10, $11): an immediate there costs one
# register move per lookup, which ptxas re-issues every K step.
PTX_DECODE_WORD_TABLES = tl.constexpr(_decode_word_ptx("$10", "$11"))
# Table words the Hopper kernel loads into registers: bf16 LO, bf16 HI.
LOOKUP_TABLE_WORDS = (0xC0800000, 0x3F3F3F00)


@triton.jit
def word_to_halves(ptx: tl.constexpr, words, factor, HALF: tl.constexpr):
    """A one-word decoder `ptx` ($8 = int32 word, $9 = its x2 scale factor -> 8 halves $0..$7)
    applied elementwise: returns the 8 slot tensors, of type HALF. Shared with shift_words."""
    return tl.inline_asm_elementwise(
        ptx,
        "=h,=h,=h,=h,=h,=h,=h,=h,r,r",
        [words, factor],
        dtype=(HALF.value,) * 8,
        is_pure=True,
        pack=1,
    )


@triton.jit
def scale_word_factors(ptx: tl.constexpr, scale_words, selector):
    """A factor builder `ptx` ($1 = int32 scale word, $2 = prmt selector -> int32 $0)
    applied elementwise. Shared with shift_words."""
    return tl.inline_asm_elementwise(
        ptx, "=r,r,r", [scale_words, selector], dtype=tl.int32, is_pure=True, pack=1
    )


@triton.jit
def decode_word_slots(words, factor):
    """PTX_DECODE_WORD over int32 `words` and their bf16x2 scale `factor` (same shape):
    returns the 8 element tensors (slot 0..7) as bf16."""
    return word_to_halves(PTX_DECODE_WORD, words, factor, tl.bfloat16)


@triton.jit
def decode_word_slots_tables(words, factor, lo_table, hi_table):
    """decode_word_slots with the lookup tables' first words as operands (LOOKUP_TABLE_WORDS
    0 and 1, broadcast to words' shape). Called from the Gluon kernel."""
    return tl.inline_asm_elementwise(
        PTX_DECODE_WORD_TABLES,
        "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r",
        [words, factor, lo_table, hi_table],
        dtype=(tl.bfloat16,) * 8,
        is_pure=True,
        pack=1,
    )


# {s, s} << 7 for byte $2's selection of scale word $1 ($2 = b * 0x0101 + 0x4040 picks byte b
# into both halves): the bf16x2 factor 2^(s - 127); max with 0x0040 makes s = 0 the subnormal
# 2^-127 (every other s gives at least 0x0080).
PTX_BF16_SCALE_FACTOR = tl.constexpr(
    "{ .reg .b32 f, z; prmt.b32 f, $1, 0, $2; shl.b32 f, f, 7; mov.b32 z, 0x00400040; "
    "max.u16x2 $0, f, z; }"
)


@triton.jit
def bf16_scale_factors(scale_words, selector):
    """bf16x2 e8m0 factors: byte (selector - 0x4040) & 3 of each int32 scale word."""
    return scale_word_factors(PTX_BF16_SCALE_FACTOR, scale_words, selector)


@triton.jit
def decode_words_ptx(words, scale, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """`decode_words` for NVIDIA sm_90+ (mul.rn.bf16x2): the same values, via byte-permute
    lookups. The e8m0 factor 2^(s - 127) is the bf16 with exponent byte s (s = 0: the
    subnormal 2^-127, bits 0x0040), so the multiply is exact."""
    s = scale.to(tl.int32)
    factor = tl.where(s == 0, 0x0040, s << 7)
    factor = factor | (factor << 16)
    factor = tl.broadcast_to(factor[:, :, None], (BLOCK_N, BLOCK_K // 32, 4))
    factor = factor.reshape(BLOCK_N, BLOCK_K // 8)
    e0, e1, e2, e3, e4, e5, e6, e7 = decode_word_slots(words, factor)
    # join appends a trailing axis of 2: three levels give axes (bit0, bit1, bit2) of the
    # element index; permute them to (bit2, bit1, bit0) so the flattening is row-major.
    low = tl.join(tl.join(e0, e1), tl.join(e2, e3))
    high = tl.join(tl.join(e4, e5), tl.join(e6, e7))
    pairs = tl.join(low, high)
    return tl.permute(pairs, (0, 1, 4, 3, 2)).reshape(BLOCK_N, BLOCK_K)
