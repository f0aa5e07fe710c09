"""Selection by measurement: rankings files, their validation, and `tokenspeed-kernel tune`.

Fake kernels (a slow one at high priority, a fast one at low priority) make every test one
that fails when the rankings are ignored: priorities alone pick the slow kernel."""

from __future__ import annotations

import contextvars
import json
import logging
import os
import threading
import time

import pytest
import torch

import tokenspeed_kernel as tk
from tokenspeed_kernel import cli, rankings, registry, selector
from tokenspeed_kernel.ops.attention.request import size_bucket
from tokenspeed_kernel.platform import KNOWN_PLATFORMS, platform_of
from tokenspeed_kernel.presets import get_preset
from tokenspeed_kernel.tools import tune
from tokenspeed_kernel.tools.timing import Timer

OP = "mha_decode_with_kvcache"
SLOW, FAST = "tunetest.decode.slow", "tunetest.decode.fast"
TRAITS = {
    "dtype": tk.ANY,
    "kv_dtype": tk.ANY,
    "head_dim": tk.ANY,
    "gqa_ratio": tk.ANY,
    "page_size": tk.ANY,
    "q_len": tk.ANY,
    "window": True,
    "sinks": True,
}
CPU = platform_of(torch.device("cpu"))


@pytest.fixture
def fakes(monkeypatch):
    """SLOW (priority 99, sleeps 2 ms) and FAST (priority 1) for decode, recording each call;
    no rankings from the environment; everything registered or added is removed after."""
    monkeypatch.delenv(rankings.RANKINGS_ENV, raising=False)
    rankings.reload()
    calls: list[str] = []

    def kernel(name, delay):
        def run(*args, **kwargs):
            calls.append(name)
            if delay:
                time.sleep(delay)

        return run

    names_before = registry.registered_names()
    sources_before = list(rankings._registered)
    for name, priority, delay in ((SLOW, 99, 0.002), (FAST, 1, 0.0)):
        tk.register_kernel(
            OP, name=name, backend="tunetest", platforms=["*"], traits=TRAITS, priority=priority
        )(kernel(name, delay))
    yield calls
    for source in [s for s in rankings._registered if s not in sources_before]:
        rankings.remove(source)
    for name in registry.registered_names() - names_before:
        registry.unregister_kernel(name)
    monkeypatch.delenv(rankings.RANKINGS_ENV, raising=False)
    rankings.reload()


def _decode(batch: int):
    """A GPT-OSS-shaped decode call (heads 8/1, hd 64) on CPU tensors; returns its request."""
    q = torch.randn(batch, 8, 64, dtype=torch.bfloat16)
    cache = torch.randn(4, 16, 1, 64, dtype=torch.bfloat16)
    table = torch.zeros(batch, 2, dtype=torch.int32)
    lens = torch.full((batch,), 5, dtype=torch.int32)
    tk.mha_decode_with_kvcache(q, cache, cache, page_table=table, cache_seqlens=lens)
    return tk.AttentionRequest(
        torch.bfloat16, torch.bfloat16, 64, 8, 1, 16, 1, tokens=size_bucket(batch)
    )


def _file(entries, *, platform=None):
    return {
        "format": rankings.FORMAT,
        "version": rankings.VERSION,
        "platform": platform or {"vendor": CPU.vendor, "arch": CPU.arch, "name": CPU.name},
        "rankings": entries,
    }


def _entry(request, times, **sizes):
    return {"op": OP, "key": rankings.request_key(request), "sizes": sizes, "times_us": times}


