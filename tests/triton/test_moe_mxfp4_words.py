"""The MXFP4 word re-encoding of the Triton MoE weights: lossless (round trip), and both
decoders (portable arithmetic, NVIDIA byte-permute PTX) reproduce core's dequantizer exactly
for every code and the whole accepted scale range."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from tokenspeed_kernel.formats.mxfp4 import dequantize_mxfp4
from tokenspeed_kernel.platform import Platform
from tokenspeed_kernel_triton.moe._common import has_ptx_decode
from tokenspeed_kernel_triton.moe.layout import MAX_SCALE_BYTE
from tokenspeed_kernel_triton.moe.mxfp4_words import (
    decode_words,
    decode_words_ptx,
    decode_words_reference,
    encode_words,
)

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
ROWS, K = 64, 256


@triton.jit
def _decode_kernel(
    words_ptr,
    scale_ptr,
    out_ptr,
    PTX: tl.constexpr,
    INTERPRETED: tl.constexpr,
    ROWS: tl.constexpr,
    K: tl.constexpr,
):
    rows = tl.arange(0, ROWS)
    words = tl.load(words_ptr + rows[:, None] * (K // 8) + tl.arange(0, K // 8)[None, :])
    scale = tl.load(scale_ptr + rows[:, None] * (K // 32) + tl.arange(0, K // 32)[None, :])
    if PTX:
        w = decode_words_ptx(words, scale, ROWS, K)
    else:
        w = decode_words(words, scale, ROWS, K, INTERPRETED)
    tl.store(out_ptr + rows[:, None] * K + tl.arange(0, K)[None, :], w)


def _inputs(min_scale: int = 0):
    """Every byte value (all 16 x 16 code pairs) twice per row pair, in shuffled positions;
    scale bytes spanning min_scale..MAX_SCALE_BYTE, both ends included."""
    gen = torch.Generator().manual_seed(7)
    packed = torch.arange(ROWS * K // 2).reshape(ROWS, K // 2) % 256
    packed = packed[:, torch.randperm(K // 2, generator=gen)].to(torch.uint8)
    scale = torch.linspace(min_scale, MAX_SCALE_BYTE, ROWS * K // 32).round().to(torch.uint8)
    scale = scale[torch.randperm(scale.numel(), generator=gen)].reshape(ROWS, K // 32)
    scale[0, 0], scale[-1, -1] = min_scale, MAX_SCALE_BYTE
    return packed, scale


def test_encoding_round_trips_and_keeps_the_size():
    packed, _ = _inputs()
    words = encode_words(packed)
    assert words.dtype == torch.int32 and words.shape == (ROWS, K // 8)
    assert words.numel() * 4 == packed.numel()
    assert torch.equal(decode_words_reference(words), packed)


def test_encoding_refuses_a_partial_word():
    with pytest.raises(ValueError, match="not a multiple of 4"):
        encode_words(torch.zeros(2, 6, dtype=torch.uint8))


def _decode(packed, scale, ptx: bool) -> torch.Tensor:
    words = encode_words(packed).to(DEVICE)
    out = torch.empty(ROWS, K, dtype=torch.bfloat16, device=DEVICE)
    _decode_kernel[(1,)](
        words, scale.to(DEVICE), out, PTX=ptx, INTERPRETED=not ON_GPU, ROWS=ROWS, K=K
    )
    return out.cpu()


def test_portable_decoder_matches_core_dequantizer():
    # On a GPU, scale bytes 0 and 1 give float32-subnormal products that flushing devices zero.
    packed, scale = _inputs(min_scale=2 if ON_GPU else 0)
    expected = dequantize_mxfp4(packed, scale).to(torch.bfloat16)
    assert torch.equal(_decode(packed, scale, ptx=False), expected)


@pytest.mark.gpu
@pytest.mark.skipif(
    not ON_GPU or torch.version.hip is not None or torch.cuda.get_device_capability()[0] < 9,
    reason="the PTX decoder needs NVIDIA sm_90+",
)
def test_ptx_decoder_matches_core_dequantizer_bit_for_bit():
    packed, scale = _inputs()
    expected = dequantize_mxfp4(packed, scale).to(torch.bfloat16)
    got = _decode(packed, scale, ptx=True)
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize(
    "vendor,arch,expected",
    [
        ("nvidia", "sm_90", True),
        ("nvidia", "sm_100a", True),
        ("nvidia", "sm_89", False),
        ("amd", "gfx942", False),
        ("cpu", "cpu", False),
    ],
)
def test_ptx_decoder_is_chosen_only_where_it_compiles(vendor, arch, expected):
    assert has_ptx_decode(Platform(vendor, arch)) is expected
