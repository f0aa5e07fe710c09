"""Run every GPU kernel registered here once per conformance case, for compute-sanitizer.

    bash scripts/sanitize.sh [--op OP] [--preset gpt-oss-120b] [--max-cases N]

Each kernel that accepts this GPU runs the op's shared cases (odd sizes, one token, empty
sequences, page size 1, FP8 caches, ...) and, with --preset, a model's real shapes; outputs are
compared with the reference so a sanitizer-clean but wrong kernel still fails. Exit status 1 if
any comparison failed; the sanitizer's own exit code reports memory errors and races.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from tokenspeed_kernel.platform import platform_of
from tokenspeed_kernel.registry import kernels, op_names
from tokenspeed_kernel.testing import case_support, conformance_cases, run_case


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=op_names(), action="append")
    parser.add_argument("--preset", help="add this model's real shapes (e.g. gpt-oss-120b)")
    parser.add_argument("--max-cases", type=int, default=0, help="per kernel; 0 = all")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("sanitize_kernels: no GPU here; compute-sanitizer needs one")
        return 2
    device = torch.device("cuda", 0)
    platform = platform_of(device)
    failed = ran = 0
    for op in args.op or op_names():
        cases = conformance_cases(op, preset=args.preset)
        for spec in kernels(op):
            if spec.backend == "reference":
                continue
            runnable = [c for c in cases if case_support(spec, c, device).ok]
            for case in runnable[: args.max_cases or None]:
                start = time.perf_counter()
                result = run_case(spec, case, device)
                torch.cuda.synchronize()
                seconds = time.perf_counter() - start
                ran += 1
                failed += not result.ok
                status = "ok" if result.ok else f"FAILED {result}"
                print(f"{spec.name:<36} {case.name:<48} {seconds:6.2f}s {status}")
    print(f"{ran} kernel-case runs on {platform}, {failed} failed")
    return 1 if failed or not ran else 0


if __name__ == "__main__":
    sys.exit(main())
