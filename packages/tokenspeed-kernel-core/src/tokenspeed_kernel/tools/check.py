"""`tokenspeed-kernel check`: every registered kernel that can run here, against the core
reference, over the shared conformance cases (plus a preset's shapes).

Prints one row per (kernel, case): max abs and relative error and PASS / FAIL / SKIP (the kernel
declines the case, with its reason). A kernel that raises fails with its error. Exits 1 when any
case fails, naming each failing kernel and case, and when nothing ran (no kernel matches, or
every match declines every case). Without a GPU the Triton kernels run through the Triton
interpreter: numerics only, and slow (narrow with --op, --kernel, --case).
"""

from __future__ import annotations

import argparse
import fnmatch
import time
import traceback
from dataclasses import asdict, dataclass

import torch

from ..platform import interpreting, platform_of
from ..registry import kernels, op_names
from ..testing import case_support, conformance_cases, run_case
from ._common import (
    Progress,
    format_table,
    platform_words,
    resolve_device,
    run_metadata,
    tool_parser,
    write_json,
)

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def add_parser(sub) -> None:
    p = tool_parser(
        sub,
        "check",
        __doc__,
        summary="every kernel against the reference on the shared cases",
        preset="also check the preset's model shapes",
    )
    p.add_argument(
        "--kernel",
        metavar="GLOB",
        help="kernel name glob, e.g. 'triton.*' (default: every non-reference kernel; "
        "a glob that names reference kernels checks them too)",
    )
    p.add_argument("--op", choices=op_names(), help="only this op (default: every op)")
    p.add_argument(
        "--dtype",
        choices=sorted(_DTYPES),
        action="append",
        help="only cases with this activation dtype (repeatable)",
    )
    p.add_argument("--case", metavar="GLOB", help="only cases whose name matches")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write every result as JSON")
    p.set_defaults(run=run)


@dataclass
class Row:
    kernel: str
    op: str
    case: str
    status: str  # PASS | FAIL | SKIP
    max_abs: float | None = None
    max_rel: float | None = None
    rms: float | None = None
    detail: str = ""
    seconds: float = 0.0


def _kernels(op: str | None, glob: str | None, device: torch.device):
    """(specs to check, one line per kernel that cannot run on this platform at all)."""
    ops = op_names() if op is None else (op,)
    chosen, elsewhere = [], []
    platform = platform_of(device)
    for name in ops:
        for spec in kernels(name):
            if glob is None and spec.backend == "reference":
                continue
            if glob is not None and not fnmatch.fnmatchcase(spec.name, glob):
                continue
            mismatches = [p.mismatch(platform) for p in spec.platforms]
            if all(mismatches):
                elsewhere.append(f"{spec.name}: {mismatches[0]}")
            else:
                chosen.append(spec)
    return chosen, elsewhere


def _check_one(spec, case, device, seed) -> Row:
    verdict = case_support(spec, case, device)
    if not verdict.ok:
        return Row(spec.name, spec.op, case.name, "SKIP", detail=verdict.reason)
    start = time.perf_counter()
    try:
        result = run_case(spec, case, device, seed=seed)
    except Exception as exc:  # a kernel that raises is a failure, shown with its error
        last = traceback.extract_tb(exc.__traceback__)[-1]
        where = f" ({last.filename.rsplit('/', 1)[-1]}:{last.lineno})"
        return Row(
            spec.name,
            spec.op,
            case.name,
            "FAIL",
            detail=f"raised {type(exc).__name__}: {exc}{where}",
            seconds=time.perf_counter() - start,
        )
    return Row(
        spec.name,
        spec.op,
        case.name,
        "PASS" if result.ok else "FAIL",
        result.max_abs,
        result.max_rel,
        result.rms,
        "" if result.ok else str(result),
        time.perf_counter() - start,
    )


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    op = args.op
    specs, elsewhere = _kernels(op, args.kernel, device)
    dtypes = None if not args.dtype else [_DTYPES[d] for d in args.dtype]
    work = [
        (spec, case)
        for spec in specs
        for case in conformance_cases(spec.op, preset=args.tool_preset, dtypes=dtypes)
        if args.case is None or fnmatch.fnmatchcase(case.name, args.case)
    ]
    print(
        f"check on {platform_words(platform_of(device))}: {len(specs)} kernels, "
        f"{len(work)} kernel-case pairs"
    )
    if device.type == "cpu" and interpreting():
        print("  no GPU: Triton kernels run through the Triton interpreter (numerics, not speed)")
    for line in elsewhere:
        print(f"  not on this platform: {line}")
    progress = Progress(len(work), "check")
    rows = []
    for spec, case in work:
        rows.append(_check_one(spec, case, device, args.seed))
        progress.step(f"{spec.name} {case.name}")
    progress.close()
    _print(rows)
    if args.json:
        payload = run_metadata(device)
        payload["results"] = [asdict(r) for r in rows]
        payload["not_on_this_platform"] = elsewhere
        write_json(args.json, payload)
        print(f"wrote {args.json}")
    if all(r.status == "SKIP" for r in rows):
        return 1
    return 1 if any(r.status == "FAIL" for r in rows) else 0


def _print(rows: list[Row]) -> None:
    if not rows:
        print(
            "nothing ran: no kernel that can run here matches the filters "
            "(`tokenspeed-kernel list` names them; reference kernels need --kernel 'reference.*')"
        )
        return
    table = [
        (
            r.kernel,
            r.case,
            _num(r.max_abs),
            _num(r.max_rel),
            r.status,
            r.detail if r.status == "SKIP" else "",
        )
        for r in rows
    ]
    print(format_table(("kernel", "case", "max abs", "max rel", "result", "note"), table, "llrrll"))
    counts = {s: sum(r.status == s for r in rows) for s in ("PASS", "FAIL", "SKIP")}
    print(f"\n{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    if not counts["PASS"] and not counts["FAIL"]:
        print("nothing ran: every matching kernel declines every case (see the notes)")
    for r in rows:
        if r.status == "FAIL":
            print(f"FAIL {r.kernel} on {r.case}: {r.detail}")


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"