def test_tune_then_select_round_trip(fakes, tmp_path):
    """Tune measures both fakes on the tiny preset's decode points; selecting from the file
    it writes picks the fast kernel that priorities would not."""
    request = _decode(4)
    assert fakes[-1] == SLOW  # priorities alone
    timer = Timer(torch.device("cpu"), warmup=1, iters=3, budget_s=0.05)
    records = tune.measure(
        tune.preset_points((OP,), "tiny"), torch.device("cpu"), timer, kernel_glob="tunetest.*"
    )
    assert {r["kernel"] for r in records} == {SLOW, FAST}
    payload = tune.rankings_payload(CPU, records, {"command": "test"})
    path = tmp_path / "rankings.json"
    path.write_text(json.dumps(payload))
    assert all(next(iter(e["times_us"])) == FAST for e in payload["rankings"])
    registry.add_rankings(path)
    # The tiny preset's request (heads, sizes) is not this call's: the points must cover it.
    tiny = get_preset("tiny")
    point = tiny.attention_request(OP)._replace(tokens=4)
    assert selector.select(OP, point, CPU).name == FAST
    explanation = tk.explain(OP, point, CPU)
    assert explanation.selected == FAST
    assert f"measured fastest on {CPU.name} for tokens <= 4" in str(explanation)
    assert str(path) in str(explanation)
    assert selector.select(OP, request, CPU).name == SLOW  # other heads: no ranking covers it


def test_selection_follows_the_bucket_of_each_call(fakes):
    """Entries at B=1 (SLOW measured faster) and B=64 (FAST faster): each call picks by its
    batch, nearest bucket on the log2 scale, ties to the larger."""
    base = _decode(1)
    registry.add_rankings(
        _file([
            _entry(base, {SLOW: 5.0, FAST: 9.0}, tokens=1),
            _entry(base, {SLOW: 50.0, FAST: 20.0}, tokens=64),
        ])
    )  # fmt: skip
    for batch, expected in ((1, SLOW), (2, SLOW), (8, FAST), (40, FAST), (64, FAST)):
        fakes.clear()
        _decode(batch)
        assert fakes == [expected], batch
    assert "nearest measured to tokens <= 2" in str(tk.explain(OP, base._replace(tokens=2), CPU))


def test_cached_selection_changes_when_rankings_are_added(fakes):
    request = _decode(4)
    assert selector.select(OP, request, CPU).name == SLOW
    registry.add_rankings(_file([_entry(request, {SLOW: 30.0, FAST: 10.0}, tokens=4)]))
    assert selector.select(OP, request, CPU).name == FAST
    fakes.clear()
    _decode(4)
    assert fakes == [FAST]


def test_explain_states_figures_and_file(fakes):
    request = _decode(4)
    registry.add_rankings(
        _file([_entry(request, {SLOW: 15.0, FAST: 12.3}, tokens=4)]), origin="vendor.json"
    )
    text = str(tk.explain(OP, request, CPU))
    assert (
        f"why: measured fastest on {CPU.name} for tokens <= 4: {FAST} 12.3 us vs {SLOW} 15.0 us "
        "(vendor.json)"
    ) in text
    plain = str(tk.explain(OP, request._replace(head_dim=128), CPU))
    assert "why: highest priority (no measured ranking covers this request)" in plain


def test_unmeasured_and_unsupported_kernels(fakes, caplog):
    """A kernel the file names but nobody registered is ignored with a warning; a measured
    kernel that declines the request is never chosen; unmeasured kernels come after."""
    request = _decode(4)
    entry = _entry(request, {"gone.decode": 1.0, FAST: 10.0, SLOW: 20.0}, tokens=4)
    registry.add_rankings(_file([entry]), origin="stale.json")
    with caplog.at_level(logging.WARNING, logger="tokenspeed_kernel.rankings"):
        assert selector.select(OP, request, CPU).name == FAST
    assert "stale.json: kernel gone.decode is not registered here" in caplog.text
    with tk.use_kernel(OP, SLOW):  # an override still wins over a ranking
        assert selector.select(OP, request, CPU).name == SLOW
    tk.register_kernel(
        OP, name="tunetest.decode.new", backend="tunetest", platforms=["*"], traits=TRAITS,
        priority=500,
    )(lambda *a, **k: None)  # fmt: skip
    assert selector.select(OP, request, CPU).name == FAST  # measured beats unmeasured
    fp8_only = {**TRAITS, "kv_dtype": {torch.float8_e4m3fn}}
    tk.register_kernel(
        OP, name="tunetest.decode.fp8", backend="tunetest", platforms=["*"], traits=fp8_only,
        priority=0,
    )(lambda *a, **k: None)  # fmt: skip
    registry.add_rankings(_file([_entry(request, {"tunetest.decode.fp8": 1.0}, tokens=4)]))
    assert selector.select(OP, request, CPU).name == FAST  # the fp8 kernel declines a bf16 cache


