"""The `tokenspeed-kernel` report, list and explain commands (core kernels only)."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import pytest

from tokenspeed_kernel import cli
from tokenspeed_kernel.testing import reference_spec, temporary_kernel


@pytest.fixture
def register():
    with contextlib.ExitStack() as stack:
        yield lambda *args, **kw: stack.enter_context(temporary_kernel(*args, **kw))


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


def test_report_names_the_platform_once_and_ends_with_next_steps(capsys):
    code, out = run(capsys)
    assert code == 0
    assert "cpu CPU" not in out and "this platform (cpu):" in out
    assert "`check` runs the Triton kernels through the Triton interpreter" in out
    assert out.rstrip().splitlines()[-1].startswith("  tokenspeed-kernel --help")
    assert "tokenspeed-kernel check --op kvcache_store" in out


def test_report_states_each_decline_reason_once(register, capsys):
    def nvidia_only(op):
        register(op, f"gpu.{op}", reference_spec(op).fn, platforms=("nvidia:sm_90",), priority=50)

    nvidia_only("mha_prefill")
    nvidia_only("mha_decode_with_kvcache")
    code, out = run(capsys)
    assert code == 0
    assert out.count("needs nvidia:sm_90, this is cpu") == 1
    assert "    gpu.mha_prefill, gpu.mha_decode_with_kvcache\n" in out


def test_report_on_a_faked_platform(capsys):
    code, out = run(capsys, "--platform", "mi355x")
    assert code == 0 and "platform: amd gfx950" in out
    assert "tokenspeed-kernel aot --target gfx950" in out


def test_global_options_after_the_command(capsys):
    code, out = run(capsys, "explain", "moe_apply", "--platform", "mi355x", "--preset", "tiny")
    assert code == 0 and "amd gfx950" in out and "E 8 top-2" in out
    code, out = run(capsys, "--platform", "h100", "explain", "moe_apply")
    assert code == 0 and "nvidia sm_90" in out
    code, out = run(capsys, "list", "--platform", "h100")
    assert code == 0


def test_trait_sets_read_in_order_and_runs_as_ranges():
    assert cli.trait_text(frozenset(range(1, 65))) == "1..64"
    assert cli.trait_text(frozenset({128, 1, 16, 2})) == "{1, 2, 16, 128}"
    assert cli.trait_text(True) == "yes"


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
    for heads in ("7/2", "8/0", "0/8", "x/8"):
        code = cli.main(["explain", "mha_prefill", "--heads", heads])
        assert code == 2
        assert f"--heads is '{heads}', expected HQ/HKV" in capsys.readouterr().err


def test_explain_refuses_non_positive_sizes(capsys):
    for option in ("--head-dim", "--page-size", "--q-len", "--num-tokens"):
        with pytest.raises(SystemExit) as exc:
            cli.main(["explain", "mha_decode_with_kvcache", option, "0"])
        assert exc.value.code == 2
        assert "0 is not a positive integer" in capsys.readouterr().err


def test_console_script_runs():
    done = subprocess.run(
        [sys.executable, "-m", "tokenspeed_kernel.cli", "explain", "moe_apply"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "selected: " in done.stdout
