"""The Hopper fragment GEMM's weight order (tokenspeed_kernel_triton.moe.fragment_layout_sm90): each
word holds exactly the 8 K elements its thread's wgmma A fragment needs, inside one scale
block; w13 rows regroup gate/up so one thread holds both halves of a SwiGLU pair; preparation
is a pure re-layout (decodable back to the checkpoint, caller's tensors untouched).

The kernel itself runs only on sm_90 (see test_moe.py's GPU cases and test_aot.py, which checks
that its weight fragments never pass through shared memory)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tokenspeed_kernel.ops.moe.types import MoEConfig
from tokenspeed_kernel.tuning import pin_config
from tokenspeed_kernel_triton.moe import _common, moe_sm90
from tokenspeed_kernel_triton.moe import shift_words_sm90 as shift_words
from tokenspeed_kernel_triton.moe._common import swiglu_fits_f16
from tokenspeed_kernel_triton.moe.combine import combine
from tokenspeed_kernel_triton.moe.fragment_config_sm90 import (
    CONFIGS,
    FragmentConfig,
    for_layer,
    gemm2_splits,
    half_pair_rows,
    half_pair_rows_bound,
)
from tokenspeed_kernel_triton.moe.fragment_layout_sm90 import (
    PANEL_ROWS,
    fragment_order,
    group_gate_up,
    kernel_layouts,
    panel_major,
    panel_view,
)
from tokenspeed_kernel_triton.moe.layout import prepare_weights
from tokenspeed_kernel_triton.moe.moe_sm90 import KERNEL_NAME, moe_forward_sm90
from tokenspeed_kernel_triton.moe.moe_sm90 import pick_config as pick_fragment_config
from tokenspeed_kernel_triton.moe.mxfp4_words import decode_words_reference
from tokenspeed_kernel_triton.moe.wgmma_gemm_sm90 import fp16_wide_threshold_bits, fragment_gemm


def _codes(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] uint8 -> [..., K] 4-bit codes (low nibble = even element)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def _fragment_k(j: int, i: int) -> int:
    """The K element (within a 128-element chunk) in slot i of word j, as the wgmma A fragment
    of a bf16 m64k16 operand needs it: slot bit 0 is the bf16x2 pair element, word bits 2-3 the
    lane's K pair (2 * (lane % 4)), slot bit 1 the +8 half, slot bit 2 and word bits 0-1 the
    16-element steps."""
    jhi, jlo = j >> 2, j & 3
    b0, b1, b2 = i & 1, (i >> 1) & 1, i >> 2
    return 32 * jlo + 16 * b2 + 8 * b1 + 2 * jhi + b0


def test_fragment_order_puts_each_fragment_element_in_its_word():
    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (3, 5, 128), generator=gen, dtype=torch.uint8)  # K = 256
    original = _codes(packed)
    ordered = _codes(fragment_order(packed)).reshape(3, 5, 2, 16, 8)  # chunk, word, slot
    for chunk in range(2):
        for j in range(16):
            for i in range(8):
                k = 128 * chunk + _fragment_k(j, i)
                assert torch.equal(ordered[:, :, chunk, j, i], original[:, :, k]), (chunk, j, i)


def test_every_word_stays_in_one_scale_block_and_the_order_is_a_permutation():
    ks = [[_fragment_k(j, i) for i in range(8)] for j in range(16)]
    assert sorted(k for word in ks for k in word) == list(range(128))
    for j, word in enumerate(ks):
        assert {k // 32 for k in word} == {j & 3}


def test_fragment_order_refuses_a_partial_chunk():
    with pytest.raises(ValueError, match="multiple of 128"):
        fragment_order(torch.zeros(2, 3, 32, dtype=torch.uint8))


def test_group_gate_up_gives_each_16_row_group_8_gates_then_their_ups():
    E, rows = 2, 32
    t = torch.arange(E * rows * 3).reshape(E, rows, 3)
    grouped = group_gate_up(t)
    for g in range(rows // 16):
        for r in range(8):
            channel = 8 * g + r
            assert torch.equal(grouped[:, 16 * g + r], t[:, 2 * channel])  # gate
            assert torch.equal(grouped[:, 16 * g + 8 + r], t[:, 2 * channel + 1])  # up
    with pytest.raises(ValueError, match="multiple of 16"):
        group_gate_up(torch.zeros(1, 24))


def _checkpoint(E=2, H=96, I=80, seed=1):  # noqa: E741
    gen = torch.Generator().manual_seed(seed)
    return dict(
        w13=torch.randint(0, 256, (E, 2 * I, H // 2), generator=gen, dtype=torch.uint8),
        w13_scale=torch.randint(110, 129, (E, 2 * I, H // 32), generator=gen, dtype=torch.uint8),
        w2=torch.randint(0, 256, (E, H, I // 2), generator=gen, dtype=torch.uint8),
        w2_scale=torch.randint(110, 129, (E, H, I // 32), generator=gen, dtype=torch.uint8),
        w13_bias=torch.randn(E, 2 * I, generator=gen),
        w2_bias=torch.randn(E, H, generator=gen),
    )


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """Prepared words or scales [E, N / 64, 64, K / 128, 16 or 4] -> [E, N, K / 8 or K / 32]."""
    return t.reshape(t.shape[0], t.shape[1] * t.shape[2], -1)


def _undo_fragment_order(words: torch.Tensor, decode: str) -> torch.Tensor:
    """Prepared words [E, N / 64, 64, K / 128, 16] in `decode`'s encoding -> codes [E, N, K] in
    natural K order."""
    words = _row_major(words)
    if decode == "prmt":
        packed = decode_words_reference(words)
    else:
        packed = shift_words.decode_reference(words, decode)
    codes = _codes(packed)
    lead, K = codes.shape[:-1], codes.shape[-1]
    natural = torch.empty_like(codes)
    chunks = codes.reshape(*lead, K // 128, 16, 8)
    out = natural.reshape(*lead, K // 128, 128)
    for j in range(16):
        for i in range(8):
            out[..., _fragment_k(j, i)] = chunks[..., j, i]
    return natural


def test_prepare_in_fragment_order_is_a_pure_relayout():
    H, I = 96, 80  # noqa: E741 - padded to 128 each
    ckpt = _checkpoint(H=H, I=I)
    before = {name: t.clone() for name, t in ckpt.items()}
    prepared = prepare_weights("mxfp4", H, I, word_order="fragment", **ckpt)
    for name, t in ckpt.items():
        assert torch.equal(t, before[name]), f"{name} was mutated"
    assert prepared["word_order"] == "fragment"
    E, Ip, Hp = 2, 128, 128
    # w2: natural rows, fragment-ordered K, zero padding.
    assert (prepared["w13_decode"], prepared["w2_decode"]) == ("bf16", "fp16")
    w2 = _undo_fragment_order(prepared["w2"], "fp16")
    assert torch.equal(w2[:, :H, :I], _codes(ckpt["w2"]))
    assert not w2[:, H:].any() and not w2[:, :, I:].any()
    # w13: rows regrouped (checkpoint row 2c = gate c, 2c + 1 = up c), scales and bias with them.
    w13 = _undo_fragment_order(prepared["w13"], "bf16")
    natural_rows = group_gate_up(torch.arange(2 * Ip)[None])[0]
    assert w13.shape == (E, 2 * Ip, Hp)
    for new_row, old_row in enumerate(natural_rows.tolist()):
        if old_row < 2 * I:
            assert torch.equal(w13[:, new_row, :H], _codes(ckpt["w13"][:, old_row]))
            assert torch.equal(
                _row_major(prepared["w13_scale"])[:, new_row, : H // 32],
                ckpt["w13_scale"][:, old_row],
            )
            assert torch.equal(prepared["w13_bias"][:, new_row], ckpt["w13_bias"][:, old_row])
        else:
            assert not w13[:, new_row].any()


def test_fragment_weights_are_stored_panel_major():
    """A chunk's 64 rows of words (of scale bytes) are one contiguous run, the chunks of a
    panel follow one another: a ring step's copy reads one block of memory."""
    H, I = 320, 200  # noqa: E741 - padded to 3 and 2 chunks
    ckpt = _checkpoint(H=H, I=I)
    prepared = prepare_weights("mxfp4", H, I, word_order="fragment", **ckpt)
    for name, per_chunk in (("w13", 16), ("w2", 16), ("w13_scale", 4), ("w2_scale", 4)):
        t = prepared[name]
        E, panels, rows, chunks, width = t.shape
        assert (rows, width, chunks) == (PANEL_ROWS, per_chunk, 3 if "13" in name else 2), name
        assert t.stride()[1:] == (chunks * rows * width, width, rows * width, 1), name
        assert t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes, name
    words = torch.randint(-(2**31), 2**31, (3, 128, 48), dtype=torch.int32)
    assert torch.equal(panel_major(words), panel_view(words))
    assert torch.equal(_row_major(panel_major(words)), words)
    with pytest.raises(ValueError, match="whole panels"):
        panel_view(torch.zeros(1, 96, 16, dtype=torch.int32))


