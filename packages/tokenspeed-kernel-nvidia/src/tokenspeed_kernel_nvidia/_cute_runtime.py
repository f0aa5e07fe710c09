"""What this package's CuTe DSL kernels share: finding the DSL, compiling a kernel to a cubin
for an arch, and loading and launching that cubin on torch's current stream.

The DSL (`nvidia-cutlass-dsl`, the `[cute]` extra) serves as the compiler only. `cute.compile`
needs no GPU: it turns a kernel into a cubin for any arch, on any machine. We load the cubin
with the CUDA driver (`cuda-bindings`, which torch's CUDA wheels already depend on) and launch
it ourselves, so one launch path serves both ways a cubin can arrive:

- JIT: the DSL is installed; a specialization compiles on first use (about 0.5 s on a CPU
  core), then comes from memory, or from the disk cache after a restart.
- AOT: cubins built elsewhere (`python -m tokenspeed_kernel_nvidia._cute_runtime build`, on a
  machine without a GPU) are found in the directory `TOKENSPEED_KERNEL_CUTE_CUBINS` names; no DSL
  is needed at run time.

A cubin's file name carries a hash of the kernel module's source, so a cubin built from other
sources is never loaded: it is simply not found.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

EXTRA = "tokenspeed-kernel-nvidia[cute]"
DSL_DISTRIBUTION = "nvidia-cutlass-dsl"
CUBIN_DIR_ENV = "TOKENSPEED_KERNEL_CUTE_CUBINS"
# The archs this package compiles for: Hopper and datacenter Blackwell, each with its
# arch-specific ("a") instruction set.
COMPILE_ARCHS = {"sm_90": "sm_90a", "sm_100": "sm_100a"}


@functools.cache
def dsl_version() -> str | None:
    """The installed CuTe DSL's version, or None. Reads package metadata and finds (does not
    import) `cutlass`: importing the DSL costs about 3 s, paid on the first compile, never at
    registration or selection."""
    try:
        version = importlib.metadata.version(DSL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    return version if importlib.util.find_spec("cutlass") is not None else None


def compile_arch(arch: str) -> str | None:
    """The cubin target for a platform arch (`sm_90` -> `sm_90a`), None where we build none."""
    return COMPILE_ARCHS.get(arch)


def source_hash(module_name: str) -> str:
    """12 hex digits of the module's source: part of every cubin's file name."""
    return _source_hash(sys.modules[module_name].__file__)


@functools.cache
def _source_hash(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "tokenspeed_kernel" / "cute"


def search_dirs() -> list[Path]:
    """Where cubins are looked for: the AOT directory first, then the JIT disk cache."""
    aot = os.environ.get(CUBIN_DIR_ENV)
    return ([Path(aot)] if aot else []) + [cache_dir()]


@dataclass(frozen=True)
class Cubin:
    """A compiled kernel: its image and the entry symbol to launch."""

    image: bytes
    symbol: str


@dataclass(frozen=True)
class Build:
    """One specialization of a kernel: `compile_fn(arch)` returns its Cubin (needs the DSL);
    `key` names it (dtypes and constexprs) and `module` is the kernel module it comes from."""

    module: str
    key: str
    compile_fn: Callable[[str], Cubin]

    def file_stem(self, arch: str) -> str:
        return f"{self.key}-{source_hash(self.module)}.{arch}"


def find_cubin(build: Build, arch: str) -> Cubin | None:
    stem = build.file_stem(arch)
    for directory in search_dirs():
        image, meta = directory / f"{stem}.cubin", directory / f"{stem}.json"
        if image.is_file() and meta.is_file():
            return Cubin(image.read_bytes(), json.loads(meta.read_text())["symbol"])
    return None


def write_cubin(directory: Path, build: Build, arch: str, cubin: Cubin) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    stem = build.file_stem(arch)
    meta = dict(symbol=cubin.symbol, key=build.key, arch=arch, dsl=dsl_version())
    # Write-then-rename, so a concurrent reader never sees half a file.
    for suffix, data in ((".cubin", cubin.image), (".json", json.dumps(meta).encode())):
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=suffix)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, directory / f"{stem}{suffix}")


def available(build: Build, arch: str) -> bool:
    """Whether `build` can run on `arch` here: the DSL can compile it, or a cubin exists."""
    return dsl_version() is not None or find_cubin(build, arch) is not None


def missing_reason(build: Build, arch: str) -> str:
    where = os.environ.get(CUBIN_DIR_ENV)
    aot = f", and {CUBIN_DIR_ENV}={where} holds no {build.file_stem(arch)}.cubin" if where else ""
    return f"the CuTe DSL is not installed (pip install '{EXTRA}'){aot}"


def compile_cubin(jit_fn: Any, args: Sequence[Any], arch: str) -> Cubin:
    """`cute.compile` the host function `jit_fn` (which launches exactly one kernel) for
    `arch` and return that kernel's cubin. No GPU is needed."""
    import cutlass.cute as cute
    from cutlass.base_dsl.compiler import DumpDir, GPUArch, KeepCUBIN

    with tempfile.TemporaryDirectory(prefix="tokenspeed-cute-") as dump:
        compiled = cute.compile[GPUArch(arch), KeepCUBIN, DumpDir(dump)](jit_fn, *args)
        image = compiled.artifacts.CUBIN
        if isinstance(image, str):
            image = Path(image).read_bytes()
    symbols = list(compiled.kernel_info)
    if len(symbols) != 1 or not isinstance(image, bytes):
        raise RuntimeError(f"cute.compile of {jit_fn.__name__} gave kernels {symbols}, not one")
    return Cubin(image, symbols[0])


