"""MXFP4 weights as e4m3 wgmma fragments, for the Hopper kernel's FP8 MMAs: w2 with fp8
activations (GEMM1 keeps exact half-precision sums, which round the SwiGLU intermediate to
e4m3 as the reference does; docs/decisions.md has why GEMM1's FP8 MMAs were not taken).

wgmma's e4m3 A operand in registers (k_width 4) gives lane l of each k32 step c the MMA-K
positions 32c + 4(l % 4) + i and 32c + 16 + 4(l % 4) + i (i < 4). Within each 128-element K
chunk the kernel multiplies a permuted K order: MMA position

    p = 32c + 16h + 4q + i   holds K element   k = 32q + 8c + 4h + i,

so lane quad q holds only scale block q of the chunk, and its word c (8 consecutive elements
32q + 8c ..) is the chunk's word 4q + c: words stay in the checkpoint's K order. The
activations are written in the permuted order by our own writers (quant.py's pass, GEMM1's
SwiGLU store), so the product is unchanged.

A row's blocks become e4m3 relative to its largest block exponent T (e8m0 byte, over the blocks
holding a non-zero code): block b with byte S_b decodes to e2m1 * 2^R_b, R_b = S_b - T + 6 in
[-5, 6], exact in e4m3 (6 * 2^6 = 384 <= 448; 0.5 * 2^-5 normal), and the row's factor
2^(T - 133) goes on the accumulator. A row whose non-zero blocks span more than 11 binades
does not fit (`fits`); the weight then stays half precision (layout.prepare_weights). The
kernel builds each block's two 4-entry tables from one byte B_b = (R_b + 6) * 8, the e4m3 of
0.5 * 2^R_b, which replaces the e8m0 byte in the prepared scales.

Within a word, element n = 4h + i keeps its magnitude code at bits 16h + 4i and its sign at
bit 8i + 4h + 3: the decode's prmt lookups take 4 magnitudes per selector half-word, and one
lop3 puts 4 signs on their bytes' top bits (fragment_steps_sm90.e4m3_fragment).
"""

from __future__ import annotations

import torch

from tokenspeed_kernel.formats import E2M1_VALUES

CHUNK_K = 128
# e4m3 exponent fields of a block's 0.5 * 2^R: 1 (normal, R = -5) to 12 (R = 6, 6 * 2^6 = 384).
SPAN = 11
_ROW_BIAS = 133  # factor 2^(T - 133): the top block's R = 6 on 2^(T - 127)


def mma_positions(K: int, device=None) -> torch.Tensor:
    """[K] int64: the MMA position p of K element k (K a multiple of 128)."""
    if K % CHUNK_K:
        raise ValueError(f"mma_positions: K = {K} is not a multiple of {CHUNK_K}")
    k = torch.arange(K, device=device)
    t = k % CHUNK_K
    q, c, h, i = t // 32, t // 8 % 4, t // 4 % 2, t % 4
    return k - t + 32 * c + 16 * h + 4 * q + i


def to_mma_order(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] in K order -> the same values at their MMA positions (a fresh tensor)."""
    out = torch.empty_like(x)
    out[..., mma_positions(x.shape[-1], x.device)] = x
    return out


def _codes(packed: torch.Tensor) -> torch.Tensor:
    """[..., K / 2] uint8, low nibble first -> [..., K] int64 codes."""
    wide = packed.to(torch.int64)
    return torch.stack((wide & 0xF, wide >> 4), dim=-1).flatten(-2)


def _row_top(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T [...] per row, nonzero [..., K / 32] per block)."""
    nonzero = (codes.unflatten(-1, (-1, 32)) & 7).amax(-1) > 0
    s = scales.to(torch.int64)
    top = torch.where(nonzero, s, -1).amax(-1)
    return torch.where(top < 0, 127, top), nonzero


def fits(packed: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether every row's non-zero blocks span at most 11 binades (and the rows' factors
    2^(T - 133) are normal float32)."""
    if scales.numel() == 0:
        return True
    top, nonzero = _row_top(_codes(packed), scales)
    low = scales.to(torch.int64) < (top - SPAN)[..., None]
    return not bool((low & nonzero).any()) and int(top.min()) - _ROW_BIAS >= -126


def encode(packed: torch.Tensor, scales: torch.Tensor):
    """Checkpoint MXFP4 [..., K / 2] uint8 codes (low nibble first) and [..., K / 32] e8m0
    scales (rows that `fits`) -> (words [..., K / 8] int32 in K order, table bytes [...,
    K / 32] uint8, row factors [...] float32)."""
    codes = _codes(packed)
    top, nonzero = _row_top(codes, scales)
    exponent = scales.to(torch.int64) - top[..., None] + 12  # R + 6, the e4m3 exponent field
    table = torch.where(nonzero, exponent, 1) * 8
    if bool((table < 8).any()) or bool((table > 96).any()):
        raise ValueError("e4m3_fragments.encode: rows span more than 11 binades (see fits)")
    element = codes.unflatten(-1, (-1, 8))  # [..., K / 8 words, n]
    n = torch.arange(8, device=codes.device)
    h, i = n // 4, n % 4
    magnitude = (element & 7) << (16 * h + 4 * i)
    sign = (element >> 3) << (8 * i + 4 * h + 3)
    words = (magnitude | sign).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    factors = torch.ldexp(torch.ones_like(top, dtype=torch.float32), top - _ROW_BIAS)
    return words, table.to(torch.uint8), factors


def decode(words: torch.Tensor, table: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """encode's outputs -> [..., K] float64 weights in K order (the reference for tests)."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    n = torch.arange(8, device=w.device)
    h, i = n // 4, n % 4
    magnitude = (w[..., None] >> (16 * h + 4 * i)) & 7
    sign = (w[..., None] >> (8 * i + 4 * h + 3)) & 1
    e2m1 = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=w.device)
    values = e2m1[magnitude | sign << 3].flatten(-2)  # [..., K]
    r = table.to(torch.int64) // 8 - 6
    scale = torch.exp2(r.to(torch.float64)).repeat_interleave(32, dim=-1)
    return values * scale * factors.to(torch.float64)[..., None]