def test_fragment_order_needs_mxfp4_weights():
    bf16 = dict(
        w13=torch.zeros(1, 32, 16, dtype=torch.bfloat16),
        w2=torch.zeros(1, 16, 16, dtype=torch.bfloat16),
    )
    with pytest.raises(ValueError, match="needs mxfp4"):
        prepare_weights("bf16", 16, 16, word_order="fragment", **bf16)
    with pytest.raises(ValueError, match="word_order"):
        prepare_weights("bf16", 16, 16, word_order="tiled", **bf16)


def test_kernel_layouts_refuse_tiles_wgmma_cannot_run():
    kernel_layouts(64, 8, 4)
    with pytest.raises(ValueError, match="block_w"):
        kernel_layouts(32, 8, 4)  # one warpgroup covers 64 rows
    with pytest.raises(ValueError, match="block_t"):
        kernel_layouts(64, 12, 4)  # wgmma N is a multiple of 8


def test_fragment_config_refuses_rings_the_kernel_cannot_run():
    FragmentConfig(64, 8, 4, 2, chunks=2)
    with pytest.raises(ValueError, match="stages 1"):
        FragmentConfig(64, 8, 4, 1)
    with pytest.raises(ValueError, match="chunks 3"):
        FragmentConfig(64, 8, 4, 2, chunks=3)
    assert FragmentConfig(128, 64, 4, 4, narrow_t=32).narrow_t == 32
    for narrow_t in (4, 24, 64, 128):  # below wgmma's N of 8, not a power of two, too wide
        with pytest.raises(ValueError, match="narrow_t"):
            FragmentConfig(128, 64, 4, 4, narrow_t=narrow_t)
    with pytest.raises(ValueError, match="narrow_t"):
        FragmentConfig(64, 16, 4, 2, chunks=4, mma_in_flight=1, post_scale=True, narrow_t=8)
    assert FragmentConfig(128, 128, 4, 2, narrow_t=64, narrow_stages=4).narrow_stages == 4
    for stages, narrow_t in ((1, 64), (4, 0)):  # a ring of one step, no narrow launch
        with pytest.raises(ValueError, match="narrow_stages"):
            FragmentConfig(128, 128, 4, 2, narrow_t=narrow_t, narrow_stages=stages)
    assert FragmentConfig(64, 8, 4, 2, chunks=4).in_flight == 4
    assert FragmentConfig(64, 8, 4, 2, chunks=4, mma_in_flight=1).in_flight == 1
    with pytest.raises(ValueError, match="tile_ready needs pdl"):
        FragmentConfig(64, 8, 4, 2, tile_ready=True)
    for in_flight in (0, 5):
        with pytest.raises(ValueError, match=f"mma_in_flight {in_flight}"):
            FragmentConfig(64, 8, 4, 2, chunks=4, mma_in_flight=in_flight)
    assert FragmentConfig(128, 128, 4, 2, narrow_t=32, warp_specialized=True).warp_specialized
    # The warp-specialized kernel's consumers are 128 x 128 fragment tiles, one chunk a step.
    for other in (
        dict(block_t=64),
        dict(block_w=256, num_warps=8),
        dict(chunks=2),
        dict(pdl=True, tile_ready=True),
    ):
        tile = {**dict(block_w=128, block_t=128, num_warps=4, stages=2), **other}
        with pytest.raises(ValueError, match="warp_specialized"):
            FragmentConfig(**tile, warp_specialized=True)
    # Fitting MMA widths to a tile's tokens is the warp-specialized kernel's.
    assert FragmentConfig(128, 128, 4, 2, warp_specialized=True, fit_widths=True).fit_widths
    with pytest.raises(ValueError, match="fit_widths"):
        FragmentConfig(128, 128, 4, 2, fit_widths=True)


