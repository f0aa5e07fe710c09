"""Decode attention and kvcache_store on the GPU: numerics at GPT-OSS-120B shapes, then time
our Triton decode and the kernel the public op selects (the shipped rankings) against
FlashAttention-3 (`flash_attn_with_kvcache` with sinks) and FlashInfer's XQA, each where its
library is installed, in the same run; rewrites benchmarks/results/decode_<gpu>.md.

    python3 benchmarks/bench_decode.py [--sweep] [--no-record]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import statistics

import record
import torch
from record import table

import tokenspeed_kernel as tk
from tokenspeed_kernel.ops.attention.reference import reference_decode, reference_kvcache_store
from tokenspeed_kernel.platform import Platform, platform_of
from tokenspeed_kernel.registry import get_kernel
from tokenspeed_kernel.testing import compare
from tokenspeed_kernel.tuning import pin_config
from tokenspeed_kernel_triton.attention.decode import KERNEL_NAME, mha_decode_with_kvcache
from tokenspeed_kernel_triton.attention.decode_config import (
    DecodeConfig,
    heuristic_config,
    plan_decode,
)
from tokenspeed_kernel_triton.attention.kvcache_store import kvcache_store

HQ, HKV, D, P = 64, 8, 64, 64
FP8 = torch.float8_e4m3fn
CASES = [  # (batch, context, window_left)
    (1, 8192, -1),
    (16, 8192, -1),
    (64, 8192, -1),
    (128, 8192, -1),
    (1, 8192, 127),
    (16, 8192, 127),
    (64, 8192, 127),
    (128, 8192, 127),
    (64, 8192, -1, FP8),
]
SWEEP = {  # label -> pinned config (None = heuristic), for the cases marked in SWEEP_CASES
    "bn64-s3": DecodeConfig(64, 4, 3, 4),
    "bn64-s5": DecodeConfig(64, 4, 5, 4),
    "bn128-s3": DecodeConfig(128, 4, 3, 2),
    "bn128-w8-s3": DecodeConfig(128, 8, 3, 2),
    "bn32-s6": DecodeConfig(32, 4, 6, 4),
}
SWEEP_CASES = {(1, 8192, -1), (64, 8192, -1), (64, 8192, 127)}
METHOD = (
    f"GPT-OSS-120B attention: head dim {D}, {HQ} query / {HKV} KV heads, page {P}, bf16 "
    "(or FP8 e4m3 KV), per-head sinks, one query token. Each time is the median of 5 trials "
    "of 20 CUDA-graph replays; a replay runs the call back to back over several input sets "
    "whose visible K/V pages are disjoint and together exceed 4x the L2, so no call finds its "
    "keys in cache. Bytes = K and V of the visible keys (window: 128 keys per sequence); "
    "floor = bytes / copy bandwidth. selected: the kernel `tk.mha_decode_with_kvcache` picks "
    "on this GPU (shipped rankings, then priority), timed through the public op. FA3 and XQA "
    "(FlashInfer's `trtllm_batch_decode_with_kv_cache` through its registered adapter) run in "
    "the same process where installed (bf16 sinks, `window_size=(127, 0)` / `window_left=127` "
    "for the window rows); FA3's FP8 path wants FP8 queries and XQA's Hopper kernel converts "
    "q to the cache's e4m3, so FP8 KV has no peer column. Numerics: out and lse of ours (and "
    "the selected kernel's and the peers' out) against the core reference on the first input "
    "set of every case. peer / selected > 1: the selected kernel is faster."
)
XQA = "flashinfer.mha_decode_with_kvcache.xqa"


def copy_bandwidth() -> float:
    """Device-to-device copy through an elementwise kernel (cudaMemcpy's copy path measured
    only 2.8 TB/s on H200), bytes read + written per second, in TB/s."""
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


def build(batch, ctx, window, l2_bytes, gen, kv_dtype=torch.bfloat16):
    """Input sets over disjoint physical pages. Only pages a query can see are materialized;
    the other page-table entries point at page 0, which no correct kernel reads."""
    span = ctx if window < 0 else min(ctx, window + 1 + P)
    first_page = (ctx - span) // P
    pages_per_seq = -(-ctx // P) - first_page
    set_pages = batch * pages_per_seq
    elem = torch.tensor([], dtype=kv_dtype).element_size()
    visible = batch * min(ctx, ctx if window < 0 else window + 1) * HKV * D * 2 * elem
    set_bytes = set_pages * P * HKV * D * 2 * elem
    num_sets = max(1, min(64, math.ceil(4 * l2_bytes / set_bytes)))
    shape = (1 + num_sets * set_pages, P, HKV, D)
    k_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16).to(kv_dtype)
    v_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16).to(kv_dtype)
    sets = []
    for s in range(num_sets):
        table = torch.zeros(batch, -(-ctx // P), dtype=torch.int32)
        phys = 1 + s * set_pages + torch.randperm(set_pages, generator=gen)
        table[:, first_page:] = phys.reshape(batch, pages_per_seq).to(torch.int32)
        q = torch.randn(batch, 1, HQ, D, generator=gen).to(torch.bfloat16)
        sets.append(dict(q=q.cuda(), page_table=table.cuda()))
    seqlens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    # FA3 takes bf16 sinks; ours get the same values (bf16-exact) in float32.
    sinks = torch.randn(HQ, generator=gen).to(torch.bfloat16).float().cuda()
    return k_cache, v_cache, sets, seqlens, sinks, visible


def check(k_cache, v_cache, s, seqlens, sinks, window, fa3, others) -> dict:
    """Triton (out and lse), FA3 and `others` (label -> call(i) returning out) against the
    reference on one input set."""
    kw = dict(
        page_table=s["page_table"],
        cache_seqlens=seqlens,
        window_left=window,
        sinks=sinks,
        softmax_scale=D**-0.5,
        k_scale=1.0,
        v_scale=1.0,
    )
    q = s["q"]
    want = torch.empty_like(q)
    want_lse = torch.empty(q.shape[:-1], device="cuda")
    reference_decode(q, k_cache, v_cache, out=want, lse=want_lse, **kw)
    out = torch.full_like(q, float("nan"))
    lse = torch.full_like(want_lse, float("nan"))
    mha_decode_with_kvcache(q, k_cache, v_cache, out=out, lse=lse, **kw)
    result = {
        "triton_out": compare(out, want, dtype=torch.bfloat16, name="out"),
        "triton_lse": compare(lse, want_lse, dtype=torch.float32, name="lse"),
    }
    if fa3 is not None:
        result["fa3_out"] = compare(fa3(0), want, dtype=torch.bfloat16, name="fa3")
    for label, call in others.items():
        result[f"{label}_out"] = compare(call(0), want, dtype=torch.bfloat16, name=label)
    return {k: (v.ok, f"{v.max_abs:.2e}") for k, v in result.items()}


def fa3_caller(k_cache, v_cache, sets, seqlens, sinks, window):
    try:
        from flash_attn_interface import flash_attn_with_kvcache
    except ImportError:
        return None

    sinks_bf16 = sinks.to(torch.bfloat16)

    def call(i):
        s = sets[i]
        return flash_attn_with_kvcache(
            s["q"],
            k_cache,
            v_cache,
            cache_seqlens=seqlens,
            page_table=s["page_table"],
            causal=True,
            window_size=(window, 0) if window >= 0 else (-1, -1),
            softmax_scale=D**-0.5,
            sinks=sinks_bf16,
        )

    return call


def xqa_caller(k_cache, v_cache, sets, seqlens, sinks, window, platform):
    """XQA through its registered adapter (the contract's arguments), or None where FlashInfer
    is not installed (every bf16 case here is one XQA takes: sinks, window, page 64, GQA 8)."""
    if importlib.util.find_spec("flashinfer") is None or platform.vendor != "nvidia":
        return None
    spec = get_kernel("mha_decode_with_kvcache", XQA)
    outs = [torch.empty_like(s["q"]) for s in sets]

    def call(i):
        s = sets[i]
        spec.fn(
            s["q"], k_cache, v_cache, page_table=s["page_table"], cache_seqlens=seqlens,
            window_left=window, sinks=sinks, softmax_scale=D**-0.5, k_scale=1.0, v_scale=1.0,
            out=outs[i], lse=None,
        )  # fmt: skip
        return outs[i]

    return call


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.element_size() == 1 else x


def bench_store_case(tokens: int, cache_dtype: torch.dtype, bw: float) -> dict:
    """One store: bit-exact against the reference, then timed (bytes: read k/v, write caches)."""
    num_pages = 2 * tokens // P + 1
    k = torch.randn(tokens, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    caches = [torch.zeros(num_pages, P, HKV, D, device="cuda").to(cache_dtype) for _ in "kv"]
    want = [c.clone() for c in caches]
    slots = torch.randperm(num_pages * P, device="cuda")[:tokens].to(torch.int64)
    scale = 0.5 if cache_dtype == FP8 else 1.0
    kw = dict(slot_mapping=slots, k_scale=scale, v_scale=scale)
    kvcache_store(k, v, *caches, **kw)
    reference_kvcache_store(k, v, *want, **kw)
    exact = all(torch.equal(_bits(a), _bits(b)) for a, b in zip(caches, want, strict=True))
    us = time_calls(lambda i: kvcache_store(k, v, *caches, **kw), 1)
    nbytes = 2 * tokens * HKV * D * (2 + caches[0].element_size())
    return dict(
        tokens=tokens,
        cache=str(cache_dtype).split(".")[-1],
        exact=exact,
        us=round(us, 2),
        tbps=round(nbytes / us / 1e6, 2),
        floor_us=round(nbytes / (bw * 1e6), 2),
    )


def run_decode_case(case, l2: int, bw: float, platform: Platform, sweep: bool, gen) -> list[dict]:
    """Rows (heuristic config, then the pinned sweep configs) of one decode case."""
    batch, ctx, window, *kv = case
    kv_dtype = kv[0] if kv else torch.bfloat16
    k_cache, v_cache, sets, seqlens, sinks, visible = build(batch, ctx, window, l2, gen, kv_dtype)
    # FA3's FP8 path wants FP8 queries too: only bf16 caches are compared with it.
    fa3 = None
    if kv_dtype == torch.bfloat16:
        fa3 = fa3_caller(k_cache, v_cache, sets, seqlens, sinks, window)
    outs = [torch.empty_like(s["q"]) for s in sets]
    kw = dict(
        cache_seqlens=seqlens,
        window_left=window,
        sinks=sinks,
        softmax_scale=D**-0.5,
        k_scale=1.0,
        v_scale=1.0,
        lse=None,
    )

    def ours(i):
        s = sets[i]
        mha_decode_with_kvcache(
            s["q"], k_cache, v_cache, page_table=s["page_table"], out=outs[i], **kw
        )

    selected_outs = [torch.empty_like(s["q"]) for s in sets]
    fp8_scales = dict(k_scale=1.0, v_scale=1.0) if kv_dtype == FP8 else {}

    def selected(i):
        s = sets[i]
        return tk.mha_decode_with_kvcache(
            s["q"], k_cache, v_cache, page_table=s["page_table"], cache_seqlens=seqlens,
            window_left=window, sinks=sinks, out=selected_outs[i], **fp8_scales,
        )  # fmt: skip

    selected_name = _selected_kernel(selected)
    xqa = None
    if kv_dtype == torch.bfloat16:
        xqa = xqa_caller(k_cache, v_cache, sets, seqlens, sinks, window, platform)
    others = {"selected": selected, **({"xqa": xqa} if xqa is not None else {})}
    numerics = check(k_cache, v_cache, sets[0], seqlens, sinks, window, fa3, others)
    configs = {"heuristic": None}
    if sweep and (batch, ctx, window) in SWEEP_CASES:
        configs.update(SWEEP)
    fa3_us = time_calls(fa3, len(sets)) if fa3 is not None else float("nan")
    xqa_us = time_calls(xqa, len(sets)) if xqa is not None else float("nan")
    selected_us = time_calls(selected, len(sets))
    rows = []
    for label, config in configs.items():
        if config is None:
            us = time_calls(ours, len(sets))
        else:
            with pin_config(KERNEL_NAME, config):
                us = time_calls(ours, len(sets))
        shape = (batch, 1, HQ, HKV, D, P, -(-ctx // P), window)
        plan = plan_decode(platform, k_cache.element_size(), *shape, config)
        rows.append(
            dict(
                batch=batch,
                ctx=ctx,
                window=window,
                kv="fp8 e4m3" if kv_dtype == FP8 else "bf16",
                config=label,
                splits=plan[2],
                us=us,
                tbps=visible / us / 1e6,
                fa3_us=fa3_us,
                xqa_us=xqa_us,
                selected=selected_name,
                selected_us=selected_us,
                floor_us=visible / (bw * 1e12) * 1e6,
                numerics=numerics,
            )
        )
        print(rows[-1], flush=True)
    return rows


def _cells(r: dict, sweep: bool) -> list[object]:
    window = "-" if r["window"] < 0 else r["window"]
    cells = [r["batch"], r["ctx"], window, r["kv"], r["splits"]]
    if sweep:
        return cells + [r["config"], f"{r['us']:.2f}"]
    bad = {k: v for k, v in r["numerics"].items() if not v[0]}
    sel = r["selected_us"]
    peers = []
    for us in (r["fa3_us"], r["xqa_us"]):
        peers += ["-", "-"] if math.isnan(us) else [f"{us:.2f}", f"{us / sel:.2f}"]
    return (
        cells
        + [f"{r['us']:.2f}", r["selected"], f"{sel:.2f}", *peers, f"{r['floor_us']:.2f}"]
        + [f"{sel / r['floor_us']:.2f}", "ok" if not bad else f"fail {bad}"]
    )


def _selected_kernel(call) -> str:
    """The kernel name the public op's cached selection gives for call(0)."""
    from tokenspeed_kernel.ops.attention import api

    chosen = []
    original = api.select

    def spy(op, request, platform):
        spec = original(op, request, platform)
        chosen.append(spec.name)
        return spec

    api.select = spy
    try:
        call(0)
    finally:
        api.select = original
    return chosen[-1] if chosen else "?"


def decode_lines(rows: list[dict]) -> list[str]:
    """The heuristic rows side by side with the selected kernel and the peers, then the pinned
    configs (--sweep)."""
    columns = ["B", "ctx", "window", "KV", "splits"]
    peers = ["FA3 µs", "FA3 / selected", "XQA µs", "XQA / selected"]
    lines = table(
        columns
        + ["Triton µs", "selected", "selected µs", *peers, "floor µs", "selected x floor"]
        + ["numerics"],
        (_cells(r, False) for r in rows if r["config"] == "heuristic"),
    )
    swept = [r for r in rows if r["config"] != "heuristic"]
    if swept:
        lines += ["", f"Pinned configs (`tuning.pin_config({KERNEL_NAME!r}, ...)`):", ""]
        lines += table(columns + ["config", "µs"], (_cells(r, True) for r in swept))
    return lines


def store_lines(bw: float) -> list[str]:
    rows = [bench_store_case(t, dt, bw) for t in (64, 8192) for dt in (torch.bfloat16, FP8)]
    return [
        "",
        f"kvcache_store ({HKV} KV heads, D={D}, page {P}, random slots; bit-exact against the "
        "reference; timed without L2 rotation, so the 8192-token rows, whose bytes fit in the "
        "L2, flatter the kernel):",
        "",
        *table(
            ["tokens", "cache", "µs", "TB/s", "floor µs", "bit-exact"],
            (
                (r["tokens"], r["cache"], r["us"], r["tbps"], r["floor_us"], r["exact"])
                for r in rows
            ),
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time pinned configs")
    record.add_record_argument(parser)
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    l2 = props.L2_cache_size
    bw = copy_bandwidth()
    platform = platform_of(torch.device("cuda", 0))
    fa3_version = record.package_version("tokenspeed-fa3", "flash-attn-3", "flash_attn_3")
    xqa_version = record.package_version("flashinfer-python", "flashinfer")
    lines = record.header(
        f"Decode attention and kvcache_store against FlashAttention-3 and XQA, {props.name}",
        f"{props.name} ({platform.sm_count} SMs, {l2 >> 20} MiB L2)",
        {"FA3": fa3_version, "FlashInfer": xqa_version},
    )
    lines += [
        METHOD,
        "",
        f"Copy bandwidth (elementwise bf16 kernel over 1 GiB, read + written): {bw:.2f} TB/s. "
        f"Heuristic config: {heuristic_config(platform, D)}.",
        "",
    ]
    gen = torch.Generator().manual_seed(0)
    rows = []
    for case in CASES:
        rows += run_decode_case(case, l2, bw, platform, args.sweep, gen)
        torch.cuda.empty_cache()
    lines += decode_lines(rows) + store_lines(bw)
    record.write("decode", lines, device=props.name, record=not args.no_record)


if __name__ == "__main__":
    main()
