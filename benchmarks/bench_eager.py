"""Eager host cost of the public ops against their GPU time and FA3's eager call; rewrites
benchmarks/results/eager_<gpu>.md.

Serving engines run many calls eagerly (prefill, odd batch sizes, warm-up), so an op's eager
time is what they pay there. For each GPT-OSS-120B call this reports:
- eager: the public op called back to back (no sync in between; per call, median of repeats).
  When it is far above the graph time the host is the bottleneck.
- graph: the same call captured once in a CUDA graph, per replay (the GPU time).
- FA3 eager: flash_attn_interface on the same inputs, called the same way (attention only).
- the host split of one eager call: selection (the cached `select`), argument checks (the
  public op minus the direct kernel call minus selection) and launch (the kernel called
  directly with normalized arguments: our launcher plus Triton's).

    bash scripts/run_from_source.sh python benchmarks/bench_eager.py [--no-record]
"""

from __future__ import annotations

import argparse
import statistics
import time

import record
import torch

import tokenspeed_kernel as tk
from tokenspeed_kernel.selector import select
from tokenspeed_kernel.testing.inputs import MoEShape, build_moe
from tokenspeed_kernel.tools.timing import capture_graph

HQ, HKV, D, PAGE = 64, 8, 64, 64
BF16, I32 = torch.bfloat16, torch.int32


def per_call_us(fn, calls: int = 200, repeats: int = 9) -> float:
    """Eager: `calls` back-to-back calls per repeat, the median repeat."""
    for _ in range(10):
        fn()
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def graph_us(fn, replays: int = 100) -> float:
    """One call captured in a CUDA graph: per replay."""
    replay = capture_graph(fn, torch.cuda.current_device())
    for _ in range(5):
        replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays * 1e3


def host_us(fn, calls: int = 2000) -> float:
    """A host-only call (no launch): per call."""
    for _ in range(50):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


class Recorder:
    """Captures the selected kernel and its normalized arguments of one public call, so the
    kernel can be called directly and the cached selection timed on its request."""

    def __init__(self):
        self.calls = []

    def __enter__(self):
        import tokenspeed_kernel.selector as selector

        self._selector, self._select = selector, selector.select

        def spy(op, request, platform):
            spec = self._select(op, request, platform)
            self.calls.append((op, request, platform, spec))
            return spec

        selector.select = spy
        for module in _select_users():
            module.select = spy
        return self

    def __exit__(self, *exc):
        self._selector.select = self._select
        for module in _select_users():
            module.select = self._select


def _select_users():
    import importlib

    names = ("tokenspeed_kernel.ops.attention.api", "tokenspeed_kernel.ops.moe.api")
    return [m for m in map(importlib.import_module, names) if hasattr(m, "select")]


