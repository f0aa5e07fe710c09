"""`tune` on the GPU machine: the Triton kernels timed as CUDA-graph replays, and selection
following the file it wrote (CPU coverage with fake kernels: tests/core/test_rankings.py)."""

from __future__ import annotations

import json

import pytest
import torch

from tokenspeed_kernel import rankings, registry, selector
from tokenspeed_kernel.platform import platform_of
from tokenspeed_kernel.tools import tune
from tokenspeed_kernel.tools.timing import Timer
from tokenspeed_kernel.tools.workloads import bench_points

OPS = ("mha_decode_with_kvcache", "kvcache_store")


@pytest.mark.gpu
def test_tune_round_trip_on_gpu(tmp_path):
    device = torch.device("cuda", torch.cuda.current_device())
    platform = platform_of(device)
    timer = Timer(device, warmup=2, iters=10, budget_s=0.05)
    records = tune.measure(tune.preset_points(OPS, "tiny"), device, timer)
    assert all(r["median_us"] for r in records), [r for r in records if not r["median_us"]]
    methods = {r["method"] for r in records if r["kernel"].startswith("triton.")}
    assert methods == {"cuda graph replay"}, methods
    payload = tune.rankings_payload(platform, records, {"command": "test"})
    measured = {
        (e["op"], e["key"], tuple(sorted(e["sizes"].items()))): e for e in payload["rankings"]
    }
    # Claim the reference kernel is the fastest everywhere: selection must follow the file
    # even where priorities say otherwise.
    for entry in payload["rankings"]:
        entry["times_us"][f"reference.{entry['op']}"] = 1e-3
    path = tmp_path / "rankings.json"
    path.write_text(json.dumps(payload))
    source = registry.add_rankings(path)
    try:
        for op in OPS:
            for point in bench_points(op, "tiny"):
                request = tune.bucketed_request(point.case)
                sizes = tuple(sorted(tune._sizes(point.case, request).items()))
                assert (op, rankings.request_key(request), sizes) in measured, point.label
                assert selector.select(op, request, platform).name == f"reference.{op}"
    finally:
        rankings.remove(source)
    by_priority = next(s for s in registry.kernels(op) if s.supports(request, platform).ok)
    assert selector.select(op, request, platform) is by_priority  # the file removed
