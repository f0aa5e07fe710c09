"""The rankings the nvidia package ships (rankings/<gpu>.json, measured with `tokenspeed-kernel
tune` on that GPU): they load, name only kernels this workspace registers, and on their GPU
every measured bucket selects its fastest kernel, or the next one where that kernel declines
(its library not installed)."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

import tokenspeed_kernel as tk
from tokenspeed_kernel import rankings, registry
from tokenspeed_kernel.ops.moe.request import MoERequest
from tokenspeed_kernel.platform import KNOWN_PLATFORMS
from tokenspeed_kernel_nvidia.registration import RANKINGS

FILES = sorted(RANKINGS.glob("*.json"))
REQUESTS = {
    "mha_prefill": tk.AttentionRequest,
    "mha_extend_with_kvcache": tk.AttentionRequest,
    "mha_decode_with_kvcache": tk.AttentionRequest,
    "kvcache_store": tk.KVStoreRequest,
    "moe_apply": MoERequest,
}


def _entries():
    for path in FILES:
        data = json.loads(path.read_text())
        for entry in data["rankings"]:
            yield pytest.param(data, entry, id=f"{path.stem}:{entry['op']}:{entry['label']}")


def _request(entry):
    """The request of a bucket, rebuilt from its key and sizes."""
    cls = REQUESTS[entry["op"]]
    fields = {}
    for part in entry["key"].split(";"):
        name, value = part.split("=")
        if value in ("true", "false"):
            fields[name] = value == "true"
        elif value.lstrip("-").isdigit():
            fields[name] = int(value)
        elif isinstance(getattr(torch, value, None), torch.dtype):
            fields[name] = getattr(torch, value)
        else:  # a format or routing name (MoE)
            fields[name] = value
    sizes = dict(entry["sizes"])
    if entry["op"] == "moe_apply":  # a plan's bucket is its max_num_tokens
        sizes = dict(max_num_tokens=sizes.pop("tokens"), **sizes)
    return cls(**fields, **sizes)


def test_the_package_ships_rankings_that_load():
    assert FILES, "no rankings file in tokenspeed_kernel_nvidia/rankings"
    registry.kernels("mha_prefill")  # loads the plugins, whose register() adds the files
    origins = {source.origin for source in rankings.sources()}
    for path in FILES:
        assert rankings.load(path).entries
        assert f"tokenspeed-kernel-nvidia rankings/{path.name}" in origins, origins


def _expected_order(data, entry, names):
    """`names` fastest first as the file ranks them for the bucket's request: by the entry's
    times, or for a MoE plan (which serves every batch up to its max_num_tokens) by each
    kernel's geometric mean over the entries of its key up to the bucket's tokens."""
    if entry["op"] != "moe_apply":
        return sorted(names, key=entry["times_us"].get)
    covered = [
        e["times_us"]
        for e in data["rankings"]
        if e["op"] == entry["op"]
        and e["key"] == entry["key"]
        and e["sizes"]["tokens"] <= entry["sizes"]["tokens"]
    ]
    names = [name for name in names if all(name in times for times in covered)]
    return sorted(names, key=lambda name: sum(math.log(t[name]) for t in covered))


@pytest.mark.parametrize("data,entry", list(_entries()))
def test_each_bucket_selects_its_fastest_then_the_next(data, entry):
    registered = {spec.name for spec in registry.kernels(entry["op"])}
    unknown = set(entry["times_us"]) - registered
    # The files rank our Triton kernels beside the libraries'. In the workspace every name is
    # registered; beside the nvidia wheel alone (no tokenspeed-kernel-triton) the Triton names
    # are not, and selection ranks the kernels that are.
    if importlib.util.find_spec("tokenspeed_kernel_triton") is not None:
        assert not unknown, unknown
    names = [name for name in entry["times_us"] if name in registered]
    if not names:
        pytest.skip(f"none of {sorted(unknown)} is registered here")
    (platform,) = [p for p in KNOWN_PLATFORMS.values() if p.name == data["platform"]["name"]]
    assert data["platform"]["arch"] == platform.arch
    request = _request(entry)
    by_time = _expected_order(data, entry, names)
    measured = rankings.lookup(entry["op"], request, platform, names)
    assert measured is not None and measured.order[0][0] == by_time[0], measured
    if len(by_time) > 1:  # the fastest declines (its library missing): the next measured
        measured = rankings.lookup(entry["op"], request, platform, by_time[1:])
        assert measured.order[0][0] == by_time[1], measured
