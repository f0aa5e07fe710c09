"""Cached dispatch overhead of the public ops on the host CPU, per call; rewrites
benchmarks/results/dispatch_<gpu>.md (`dispatch_cpu.md` on a machine without a GPU).

The overhead is the public op's time minus the time of calling the selected kernel directly
with the same normalized arguments; both run a no-op kernel registered for the purpose, so
the difference is validation + selection (+ output allocation). Target: under 5 µs.

    python3 benchmarks/bench_dispatch_overhead.py [--calls N] [--repeats N] [--no-record]
"""

from __future__ import annotations

import argparse
import os
import platform as host
import statistics
import time

import record
import torch

import tokenspeed_kernel as tk
from tokenspeed_kernel import registry

OP = "mha_decode_with_kvcache"
NOOP = f"bench.{OP}.noop"
B, HQ, HKV, D, P = 64, 64, 8, 64, 64  # GPT-OSS-120B decode step


def _noop(*args, **kwargs):
    return None


def _time_per_call(fn, calls: int, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def register_noop() -> None:
    """A no-op kernel that every decode request selects (highest priority, any traits)."""
    any_traits = ("dtype", "kv_dtype", "head_dim", "gqa_ratio", "page_size", "q_len")
    tk.register_kernel(
        OP,
        name=NOOP,
        backend="bench",
        platforms=["*"],
        traits={**dict.fromkeys(any_traits, tk.ANY), "window": True, "sinks": True},
        priority=10_000,
    )(_noop)


def public_and_direct():
    """(public op call, direct kernel call) at a GPT-OSS-120B decode step on CPU tensors; both
    pass their arguments as literal keywords, so neither pays for building a dict."""
    q = torch.randn(B, HQ, D, dtype=torch.bfloat16)
    cache = torch.zeros(8, P, HKV, D, dtype=torch.bfloat16)
    table = torch.zeros(B, 1, dtype=torch.int32)
    lens = torch.ones(B, dtype=torch.int32)
    sinks = torch.zeros(HQ)
    out = torch.empty_like(q)

    def public():
        tk.mha_decode_with_kvcache(
            q, cache, cache, page_table=table, cache_seqlens=lens, window_left=127, sinks=sinks,
            out=out,
        )  # fmt: skip

    q4, out4 = q.unsqueeze(1), out.unsqueeze(1)
    kernel = registry.get_kernel(OP, NOOP).fn

    def direct():
        kernel(
            q4, cache, cache, page_table=table, cache_seqlens=lens, window_left=127, sinks=sinks,
            softmax_scale=0.125, k_scale=1.0, v_scale=1.0, out=out4, lse=None,
        )  # fmt: skip

    return public, direct


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=7)
    record.add_record_argument(parser)
    args = parser.parse_args()
    register_noop()
    public, direct = public_and_direct()
    public()  # fill the selector cache
    t_public = _time_per_call(public, args.calls, args.repeats)
    t_direct = _time_per_call(direct, args.calls, args.repeats)
    overhead = (t_public - t_direct) * 1e6
    device = record.device_name()
    cpu = f"host CPU {host.processor() or host.machine()} ({os.cpu_count()} cores)"
    lines = record.header(
        "Dispatch overhead of the public ops (cached path)",
        cpu + (", no GPU" if device == "cpu" else f" of the {device} machine"),
    )
    lines += [
        f"`{OP}` at a GPT-OSS-120B decode step (B={B}, Hq={HQ}, window 127, sinks, out given) "
        f"on CPU tensors: the public op against a direct call of the same no-op kernel with "
        f"normalized arguments; median of {args.repeats} runs of {args.calls} calls.",
        "",
        *record.table(
            ["op", "public op µs", "kernel only µs", "overhead µs", "target"],
            [[OP, f"{t_public * 1e6:.2f}", f"{t_direct * 1e6:.2f}", f"{overhead:.2f}", "< 5 µs"]],
        ),
    ]
    record.write("dispatch", lines, device=device, record=not args.no_record)


if __name__ == "__main__":
    main()
