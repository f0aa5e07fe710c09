"""The end-to-end GPT-OSS model (integrations.gpt_oss) and its benchmark's CPU mode: the model
runs on the reference kernels, matches transformers' decoder layer on the same weights, and its
cached decode agrees with a fresh prefill."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tokenspeed_kernel.integrations.gpt_oss import (
    PRESETS,
    GptOssModel,
    decode_batch,
    prefill_batch,
    rope_cos_sin,
    rope_inv_freq,
)

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def model():
    return GptOssModel(PRESETS["tiny"], device="cpu", seed=3)


def test_decode_after_prefill_matches_one_prefill(model):
    torch.manual_seed(0)
    ids = torch.randint(0, model.shape.vocab_size, (13,))
    lengths, page = [12, 13], 4  # two sequences; the second one token longer
    pages = 4
    cache = model.new_cache(2 * pages, page)
    batch, positions = prefill_batch(lengths, page, pages, "cpu")
    tokens = torch.cat((ids[:12], ids))
    last = batch.cu_seqlens[1:].long() - 1
    full = model.forward(tokens, positions, cache, batch, last=last)
    # Sequence 0 then decodes ids[12]: the same tokens as sequence 1's prompt.
    step, pos = decode_batch([12], page, pages, "cpu")
    step.page_table = step.page_table[:, :pages]
    decoded = model.forward(ids[12:], pos, cache, step)
    torch.testing.assert_close(decoded[0].float(), full[1].float(), rtol=0, atol=2e-2)


def test_rope_matches_transformers():
    pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    from tokenspeed_kernel.integrations.gpt_oss import transformers_config

    shape = PRESETS["gpt-oss-120b"]
    rotary = GptOssRotaryEmbedding(transformers_config(shape))
    positions = torch.tensor([0, 1, 127, 4095, 4096, 100000])
    x = torch.zeros(1, len(positions), 8, dtype=torch.bfloat16)
    cos, sin = rotary(x, positions[None])
    inv_freq, scaling = rope_inv_freq(shape)
    ours = rope_cos_sin(inv_freq, scaling, positions)
    torch.testing.assert_close(ours[0], cos[0], rtol=0, atol=0)
    torch.testing.assert_close(ours[1], sin[0], rtol=0, atol=0)


def _benchmark_module():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import gpt_oss_e2e
    finally:
        sys.path.remove(str(BENCHMARKS))
    return gpt_oss_e2e


def test_tiny_benchmark_checks_against_transformers(capsys):
    pytest.importorskip("transformers")
    assert _benchmark_module().main(["--tiny", "--check"]) == 0
    out = capsys.readouterr().out
    assert "| decode | B=3 ctx 20 |" in out
    # 2 layers x (attention prefill/decode, moe M=20/M=1, layer prefill/decode)
    assert out.count("| ok |") == 12


def test_tiny_check_fails_the_block_that_is_wrong(capsys, monkeypatch):
    """A MoE 10% off fails the moe and layer rows and leaves the attention rows ok."""
    pytest.importorskip("transformers")
    from tokenspeed_kernel.integrations import gpt_oss

    moe_apply = gpt_oss.moe_apply
    monkeypatch.setattr(gpt_oss, "moe_apply", lambda *a, **k: moe_apply(*a, **k) * 1.1)
    assert _benchmark_module().main(["--tiny", "--check", "--no-record"]) != 0
    out = capsys.readouterr().out
    for block, phases in (("attention", ("prefill", "decode")), ("moe", ("M=20", "M=1"))):
        for phase in phases:
            line = next(x for x in out.splitlines() if f"| {block} | {phase} |" in x)
            assert (line.split(" | ")[-1] == "ok") == (block == "attention"), line
