"""Expert weights laid out for the Triton MoE kernels: the portable kernel's
"triton-mx4words-padded" layout and the Hopper kernel's "triton-mx4fragment-padded" one.

Checkpoint row order is kept (w13 rows interleave gate/up; e8m0 scales unchanged); MXFP4 codes
are re-encoded as int32 words of 8 K elements (mxfp4_words.py: same bytes, cheaper decode),
and H and I are zero-padded to a multiple of PAD_MULTIPLE so the GEMM tiles are whole (see
_common.PAD_MULTIPLE). Padded rows/columns are zeros: a padded intermediate channel has h = 0,
so its SwiGLU output is 0 * sigmoid(0) * (0 + 1) = 0, and padded output columns are never
stored. Biases become float32. Every returned tensor is a fresh copy: the caller's tensors are
never written and never aliased.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenspeed_kernel.ops.moe.types import PreparedMoEWeights
from tokenspeed_kernel.tuning import pinned_config

from . import e4m3_fragments_sm90, replay, shift_words_sm90
from ._common import padded_sizes, swiglu_fits_f16
from .fragment_layout_sm90 import fragment_order, group_gate_up, panel_major
from .mxfp4_words import encode_words

# e8m0 bytes above this would overflow the kernel's 2^(scale - 113) float32 factor (elements of
# 2^114 and beyond, far outside any trained weight); 255 is NaN in the format.
MAX_SCALE_BYTE = 240
# The MoEWeights fields prepare_weights takes, under the same names.
CHECKPOINT_TENSORS = ("w13", "w2", "w13_scale", "w2_scale", "w13_bias", "w2_bias")


def _pad(t: torch.Tensor, shape: tuple[int, ...], fill: int | float = 0) -> torch.Tensor:
    out = torch.full(shape, fill, dtype=t.dtype, device=t.device)
    out[tuple(slice(0, n) for n in t.shape)] = t
    return out


def _pad_fp8(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    # torch.full has no float8 kernel on every device; pad the raw bytes.
    return _pad(t.view(torch.uint8), shape).view(t.dtype)


class PaddedMoEKernel:
    """What both Triton MoE kernel objects share (core's MoEKernel protocol): H and I padded to
    PAD_MULTIPLE, weights prepared in the subclass's `word_order`, with the static FP8 input
    scales as floats; `apply` calls the subclass's `forward` (moe_forward's keywords) with the
    routing, the layer's SwiGLU and `forward_options`."""

    name: str
    weight_layout: str
    word_order: str
    forward: Callable[..., torch.Tensor]

    def forward_options(self, config, tensors: dict) -> dict:
        """`forward`'s keywords beyond routing, top_k, out, alpha and limit."""
        return {}

    def prepare_options(self, config) -> dict:
        """`prepare_weights`' keywords beyond the checkpoint, sizes, word order and SwiGLU."""
        return {}

    def apply(
        self, plan, x, prepared, *, router_logits=None, topk_weights=None, topk_ids=None, out
    ) -> None:
        """A call of prepared weights on the shapes, strides and stream of an earlier one replays
        that call's launches (replay.py); any other runs `forward` and records it. plan.config
        is prepared.config (moe_apply checks)."""
        inputs = (x, router_logits, topk_weights, topk_ids, out)
        key, pointers = replay.key_of(prepared, inputs, pinned_config(self.name))
        recipe = replay.lookup(key) if key is not None else None
        if recipe is not None:
            recipe.launch(inputs, pointers)
            return
        config, tensors = plan.config, prepared.tensors
        with replay.Recording(inputs) as recording:
            self.forward(
                x,
                tensors,
                top_k=config.top_k,
                out=out,
                router_logits=router_logits,
                topk_weights=topk_weights,
                topk_ids=topk_ids,
                alpha=config.activation.alpha,
                limit=config.activation.limit,
                expert_offset=config.expert_offset,
                **self.forward_options(config, tensors),
            )
        if key is not None:
            replay.store(key, prepared, recording)

    def padded_sizes(self, config) -> tuple[int, int]:
        return padded_sizes(config.hidden_size, config.intermediate_size)

    def prepare_weights(self, plan, weights) -> PreparedMoEWeights:
        config = plan.config
        checkpoint = {name: getattr(weights, name) for name in CHECKPOINT_TENSORS}
        tensors = prepare_weights(
            config.weight_format,
            config.hidden_size,
            config.intermediate_size,
            **checkpoint,
            word_order=self.word_order,
            f16_intermediate=swiglu_fits_f16(config.activation.alpha, config.activation.limit),
            **self.prepare_options(config),
        )
        for name in ("w13_input_scale", "w2_input_scale"):
            value = getattr(weights, name)
            tensors[name] = None if value is None else float(value)
        return PreparedMoEWeights(kernel=self.name, config=config, tensors=tensors)


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
    e4m3_w2: bool = False,
) -> dict:
    """Checkpoint tensors (see the MoE contract) -> dict of padded tensors for `moe_forward`
    (word_order "natural") or `moe_forward_sm90` ("fragment").

    word_order "fragment" (MXFP4 only) lays the words and w13 rows out for the Hopper fragment
    GEMM (fragment_layout_sm90.py; words [E, N / 64, 64, K / 128, 16] int32 and scales [E, N / 64,
    64, K / 128, 4] uint8, stored panel-major), each weight in the cheapest encoding that
    decodes it exactly (recorded as "w13_decode" / "w2_decode"): shift_words' fp16 layout for
    w2 when f16_intermediate (the caller's SwiGLU clamp bounds the intermediate,
    _common.swiglu_fits_f16) and every w2 scale byte allows it, else its bf16 layout, else
    mxfp4_words' byte-permute words ("prmt"; always, with shift_decode=False). With e4m3_w2
    (the Hopper kernel's fp8 activations), w2 as e4m3 fragments where every row fits ("e4m3",
    e4m3_fragments_sm90.py: words in K order, table bytes for scales, each row's factor in
    "w2_row_scale", float32 [E, H]). Raises ValueError for MXFP4 scale bytes above 240 (the
    kernel's exact range)."""
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
    w2_kinds = ("fp16", "bf16") if f16_intermediate else ("bf16",)
    w2_kinds = w2_kinds if shift_decode else ()
    if weight_format == "mxfp4":
        scales = (w13_scale, w2_scale)
        tensors = _prepare_mxfp4(w13, w2, scales, (E, Hp, Ip), word_order, w2_kinds, e4m3_w2)
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
    sizes = dict(
        hidden_size=H, intermediate_size=I, padded_hidden_size=Hp, padded_intermediate_size=Ip
    )
    tensors.update(sizes, weight_format=weight_format, num_experts=E, word_order=word_order)
    return tensors


