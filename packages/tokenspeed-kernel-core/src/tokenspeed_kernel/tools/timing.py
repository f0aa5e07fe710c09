"""Timing one call: warm-up, then the median of many timed runs.

On a GPU every run is timed with its own pair of device events, and the L2 cache is flushed (a
buffer twice its size is overwritten) between runs, outside the events, so a run never measures
inputs left in the cache by the previous one. A call can instead be captured once in a CUDA graph
and each replay timed (decode: what a serving engine does). On the CPU there are no device
events: runs are timed with the wall clock, which the results say.

Two more figures show what a caller pays beyond the device time. `eager` is host-inclusive:
a few repeats of N back-to-back calls with one synchronize at the end, wall clock per call, the
median repeat (what an engine pays running the call eagerly; the same method on the CPU).
`graph` captures the call once in a CUDA graph and times back-to-back replays between two
device events, per replay (what a graph-captured decode step pays; GPU only). Neither flushes
the L2 between calls, as neither an engine's eager loop nor its graph replays do.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..platform import platform_of

_DEFAULT_L2 = 256 << 20  # when the device does not report its L2 size


@dataclass(frozen=True)
class Timing:
    median_s: float
    runs: int
    method: str  # "cuda events" | "cuda graph replay" | "wall clock" | "eager" | "graph"
    note: str = ""
    # The 10th and 90th percentile run: how far one run strays from the median.
    low_s: float | None = None
    high_s: float | None = None


class Timer:
    """warmup calls, then up to `iters` timed runs, fewer when one run is slow: as many as fit
    in `budget_s`, but at least `min_iters` (or `iters` if that is smaller)."""

    def __init__(
        self,
        device: torch.device,
        *,
        warmup: int,
        iters: int,
        budget_s: float,
        min_iters: int = 3,
        flush_l2: bool = True,
    ):
        self.device = device
        self.warmup, self.iters, self.budget_s, self.min_iters = warmup, iters, budget_s, min_iters
        self._flush = None
        if device.type == "cuda" and flush_l2:
            l2 = platform_of(device).l2_bytes or _DEFAULT_L2
            self._flush = torch.empty(2 * l2, dtype=torch.int8, device=device)

    @property
    def method(self) -> str:
        return "cuda events" if self.device.type == "cuda" else "wall clock"

    def measure(self, fn: Callable[[], object], *, graph: bool = False) -> Timing:
        if self.device.type != "cuda":
            return self._wall(fn)
        note = ""
        if graph:
            try:
                fn = capture_graph(fn, self.device)
            except Exception as exc:  # e.g. a kernel that synchronizes cannot be captured
                torch.cuda.synchronize(self.device)
                note = f"graph capture failed ({type(exc).__name__}), timed eagerly"
                graph = False
        timing = self._events(fn)
        method = "cuda graph replay" if graph else "cuda events"
        return Timing(timing.median_s, timing.runs, method, note, timing.low_s, timing.high_s)

    def eager(self, fn: Callable[[], object]) -> Timing:
        """Host-inclusive wall clock per call (module docstring): about `iters` calls in all (5
        repeats of iters / 5), fewer where they would take over a quarter of the budget."""
        sync = (lambda: torch.cuda.synchronize(self.device)) if self.device.type == "cuda" else None
        return eager_per_call(
            fn, budget_s=self.budget_s / 4, sync=sync, max_calls=max(1, self.iters // 5)
        )

    def graph(self, fn: Callable[[], object]) -> Timing:
        """Device time per back-to-back replay of `fn` captured once in a CUDA graph, within a
        quarter of the budget. Raises ValueError off a GPU; a failed capture raises its error."""
        if self.device.type != "cuda":
            raise ValueError(f"graph timing needs a CUDA device, got {self.device}")
        try:
            replay = capture_graph(fn, self.device)
        except Exception:
            torch.cuda.synchronize(self.device)
            raise
        return _replays(replay, self.device, self.budget_s / 4, max(1, self.iters // 3))

    def _count(self, fn, clock) -> int:
        """Warm up; return how many runs fit the budget."""
        start = clock()
        fn()
        first = max(clock() - start, 1e-9)
        for _ in range(max(self.warmup - 1, 0)):
            fn()
        return max(min(self.min_iters, self.iters), min(self.iters, int(self.budget_s / first)))

    def _wall(self, fn) -> Timing:
        runs = self._count(fn, time.perf_counter)
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return Timing(statistics.median(times), runs, "wall clock", "", *_spread(times))

    def _events(self, fn) -> Timing:
        def clock():
            torch.cuda.synchronize(self.device)
            return time.perf_counter()

        runs = self._count(fn, clock)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
        for start, end in zip(starts, ends, strict=True):
            if self._flush is not None:
                self._flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(self.device)
        times = [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends, strict=True)]
        return Timing(statistics.median(times), runs, "cuda events", "", *_spread(times))


def eager_per_call(
    fn: Callable[[], object],
    *,
    budget_s: float,
    sync: Callable[[], object] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    max_calls: int = 100,
) -> Timing:
    """`fn` called back to back, `sync` once after each repeat: the median repeat's wall clock
    per call. Calls per repeat (1 to `max_calls`) and repeats (3 to 5) shrink to fit `budget_s`
    from the cost of one synchronized warm-up call, so a slow kernel gets few calls."""
    sync = sync or (lambda: None)
    sync()
    start = clock()
    fn()
    sync()
    first = max(clock() - start, 1e-9)
    repeats = max(3, min(5, int(budget_s / first)))
    calls = max(1, min(max_calls, int(budget_s / (repeats * first))))
    samples = []
    for _ in range(repeats):
        sync()
        start = clock()
        for _ in range(calls):
            fn()
        sync()
        samples.append((clock() - start) / calls)
    note = f"{calls} calls x {repeats}"
    return Timing(statistics.median(samples), calls * repeats, "eager", note, *_spread(samples))


def _replays(replay: Callable[[], None], device, budget_s: float, max_count: int) -> Timing:
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    replay()
    torch.cuda.synchronize(device)
    first = max(time.perf_counter() - start, 1e-9)
    repeats = 3
    count = max(1, min(max_count, int(budget_s / (repeats * first))))
    samples = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(count):
            replay()
        end.record()
        torch.cuda.synchronize(device)
        samples.append(begin.elapsed_time(end) / 1e3 / count)
    note = f"{count} replays x {repeats}"
    return Timing(statistics.median(samples), count * repeats, "graph", note, *_spread(samples))


def _spread(times: list[float]) -> tuple[float, float]:
    """(10th, 90th) percentile of the runs (nearest rank)."""
    ordered = sorted(times)
    last = len(ordered) - 1
    return ordered[round(0.1 * last)], ordered[round(0.9 * last)]


def capture_graph(fn, device) -> Callable[[], None]:
    """One call of `fn` captured in a CUDA graph on `device`; returns the graph's replay."""
    # Warm up on a side stream first (lazy initialisation and autotuning must not be captured).
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay
