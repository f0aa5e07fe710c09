"""Compile the Triton kernels ahead of time for GPUs this machine lacks and print JSON rows.

    uv run python scripts/aot_check.py --package triton --target sm_90 [--target gfx942 ...]

Triton only compiles real @triton.jit functions, so TRITON_INTERPRET is dropped before any
kernel module is imported. Exit status 1 if any specialization failed to compile.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

PACKAGES = {"triton": "tokenspeed_kernel_triton.aot"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", choices=sorted(PACKAGES), default="triton")
    parser.add_argument(
        "--target", action="append", choices=("sm_90", "gfx942", "gfx950"), required=True
    )
    args = parser.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)

    import importlib

    aot = importlib.import_module(PACKAGES[args.package])
    rows = [row for target in args.target for row in aot.check_target(target)]
    print(json.dumps(rows, indent=1))
    return 0 if all(row["ok"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