def attention_calls(device):
    gen = torch.Generator(device=device).manual_seed(0)
    # GPT-OSS's sinks: bf16 checkpoint values, passed as float32 (both sink dtypes the ops take
    # reach FA3's kernel; the FA3 peer below rounds to bf16, which changes nothing).
    sinks = torch.randn(HQ, device=device, generator=gen).to(BF16).float()
    calls = []
    for batch, ctx, window in ((1, 8192, -1), (1, 8192, 127), (64, 8192, -1)):
        pages = batch * ctx // PAGE
        k_cache = torch.randn(pages, PAGE, HKV, D, device=device, generator=gen, dtype=BF16)
        v_cache = torch.randn_like(k_cache)
        table = torch.arange(pages, device=device, dtype=I32).view(batch, -1)
        lens = torch.full((batch,), ctx, device=device, dtype=I32)
        q = torch.randn(batch, HQ, D, device=device, generator=gen, dtype=BF16)
        out = torch.empty_like(q)
        label = f"decode B={batch} ctx {ctx}" + (f" window {window}" if window >= 0 else "")
        ours = _bind(
            tk.mha_decode_with_kvcache, q, k_cache, v_cache, page_table=table,
            cache_seqlens=lens, window_left=window, sinks=sinks, out=out,
        )  # fmt: skip
        fa3 = _fa3_decode(q, k_cache, v_cache, table, lens, window, sinks)
        calls.append(("mha_decode_with_kvcache", label, ours, fa3))
    for tokens, window in ((1024, 127), (1024, -1), (8192, -1)):
        q = torch.randn(tokens, HQ, D, device=device, generator=gen, dtype=BF16)
        k = torch.randn(tokens, HKV, D, device=device, generator=gen, dtype=BF16)
        v = torch.randn_like(k)
        cu = torch.tensor([0, tokens], device=device, dtype=I32)
        out = torch.empty_like(q)
        label = f"prefill S={tokens}" + (f" window {window}" if window >= 0 else " causal")
        ours = _bind(
            tk.mha_prefill, q, k, v, cu_seqlens=cu, max_seqlen=tokens, window_left=window,
            sinks=sinks, out=out,
        )  # fmt: skip
        fa3 = _fa3_prefill(q, k, v, cu, tokens, window, sinks)
        calls.append(("mha_prefill", label, ours, fa3))
    pages = 4 * 8192 // PAGE
    k_cache = torch.randn(pages, PAGE, HKV, D, device=device, generator=gen, dtype=BF16)
    v_cache = torch.randn_like(k_cache)
    table = torch.arange(pages, device=device, dtype=I32).view(4, -1)
    lens = torch.full((4,), 8192, device=device, dtype=I32)
    q = torch.randn(4 * 256, HQ, D, device=device, generator=gen, dtype=BF16)
    cu = torch.arange(0, 5 * 256, 256, device=device, dtype=I32)
    out = torch.empty_like(q)
    ours = _bind(
        tk.mha_extend_with_kvcache, q, k_cache, v_cache, cu_seqlens_q=cu, page_table=table,
        cache_seqlens=lens, max_seqlen_q=256, sinks=sinks, out=out,
    )  # fmt: skip
    fa3 = _fa3_extend(q, k_cache, v_cache, table, lens, cu, sinks)
    calls.append(("mha_extend_with_kvcache", "extend 4 x 256 new, ctx 8192", ours, fa3))
    for tokens in (1, 64):
        k = torch.randn(tokens, HKV, D, device=device, generator=gen, dtype=BF16)
        slots = torch.randperm(pages * PAGE, device=device, generator=gen)[:tokens]
        ours = _bind(tk.kvcache_store, k, k, k_cache, v_cache, slot_mapping=slots)
        calls.append(("kvcache_store", f"store T={tokens}", ours, None))
    return calls


_last_plan: list = []  # the plan of the MoE call being split (moe_apply takes it as argument)


def moe_calls(device):
    calls = []
    for tokens in (1, 64):
        shape = MoEShape(
            num_tokens=tokens, num_experts=128, top_k=4, hidden_size=2880, intermediate_size=2880
        )
        gen = torch.Generator(device=device).manual_seed(tokens)
        (config, weights, x), routing = build_moe(shape, gen, device)
        plan = tk.moe_plan(config, device=device, max_num_tokens=8192)
        prepared = tk.moe_prepare_weights(plan, weights)
        out = torch.empty_like(x)
        logits = routing["router_logits"]
        ours = _bind(tk.moe_apply, plan, x, prepared, logits, out=out)
        _last_plan[:] = [plan]
        calls.append(("moe_apply", f"moe_apply M={tokens} (GPT-OSS-120B)", ours, None))
    return calls


def _bind(fn, *args, **kwargs):
    return lambda: fn(*args, **kwargs)


def _fa3():
    try:
        import flash_attn_interface
    except ImportError:
        return None
    return flash_attn_interface


def _fa3_common(window, sinks):
    # This FA3 build takes bf16 sinks.
    return dict(
        causal=True,
        window_size=(window, 0) if window >= 0 else (-1, -1),
        sinks=sinks.to(BF16),
    )


def _fa3_decode(q, k_cache, v_cache, table, lens, window, sinks):
    fa3 = _fa3()
    if fa3 is None:
        return None
    common = _fa3_common(window, sinks)
    q4 = q.unsqueeze(1)
    return lambda: fa3.flash_attn_with_kvcache(
        q4, k_cache, v_cache, page_table=table, cache_seqlens=lens, **common
    )


def _fa3_prefill(q, k, v, cu, tokens, window, sinks):
    fa3 = _fa3()
    if fa3 is None:
        return None
    common = _fa3_common(window, sinks)
    return lambda: fa3.flash_attn_varlen_func(q, k, v, cu, cu, tokens, tokens, **common)


