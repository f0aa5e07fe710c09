"""`tokenspeed-kernel tune`: time every kernel that supports each of a preset's requests on this
device, and write the rankings file the selector consults (format and bucket key:
`tokenspeed_kernel.rankings`).

On a GPU each kernel is timed as CUDA-graph replays with the L2 flushed between runs (the
reference kernels synchronize, and a kernel whose capture fails is timed eagerly; the entry
says so); on the CPU with the wall clock. Figures are medians with the 10th-90th percentile
spread. Points of the preset that fall into one bucket (same request key and sizes) are merged
by the geometric mean of each kernel's times over them.

    tokenspeed-kernel tune --preset gpt-oss-120b --out rankings-h100.json
    TOKENSPEED_KERNEL_CAPTURE=calls.jsonl python serve.py          # record a real workload ...
    tokenspeed-kernel tune --replay calls.jsonl --out rankings-h100.json   # ... and rank on it
    TOKENSPEED_KERNEL_RANKINGS=rankings-h100.json python serve.py   # select from it

`--replay` measures the distinct calls recorded with TOKENSPEED_KERNEL_CAPTURE instead of a
preset's shapes (fresh data of the recorded shapes, the recorded offsets, lengths and expert ids).
"""

from __future__ import annotations

import argparse
import fnmatch
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from .. import rankings
from ..ops.attention.request import size_bucket
from ..platform import Platform, platform_of
from ..registry import KernelSpec, kernels
from ..testing.cases import Case
from ._common import Progress, format_table, resolve_device, run_metadata, tool_parser, write_json
from .replay import replay_inputs, replay_points
from .timing import Timer
from .workloads import MoEWeightsCache, Point, bench_points, build_inputs, kernel_call

TUNED_OPS = (
    "mha_prefill",
    "mha_extend_with_kvcache",
    "mha_decode_with_kvcache",
    "kvcache_store",
    "moe_apply",
)


