"""Run every GPU kernel registered here once per conformance case, for compute-sanitizer.

    bash scripts/sanitize.sh            # the whole sweep: memcheck, racecheck, initcheck
    python scripts/sanitize_kernels.py [--op OP] [--preset gpt-oss-120b] [--max-cases N]
        [--budget-s S] [--shard K/N]
    python scripts/sanitize_kernels.py --summarize LOG...   # findings table of sanitizer logs

Each kernel that accepts this GPU runs the op's shared cases (odd sizes, one token, empty
sequences, page size 1, FP8 caches, ...) and, with --preset, a model's real shapes first
(for gpt-oss-120b also MoE at M = 64, the one-program router's largest batch, and at 5 and
300 tokens, odd batches on both routers); outputs are compared with the reference so a
sanitizer-clean but wrong kernel still fails. Each run prints a `case:` line before it starts,
so the summary attributes every sanitizer report to the kernel and case that produced it.
--budget-s stops starting new runs after that many seconds (the ones left are counted as
skipped), so a slow tool still finishes in a known time. --shard K/N runs every N-th run from
the K-th (0-based) of the same ordered list, so N processes, one per GPU, split a sweep with
each holding its share of the model shapes first. Exit status 1 if any comparison
failed; the sanitizer's own exit code reports memory errors and races.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import re
import sys
import time
from pathlib import Path

# Experts per MoE layer in the sanitized model-shape cases. Each expert's GEMMs keep the model's
# shapes (H = I = 2880, top-4) and a token meets at most top_k experts, so the kernels' loops,
# tiles and edges are the model's; what the count changes is the weights to prepare: at 128 the
# MXFP4 weights are 1.7 GB and the reference's float32 copy 12.7 GB, ~20 s per case without a
# sanitizer (so the plain pass's budget covered 15 of 119 runs on an H100) and memcheck, which
# holds freed memory back, ran the GPU out of memory preparing them.
SANITIZED_EXPERTS = 16


def extra_cases(op: str, preset: str | None):
    """MoE shapes the preset's cases leave out: M = 64 at GPT-OSS-120B (top-4, H = I = 2880)
    and odd batches (5, 300 tokens) on both router paths."""
    if op != "moe_apply" or preset != "gpt-oss-120b":
        return []
    from tokenspeed_kernel.testing.cases import moe_case
    from tokenspeed_kernel.testing.inputs import MoEShape

    return [
        moe_case(f"{preset}-moe-mxfp4-bf16-m{m}", MoEShape(m, 128, 4, 2880, 2880), preset)
        for m in (64, 5, 300)
    ]


def with_sanitized_experts(case):
    """A model-shape MoE case at SANITIZED_EXPERTS experts (its name says so); others, and
    expert-parallel cases (whose rank prepares only its local experts), as given."""
    if case.op != "moe_apply" or case.preset is None:
        return case
    config = case.shape.config()
    if config.num_local_experts != config.num_experts:
        return case
    from tokenspeed_kernel.testing.cases import moe_case

    shape = dataclasses.replace(
        case.shape, num_experts=min(case.shape.num_experts, SANITIZED_EXPERTS)
    )
    return moe_case(f"{case.name}-e{shape.num_experts}", shape, case.preset)


def ordered_cases(op: str, preset: str | None):
    """The model's shapes first (what a budget must not cut), then the shared odd shapes."""
    from tokenspeed_kernel.testing import conformance_cases

    cases = conformance_cases(op, preset=preset) + extra_cases(op, preset)
    cases = [with_sanitized_experts(case) for case in cases]
    return sorted(cases, key=lambda case: case.preset is None)


def run(args) -> int:
    import torch

    from tokenspeed_kernel.platform import platform_of
    from tokenspeed_kernel.registry import kernels, op_names
    from tokenspeed_kernel.testing import case_support, run_case

    if not torch.cuda.is_available():
        print("sanitize_kernels: no GPU here; compute-sanitizer needs one")
        return 2
    device = torch.device("cuda", 0)
    platform = platform_of(device)
    runs = []
    for op in args.op or op_names():
        cases = ordered_cases(op, args.preset)
        for spec in kernels(op):
            if spec.backend != "reference":
                runnable = [c for c in cases if case_support(spec, c, device).ok]
                runs += [(case.preset is None, i, spec, case) for i, case in enumerate(runnable)]
    # Every kernel's model shapes before any odd shape, then the odd shapes kernel by kernel
    # in turn: a budget cuts some of every kernel's odd shapes, never a model shape first.
    runs.sort(key=lambda run: run[:2])
    runs = [run for i, run in enumerate(runs) if i % args.shard[1] == args.shard[0]]
    failed = ran = skipped = 0
    start_all = time.perf_counter()
    for _, i, spec, case in runs:
        if args.max_cases and i >= args.max_cases:
            continue
        if args.budget_s and time.perf_counter() - start_all > args.budget_s:
            skipped += 1
            continue
        print(f"case: {spec.name} {case.name}", flush=True)
        start = time.perf_counter()
        if args.kernel_only:
            run_kernel_alone(spec, case, device)
            ok, status = True, "ran (not compared)"
        else:
            result = run_case(spec, case, device)
            ok, status = result.ok, "ok" if result.ok else f"FAILED {result}"
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        ran += 1
        failed += not ok
        print(f"{spec.name:<36} {case.name:<48} {seconds:6.2f}s {status}", flush=True)
    print(f"runs: {ran} kernel-case runs on {platform}, {failed} failed, {skipped} skipped")
    return 1 if failed or not ran else 0


