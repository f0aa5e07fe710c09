"""MXFP4 weights as FP8 e4m3 MMA operands, for FP8 activations (twice bf16's matrix rate).

Every e2m1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6) is an e4m3 value, and so is `e2m1 * 2^d` for
d in [-5, 6] as a normal number (0.5 * 2^-5 = 2^-6 is e4m3's smallest normal, 6 * 2^6 = 384 is
below its 448). A weight row n is therefore `row_scale[n] * w8` with w8 e4m3 exactly, as long
as its 32-element blocks' e8m0 bytes s stay within 11 binades of the row's largest:
row_scale[n] = 2^(s_max - 133) and block shift d = s - s_max + 6. The GEMM multiplies e4m3
activations by w8 on the FP8 tensor cores and scales the fp32 accumulator per output channel
(by row_scale) and per token (by the activation scale). Blocks whose codes are all zero may lie
any distance below: their shift is clamped to [-16, 6] and decodes to zeros. `encode` returns
None where a row needs more than that (a wider scale spread, or 2^(s_max - 133) below float32's
normal range); the kernel then keeps the bf16 decode of mxfp4_words.

Word format (int32 per 8 K elements, the same 4 bits per element as the checkpoint):
element i's magnitude (its code's low 3 bits) in nibble i / 2 for even i and 4 + (i - 1) / 2
for odd i, its sign in bit E4M3_SIGN_BITS[i]. On NVIDIA (`decode_e4m3_ptx`) one word is two
byte-permute lookups (prmt) into a table of e4m3 magnitude bytes shifted by d, which give the
even elements' and the odd elements' four bytes; one lop3 each merges their signs (the odd
ones' after a 4-bit shift): 7 instructions per 8 weights, plus two multiply-adds per block for
the table. Elsewhere (`decode_e4m3`) the same words decode with portable arithmetic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import round_to_fp8

WORD_ELEMENTS = 8
E4M3_MAGNITUDE_SHIFTS = (0, 16, 4, 20, 8, 24, 12, 28)
E4M3_SIGN_BITS = (7, 3, 15, 11, 23, 19, 31, 27)
# Shifts d a block may take with a nonzero code (exact e4m3 normals), and where zero blocks'
# shifts are clamped.
MIN_SHIFT, MAX_SHIFT, ZERO_BLOCK_SHIFT = -5, 6, -16
# e4m3 bytes of the e2m1 magnitudes 0, .5, 1, 1.5 (LO) and 2, 3, 4, 6 (HI) at d = 0; + d * 8 per
# nonzero byte moves them by 2^d (byte 0 of LO, the zero, never changes).
TABLE_LO, TABLE_HI = 0x3C383000, 0x4C484440
SHIFT_LO, SHIFT_HI = 0x08080800, 0x08080808
_TABLE_LO, _TABLE_HI = tl.constexpr(TABLE_LO), tl.constexpr(TABLE_HI)
_SHIFT_LO, _SHIFT_HI = tl.constexpr(SHIFT_LO), tl.constexpr(SHIFT_HI)


def encode(packed: torch.Tensor, scale: torch.Tensor):
    """Checkpoint MXFP4 [..., N, K/2] uint8 with e8m0 scale [..., N, K/32] uint8 -> (words
    [..., N, K/8] int32, block shifts [..., N, K/32] int8, row scales [..., N] float32), or None
    where some row's blocks do not fit e4m3 exactly (module doc). Inputs are only read."""
    if packed.shape[-1] % 16 or scale.shape[-1] * 16 != packed.shape[-1]:
        raise ValueError(
            f"mxfp4_e4m3.encode: K/2 = {packed.shape[-1]} bytes with {scale.shape[-1]} scale "
            "blocks; expected 16 bytes per block"
        )
    blocks = packed.reshape(*packed.shape[:-1], scale.shape[-1], 16)
    nonzero = (blocks & 0x77).ne(0).any(-1)
    s = scale.to(torch.int32)
    top = torch.where(nonzero, s, torch.zeros_like(s)).amax(-1, keepdim=True)
    top = torch.where(nonzero.any(-1, keepdim=True), top, torch.full_like(top, 127))
    shift = s - top + MAX_SHIFT
    if bool((nonzero & (shift < MIN_SHIFT)).any()) or bool((top < 133 - 126).any()):
        return None
    shift = shift.clamp(ZERO_BLOCK_SHIFT, MAX_SHIFT).to(torch.int8)
    row_scale = torch.pow(2.0, (top.squeeze(-1) - 133).to(torch.float64)).to(torch.float32)
    return encode_words(packed), shift, row_scale


