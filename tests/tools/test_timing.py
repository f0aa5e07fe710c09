"""The eager (host-inclusive) timer on the CPU: it reports wall clock per call, amortizes the one
synchronize per repeat over the calls, and takes fewer calls for a slow function. Graph timing
needs a GPU and says so."""

from __future__ import annotations

import time

import pytest
import torch

from tokenspeed_kernel.tools.timing import Timer, eager_per_call


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float):
        self.now += seconds


def test_eager_reports_time_per_call():
    clock = FakeClock()
    calls = []

    def fn():
        calls.append(1)
        clock.advance(2e-3)

    timing = eager_per_call(fn, budget_s=0.1, clock=clock)
    assert timing.median_s == pytest.approx(2e-3)
    assert timing.method == "eager"
    # 5 repeats of 0.1 s / (5 x 2 ms) = 10 calls, plus the one warm-up call.
    assert timing.runs == 50 and len(calls) == 51 and timing.note == "10 calls x 5"


def test_eager_amortizes_the_synchronize_over_the_calls():
    clock = FakeClock()

    def fn():
        clock.advance(1e-3)

    syncs = []

    def sync():
        syncs.append(1)
        clock.advance(5e-3)  # a device still busy: paid once per repeat, not per call

    timing = eager_per_call(fn, budget_s=1.0, sync=sync, clock=clock, max_calls=50)
    # Warm-up: 1 ms + 5 ms of sync = 6 ms, so 5 repeats of min(50, 1 s / 30 ms) = 33 calls.
    assert timing.note == "33 calls x 5"
    assert timing.median_s == pytest.approx(1e-3 + 5e-3 / 33)
    assert len(syncs) == 2 + 2 * 5


def test_eager_takes_few_calls_of_a_slow_function():
    clock = FakeClock()
    timing = eager_per_call(lambda: clock.advance(1.0), budget_s=0.01, clock=clock)
    assert timing.note == "1 calls x 3" and timing.median_s == pytest.approx(1.0)


def test_eager_on_a_sleeping_function_measures_its_sleep():
    timing = Timer(torch.device("cpu"), warmup=1, iters=3, budget_s=0.2).eager(
        lambda: time.sleep(2e-3)
    )
    assert 1.5e-3 <= timing.median_s < 0.1
    assert timing.low_s <= timing.median_s <= timing.high_s


def test_graph_timing_needs_a_gpu():
    timer = Timer(torch.device("cpu"), warmup=1, iters=3, budget_s=0.01)
    with pytest.raises(ValueError, match="graph timing needs a CUDA device, got cpu"):
        timer.graph(lambda: None)
