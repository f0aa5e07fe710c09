"""MXFP4 and FP8 formats: bit-exact hand-computed values, an independent float64 oracle, errors."""

import math

import pytest
import torch

from tokenspeed_kernel.formats import (
    E2M1_VALUES,
    FP8_DTYPE,
    FP8_E4M3_MAX,
    MXFP4_BLOCK,
    dequantize_fp8,
    dequantize_mxfp4,
    e2m1_to_float,
    float_to_e2m1,
    pack_e2m1,
    quantize_fp8,
    quantize_mxfp4,
    unpack_e2m1,
)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _decode_e2m1(code: int) -> float:
    # The e2m1 definition from the OCP MX spec: bias 1, subnormal when the exponent field is 0.
    sign = -1.0 if code & 0x8 else 1.0
    exp, man = (code >> 1) & 0x3, code & 0x1
    mag = 0.5 * man if exp == 0 else 2.0 ** (exp - 1) * (1.0 + 0.5 * man)
    return sign * mag


def _oracle_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 magnitude by distance in float64, ties to the even code; sign kept."""
    grid = torch.tensor([_decode_e2m1(c) for c in range(8)], dtype=torch.float64)
    dist = (x.to(torch.float64).abs().unsqueeze(-1) - grid).abs()
    nearest = dist == dist.amin(dim=-1, keepdim=True)
    odd = torch.arange(8) % 2
    codes = (2 * (~nearest) + odd).argmin(dim=-1).to(torch.uint8)
    return codes | (torch.signbit(x).to(torch.uint8) << 3)


def _oracle_mxfp4(x: torch.Tensor) -> torch.Tensor:
    """Dequantized MXFP4 of `x [..., K]` from the spec formulas in float64 via python math."""
    blocks = x.to(torch.float64).reshape(-1, MXFP4_BLOCK)
    out = torch.empty_like(blocks)
    for i, block in enumerate(blocks):
        amax = float(block.abs().max())
        shared = math.floor(math.log2(amax)) - 2 if amax > 0 else -127
        shared = max(-127, min(127, shared))
        codes = _oracle_e2m1(block / 2.0**shared)
        out[i] = torch.tensor([_decode_e2m1(int(c)) for c in codes], dtype=torch.float64)
        out[i] *= 2.0**shared
    return out.reshape(x.shape)


def _random_blocks(*shape: int, seed: int) -> torch.Tensor:
    # Per-block magnitudes spread over many binades so every scale path is exercised.
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    mags = 2.0 ** torch.randint(-20, 20, (*shape[:-1], shape[-1] // MXFP4_BLOCK, 1), generator=g)
    return (x.reshape(*shape[:-1], -1, MXFP4_BLOCK) * mags).reshape(shape)


# ---------------------------------------------------------------------------------------- e2m1


def test_e2m1_values_match_bit_definition():
    assert len(E2M1_VALUES) == 16
    for code, value in enumerate(E2M1_VALUES):
        expected = _decode_e2m1(code)
        assert value == expected and math.copysign(1, value) == math.copysign(1, expected), code
    assert math.copysign(1, E2M1_VALUES[8]) == -1.0  # code 8 is -0.0


@pytest.mark.parametrize(
    "value, code",
    [
        (0.0, 0), (0.1, 0), (0.25, 0),  # 0.25 ties 0 / 0.5: even code 0
        (0.26, 1), (0.5, 1), (0.7, 1),
        (0.75, 2),  # ties 0.5 / 1.0: even code 2 (1.0)
        (1.25, 2),  # ties 1.0 / 1.5: even code 2
        (1.3, 3), (1.5, 3),
        (1.75, 4),  # ties 1.5 / 2.0: even code 4
        (2.5, 4),  # ties 2 / 3: even code 4
        (2.6, 5), (3.0, 5),
        (3.5, 6),  # ties 3 / 4: even code 6
        (5.0, 6),  # ties 4 / 6: even code 6 (4.0)
        (5.1, 7), (6.0, 7), (7.0, 7), (1e30, 7),  # saturation at 6
        (-0.1, 8), (-0.75, 10), (-5.0, 14), (-7.0, 15),
    ],
)  # fmt: skip
def test_float_to_e2m1_hand_values(value, code):
    for dtype in (torch.float32, torch.float64):
        got = float_to_e2m1(torch.tensor([value], dtype=dtype))
        assert got.dtype == torch.uint8
        assert got.tolist() == [code], (value, dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_float_to_e2m1_matches_oracle(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4096, generator=g) * 4
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = torch.cat([x, midpoints, -midpoints, midpoints + 1e-3, midpoints - 1e-3]).to(dtype)
    torch.testing.assert_close(float_to_e2m1(x), _oracle_e2m1(x), rtol=0, atol=0)


def test_e2m1_round_trip_all_codes():
    codes = torch.arange(16, dtype=torch.uint8)
    values = e2m1_to_float(codes)
    assert values.dtype == torch.float32
    assert values.tolist() == list(E2M1_VALUES)
    assert torch.equal(float_to_e2m1(values), codes)


def test_pack_nibble_order():
    codes = torch.tensor([[1, 2, 15, 0], [7, 8, 0, 9]], dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.tolist() == [[0x21, 0x0F], [0x87, 0x90]]
    assert torch.equal(unpack_e2m1(packed), codes)


def test_pack_unpack_round_trip():
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (3, 5, 64), generator=g, dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.shape == (3, 5, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_e2m1(packed), codes)
    bytes_ = torch.randint(0, 256, (7, 16), generator=g, dtype=torch.uint8)
    assert torch.equal(pack_e2m1(unpack_e2m1(bytes_)), bytes_)


def test_e2m1_errors():
    with pytest.raises(ValueError, match="pack_e2m1: codes has last dimension 3, expected an even"):
        pack_e2m1(torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="pack_e2m1: codes has value 16, expected values in 0..15"):
        pack_e2m1(torch.tensor([1, 16], dtype=torch.uint8))
    with pytest.raises(ValueError, match="pack_e2m1: codes has dtype int32, expected uint8"):
        pack_e2m1(torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="e2m1_to_float: codes has value 200"):
        e2m1_to_float(torch.tensor([200], dtype=torch.uint8))
    with pytest.raises(ValueError, match="unpack_e2m1: packed has dtype int8, expected uint8"):
        unpack_e2m1(torch.tensor([1], dtype=torch.int8))
    with pytest.raises(TypeError, match="float_to_e2m1: x is list, expected a torch.Tensor"):
        float_to_e2m1([1.0])
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match="float_to_e2m1: x contains NaN or inf"):
            float_to_e2m1(torch.tensor([1.0, bad]))


# --------------------------------------------------------------------------------------- mxfp4


def test_quantize_mxfp4_hand_block():
    # Block 0: amax 3 -> floor(log2 3) - 2 = -1 -> byte 126, elements x / 0.5.
    # 3->6 (7), -1.5->-3 (13), 0.25->0.5 (1), 0.125->0.25 tie (0), 0.375->0.75 tie (2),
    # 1->2 (4), 2.9->5.8 (7), 1.25->2.5 tie (4).
    block0 = [3.0, -1.5, 0.25, 0.125, 0.375, 1.0, 2.9, 1.25] * 4
    # Block 1: amax 7.5 -> floor(log2 7.5) - 2 = 0 -> byte 127, elements x / 1.
    # 7.5 saturates (7), 5 tie (6), -7 saturates (15), 0.75 tie (2), -0.2 -> -0 (8), 3.5 tie (6),
    # 6 (7), -0.5 (9).
    block1 = [7.5, 5.0, -7.0, 0.75, -0.2, 3.5, 6.0, -0.5] * 4
    # Block 2: amax 1000 -> 9 - 2 = 7 -> byte 134, elements x / 128: 1000->7.8 (7), 100->0.78 (2),
    # -384->-3 (13), 64->0.5 (1), then 160->1.25 tie (2), -448->-3.5 tie (14), 32->0.25 tie (0),
    # 800->6.25 (7).
    block2 = [1000.0, 100.0, -384.0, 64.0, 160.0, -448.0, 32.0, 800.0] * 4
    x = torch.tensor([block0 + block1, block2 + block0])
    packed, scales = quantize_mxfp4(x)
    bytes0 = [0xD7, 0x01, 0x42, 0x47] * 4
    bytes1 = [0x67, 0x2F, 0x68, 0x97] * 4
    bytes2 = [0x27, 0x1D, 0xE2, 0x70] * 4
    assert scales.dtype == torch.uint8 and packed.dtype == torch.uint8
    assert scales.tolist() == [[126, 127], [134, 126]]
    assert packed.tolist() == [bytes0 + bytes1, bytes2 + bytes0]


def test_quantize_mxfp4_zero_and_extreme_blocks():
    x = torch.zeros(4, 32, dtype=torch.float64)
    x[1, 3] = 1e-40  # amax far below 2^-125: clamps to byte 0, element rounds to 0
    x[2, 0] = 1e300  # float64 beyond e8m0: clamps to byte 254, elements saturate
    x[2, 1] = -1e300
    x[3, 5] = 2.0**-125  # smallest amax whose scale (2^-127) is exact: element 4 (code 6)
    packed, scales = quantize_mxfp4(x)
    assert scales.flatten().tolist() == [0, 0, 254, 0]
    codes = unpack_e2m1(packed)
    assert codes[0].eq(0).all() and codes[1].eq(0).all()
    assert codes[2, :2].tolist() == [7, 15] and codes[2, 2:].eq(0).all()
    assert codes[3, 5] == 6 and codes[3].count_nonzero() == 1
    out = dequantize_mxfp4(packed, scales, dtype=torch.float64)
    assert out[0].eq(0).all()
    assert out[3, 5] == 2.0**-125
    assert out[2, 0] == 6 * 2.0**127


def test_quantize_mxfp4_scale_never_255():
    x = torch.full((1, 32), torch.finfo(torch.float32).max)
    _, scales = quantize_mxfp4(x)
    assert scales.tolist() == [[252]]  # floor(log2 max) = 127 -> 127 - 2 + 127


@pytest.mark.parametrize("shape", [(32,), (3, 64), (2, 3, 96)])
def test_quantize_mxfp4_matches_oracle(shape):
    x = _random_blocks(*shape, seed=sum(shape))
    packed, scales = quantize_mxfp4(x)
    assert packed.shape == (*shape[:-1], shape[-1] // 2)
    assert scales.shape == (*shape[:-1], shape[-1] // 32)
    expected_scales = [
        math.floor(math.log2(float(b.abs().max()))) + 125 for b in x.reshape(-1, 32).double()
    ]
    assert scales.flatten().tolist() == expected_scales
    out = dequantize_mxfp4(packed, scales, dtype=torch.float64)
    torch.testing.assert_close(out, _oracle_mxfp4(x), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_quantize_mxfp4_input_dtypes_agree(dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 64, generator=g) * 10).to(dtype)
    packed, scales = quantize_mxfp4(x)
    packed32, scales32 = quantize_mxfp4(x.float())
    assert torch.equal(packed, packed32) and torch.equal(scales, scales32)


def test_mxfp4_round_trip_error_bound():
    x = _random_blocks(8, 256, seed=4)
    packed, scales = quantize_mxfp4(x)
    out = dequantize_mxfp4(packed, scales)
    # Per block, scale X = 2^(floor(log2 amax) - 2): the e2m1 grid step is at most 2X below 6X,
    # and values in (6X, 8X) saturate to 6X, so no error exceeds 2X <= amax / 2.
    amax = x.reshape(8, -1, 32).abs().amax(-1, keepdim=True)
    err = (out - x).reshape(8, -1, 32).abs()
    assert (err <= amax / 2).all()
    # Elements that are not tiny relative to amax keep e2m1's relative precision (<= 1/4 + 1/3
    # near saturation); a broken scale or nibble swap fails this.
    big = x.reshape(8, -1, 32).abs() >= amax / 4
    assert (err[big] <= 0.34 * x.reshape(8, -1, 32).abs()[big]).all()


def test_dequantize_mxfp4_hand_bytes():
    packed = torch.zeros(2, 16, dtype=torch.uint8)
    packed[0, 0] = 0x21  # codes 1, 2 -> 0.5, 1.0
    packed[0, 1] = 0xF7  # codes 7, 15 -> 6, -6
    packed[0, 15] = 0x9B  # codes 11, 9 -> -1.5, -0.5
    packed[1, 0] = 0x12  # codes 2, 1 -> 1.0, 0.5
    scales = torch.tensor([[129], [0]], dtype=torch.uint8)  # 2^2 and 2^-127
    out = dequantize_mxfp4(packed, scales)
    assert out.dtype == torch.float32 and out.shape == (2, 32)
    expected0 = [2.0, 4.0, 24.0, -24.0] + [0.0] * 26 + [-6.0, -2.0]
    assert out[0].tolist() == expected0
    assert out[1, :2].tolist() == [2.0**-127, 2.0**-128] and out[1, 2:].eq(0).all()
    bf16 = dequantize_mxfp4(packed, scales, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and bf16[0].float().tolist() == expected0


def test_dequantize_mxfp4_special_scales():
    packed = torch.full((1, 16), 0x22, dtype=torch.uint8)  # every element 1.0
    out = dequantize_mxfp4(packed, torch.tensor([[254]], dtype=torch.uint8))
    assert out.eq(2.0**127).all()
    out = dequantize_mxfp4(packed, torch.tensor([[255]], dtype=torch.uint8))
    assert out.isnan().all()  # e8m0 255 is NaN by the spec


def test_mxfp4_errors():
    with pytest.raises(ValueError, match="quantize_mxfp4: x has last dimension 48, expected a mul"):
        quantize_mxfp4(torch.randn(2, 48))
    with pytest.raises(ValueError, match="quantize_mxfp4: x contains NaN or inf"):
        quantize_mxfp4(torch.tensor([float("nan")] + [1.0] * 31))
    with pytest.raises(ValueError, match="quantize_mxfp4: x has dtype int32, expected bfloat16"):
        quantize_mxfp4(torch.ones(32, dtype=torch.int32))
    with pytest.raises(ValueError, match="quantize_mxfp4: x has shape \\[\\]"):
        quantize_mxfp4(torch.tensor(1.0))
    packed = torch.zeros(2, 32, dtype=torch.uint8)
    with pytest.raises(
        ValueError, match=r"dequantize_mxfp4: scales has shape \[2, 3\], expected \[2, 2\]"
    ):
        dequantize_mxfp4(packed, torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(
        ValueError, match=r"dequantize_mxfp4: scales has shape \[3, 2\], expected \[2, 2\]"
    ):
        dequantize_mxfp4(packed, torch.zeros(3, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="dequantize_mxfp4: scales has dtype float32, expected ui"):
        dequantize_mxfp4(packed, torch.zeros(2, 2))
    with pytest.raises(ValueError, match="dequantize_mxfp4: packed has last dimension 8, expected"):
        dequantize_mxfp4(torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="dequantize_mxfp4: dtype is int8, expected one of"):
        dequantize_mxfp4(packed, torch.zeros(2, 2, dtype=torch.uint8), dtype=torch.int8)


# ----------------------------------------------------------------------------------------- fp8


def test_fp8_static_scale_exact():
    q, scale = quantize_fp8(torch.tensor([448.0, -448.0, 1.0, 0.0]), scale=1.0)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == ()
    assert q.float().tolist() == [448.0, -448.0, 1.0, 0.0] and float(scale) == 1.0
    # e4m3 step is 32 in [256, 448]: 272 ties to 256 (even), 304 ties to 320, 500 clamps to 448.
    q, _ = quantize_fp8(torch.tensor([272.0, 304.0, 500.0, -1000.0]), scale=torch.tensor([1.0]))
    assert q.float().tolist() == [256.0, 320.0, 448.0, -448.0]
    q, _ = quantize_fp8(torch.tensor([3.0, -0.75]), scale=0.25)
    assert q.float().tolist() == [12.0, -3.0]


def test_fp8_dynamic_tensor_exact():
    q, scale = quantize_fp8(torch.tensor([[224.0, -112.0], [1.5, 0.0]]))
    assert float(scale) == 0.5 and scale.shape == ()
    assert q.float().tolist() == [[448.0, -224.0], [3.0, 0.0]]
    out = dequantize_fp8(q, scale)
    assert out.tolist() == [[224.0, -112.0], [1.5, 0.0]]


@pytest.mark.parametrize("granularity", ["channel", "token"])
def test_fp8_rowwise_exact(granularity):
    x = torch.tensor([[896.0, -448.0, 2.0, 0.5], [-56.0, 28.0, 7.0, 3.5]])
    q, scale = quantize_fp8(x, granularity=granularity)
    assert scale.dtype == torch.float32 and scale.tolist() == [2.0, 0.125]
    assert q.float().tolist() == [[448.0, -224.0, 1.0, 0.25], [-448.0, 224.0, 56.0, 28.0]]
    assert dequantize_fp8(q, scale, granularity=granularity).tolist() == x.tolist()


@pytest.mark.parametrize("granularity", ["tensor", "channel", "token"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_round_trip_relative_error(granularity, dtype):
    g = torch.Generator().manual_seed(5)
    rows = 2.0 ** torch.randint(-8, 8, (3, 17, 1), generator=g)
    x = (torch.randn(3, 17, 40, generator=g) * rows).to(dtype)
    q, scale = quantize_fp8(x, granularity=granularity)
    expected_scale_shape = () if granularity == "tensor" else (3, 17)
    assert scale.shape == expected_scale_shape and q.shape == x.shape
    xf = x.float()
    amax = xf.abs().amax() if granularity == "tensor" else xf.abs().amax(-1)
    torch.testing.assert_close(scale, amax / FP8_E4M3_MAX, rtol=0, atol=0)
    out = dequantize_fp8(q, scale, granularity=granularity)
    # e4m3 keeps 3 mantissa bits: RNE error <= 2^-4 relative for values in its normal range.
    s = scale if granularity == "tensor" else scale.unsqueeze(-1)
    normal = xf.abs() >= s * 2.0**-6
    assert normal.sum() > x.numel() // 4  # the bound below must cover a real share of elements
    rel = ((out - xf).abs() / xf.abs())[normal]
    assert rel.max() <= 2.0**-4
    assert q.float().abs().max() <= FP8_E4M3_MAX


def test_fp8_zeros():
    for granularity in ("tensor", "channel"):
        q, scale = quantize_fp8(torch.zeros(2, 8), granularity=granularity)
        assert (scale > 0).all() and scale.isfinite().all()
        assert q.float().eq(0).all()
        assert dequantize_fp8(q, scale, granularity=granularity).eq(0).all()


def test_fp8_dequantize_dtypes():
    q = torch.tensor([[1.0, -2.0], [0.5, 448.0]]).to(FP8_DTYPE)
    out = dequantize_fp8(q, torch.tensor([3.0, 0.25]), granularity="token", dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.float().tolist() == [[3.0, -6.0], [0.125, 112.0]]
    out = dequantize_fp8(q, 2.0, dtype=torch.float64)
    assert out.dtype == torch.float64 and out.tolist() == [[2.0, -4.0], [1.0, 896.0]]


def test_fp8_errors():
    x = torch.randn(2, 4)
    with pytest.raises(
        ValueError, match="quantize_fp8: granularity is 'row', expected one of 'tensor', 'chan"
    ):
        quantize_fp8(x, granularity="row")
    with pytest.raises(ValueError, match="dequantize_fp8: granularity is 'block', expected one of"):
        dequantize_fp8(x.to(FP8_DTYPE), 1.0, granularity="block")
    with pytest.raises(ValueError, match="quantize_fp8: scale is given with granularity 'channel'"):
        quantize_fp8(x, granularity="channel", scale=1.0)
    with pytest.raises(ValueError, match="quantize_fp8: scale is 0.0, expected a finite positive"):
        quantize_fp8(x, scale=0.0)
    with pytest.raises(ValueError, match=r"quantize_fp8: scale has shape \[2\], expected one elem"):
        quantize_fp8(x, scale=torch.ones(2))
    with pytest.raises(ValueError, match="quantize_fp8: x contains NaN or inf"):
        quantize_fp8(torch.tensor([1.0, float("inf")]))
    with pytest.raises(ValueError, match="quantize_fp8: x has dtype int64, expected bfloat16"):
        quantize_fp8(torch.ones(3, dtype=torch.int64))
    q = x.to(FP8_DTYPE)
    with pytest.raises(
        ValueError, match=r"dequantize_fp8: scale has shape \[4\], expected \[2\] for granularity"
    ):
        dequantize_fp8(q, torch.ones(4), granularity="channel")
    with pytest.raises(ValueError, match=r"dequantize_fp8: scale has shape \[2\], expected one"):
        dequantize_fp8(q, torch.ones(2))
    with pytest.raises(ValueError, match="dequantize_fp8: q has dtype float32, expected float8"):
        dequantize_fp8(x, 1.0)


# ----------------------------------------------------------------------------------------- gpu


@pytest.mark.gpu
def test_formats_cuda_matches_cpu():
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    x = _random_blocks(6, 4, 128, seed=6)
    x[0, 0, :32] = 0  # an all-zero block takes the byte-0 path on the device too
    packed, scales = quantize_mxfp4(x)
    packed_d, scales_d = quantize_mxfp4(x.cuda())
    assert packed_d.is_cuda and torch.equal(packed_d.cpu(), packed)
    assert torch.equal(scales_d.cpu(), scales)
    out_d = dequantize_mxfp4(packed_d, scales_d, dtype=torch.bfloat16)
    assert torch.equal(out_d.cpu(), dequantize_mxfp4(packed, scales, dtype=torch.bfloat16))
    for granularity in ("tensor", "channel", "token"):
        q, scale = quantize_fp8(x, granularity=granularity)
        q_d, scale_d = quantize_fp8(x.cuda(), granularity=granularity)
        assert torch.equal(q_d.cpu().view(torch.uint8), q.view(torch.uint8))
        torch.testing.assert_close(scale_d.cpu(), scale, rtol=0, atol=0)
