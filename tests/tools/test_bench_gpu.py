"""`bench` on a GPU: every timed kernel row carries latency, eager and graph figures; the
reference (which synchronizes) has no graph figure and says why; --cuda-graph still times decode
latency as graph replays. Sanity bounds only: eager includes the host, so it is at least the
graph replay's device time less the run-to-run spread."""

from __future__ import annotations

import json

import pytest
import torch

from tokenspeed_kernel.cli import main
from tokenspeed_kernel.tools.timing import Timer

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def needs_cuda(tmp_path, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def test_bench_rows_carry_eager_and_graph(tmp_path, capsys):
    rc = main(
        [
            "bench",
            "--preset",
            "tiny",
            "--op",
            "mha_decode_with_kvcache",
            "--kernels",
            "*",
            "--cuda-graph",
            "--no-plot",
            "--out",
            str(tmp_path),
            "--budget-ms",
            "50",
        ]
    )
    out = capsys.readouterr().out
    assert rc in (0, 1) and "eager us" in out and "graph us" in out  # 1: some other kernel broke
    rows = json.loads((tmp_path / "results.json").read_text())["results"]
    reference = [r for r in rows if r["kernel"].startswith("reference.")]
    kernels = [r for r in rows if r["kernel"].startswith("triton.")]
    assert reference and kernels
    for r in reference:
        assert r["status"] == "ok" and r["eager_us"] > 0 and r["graph_us"] is None
        assert "reference synchronizes: not captured" in r["note"]
    for r in kernels:
        assert r["status"] == "ok", r["note"]
        assert r["method"] == "cuda graph replay" and r["latency_us"] > 0
        assert r["graph_us"] is not None, r["note"]
        assert 0 < r["graph_us"] < 10 * r["eager_us"]


def test_graph_timer_per_replay_scales_with_work():
    device = torch.device("cuda")
    timer = Timer(device, warmup=2, iters=30, budget_s=0.2)
    x = torch.randn(4096, 4096, device=device)
    out = torch.empty_like(x)
    one = timer.graph(lambda: torch.mm(x, x, out=out)).median_s
    four = timer.graph(lambda: [torch.mm(x, x, out=out) for _ in range(4)]).median_s
    assert 2 * one < four < 8 * one
    assert timer.eager(lambda: torch.mm(x, x, out=out)).median_s > 0.5 * one
