"""Host cost of the public ops per call, split into selection, argument checks, the op's other
work and the kernel launch; rewrites benchmarks/results/dispatch_<gpu>.md (`dispatch_cpu.md` on
a machine without a GPU).

Per op, at GPT-OSS-120B head/expert shapes with small batches (so the host bounds each call):
- selection: `platform_of(device)` + `select(op, request, platform)` on a warm cache, which every
  attention call pays (moe_apply selected its kernel in moe_plan: nothing per call);
- checks: the op's validation, which also builds the selection request (`check_decode`, ...);
  moe_apply's checks are inline in the op, so they are counted under "other";
- other: the public op running a no-op kernel, minus that no-op called directly, minus the two
  above (allocation, views, the capture and checked-mode tests, argument passing);
- launch: the kernel the selector picks without the no-op, called directly with the op's
  normalized arguments (host time per call; GPU only, since on the CPU it computes);
- eager: the public op with that kernel, and its GPU time as a CUDA-graph replay (GPU only).

The no-op kernel records the arguments the op passes, so "direct" and "launch" replay exactly
what the op calls. Targets (issue 26): cached selection < 2 µs.

    python3 benchmarks/bench_dispatch_overhead.py [--calls N] [--repeats N] [--no-record]
"""

from __future__ import annotations

import argparse
import os
import platform as host
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import record
import torch

import tokenspeed_kernel as tk
from tokenspeed_kernel import registry, selector
from tokenspeed_kernel.ops.attention import checks
from tokenspeed_kernel.ops.attention.request import ATTENTION_FEATURES, STORE_FEATURES
from tokenspeed_kernel.ops.moe.request import MOE_FEATURES
from tokenspeed_kernel.platform import platform_of

HQ, HKV, D, P, WINDOW = 64, 8, 64, 64, 127  # GPT-OSS-120B attention, sliding layer
E, TOP_K, H, INTER = 128, 4, 2880, 2880  # GPT-OSS-120B MoE
FLAGS = ("non_causal", "window", "sinks", "lse", "bias")


@dataclass
class Case:
    op: str
    shape: str
    public: Callable[[], Any]
    check: Callable[[], Any] | None  # None: the op checks inline (moe_apply)
    request: Any = None  # None: selected once per plan (moe_apply)
    direct: Callable[[], Any] | None = None  # set once the no-op has recorded its arguments
    kernel: str = "-"  # the kernel a plan selected (moe_apply)


