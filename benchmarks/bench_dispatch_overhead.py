"""Cached dispatch overhead of the public ops on the CPU, per call.

The overhead is the public op's time minus the time of calling the selected kernel directly
with the same normalized arguments; both run a no-op kernel registered for the purpose, so
the difference is validation + selection (+ output allocation). Target: under 5 µs.

    uv run python benchmarks/bench_dispatch_overhead.py
"""

from __future__ import annotations

import argparse
import platform as host
import statistics
import time

import torch

import tokenspeed_kernel as tk
from tokenspeed_kernel import registry

OP = "mha_decode_with_kvcache"


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    tk.register_kernel(
        OP,
        name="bench.noop_decode",
        backend="bench",
        platforms=["*"],
        traits={
            "dtype": tk.ANY,
            "kv_dtype": tk.ANY,
            "head_dim": tk.ANY,
            "gqa_ratio": tk.ANY,
            "page_size": tk.ANY,
            "q_len": tk.ANY,
            "window": True,
            "sinks": True,
        },
        priority=10_000,
    )(_noop)
    B, Hq, Hkv, D, P = 64, 64, 8, 64, 64  # GPT-OSS-120B decode step
    q = torch.randn(B, Hq, D, dtype=torch.bfloat16)
    cache = torch.zeros(8, P, Hkv, D, dtype=torch.bfloat16)
    table = torch.zeros(B, 1, dtype=torch.int32)
    lens = torch.ones(B, dtype=torch.int32)
    sinks = torch.zeros(Hq)
    out = torch.empty_like(q)

    def public():
        tk.mha_decode_with_kvcache(
            q,
            cache,
            cache,
            page_table=table,
            cache_seqlens=lens,
            window_left=127,
            sinks=sinks,
            out=out,
        )

    q4, out4 = q.unsqueeze(1), out.unsqueeze(1)
    spec = registry.get_kernel(OP, "bench.noop_decode")

    def direct():
        spec.fn(
            q4,
            cache,
            cache,
            page_table=table,
            cache_seqlens=lens,
            window_left=127,
            sinks=sinks,
            softmax_scale=0.125,
            k_scale=1.0,
            v_scale=1.0,
            out=out4,
            lse=None,
        )

    public()  # fill the selector cache
    t_public = _time_per_call(public, args.calls, args.repeats)
    t_direct = _time_per_call(direct, args.calls, args.repeats)
    overhead = (t_public - t_direct) * 1e6
    print(
        f"host: {host.processor() or host.machine()}, python {host.python_version()}, "
        f"torch {torch.__version__}"
    )
    print(
        f"{OP} (B={B}, Hq={Hq}, window 127, sinks, out given), {args.calls} calls x "
        f"{args.repeats}, median:"
    )
    print(f"  public op   {t_public * 1e6:7.2f} us/call")
    print(f"  kernel only {t_direct * 1e6:7.2f} us/call")
    print(f"  overhead    {overhead:7.2f} us/call (target < 5)")


if __name__ == "__main__":
    main()
