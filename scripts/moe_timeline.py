"""Kernel timeline of triton.moe_apply.sm90's forward on GPT-OSS-120B shapes: each kernel's start
and end (torch.profiler, CUDA activity) in the last of several CUDA-graph replays over 4 layers'
distinct weights (L2-cold, as benchmarks/bench_moe.py times decode). Under programmatic
dependent launch a kernel starts while the previous one finishes, so the overlaps show where
the critical path runs. The profiler adds about 2 us per layer. On the GPU machine:

    bash scripts/run_from_source.sh python3 scripts/moe_timeline.py [M ...]
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "benchmarks")
from bench_moe import TOP_K, gpt_oss_tensors, token_inputs, weight_copies  # noqa: E402

from tokenspeed_kernel_triton.moe.moe_sm90 import moe_forward_sm90  # noqa: E402

LAYERS = 4


def timeline(layers: list[dict], m: int) -> list[str]:
    x, logits, out = token_inputs(m)

    def forward():
        for prepared in layers:
            moe_forward_sm90(x, prepared, top_k=TOP_K, out=out, router_logits=logits)

    forward()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start
    )
    per_replay = len(kernels) // 3
    last = kernels[-per_replay:]
    t0 = last[0].time_range.start
    rows = [f"M={m}: us from the first kernel's start, last replay ({LAYERS} layers)"]
    rows += ["| kernel | start | end | duration |", "| --- | --- | --- | --- |"]
    for e in last:
        start, end = e.time_range.start - t0, e.time_range.end - t0
        rows.append(f"| {e.name[:32]} | {start:.2f} | {end:.2f} | {end - start:.2f} |")
    return rows


def main() -> None:
    prepared, _ = gpt_oss_tensors(False, "fragment")
    layers = weight_copies(prepared, LAYERS)
    for m in [int(a) for a in sys.argv[1:]] or [1, 4]:
        print("\n".join(timeline(layers, m)), flush=True)


if __name__ == "__main__":
    main()
