"""benchmarks/ab_moe_configs.py on the CPU: the --config and --shards checks, and the rounds
(vLLM's path, the pick, each config in turn, the order turned by one each round) reported as
medians, ratios and each config's difference from the pick's output."""

from __future__ import annotations

import pytest
import torch

from tokenspeed_kernel.tuning import pinned_config as pinned
from tokenspeed_kernel_triton.moe import moe_sm90
from tokenspeed_kernel_triton.moe.fragment_config_sm90 import CONFIGS, FragmentConfig


@pytest.fixture(scope="module")
def ab(import_benchmark):
    return import_benchmark("ab_moe_configs")


def test_configs_are_fragment_config_expressions_of_the_size(ab):
    plain, changed, at_size = ab.parse_configs(
        [
            "FragmentConfig(128, 128, 4, 2, pdl=True, warp_specialized=True)",
            "dataclasses.replace(CONFIGS[-1][1], fit_widths=False)",
            "first_match(CONFIGS, 16 * m)",
        ],
        m=64,
    )
    assert plain == FragmentConfig(128, 128, 4, 2, pdl=True, warp_specialized=True)
    assert not changed.fit_widths and CONFIGS[-1][1].fit_widths
    assert at_size == moe_sm90.pick_config(1024) != moe_sm90.pick_config(256)
    for bad in ("1", "CONFIGS[-1]"):
        with pytest.raises(SystemExit, match="not a FragmentConfig"):
            ab.parse_configs([bad], m=1)


def test_models_differ_in_their_experts_only(ab):
    bench = ab.bench
    try:
        bench.use_model("gpt-oss-20b")
        assert (bench.E, bench.CONFIG.num_experts, bench.CONFIG.num_local_experts) == (32, 32, 32)
        assert (bench.CONFIG.top_k, bench.CONFIG.hidden_size) == (4, 2880)
        with pytest.raises(SystemExit, match="--model"):
            bench.use_model("tiny")
    finally:
        bench.use_model("gpt-oss-120b")
    assert (bench.E, bench.CONFIG.num_experts, bench.MODEL) == (128, 128, "gpt-oss-120b")


def test_shards_are_whole_tp_n_or_ep_n(ab, monkeypatch):
    assert ab.layer("whole", "weights") == (ab.bench.CONFIG, "weights")
    calls = []
    for name in ("tensor_parallel_shard", "expert_parallel_shard"):
        monkeypatch.setattr(ab, name, lambda *a, name=name, **k: calls.append((name, a, k)))
    ab.layer("tp4", "weights")
    ab.layer("ep8", "weights")
    assert calls == [
        ("tensor_parallel_shard", (ab.bench.CONFIG, "weights"), dict(rank=0, world_size=4)),
        ("expert_parallel_shard", (ab.bench.CONFIG, "weights"), dict(rank=0, world_size=8)),
    ]
    for bad in ("tp", "ep", "tpx", "dp2"):
        with pytest.raises(SystemExit, match="--shards"):
            ab.layer(bad, None)


def test_rounds_interleave_and_report_medians_ratios_and_differences(ab, monkeypatch, capsys):
    slower = FragmentConfig(128, 64, 4, 4)
    other = FragmentConfig(128, 8, 4, 3)
    order = []
    peer_ran = []
    # Per runner (vLLM, the pick, `slower`, `other`), µs: its first round, then later ones.
    times = {"vLLM": (300.0, 310.0), None: (200.0, 210.0), slower: (220.0, 230.0)}
    times[other] = (180.0, 190.0)

    def time_layers(fn, layers):
        fn()
        who = "vLLM" if peer_ran and peer_ran.pop() else pinned(moe_sm90.KERNEL_NAME)
        later = who in order
        order.append(who)
        return times[who][later]

    def token_inputs(m, skew):
        assert skew == 0.25
        return torch.zeros(m, 4), torch.zeros(m, 8), torch.zeros(m, 4)

    class Impl:
        @staticmethod
        def apply(plan, x, prepared, out, **routing):
            # `other` computes something else: its output differs from the pick's by 0.5.
            out.fill_(0.5 if pinned(moe_sm90.KERNEL_NAME) == other else 0.0)

    class Plan:
        impl = Impl

    monkeypatch.setattr(ab.bench, "time_layers", time_layers)
    monkeypatch.setattr(ab.bench, "token_inputs", token_inputs)
    peer = [lambda x, logits, out: peer_ran.append(True)]
    ab.compare("whole", 3, [None, slower, other], Plan(), ["layer"], peer, rounds=3, skew=0.25)
    assert order == [
        *("vLLM", None, slower, other),
        *(None, slower, other, "vLLM"),
        *(slower, other, "vLLM", None),
    ]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "whole M=3 skew 0.25: vLLM 310.0 µs [300.0-310.0]"
    assert lines[1] == "  pick: 210.0 µs [200.0-210.0], x1.000 the pick's, vLLM / it 1.48"
    assert lines[2].endswith(
        ": 230.0 µs [220.0-230.0], x1.095 the pick's, vLLM / it 1.35, max |config - pick| 0.000e+00"
    )
    assert lines[3].endswith("vLLM / it 1.63, max |config - pick| 5.000e-01")


def test_a_config_that_leaves_scratch_rows_unwritten_differs_by_nan(ab, monkeypatch, capsys):
    """The pick and each config run on poisoned scratch: a config that reads back rows it never
    wrote (here: skips its write, as a kernel skipping a tile would) cannot inherit the pick's."""
    from tokenspeed_kernel_triton.moe import workspace

    lazy = FragmentConfig(128, 64, 4, 4)

    class Impl:
        @staticmethod
        def apply(plan, x, prepared, out, **routing):
            rows = workspace.scratch("test-ab-rows", tuple(out.shape), torch.float32, out.device)
            if pinned(moe_sm90.KERNEL_NAME) != lazy:
                rows.fill_(1.0)
            out.copy_(rows)

    class Plan:
        impl = Impl

    monkeypatch.setattr(ab.bench, "time_layers", lambda fn, layers: fn() or 100.0)

    def token_inputs(m, skew):
        return torch.zeros(m, 4), torch.zeros(m, 8), torch.zeros(m, 4)

    monkeypatch.setattr(ab.bench, "token_inputs", token_inputs)
    peer = [lambda x, logits, out: None]
    ab.compare("whole", 3, [None, lazy], Plan(), ["layer"], peer, rounds=1, skew=0.0)
    assert capsys.readouterr().out.splitlines()[2].endswith("max |config - pick| nan")