def cubin_for(build: Build, arch: str) -> Cubin:
    """The cubin of `build` for `arch`: from the AOT directory or the disk cache, else
    compiled now (and written to the disk cache for the next process)."""
    cubin = find_cubin(build, arch)
    if cubin is not None:
        return cubin
    if dsl_version() is None:
        raise RuntimeError(f"{build.key} for {arch}: {missing_reason(build, arch)}")
    cubin = build.compile_fn(arch)
    try:
        write_cubin(cache_dir(), build, arch, cubin)
    except OSError as exc:
        logger.info("CuTe cubin cache not written (%s); compiling again next process", exc)
    return cubin


# ---- loading and launching ----------------------------------------------------------------


def _check(result: Any, what: str) -> Any:
    from cuda.bindings import driver

    err, *values = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, text = driver.cuGetErrorString(err)
        detail = text.decode() if isinstance(text, bytes) else str(err)
        raise RuntimeError(f"{what} failed: {detail}")
    return values[0] if len(values) == 1 else values


class LoadedKernel:
    """A cubin loaded context-independently (cuLibraryLoadData), launched with
    cuLaunchKernel on torch's current stream of the tensors' device (so CUDA graph capture
    records it like any torch launch)."""

    def __init__(self, cubin: Cubin, param_types: Sequence[type], *, shared_bytes: int = 0):
        from cuda.bindings import driver

        torch.cuda.init()
        self._library = _check(
            driver.cuLibraryLoadData(cubin.image, None, None, 0, None, None, 0),
            "cuLibraryLoadData",
        )
        self._kernel = _check(
            driver.cuLibraryGetKernel(self._library, cubin.symbol.encode()), "cuLibraryGetKernel"
        )
        self._functions: dict[int, Any] = {}  # device index -> the kernel in its context
        self._types = tuple(param_types)
        self._shared = shared_bytes
        self.symbol = cubin.symbol

    def launch(self, device: torch.device, grid: int, block: int, args: Sequence[Any]) -> None:
        self.launch_grid(device, (grid, 1, 1), block, args)

    def launch_grid(
        self, device: torch.device, grid: tuple[int, int, int], block: int, args: Sequence[Any]
    ) -> None:
        from cuda.bindings import driver

        if len(args) != len(self._types):
            raise TypeError(f"{self.symbol}: {len(args)} arguments, expected {len(self._types)}")
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = torch.cuda.current_stream(device).cuda_stream
        pushed = _make_current(index)
        try:
            function = self._functions.get(index)
            if function is None:
                function = _check(driver.cuKernelGetFunction(self._kernel), "cuKernelGetFunction")
                if self._shared > 48 * 1024:
                    # Past 48 KB a kernel must opt in to its dynamic shared memory.
                    attribute = (
                        driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                    )
                    _check(
                        driver.cuFuncSetAttribute(function, attribute, self._shared),
                        "cuFuncSetAttribute",
                    )
                self._functions[index] = function
            params = (tuple(args), self._types)
            _check(
                driver.cuLaunchKernel(
                    function, *grid, block, 1, 1, self._shared, driver.CUstream(stream), params, 0
                ),
                f"cuLaunchKernel({self.symbol})",
            )
        finally:
            if pushed:
                _check(driver.cuCtxPopCurrent(), "cuCtxPopCurrent")


_contexts: dict[int, Any] = {}
_context_lock = threading.Lock()


def _primary_context(index: int) -> Any:
    from cuda.bindings import driver

    with _context_lock:
        if index not in _contexts:
            device = _check(driver.cuDeviceGet(index), "cuDeviceGet")
            _contexts[index] = _check(
                driver.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain"
            )
        return _contexts[index]


def _make_current(index: int) -> bool:
    """Make device `index`'s primary context (torch's) current for a driver-API launch;
    returns whether one was pushed (and must be popped). Usually it is current already: torch
    made it so on this thread."""
    from cuda.bindings import driver

    wanted = _primary_context(index)
    current = _check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if int(current) == int(wanted):
        return False
    _check(driver.cuCtxPushCurrent(wanted), "cuCtxPushCurrent")
    return True


# ctypes types of kernel parameters, as the DSL lays them out (.param .u64 / .u32 / .f32);
# c_int, c_longlong and c_float are the ones cuda-bindings packs without a ctypes object.
POINTER = ctypes.c_void_p
INT32 = ctypes.c_int
INT64 = ctypes.c_longlong
FLOAT32 = ctypes.c_float


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m tokenspeed_kernel_nvidia._cute_runtime build --arch sm_90a --out DIR`:
    compile every kernel module's AOT builds (its `cute_builds()`) into DIR (no GPU needed)."""
    parser = argparse.ArgumentParser(prog="python -m tokenspeed_kernel_nvidia._cute_runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="compile the CuTe DSL kernels' cubins ahead of time")
    build.add_argument("--arch", default="sm_90a", choices=sorted(COMPILE_ARCHS.values()))
    build.add_argument("--out", type=Path, required=True)
    build.add_argument(
        "--modules", nargs="*", default=["cute_kvcache_store", "cute_decode", "cute_prefill"]
    )
    args = parser.parse_args(argv)
    if dsl_version() is None:
        print(f"build: the CuTe DSL is not installed (pip install '{EXTRA}')", file=sys.stderr)
        return 2
    count = 0
    for name in args.modules:
        module = importlib.import_module(f"{__package__}.{name}")
        for item in module.cute_builds():
            write_cubin(args.out, item, args.arch, item.compile_fn(args.arch))
            print(f"{item.file_stem(args.arch)}.cubin")
            count += 1
    print(f"build: {count} cubins for {args.arch} in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
