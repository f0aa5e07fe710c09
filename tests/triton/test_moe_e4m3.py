"""MXFP4 weights as e4m3 MMA operands for FP8 activations (mxfp4_e4m3.py): the encoding is
exact where it applies and refused where it would not be, and the portable kernel computes the
same function through it (CPU through the Triton interpreter; GPU under the gpu marker)."""

from __future__ import annotations

import pytest
import torch

from tokenspeed_kernel.registry import get_kernel
from tokenspeed_kernel.testing import assert_close, moe_plan_for
from tokenspeed_kernel.testing.inputs import MoEShape, generator, moe_weights
from tokenspeed_kernel_triton.moe import mxfp4_e4m3
from tokenspeed_kernel_triton.moe.layout import prepare_weights

KERNEL = "triton.moe_apply"
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def _dequantize(packed, scale):
    """Checkpoint MXFP4 [..., N, K/2] with e8m0 [..., N, K/32] -> float64 [..., N, K]."""
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], -1)
    factor = torch.pow(2.0, scale.double() - 127).repeat_interleave(32, dim=-1)
    return E2M1.double()[codes.long()] * factor


def _mxfp4(rows, cols, scale_low, scale_high, name):
    gen = generator(name)
    packed = torch.randint(0, 256, (rows, cols // 2), generator=gen, dtype=torch.uint8)
    scale = torch.randint(scale_low, scale_high + 1, (rows, cols // 32), generator=gen)
    return packed, scale.to(torch.uint8)


def test_encoding_is_exact_over_eleven_binades_and_zero_blocks_anywhere():
    packed, scale = _mxfp4(8, 256, 109, 120, "e4m3-exact")
    scale[:, 0] = 120  # every row spans the full 11 binades
    scale[:, 1] = 109
    packed[3, 32:48] = 0x88  # block 2: -0 codes (sign only) far below its row
    scale[3, 2] = 3
    packed[5] = 0  # a row of zeros
    encoded = mxfp4_e4m3.encode(packed, scale)
    assert encoded is not None
    words, shift, row_scale = encoded
    assert words.dtype == torch.int32 and words.shape == (8, 32)
    assert shift.dtype == torch.int8 and int(shift.max()) <= mxfp4_e4m3.MAX_SHIFT
    assert int(shift[3, 2]) == mxfp4_e4m3.ZERO_BLOCK_SHIFT
    assert row_scale[0].item() == 2.0 ** (120 - 133)
    got = mxfp4_e4m3.decode_reference(words, shift, row_scale).double()
    assert torch.equal(got, _dequantize(packed, scale))


@pytest.mark.parametrize("low,top", [(108, 120), (120, 5)])
def test_encoding_refuses_rows_e4m3_cannot_hold(low, top):
    """Twelve binades below the row's top, or a top whose row scale is no float32 normal."""
    packed, scale = _mxfp4(4, 64, top, top, "e4m3-refused")
    packed |= 0x11  # no zero block
    scale[2, 1] = low
    assert mxfp4_e4m3.encode(packed, scale) is None


def test_words_keep_every_code():
    packed, _ = _mxfp4(3, 64, 127, 127, "e4m3-words")
    words = mxfp4_e4m3.encode_words(packed)
    shift = torch.zeros(3, 2, dtype=torch.int8)
    got = mxfp4_e4m3.decode_reference(words, shift, torch.ones(3))
    assert torch.equal(got.double(), _dequantize(packed, torch.full((3, 2), 127)))


def _fp8_layer(device):
    shape = MoEShape(
        num_tokens=37, num_experts=4, top_k=2, hidden_size=256, intermediate_size=192,
        weight_format="mxfp4", activation_format="fp8",
    )  # fmt: skip
    weights = moe_weights(shape, generator("e4m3-layer"))
    moved = {f: getattr(weights, f) for f in weights.__dataclass_fields__}
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()}
    return shape.config(), type(weights)(**moved), shape


def _run(kernel, config, weights, tokens, device):
    spec = get_kernel("moe_apply", kernel)
    plan = moe_plan_for(spec, config, tokens, device)
    prepared = spec.fn.prepare_weights(plan, weights)
    gen = torch.Generator(device=device).manual_seed(3)
    x = torch.randn(tokens, config.hidden_size, generator=gen, device=device).bfloat16()
    logits = torch.randn(tokens, config.num_experts, generator=gen, device=device)
    out = torch.empty_like(x)
    spec.fn.apply(plan, x, prepared, router_logits=logits, out=out)
    return out, prepared.tensors


@pytest.mark.parametrize("wide_w2", [False, True])
def test_fp8_activations_take_e4m3_weights_and_match_the_reference(wide_w2):
    """FP8 activations prepare e4m3 weights where the scales allow (here both, or w13 only:
    one w2 block 14 binades down keeps w2 in the bf16 decode) and match the reference."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config, weights, shape = _fp8_layer(device)
    if wide_w2:
        weights.w2_scale[1, 3, 0] = int(weights.w2_scale[1, 3].max()) - 14
    out, tensors = _run(KERNEL, config, weights, shape.num_tokens, device)
    assert tensors["w13_decode"] == "e4m3"
    assert tensors.get("w2_decode") == (None if wide_w2 else "e4m3")
    expected, _ = _run("reference.moe_apply", config, weights, shape.num_tokens, device)
    assert_close(out, expected, dtype=torch.float8_e4m3fn, name="out")


def test_bf16_activations_keep_the_bf16_decode():
    packed, scale = _mxfp4(2 * 128, 128, 120, 121, "e4m3-bf16")
    tensors = prepare_weights(
        "mxfp4", 128, 128, w13=packed.reshape(1, 256, 64), w2=packed[:128].reshape(1, 128, 64),
        w13_scale=scale.reshape(1, 256, 4), w2_scale=scale[:128].reshape(1, 128, 4),
    )  # fmt: skip
    assert "w13_decode" not in tensors and "w13_row_scale" not in tensors