def test_shards_run_the_config_below_their_intermediate_size():
    """A config names the one that runs instead below a padded intermediate size, in turn: the
    serving pick at M=256 drops its narrow launch on a TP=8 shard (384 padded channels), and
    the pick at M=13 runs its 4-step ring on the whole layer and TP=2 only."""
    short = FragmentConfig(128, 16, 4, 4, pdl=True)
    config = FragmentConfig(128, 16, 4, 4, pdl=True, narrow_t=8, below_intermediate=(768, short))
    assert for_layer(config, 384, 128) is short
    assert for_layer(config, 768, 128) is config
    assert for_layer(config, 2944, 128) is config
    chained = dataclasses.replace(config, stages=3, below_intermediate=(2048, config))
    assert [for_layer(chained, i, 128) for i in (384, 1536, 2944)] == [short, config, chained]
    plain = FragmentConfig(128, 64, 4, 4, pdl=True, narrow_t=32)
    assert for_layer(plain, 128, 128) is plain
    pick = pick_fragment_config(256 * 4)
    assert pick.narrow_t == 8 and for_layer(pick, 384, 128).narrow_t == 0
    # Fitted MMA widths on the whole layer and TP=2 shards, TP=4 to M=2816 (H200 measurements).
    fitted = {
        m: [
            for_layer(pick_fragment_config(m * 4), i, 128).fit_widths
            for i in (384, 768, 1536, 2944)
        ]
        for m in (2049, 2816, 2817, 8192)
    }
    assert fitted == {
        2049: [False, True, True, True],
        2816: [False, True, True, True],
        2817: [False, False, True, True],
        8192: [False, False, True, True],
    }
    # M = 1025 to 2048: the narrow launch to M=1280 on the long intermediates, then one
    # launch of 64-token tiles to M=1664, then on TP=8 shards (and TP=4 to M=1792) 128-token
    # tiles whose 64-token narrow tiles have a 4-step ring, on the others the warp-specialized
    # kernel (H200 measurements).
    shapes = {}
    for m in (1024, 1152, 1280, 1536, 1664, 1792, 2048):
        picked = [for_layer(pick_fragment_config(m * 4), i, 128) for i in (384, 768, 1536, 2944)]
        shapes[m] = [
            "ws" if c.warp_specialized else (c.block_t, c.stages, c.narrow_t, c.narrow_stages)
            for c in picked
        ]
    narrow_32, tile_64, tile_128 = (64, 4, 32, 0), (64, 4, 0, 0), (128, 2, 64, 4)
    assert shapes == {
        1024: [narrow_32] * 4,
        1152: [tile_64, tile_64, narrow_32, narrow_32],
        1280: [tile_64, tile_64, narrow_32, narrow_32],
        1536: [tile_64] * 4,
        1664: [tile_64] * 4,
        1792: [tile_128, tile_128, "ws", "ws"],
        2048: [tile_128, "ws", "ws", "ws"],
    }
    # M = 257 to 512: 32-token tiles with a 16-token narrow launch; TP=8 shards one launch
    # of 16-token tiles to M=384, of 32-token ones beyond (H200 measurements).
    shapes = {}
    for m in (256, 257, 384, 385, 512, 513):
        picked = [for_layer(pick_fragment_config(m * 4), i, 128) for i in (384, 768, 2944)]
        shapes[m] = [(c.block_t, c.narrow_t) for c in picked]
    assert shapes == {
        256: [(16, 0), (16, 8), (16, 8)],
        257: [(16, 0), (32, 16), (32, 16)],
        384: [(16, 0), (32, 16), (32, 16)],
        385: [(32, 0), (32, 16), (32, 16)],
        512: [(32, 0), (32, 16), (32, 16)],
        513: [(64, 32)] * 3,
    }
    decode = pick_fragment_config(13 * 4)
    assert [for_layer(decode, i, 128).stages for i in (384, 768, 1536, 2944)] == [3, 3, 4, 4]
    for bad in ((0, short), (-1, short), (768, "short"), 768, (768,)):
        with pytest.raises(ValueError, match="below_intermediate"):
            FragmentConfig(128, 16, 4, 4, below_intermediate=bad)
        with pytest.raises(ValueError, match="below_expert_channels"):
            FragmentConfig(128, 16, 4, 4, below_expert_channels=bad)


def test_few_local_channels_keep_the_fragment_kernel_at_m_2048():
    """At ~57-64 tokens per expert the warp-specialized kernel runs where the local experts'
    padded channels together reach 64 K, the 128-token fragment tile where they do not: TP=8
    shards, EP=8 ranks, GPT-OSS-20B's TP=2 shard and EP=2 rank; at ~52-56 from 128 K, which
    leaves the TP=4 shard, EP=4 rank and 20B's whole layer the tile too (H200 measurements).
    The rule resolves before the intermediate size's, and the sizes around keep their picks."""
    layers = {
        "120B whole": (2944, 128),
        "120B TP=2": (1472, 128),
        "120B TP=4": (768, 128),
        "120B TP=8": (384, 128),
        "120B EP=2": (2944, 64),
        "120B EP=4": (2944, 32),
        "120B EP=8": (2944, 16),
        "20B whole": (2944, 32),
        "20B TP=2": (1472, 32),
        "20B EP=2": (2944, 16),
    }
    few = {"120B TP=8", "120B EP=8", "20B TP=2", "20B EP=2"}
    fewer_at_56 = few | {"120B TP=4", "120B EP=4", "20B whole"}
    for num_experts, m in ((128, 1792), (128, 1793), (128, 2048), (32, 448), (32, 449)):
        for name, (intermediate, local) in layers.items():
            if (num_experts == 32) != name.startswith("20B"):
                continue
            pairs = _common.selection_pairs(m, 4, local, num_experts)
            config = for_layer(pick_fragment_config(pairs), intermediate, local)
            tile = fewer_at_56 if m in (1792, 448) else few
            assert config.warp_specialized == (name not in tile), (name, m)
            if not config.warp_specialized:
                assert (config.block_t, config.narrow_t, config.narrow_stages) == (128, 64, 4)
            else:
                assert config.fit_widths and config.warp_specialized_gemm2, (name, m)
    # The TP=4 shard takes the float32 pair rows' form below 1024 channels.
    tp4 = for_layer(pick_fragment_config(2048 * 4), 768, 128)
    assert not half_pair_rows(tp4, 768, 1)
    for m in (1664, 2049):
        assert for_layer(pick_fragment_config(m * 4), 2944, 16) == for_layer(
            pick_fragment_config(m * 4), 2944, 128
        )
    fallback = FragmentConfig(128, 64, 4, 4)
    config = FragmentConfig(128, 16, 4, 4, below_expert_channels=(65536, fallback))
    assert for_layer(config, 384, 170) is fallback
    assert for_layer(config, 384, 171) is config  # 65664 channels


