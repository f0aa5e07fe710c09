"""Compile the AMD Gluon kernels ahead of time for gfx942/gfx950 (no GPU needed) and print JSON
rows: one per specialization and arch, with the ISA features it relies on and its resources.

    uv run python scripts/aot_check_amd.py --arch gfx942 --arch gfx950 [--only attention.decode]

Gluon kernels only compile as real JIT functions, so TRITON_INTERPRET is dropped before any
kernel module is imported. Exit status 1 if any specialization failed to compile or lacks an
instruction its design relies on (MFMA, buffer loads).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", action="append", choices=("gfx942", "gfx950"), required=True)
    parser.add_argument("--only", action="append", help="module of aot.AOT_MODULES to compile")
    args = parser.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)

    from tokenspeed_kernel_amd import aot

    modules = args.only or aot.AOT_MODULES
    rows = [
        aot.check(spec, arch) for arch in args.arch for spec in aot.specs(arch, modules=modules)
    ]
    print(json.dumps(rows, indent=1))
    return 0 if all(row["ok"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
