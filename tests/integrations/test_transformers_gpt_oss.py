"""transformers' GPT-OSS on tokenspeed ops against transformers' own eager implementation.

One tiny random GPT-OSS (2 layers: sliding window 16, then full; head_dim 64, sinks, 8 experts
top-2, initializer_range 0.1) is written as an MXFP4 checkpoint and loaded twice, eager and
"tokenspeed". On the CPU the tokenspeed path runs the reference kernels; on a GPU (`-m gpu`) the
selected kernels.

Greedy tokens are compared for 32 steps on a pinned seed: eager GPT-OSS computes its softmax and
expert sums in bf16, so the two paths differ by a few bf16 ulps and a near-tie between the two
best tokens can flip (about half the seeds flip one somewhere in 32 steps). The logits of every
step are compared within bf16 tolerance on eager's own token sequence, which does not depend on
ties.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from gpt_oss_checkpoint import load, write_mxfp4_checkpoint  # noqa: E402

from tokenspeed_kernel.formats.mxfp4 import dequantize_mxfp4  # noqa: E402
from tokenspeed_kernel.integrations import transformers as tk_hf  # noqa: E402

SEED, VOCAB, PROMPT, STEPS = 14, 64, 20, 32
# Logit error allowed: eager rounds attention probabilities and expert partial sums to bf16,
# logits are O(3) here (bf16 ulp 0.016). A token whose router logits are a near tie in some
# layer can take another expert on one path (routing is transformers' own on both, but its
# input differs by those ulps): such rows may differ by more, up to ROUTING_FLIP_ATOL, and at
# most one row in ROUTING_FLIP_RATE may.
LOGIT_ATOL = 0.1
# Plus one bf16 step of the logit itself: the logits are bf16, and a step at |logit| >= 16 is
# 0.125 (seen on an H100, row 39 of a 40-token prompt, the same experts on both paths).
LOGIT_RTOL = 2.0**-7
ROUTING_FLIP_ATOL = 1.0
ROUTING_FLIP_RATE = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_mxfp4_checkpoint(tmp_path_factory.mktemp("gpt_oss"), seed=SEED, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def models(checkpoint):
    tk_hf.register()
    return load(checkpoint, "eager"), load(checkpoint, "tokenspeed")


def _prompt(batch=1, length=PROMPT, seed=SEED):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, length), generator=g)  # 0 is the pad token


def _greedy(model, ids, steps=STEPS, **kwargs):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=steps, do_sample=False, pad_token_id=0, **kwargs)


def assert_logits_close(actual, expected, flipped=None):
    """actual, expected [..., V]: every row within LOGIT_ATOL but for rare routing flips.

    flipped, where known: ExpertChoices.differ's (rows that took other experts, rows that
    attend to such a row's changed output). The first may be off by any amount (another expert
    is another function), at most one row in ROUTING_FLIP_RATE; the second by up to
    ROUTING_FLIP_ATOL; every other row must be within the tolerance."""
    error = (actual - expected).abs()
    row_error = error.amax(dim=-1).flatten()
    off = (error > LOGIT_ATOL + LOGIT_RTOL * expected.abs()).any(dim=-1).flatten()
    limit = max(1, row_error.numel() // ROUTING_FLIP_RATE)
    if flipped is not None:
        took_others, downstream = flipped
        unexplained = off & ~took_others & ~downstream
        assert not unexplained.any(), (
            f"rows {unexplained.nonzero().flatten().tolist()} differ by "
            f"{row_error[unexplained].tolist()} (> {LOGIT_ATOL} + {LOGIT_RTOL} |logit|) with the "
            "same experts, downstream of no flip"
        )
        attended = downstream & ~took_others
        assert not (row_error[attended] > ROUTING_FLIP_ATOL).any(), (
            f"rows downstream of a flip differ by {row_error[attended].tolist()}"
        )
        assert int(took_others.sum()) <= limit, f"{int(took_others.sum())} rows took other experts"
        return
    assert int(off.sum()) <= limit, (
        f"{int(off.sum())} of {row_error.numel()} rows differ by more than {LOGIT_ATOL} + "
        f"{LOGIT_RTOL} |logit|: "
        f"{row_error[off].tolist()}"
    )
    assert float(row_error.max()) <= ROUTING_FLIP_ATOL, f"max row error {float(row_error.max())}"


class ExpertChoices:
    """Records the experts transformers' router picks in every layer of a model's forward
    calls (both models route with transformers' own GptOssTopKRouter)."""

    def __init__(self, model):
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

        self.calls = []
        self.routers = [m for m in model.modules() if isinstance(m, GptOssTopKRouter)]
        assert self.routers, "no GptOssTopKRouter in the model"

    def __enter__(self):
        record = lambda _module, _args, out: self.calls.append(out[2].sort(-1).values)  # noqa: E731
        self._hooks = [r.register_forward_hook(record) for r in self.routers]
        return self

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()

    def differ(self, other, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([rows] bool, [rows] bool) over the batch's flattened rows: the rows whose experts
        differ from `other`'s in some layer, and the rows at or after a row that differed in
        an earlier layer than the last, in the same sequence (its changed output reaches them
        through the next layers' causal attention)."""
        assert len(self.calls) == len(other.calls) == len(self.routers)
        flips = [
            (a != b).any(-1).view(batch, -1) for a, b in zip(self.calls, other.calls, strict=True)
        ]
        took_others = torch.stack(flips).any(0)
        upstream = torch.stack(flips[:-1]).any(0) if len(flips) > 1 else torch.zeros_like(flips[0])
        downstream = upstream.int().cummax(dim=-1).values.bool()
        return took_others.flatten(), downstream.flatten()


def test_experts_serve_the_checkpoint_mxfp4_bytes(checkpoint, models):
    from safetensors.torch import load_file

    _, ours = models
    experts = ours.model.layers[0].mlp.experts
    plan = tk_hf.prepare_experts(experts)
    assert plan.config.weight_format == "mxfp4"  # the dequantized weights round-trip exactly
    state = load_file(checkpoint / "model.safetensors")
    blocks = state["model.layers.0.mlp.experts.gate_up_proj_blocks"]
    scales = state["model.layers.0.mlp.experts.gate_up_proj_scales"]
    values = dequantize_mxfp4(blocks.reshape(*scales.shape[:2], -1), scales)
    torch.testing.assert_close(experts.gate_up_proj.transpose(1, 2).float(), values, rtol=0, atol=0)


def test_prefill_logits_match_eager(models):
    eager, ours = models
    ids = _prompt(batch=2, length=40)  # longer than the sliding window
    with torch.no_grad():
        expected = eager(ids).logits.float()
        actual = ours(ids).logits.float()
    assert_logits_close(actual, expected)


def test_greedy_tokens_and_cached_logits_match_eager(models):
    eager, ours = models
    ids = _prompt()
    options = dict(output_logits=True, return_dict_in_generate=True)
    expected, actual = _greedy(eager, ids, **options), _greedy(ours, ids, **options)
    assert actual.sequences.tolist() == expected.sequences.tolist()
    # Same tokens, so each step's logits (a prefill, then decode over the cache) compare.
    assert_logits_close(torch.cat(actual.logits).float(), torch.cat(expected.logits).float())


def test_left_padded_batch_matches_unpadded_rows(models):
    _, ours = models
    long, short = _prompt(length=24, seed=1), _prompt(length=17, seed=2)
    ids = torch.cat((torch.cat((torch.zeros(1, 7, dtype=torch.long), short), 1), long))
    mask = (torch.arange(24) >= 7).long().unsqueeze(0).expand(2, -1).clone()
    mask[1] = 1
    batched = _greedy(ours, ids, steps=8, attention_mask=mask)
    assert batched[0, 7:].tolist() == _greedy(ours, short, steps=8)[0].tolist()
    assert batched[1].tolist() == _greedy(ours, long, steps=8)[0].tolist()


def test_packed_sequences_attend_within_their_own_positions(models):
    _, ours = models
    first, second = _prompt(length=9, seed=3), _prompt(length=7, seed=4)
    packed = torch.cat((first, second), dim=1)
    positions = torch.cat((torch.arange(9), torch.arange(7))).unsqueeze(0)
    with torch.no_grad():
        together = ours(packed, position_ids=positions, use_cache=False).logits
        apart = torch.cat((ours(first).logits, ours(second).logits), dim=1)
    torch.testing.assert_close(together, apart, rtol=0, atol=0.035)  # 2 bf16 ulps at 4


def test_enable_switches_a_loaded_eager_model(checkpoint):
    model = load(checkpoint, "eager")
    tk_hf.enable(model)
    assert model.config._attn_implementation == "tokenspeed"
    assert model.config._experts_implementation == "tokenspeed"
    experts = model.model.layers[1].mlp.experts
    assert experts._tokenspeed_moe[1].config.weight_format == "mxfp4"


def test_bf16_weights_that_are_not_mxfp4_stay_bf16(models):
    _, ours = models
    experts = ours.model.layers[1].mlp.experts
    original = experts.gate_up_proj.data.clone()
    try:
        with torch.no_grad():
            experts.gate_up_proj.add_(1e-3)  # values off the MXFP4 grid
        ids = _prompt(length=5)
        with torch.no_grad():
            ours(ids)
        assert experts._tokenspeed_moe[1].config.weight_format == "bf16"
    finally:
        with torch.no_grad():
            experts.gate_up_proj.copy_(original)


def test_float32_activations_are_refused(models):
    _, ours = models
    attn = ours.model.layers[0].self_attn
    q = torch.randn(1, 4, 3, 64)
    kv = torch.randn(1, 2, 3, 64)
    with pytest.raises(ValueError, match="activations are torch.float32, expected bfloat16"):
        tk_hf.attention_forward(attn, q, kv, kv, None, scaling=0.125)
    experts = ours.model.layers[0].mlp.experts
    ids = torch.zeros(3, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="hidden_states are torch.float32, expected bfloat16"):
        tk_hf.experts_forward(experts, torch.randn(3, 128), ids, torch.ones(3, 2))


def test_custom_4d_mask_is_refused(models):
    _, ours = models
    attn = ours.model.layers[0].self_attn
    q = torch.randn(1, 4, 3, 64).bfloat16()
    kv = torch.randn(1, 2, 3, 64).bfloat16()
    with pytest.raises(ValueError, match="attention_mask has 4 dimensions, expected the 2-D"):
        tk_hf.attention_forward(attn, q, kv, kv, torch.zeros(1, 1, 3, 3), scaling=0.125)


def test_right_padding_with_a_cache_is_refused(models):
    _, ours = models
    ids = _prompt(batch=2, length=6)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, 4:] = 0
    with pytest.raises(ValueError, match="expected left padding"):
        _greedy(ours, ids, attention_mask=mask)


def test_bad_weight_format_is_named(models):
    _, ours = models
    with pytest.raises(ValueError, match="weight_format is 'fp4', expected one of auto"):
        tk_hf.prepare_experts(ours.model.layers[0].mlp.experts, weight_format="fp4")


def test_core_imports_without_loading_transformers():
    import subprocess
    import sys

    code = (
        "import sys, tokenspeed_kernel, tokenspeed_kernel.integrations.transformers;"
        "assert 'transformers' not in sys.modules, 'transformers imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.gpu
def test_gpu_logits_and_greedy_tokens_match_eager(checkpoint):
    tk_hf.register()
    eager, ours = load(checkpoint, "eager", "cuda"), load(checkpoint, "tokenspeed", "cuda")
    ids = _prompt(batch=2, length=40).cuda()
    with torch.no_grad(), ExpertChoices(ours) as ours_experts, ExpertChoices(eager) as theirs:
        actual, expected = ours(ids).logits.float(), eager(ids).logits.float()
    assert_logits_close(actual, expected, ours_experts.differ(theirs, batch=2))
    ids = _prompt().cuda()
    expected = _greedy(eager, ids)
    with torch.no_grad(), ExpertChoices(ours) as ours_experts, ExpertChoices(eager) as theirs:
        reference = eager(expected).logits.float()
        actual = ours(expected).logits.float()
    assert_logits_close(actual, reference, ours_experts.differ(theirs, batch=1))
    assert _greedy(ours, ids)[0, : PROMPT + 8].tolist() == expected[0, : PROMPT + 8].tolist()


def test_expert_choices_name_the_rows_that_flipped(models):
    """The flip-aware comparison: a row off by more than the tolerance passes only where its
    experts differ, or (by up to ROUTING_FLIP_ATOL) after a row whose experts differed in an
    earlier layer, so a wrong kernel cannot hide behind the routing allowance."""
    eager, _ = models
    ids = _prompt(batch=2, length=40)
    with torch.no_grad(), ExpertChoices(eager) as first:
        eager(ids)
    with torch.no_grad(), ExpertChoices(eager) as second:
        eager(ids)
    took_others, downstream = first.differ(second, batch=2)
    assert not took_others.any() and not downstream.any()
    experts = eager.config.num_local_experts
    first.calls[-1][3, 0] = (first.calls[-1][3, 0] + 1) % experts  # the last layer: row 3 only
    first.calls[0][47, 0] = (first.calls[0][47, 0] + 1) % experts  # layer 0: sequence 1 from 7
    took_others, downstream = first.differ(second, batch=2)
    assert took_others.nonzero().flatten().tolist() == [3, 47]
    assert downstream.nonzero().flatten().tolist() == list(range(47, 80))
    expected = torch.zeros(80, 8)
    actual = expected.clone()
    actual[3] += 5.0
    actual[47] += 5.0
    actual[52] += 0.5
    assert_logits_close(actual, expected, (took_others, downstream))
    actual[52] += 1.0
    with pytest.raises(AssertionError, match="downstream of a flip differ"):
        assert_logits_close(actual, expected, (took_others, downstream))
    actual[52] -= 1.5
    actual[4] += 0.2
    with pytest.raises(AssertionError, match=r"rows \[4\] differ"):
        assert_logits_close(actual, expected, (took_others, downstream))
