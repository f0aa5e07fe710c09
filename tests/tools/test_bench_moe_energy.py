"""benchmarks/energy.py, the energy cells and expert loads of bench_moe's side-by-side rows, on
the CPU."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch


@pytest.fixture(scope="module")
def bench(import_benchmark):
    return import_benchmark("bench_moe")


def test_energy_is_unmeasured_without_nvml_or_measured_with_it(bench):
    ran = []
    measured = bench.energy.per_call(lambda: ran.append(1), seconds=0.05, settle=0.0)
    if not torch.cuda.is_available():
        assert measured is None and not ran  # nothing captured, nothing run
    else:
        # An NVIDIA machine: a graph of nothing still draws the GPU's idle power.
        assert measured is None or (measured[0] >= 0 and measured[1] >= 0)


def _pair(bench, monkeypatch, energy, peer_layers):
    applied = []

    class Impl:
        def apply(self, plan, x, prepared, **kwargs):
            applied.append(prepared)

    monkeypatch.setattr(bench, "time_layers", lambda fn, layers: (fn(), 100.0)[1])
    monkeypatch.setattr(
        bench,
        "token_inputs",
        lambda m, skew: (torch.zeros(m, 4), torch.randn(m, 128), torch.zeros(m, 4)),
    )
    monkeypatch.setattr(bench.energy, "per_call", energy)
    plan = SimpleNamespace(impl=Impl(), config=bench.CONFIG)
    result = bench.time_pair(8, plan, ["layer"] * 4, peer_layers)
    return result, applied


def test_time_pair_reports_energy_per_layer_and_mean_power(bench, monkeypatch):
    peer_calls = []
    peer = [lambda x, logits, out: peer_calls.append(1)] * 4
    measured = []

    def per_call(fn):
        fn()  # one call of fn: every layer once
        measured.append(fn)
        return 40.0, 690.4

    (t_ours, t_peer, loads, cells), applied = _pair(bench, monkeypatch, per_call, peer)
    distinct, busiest, pairs = loads
    assert (t_ours, t_peer) == (100.0, 100.0) and 1 <= distinct <= 32
    assert 1 <= busiest <= 8 and pairs == 32
    # mJ per call of fn over its 4 layers, then the mean W.
    assert cells == ["10.0 (690)", "10.0 (690)"]
    assert len(measured) == 2 and peer_calls and applied


def test_time_pair_energy_cells_say_unmeasured(bench, monkeypatch):
    (_, t_peer, _, cells), _ = _pair(bench, monkeypatch, lambda fn: None, [])
    assert t_peer != t_peer and cells == ["-", "-"]  # no NVML; no peer
    (_, _, _, cells), _ = _pair(bench, monkeypatch, lambda fn: (8.0, 650.0), [])
    assert cells == ["2.0 (650)", "-"]


def test_expert_loads_count_the_local_experts_only(bench):
    """Loads of router logits, whole layer and rank 1 of EP=8 (experts 16..31): tokens 0-2
    pick experts 0-3, 16-19, 16-19 (their largest logits)."""
    logits = torch.zeros(3, 128)
    logits[0, 0:4] = 1.0
    logits[1:, 16:20] = 1.0
    assert bench.expert_loads(logits, bench.CONFIG) == (8, 2, 12)
    ep = dataclasses.replace(bench.CONFIG, expert_offset=16, num_local_experts=16)
    assert bench.expert_loads(logits, ep) == (4, 2, 8)


def test_side_by_side_rows_state_no_floor_where_no_pair_is_local(bench):
    """An EP=8 rank at M=1 often holds none of the token's experts: no floor, no ratio to it."""
    ep = dataclasses.replace(bench.CONFIG, num_local_experts=16)
    cells = ["1.0 (500)", "2.0 (400)"]
    row = bench.side_by_side_row(1, (0, 0, 0), ep, (5.0, 10.0), cells, 4e12, 7e14, "")
    assert row == [1, 0, 0, "-", "5.0", "10.0", "2.00", "-", "-", "-", "-", *cells]
    assert len(row) == len(bench.PEER_COLUMNS)
    # Local pairs: a floor, and % dense from M = 1024 over those pairs only.
    row = bench.side_by_side_row(
        1024, (16, 40, 512), ep, (200.0, float("nan")), cells, 4e12, 7e14, "n/a"
    )
    floor = 16 * bench.expert_bytes(2880) / 4e12 * 1e6
    flops = 512 * 2 * 3 * 2880 * 2880
    assert row[3] == f"{floor:.1f}" and row[5:7] == ["n/a", "-"]
    assert row[7:11] == [f"{200 / floor:.2f}", "-", f"{100 * flops / 200e-6 / 7e14:.0f}%", "-"]