def _fa3_extend(q, k_cache, v_cache, table, lens, cu, sinks):
    fa3 = _fa3()
    if fa3 is None:
        return None
    common = _fa3_common(-1, sinks)
    return lambda: fa3.flash_attn_with_kvcache(
        q, k_cache, v_cache, page_table=table, cache_seqlens=lens, cu_seqlens_q=cu,
        max_seqlen_q=256, **common,
    )  # fmt: skip


def split(op: str, call) -> tuple[str, float, float, float]:
    """(kernel, selection, checks, launch): the kernel the call ran and the host us of one
    eager call of `call`."""
    with Recorder() as seen:
        call()
    torch.cuda.synchronize()
    kinds = [entry for entry in seen.calls if entry[0] in (op, "moe_apply")]
    if op == "moe_apply":
        selection = 0.0  # moe_plan selected once, up front: moe_apply never selects
        direct = _direct_moe(call)
        kernel = _last_plan[0].kernel
    else:
        op_name, request, platform, spec = kinds[-1]
        selection = host_us(lambda: select(op_name, request, platform))
        direct = _direct_attention(op, call, spec)
        kernel = spec.name
    total = per_call_us(call)
    launch = per_call_us(direct)
    return kernel, selection, max(total - launch - selection, 0.0), launch


def _direct_attention(op, call, spec):
    """The selected kernel called with the normalized arguments the op passed it."""
    captured = {}
    original = spec.fn

    def spy(*args, **kwargs):
        captured.update(args=args, kwargs=kwargs)
        return original(*args, **kwargs)

    object.__setattr__(spec, "fn", spy)
    try:
        call()
    finally:
        object.__setattr__(spec, "fn", original)
    args, kwargs = captured["args"], captured["kwargs"]
    return lambda: original(*args, **kwargs)


def _direct_moe(call):
    """The plan's kernel object called with the arguments moe_apply passed it."""
    captured = {}

    def spy(plan, *args, **kwargs):
        captured.update(plan=plan, args=args, kwargs=kwargs)
        return type(plan.impl).apply(plan.impl, plan, *args, **kwargs)

    plan = _last_plan[0]
    object.__setattr__(plan.impl, "apply", spy)
    try:
        call()
    finally:
        object.__delattr__(plan.impl, "apply")
    impl, args, kwargs = captured["plan"].impl, captured["args"], captured["kwargs"]
    return lambda: type(impl).apply(impl, captured["plan"], *args, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-record", action="store_true", help="print only")
    args = parser.parse_args()
    device = torch.device("cuda")
    fa3 = _fa3()
    rows = []
    for op, label, ours, peer in attention_calls(device) + moe_calls(device):
        eager = per_call_us(ours)
        graph = graph_us(ours)
        fa3_eager = per_call_us(peer) if peer is not None else None
        kernel, selection, checks, launch = split(op, ours)
        rows.append(
            (
                label,
                kernel,
                f"{eager:.1f}",
                f"{graph:.1f}",
                "-" if fa3_eager is None else f"{fa3_eager:.1f}",
                "-" if fa3_eager is None else f"{fa3_eager / eager:.2f}",
                f"{selection:.2f}",
                f"{checks:.1f}",
                f"{launch:.1f}",
            )
        )
        print(" | ".join(rows[-1]), flush=True)
    headers = (
        "call",
        "kernel",
        "eager us",
        "graph us",
        "FA3 eager us",
        "FA3 eager / ours",
        "selection us",
        "checks us",
        "launch us",
    )
    notes = [
        "Eager: 200 back-to-back calls per repeat, median of 9 repeats, per call; graph: one",
        "call captured in a CUDA graph, per replay (100 replays). Selection: the cached `select`",
        "on the call's request; launch: the selected kernel called directly with the op's",
        "normalized arguments; checks: eager minus launch minus selection. moe_apply never",
        "selects (moe_plan did, once). GPT-OSS-120B shapes: 64 q heads, 8 KV heads, head dim",
        "64, sinks, page 64; MoE 128 experts top-4, H = I = 2880, MXFP4 weights.",
        f"FA3: {'tokenspeed-fa3 (flash_attn_interface)' if fa3 else 'not importable here'}.",
    ]
    name = torch.cuda.get_device_name(device)
    lines = record.header(
        f"Eager host cost of the public ops, {name}",
        name,
        {"tokenspeed-fa3": record.package_version("tokenspeed-fa3")},
    )
    lines += notes + [""] + record.table(headers, rows)
    record.write("eager", lines, device=name, record=not args.no_record)


if __name__ == "__main__":
    main()