def _prepare_mxfp4(
    w13, w2, scales, sizes, word_order: str, w2_kinds: tuple, e4m3_w2: bool = False
) -> dict:
    """prepare_weights for MXFP4: padded words and scales; w2_kinds: the shift_words_sm90
    layouts w2 may take in fragment order (w13 takes bf16), cheapest first (none: prmt);
    e4m3_w2: w2 as e4m3 fragments where every row fits."""
    E, Hp, Ip = sizes
    for name, s in zip(("w13_scale", "w2_scale"), scales, strict=True):
        top = int(s.max()) if s.numel() else 0
        if top > MAX_SCALE_BYTE:
            raise ValueError(
                f"moe_prepare_weights: weights.{name} holds e8m0 byte {top}, expected at "
                f"most {MAX_SCALE_BYTE} (2^113) for the Triton MoE kernel"
            )
    tensors = dict(
        w13=_pad(w13, (E, 2 * Ip, Hp // 2)),
        w13_scale=_pad(scales[0], (E, 2 * Ip, Hp // 32), 127),
        w2=_pad(w2, (E, Hp, Ip // 2)),
        w2_scale=_pad(scales[1], (E, Hp, Ip // 32), 127),
    )
    if word_order == "fragment":
        tensors["w13"] = group_gate_up(tensors["w13"])
        tensors["w13_scale"] = group_gate_up(tensors["w13_scale"])
        encodings = {"w13": ("bf16",) if w2_kinds else (), "w2": w2_kinds}
        if e4m3_w2 and e4m3_fragments_sm90.fits(tensors["w2"], tensors["w2_scale"]):
            words, table, factors = e4m3_fragments_sm90.encode(tensors["w2"], tensors["w2_scale"])
            tensors.update(w2=panel_major(words), w2_scale=panel_major(table))
            tensors.update(w2_row_scale=factors.contiguous(), w2_decode="e4m3")
            del encodings["w2"]
        for name, kinds in encodings.items():
            kind = shift_words_sm90.pick(tensors[f"{name}_scale"], kinds)
            tensors[f"{name}_decode"] = kind or "prmt"
            ordered = fragment_order(tensors[name])
            tensors[name] = shift_words_sm90.encode(ordered, kind) if kind else ordered
    for name in ("w13", "w2"):
        if tensors.get(f"{name}_decode") == "e4m3":
            continue
        if tensors.get(f"{name}_decode", "prmt") == "prmt":
            tensors[name] = encode_words(tensors[name])
        if word_order == "fragment":
            for key in (name, f"{name}_scale"):
                tensors[key] = panel_major(tensors[key])
    return tensors
