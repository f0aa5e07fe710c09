"""scripts/sanitize_kernels.py's findings table, from sanitizer logs written here: a sweep is
clean only when every tool's log ran to its `runs:` line with no error, finding or failed
comparison."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import sanitize_kernels  # noqa: E402

sys.path.remove(str(SCRIPTS))

CLEAN = """========= COMPUTE-SANITIZER
case: triton.mha_prefill gpt-oss-120b-prefill-full
triton.mha_prefill   gpt-oss-120b-prefill-full   6.09s ok
runs: 1 kernel-case runs on nvidia sm_90 H100, 0 failed, 0 skipped
========= ERROR SUMMARY: 0 errors
"""
CUT_SHORT = """========= COMPUTE-SANITIZER
case: triton.moe_apply.sm90 gpt-oss-120b-moe-mxfp4-bf16-m1-e16
"""
FINDING = """========= COMPUTE-SANITIZER
case: triton.kvcache_store odd-store
========= Invalid __global__ write of size 2 bytes
=========     at _store_kernel+0x1a0 in kvcache_store.py:88
runs: 1 kernel-case runs on nvidia sm_90 H100, 0 failed, 0 skipped
========= ERROR SUMMARY: 1 error
"""


def _summarize(tmp_path, capsys, **logs):
    paths = []
    for tool, text in logs.items():
        path = tmp_path / f"{tool}.log"
        path.write_text(text)
        paths.append(path)
    status = sanitize_kernels.summarize(paths)
    return status, capsys.readouterr().out


def test_clean_logs_are_clean(tmp_path, capsys):
    status, out = _summarize(tmp_path, capsys, memcheck=CLEAN, racecheck=CLEAN)
    assert status == 0 and "no findings" in out


@pytest.mark.parametrize("bad", [CUT_SHORT, FINDING], ids=["cut-short", "finding"])
def test_a_cut_or_a_finding_is_not_clean(tmp_path, capsys, bad):
    status, out = _summarize(tmp_path, capsys, memcheck=CLEAN, racecheck=bad)
    assert status == 1 and "findings above" in out
    if bad is FINDING:
        assert "kvcache_store.py" in out and "odd-store" in out


def test_model_moe_cases_keep_their_per_expert_shapes():
    """The sanitized GPT-OSS MoE cases prepare SANITIZED_EXPERTS experts, with the model's
    H, top-k and I (or its tensor-parallel shard); expert-parallel cases stay as the preset
    has them."""
    cases = [c for c in sanitize_kernels.ordered_cases("moe_apply", "gpt-oss-120b") if c.preset]
    assert cases
    for case in cases:
        shape = case.shape
        assert (shape.hidden_size, shape.top_k) == (2880, 4)
        assert shape.intermediate_size == 2880 or "-tp" in case.name
        if shape.config().num_local_experts == shape.num_experts:
            assert shape.num_experts == sanitize_kernels.SANITIZED_EXPERTS
            assert case.request.num_experts == shape.num_experts
            assert case.name.endswith(f"-e{shape.num_experts}")


def test_per_gpu_shard_logs_count_as_their_tool(tmp_path, capsys):
    """A sweep split over GPUs writes <tool>.<K>.log: a finding in any shard is that tool's,
    and a shard cut short makes the sweep unclean."""
    status, out = _summarize(tmp_path, capsys, **{"memcheck.0": CLEAN, "memcheck.1": CLEAN})
    assert status == 0 and "memcheck.1" in out
    status, out = _summarize(tmp_path, capsys, **{"memcheck.0": CLEAN, "memcheck.1": FINDING})
    assert status == 1 and "kvcache_store.py" in out
    rows = [line.split() for line in out.splitlines() if "kvcache_store.py" in line]
    assert rows and rows[0][0] == "memcheck"
    status, out = _summarize(tmp_path, capsys, **{"racecheck.0": CLEAN, "racecheck.1": CUT_SHORT})
    assert status == 1


@pytest.mark.parametrize("text,expected", [("0/1", (0, 1)), ("3/4", (3, 4))])
def test_shard_argument(text, expected):
    assert sanitize_kernels.shard(text) == expected


@pytest.mark.parametrize("text", ["4/4", "1", "-1/2", "a/b", "1/0"])
def test_bad_shard_argument_is_named(text):
    with pytest.raises(Exception, match="expected K/N with 0 <= K < N"):
        sanitize_kernels.shard(text)


@pytest.mark.parametrize("op", ["mha_decode_with_kvcache", "moe_apply"])
def test_kernel_alone_runs_a_case_on_copied_inputs(op):
    """--kernel-only (initcheck's mode) builds a case on the host, copies it over and runs the
    kernel alone; here the reference kernel on the CPU stands in for a GPU kernel."""
    from tokenspeed_kernel.registry import get_kernel
    from tokenspeed_kernel.testing import conformance_cases

    case = conformance_cases(op)[0]
    spec = get_kernel(op, f"reference.{op}")
    sanitize_kernels.run_kernel_alone(spec, case, "cpu")
