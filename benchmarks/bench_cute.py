"""Our CuTe DSL kernels against our Triton ones, same run, same inputs: kvcache_store and
full-context decode attention at GPT-OSS-120B shapes; rewrites benchmarks/results/cute_<gpu>.md.

    python3 benchmarks/bench_cute.py [--no-record]

Without the DSL on the GPU machine, point TOKENSPEED_KERNEL_CUTE_CUBINS at cubins built on any
machine with `python -m tokenspeed_kernel_nvidia._cute_runtime build --arch sm_90a --out DIR`.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import record
import torch
from record import table

from tokenspeed_kernel.ops.attention.reference import reference_decode, reference_kvcache_store
from tokenspeed_kernel.testing import compare
from tokenspeed_kernel.tuning import pin_config
from tokenspeed_kernel_nvidia import _cute_runtime
from tokenspeed_kernel_nvidia.cute_decode import KERNEL_NAME as CUTE_DECODE
from tokenspeed_kernel_nvidia.cute_decode import DecodeConfig
from tokenspeed_kernel_nvidia.cute_decode import mha_decode_with_kvcache as cute_decode
from tokenspeed_kernel_nvidia.cute_kvcache_store import kvcache_store as cute_store
from tokenspeed_kernel_triton.attention.decode import mha_decode_with_kvcache as triton_decode
from tokenspeed_kernel_triton.attention.kvcache_store import kvcache_store as triton_store

HQ, HKV, D, P = 64, 8, 64, 64
FP8 = torch.float8_e4m3fn
TOKENS = (1, 16, 64, 1024, 8192)
KERNELS = {"triton": triton_store, "cute": cute_store}
DECODERS = {"triton": triton_decode, "cute": cute_decode}
DECODE_CASES = ((1, 8192), (2, 8192), (4, 8192), (8, 8192), (16, 8192), (64, 8192))
# CuTe decode configs swept where B is small (the default: 2 CTAs per SM, 8 warps).
SWEEP = {
    "1 CTA/SM": DecodeConfig(ctas_per_sm=1),
    "4 CTAs/SM": DecodeConfig(ctas_per_sm=4),
    "4 warps": DecodeConfig(ctas_per_sm=2, warps=4),
}
METHOD = (
    f"kvcache_store at GPT-OSS-120B shapes: {HKV} KV heads, D={D}, page {P}, bf16 K/V into a "
    "bf16 or FP8 e4m3 cache (scale 0.5), random distinct slots, one in eight padded (-1). "
    "Each time is the median of 5 trials of 20 CUDA-graph replays; a graph runs the store "
    "over several input sets back to back (at least 16 calls, and sets whose bytes together "
    "exceed 4x the L2, so large stores do not find their inputs in cache; small ones do, as "
    "a decode step's freshly computed K/V would). Bytes = K and V read plus the cache rows "
    "written; floor = bytes / copy bandwidth. Eager = host wall time of one call, launch "
    "included, over 200 back-to-back calls. Both kernels' caches are compared bit for bit "
    "with the core reference. triton / cute > 1: the CuTe kernel is faster."
)


def copy_bandwidth() -> float:
    """Device-to-device copy through an elementwise kernel, bytes read + written, in TB/s."""
    src = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    us = time_calls(lambda i: torch.neg(src, out=dst), 1)
    return 2 * src.numel() * src.element_size() / (us * 1e-6) / 1e12


def time_calls(fn, num_sets: int, replays: int = 20, trials: int = 5) -> float:
    """Median microseconds of one fn(i) call, from CUDA-graph replays of fn(0..num_sets-1)."""
    for i in range(num_sets):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(num_sets):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (replays * num_sets))
    return statistics.median(times)


def eager_us(fn, calls: int = 200) -> float:
    fn(0)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn(0)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.element_size() == 1 else x


def make_sets(tokens: int, cache_dtype, l2_bytes: int, gen):
    num_pages = 2 * tokens // P + 1
    nbytes = 2 * tokens * HKV * D * (2 + torch.tensor([], dtype=cache_dtype).element_size())
    num_sets = max(16, min(64, math.ceil(4 * l2_bytes / nbytes)))
    sets = []
    for _ in range(num_sets):
        k = torch.randn(tokens, HKV, D, generator=gen).to("cuda", torch.bfloat16)
        v = torch.randn(tokens, HKV, D, generator=gen).to("cuda", torch.bfloat16)
        caches = [torch.zeros(num_pages, P, HKV, D, device="cuda").to(cache_dtype) for _ in "kv"]
        slots = torch.randperm(num_pages * P, generator=gen)[:tokens]
        slots[torch.randperm(tokens, generator=gen)[: tokens // 8]] = -1
        sets.append((k, v, caches, slots.to("cuda", torch.int64)))
    return sets, nbytes


def run_case(tokens: int, cache_dtype, bw: float, l2_bytes: int, gen) -> dict:
    sets, nbytes = make_sets(tokens, cache_dtype, l2_bytes, gen)
    scale = 0.5 if cache_dtype == FP8 else 1.0
    row = dict(tokens=tokens, cache="fp8" if cache_dtype == FP8 else "bf16")
    k, v, caches, slots = sets[0]
    want = [c.clone() for c in caches]
    kw = dict(slot_mapping=slots, k_scale=scale, v_scale=scale)
    reference_kvcache_store(k, v, *want, **kw)
    for name, fn in KERNELS.items():
        got = [c.clone() for c in caches]
        try:
            fn(k, v, *got, **kw)
        except Exception as exc:  # noqa: BLE001 - reported in the row, the others still run
            row[f"{name}_exact"] = f"error: {type(exc).__name__}: {exc}"[:120]
            row[f"{name}_us"] = row[f"{name}_eager_us"] = float("nan")
            continue
        row[f"{name}_exact"] = all(
            torch.equal(_bits(a), _bits(b)) for a, b in zip(got, want, strict=True)
        )

        def call(i, fn=fn):
            k, v, caches, slots = sets[i]
            fn(k, v, *caches, slot_mapping=slots, k_scale=scale, v_scale=scale)

        row[f"{name}_us"] = time_calls(call, len(sets))
        row[f"{name}_eager_us"] = eager_us(call)
    row["floor_us"] = nbytes / (bw * 1e6)
    return row


def decode_sets(batch: int, ctx: int, l2_bytes: int, gen):
    """Input sets over disjoint pages, together over 4x the L2, so no call finds its keys in
    cache; sinks bf16-exact in float32."""
    pages_per_seq = -(-ctx // P)
    set_pages = batch * pages_per_seq
    set_bytes = set_pages * P * HKV * D * 2 * 2
    num_sets = max(1, min(64, math.ceil(4 * l2_bytes / set_bytes)))
    shape = (num_sets * set_pages, P, HKV, D)
    k_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    sets = []
    for s in range(num_sets):
        phys = s * set_pages + torch.randperm(set_pages, generator=gen)
        table = phys.reshape(batch, pages_per_seq).to("cuda", torch.int32)
        q = torch.randn(batch, 1, HQ, D, generator=gen).to("cuda", torch.bfloat16)
        sets.append((q, table, torch.empty_like(q)))
    seqlens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    sinks = torch.randn(HQ, generator=gen).to(torch.bfloat16).float().cuda()
    return k_cache, v_cache, sets, seqlens, sinks, set_bytes


def run_decode(batch: int, ctx: int, bw: float, l2_bytes: int, gen) -> dict:
    k_cache, v_cache, sets, seqlens, sinks, nbytes = decode_sets(batch, ctx, l2_bytes, gen)
    kw = dict(cache_seqlens=seqlens, window_left=-1, sinks=sinks, softmax_scale=D**-0.5,
              k_scale=1.0, v_scale=1.0, lse=None)  # fmt: skip
    q, table, _ = sets[0]
    want = torch.empty_like(q)
    reference_decode(q, k_cache, v_cache, page_table=table, out=want, **kw)
    row = dict(batch=batch, ctx=ctx, floor_us=nbytes / (bw * 1e6))
    for name, fn in DECODERS.items():
        got = torch.full_like(q, float("nan"))
        try:
            fn(q, k_cache, v_cache, page_table=table, out=got, **kw)
        except Exception as exc:  # noqa: BLE001 - reported in the row, the others still run
            row[f"{name}_ok"] = f"error: {type(exc).__name__}: {exc}"[:120]
            row[f"{name}_us"] = float("nan")
            continue
        result = compare(got, want, dtype=torch.bfloat16, name="out")
        row[f"{name}_ok"] = f"{result.ok} ({result.max_abs:.1e})"

        def call(i, fn=fn):
            q, table, out = sets[i]
            fn(q, k_cache, v_cache, page_table=table, out=out, **kw)

        row[f"{name}_us"] = time_calls(call, len(sets))
    if batch <= 4 and row["cute_ok"].startswith("True"):

        def cute_call(i):
            q, table, out = sets[i]
            cute_decode(q, k_cache, v_cache, page_table=table, out=out, **kw)

        for label, config in SWEEP.items():
            with pin_config(CUTE_DECODE, config):
                row[f"cute {label}"] = time_calls(cute_call, len(sets))
    return row


def decode_lines(rows: list[dict]) -> list[str]:
    columns = ["B", "ctx", "triton µs", "cute µs", "triton / cute", "floor µs", "cute / floor"]
    columns += ["triton ok (max err)", "cute ok (max err)"]
    columns += [f"cute µs, {label}" for label in SWEEP]
    cells = [
        (
            r["batch"],
            r["ctx"],
            f"{r['triton_us']:.2f}",
            f"{r['cute_us']:.2f}",
            f"{r['triton_us'] / r['cute_us']:.2f}",
            f"{r['floor_us']:.2f}",
            f"{r['cute_us'] / r['floor_us']:.2f}",
            r["triton_ok"],
            r["cute_ok"],
            *(f"{r[f'cute {label}']:.2f}" if f"cute {label}" in r else "-" for label in SWEEP),
        )
        for r in rows
    ]
    return [
        "",
        f"Decode attention, full context, {HQ} query / {HKV} KV heads, D={D}, page {P}, bf16, "
        "per-head sinks, one query; sets of disjoint pages over 4x the L2; floor = K and V "
        "bytes / copy bandwidth; outputs against the core reference (bf16 tolerance). The "
        "CuTe kernel's default aims at 2 CTAs per SM of 8 warps; the last columns pin other "
        "`DecodeConfig`s:",
        "",
        *table(columns, cells),
    ]


def first_call_ms() -> float:
    """The first CuTe store of this process: cubin load (or JIT compile) and launch."""
    k, v, caches, slots = make_sets(1, torch.bfloat16, 0, torch.Generator())[0][0]
    torch.cuda.synchronize()
    start = time.perf_counter()
    cute_store(k, v, *caches, slot_mapping=slots, k_scale=1.0, v_scale=1.0)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def lines_for(rows: list[dict]) -> list[str]:
    columns = ["tokens", "cache", "triton µs", "cute µs", "triton / cute", "floor µs"]
    columns += ["eager triton µs", "eager cute µs", "bit-exact (triton, cute)"]
    cells = [
        (
            r["tokens"],
            r["cache"],
            f"{r['triton_us']:.2f}",
            f"{r['cute_us']:.2f}",
            f"{r['triton_us'] / r['cute_us']:.2f}",
            f"{r['floor_us']:.2f}",
            f"{r['triton_eager_us']:.1f}",
            f"{r['cute_eager_us']:.1f}",
            f"{r['triton_exact']}, {r['cute_exact']}",
        )
        for r in rows
    ]
    return table(columns, cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    record.add_record_argument(parser)
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    source = _cute_runtime.search_dirs()[0]
    if source.resolve().is_relative_to(record.REPO):  # no machine paths in the record
        source = source.resolve().relative_to(record.REPO)
    lines = record.header(
        f"CuTe DSL kernels against our Triton kernels, {props.name}",
        f"{props.name} ({props.multi_processor_count} SMs, {props.L2_cache_size >> 20} MiB L2)",
        {"nvidia-cutlass-dsl": _cute_runtime.dsl_version()},
    )
    first_ms = first_call_ms()
    bw = copy_bandwidth()
    lines += [
        METHOD,
        "",
        f"Copy bandwidth: {bw:.2f} TB/s. CuTe cubins from {source} (first call, load or JIT "
        f"compile included: {first_ms:.0f} ms).",
        "",
    ]
    gen = torch.Generator().manual_seed(0)
    rows = []
    for tokens in TOKENS:
        for cache_dtype in (torch.bfloat16, FP8):
            rows.append(run_case(tokens, cache_dtype, bw, props.L2_cache_size, gen))
            torch.cuda.empty_cache()
    lines += lines_for(rows)
    # Printed now: a decode failure below must not lose the store's figures.
    print("\n".join(lines), flush=True)
    decode_rows = []
    for batch, ctx in DECODE_CASES:
        decode_rows.append(run_decode(batch, ctx, bw, props.L2_cache_size, gen))
        torch.cuda.empty_cache()
    lines += decode_lines(decode_rows)
    record.write("cute", lines, device=props.name, record=not args.no_record)


if __name__ == "__main__":
    main()
