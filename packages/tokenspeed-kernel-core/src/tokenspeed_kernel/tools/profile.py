"""`tokenspeed-kernel profile`: run one op on a preset's shapes under torch.profiler.

Writes a Chrome / Perfetto trace (DIR/trace.json: open it in ui.perfetto.dev or
chrome://tracing) and prints the device kernels with their times (on the CPU, where there is no
device, the CPU operators). The kernel is the one the selector picks for each shape, or --kernel.
Every shape's inputs stay allocated until the trace is written: a preset whose inputs and weights
would not fit this device's free memory is refused up front, naming the presets that fit.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from ..platform import platform_of
from ..presets import PRESETS
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
    _refuse_if_too_big(op, preset, device)
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


# Bytes per MoE weight element while profiling: the float32 draw, the packed checkpoint, and
# the reference kernel's float32 dequantized copy (measured on the CPU: 9.6 B at 8 experts of
# 2880 x 2880; rounded up).
MOE_BYTES_PER_WEIGHT = 10


def needed_bytes(op: str, preset: str) -> int:
    """Roughly the memory `profile` holds for a preset: every shape's inputs and outputs, and
    the MoE weights."""
    total = 0
    for point in bench_points(op, preset):
        s = point.case.shape
        if op == "moe_apply":
            total += 2 * 2 * s.num_tokens * s.hidden_size  # x and out, bf16
            continue
        kv_row = s.num_kv_heads * s.head_dim
        if op == "kvcache_store":  # k and v in, the two caches
            total += 2 * (s.num_tokens + s.num_pages * s.page_size) * kv_row * 4
            continue
        q_rows = sum(s.seqlens) if op == "mha_prefill" else sum(s.q_lens)
        if op == "mha_decode_with_kvcache":
            q_rows *= len(s.seqlens)
        # k and v (or their caches), q and out, counted at float32 for the reference's upcasts.
        total += 2 * sum(s.seqlens) * kv_row * 4 + 2 * q_rows * s.num_q_heads * s.head_dim * 4
    if op == "moe_apply":
        p = PRESETS[preset]
        total += MOE_BYTES_PER_WEIGHT * 3 * p.num_experts * p.hidden_size * p.intermediate_size
    return total


def free_bytes(device: torch.device) -> int | None:
    """Memory free for new tensors: the GPU's free memory, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def _refuse_if_too_big(op: str, preset: str, device: torch.device) -> None:
    free = free_bytes(device)
    needed = needed_bytes(op, preset)
    if free is None or needed <= free:
        return
    fits = [name for name in PRESETS if name != preset and needed_bytes(op, name) <= free]
    instead = f"use --preset {' or '.join(fits)}" if fits else "use a machine with more memory"
    raise ValueError(
        f"profile --op {op} --preset {preset} needs about {needed / 2**30:.1f} GiB on {device}, "
        f"and {free / 2**30:.1f} GiB is free: {instead}"
    )


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
