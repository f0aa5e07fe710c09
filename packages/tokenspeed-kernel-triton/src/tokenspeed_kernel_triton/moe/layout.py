"""Expert weights laid out for the Triton MoE kernels ("triton-mx4words-padded" layout).

Checkpoint row order is kept (w13 rows interleave gate/up; e8m0 scales unchanged); MXFP4 codes
are re-encoded as int32 words of 8 K elements (mxfp4_words.py: same bytes, cheaper decode),
and H and I are zero-padded to a multiple of PAD_MULTIPLE so the GEMM tiles are whole (see
_common.PAD_MULTIPLE). Padded rows/columns are zeros: a padded intermediate channel has h = 0,
so its SwiGLU output is 0 * sigmoid(0) * (0 + 1) = 0, and padded output columns are never
stored. Biases become float32. Every returned tensor is a fresh copy: the caller's tensors are
never written and never aliased.
"""

from __future__ import annotations

import torch

from . import shift_words
from ._common import PAD_MULTIPLE, round_up
from .fragment_layout import fragment_order, group_gate_up, panel_major
from .mxfp4_words import encode_words

# e8m0 bytes above this would overflow the kernel's 2^(scale - 113) float32 factor (elements of
# 2^114 and beyond, far outside any trained weight); 255 is NaN in the format.
MAX_SCALE_BYTE = 240


def padded_sizes(hidden_size: int, intermediate_size: int) -> tuple[int, int]:
    return round_up(hidden_size, PAD_MULTIPLE), round_up(intermediate_size, PAD_MULTIPLE)


def _pad(t: torch.Tensor, shape: tuple[int, ...], fill: int | float = 0) -> torch.Tensor:
    out = torch.full(shape, fill, dtype=t.dtype, device=t.device)
    out[tuple(slice(0, n) for n in t.shape)] = t
    return out


def _pad_fp8(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    # torch.full has no float8 kernel on every device; pad the raw bytes.
    return _pad(t.view(torch.uint8), shape).view(t.dtype)


def prepare_weights(
    weight_format: str,
    hidden_size: int,
    intermediate_size: int,
    *,
    w13,
    w2,
    w13_scale=None,
    w2_scale=None,
    w13_bias=None,
    w2_bias=None,
    word_order: str = "natural",
    f16_intermediate: bool = True,
    shift_decode: bool = True,
) -> dict:
    """Checkpoint tensors (see the MoE contract) -> dict of padded tensors for `moe_forward`.

    word_order "fragment" (MXFP4 only) lays the words and w13 rows out for the Hopper fragment
    GEMM (fragment_layout.py; words [E, N / 64, 64, K / 128, 16] int32 and scales [E, N / 64,
    64, K / 128, 4] uint8, stored panel-major), each weight in the cheapest encoding that
    decodes it exactly (recorded as "w13_decode" / "w2_decode"): shift_words' fp16 layout for
    w2 when f16_intermediate (the caller's SwiGLU clamp bounds the intermediate,
    kernel.swiglu_fits_f16) and every w2 scale byte allows it, else its bf16 layout, else
    mxfp4_words' byte-permute words ("prmt"; always, with shift_decode=False). Raises
    ValueError for MXFP4 scale bytes above 240 (the kernel's exact range)."""
    if word_order not in ("natural", "fragment"):
        raise ValueError(
            f"prepare_weights: word_order is {word_order!r}, expected natural or fragment"
        )
    if word_order == "fragment" and weight_format != "mxfp4":
        raise ValueError(
            f"prepare_weights: fragment word order needs mxfp4 weights, got {weight_format}"
        )
    E = w13.shape[0]
    H, I = hidden_size, intermediate_size  # noqa: E741
    Hp, Ip = padded_sizes(H, I)
    if weight_format == "mxfp4":
        for name, s in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
            top = int(s.max()) if s.numel() else 0
            if top > MAX_SCALE_BYTE:
                raise ValueError(
                    f"moe_prepare_weights: weights.{name} holds e8m0 byte {top}, expected at "
                    f"most {MAX_SCALE_BYTE} (2^113) for the Triton MoE kernel"
                )
        tensors = dict(
            w13=_pad(w13, (E, 2 * Ip, Hp // 2)),
            w13_scale=_pad(w13_scale, (E, 2 * Ip, Hp // 32), 127),
            w2=_pad(w2, (E, Hp, Ip // 2)),
            w2_scale=_pad(w2_scale, (E, Hp, Ip // 32), 127),
        )
        if word_order == "fragment":
            tensors["w13"] = group_gate_up(tensors["w13"])
            tensors["w13_scale"] = group_gate_up(tensors["w13_scale"])
            w2_kinds = ("fp16", "bf16") if f16_intermediate else ("bf16",)
            for name, kinds in (("w13", ("bf16",)), ("w2", w2_kinds)):
                kinds = kinds if shift_decode else ()
                kind = shift_words.pick(tensors[f"{name}_scale"], kinds)
                tensors[f"{name}_decode"] = kind or "prmt"
                ordered = fragment_order(tensors[name])
                tensors[name] = shift_words.encode(ordered, kind) if kind else ordered
        for name in ("w13", "w2"):
            if tensors.get(f"{name}_decode", "prmt") == "prmt":
                tensors[name] = encode_words(tensors[name])
            if word_order == "fragment":
                for key in (name, f"{name}_scale"):
                    tensors[key] = panel_major(tensors[key])
    elif weight_format == "fp8":
        tensors = dict(
            w13=_pad_fp8(w13, (E, 2 * Ip, Hp)),
            w13_scale=_pad(w13_scale.to(torch.float32), (E, 2 * Ip)),
            w2=_pad_fp8(w2, (E, Hp, Ip)),
            w2_scale=_pad(w2_scale.to(torch.float32), (E, Hp)),
        )
    else:
        tensors = dict(
            w13=_pad(w13, (E, 2 * Ip, Hp)), w2=_pad(w2, (E, Hp, Ip)), w13_scale=None, w2_scale=None
        )
    tensors["w13_bias"] = None if w13_bias is None else _pad(w13_bias.float(), (E, 2 * Ip))
    if word_order == "fragment" and w13_bias is not None:
        tensors["w13_bias"] = group_gate_up(tensors["w13_bias"])
    tensors["w2_bias"] = None if w2_bias is None else _pad(w2_bias.float(), (E, Hp))
    tensors.update(
        weight_format=weight_format,
        hidden_size=H,
        intermediate_size=I,
        padded_hidden_size=Hp,
        padded_intermediate_size=Ip,
        num_experts=E,
        word_order=word_order,
    )
    return tensors
