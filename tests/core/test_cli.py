"""The `tokenspeed-kernel` report, list and explain commands (core kernels only)."""

from __future__ import annotations

import subprocess
import sys

from tokenspeed_kernel import cli


def run(capsys, *argv):
    code = cli.main(list(argv))
    return code, capsys.readouterr().out


def test_report_shows_platform_kernels_and_gpt_oss_selection(capsys):
    code, out = run(capsys)
    assert code == 0
    assert "platform: cpu" in out
    assert "plugins (tokenspeed_kernel.plugins):" in out
    for op in (
        "mha_prefill",
        "mha_extend_with_kvcache",
        "mha_decode_with_kvcache",
        "kvcache_store",
        "moe_apply",
    ):
        assert f"  {op}:" in out
    assert "gpt-oss-120b on this platform" in out
    assert "decode (sliding window)" in out and "-> reference.mha_decode_with_kvcache" in out
    assert "moe prefill batch (M<=8192)" in out and "-> reference.moe_apply" in out


def test_report_on_a_faked_platform(capsys):
    code, out = run(capsys, "--platform", "mi355x")
    assert code == 0 and "platform: amd gfx950" in out


def test_list_shows_traits(capsys):
    code, out = run(capsys, "list")
    assert code == 0
    assert "reference.mha_prefill" in out and "priority 0" in out and "platforms *" in out
    assert "traits:" in out and "sinks=yes" in out


def test_explain_preset_and_overrides(capsys):
    code, out = run(capsys, "explain", "mha_decode_with_kvcache", "--window", "--q-len", "2")
    assert code == 0
    assert "window_left 127" in out and "q_len 2" in out and "heads 64/8" in out
    assert "* reference.mha_decode_with_kvcache (priority 0): accepted" in out
    code, out = run(
        capsys,
        "--preset",
        "tiny",
        "explain",
        "mha_prefill",
        "--heads",
        "8/8",
        "--head-dim",
        "128",
        "--dtype",
        "fp16",
    )
    assert code == 0 and "heads 8/8" in out and "head_dim 128" in out and "q float16" in out
    code, out = run(
        capsys, "explain", "moe_apply", "--num-tokens", "4096", "--activation-format", "fp8"
    )
    assert code == 0 and "fp8 activations" in out and "up to 4096 tokens" in out


def test_explain_bad_heads_is_an_error(capsys):
    code = cli.main(["explain", "mha_prefill", "--heads", "7/2"])
    assert code == 2
    assert "--heads is '7/2', expected HQ/HKV" in capsys.readouterr().err


def test_console_script_runs():
    done = subprocess.run(
        [sys.executable, "-m", "tokenspeed_kernel.cli", "explain", "moe_apply"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "selected: " in done.stdout
