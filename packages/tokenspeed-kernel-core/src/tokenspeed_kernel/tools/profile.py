"""`tokenspeed-kernel profile`: run one op on a preset's shapes under torch.profiler.

Writes a Chrome / Perfetto trace (DIR/trace.json: open it in ui.perfetto.dev or
chrome://tracing) and prints the device kernels with their times (on the CPU, where there is no
device, the CPU operators). The kernel is the one the selector picks for each shape, or --kernel.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..platform import platform_of
from ..registry import get_kernel, op_names
from ..selector import select
from ._common import add_out_option, format_table, resolve_device, tool_parser, write_json
from .workloads import MoEWeightsCache, bench_points, build_inputs, kernel_call


def add_parser(sub) -> None:
    p = tool_parser(
        sub,
        "profile",
        __doc__,
        summary="one op under torch.profiler: trace + kernel times",
        preset="shapes to run (default: gpt-oss-120b on a GPU, tiny on the CPU)",
    )
    p.add_argument("--op", required=True, choices=op_names())
    p.add_argument("--kernel", metavar="NAME", help="profile this kernel (default: selected)")
    add_out_option(p, "profile-results", "trace.json goes")
    p.add_argument("--iters", type=int, default=3, help="profiled calls per shape")
    p.add_argument("--top", type=int, default=25, help="rows of the kernel table")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    gpu = device.type == "cuda"
    op = args.op
    preset = args.tool_preset or ("gpt-oss-120b" if gpu else "tiny")
    forced = get_kernel(op, args.kernel) if args.kernel else None
    platform = platform_of(device)
    weights = MoEWeightsCache(device)
    points = bench_points(op, preset)
    max_tokens = max(p.x for p in points) if op == "moe_apply" else 0
    calls = []
    for point in points:
        spec = forced or select(op, point.case.request, platform)
        verdict = spec.supports(point.case.request, platform)
        if not verdict.ok:
            raise ValueError(f"profile: {spec.name} declines {point.label}: {verdict.reason}")
        inputs = build_inputs(point.case, device)
        call = kernel_call(spec, point.case, inputs, device, weights, max_tokens)
        call()  # compile / autotune outside the trace
        calls.append((f"{spec.name} {point.series} {point.label}", call))
    if gpu:
        torch.cuda.synchronize(device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if gpu:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, acc_events=True) as prof:
        for label, call in calls:
            with torch.profiler.record_function(label):
                for _ in range(args.iters):
                    call()
        if gpu:
            torch.cuda.synchronize(device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "trace.json"
    prof.export_chrome_trace(str(trace))
    rows = _kernel_rows(prof, gpu, {label for label, _ in calls})
    print(f"profile {op} on {platform} ({preset}, {len(calls)} shapes x {args.iters} calls)")
    what = "device kernels" if gpu else "CPU operators (no device here)"
    print(f"{what}, by total time:")
    shown = [
        (name[:80], calls_, f"{total:.1f}", f"{total / max(calls_, 1):.2f}")
        for name, calls_, total in rows[: args.top]
    ]
    print(format_table(("name", "calls", "total us", "avg us"), shown, "lrrr"))
    write_json(
        out / "kernels.json",
        {
            "op": op,
            "preset": preset,
            "device_kernels": gpu,
            "rows": [dict(name=n, calls=c, total_us=t) for n, c, t in rows],
        },
    )
    print(f"wrote {trace}")
    return 0


def _kernel_rows(prof, gpu: bool, labels: set[str]) -> list[tuple[str, int, float]]:
    """(name, calls, total µs): device kernels on a GPU, self CPU time of operators otherwise;
    our own per-shape ranges are left out (they would count every kernel twice)."""
    rows = []
    for event in prof.key_averages():
        if event.key in labels:
            continue
        total = event.self_device_time_total if gpu else event.self_cpu_time_total
        if total > 0:
            rows.append((event.key, event.count, float(total)))
    return sorted(rows, key=lambda r: -r[2])