def run_kernel_alone(spec, case, device) -> None:
    """The kernel on the case's inputs, built on the CPU and copied to the device, and nothing
    else: initcheck counts a copy as initialisation but not the writes of a kernel it does not
    instrument, and instrumenting the reference's PyTorch kernels as well costs minutes a
    case. Outputs are compared in the plain pass (same inputs, same kernel)."""
    import torch

    from tokenspeed_kernel.testing import moe_plan_for

    def to_device(value):
        if isinstance(value, torch.Tensor):
            return value.to(device)
        if isinstance(value, dict):
            return {k: to_device(v) for k, v in value.items()}
        if isinstance(value, tuple | list):
            return type(value)(to_device(v) for v in value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = dataclasses.fields(value)
            return dataclasses.replace(
                value, **{f.name: to_device(getattr(value, f.name)) for f in fields}
            )
        return value

    args, kwargs = to_device(case.build("cpu", seed=0))
    if case.op != "moe_apply":
        spec.fn(*args, **kwargs)
        return
    config, weights, x = args
    plan = moe_plan_for(spec, config, case.request.max_num_tokens, device)
    prepared = spec.fn.prepare_weights(plan, weights)
    out = torch.full(x.shape, float("nan"), dtype=x.dtype).to(device)
    spec.fn.apply(plan, x, prepared, out=out, **kwargs)


# ----------------------------------------------------------------------------- findings table

_CASE = re.compile(r"^case: (\S+) (\S+)")
_RUNS = re.compile(r"^runs: (\d+) kernel-case runs .*, (\d+) failed, (\d+) skipped")
_SUMMARY = re.compile(r"=+ (?:ERROR|RACECHECK) SUMMARY: (\d+) (?:errors|hazards)")
# A report's first line ("Invalid __global__ read of size 4 bytes", "Uninitialized __global__
# memory read ...", "Error: Race reported between ...") and its first source location.
_REPORT = re.compile(r"^=+ ((?:Invalid|Uninitialized|Error|Warning|Program hit|Race)\b.*)")
_WHERE = re.compile(r"^=+\s+at (\S+?)(?:\+0x[0-9a-f]+)? in (\S+)")


def summarize(logs: list[Path]) -> int:
    """Print one table row per (tool, finding, location, kernel case) over sanitizer logs named
    <tool>.log (or <tool>.<shard>.log, one per GPU), and the totals per log; exit status 1 if
    any log reports a finding or a comparison with the reference failed."""
    totals, findings = {}, collections.Counter()
    for log in logs:
        tool = log.stem.split(".")[0]
        case, pending, errors, runs, failed = "(startup)", None, 0, "?", 0  # ? = cut short
        for line in log.read_text(errors="replace").splitlines():
            if m := _CASE.match(line):
                case = f"{m[1]} {m[2]}"
            elif m := _RUNS.match(line):
                runs, failed = f"{m[1]} ran, {m[2]} failed, {m[3]} skipped", int(m[2])
            elif m := _SUMMARY.search(line):
                errors = max(errors, int(m[1]))
            elif m := _REPORT.match(line):
                pending = re.sub(r"0x[0-9a-f]+", "0x..", m[1].split(" at ")[0])[:60]
            elif pending and (m := _WHERE.match(line)):
                where = f"{Path(m[2]).name}"
                findings[(tool, pending, where, case)] += 1
                pending = None
        totals[log.stem] = (runs, errors, failed)
    print(f"{'log':<16} {'kernel-case runs':<34} {'errors':>7}")
    for name, (runs, errors, _) in totals.items():
        print(f"{name:<16} {runs:<34} {errors:>7}")
    if findings:
        print(f"\n{'tool':<10} {'n':>5}  {'finding':<60} {'at':<34} case")
        for (tool, what, where, case), n in sorted(findings.items()):
            print(f"{tool:<10} {n:>5}  {what:<60} {where:<34} {case}")
    # A log without its `runs:` line is a run cut short (a tool's timeout): not clean.
    clean = not findings and all(r != "?" and e == 0 and f == 0 for r, e, f in totals.values())
    print("\nno findings" if clean else "\nfindings above")
    return 0 if clean else 1


def shard(text: str) -> tuple[int, int]:
    """'K/N' -> (K, N) with 0 <= K < N."""
    k, _, n = text.partition("/")
    if not (k.isdigit() and n.isdigit() and 0 <= int(k) < int(n)):
        raise argparse.ArgumentTypeError(f"--shard {text!r}: expected K/N with 0 <= K < N")
    return int(k), int(n)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", action="append")
    parser.add_argument("--preset", help="add this model's real shapes (e.g. gpt-oss-120b)")
    parser.add_argument("--max-cases", type=int, default=0, help="per kernel; 0 = all")
    parser.add_argument("--budget-s", type=float, default=0, help="0 = no limit")
    parser.add_argument(
        "--kernel-only",
        action="store_true",
        help="run each kernel alone on copied inputs, without the reference (for initcheck)",
    )
    parser.add_argument("--shard", type=shard, default=(0, 1), metavar="K/N")
    parser.add_argument("--summarize", nargs="+", type=Path, metavar="LOG")
    args = parser.parse_args()
    if args.summarize:
        return summarize(args.summarize)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
