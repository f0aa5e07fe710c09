"""Energy per call of a CUDA-graph-replayed function, from NVML's total-energy counter
(millijoules since the driver loaded, read through ctypes: no package needed). Under sustained
load the H200 holds its power limit, where a layer's time is its energy over that power
(docs/decisions.md): the energy says which of two implementations does less work, on whichever
machine of a GPU kind they ran."""

from __future__ import annotations

import ctypes
import functools
import time

import torch


@functools.cache
def _nvml_device() -> tuple[ctypes.CDLL, ctypes.c_void_p] | None:
    """(NVML, the current CUDA device's handle), or None without an NVIDIA driver."""
    if torch.version.cuda is None or not torch.cuda.is_available():
        return None
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    # By UUID: NVML's device indices ignore CUDA_VISIBLE_DEVICES.
    uuid = torch.cuda.get_device_properties(torch.cuda.current_device()).uuid
    handle = ctypes.c_void_p()
    if nvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}".encode(), ctypes.byref(handle)) != 0:
        return None
    return nvml, handle


def _millijoules(nvml: ctypes.CDLL, handle: ctypes.c_void_p) -> int:
    value = ctypes.c_ulonglong()
    status = nvml.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(value))
    if status != 0:
        raise RuntimeError(f"nvmlDeviceGetTotalEnergyConsumption returned {status}")
    return value.value


def per_call(fn, seconds: float = 1.0, settle: float = 0.5) -> tuple[float, float] | None:
    """(mJ per call of fn, mean W) over its CUDA graph replayed back to back for about
    `seconds`, after `settle` seconds idle: the counter trails the load by a fraction of a
    second, so read right after other work it charges that work's last moments to this
    window. None where NVML is missing or does not count energy."""
    device = _nvml_device()
    if device is None:
        return None
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    calls = max(10, int(seconds / (time.perf_counter() - start)))
    time.sleep(settle)
    try:
        before = _millijoules(*device)
    except RuntimeError:
        return None
    start = time.perf_counter()
    for _ in range(calls):
        graph.replay()
    torch.cuda.synchronize()
    used = _millijoules(*device) - before
    return used / calls, used / 1e3 / (time.perf_counter() - start)
