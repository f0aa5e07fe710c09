"""Hopper MoE tile configs pinned against the heuristic's pick, beside vLLM's GPT-OSS MoE.

    python3 benchmarks/ab_moe_configs.py --shards whole,tp8 --sizes 3072,6144 \
        --config "FragmentConfig(128, 128, 4, 2, pdl=True, narrow_t=32, warp_specialized=True)"

GPT-OSS-120B weights as bench_moe.py builds them (a TP shard: rank 0's; --model gpt-oss-20b: its
32 experts). Each round times
vLLM's path (OpenAI triton_kernels on PYTHONPATH, as bench_moe.py), the pick and each --config
in turn, CUDA-graph replayed over --layers distinct weight copies (bench_moe.time_layers), so
that a machine's drift during the run falls on all of them alike; the order turns by one each
round, since a layer timed right after vLLM's path ran slower than the same layer timed later
in the round (H200, 2026-11-28, the pick against the same config pinned, M = 1152-1792 on
the whole layer and TP=2/4/8 shards: -0.4% to 2.3%, median 0.6%). Prints per config its median
and range over the rounds, its time over the pick's, vLLM's time over it, and its largest
difference from the pick's output (0 where it computes the pick's function bit for bit; the
pick's own accuracy is what bench_moe.py checks). Each of those two calls starts on scratch
buffers filled with NaN: a config that leaves a row unwritten differs by NaN, where it would
otherwise read back the pick's row. --config takes a Python expression over FragmentConfig,
CONFIGS, dataclasses, first_match and the size m (e.g. `dataclasses.replace(CONFIGS[-1][1],
fit_widths=False)`, or `first_match(CONFIGS, 16 * m)`: the tile 128 experts would take at four
times the pairs), evaluated per size; none leaves the pick against vLLM alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import bench_moe as bench
import torch

from tokenspeed_kernel import (
    expert_parallel_shard,
    moe_plan,
    moe_prepare_weights,
    tensor_parallel_shard,
)
from tokenspeed_kernel.tools import peers
from tokenspeed_kernel.tuning import first_match, pin_config
from tokenspeed_kernel_triton.moe import moe_sm90, workspace
from tokenspeed_kernel_triton.moe.fragment_config_sm90 import CONFIGS, FragmentConfig


def layer(shard: str, weights):
    """(config, weights) of `shard`: "whole", "tpN" or "epN" (rank 0 of N)."""
    if shard == "whole":
        return bench.CONFIG, weights
    split = {"tp": tensor_parallel_shard, "ep": expert_parallel_shard}.get(shard[:2])
    if split is None or not shard[2:].isdigit():
        raise SystemExit(f"--shards: {shard!r} is neither 'whole', 'tpN' nor 'epN'")
    return split(bench.CONFIG, weights, rank=0, world_size=int(shard[2:]))


# What a --config expression may name, beside the size m.
CONFIG_NAMES = dict(FragmentConfig=FragmentConfig, CONFIGS=CONFIGS, dataclasses=dataclasses)
CONFIG_NAMES.update(first_match=first_match)


def parse_configs(texts: list[str], m: int) -> list[FragmentConfig]:
    """--config expressions at size m (over CONFIG_NAMES) -> the configs."""
    configs = [eval(text, {**CONFIG_NAMES, "m": m}) for text in texts]  # a developer's own
    for config in configs:
        if not isinstance(config, FragmentConfig):
            raise SystemExit(f"--config: {config!r} is not a FragmentConfig")
    return configs


def compare(
    shard: str, m: int, configs: list, plan, ours: list, peer: list, rounds: int, skew: float
):
    x, logits, out = bench.token_inputs(m, skew)

    def apply(prepared, into):
        plan.impl.apply(
            plan, x, prepared, router_logits=logits, topk_weights=None, topk_ids=None, out=into
        )

    def timed(config) -> float:
        def forward():
            for prepared in ours:
                apply(prepared, out)

        if config is None:
            return bench.time_layers(forward, len(ours))
        with pin_config(moe_sm90.KERNEL_NAME, config):
            return bench.time_layers(forward, len(ours))

    # Each call starts on poisoned scratch, so that rows a config leaves unwritten show up as
    # NaN differences rather than the previous call's rows read back.
    picked = torch.empty_like(out)
    workspace.poison_scratch()
    apply(ours[0], picked)
    differences = []
    for config in configs[1:]:
        tiled = torch.empty_like(out)
        workspace.poison_scratch()
        with pin_config(moe_sm90.KERNEL_NAME, config):
            apply(ours[0], tiled)
        differences.append((tiled.float() - picked.float()).abs().max().item())

    def peer_forward():
        for p in peer:
            p(x, logits, out)

    times = [[] for _ in configs]
    vllm = []
    runners = [None, *range(len(configs))]  # None: vLLM's path
    for r in range(rounds):
        turn = r % len(runners)
        for i in runners[turn:] + runners[:turn]:
            if i is None:
                vllm.append(bench.time_layers(peer_forward, len(peer)))
            else:
                times[i].append(timed(configs[i]))
    v = statistics.median(vllm)
    base = statistics.median(times[0])
    print(
        f"{shard} M={m} skew {skew}: vLLM {v:.1f} µs [{min(vllm):.1f}-{max(vllm):.1f}]", flush=True
    )
    for i, config in enumerate(configs):
        t = statistics.median(times[i])
        diff = "" if i == 0 else f", max |config - pick| {differences[i - 1]:.3e}"
        print(
            f"  {'pick' if config is None else config}: {t:.1f} µs "
            f"[{min(times[i]):.1f}-{max(times[i]):.1f}], x{t / base:.3f} the pick's, "
            f"vLLM / it {v / t:.2f}{diff}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shards", default="whole", help="comma-separated: whole, tp2, tp8, ep8, ..."
    )
    parser.add_argument("--sizes", required=True, help="comma-separated M")
    parser.add_argument("--config", action="append", default=[], help="a FragmentConfig")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--skew", type=float, default=0.0, help="routing skew (bench_moe.token_inputs)"
    )
    parser.add_argument("--model", default=bench.MODEL, choices=bench.MODELS)
    args = parser.parse_args()
    bench.use_model(args.model)
    sizes = [int(m) for m in args.sizes.split(",")]
    for m in sizes:
        parse_configs(args.config, m)  # bad expressions fail before any GPU work
    weights = bench.checkpoint_weights()
    for shard in args.shards.split(","):
        config, shard_weights = layer(shard, weights)
        plan = moe_plan(config, device="cuda", max_num_tokens=max(*sizes, 1024))
        ours = [moe_prepare_weights(plan, shard_weights) for _ in range(args.layers)]
        peer = [peers.TritonKernelsMoE(config, shard_weights) for _ in range(args.layers)]
        for m in sizes:
            configs = [None] + parse_configs(args.config, m)
            compare(shard, m, configs, plan, ours, peer, args.rounds, args.skew)
        del ours, peer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
