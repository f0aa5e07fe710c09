"""The developer tools on the CPU: output formats and exit codes of check / bench / profile, a
deliberately wrong kernel caught by check, capture then replay. Nothing here asserts a speed."""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest
import torch

import tokenspeed_kernel as tk
from tokenspeed_kernel import capture, env
from tokenspeed_kernel.cli import main
from tokenspeed_kernel.testing import MoEShape, conformance_cases, reference_spec, temporary_kernel
from tokenspeed_kernel.testing.inputs import moe_weights
from tokenspeed_kernel.tools._common import Progress, format_table
from tokenspeed_kernel.tools.replay import case_from_record, load_capture
from tokenspeed_kernel.tools.roofline import roofline
from tokenspeed_kernel.tools.workloads import _visible, bench_points, work

FAST = ["--iters", "2", "--warmup", "1", "--budget-ms", "10"]


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    """The roofline cache goes to a temporary directory, never the user's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(capture.CAPTURE_ENV, raising=False)
    env.reload()


@pytest.fixture
def register():
    """Register kernels for one test; every one is unregistered afterwards, even on failure."""
    with contextlib.ExitStack() as stack:
        yield lambda *args, **kw: stack.enter_context(temporary_kernel(*args, **kw))


def _window_off_by_one(*args, **kwargs):
    kwargs["window_left"] += 1
    reference_spec("mha_decode_with_kvcache").fn(*args, **kwargs)


def test_check_passes_and_writes_json(tmp_path, capsys):
    path = tmp_path / "check.json"
    rc = main(
        ["check", "--kernel", "reference.kvcache_store", "--dtype", "fp16", "--json", str(path)]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "kernel  " in out and "max abs" in out and "max rel" in out and "result" in out
    assert "store-page16-padded-slots-fp16" in out and "PASS" in out and "FAIL" not in out
    expected = len(conformance_cases("kvcache_store", dtypes=[torch.float16]))
    assert f"{expected} passed, 0 failed, 0 skipped" in out
    payload = json.loads(path.read_text())
    assert {"command", "date", "device", "versions", "results"} <= set(payload)
    assert [r["status"] for r in payload["results"]] == ["PASS"] * expected


def test_check_catches_a_wrong_kernel(register, capsys):
    register("mha_decode_with_kvcache", "wrong.mha_decode_with_kvcache", _window_off_by_one)
    rc = main(
        ["check", "--op", "mha_decode_with_kvcache", "--kernel", "wrong.*", "--case", "*window*"]
    )
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAIL wrong.mha_decode_with_kvcache on decode-q3-window1-bf16: out: " in out
    assert "worst at" in out


def test_check_counts_a_raising_kernel_as_failure(register, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    register("kvcache_store", "broken.kvcache_store", broken)
    rc = main(["check", "--kernel", "broken.*", "--case", "store-page1-*"])
    out = capsys.readouterr().out
    assert rc == 1
    assert (
        "FAIL broken.kvcache_store on store-page1-d128-gqa-heads8-bf16: raised "
        "RuntimeError: boom" in out
    )


def test_check_skips_declined_cases_with_the_reason(register, capsys):
    spec = reference_spec("kvcache_store")
    register(
        "kvcache_store", "narrow.kvcache_store", spec.fn, traits=dict(spec.traits, head_dim={128})
    )
    rc = main(["check", "--kernel", "narrow.*", "--dtype", "bf16"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "SKIP" in out and "head_dim 64 not in {128}" in out and "PASS" in out


def test_check_usage_errors(capsys):
    assert main(["check", "--kernel", "no-such-kernel.*"]) == 1
    assert "nothing ran: no kernel that can run here matches" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["check", "--op", "not_an_op"])
    assert exc.value.code == 2


def test_check_fails_when_every_match_declines(register, capsys):
    spec = reference_spec("kvcache_store")
    register(
        "kvcache_store", "narrow.kvcache_store", spec.fn, traits=dict(spec.traits, head_dim={96})
    )
    assert main(["check", "--kernel", "narrow.*"]) == 1
    out = capsys.readouterr().out
    assert "0 passed, 0 failed" in out and "nothing ran: every matching kernel declines" in out


def test_check_says_the_triton_interpreter_runs_the_kernels(capsys):
    if torch.cuda.is_available():
        pytest.skip("the interpreter runs only where there is no GPU")
    assert main(["check", "--kernel", "reference.kvcache_store", "--case", "store-page1-*"]) == 0
    assert "Triton kernels run through the Triton interpreter" in capsys.readouterr().out


def test_commands_that_run_kernels_refuse_platform(capsys):
    for command in (["check"], ["bench"], ["profile", "--op", "kvcache_store"]):
        assert main(["--platform", "mi300x", *command]) == 2
        err = capsys.readouterr().err
        assert f"`{command[0]}` runs kernels on this machine's device" in err
        assert "--platform mi300x explain OP" in err


def test_profile_refuses_a_preset_that_does_not_fit(monkeypatch, capsys):
    from tokenspeed_kernel.tools import profile

    monkeypatch.setattr(profile, "free_bytes", lambda device: 24 << 30)
    rc = main(["profile", "--op", "moe_apply", "--preset", "gpt-oss-120b"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "moe_apply --preset gpt-oss-120b needs about 29.7 GiB" in err
    assert "24.0 GiB is free: use --preset gpt-oss-20b or tiny" in err


def test_bench_tiny_writes_json_and_png(tmp_path, capsys):
    rc = main(
        [
            "bench",
            "--preset",
            "tiny",
            "--op",
            "mha_decode_with_kvcache",
            "--peers",
            "--kernels",
            "reference.*",
            "--out",
            str(tmp_path),
            *FAST,
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "timing: wall clock" in out and "latency us" in out and "% roof" in out
    header = next(line for line in out.splitlines() if "latency us" in line)
    assert header.split()[3:9] == ["latency", "us", "eager", "us", "graph", "us"]
    payload = json.loads((tmp_path / "results.json").read_text())
    assert {"command", "date", "device", "versions", "roofline", "timing"} <= set(payload)
    assert payload["timing"]["method"] == "wall clock" and payload["preset"] == "tiny"
    rows = payload["results"]
    ref = [r for r in rows if r["kernel"] == "reference.mha_decode_with_kvcache"]
    assert len(ref) == len(bench_points("mha_decode_with_kvcache", "tiny"))
    for r in ref:
        assert r["status"] == "ok" and r["latency_us"] > 0 and r["flops"] > 0 and r["bytes"] > 0
        assert r["gbps"] > 0 and r["roofline_pct"] > 0
        # CPU: eager is the wall clock per call too; no graph, and no error or note about it.
        assert r["eager_us"] > 0 and r["graph_us"] is None and "graph" not in r["note"]
    peers = {r["kernel"]: r for r in rows if r["peer"]}
    assert peers["peer:fa3"]["status"] == "unavailable"  # no CUDA here
    assert peers["peer:fa3"]["eager_us"] is None and peers["peer:fa3"]["graph_us"] is None
    sdpa = peers["peer:torch.sdpa"]
    assert sdpa["status"] == "ok" and sdpa["eager_us"] > 0 and sdpa["graph_us"] is None
    png = tmp_path / "mha_decode_with_kvcache.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_all_ops_tiny(tmp_path, capsys):
    rc = main(["bench", "--out", str(tmp_path), "--kernels", "reference.*", *FAST])
    assert rc == 0
    payload = json.loads((tmp_path / "results.json").read_text())
    assert {r["op"] for r in payload["results"]} == set(tk.op_names())
    assert all(r["status"] == "ok" for r in payload["results"])
    assert {p.name for p in tmp_path.glob("*.png")} == {f"{op}.png" for op in tk.op_names()}


def test_bench_reports_a_raising_kernel(register, tmp_path, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    register("kvcache_store", "broken.kvcache_store", broken)
    rc = main(
        [
            "bench",
            "--op",
            "kvcache_store",
            "--kernels",
            "broken.*",
            "--no-plot",
            "--out",
            str(tmp_path),
            *FAST,
        ]
    )
    assert rc == 1
    rows = json.loads((tmp_path / "results.json").read_text())["results"]
    assert rows and all(r["status"] == "error" and "boom" in r["note"] for r in rows)


def test_bench_without_matplotlib_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    rc = main(
        [
            "bench",
            "--op",
            "kvcache_store",
            "--kernels",
            "reference.*",
            "--out",
            str(tmp_path),
            *FAST,
        ]
    )
    assert rc == 2
    assert "need matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


def test_profile_writes_a_trace(tmp_path, capsys):
    rc = main(
        [
            "profile",
            "--op",
            "kvcache_store",
            "--preset",
            "tiny",
            "--out",
            str(tmp_path),
            "--kernel",
            "reference.kvcache_store",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "CPU operators" in out and "calls" in out and "total us" in out
    trace = json.loads((tmp_path / "trace.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any(n.startswith("reference.kvcache_store") for n in names)


def _captured_calls():
    gen = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen).to(dtype)

    k = randn(10, 2, 64)
    tk.mha_prefill(
        randn(10, 4, 64),
        k,
        randn(10, 2, 64),
        cu_seqlens=torch.tensor([0, 3, 10], dtype=torch.int32),
        max_seqlen=7,
        window_left=2,
        sinks=torch.zeros(4),
        return_lse=True,
    )
    cache = randn(4, 16, 2, 64)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lengths = torch.tensor([20, 5], dtype=torch.int32)
    for _ in range(2):  # one distinct call, recorded twice
        tk.mha_decode_with_kvcache(
            randn(2, 4, 64), cache, cache.clone(), page_table=table, cache_seqlens=lengths
        )
    fp8 = cache.to(torch.float8_e4m3fn)
    tk.mha_extend_with_kvcache(
        randn(5, 4, 64),
        fp8,
        fp8.clone(),
        page_table=table,
        cu_seqlens_q=torch.tensor([0, 2, 5], dtype=torch.int32),
        cache_seqlens=lengths,
        max_seqlen_q=3,
        k_scale=0.5,
    )
    tk.kvcache_store(k, k.clone(), fp8, fp8.clone(), slot_mapping=torch.arange(10), k_scale=2.0)
    shape = MoEShape(3, 8, 2, 128, 128)
    plan = tk.moe_plan(shape.config(), device="cpu", max_num_tokens=8)
    weights = tk.moe_prepare_weights(plan, moe_weights(shape, gen))
    tk.moe_apply(plan, randn(3, 128), weights, randn(3, 8, dtype=torch.float32))
    tk.moe_apply(
        plan,
        randn(2, 128),
        weights,
        topk_weights=torch.full((2, 2), 0.5),
        topk_ids=torch.tensor([[1, 2], [3, 4]], dtype=torch.int32),
    )


def test_capture_then_replay_round_trips(tmp_path, monkeypatch, capsys):
    path = tmp_path / "calls.jsonl"
    monkeypatch.setenv(capture.CAPTURE_ENV, str(path))
    env.reload()  # settings are read once; re-read them after changing the variable
    # The reference kernels serve (and replay) fast on the CPU whatever else is registered.
    with contextlib.ExitStack() as stack:
        for op in tk.op_names():
            stack.enter_context(tk.use_kernel(op, f"reference.{op}"))
        _captured_calls()
    monkeypatch.delenv(capture.CAPTURE_ENV)
    env.reload()
    records = load_capture(path)
    assert [(r["op"], n) for r, n in records] == [
        ("mha_prefill", 1),
        ("mha_decode_with_kvcache", 2),
        ("mha_extend_with_kvcache", 1),
        ("kvcache_store", 1),
        ("moe_apply", 1),
        ("moe_apply", 1),
    ]
    prefill = case_from_record(records[0][0], 0)
    assert prefill.shape.seqlens == (3, 7) and prefill.request.window_left == 2
    assert prefill.request.sinks and prefill.request.lse
    extend = case_from_record(records[2][0], 2)
    assert extend.shape.q_lens == (2, 3) and extend.shape.seqlens == (20, 5)
    assert extend.request.kv_dtype == torch.float8_e4m3fn and extend.shape.k_scale == 0.5

    out_dir = tmp_path / "replay"
    rc = main(["bench", "--replay", str(path), "--no-plot", "--out", str(out_dir), *FAST])
    assert rc == 0
    rows = json.loads((out_dir / "results.json").read_text())["results"]
    assert [r["kernel"] for r in rows] == [r["kernel"] for r, _ in records]
    assert all(r["kernel"].startswith("reference.") for r in rows)
    assert all(r["status"] == "ok" and r["latency_us"] > 0 for r in rows)
    assert all(r["eager_us"] > 0 and r["graph_us"] is None for r in rows)
    assert rows[1]["note"].startswith("mha_decode_with_kvcache x2")
    assert "q_len 1" in rows[1]["request"] and "page 16" in rows[1]["request"]


def test_replay_rejects_a_file_that_is_not_a_capture(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"op": "mha_prefill"}\n')
    assert main(["bench", "--replay", str(path), "--no-plot", "--out", str(tmp_path)]) == 2
    assert "is not a capture record" in capsys.readouterr().err


def test_visible_key_counts_match_brute_force():
    for lo, hi, window in [(0, 9, -1), (0, 9, 2), (5, 12, 3), (-3, 4, -1), (-3, 4, 0), (7, 7, 1)]:
        brute = sum(min(p + 1, window + 1) if window >= 0 else p + 1 for p in range(max(lo, 0), hi))
        assert _visible(lo, hi, window) == brute, (lo, hi, window)


def test_work_formulas():
    [case] = [
        p.case
        for p in bench_points("mha_decode_with_kvcache", "tiny")
        if p.series == "window 15" and p.x == 4
    ]
    flops, nbytes = work(case)
    s = case.shape  # 4 sequences of 64 keys, one query each, window 15: 16 visible keys
    assert flops == 4 * s.num_q_heads * s.head_dim * 4 * 16
    kv = 2 * 4 * 16 * s.num_kv_heads * s.head_dim * 2
    assert nbytes == kv + 4 * s.num_q_heads * s.head_dim * 2 * 2
    [moe] = [p.case for p in bench_points("moe_apply", "tiny") if p.x == 1]
    m = moe.shape
    flops, nbytes = work(moe, torch.tensor([[0, 3]]))
    assert flops == 1 * m.top_k * 2 * (
        m.hidden_size * 2 * m.intermediate_size + m.intermediate_size * m.hidden_size
    )
    elements = 3 * m.hidden_size * m.intermediate_size
    expert = elements / 2 + elements / 32 + 4 * (2 * m.intermediate_size + m.hidden_size)
    assert math.isclose(nbytes, 2 * expert + 2 * m.hidden_size * 2)


def test_roofline_is_measured_once_and_cached():
    first = roofline(torch.device("cpu"))
    again = roofline(torch.device("cpu"))
    assert first.source == "measured" and again.source == "cache"
    assert again.copy_bytes_per_s == first.copy_bytes_per_s > 0
    assert first.percent(1.0, first.matmul_flops_per_s / 2, 0.0) == pytest.approx(50.0)


def test_progress_bar_and_table():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    bar = Progress(3, "bench", stream=stream)
    for _ in range(3):
        bar.step("x")
    bar.close()
    assert "[" + "#" * 24 + "] 3/3" in stream.getvalue()
    quiet = io.StringIO()
    Progress(3, "bench", stream=quiet).step()
    assert quiet.getvalue() == ""
    assert format_table(("a", "bb"), [(1, 22)], "lr").splitlines() == ["a  bb", "-  --", "1  22"]
