"""`tokenspeed-kernel bench`: every eligible kernel side by side on a preset's shapes.

Each kernel is called directly (`spec.fn`, normalized arguments, outputs preallocated) after a
warm-up, and gets three figures (see tools/timing.py). `latency us`: device time, the median of
many runs timed with device events with the L2 flushed between runs, or, with --cuda-graph, of
flushed CUDA-graph replays for decode. `eager us`: host-inclusive wall clock per call of
back-to-back calls with one synchronize at the end, what an engine pays calling it eagerly.
`graph us`: per back-to-back replay of the call captured once in a CUDA graph; empty, with a
note, where capture fails or for the reference (it synchronizes). On the CPU latency and eager
are wall clock and graph is empty. Also reports TFLOP/s, GB/s and the percentage of this device's
measured roofline (tools/roofline.py), all from latency; --peers adds FA3 and torch SDPA
(attention) and vLLM's triton_kernels MoE (moe_apply) where importable. Writes DIR/results.json
and one PNG per op (latency). --replay FILE times the public-op calls recorded with
TOKENSPEED_KERNEL_CAPTURE=FILE instead of the preset's shapes.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from ..registry import op_names
from ..testing.conformance import case_support, select_kernels
from ._common import (
    Progress,
    add_out_option,
    fmt,
    format_table,
    resolve_device,
    run_metadata,
    tool_parser,
    write_json,
)
from .peers import peer_calls, peer_names
from .plot import plot_op, require_matplotlib
from .roofline import Roofline, roofline
from .timing import Timer, Timing
from .workloads import MoEWeightsCache, bench_points, build_inputs, kernel_call, routing_ids, work

GRAPH_OPS = ("mha_decode_with_kvcache",)


def add_parser(sub) -> None:
    p = tool_parser(
        sub,
        "bench",
        __doc__,
        summary="time every eligible kernel on a preset's shapes",
        preset="shapes to time (default: gpt-oss-120b on a GPU, tiny on the CPU)",
    )
    p.add_argument("--op", choices=op_names(), help="only this op (default: every op)")
    p.add_argument("--kernels", metavar="GLOB", help="kernel name glob (default: all eligible)")
    add_out_option(p, "bench-results", "results.json and the PNGs go")
    p.add_argument(
        "--peers",
        action="store_true",
        help="add FA3 / torch SDPA / vLLM triton_kernels MoE reference points where importable",
    )
    p.add_argument(
        "--replay",
        metavar="FILE",
        help="time the calls captured with TOKENSPEED_KERNEL_CAPTURE=FILE",
    )
    p.add_argument(
        "--cuda-graph", action="store_true", help="time decode as CUDA-graph replays (GPU only)"
    )
    p.add_argument("--warmup", type=int, help="warm-up calls (default: 10 GPU, 1 CPU)")
    p.add_argument("--iters", type=int, help="most timed runs (default: 100 GPU, 5 CPU)")
    p.add_argument(
        "--budget-ms",
        type=float,
        default=500.0,
        help="stop timing a kernel after this long (at least 3 runs)",
    )
    p.add_argument("--no-plot", action="store_true", help="skip the PNG plots")
    p.add_argument(
        "--refresh-roofline",
        action="store_true",
        help="re-measure the roofline instead of using the cached figures",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    gpu = device.type == "cuda"
    if not args.no_plot:
        try:
            require_matplotlib()
        except RuntimeError as exc:
            raise ValueError(str(exc)) from None
    preset = args.tool_preset or ("gpt-oss-120b" if gpu else "tiny")
    timer = Timer(
        device,
        warmup=args.warmup or (10 if gpu else 1),
        iters=args.iters or (100 if gpu else 5),
        budget_s=args.budget_ms / 1e3,
    )
    roof = roofline(device, refresh=args.refresh_roofline)
    print(
        f"bench on {device} ({_describe(roof)}); timing: {timer.method}"
        + ("" if gpu else " (CPU: no device events, wall-clock medians)")
    )
    if args.cuda_graph and not gpu:
        print("note: --cuda-graph needs a GPU; timing eagerly")
    if args.replay:
        from .replay import replay_rows  # noqa: PLC0415

        rows = replay_rows(Path(args.replay), device, timer, roof, args.kernels)
        source = f"replay of {args.replay}"
    else:
        ops = op_names() if args.op is None else (args.op,)
        rows = _bench(ops, preset, device, timer, roof, args)
        source = f"preset {preset}"
    _print(rows)
    out = Path(args.out)
    payload = run_metadata(device)
    payload.update(
        source=source,
        preset=None if args.replay else preset,
        timing=dict(
            method=timer.method,
            warmup=timer.warmup,
            max_iters=timer.iters,
            budget_ms=args.budget_ms,
            l2_flush=gpu,
            cuda_graph_ops=list(GRAPH_OPS) if args.cuda_graph and gpu else [],
            eager="back-to-back calls, one synchronize per repeat, median repeat per call",
            graph="back-to-back replays of one capture, device events, per replay" if gpu else None,
        ),
        roofline=roof.__dict__,
        results=rows,
    )
    write_json(out / "results.json", payload)
    print(f"wrote {out / 'results.json'}")
    if not args.no_plot:
        title = f"{payload['device']} - {source} - {payload['date']} - {timer.method}"
        for op in sorted({r["op"] for r in rows}):
            path = plot_op(op, rows, out, title)
            if path is not None:
                print(f"wrote {path}")
    return 1 if any(r["status"] == "error" for r in rows) else 0


def _describe(roof: Roofline) -> str:
    return (
        f"{roof.device}; roofline ({roof.source}): copy {roof.copy_bytes_per_s / 1e9:.0f} GB/s,"
        f" {roof.matmul_dtype} matmul {roof.matmul_flops_per_s / 1e12:.1f} TFLOP/s"
    )


def row(
    point,
    kernel: str,
    *,
    peer: bool = False,
    status: str = "ok",
    timing: Timing | None = None,
    flops: float = 0.0,
    nbytes: float = 0.0,
    roof: Roofline | None = None,
    note: str = "",
    eager: Timing | None = None,
    graph: Timing | None = None,
) -> dict[str, Any]:
    """One result: figures are None unless the kernel was timed."""
    result: dict[str, Any] = dict(
        op=point.op,
        series=point.series,
        x=point.x,
        xlabel=point.xlabel,
        label=point.label,
        request=str(point.case.request),
        kernel=kernel,
        peer=peer,
        status=status,
        latency_us=None,
        eager_us=None,
        graph_us=None,
        tflops=None,
        gbps=None,
        roofline_pct=None,
        flops=flops,
        bytes=nbytes,
        runs=0,
        method=None,
        note=note,
    )
    if timing is not None:
        t = timing.median_s
        result.update(
            latency_us=t * 1e6,
            tflops=flops / t / 1e12 if flops else None,
            gbps=nbytes / t / 1e9 if nbytes else None,
            roofline_pct=roof.percent(t, flops, nbytes) if roof else None,
            runs=timing.runs,
            method=timing.method,
            note="; ".join(x for x in (note, timing.note) if x),
        )
    for key, extra in (("eager_us", eager), ("graph_us", graph)):
        if extra is not None:
            result[key] = extra.median_s * 1e6
    return result


def time_call(
    timer: Timer,
    call,
    point,
    name: str,
    flops,
    nbytes,
    roof,
    *,
    peer=False,
    graph=False,
    note="",
    no_capture="",
) -> dict[str, Any]:
    """Time `call` three ways (module docstring); `no_capture` says why it must not be captured
    in a CUDA graph (graph_us stays None with that note)."""
    try:
        timing = timer.measure(call, graph=graph)
        eager = timer.eager(call)
    except Exception as exc:  # one broken kernel must not end the whole run
        if timer.device.type == "cuda":
            torch.cuda.synchronize(timer.device)
        return row(
            point,
            name,
            peer=peer,
            status="error",
            flops=flops,
            nbytes=nbytes,
            note=f"{type(exc).__name__}: {exc}"[:300],
        )
    replays, graph_note = None, no_capture
    if timer.device.type == "cuda" and not no_capture:
        try:
            replays = timer.graph(call)
        except Exception as exc:  # e.g. a call that synchronizes or allocates on the host
            graph_note = f"graph capture failed ({type(exc).__name__})"
    return row(
        point,
        name,
        peer=peer,
        timing=timing,
        flops=flops,
        nbytes=nbytes,
        roof=roof,
        note="; ".join(x for x in (note, graph_note) if x),
        eager=eager,
        graph=replays,
    )


def _bench(ops, preset: str, device, timer: Timer, roof: Roofline, args) -> list[dict]:
    plan = []
    for op in ops:
        specs = select_kernels(op, kernel=args.kernels)
        plan += [(point, specs) for point in bench_points(op, preset)]
    progress = Progress(
        sum(len(specs) + (len(peer_names(p.op)) if args.peers else 0) for p, specs in plan),
        "bench",
    )
    weights = MoEWeightsCache(device)
    max_tokens = max((p.x for p, _ in plan if p.op == "moe_apply"), default=0)
    rows = []
    for point, specs in plan:
        inputs = build_inputs(point.case, device)
        flops, nbytes = work(point.case, routing_ids(point.case, inputs))
        for spec in specs:
            progress.step(f"{spec.name} {point.label}")
            verdict = case_support(spec, point.case, device)
            if not verdict.ok:
                rows.append(row(point, spec.name, status="skipped", note=verdict.reason))
                continue
            graph = args.cuda_graph and point.op in GRAPH_OPS
            note, no_capture = "", ""
            if device.type == "cuda" and spec.backend == "reference":
                no_capture = "reference synchronizes: not captured"
                if graph:
                    graph, note = False, "latency timed eagerly"
            try:
                call = kernel_call(spec, point.case, inputs, device, weights, max_tokens)
            except Exception as exc:
                rows.append(row(point, spec.name, status="error", note=f"prepare: {exc}"[:300]))
                continue
            rows.append(
                time_call(
                    timer,
                    call,
                    point,
                    spec.name,
                    flops,
                    nbytes,
                    roof,
                    graph=graph,
                    note=note,
                    no_capture=no_capture,
                )
            )
        if args.peers:
            checkpoint = None
            if point.op == "moe_apply":
                checkpoint = weights.checkpoint(point.case.shape)
            for name, call, why in peer_calls(point, inputs, device, checkpoint):
                progress.step(f"{name} {point.label}")
                if call is None:
                    rows.append(row(point, name, peer=True, status="unavailable", note=why))
                else:
                    rows.append(
                        time_call(
                            timer, call, point, name, flops, nbytes, roof, peer=True, note=why
                        )
                    )
        del inputs
    progress.close()
    weights.clear()
    return rows


def _print(rows: list[dict]) -> None:
    for op in dict.fromkeys(r["op"] for r in rows):
        table = [
            (
                r["series"],
                r["label"],
                r["kernel"],
                fmt(r["latency_us"], ".1f"),
                fmt(r["eager_us"], ".1f"),
                fmt(r["graph_us"], ".1f"),
                fmt(r["tflops"], ".2f"),
                fmt(r["gbps"], ".1f"),
                fmt(r["roofline_pct"], ".1f"),
                r["status"] if r["status"] != "ok" else "",
                r["note"][:70],
            )
            for r in rows
            if r["op"] == op
        ]
        print(f"\n{op}:")
        print(
            format_table(
                (
                    "series",
                    "shape",
                    "kernel",
                    "latency us",
                    "eager us",
                    "graph us",
                    "TFLOP/s",
                    "GB/s",
                    "% roof",
                    "status",
                    "note",
                ),
                table,
                "lllrrrrrrll",
            )
        )