def per_call_us(fn: Callable[[], Any], calls: int, repeats: int, device) -> float:
    """Median over `repeats` of the mean host time of `calls` back-to-back calls."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append((time.perf_counter_ns() - start) / calls / 1e3)
    return statistics.median(samples)


class Recorder:
    """A no-op kernel that keeps the last arguments the op passed it."""

    def __init__(self) -> None:
        self.args: tuple = ()
        self.kwargs: dict = {}

    def __call__(self, *args, **kwargs) -> None:
        self.args, self.kwargs = args, kwargs


class NoopMoE(Recorder):
    """A MoE kernel object that does nothing: prepares no tensors, applies nothing."""

    weight_layout = "checkpoint"

    def padded_sizes(self, config):
        return config.hidden_size, config.intermediate_size

    def prepare_weights(self, plan, weights):
        return tk.PreparedMoEWeights(plan.kernel, plan.config, {})

    def apply(self, plan, x, prepared, **kwargs) -> None:
        self.args, self.kwargs = (plan, x, prepared), kwargs


def register_noops() -> dict[str, Recorder]:
    """A no-op at the top priority for every op, accepting every request anywhere."""
    noops = {}
    for op, features in (
        ("mha_prefill", ATTENTION_FEATURES),
        ("mha_extend_with_kvcache", ATTENTION_FEATURES),
        ("mha_decode_with_kvcache", ATTENTION_FEATURES),
        ("kvcache_store", STORE_FEATURES),
        ("moe_apply", MOE_FEATURES),
    ):
        traits = {f: True if f in FLAGS else tk.ANY for f in features}
        noops[op] = NoopMoE() if op == "moe_apply" else Recorder()
        tk.register_kernel(
            op, name=f"bench.{op}.noop", backend="bench", platforms=["*"], traits=traits,
            priority=10_000,
        )(noops[op])  # fmt: skip
    return noops


def unregister_noops() -> None:
    for op in registry.op_names():
        if f"bench.{op}.noop" in registry.registered_names():
            registry.unregister_kernel(f"bench.{op}.noop")


def attention_cases(device) -> list[Case]:
    bf16, i32 = torch.bfloat16, torch.int32
    sinks = torch.zeros(HQ, device=device)
    cache = torch.zeros(256, P, HKV, D, dtype=bf16, device=device)
    opts = (WINDOW, sinks, None, False)
    cases = []

    # decode: B=64 sequences of 128 keys (two pages each), q 3-D as engines pass it
    b = 64
    q = torch.randn(b, HQ, D, dtype=bf16, device=device)
    table = torch.arange(2 * b, dtype=i32, device=device).reshape(b, 2)
    lens = torch.full((b,), 2 * P, dtype=i32, device=device)
    out = torch.empty_like(q)
    kv = (cache, cache, table, lens)
    cases.append(Case(
        "mha_decode_with_kvcache", f"B={b} ctx={2 * P}",
        lambda: tk.mha_decode_with_kvcache(
            q, cache, cache, page_table=table, cache_seqlens=lens, window_left=WINDOW,
            sinks=sinks, out=out),
        lambda: checks.check_decode(q, kv, opts, out, None, None),
    ))  # fmt: skip

    # extend: 4 sequences of 16 new tokens on 128 cached ones
    nb, new = 4, 16
    qe = torch.randn(nb * new, HQ, D, dtype=bf16, device=device)
    cu = torch.arange(0, nb * new + 1, new, dtype=i32, device=device)
    te = torch.arange(3 * nb, dtype=i32, device=device).reshape(nb, 3)
    le = torch.full((nb,), 2 * P + new, dtype=i32, device=device)
    oute = torch.empty_like(qe)
    kve = (cache, cache, te, le)
    cases.append(Case(
        "mha_extend_with_kvcache", f"B={nb} +{new} ctx={2 * P + new}",
        lambda: tk.mha_extend_with_kvcache(
            qe, cache, cache, cu_seqlens_q=cu, page_table=te, cache_seqlens=le,
            max_seqlen_q=new, window_left=WINDOW, sinks=sinks, out=oute),
        lambda: checks.check_extend(qe, cu, new, kve, opts, oute, None, None),
    ))  # fmt: skip

    # prefill: 4 sequences of 64 tokens
    s = 64
    qp = torch.randn(nb * s, HQ, D, dtype=bf16, device=device)
    kp = torch.randn(nb * s, HKV, D, dtype=bf16, device=device)
    cup = torch.arange(0, nb * s + 1, s, dtype=i32, device=device)
    outp = torch.empty_like(qp)
    cases.append(Case(
        "mha_prefill", f"S={s} x{nb}",
        lambda: tk.mha_prefill(
            qp, kp, kp, cu_seqlens=cup, max_seqlen=s, window_left=WINDOW, sinks=sinks, out=outp),
        lambda: checks.check_prefill(qp, kp, kp, cup, s, True, opts, outp),
    ))  # fmt: skip

    # store: the 64 new tokens of a decode step
    k = torch.randn(b, HKV, D, dtype=bf16, device=device)
    slots = torch.arange(b, dtype=torch.int64, device=device) * P
    cases.append(Case(
        "kvcache_store", f"T={b}",
        lambda: tk.kvcache_store(k, k, cache, cache, slot_mapping=slots),
        lambda: checks.check_store(k, k, cache, cache, slots, None, None),
    ))  # fmt: skip
    return cases


def moe_case(device, m: int = 1) -> Case:
    """moe_apply at M=`m` with the plan's selected kernel; weights uninitialized (only the
    host cost is measured), prepared by whichever kernel moe_plan selects."""
    config = tk.MoEConfig(E, TOP_K, H, INTER)
    u8 = dict(dtype=torch.uint8, device=device)
    weights = tk.MoEWeights(
        w13=torch.zeros(E, 2 * INTER, H // 2, **u8),
        w2=torch.zeros(E, H, INTER // 2, **u8),
        w13_scale=torch.full((E, 2 * INTER, H // 32), 127, **u8),
        w2_scale=torch.full((E, H, INTER // 32), 127, **u8),
        w13_bias=torch.zeros(E, 2 * INTER, device=device),
        w2_bias=torch.zeros(E, H, device=device),
    )
    plan = tk.moe_plan(config, device=device, max_num_tokens=8192)
    prepared = tk.moe_prepare_weights(plan, weights)
    x = torch.randn(m, H, dtype=torch.bfloat16, device=device)
    logits = torch.randn(m, E, device=device)
    out = torch.empty_like(x)
    case = Case(
        "moe_apply", f"M={m}", lambda: tk.moe_apply(plan, x, prepared, logits, out=out), None
    )
    case.direct = lambda: plan.impl.apply(
        plan, x, prepared, router_logits=logits, topk_weights=None, topk_ids=None, out=out
    )
    case.kernel = plan.kernel
    return case


def measure(device, calls: int, repeats: int) -> list[dict[str, Any]]:
    platform = platform_of(device)
    noops = register_noops()
    try:
        cases = attention_cases(device)
        rows = []
        for case in cases:
            case.public()  # warm the selector cache; the no-op records the call
            case.request = case.check()[0]
            noop = noops[case.op]
            case.direct = lambda n=noop: n(*n.args, **n.kwargs)
            rows.append(_noop_row(case, device, platform, calls, repeats))
        moe = moe_case(device)
        moe.public()
        rows.append(_noop_row(moe, device, platform, calls, repeats))
        del moe
    finally:
        unregister_noops()
    if device.type == "cuda":
        for case, row in zip(cases, rows, strict=False):
            _real_kernel(case, row, noops[case.op], device, platform, calls, repeats)
        moe = moe_case(device)
        rows[-1]["kernel"] = moe.kernel
        _time_real(moe.direct, moe.public, rows[-1], device, calls, repeats)
    return rows


def _noop_row(case: Case, device, platform, calls, repeats) -> dict[str, Any]:
    t = dict(calls=calls, repeats=repeats, device=device)
    row = dict(op=case.op, shape=case.shape, kernel="-", launch=None, eager=None, graph=None)
    row["public_noop"] = per_call_us(case.public, **t)
    row["direct_noop"] = per_call_us(case.direct, **t)
    if case.request is not None:
        op, request = case.op, case.request
        row["select"] = per_call_us(lambda: selector.select(op, request, platform), **t)
        row["selection"] = per_call_us(
            lambda: selector.select(op, request, platform_of(device)), **t
        )
        row["checks"] = per_call_us(case.check, **t)
    else:
        row["select"] = row["selection"] = row["checks"] = 0.0
    row["other"] = row["public_noop"] - row["direct_noop"] - row["selection"] - row["checks"]
    return row


def _real_kernel(case, row, noop, device, platform, calls, repeats) -> None:
    spec = selector.select(case.op, case.request, platform)
    row["kernel"] = spec.name
    args, kwargs = noop.args, noop.kwargs
    _time_real(lambda: spec.fn(*args, **kwargs), case.public, row, device, calls, repeats)


def _time_real(direct, public, row, device, calls, repeats) -> None:
    from tokenspeed_kernel.tools.timing import Timer  # noqa: PLC0415

    public()
    torch.cuda.synchronize(device)
    few = max(calls // 20, 50)
    row["launch"] = per_call_us(direct, few, repeats, device)
    row["eager"] = per_call_us(public, few, repeats, device)
    timing = Timer(device, warmup=3, iters=50, budget_s=0.2).measure(direct, graph=True)
    row["graph"] = timing.median_s * 1e6


HEADERS = (
    "op", "shape", "selection", "checks", "other", "public (no-op)", "kernel", "launch",
    "eager", "graph",
)  # fmt: skip


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _cells(r: dict[str, Any]) -> list[str]:
    selection = f"{r['selection']:.2f} ({r['select']:.2f})"
    figures = [_fmt(r[k]) for k in ("checks", "other", "public_noop")]
    return [r["op"], r["shape"], selection, *figures, r["kernel"], *map(_fmt, _real(r))]


def _real(r: dict[str, Any]) -> list[float | None]:
    return [r["launch"], r["eager"], r["graph"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=7)
    record.add_record_argument(parser)
    args = parser.parse_args()
    # An indexed device, as tensors report it: platform_of caches one Platform per device key.
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    rows = measure(device, args.calls, args.repeats)
    name = record.device_name()
    cpu = f"host CPU {host.processor() or host.machine()} ({os.cpu_count()} cores)"
    lines = record.header(
        "Host cost of the public ops per call (cached path)",
        cpu + (", no GPU" if name == "cpu" else f" of the {name} machine"),
    )
    where = "CPU tensors" if device.type == "cpu" else f"{name} tensors"
    lines += [
        f"GPT-OSS-120B heads/experts (Hq {HQ}, Hkv {HKV}, D {D}, page {P}, window {WINDOW}, "
        f"sinks, out given; MoE E {E} top-{TOP_K} H {H} I {INTER} mxfp4) on {where}; median of "
        f"{args.repeats} runs of {args.calls} calls (the real kernel: 1/20 of them). "
        "selection = platform_of + cached select (select alone in brackets); other = public "
        "op with a no-op kernel - the no-op called directly - selection - checks; launch = "
        "the selected kernel called directly; eager = the public op with it; graph = its GPU "
        "time as a CUDA-graph replay. All in µs per call. Target: cached selection < 2 µs.",
        "",
        *record.table(HEADERS, [_cells(r) for r in rows]),
    ]
    record.write("dispatch", lines, device=name, record=not args.no_record)


if __name__ == "__main__":
    main()
