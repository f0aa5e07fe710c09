"""The roofline of this device, measured once and cached per device name.

Copy bandwidth (bytes read + written by a device-to-device copy) and the dense matmul rate
(bf16 on a GPU, float32 on the CPU) are what this machine actually reaches, so "percent of
roofline" compares a kernel with the floor here rather than with a datasheet. Cached in
`$XDG_CACHE_HOME/tokenspeed-kernel/roofline.json` (default `~/.cache/...`).
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ._common import device_name


@dataclass(frozen=True)
class Roofline:
    device: str
    copy_bytes_per_s: float
    matmul_flops_per_s: float
    matmul_dtype: str
    measured: str
    source: str = "measured"  # "measured" now, or "cache"

    def percent(self, seconds: float, flops: float, nbytes: float) -> float | None:
        """The floor time of (flops, bytes) here as a percentage of the measured time."""
        if seconds <= 0 or (flops <= 0 and nbytes <= 0):
            return None
        floor = max(flops / self.matmul_flops_per_s, nbytes / self.copy_bytes_per_s)
        return 100.0 * floor / seconds


def cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "tokenspeed-kernel" / "roofline.json"


def roofline(device: torch.device, *, refresh: bool = False) -> Roofline:
    """This device's roofline, from the cache unless `refresh` or never measured."""
    name = device_name(device)
    path = cache_path()
    cached = {}
    if path.exists():
        try:
            cached = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            cached = {}
    if not refresh and name in cached:
        return Roofline(**{**cached[name], "source": "cache"})
    result = _measure(device, name)
    cached[name] = {k: v for k, v in asdict(result).items() if k != "source"}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cached, indent=2) + "\n", encoding="utf-8")
    except OSError:
        pass  # a read-only home only costs a re-measurement next time
    return result


def _median_seconds(fn, device: torch.device, runs: int) -> float:
    fn()
    times = []
    for _ in range(runs):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _copy_seconds(nbytes: int, device: torch.device, runs: int) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    return _median_seconds(lambda: dst.copy_(src), device, runs)


def _measure(device: torch.device, name: str) -> Roofline:
    gpu = device.type == "cuda"
    # Large enough to stream from DRAM (far beyond L2) and to saturate the tensor cores.
    copy_bytes = (1 << 30) if gpu else (64 << 20)
    n, dtype = (8192, torch.bfloat16) if gpu else (512, torch.float32)
    runs = 20 if gpu else 5
    copy_s = _copy_seconds(copy_bytes, device, runs)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    mm_s = _median_seconds(lambda: a @ b, device, runs)
    return Roofline(
        name,
        2.0 * copy_bytes / copy_s,
        2.0 * n**3 / mm_s,
        str(dtype).removeprefix("torch."),
        datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
