"""Kernel timeline of triton.moe_apply.sm90's forward beside vLLM's GPT-OSS MoE path on
GPT-OSS-120B shapes: each kernel's mean duration a layer, the layer's span (first start to last
end) and the last layer's kernels' starts and ends, from the last of several CUDA-graph replays
over 4 layers' distinct weights (torch.profiler, CUDA activity; L2-cold, as
benchmarks/bench_moe.py times). Under programmatic dependent launch a kernel starts while the
previous one finishes and waits inside, so the durations can sum past the span; the starts and
ends show the critical path. The profiler adds about 2 us per layer. On the
GPU machine, with vLLM's triton_kernels on PYTHONPATH (bench_moe.py):

    bash scripts/run_from_source.sh python3 scripts/moe_timeline.py --shards whole,ep16 \
        --sizes 3072
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "benchmarks")
import bench_moe as bench  # noqa: E402
from ab_moe_configs import layer  # noqa: E402

from tokenspeed_kernel import moe_plan, moe_prepare_weights  # noqa: E402
from tokenspeed_kernel.tools import peers  # noqa: E402

LAYERS = 4
REPLAYS = 3


def kernel_times(forward) -> tuple[list[tuple[str, float, int]], float, list[str]]:
    """([(kernel, mean µs a layer, launches a layer)], span µs a layer, the last layer's
    kernels as "name start-end" in µs from its first start) of `forward`'s last CUDA-graph
    replay."""
    forward()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start
    )
    last = kernels[-(len(kernels) // REPLAYS) :]
    span = (max(e.time_range.end for e in last) - last[0].time_range.start) / LAYERS
    totals, counts = collections.defaultdict(float), collections.Counter()
    for e in last:
        totals[e.name[:40]] += e.time_range.end - e.time_range.start
        counts[e.name[:40]] += 1
    per_layer = len(last) // LAYERS
    t0 = last[-per_layer].time_range.start
    timeline = [
        f"{e.name[:24]} {e.time_range.start - t0:.1f}-{e.time_range.end - t0:.1f}"
        for e in last[-per_layer:]
    ]
    times = [(name, totals[name] / LAYERS, counts[name] // LAYERS) for name in totals]
    return times, span, timeline


def rows(title: str, times: list[tuple[str, float, int]], span: float, timeline) -> list[str]:
    lines = [f"{title}: span {span:.1f} µs a layer; last layer: " + ", ".join(timeline)]
    lines.append("| kernel | µs a layer | launches |")
    lines.append("| --- | --- | --- |")
    lines += [f"| {name} | {us:.1f} | {n} |" for name, us, n in times]
    return lines


def compare(shard: str, m: int, plan, ours: list, peer: list) -> None:
    ours_forward, peer_forward, _ = bench.layer_forwards(m, plan, ours, peer)
    for title, forward in (("ours", ours_forward), ("vLLM", peer_forward)):
        times, span, timeline = kernel_times(forward)
        print("\n".join(rows(f"{shard} M={m} {title}", times, span, timeline)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", default="whole", help="comma-separated: whole, tp8, ep16, ...")
    parser.add_argument("--sizes", default="1,4", help="comma-separated M")
    args = parser.parse_args()
    sizes = [int(m) for m in args.sizes.split(",")]
    weights = bench.checkpoint_weights()
    for shard in args.shards.split(","):
        config, shard_weights = layer(shard, weights)
        plan = moe_plan(config, device="cuda", max_num_tokens=max(*sizes, 1024))
        ours = [moe_prepare_weights(plan, shard_weights) for _ in range(LAYERS)]
        peer = [peers.TritonKernelsMoE(config, shard_weights) for _ in range(LAYERS)]
        for m in sizes:
            compare(shard, m, plan, ours, peer)
        del ours, peer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