def encode_words(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] uint8 checkpoint MXFP4 -> [..., K/8] int32 words in the e4m3 word format."""
    if packed.shape[-1] % 4:
        raise ValueError(f"mxfp4_e4m3.encode_words: K/2 = {packed.shape[-1]} is not a multiple of 4")
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).to(torch.int64)
    codes = codes.reshape(*packed.shape[:-1], packed.shape[-1] // 4, WORD_ELEMENTS)
    magnitude_shift = torch.tensor(E4M3_MAGNITUDE_SHIFTS, device=packed.device)
    sign_shift = torch.tensor(E4M3_SIGN_BITS, device=packed.device)
    word = ((codes & 7) << magnitude_shift).sum(-1) + ((codes >> 3) << sign_shift).sum(-1)
    word = torch.where(word >= 2**31, word - 2**32, word)
    return word.to(torch.int32)


def decode_reference(words: torch.Tensor, shift: torch.Tensor, row_scale: torch.Tensor):
    """What the kernels compute from `encode`'s tensors: [..., N, K] float32 weights."""
    word = words.to(torch.int64) & 0xFFFFFFFF
    magnitude_shift = torch.tensor(E4M3_MAGNITUDE_SHIFTS, device=words.device)
    sign_shift = torch.tensor(E4M3_SIGN_BITS, device=words.device)
    magnitude = (word[..., None] >> magnitude_shift) & 7
    sign = (word[..., None] >> sign_shift) & 1
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], device=words.device)[magnitude]
    value = torch.where(sign.bool(), -e2m1, e2m1).reshape(*words.shape[:-1], -1)
    w8 = value * torch.pow(2.0, shift.float()).repeat_interleave(32, dim=-1)
    return w8.to(torch.float8_e4m3fn).float() * row_scale[..., None]


@triton.jit
def shift_tables(shift):
    """The prmt tables (LO, HI int32) of blocks with shift d (an int8 tensor)."""
    d = shift.to(tl.int32)
    return _TABLE_LO + d * _SHIFT_LO, _TABLE_HI + d * _SHIFT_HI


# $0 / $1: the four e4m3 bytes of elements 0, 2, 4, 6 / 1, 3, 5, 7; $2: the word (its four bytes
# packed); $3 / $7: the block's LO / HI table ($4-$6 and $8-$10 are the same values: pack 4
# passes four 32-bit operands each).
_PTX_DECODE_E4M3 = tl.constexpr(
    "{ .reg .b32 m, r0, r1, s; "
    "and.b32 m, $2, 0x77777777; "
    "prmt.b32 r0, $3, $7, m; "
    "shr.u32 m, m, 16; "
    "prmt.b32 r1, $3, $7, m; "
    "lop3.b32 $0, r0, $2, 0x80808080, 0xF8; "
    "shl.b32 s, $2, 4; "
    "lop3.b32 $1, r1, s, 0x80808080, 0xF8; }"
)


@triton.jit
def decode_e4m3_ptx(word_bytes, shift, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """word_bytes [BLOCK_N, BLOCK_K/2] uint8 (the words' bytes, in memory order), shift
    [BLOCK_N, BLOCK_K/32] int8 -> [BLOCK_N, BLOCK_K] float8e4nv = e2m1 * 2^shift."""
    lo, hi = shift_tables(shift)
    lo = tl.broadcast_to(lo[:, :, None], (BLOCK_N, BLOCK_K // 32, 16)).reshape(BLOCK_N, BLOCK_K // 2)
    hi = tl.broadcast_to(hi[:, :, None], (BLOCK_N, BLOCK_K // 32, 16)).reshape(BLOCK_N, BLOCK_K // 2)
    even, odd = tl.inline_asm_elementwise(
        _PTX_DECODE_E4M3,
        "=r,=r,r,r,r,r,r,r,r,r,r",
        [word_bytes, lo, hi],
        dtype=(tl.float8e4nv, tl.float8e4nv),
        is_pure=True,
        pack=4,
    )
    # Byte b of a word's even / odd register is element 2b / 2b + 1.
    return tl.join(even, odd).reshape(BLOCK_N, BLOCK_K)


@triton.jit
def decode_e4m3(
    words, shift, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr
):
    """words [BLOCK_N, BLOCK_K/8] int32, shift [BLOCK_N, BLOCK_K/32] int8 -> [BLOCK_N,
    BLOCK_K] float8e4nv, with portable arithmetic: the magnitude placed in an fp16 (`m << 9`) is
    value * 2^-14, so each element is that fp16 times 2^(14 + shift), exact in e4m3."""
    lane = tl.arange(0, 8)
    magnitude_shift = tl.where(lane % 2 == 0, 2 * lane, 14 + 2 * lane)
    sign_bit = tl.where(lane % 2 == 0, 4 * lane + 7, 4 * lane - 1)
    w = words.to(tl.uint32, bitcast=True)[:, :, None]
    magnitude = (w >> magnitude_shift[None, None, :]) & 7
    sign = (w >> sign_bit[None, None, :]) & 1
    bits = ((magnitude << 9) | (sign << 15)).to(tl.uint16)
    value = bits.to(tl.float16, bitcast=True).to(tl.float32).reshape(BLOCK_N, BLOCK_K)
    factor = ((shift.to(tl.int32) + 14 + 127) << 23).to(tl.float32, bitcast=True)
    factor = tl.broadcast_to(factor[:, :, None], (BLOCK_N, BLOCK_K // 32, 32))
    return round_to_fp8(value * factor.reshape(BLOCK_N, BLOCK_K), INTERPRETED)
