"""benchmarks/bench_prefill.py on the CPU: the alternating CuTe / FA3 rounds (each round's
ratio, our median time), the table cell that reports them, and the --rounds check."""

from __future__ import annotations

import sys

import pytest


@pytest.fixture(scope="module")
def bench_prefill(import_benchmark):
    return import_benchmark("bench_prefill")


def test_rounds_alternate_and_keep_each_rounds_ratio(bench_prefill, monkeypatch):
    timed = []
    # peer, ours; peer, ours; ...: the ratios 2.0 / 1.0, 3.0 / 2.0, 2.2 / 2.0.
    times = iter([2.0, 1.0, 3.0, 2.0, 2.2, 2.0])

    def fake_bench(fn):
        timed.append(fn.__name__)
        return next(times)

    def peer():
        pass

    def ours():
        pass

    monkeypatch.setattr(bench_prefill, "bench", fake_bench)
    ours_ms, ratios = bench_prefill.paired(peer, ours, 3)
    assert timed == ["peer", "ours"] * 3
    assert ratios == pytest.approx([2.0, 1.5, 1.1])
    assert ours_ms == 2.0  # the median of 1.0, 2.0, 2.0


def test_the_cute_cell_gives_the_median_ratio_and_its_range(bench_prefill):
    row = dict(
        case="prefill causal S=8192x2", config="heuristic", ms=2.5, tflops=440.0, fa3_ms=2.3,
        fa3_tflops=470.0, err_vs_ref=2e-3, fa3_err_vs_ref=2e-3, cute_ms=2.2,
        cute_err_vs_ref=2e-3, fa3_over_cute=[1.05, 0.92, 1.07, 1.06, 1.04],
    )  # fmt: skip
    cells = bench_prefill._cells(row)
    assert cells[7:9] == ["2.200", "1.050 (0.920-1.070, 5 rounds)"]
    # Without FA3 (not importable) the time stands alone.
    alone = bench_prefill._cells(dict(row, fa3_ms=None, fa3_over_cute=None))
    assert alone[7:9] == ["2.200", ""]


def test_rounds_below_one_are_refused(bench_prefill, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_prefill.py", "--rounds", "0"])
    with pytest.raises(SystemExit):
        bench_prefill.main()
    assert "at least one round" in capsys.readouterr().err