_GEMM_WIDTHS = """
import json, sys
from tokenspeed_kernel.registry import kernels
from tokenspeed_kernel.tools import aot

spec = next(s for s in kernels("moe_apply") if s.name == "triton.moe_apply.sm90")
case = dict(num_experts=16, top_k=4, hidden_size=2880, intermediate_size=int(sys.argv[1]),
            num_tokens=int(sys.argv[2]))
launches = aot.run_case_launches(spec, case, "sm_90")
gemms = [l for l in launches if l.fn.__name__ == "_fragment_gemm_kernel"]
print(json.dumps([l.constexprs[(l.fn.arg_names.index("BLOCK_T"),)] for l in gemms]))
"""


def test_tp_shards_launch_the_narrow_tiles_from_their_intermediate_size():
    """At 8 tokens an expert (GPT-OSS-120B's M=256; here M=32 over 16 experts) each GEMM of a
    TP=4 shard (736 channels, 768 padded) runs its 8-token tiles in a launch of their own; a
    TP=8 shard's (384) runs one launch per GEMM. The launches as moe_apply makes them for
    sm_90, in a subprocess without TRITON_INTERPRET: the AOT launch capture cannot take the
    interpreted kernels these tests run."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    widths = {}
    for intermediate in (736, 384):
        command = [sys.executable, "-c", _GEMM_WIDTHS, str(intermediate), "32"]
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-4000:]
        widths[intermediate] = json.loads(run.stdout.strip().splitlines()[-1])
    assert widths == {736: [16, 8, 16, 8], 384: [16, 16]}


def test_warp_specialized_kernel_takes_what_its_config_and_operands_allow():
    from tokenspeed_kernel_triton.moe.fragment_ws_sm90 import warp_specialized_fits

    on = FragmentConfig(128, 128, 4, 2, warp_specialized=True)
    both = FragmentConfig(128, 128, 4, 2, warp_specialized=True, warp_specialized_gemm2=True)
    off = FragmentConfig(128, 128, 4, 2)
    x = torch.empty(16, 2880, dtype=torch.bfloat16)
    w = torch.empty(2, 92, 64, 23, 16, dtype=torch.int32)  # 2I = 5760 of 5888 padded rows
    assert warp_specialized_fits(on, x, w, gemm1=True, n_valid=5760)
    assert not warp_specialized_fits(off, x, w, gemm1=True, n_valid=5760)
    assert not warp_specialized_fits(on, x.half(), w, gemm1=True, n_valid=5760)
    # A TP=2 shard: 2I = 2880 real rows of 3072 padded, a consumer's rows half padding.
    shard = torch.empty(2, 48, 64, 23, 16, dtype=torch.int32)
    assert warp_specialized_fits(on, x, shard, gemm1=True, n_valid=2880)
    # Padded rows that are no whole 256-row blocks go to the fragment kernel.
    odd = torch.empty(2, 91, 64, 23, 16, dtype=torch.int32)
    assert not warp_specialized_fits(on, x, odd, gemm1=True, n_valid=5760)
    # Copy offsets are 32-bit: x rows past 2^31 elements go to the fragment kernel.
    big = torch.empty(2**31 // 2880 + 1, 2880, dtype=torch.bfloat16, device="meta")
    assert not warp_specialized_fits(on, big, w, gemm1=True, n_valid=5760)
    # GEMM2 (H = 2880 rows: 11.25 blocks, the last one's rows masked) where its config asks,
    # on fp16 SwiGLU rows into float32 or fp16 pair rows, unsplit.
    act = torch.empty(256, 2944, dtype=torch.float16)
    w2 = torch.empty(2, 45, 64, 23, 16, dtype=torch.int32)
    assert warp_specialized_fits(both, act, w2, gemm1=False, n_valid=2880)
    assert not warp_specialized_fits(on, act, w2, gemm1=False, n_valid=2880)
    assert not warp_specialized_fits(both, act, w2, gemm1=False, n_valid=2880, split_k=2)
    assert not warp_specialized_fits(both, act, w2, gemm1=False, n_valid=2880, scaled=True)
    hi_lo = torch.empty(256, 2 * 2944, dtype=torch.bfloat16)  # bf16 [hi | lo] rows
    assert not warp_specialized_fits(both, hi_lo, w2, gemm1=False, n_valid=2880)
    e4m3 = torch.empty(256, 2944, dtype=torch.float8_e4m3fn)
    assert not warp_specialized_fits(both, e4m3, w2, gemm1=False, n_valid=2880)
    with pytest.raises(ValueError, match="warp_specialized_gemm2"):
        FragmentConfig(128, 128, 4, 2, warp_specialized_gemm2=True)
    with pytest.raises(ValueError, match="warp_specialized_gemm2"):
        dataclasses.replace(both, gemm2_split_k=2)


def test_persistent_items_turn_row_blocks_only_where_the_grid_stride_pins_them():
    from tokenspeed_kernel_triton.moe.fragment_ws_sm90 import rotates_row_blocks

    # 132 SMs (H100, H200): H = 2880 (GEMM2) and the TP=2 shard's 2I = 2880 in 12 blocks, the
    # TP=4 shard's 2I = 1344 in 6 and the TP=8 shard's 720 in 3 share factors with the grid.
    for row_blocks in (12, 6, 3):
        assert rotates_row_blocks(132, row_blocks)
    # The whole layer's 2I = 5760 in 23 blocks: the stride already turns them; one block
    # has nothing to turn.
    assert not rotates_row_blocks(132, 23)
    assert not rotates_row_blocks(132, 1)
    # A grid cut to the work there is (five tiles' blocks) pins every CTA to one block.
    assert rotates_row_blocks(23 * 5, 23)
    assert not rotates_row_blocks(23 * 5 + 1, 23)


E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
HALF_TYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# The factor each layout multiplies by: 2^(s - 127) times 2^126 (bf16) or 2^14 (fp16).
FACTOR_EXPONENT_OFFSET = {"bf16": 126, "fp16": 14}


def _exact(kind: str, scale_byte: int) -> bool:
    """Whether the factor is a normal number of the half type and every MXFP4 value times
    2^(s - 127) survives a round trip through it."""
    dtype = HALF_TYPES[kind]
    factor = 2.0 ** (scale_byte - 127 + FACTOR_EXPONENT_OFFSET[kind])
    values = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64) * 2.0 ** (scale_byte - 127)
    normal = torch.finfo(dtype).tiny <= factor <= torch.finfo(dtype).max
    return normal and torch.equal(values.to(dtype).to(torch.float64), values)


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_exact_scale_bytes_are_exactly_those_the_half_type_holds(kind):
    assert [s for s in range(256) if _exact(kind, s)] == list(shift_words.EXACT_SCALE_BYTES[kind])


def _run_ptx(ptx: str, word: int, factor: int, dtype: torch.dtype) -> list[float]:
    """Interpret the decode PTX (the handful of instructions it uses) for one word."""
    regs = {"$8": word, "$9": factor}
    outputs: dict[str, float] = {}
    mask32 = 0xFFFFFFFF

    def val(x: str) -> int:
        return regs[x] if x in regs else int(x, 0)

    def halves(bits: int) -> torch.Tensor:
        pair = torch.tensor([bits & 0xFFFF, bits >> 16], dtype=torch.int32).to(torch.int16)
        return pair.view(dtype).to(torch.float64)

    for line in ptx.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        args = [a.strip() for a in args.split(",")]
        if op == "and.b32":
            regs[args[0]] = val(args[1]) & val(args[2])
        elif op == "shl.b32":
            regs[args[0]] = (val(args[1]) << val(args[2])) & mask32
        elif op == "shr.u32":
            regs[args[0]] = val(args[1]) >> val(args[2])
        elif op == "lop3.b32" and args[4] == "0xF8":  # a | (b & c)
            regs[args[0]] = val(args[1]) | (val(args[2]) & val(args[3]))
        elif op in ("mul.rn.bf16x2", "mul.rn.f16x2"):
            product = (halves(val(args[1])) * halves(val(args[2]))).to(dtype)
            bits = product.view(torch.int16).to(torch.int32) & 0xFFFF
            regs[args[0]] = int(bits[0]) | (int(bits[1]) << 16)
        elif op == "mov.b32":
            low, high = args[0].strip("{}"), args[1].strip("{}")
            outputs[low], outputs[high] = halves(val(args[2])).tolist()
        else:
            raise AssertionError(f"instruction the interpreter does not know: {line}")
    return [outputs[f"${i}"] for i in range(8)]


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_shift_decode_ptx_gives_every_code_exactly(kind):
    """The kernel's PTX, interpreted: every code in every slot, at the ends and middle of the
    exact scale range, decodes to e2m1 * 2^(s - 127), bit for bit."""
    ptx = shift_words.PTX_DECODE_BF16 if kind == "bf16" else shift_words.PTX_DECODE_F16
    multiplier, addend = shift_words.factor_constants(kind)
    values = torch.tensor(E2M1_MAGNITUDES + tuple(-v for v in E2M1_MAGNITUDES))
    exact = shift_words.EXACT_SCALE_BYTES[kind]
    for scale_byte in (exact.start, 120, exact.stop - 1):
        factor = ((scale_byte | scale_byte << 16) * multiplier + addend) & 0xFFFFFFFF
        for code in range(16):
            # Slot i holds code + i (mod 16), so each word checks 8 codes in 8 positions.
            codes = torch.tensor([(code + i) % 16 for i in range(8)], dtype=torch.uint8)
            packed = codes[0::2] | (codes[1::2] << 4)
            word = int(shift_words.encode(packed, kind)[0]) & 0xFFFFFFFF
            got = _run_ptx(ptx.value, word, factor, HALF_TYPES[kind])
            want = (values[codes.long()].double() * 2.0 ** (scale_byte - 127)).tolist()
            assert got == want, (kind, scale_byte, code)


@pytest.mark.parametrize(
    "w13_byte,w2_byte,f16_intermediate,decodes",
    [
        (None, None, True, ("bf16", "fp16")),
        (None, 104, True, ("bf16", "fp16")),
        (None, 128, True, ("bf16", "fp16")),
        (None, 103, True, ("bf16", "bf16")),  # fp16 cannot hold 0.5 * 2^-24
        (None, None, False, ("bf16", "bf16")),  # the clamp does not bound the intermediate
        (None, 129, True, ("bf16", "prmt")),  # 2^128 is no normal bf16
        (129, None, True, ("prmt", "fp16")),
    ],
)
def test_prepare_picks_the_cheapest_exact_decode(w13_byte, w2_byte, f16_intermediate, decodes):
    ckpt = _checkpoint()
    if w13_byte is not None:
        ckpt["w13_scale"][0, 3, 1] = w13_byte
    if w2_byte is not None:
        ckpt["w2_scale"][1, 7, 1] = w2_byte
    prepared = prepare_weights(
        "mxfp4", 96, 80, word_order="fragment", f16_intermediate=f16_intermediate, **ckpt
    )
    assert (prepared["w13_decode"], prepared["w2_decode"]) == decodes
    # Whatever the encoding, the words decode back to the checkpoint's codes.
    w2 = _undo_fragment_order(prepared["w2"], decodes[1])
    assert torch.equal(w2[:, :96, :80], _codes(ckpt["w2"]))


def test_shift_decode_can_be_turned_off():
    prepared = prepare_weights(
        "mxfp4", 96, 80, word_order="fragment", shift_decode=False, **_checkpoint()
    )
    assert (prepared["w13_decode"], prepared["w2_decode"]) == ("prmt", "prmt")


@pytest.mark.parametrize(
    "alpha,limit,fits",
    [
        (1.702, 7.0, True),  # GPT-OSS: |intermediate| <= 56
        (1.702, 240.0, True),
        (1.702, 250.0, False),  # 250 * 251 > 60000
        (1.702, math.inf, False),
        (1e-5, 7.0, False),  # g * sigmoid(alpha * g) reaches -0.28 / alpha
        (0.0, 7.0, False),
    ],
)
def test_fp16_intermediate_only_where_the_clamp_bounds_it(alpha, limit, fits):
    assert swiglu_fits_f16(alpha, limit) is fits


@pytest.mark.parametrize(
    "requested,K,splits",
    [(1, 2944, 1), (4, 2944, 4), (8, 2944, 8), (6, 2944, 6), (4, 640, 3), (9, 256, 2)],
)
def test_gemm2_splits_are_all_non_empty(requested, K, splits):
    """GPT-OSS's padded I = 2944 is 23 chunks of 128: 4 ways -> 6, 6, 6, 5. Fewer chunks than
    the request per split would leave a CTA with none, so the count shrinks instead."""
    assert gemm2_splits(requested, K) == splits
    chunks = K // 128
    per_split = -(-chunks // splits)
    assert (splits - 1) * per_split < chunks


def test_forward_refuses_a_clamp_the_fp16_layout_was_not_prepared_for():
    """Checked before any launch, so it runs on the CPU."""
    prepared = prepare_weights("mxfp4", 96, 80, word_order="fragment", **_checkpoint())
    assert prepared["w2_decode"] == "fp16"
    x = torch.zeros(2, 96, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="f16_intermediate=False"):
        moe_forward_sm90(
            x,
            prepared,
            top_k=1,
            out=torch.empty_like(x),
            router_logits=torch.zeros(2, 2),
            limit=math.inf,
        )


def test_fragment_gemm_refuses_weights_encoded_for_another_operand():
    prepared = prepare_weights("mxfp4", 96, 80, word_order="fragment", **_checkpoint())
    config = FragmentConfig(64, 8, 4, 4)
    common = dict(routing=None, k_valid=96, n_valid=256, config=config)
    x = torch.zeros(8, 96, dtype=torch.bfloat16)
    act16 = torch.zeros(8, 128, dtype=torch.float16)
    w13 = (prepared["w13"], prepared["w13_scale"], prepared["w13_bias"])
    w2 = (prepared["w2"], prepared["w2_scale"], prepared["w2_bias"])
    with pytest.raises(ValueError, match="fp16 weights for a bf16 operand"):
        fragment_gemm(x, *w13, act16, gemm1=True, decode="fp16", **common)
    with pytest.raises(ValueError, match="prmt weights for a fp16 operand"):
        fragment_gemm(act16, *w2, torch.zeros(8, 96), gemm1=False, decode="prmt", **common)
    with pytest.raises(ValueError, match="GEMM2 rows"):
        fragment_gemm(act16[:, :64], *w2, torch.zeros(8, 96), gemm1=False, decode="fp16", **common)
    with pytest.raises(ValueError, match="split_k"):
        fragment_gemm(x, *w13, act16, gemm1=True, decode="bf16", split_k=2, **common)
    # A static fp8 scale quantizes GEMM1's SwiGLU rows into a half form, nothing else.
    act32 = torch.zeros(8, 128, dtype=torch.float32)
    with pytest.raises(ValueError, match="out_scale"):
        fragment_gemm(x, *w13, act32, gemm1=True, decode="bf16", out_scale=0.5, **common)
    with pytest.raises(ValueError, match="out_scale"):
        y = torch.zeros(8, 96)
        fragment_gemm(act16, *w2, y, gemm1=False, decode="fp16", out_scale=0.5, **common)


@pytest.mark.parametrize("top_k", [1, 2, 3, 4, 8, 16, 32])
def test_half_pair_rows_bound_keeps_a_tokens_rounding_under_half_the_tolerance(top_k):
    """fp16 rounds a value below 2^(e+1) by at most 2^(e-11): top_k rows below the bound err
    by at most 2^-8 together, half of bf16's atol (0.01) at most; and the bound is the
    largest power of two that keeps it."""
    bound = half_pair_rows_bound(top_k)
    assert math.frexp(bound)[0] == 0.5
    worst = top_k * bound * 2.0**-12
    assert worst <= 2.0**-8 < 2 * worst
    # The rounding the bound is derived from, checked on fp16 itself just below the bound.
    x = torch.tensor([bound * (1 - 2.0**-20)], dtype=torch.float64)
    assert abs(float(x.to(torch.float16).double() - x)) <= bound * 2.0**-12


@pytest.mark.parametrize("exponent", range(-13, 16))
def test_fp16_pair_rows_pick_by_float32_bits_what_the_combine_picks_by_fp16(exponent):
    """GEMM2 decides a pair's fp16 or float32 rows on the float32 bits
    (fp16_wide_threshold_bits); the combine reads the float32 rows where the fp16 value is
    not below the bound. Both must pick the same elements, including the values that round
    up to the bound, infinities and NaN."""
    bound = 2.0**exponent
    threshold = fp16_wide_threshold_bits(bound)
    near = torch.arange(threshold - 4096, threshold + 4096, dtype=torch.int32)
    special = torch.tensor([0x7F800000, 0x7FC00000, 0, 1], dtype=torch.int32)
    values = torch.cat([near, special]).view(torch.float32)
    values = torch.cat([values, -values])
    combine_reads_wide = (values.to(torch.float16).float().abs() < bound) == 0
    gemm2_stores_wide = (values.view(torch.int32) & 0x7FFFFFFF) >= threshold
    assert torch.equal(combine_reads_wide, gemm2_stores_wide)


def test_fp16_pair_rows_where_the_shard_keeps_rows_small():
    allowed = FragmentConfig(128, 128, 4, 2, pdl=True, narrow_t=32, half_pair_rows=True)
    assert half_pair_rows(allowed, 384, 1) and half_pair_rows(allowed, 768, 1)  # TP=8, TP=4
    assert not half_pair_rows(allowed, 1536, 1)  # TP=2 (1440 padded)
    assert not half_pair_rows(allowed, 384, 2)  # split partial rows
    assert not half_pair_rows(FragmentConfig(128, 128, 4, 2), 384, 1)


def test_fp16_pair_rows_need_their_float32_beside_them():
    prepared = prepare_weights("mxfp4", 96, 80, word_order="fragment", **_checkpoint())
    w2 = (prepared["w2"], prepared["w2_scale"], prepared["w2_bias"])
    act16 = torch.zeros(8, 128, dtype=torch.float16)
    y16 = torch.zeros(8, 96, dtype=torch.float16)
    wide = torch.zeros(8, 96)
    common = dict(gemm1=False, decode="fp16", k_valid=80, n_valid=96)
    common |= dict(config=FragmentConfig(128, 16, 4, 2), routing=(None, None, None, None, 1, 2))
    for kwargs in (
        dict(wide=None, half_bound=4.0),
        dict(wide=wide, half_bound=3.0),  # not a power of two
        dict(wide=wide, half_bound=2.0**16),  # past fp16's normal range
        dict(wide=wide, half_bound=2.0**-14),  # fp16's steps finer below it
        dict(wide=wide[:, :64], half_bound=4.0),
        dict(wide=wide.half(), half_bound=4.0),
    ):
        with pytest.raises(ValueError, match="fp16 pair rows"):
            fragment_gemm(act16, *w2, y16, **common, **kwargs)
    # Split partial rows: GEMM2 over two K chunks (I = 256).
    prepared = prepare_weights("mxfp4", 96, 256, word_order="fragment", **_checkpoint(I=256))
    w2 = (prepared["w2"], prepared["w2_scale"], prepared["w2_bias"])
    with pytest.raises(ValueError, match="fp16 pair rows"):
        act16 = torch.zeros(8, 256, dtype=torch.float16)
        fragment_gemm(
            act16, *w2, y16, **common | dict(k_valid=256), wide=wide, half_bound=4.0, split_k=2
        )
    out = torch.empty(2, 96, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fp16 pair rows come with"):
        combine(y16, out, top_k=4)
    with pytest.raises(ValueError, match="fp16 pair rows come with"):
        combine(wide, out, top_k=4, wide=wide, half_bound=4.0)


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_raw_decode_ptx_gives_every_code_times_the_raw_exponent(kind):
    """The post-scaled kernel's decode (no factor), interpreted: every code in every slot is
    e2m1 * 2^-RAW_EXPONENT exactly (bf16's code 1 being the subnormal 2^-127)."""
    ptx = shift_words.PTX_RAW_BF16 if kind == "bf16" else shift_words.PTX_RAW_F16
    values = torch.tensor(E2M1_MAGNITUDES + tuple(-v for v in E2M1_MAGNITUDES))
    for code in range(16):
        codes = torch.tensor([(code + i) % 16 for i in range(8)], dtype=torch.uint8)
        packed = codes[0::2] | (codes[1::2] << 4)
        word = int(shift_words.encode(packed, kind)[0]) & 0xFFFFFFFF
        got = _run_ptx(ptx.value, word, 0, HALF_TYPES[kind])
        raw = 2.0 ** -shift_words.RAW_EXPONENT[kind]
        assert got == (values[codes.long()].double() * raw).tolist(), (kind, code)


def _run_factor_ptx(ptx: str, scale_word: int, selector: int) -> float:
    """Interpret the factor PTX (prmt then mad.lo.u32) -> the fp32 it leaves in $0."""
    regs = {"$1": scale_word, "$2": selector}
    for line in ptx.strip("{} ").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        args = [a.strip() for a in args.split(",")]
        if op == "prmt.b32":  # output byte i = byte (selector nibble i) of {b, a}
            pool = regs[args[1]] | (int(args[2], 0) << 32)
            sel = regs[args[3]]
            regs[args[0]] = sum(
                ((pool >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4)
            )
        elif op == "mad.lo.u32":
            regs[args[0]] = (regs[args[1]] * int(args[2]) + int(args[3])) & 0xFFFFFFFF
        else:
            raise AssertionError(f"instruction the interpreter does not know: {line}")
    return torch.tensor([regs["$0"]], dtype=torch.int64).to(torch.int32).view(torch.float32).item()


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_post_scale_factors_are_normal_powers_of_two(kind):
    """POST_SCALE's fp32 factor of scale byte s (any of the four bytes of a scale word, the
    others arbitrary) is 2^(s - 127 + POST_SCALE_BIAS), a normal fp32, over the exact range
    of the layout."""
    ptx = shift_words.PTX_FLOAT_FACTOR_BF16 if kind == "bf16" else shift_words.PTX_FLOAT_FACTOR_F16
    bias = shift_words.POST_SCALE_BIAS[kind]
    for s in shift_words.EXACT_SCALE_BYTES[kind]:
        for byte in range(4):
            others = 0xFFFFFFFF ^ (0xFF << (8 * byte))
            word = (s << (8 * byte)) | (0x9D5A3CE1 & others)
            got = _run_factor_ptx(ptx.value, word, 0x4440 + byte)
            assert got == 2.0 ** (s - 127 + bias) >= torch.finfo(torch.float32).tiny, (s, byte)


def test_post_scale_configs_refuse_what_the_kernel_cannot_run():
    FragmentConfig(64, 2, 4, 2, chunks=4, mma_in_flight=2, post_scale=True)
    assert FragmentConfig(64, 2, 4, 2, chunks=4, mma_in_flight=1, post_scale=True).mma_n == 8
    with pytest.raises(ValueError, match="one or two chunks"):
        FragmentConfig(64, 2, 4, 2, chunks=4, post_scale=True)  # all four in flight


def test_weights_that_cannot_post_scale_get_the_scaled_form_of_the_pick():
    """Byte-permute words or a bf16 intermediate: the post-scaled decode picks become 8-token
    scaled-fragment tiles, the same object every call (no per-call construction); pinned
    configs too; other picks are unchanged."""
    decode = pick_fragment_config(4)
    assert decode.post_scale and decode.block_t == 2
    scaled = pick_fragment_config(4, post_scalable=False)
    assert not scaled.post_scale and scaled.block_t == 8 and scaled.mma_n == 8
    assert scaled is pick_fragment_config(4, post_scalable=False)
    assert (scaled.block_w, scaled.chunks, scaled.pdl) == (decode.block_w, decode.chunks, True)
    prefill = pick_fragment_config(100000)
    assert pick_fragment_config(100000, post_scalable=False) is prefill
    with pin_config(KERNEL_NAME, decode):
        assert pick_fragment_config(10**6, post_scalable=False) == scaled


def test_fragment_gemm_refuses_words_not_contiguous_in_a_chunk():
    w = torch.zeros(1, 64, 32, dtype=torch.int32)[:, :, ::2]  # every other word
    scale = torch.zeros(1, 64, 4, dtype=torch.uint8)
    config = FragmentConfig(64, 8, 4, 2)
    with pytest.raises(ValueError, match="must be contiguous"):
        fragment_gemm(
            torch.zeros(8, 128, dtype=torch.bfloat16),
            w,
            scale,
            None,
            torch.zeros(8, 64),
            (None, None, None, None, 1, 4),
            gemm1=True,
            decode="bf16",
            k_valid=128,
            n_valid=64,
            config=config,
        )


def test_post_scaled_gemms_refuse_weights_they_cannot_scale():
    """Post-scaling needs raw shift halves: GEMM1 from shift words plus the router's x
    exponents, GEMM2 from fp16 shift words. Anything else is refused before a launch."""
    config = FragmentConfig(64, 2, 4, 2, chunks=4, mma_in_flight=1, post_scale=True)
    w = torch.zeros(1, 64, 16, dtype=torch.int32)
    scale = torch.zeros(1, 64, 4, dtype=torch.uint8)
    routing = (None, None, None, None, 1, 4)
    x = torch.zeros(2, 128, dtype=torch.bfloat16)
    common = dict(k_valid=128, n_valid=64, config=config)
    with pytest.raises(ValueError, match="post_scale needs shift-decoded"):
        fragment_gemm(x, w, scale, None, x, routing, gemm1=True, decode="prmt", **common)
    with pytest.raises(ValueError, match="needs x_exp"):
        fragment_gemm(x, w, scale, None, x, routing, gemm1=True, decode="bf16", **common)
    hilo = torch.zeros(2, 256, dtype=torch.bfloat16)  # GEMM2's bf16 [hi | lo] rows
    with pytest.raises(ValueError, match="post_scale needs shift-decoded"):
        fragment_gemm(hilo, w, scale, None, x, routing, gemm1=False, decode="bf16", **common)


def test_expert_parallel_ranks_pick_decode_tiles_by_their_share_of_the_pairs():
    """Up to the one-program router's pairs (M <= 16 at top-4) a rank keys its tiles on the
    pairs its experts expect; beyond, on tokens x top_k, as the whole layer does."""
    key = _common.selection_pairs
    assert [key(m, 4, 16, 128) for m in (1, 4, 5, 8, 12, 16)] == [1, 2, 3, 4, 6, 8]
    assert [key(m, 4, 16, 128) for m in (17, 64, 3072)] == [68, 256, 12288]
    assert [key(m, 4, 128, 128) for m in (1, 8, 16)] == [4, 32, 64]  # whole layer, TP shards
    assert key(16, 4, 64, 128) == 32  # EP=2
    # Rank 0 of EP=8 at M=8 and 12 runs the whole layer's M=1 and M=4 tiles.
    assert pick_fragment_config(key(8, 4, 16, 128)) == CONFIGS[0][1]
    assert pick_fragment_config(key(12, 4, 16, 128)) == CONFIGS[1][1]


def test_fewer_experts_pick_tiles_by_tokens_per_expert():
    """Past the decode tiles the key is the pairs 128 experts would hold at the same tokens per
    expert: GPT-OSS-20B's 32 experts hold four times GPT-OSS-120B's at the same M, and run the
    tiles 120B runs at four times the M. Its decode sizes (M <= 16) keep their own decode keys,
    and no key past the one-program router's pairs reaches a decode tile (they need it)."""
    key = _common.selection_pairs
    assert [key(m, 4, 32, 32) for m in (1, 4, 8, 16)] == [4, 16, 32, 64]
    assert [key(m, 4, 32, 32) for m in (17, 64, 1024)] == [272, 1024, 16384]
    for m in (64, 256, 2048):
        assert pick_fragment_config(key(m, 4, 32, 32)) == pick_fragment_config(
            key(4 * m, 4, 128, 128)
        )
    assert [key(m, 4, 8, 32) for m in (1, 4, 8, 64)] == [1, 4, 8, 1024]  # 20B at EP=4
    # 256 experts hold half 128's tokens each: M=17 is past the one-program router (68
    # pairs) and keys on 65, not a decode tile's 34.
    assert [key(m, 4, 256, 256) for m in (16, 17, 64)] == [64, 65, 128]
    assert not pick_fragment_config(key(17, 4, 256, 256)).tile_ready


def test_prefill_picks_warp_specialize_both_gemms():
    """From M > 2048 both GEMMs' full tiles run warp-specialized on every shard: into float32
    pair rows on the whole layer, TP=2 and TP=4 shards to M=2816 (fitted widths, giving up
    fp16 pair rows), into fp16 pair rows on TP=8 shards and TP=4 beyond (128 columns)."""

    def gemm2_form(m, padded_intermediate):
        config = for_layer(pick_fragment_config(m * 4), padded_intermediate, 128)
        assert config.warp_specialized and config.warp_specialized_gemm2, (m, padded_intermediate)
        return half_pair_rows(config, padded_intermediate, 1), config.fit_widths

    for m in (2304, 2816, 3072, 4096, 8192):
        assert gemm2_form(m, 2944) == (False, True)  # whole layer
        assert gemm2_form(m, 1472) == (False, True)  # TP=2
        assert gemm2_form(m, 768) == ((True, False) if m > 2816 else (False, True))  # TP=4
        assert gemm2_form(m, 384) == (True, False)  # TP=8
    # Below M=2049 only where the local experts' channels are many (the next test).
    assert not for_layer(pick_fragment_config(2048 * 4), 384, 128).warp_specialized
    assert not pick_fragment_config(1664 * 4).warp_specialized


class _Picked(Exception):
    pass


@pytest.mark.parametrize(
    "routing,num_experts,want",
    [
        ("logits", None, 4),  # the router's width: 128 experts
        ("ids", 128, 4),  # the plan's count, passed by the kernel object
        ("ids", None, 32),  # precomputed ids and no count: the prepared experts
    ],
)
def test_the_forward_keys_its_pick_on_the_ranks_pairs(monkeypatch, routing, num_experts, want):
    keys = []

    def pick(pairs, post_scalable=True):
        keys.append(pairs)
        raise _Picked

    monkeypatch.setattr(moe_sm90, "pick_config", pick)
    m, e = 8, 16
    prepared = dict(
        w2_decode="fp16", w13_decode="bf16", padded_intermediate_size=128, num_experts=e
    )
    x = torch.zeros(m, 64, dtype=torch.bfloat16)
    inputs = (
        dict(router_logits=torch.zeros(m, 128))
        if routing == "logits"
        else dict(topk_weights=torch.ones(m, 4), topk_ids=torch.zeros(m, 4, dtype=torch.int32))
    )
    with pytest.raises(_Picked):
        moe_forward_sm90(
            x, prepared, top_k=4, out=torch.empty_like(x), num_experts=num_experts, **inputs
        )
    assert keys == [want]
    # The registered kernel passes the plan's expert count.
    config = MoEConfig(128, 4, 64, 96, num_local_experts=16)
    options = moe_sm90.TritonMoESm90().forward_options(
        config, dict(w13_input_scale=None, w2_input_scale=None)
    )
    assert options["num_experts"] == 128