def test_environment_file_wins_over_registered(fakes, tmp_path, monkeypatch):
    request = _decode(4)
    registry.add_rankings(_file([_entry(request, {SLOW: 30.0, FAST: 10.0}, tokens=4)]))
    assert selector.select(OP, request, CPU).name == FAST
    user = tmp_path / "mine.json"
    user.write_text(json.dumps(_file([_entry(request, {SLOW: 1.0, FAST: 10.0}, tokens=4)])))
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps(_file([])))
    monkeypatch.setenv(rankings.RANKINGS_ENV, os.pathsep.join([str(empty), str(user)]))
    rankings.reload()
    assert selector.select(OP, request, CPU).name == SLOW
    assert f"{user} ({rankings.RANKINGS_ENV})" in str(tk.explain(OP, request, CPU))


def test_platform_name_then_arch(fakes):
    """A file of the same GPU wins over one of the same arch; another arch gets none."""
    h100, b200 = KNOWN_PLATFORMS["h100"], KNOWN_PLATFORMS["b200"]
    request = tk.AttentionRequest(torch.bfloat16, torch.bfloat16, 64, 8, 1, 16, 1, tokens=4)
    sm90 = {"vendor": "nvidia", "arch": "sm_90"}
    registry.add_rankings(
        _file(
            [_entry(request, {SLOW: 9.0, FAST: 10.0}, tokens=4)], platform={**sm90, "name": "H200"}
        )
    )
    assert selector.select(OP, request, h100).name == SLOW  # same arch, another GPU
    registry.add_rankings(
        _file(
            [_entry(request, {SLOW: 20.0, FAST: 10.0}, tokens=4)],
            platform={**sm90, "name": h100.name},
        )
    )
    assert selector.select(OP, request, h100).name == FAST  # same GPU wins
    assert selector.select(OP, request, b200).name == SLOW  # no sm_100 ranking: priorities


def test_moe_ranks_over_the_sizes_a_plan_serves():
    request = tk.MoERequest("mxfp4", "bf16", True, "topk_softmax", 128, 4, 2880, 2880, 16)
    entries = [
        {"op": "moe_apply", "key": rankings.request_key(request), "sizes": {"tokens": m},
         "times_us": times}
        for m, times in ((1, {"a.moe": 10.0, "b.moe": 40.0}), (16, {"a.moe": 30.0, "b.moe": 20.0}),
                         (4096, {"a.moe": 100.0, "b.moe": 900.0}))
    ]  # fmt: skip
    source = rankings.load(_file(entries))
    rankings._registered.append(source)
    try:
        small = rankings.lookup("moe_apply", request, CPU, ["a.moe", "b.moe"])
        big = rankings.lookup(
            "moe_apply", request._replace(max_num_tokens=8192), CPU, ["a.moe", "b.moe"]
        )
    finally:
        rankings._registered.remove(source)
    # up to 16 tokens: geomeans a sqrt(300) ~ 17.3, b sqrt(800) ~ 28.3; up to 8192 b loses more
    assert [name for name, _ in small.order] == ["a.moe", "b.moe"]
    assert small.order[0][1] == pytest.approx(300**0.5)
    assert "geometric mean over 2 measured sizes" in small.bucket
    assert [name for name, _ in big.order] == ["a.moe", "b.moe"]
    assert "over 3 measured sizes" in big.bucket


