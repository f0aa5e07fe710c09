"""w2 as e4m3 fragments for the Hopper kernel's FP8 GEMM2 (e4m3_fragments_sm90.py): the
encoding decodes to the checkpoint's MXFP4 values exactly, rows it cannot hold are refused
(and prepare_weights keeps them half precision), the MMA order is a permutation that gives each
lane quad one scale block, and the quantizer writes activations in it. The kernel itself runs in
the GPU tests (test_moe.py's GPT-OSS shapes and conformance cases)."""

from __future__ import annotations

import pytest
import torch

from tokenspeed_kernel.formats import dequantize_mxfp4
from tokenspeed_kernel.testing.inputs import generator
from tokenspeed_kernel_triton.moe import e4m3_fragments_sm90 as e4m3
from tokenspeed_kernel_triton.moe.layout import prepare_weights
from tokenspeed_kernel_triton.moe.quant import quantize_rows
from tokenspeed_kernel_triton.moe.wgmma_gemm_sm90 import fragment_gemm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weights(rows: int, K: int, low: int, high: int, name: str):
    gen = generator(name)
    packed = torch.randint(0, 256, (2, rows, K // 2), generator=gen, dtype=torch.uint8)
    scales = torch.randint(low, high + 1, (2, rows, K // 32), generator=gen, dtype=torch.uint8)
    return packed, scales


def test_encode_decodes_to_the_mxfp4_values():
    """Blocks spanning the full 11 binades, an all-zero block far below its row's top (its
    scale never matters), negative zeros, and a row of zeros."""
    packed, scales = _weights(16, 256, 110, 121, "e4m3-encode")
    scales[0, 3, :] = 121
    scales[0, 3, 2] = 110  # exactly 11 binades below the row's top
    packed[1, 5, 16:32] = 0  # block 1 of row 5: zero codes ...
    scales[1, 5, 1] = 20  # ... under a scale no other block could share a row with
    packed[1, 6, :] = 0x88  # negative zeros
    packed[0, 7, :] = 0
    assert e4m3.fits(packed, scales)
    words, table, factors = e4m3.encode(packed, scales)
    assert words.dtype == torch.int32 and words.shape == (2, 16, 32)
    assert table.dtype == torch.uint8 and table.shape == (2, 16, 8)
    assert int(table.min()) >= 8 and int(table.max()) <= 96
    decoded = e4m3.decode(words, table, factors)
    assert torch.equal(decoded, dequantize_mxfp4(packed, scales, dtype=torch.float64))


def test_rows_past_eleven_binades_do_not_fit():
    packed, scales = _weights(4, 128, 118, 121, "e4m3-fit")
    scales[1, 2, :] = 121
    scales[1, 2, 3] = 109  # a non-zero block 12 binades below the row's top
    assert not e4m3.fits(packed, scales)
    with pytest.raises(ValueError, match="11 binades"):
        e4m3.encode(packed, scales)
    packed[1, 2, 48:64] = 0  # the same block, all zero codes: any scale decodes it
    assert e4m3.fits(packed, scales)


def test_mma_order_gives_each_lane_quad_one_scale_block():
    """A permutation within each 128-column chunk; K element k of scale block q lands where
    wgmma's k_width-4 A fragment gives lane quad q its elements (positions 4q .. 4q + 3 and
    16 + 4q .. of each k32 step), and word 4q + c of a chunk is k32 step c."""
    K = 384
    p = e4m3.mma_positions(K)
    assert torch.equal(p.sort().values, torch.arange(K))
    k = torch.arange(K)
    assert torch.equal(p // 128, k // 128)
    assert torch.equal(p % 32 % 16 // 4, k % 128 // 32)
    assert torch.equal(p % 128 // 32, k % 32 // 8)
    x = torch.randn(3, K, generator=generator("e4m3-order"))
    assert torch.equal(e4m3.to_mma_order(x)[:, p], x)
    with pytest.raises(ValueError, match="multiple of 128"):
        e4m3.mma_positions(200)


@pytest.mark.parametrize("static", [None, 0.25])
def test_quantizer_writes_mma_order_with_zero_padding(static):
    """n = 200 columns: the e4m3 values of quantize_rows at their MMA positions in 256, the
    56 padding columns zero (GEMM2 multiplies them), the same scales."""
    gen = generator("e4m3-quant-order")
    x = (torch.randn(5, 200, generator=gen) * 3).to(DEVICE)
    q, scale = quantize_rows(x, static, "test_e4m3_plain")
    want = torch.zeros(5, 256, dtype=torch.uint8, device=DEVICE)
    want[:, :200] = q.view(torch.uint8)
    want = e4m3.to_mma_order(want)
    into = torch.full((5, 256), 0x7F, dtype=torch.uint8, device=DEVICE)
    got, got_scale = quantize_rows(
        x, static, "test_e4m3_mma", into=into.view(torch.float8_e4m3fn), mma_order=True
    )
    assert torch.equal(got.view(torch.uint8), want)
    assert torch.equal(torch.as_tensor(got_scale), torch.as_tensor(scale))
    with pytest.raises(ValueError, match="MMA order"):
        quantize_rows(x, static, "test_e4m3_short", into=into[:, :200], mma_order=True)


def _checkpoint(E=2, H=256, I=128, name="e4m3-prepare"):  # noqa: E741
    gen = generator(name)
    u8 = dict(generator=gen, dtype=torch.uint8)
    return dict(
        w13=torch.randint(0, 256, (E, 2 * I, H // 2), **u8),
        w2=torch.randint(0, 256, (E, H, I // 2), **u8),
        w13_scale=torch.randint(118, 122, (E, 2 * I, H // 32), **u8),
        w2_scale=torch.randint(114, 126, (E, H, I // 32), **u8),
    )


def test_prepare_takes_e4m3_w2_where_every_row_fits():
    weights = _checkpoint()
    prepared = prepare_weights("mxfp4", 256, 128, **weights, word_order="fragment", e4m3_w2=True)
    assert (prepared["w13_decode"], prepared["w2_decode"]) == ("bf16", "e4m3")
    w2, table = prepared["w2"], prepared["w2_scale"]
    assert w2.shape == (2, 4, 64, 1, 16) and table.shape == (2, 4, 64, 1, 4)
    assert prepared["w2_row_scale"].shape == (2, 256) and prepared["w2_row_scale"].is_contiguous()
    decoded = e4m3.decode(
        w2.reshape(2, 256, 16), table.reshape(2, 256, 4), prepared["w2_row_scale"]
    )
    assert torch.equal(
        decoded, dequantize_mxfp4(weights["w2"], weights["w2_scale"], dtype=torch.float64)
    )
    without = prepare_weights("mxfp4", 256, 128, **weights, word_order="fragment")
    assert without["w2_decode"] == "fp16" and "w2_row_scale" not in without
    assert torch.equal(prepared["w13"], without["w13"])

    weights["w2_scale"][1, 7, 2] = 100  # 25 binades below its row's top
    fallback = prepare_weights("mxfp4", 256, 128, **weights, word_order="fragment", e4m3_w2=True)
    assert fallback["w2_decode"] == "bf16" and "w2_row_scale" not in fallback


def test_e4m3_weights_take_e4m3_activations_only():
    weights = _checkpoint()
    prepared = prepare_weights("mxfp4", 256, 128, **weights, word_order="fragment", e4m3_w2=True)
    rows = torch.zeros(4, 256, dtype=torch.bfloat16)  # GEMM2 rows as bf16 [hi | lo]
    with pytest.raises(ValueError, match="e4m3 weights take float8_e4m3fn activations"):
        fragment_gemm(
            rows, prepared["w2"], prepared["w2_scale"], None, torch.empty(4, 256),
            (None, None, None, None, 1, 4), gemm1=False, decode="e4m3", k_valid=128,
            n_valid=256, config=None, row_scale=prepared["w2_row_scale"],
        )  # fmt: skip


def test_e4m3_w2_needs_fp8_activations():
    from tokenspeed_kernel_triton.moe.moe_sm90 import moe_forward_sm90

    weights = _checkpoint()
    prepared = prepare_weights("mxfp4", 256, 128, **weights, word_order="fragment", e4m3_w2=True)
    x = torch.zeros(3, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="take fp8 activations"):
        moe_forward_sm90(x, prepared, top_k=2, out=torch.empty_like(x), activation_format="bf16")
