"""Build FlashInfer's CUTLASS fused-MoE module (behind `flashinfer.moe_apply.cutlass`) ahead of
time, once, on any machine with nvcc: no GPU is needed.

FlashInfer compiles the module with nvcc on first use: 182 units for sm_90a, more than 19
minutes on a 16-core GPU host, too long for a server's first request. Built here, the shared
library goes where FlashInfer (0.6.14 and 0.7.x) looks for prebuilt modules before it compiles,
`flashinfer/data/aot/<name>/<name>.so` inside the installed package, and the first call loads it.

    python -m tokenspeed_kernel_nvidia.flashinfer.prebuild [--jobs N] [--out DIR]
        [--include DIR ...] [--lib DIR ...]

The build runs FlashInfer's own JIT spec for the installed version (its sources, flags and
ninja file, under FlashInfer's JIT cache, so an interrupted build resumes where it stopped).
It needs the CUDA toolkit's headers for cuBLAS, NVRTC and cuRAND and, to link, libnvrtc and
libcuda (the driver's, or the toolkit's stub): an nvcc-only toolkit can take them from pip's
`nvidia-*-cu13` wheels through `--include` and `--lib` (a stub `libcuda.so` is enough to link;
the GPU host's driver provides the real one). `--out DIR` writes `DIR/<name>/<name>.so` instead
of installing, to copy into the package's `data/aot` on the serving machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

# The module is compiled for sm_90a whatever GPU is present (its flags name the arch); FlashInfer
# reads the arch list only to name its cache directory, and would probe a GPU without it.
ARCH_LIST = "9.0a"


def _append_env(name: str, flags: list[str]) -> None:
    if flags:
        os.environ[name] = " ".join([os.environ.get(name, ""), *flags]).strip()


def module_spec(include_dirs=(), lib_dirs=()):
    """FlashInfer's JIT spec of the sm_90 CUTLASS fused MoE, with extra header and library
    directories passed through FlashInfer's FLASHINFER_EXTRA_* flags (read at spec creation)."""
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", ARCH_LIST)
    includes = [f"-isystem {d}" for d in include_dirs]
    _append_env("FLASHINFER_EXTRA_CFLAGS", includes)
    _append_env("FLASHINFER_EXTRA_CUDAFLAGS", includes)
    _append_env("FLASHINFER_EXTRA_LDFLAGS", [f"-L{d}" for d in lib_dirs])
    from flashinfer.jit.fused_moe import gen_cutlass_fused_moe_sm90_module

    return gen_cutlass_fused_moe_sm90_module()


def aot_library_path(spec) -> Path:
    """Where FlashInfer loads a prebuilt module from instead of compiling it."""
    from flashinfer.jit import env as jit_env

    return jit_env.FLASHINFER_AOT_DIR / spec.name / f"{spec.name}.so"


def build(spec, jobs: int | None = None) -> Path:
    """Compile and link the module under FlashInfer's JIT cache; the library's path."""
    if jobs:
        os.environ["MAX_JOBS"] = str(jobs)
    spec.build(verbose=False)
    return Path(spec.jit_library_path)


def install(spec, library: Path, out: Path | None = None) -> Path:
    target = out / spec.name / f"{spec.name}.so" if out else aot_library_path(spec)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(library, target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tokenspeed_kernel_nvidia.flashinfer.prebuild", description=__doc__
    )
    parser.add_argument("--jobs", type=int, default=None, help="parallel nvcc jobs (MAX_JOBS)")
    parser.add_argument("--out", type=Path, default=None, help="write DIR/<name>/<name>.so")
    parser.add_argument("--include", type=Path, action="append", default=[], help="header dir")
    parser.add_argument("--lib", type=Path, action="append", default=[], help="library dir")
    args = parser.parse_args(argv)
    try:
        spec = module_spec(args.include, args.lib)
    except ImportError as exc:
        print(f"prebuild: FlashInfer is not importable ({exc}); "
              "pip install tokenspeed-kernel-nvidia[flashinfer]", file=sys.stderr)  # fmt: skip
        return 2
    print(f"prebuild: {spec.name}, {len(spec.sources)} sources, building in {spec.build_dir}")
    start = time.perf_counter()
    library = build(spec, args.jobs)
    target = install(spec, library, args.out)
    print(f"prebuild: built in {time.perf_counter() - start:.0f} s, installed {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