@pytest.mark.parametrize(
    "content, match",
    [
        ("{not json", r"rankings file .*bad.json: not valid JSON"),
        ("[]", r"bad.json: top level is list, expected a JSON object"),
        (json.dumps({"format": "other", "version": 1}), r"bad.json: format 'other' version 1"),
        (json.dumps(_file([{"op": "mha_bogus", "key": "", "times_us": {"a.x": 1}}])),
         r"bad.json: rankings\[0\]: unknown op 'mha_bogus', expected one of .*mha_prefill"),
        (json.dumps(_file([{"op": OP, "key": "", "times_us": {"a.x": -1}}])),
         r"times_us\['a.x'\] is -1, expected a positive number"),
        (json.dumps(_file([{"op": OP, "key": "", "sizes": {"batch": 4}, "times_us": {"a.x": 1}}])),
         r"sizes is \{'batch': 4\}, expected ints >= 0 named by tokens, seqlen"),
        (json.dumps({**_file([]), "platform": {"vendor": "nvidia"}}), r"bad.json: platform is"),
    ],
)  # fmt: skip
def test_malformed_files_raise_naming_the_file(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        registry.add_rankings(path)


def test_missing_file_and_wrong_source_type(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"rankings file .*nope.json: cannot read it"):
        registry.add_rankings(tmp_path / "nope.json")
    with pytest.raises(TypeError, match="expected a path or a mapping"):
        registry.add_rankings(42)
    monkeypatch.setenv(rankings.RANKINGS_ENV, str(tmp_path / "missing.json"))
    rankings.reload()
    request = tk.AttentionRequest(torch.bfloat16, torch.bfloat16, 64, 8, 1, 16, 1, tokens=2)
    with pytest.raises(ValueError, match=r"missing.json \(TOKENSPEED_KERNEL_RANKINGS\)"):
        selector.select(OP, request, CPU)
    monkeypatch.delenv(rankings.RANKINGS_ENV)
    rankings.reload()


def test_tune_cli_writes_a_file_the_selector_uses(fakes, tmp_path, capsys):
    out = tmp_path / "cpu.json"
    argv = ["tune", "--op", OP, "--kernels", "tunetest.*", "--iters", "3", "--out", str(out)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and FAST in printed
    data = json.loads(out.read_text())
    assert data["platform"] == {"vendor": "cpu", "arch": "cpu", "name": CPU.name}
    assert {tuple(e["sizes"].items()) for e in data["rankings"]} == {
        (("tokens", 1),),
        (("tokens", 4),),
    }
    assert all(e["spread_us"][FAST][0] <= e["spread_us"][FAST][1] for e in data["rankings"])
    registry.add_rankings(out)
    point = get_preset("tiny").attention_request(OP, window=True)._replace(tokens=1)
    assert selector.select(OP, point, CPU).name == FAST


def test_tune_on_a_captured_workload(fakes, tmp_path, monkeypatch, capsys):
    """`tune --replay` ranks the kernels on the calls a run recorded (B=1 twice, B=3 once): one
    bucket per distinct batch bucket, and selection from the file follows it."""
    from tokenspeed_kernel import capture, env

    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv(capture.CAPTURE_ENV, str(calls))
    env.reload()
    for batch in (1, 1, 3):
        request = _decode(batch)
    monkeypatch.delenv(capture.CAPTURE_ENV)
    env.reload()
    out = tmp_path / "replayed.json"
    argv = ["tune", "--replay", str(calls), "--kernels", "tunetest.*", "--iters", "3"]
    assert cli.main([*argv, "--out", str(out)]) == 0
    assert "replay of" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["created"]["replay"] == str(calls) and "preset" not in data["created"]
    assert [e["sizes"] for e in data["rankings"]] == [{"tokens": 1}, {"tokens": 4}]
    assert [e["label"] for e in data["rankings"]] == ["replay #0 x2", "replay #1 x1"]
    assert all(next(iter(e["times_us"])) == FAST for e in data["rankings"])
    registry.add_rankings(out)
    assert selector.select(OP, request, CPU).name == FAST  # B=3: the tokens=4 bucket
    with pytest.raises(SystemExit, match="records no call of kvcache_store"):
        cli.main([*argv, "--op", "kvcache_store", "--out", str(out)])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(SystemExit, match="holds no recorded calls"):
        cli.main(["tune", "--replay", str(empty), "--out", str(out)])


def test_tune_refuses_a_faked_platform(capsys):
    assert cli.main(["--platform", "h100", "tune"]) == 2
    assert "runs kernels on this machine" in capsys.readouterr().err


def test_explain_cli_takes_a_size_bucket(fakes, capsys):
    request = get_preset("tiny").attention_request(OP)._replace(tokens=4)
    registry.add_rankings(_file([_entry(request, {SLOW: 30.0, FAST: 10.0}, tokens=4)]))
    assert cli.main(["--preset", "tiny", "explain", OP, "--tokens", "3"]) == 0
    assert f"selected: {FAST}" in capsys.readouterr().out


def test_cached_path_tracks_platforms_and_threads(fakes):
    """The hot path keys by request and tests the platform's identity: an equal platform
    object, another platform, and a use_kernel block in another thread all select right."""
    request = tk.AttentionRequest(torch.bfloat16, torch.bfloat16, 64, 8, 1, 16, 1, tokens=4)
    sm100_only = {**TRAITS}
    tk.register_kernel(
        OP, name="tunetest.decode.sm100", backend="tunetest", platforms=["nvidia:sm_100+"],
        traits=sm100_only, priority=1000,
    )(lambda *a, **k: None)  # fmt: skip
    h100, b200 = KNOWN_PLATFORMS["h100"], KNOWN_PLATFORMS["b200"]
    twin = type(h100)(**{f: getattr(h100, f) for f in h100.__dataclass_fields__ if f != "_hash"})
    for _ in range(2):
        assert selector.select(OP, request, h100).name == SLOW
        assert selector.select(OP, request, b200).name == "tunetest.decode.sm100"
        assert selector.select(OP, request, twin).name == SLOW
    inside, release = threading.Event(), threading.Event()

    def hold():
        with tk.use_kernel(OP, FAST):
            inside.set()
            release.wait(5)

    worker = threading.Thread(target=hold)
    worker.start()
    inside.wait(5)
    try:
        assert selector.select(OP, request, h100).name == SLOW  # the other thread's override only
    finally:
        release.set()
        worker.join()
    # A context copied inside a block (how asyncio starts a task) keeps its override after
    # the block ends.
    with tk.use_kernel(OP, FAST):
        copied = contextvars.copy_context()
    assert selector.select(OP, request, h100).name == SLOW
    assert copied.run(selector.select, OP, request, h100).name == FAST


class _FakeMoE:
    weight_layout = "checkpoint"

    def padded_sizes(self, config):
        return config.hidden_size, config.intermediate_size


def test_moe_plan_selects_by_measurement_and_says_so(fakes):
    config = tk.MoEConfig(8, 2, 64, 64)
    moe_traits = {"weight_format": tk.ANY, "activation_format": tk.ANY, "routing": tk.ANY}
    for name, priority in (("tunetest.moe.slow", 99), ("tunetest.moe.fast", 1)):
        tk.register_kernel(
            "moe_apply", name=name, backend="tunetest", platforms=["*"],
            traits={**moe_traits, "bias": True}, priority=priority,
        )(_FakeMoE())  # fmt: skip
    assert tk.moe_plan(config, device="cpu", max_num_tokens=16).kernel == "tunetest.moe.slow"
    request = tk.ops.moe.api.request_for(config, 16)
    times = {"tunetest.moe.slow": 20.0, "tunetest.moe.fast": 10.0}
    registry.add_rankings(
        _file([
            {"op": "moe_apply", "key": rankings.request_key(request), "sizes": {"tokens": 16},
             "times_us": times},
        ]),
        origin="moe.json",
    )  # fmt: skip
    plan = tk.moe_plan(config, device="cpu", max_num_tokens=16)
    assert plan.kernel == "tunetest.moe.fast"
    assert plan.reason.startswith(f"measured fastest on {CPU.name} for max_num_tokens 16")
    assert plan.reason.endswith("(moe.json)")


class _Selected(Exception):
    pass


def _public_call(op, args, kw):
    """The public op call whose normalized kernel arguments `build_inputs` made."""
    fp8 = args[2].dtype == torch.float8_e4m3fn
    scales = dict(k_scale=kw["k_scale"], v_scale=kw["v_scale"]) if fp8 else {}
    if op == "kvcache_store":
        return lambda: tk.kvcache_store(*args, slot_mapping=kw["slot_mapping"], **scales)
    common = dict(
        window_left=kw["window_left"], sinks=kw["sinks"], softmax_scale=kw["softmax_scale"],
        return_lse=kw["lse"] is not None, out=kw["out"],
    )  # fmt: skip
    if op == "mha_prefill":
        ragged = dict(cu_seqlens=kw["cu_seqlens"], max_seqlen=kw["max_seqlen"])
        return lambda: tk.mha_prefill(*args, causal=kw["causal"], **ragged, **common)
    paged = dict(page_table=kw["page_table"], cache_seqlens=kw["cache_seqlens"], **scales)
    if op == "mha_decode_with_kvcache":
        return lambda: tk.mha_decode_with_kvcache(*args, **paged, **common)
    ragged = dict(cu_seqlens_q=kw["cu_seqlens_q"], max_seqlen_q=kw["max_seqlen_q"])
    return lambda: tk.mha_extend_with_kvcache(*args, **ragged, **paged, **common)


@pytest.mark.parametrize("op", [op for op in tune.TUNED_OPS if op != "moe_apply"])
def test_tune_buckets_are_the_requests_the_ops_build(op, monkeypatch):
    """tune keys its entries by `bucketed_request(case)`: it must be exactly the request the
    public op builds for that call, or a measured file would never match a real call."""
    from tokenspeed_kernel.ops.attention import api
    from tokenspeed_kernel.tools.workloads import bench_points, build_inputs

    seen = []

    def record(op_name, request, platform):
        seen.append(request)
        raise _Selected

    monkeypatch.setattr(api, "select", record)
    for point in bench_points(op, "tiny"):
        with pytest.raises(_Selected):
            _public_call(op, *build_inputs(point.case, torch.device("cpu")))()
        assert seen[-1] == tune.bucketed_request(point.case), point.label
    assert seen


def test_tune_merge_measures_ops_over_several_runs(fakes, tmp_path, capsys):
    out = tmp_path / "cpu.json"
    first = ["tune", "--op", OP, "--kernels", "tunetest.*", "--iters", "3", "--out", str(out)]
    assert cli.main(first) == 0
    store = ["tune", "--op", "kvcache_store", "--iters", "3", "--out", str(out), "--merge"]
    assert cli.main(store) == 0
    assert f"kept 4 entries of other ops from {out}" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert {e["op"] for e in data["rankings"]} == {OP, "kvcache_store"}
    merged = data["created"].pop("merged")
    assert [sorted(m) for m in merged] == [sorted(data["created"])]  # the first run's record
    data["platform"] = {"vendor": "nvidia", "arch": "sm_90", "name": "NVIDIA H100"}
    out.write_text(json.dumps(data))
    assert cli.main(store) == 2
    assert "was measured on {'vendor': 'nvidia'" in capsys.readouterr().err


def test_report_lists_the_rankings_in_use(fakes, capsys):
    assert cli.main([]) == 0
    before = capsys.readouterr().out
    # Vendor packages may ship rankings for other GPUs (the nvidia package's H100 file).
    assert "rankings: none (priorities decide" in before or "rankings: tokenspeed-kernel" in before
    assert "x.json" not in before
    request = _decode(4)
    registry.add_rankings(_file([_entry(request, {FAST: 1.0}, tokens=4)]), origin="x.json")
    assert cli.main([]) == 0
    assert f"rankings: x.json: cpu cpu {CPU.name}, 1 buckets" in capsys.readouterr().out


def test_prefill_bucket_has_two_sizes(fakes):
    """Prefill entries carry tokens and seqlen (as tune writes them, sorted by name); an exact
    match is named as such, a different seqlen as the nearest."""
    traits = {**TRAITS, "page_size": tk.ANY}
    a, b = "tunetest.prefill.a", "tunetest.prefill.b"
    tk.register_kernel(
        "mha_prefill", name="tunetest.prefill.a", backend="tunetest", platforms=["*"],
        traits=traits, priority=9,
    )(lambda *a, **k: None)  # fmt: skip
    tk.register_kernel(
        "mha_prefill", name="tunetest.prefill.b", backend="tunetest", platforms=["*"],
        traits=traits, priority=8,
    )(lambda *a, **k: None)  # fmt: skip
    request = tk.AttentionRequest(
        torch.bfloat16, torch.bfloat16, 64, 8, 1, tokens=4096, seqlen=1024
    )
    entries = [
        {"op": "mha_prefill", "key": rankings.request_key(request), "sizes": sizes, "times_us": t}
        for sizes, t in (
            ({"seqlen": 1024, "tokens": 4096}, {a: 2.0, b: 1.0}),
            ({"seqlen": 4096, "tokens": 4096}, {a: 1.0, b: 2.0}),
        )
    ]  # fmt: skip
    registry.add_rankings(_file(entries))
    exact = tk.explain("mha_prefill", request, CPU)
    assert exact.selected == "tunetest.prefill.b"
    assert "for tokens <= 4096, seqlen <= 1024: tunetest.prefill.b" in str(exact)
    near = tk.explain("mha_prefill", request._replace(seqlen=8192), CPU)
    assert near.selected == "tunetest.prefill.a"
    assert "seqlen <= 4096 (nearest measured to tokens <= 4096, seqlen <= 8192)" in str(near)


def test_tune_keep_kernels_adds_a_run_of_other_kernels_to_the_buckets(fakes, tmp_path, capsys):
    """A library measured in a run of its own joins the buckets of the file (say, FA3 and
    FlashInfer, which do not fit one machine together): the kernels timed now replace their
    old times, the others keep theirs, noted with their run's date."""
    out = tmp_path / "cpu.json"
    both = ["tune", "--op", OP, "--kernels", "tunetest.*", "--iters", "3", "--out", str(out)]
    assert cli.main(both) == 0
    first = json.loads(out.read_text())
    only_fast = ["tune", "--op", OP, "--kernels", FAST, "--iters", "3", "--out", str(out)]
    assert cli.main([*only_fast, "--keep-kernels"]) == 2
    assert "--keep-kernels needs --merge" in capsys.readouterr().err
    assert cli.main([*only_fast, "--merge", "--keep-kernels"]) == 0
    data = json.loads(out.read_text())
    assert len(data["rankings"]) == len(first["rankings"])
    for old, new in zip(first["rankings"], data["rankings"], strict=True):
        assert set(new["times_us"]) == {SLOW, FAST}
        assert new["times_us"][SLOW] == old["times_us"][SLOW]
        assert new["notes"][SLOW].startswith(f"measured {first['created']['date']}")
        assert not new["notes"][FAST].startswith("measured ")
        assert list(new["times_us"]) == sorted(new["times_us"], key=new["times_us"].get)
    assert cli.main([*only_fast, "--merge"]) == 0  # without it, this run's kernels only
    assert all(set(e["times_us"]) == {FAST} for e in json.loads(out.read_text())["rankings"])
