"""MXFP4 words that decode to bf16 or fp16 with shifts and masks, for the Hopper fragment GEMM.

The byte-permute decoder (mxfp4_words.py) spends 9 prmt and 5 lop3 per word on the 16-lane
integer pipe, which bounds the decode-sized GEMMs. This encoding uses the subnormal trick
instead: an e2m1 magnitude code c = (e1 e0 m) placed at bits 6..8 of a bf16 (9..11 of an fp16)
is exactly its value times 2^-126 (2^-14): exponent field e, mantissa m, and c = 1 (0.5) lands
on the subnormal 2^-127 (2^-15). Multiplying by the e8m0 factor times 2^126 (2^14), which the
kernel does anyway, gives the exact value.

Each int32 word holds 8 codes (slots 0..7, as mxfp4_words: one 32-element scale block); output
register k is the half pair (slot 2k, slot 2k + 1). Register k's magnitudes sit where one shift
moves both into place, and its signs where one shift moves them to bits 15 and 31. Where the two
shifts are equal, a shift and one mask make the register; else the sign shift is one another
register needs anyway, or none:

    r_k = ((word << mag_shift_k) & MAGNITUDES) | ((word << sign_shift_k) & 0x80008000)

The placements below were found by exhaustive search over the shifts (scripts/
shift_words_search.py): 5 distinct shifts and 6 lop3 per word (7 with one shr for bf16), the
fewest integer-ALU-pipe instructions of any layout of this form.

Exact ranges of the e8m0 byte s: the factor 2^(s - 1) must be a normal bf16 (s <= 128);
2^(s - 113) a normal fp16 and every value times 2^(s - 127) an fp16 (104 <= s <= 128).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .mxfp4_words import scale_word_factors, word_to_halves

# Per output half type: where the magnitude field of a half starts, and per register k the
# source bit of (low half, high half) magnitude fields and signs. Together they use each of
# the 32 bits once.
LAYOUTS = {
    "bf16": dict(
        field=6,
        magnitude=((13, 29), (6, 22), (3, 19), (0, 16)),
        sign=((11, 27), (10, 26), (12, 28), (9, 25)),
    ),
    "fp16": dict(
        field=9,
        magnitude=((9, 25), (6, 22), (3, 19), (0, 16)),
        sign=((15, 31), (12, 28), (14, 30), (13, 29)),
    ),
}
# e8m0 bytes each output type decodes exactly.
EXACT_SCALE_BYTES = {"bf16": range(0, 129), "fp16": range(104, 129)}


def _slot_bits(kind: str) -> list[tuple[int, int]]:
    """(magnitude field start, sign bit) of slots 0..7."""
    layout = LAYOUTS[kind]
    return [
        (layout["magnitude"][slot // 2][slot % 2], layout["sign"][slot // 2][slot % 2])
        for slot in range(8)
    ]


def encode(packed: torch.Tensor, kind: str) -> torch.Tensor:
    """[..., K/2] uint8 MXFP4 codes (low nibble first; 8 consecutive codes per word) ->
    [..., K/8] int32 words laid out for `kind` ("bf16" or "fp16"). `packed` is only read."""
    if packed.shape[-1] % 4:
        raise ValueError(
            f"shift_words_sm90.encode: K/2 = {packed.shape[-1]} is not a multiple of 4"
        )
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).to(torch.int64)
    codes = codes.reshape(*packed.shape[:-1], packed.shape[-1] // 4, 8)
    word = torch.zeros(codes.shape[:-1], dtype=torch.int64, device=packed.device)
    for slot, (field, sign) in enumerate(_slot_bits(kind)):
        word |= ((codes[..., slot] & 7) << field) | ((codes[..., slot] >> 3) << sign)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def decode_reference(words: torch.Tensor, kind: str) -> torch.Tensor:
    """The inverse of `encode` (for tests): [..., K/8] int32 -> [..., K/2] uint8."""
    word = words.to(torch.int64) & 0xFFFFFFFF
    codes = [
        ((word >> field) & 7) | (((word >> sign) & 1) << 3) for field, sign in _slot_bits(kind)
    ]
    codes = torch.stack(codes, dim=-1).reshape(*words.shape[:-1], -1, 2)
    return (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8)


def _shifted(dst_bit: int, src_bit: int, name: str) -> tuple[str, list[str]]:
    """(register holding the word shifted so that src_bit lands on dst_bit, PTX computing it)."""
    if dst_bit == src_bit:
        return "$8", []
    if dst_bit > src_bit:
        return name, [f"shl.b32 {name}, $8, {dst_bit - src_bit};"]
    return name, [f"shr.u32 {name}, $8, {src_bit - dst_bit};"]


def _decode_ptx(kind: str, scaled: bool = True) -> str:
    """PTX for one word ($8) times the x2 factor ($9) -> 8 halves $0..$7 (ptxas merges the
    shifts that several registers share). Unscaled: the raw halves (value * 2^-126 for bf16,
    2^-14 for fp16), for kernels that apply the e8m0 factor to their fp32 accumulators."""
    layout = LAYOUTS[kind]
    field = layout["field"]
    magnitudes = (7 << field) | (7 << (field + 16))
    mul = "mul.rn.bf16x2" if kind == "bf16" else "mul.rn.f16x2"
    lines = ["{", ".reg .b32 t, u, r;"]
    for k in range(4):
        mag_src, sign_src = layout["magnitude"][k][0], layout["sign"][k][0]
        if field - mag_src == 15 - sign_src:
            t, shift = _shifted(field, mag_src, "t")
            lines += [*shift, f"and.b32 r, {t}, {magnitudes | 0x80008000:#x};"]
        else:
            t, shift_t = _shifted(field, mag_src, "t")
            u, shift_u = _shifted(15, sign_src, "u")
            lines += [
                *shift_t,
                *shift_u,
                f"and.b32 r, {t}, {magnitudes:#x};",
                f"lop3.b32 r, r, {u}, 0x80008000, 0xF8;",  # r | (u & 0x80008000)
            ]
        if scaled:
            lines.append(f"{mul} r, r, $9;")
        lines.append(f"mov.b32 {{${2 * k}, ${2 * k + 1}}}, r;")
    return "\n".join([*lines, "}"])


PTX_DECODE_BF16 = tl.constexpr(_decode_ptx("bf16"))
PTX_DECODE_F16 = tl.constexpr(_decode_ptx("fp16"))
PTX_RAW_BF16 = tl.constexpr(_decode_ptx("bf16", scaled=False))
PTX_RAW_F16 = tl.constexpr(_decode_ptx("fp16", scaled=False))
# Raw halves are value * 2^-RAW_EXPONENT: the e8m0 factor of a kernel that scales after the MMA.
RAW_EXPONENT = {"bf16": 126, "fp16": 14}


def factor_constants(kind: str) -> tuple[int, int]:
    """(multiplier, addend) with {s, s} * multiplier + addend (mod 2^32) = the x2 factor
    2^(s - 127) * 2^126 (bf16: exponent field s + 126) or * 2^14 (fp16: field s - 98). The
    per-half fields stay below 2^16 inside EXACT_SCALE_BYTES, so carries between the halves of
    the product cancel in the sum."""
    if kind == "bf16":
        return 1 << 7, ((126 << 7) * 0x10001) & 0xFFFFFFFF
    return 1 << 10, (-(98 << 10) * 0x10001) & 0xFFFFFFFF


@triton.jit
def decode_word_slots_bf16(words, factor):
    """Shift-decode int32 `words` (bf16 layout) with their x2 `factor` (same shape) -> slots
    0..7 as bf16. Called from the Gluon kernel."""
    return word_to_halves(PTX_DECODE_BF16, words, factor, tl.bfloat16)


@triton.jit
def decode_word_slots_f16(words, factor):
    """The same for the fp16 layout -> fp16."""
    return word_to_halves(PTX_DECODE_F16, words, factor, tl.float16)


@triton.jit
def decode_word_slots_raw_bf16(words):
    """Shift-decode int32 `words` (bf16 layout) without a factor -> slots 0..7 as raw bf16:
    value * 2^-126 (code 1 is the subnormal 2^-127). Called from the Gluon kernel."""
    return word_to_halves(PTX_RAW_BF16, words, words, tl.bfloat16)  # the PTX ignores $9


@triton.jit
def decode_word_slots_raw_f16(words):
    """The same for the fp16 layout -> raw fp16: value * 2^-14."""
    return word_to_halves(PTX_RAW_F16, words, words, tl.float16)


def _float_factor_ptx(bias: int) -> str:
    """PTX: byte b of scale word $1, picked by prmt selector $2 = 0x4440 + b (zeros above it),
    -> the fp32 2^(s - 127 + bias) in $0."""
    return f"{{ .reg .b32 s; prmt.b32 s, $1, 0, $2; mad.lo.u32 $0, s, {1 << 23}, {bias << 23}; }}"


# Post-scaling (the Hopper GEMM's POST_SCALE): raw halves times the fp32 factors
# 2^(s - 127 + POST_SCALE_BIAS). The bias keeps every factor normal over the scale bytes each
# layout takes (EXACT_SCALE_BYTES), and for fp16 cancels the raw halves' 2^-14.
POST_SCALE_BIAS = {"bf16": 64, "fp16": 14}
PTX_FLOAT_FACTOR_BF16 = tl.constexpr(_float_factor_ptx(POST_SCALE_BIAS["bf16"]))
PTX_FLOAT_FACTOR_F16 = tl.constexpr(_float_factor_ptx(POST_SCALE_BIAS["fp16"]))


@triton.jit
def float_factors(scale_words, selector, F16: tl.constexpr):
    """POST_SCALE_BIAS's fp32 factors of the fp16 (F16) or bf16 layout from int32 scale words
    and prmt selectors 0x4440 + b (same shape)."""
    ptx: tl.constexpr = PTX_FLOAT_FACTOR_F16 if F16 else PTX_FLOAT_FACTOR_BF16
    return tl.inline_asm_elementwise(
        ptx, "=r,r,r", [scale_words, selector], dtype=tl.float32, is_pure=True, pack=1
    )


def pick(scale: torch.Tensor, kinds: tuple[str, ...]) -> str | None:
    """The first of `kinds` whose EXACT_SCALE_BYTES hold every byte of `scale`, else None."""
    low, high = (int(scale.min()), int(scale.max())) if scale.numel() else (127, 127)
    for kind in kinds:
        exact = EXACT_SCALE_BYTES[kind]
        if exact.start <= low and high < exact.stop:
            return kind
    return None


_BF16_MUL, _BF16_ADD = factor_constants("bf16")
_F16_MUL, _F16_ADD = factor_constants("fp16")
# Byte (selector - 0x4040) & 3 of the scale word into both halves, then the x2 factor.
PTX_FACTOR_BF16 = tl.constexpr(
    f"{{ .reg .b32 f; prmt.b32 f, $1, 0, $2; mad.lo.u32 $0, f, {_BF16_MUL}, {_BF16_ADD}; }}"
)
PTX_FACTOR_F16 = tl.constexpr(
    f"{{ .reg .b32 f; prmt.b32 f, $1, 0, $2; mad.lo.u32 $0, f, {_F16_MUL}, {_F16_ADD}; }}"
)


@triton.jit
def scale_factors(scale_words, selector, F16: tl.constexpr):
    """x2 factors for the decoders above from int32 scale words (four e8m0 bytes) and a prmt
    selector b * 0x0101 + 0x4040 picking byte b (same shape)."""
    if F16:
        return scale_word_factors(PTX_FACTOR_F16, scale_words, selector)
    return scale_word_factors(PTX_FACTOR_BF16, scale_words, selector)