def add_parser(sub) -> None:
    p = tool_parser(
        sub,
        "tune",
        __doc__,
        summary="measure every kernel per request bucket and write a rankings file",
        preset="shapes to measure (default: gpt-oss-120b on a GPU, tiny on the CPU)",
    )
    p.add_argument(
        "--op",
        action="append",
        choices=TUNED_OPS,
        help="only this op (repeatable; default: every op)",
    )
    p.add_argument("--kernels", metavar="GLOB", help="kernel name glob (default: all)")
    p.add_argument(
        "--replay",
        metavar="FILE",
        help="measure the calls recorded with TOKENSPEED_KERNEL_CAPTURE=FILE instead of a preset",
    )
    p.add_argument(
        "--with-reference",
        action="store_true",
        help="time the reference kernels on a GPU too (skipped there by default: they are the "
        "lowest-priority fallback, never the fastest, and slow at large shapes)",
    )
    p.add_argument(
        "--out",
        metavar="FILE",
        help="rankings file to write (default: rankings-<arch>.json in the current directory)",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="keep the entries of ops not measured now from an existing --out file of this "
        "platform (measure ops over several runs into one file)",
    )
    p.add_argument(
        "--keep-kernels",
        action="store_true",
        help="with --merge: in the buckets measured now, also keep the file's times of kernels "
        "this run did not time (say, a library not installed here), marked with their run",
    )
    p.add_argument("--warmup", type=int, help="warm-up calls (default: 10 GPU, 1 CPU)")
    p.add_argument("--iters", type=int, help="most timed runs (default: 100 GPU, 5 CPU)")
    p.add_argument(
        "--budget-ms",
        type=float,
        default=500.0,
        help="stop timing a kernel after this long (at least 3 runs)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.keep_kernels and not args.merge:  # before any timing
        raise ValueError("tune: --keep-kernels needs --merge")
    device = resolve_device(args.device)
    gpu = device.type == "cuda"
    preset = args.tool_preset or ("gpt-oss-120b" if gpu else "tiny")
    timer = Timer(
        device,
        warmup=args.warmup or (10 if gpu else 1),
        iters=args.iters or (100 if gpu else 5),
        budget_s=args.budget_ms / 1e3,
    )
    platform = platform_of(device)
    ops = tuple(args.op) if args.op else TUNED_OPS
    if args.replay:
        try:
            points = [(p, r) for p, r in replay_points(Path(args.replay)) if p.op in ops]
        except (OSError, ValueError) as exc:
            raise SystemExit(f"tokenspeed-kernel tune: {exc}") from None
        if not points:
            raise SystemExit(
                f"tokenspeed-kernel tune: {args.replay} records no call of {', '.join(ops)}"
            )
        source = dict(replay=args.replay)
    else:
        points = preset_points(ops, preset)
        source = dict(preset=preset)
    what = f"replay of {args.replay}" if args.replay else f"preset {preset}"
    print(f"tune on {device} ({platform}); timing: {timer.method}, {what}")
    skip_reference = gpu and not args.with_reference
    measured = measure(
        points, device, timer, kernel_glob=args.kernels, skip_reference=skip_reference
    )
    created = run_metadata(device)
    created.update(source, timing=timer.method, graphs=gpu, l2_flush=gpu)
    payload = rankings_payload(platform, measured, created)
    out = Path(args.out or f"rankings-{platform.arch}.json")
    if args.merge and out.exists():
        kept = merge_into(payload, rankings.load(out), ops, keep_kernels=args.keep_kernels)
        print(f"kept {kept} entries of other ops from {out}")
    write_json(out, payload)
    rankings.load(out)  # what was written must load: the selector will read it
    _print(payload["rankings"])
    print(f"wrote {out} ({len(payload['rankings'])} buckets); select from it with")
    print(f"  {rankings.RANKINGS_ENV}={out}")
    return 0


def bucketed_request(case: Case) -> Any:
    """The request the public op builds for this case's call (sizes as `size_bucket`s)."""
    s, request = case.shape, case.request
    if case.op == "mha_prefill":
        return request._replace(
            tokens=size_bucket(sum(s.seqlens)), seqlen=size_bucket(max(s.seqlens, default=0))
        )
    if case.op == "mha_extend_with_kvcache":
        return request._replace(
            tokens=size_bucket(sum(s.q_lens)), seqlen=size_bucket(max(s.q_lens, default=0))
        )
    if case.op == "mha_decode_with_kvcache":
        return request._replace(tokens=size_bucket(len(s.seqlens) * s.q_lens[0]))
    if case.op == "kvcache_store":
        return request._replace(tokens=size_bucket(s.num_tokens))
    return request  # moe_apply: the plan's max_num_tokens is the call's token count here


def _sizes(case: Case, request: Any) -> dict[str, int]:
    if case.op == "moe_apply":
        return {"tokens": size_bucket(case.shape.num_tokens)}
    return {k: v for k, v in rankings.request_sizes(request).items() if v}


def preset_points(ops, preset: str) -> list[tuple[Point, None]]:
    """The preset's benchmark points of `ops`, in `measure`'s form."""
    return [(point, None) for op in ops for point in bench_points(op, preset)]


def measure(
    points: list[tuple[Point, dict | None]],
    device: torch.device,
    timer: Timer,
    *,
    kernel_glob: str | None = None,
    skip_reference: bool = False,
) -> list[dict[str, Any]]:
    """One record per (point, kernel that supports it): op, key, sizes, label, kernel, figures.
    points: (point, its capture record for a replayed call, else None)."""
    platform = platform_of(device)
    plan: list[tuple[Point, dict | None, Any, list[KernelSpec]]] = []
    for point, record in points:
        specs = [
            s
            for s in kernels(point.op)
            if (kernel_glob is None or fnmatch.fnmatchcase(s.name, kernel_glob))
            and not (skip_reference and s.backend == "reference")
        ]
        request = bucketed_request(point.case)
        eligible = [s for s in specs if s.supports(request, platform).ok]
        plan.append((point, record, request, eligible))
    progress = Progress(sum(len(e) for *_, e in plan), "tune")
    weights = MoEWeightsCache(device)
    max_tokens = max((p.case.shape.num_tokens for p, *_ in plan if p.op == "moe_apply"), default=0)
    records = []
    for point, record, request, eligible in plan:
        if record is None:
            inputs = build_inputs(point.case, device)
        else:
            inputs = replay_inputs(record, point.case, device)
        for spec in eligible:
            progress.step(f"{spec.name} {point.label}")
            records.append(
                _time_kernel(spec, point, request, inputs, device, timer, weights, max_tokens)
            )
        del inputs
    progress.close()
    weights.clear()
    return records


def _time_kernel(spec, point, request, inputs, device, timer, weights, max_tokens) -> dict:
    record = dict(
        op=point.op,
        key=rankings.request_key(request),
        sizes=_sizes(point.case, request),
        label=f"{point.series} {point.label}",
        kernel=spec.name,
        median_us=None,
        low_us=None,
        high_us=None,
        method=None,
        note="",
    )
    graph = device.type == "cuda" and spec.backend != "reference"
    try:
        call = kernel_call(spec, point.case, inputs, device, weights, max_tokens)
        timing = timer.measure(call, graph=graph)
    except Exception as exc:  # one broken kernel must not end the run: it goes unranked
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        record["note"] = f"{type(exc).__name__}: {exc}"[:300]
        return record
    record.update(
        median_us=timing.median_s * 1e6,
        low_us=None if timing.low_s is None else timing.low_s * 1e6,
        high_us=None if timing.high_s is None else timing.high_s * 1e6,
        method=timing.method,
        note=timing.note,
    )
    return record


def rankings_payload(
    platform: Platform, records: list[dict[str, Any]], created: dict[str, Any]
) -> dict[str, Any]:
    """The rankings file: one entry per (op, key, sizes); points sharing a bucket merged by
    the geometric mean over them, of the kernels timed at every one of those points."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["op"], r["key"], tuple(sorted(r["sizes"].items())))].append(r)
    entries = []
    for (op, key, sizes), rows in groups.items():
        labels = list(dict.fromkeys(r["label"] for r in rows))
        per_kernel: dict[str, list[dict]] = defaultdict(list)
        for r in rows:
            per_kernel[r["kernel"]].append(r)
        times, spread, notes = {}, {}, {}
        for name, runs in per_kernel.items():
            ok = [r for r in runs if r["median_us"] is not None]
            failed = [r["note"] for r in runs if r["median_us"] is None]
            if failed or len(ok) != len(labels):
                notes[name] = "not ranked: " + (failed[0] if failed else "missing a point")
                continue
            times[name] = round(_geomean([r["median_us"] for r in ok]), 3)
            if all(r["low_us"] is not None for r in ok):
                low = _geomean([r["low_us"] for r in ok])
                high = _geomean([r["high_us"] for r in ok])
                spread[name] = [round(low, 3), round(high, 3)]
            methods = {r["method"] for r in ok} | {r["note"] for r in ok if r["note"]}
            notes[name] = "; ".join(sorted(m for m in methods if m))
        if not times:
            continue
        entries.append(
            dict(
                op=op,
                key=key,
                sizes=dict(sizes),
                label=", ".join(labels),
                times_us=dict(sorted(times.items(), key=lambda kv: kv[1])),
                spread_us=spread,
                notes=notes,
            )
        )
    return dict(
        format=rankings.FORMAT,
        version=rankings.VERSION,
        platform=dict(vendor=platform.vendor, arch=platform.arch, name=platform.name),
        created=created,
        rankings=entries,
    )


def merge_into(
    payload: dict[str, Any], old: rankings.Source, ops, *, keep_kernels: bool = False
) -> int:
    """Add `old`'s entries for ops not in `ops` to `payload` (same platform only); returns
    how many were kept. Each run's provenance is kept under created["merged"]. keep_kernels:
    in each bucket measured now, also the times of the kernels this run has no record of,
    noted with the date of the run they come from."""
    mine = {k: payload["platform"][k] for k in ("vendor", "arch", "name")}
    theirs = {k: old.platform.get(k) for k in ("vendor", "arch", "name")}
    if mine != theirs:
        raise ValueError(
            f"tune --merge: {old.origin} was measured on {theirs}, this is {mine}; "
            "write to another file"
        )
    kept = [dict(e) for e in old.entries if e["op"] not in ops]
    if keep_kernels:
        _keep_kernels(payload["rankings"], old)
    payload["rankings"] = kept + payload["rankings"]
    earlier = {k: v for k, v in old.created.items() if k != "merged"}
    payload["created"]["merged"] = [earlier, *old.created.get("merged", [])]
    return len(kept)


def _keep_kernels(entries: list[dict[str, Any]], old: rankings.Source) -> None:
    """merge_into's keep_kernels, in place on this run's entries."""
    earlier = {(e["op"], e["key"], tuple(sorted(e["sizes"].items()))): e for e in old.entries}
    run = old.created.get("date", "an earlier run")
    for entry in entries:
        before = earlier.get((entry["op"], entry["key"], tuple(sorted(entry["sizes"].items()))))
        if before is None:
            continue
        for name, us in before["times_us"].items():
            if name in entry["times_us"] or name in entry["notes"]:
                continue
            entry["times_us"][name] = us
            if name in before.get("spread_us", {}):
                entry["spread_us"][name] = before["spread_us"][name]
            note = before.get("notes", {}).get(name, "")
            note = note if note.startswith("measured ") else f"measured {run}; {note}"
            entry["notes"][name] = note.rstrip("; ")
        entry["times_us"] = dict(sorted(entry["times_us"].items(), key=lambda kv: kv[1]))


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _print(entries: list[dict[str, Any]]) -> None:
    rows = []
    for e in entries:
        order = list(e["times_us"].items())
        best, t = order[0]
        runner = f"{order[1][0]} {order[1][1]:.1f}" if len(order) > 1 else "-"
        sizes = rankings.describe_sizes(e["sizes"])
        rows.append((e["op"], e["label"][:32], sizes, best, f"{t:.1f}", runner))
    print(format_table(("op", "points", "bucket", "fastest", "us", "next (us)"), rows, "lllllr"))
