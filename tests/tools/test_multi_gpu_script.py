"""benchmarks/multi_gpu_gpt_oss.py's sharding logic on CPU: two gloo processes under torchrun
at tiny shapes (reference kernels), every check passing; and the same run with each rank's
shard damaged on purpose, every check failing (so the checks can fail)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "multi_gpu_gpt_oss.py"
CHECKS = 10  # 3 token counts x (TP, EP) + (prefill, decode) x (full, sliding)


def _torchrun(*extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    # Reference kernels only: no plugin, no Triton interpreter (CPU CI).
    env.pop("TRITON_INTERPRET", None)
    env["TOKENSPEED_KERNEL_PLUGINS"] = ""
    env["OMP_NUM_THREADS"] = "1"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(SCRIPT), "--backend", "gloo", "--device", "cpu", "--tiny", "--iters", "1", *extra,
    ]  # fmt: skip
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)


def _rows(stdout: str) -> list[list[str]]:
    rows = [line.split(" | ") for line in stdout.splitlines() if line.startswith("| ")]
    rows = [[cell.strip(" |") for cell in row] for row in rows[1:]]  # without the header
    return [row for row in rows if row[0] != "---"]


def test_two_gloo_ranks_match_one_process():
    run = _torchrun()
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = _rows(run.stdout)
    assert len(rows) == CHECKS
    assert {row[0] for row in rows} == {"moe-tp", "moe-ep", "attn-prefill", "attn-decode"}
    assert all(row[2] == "yes" for row in rows), run.stdout
    # Each rank's shard is named: I split 64 + 32 (whole scale groups), experts 0..3 / 4..7.
    by_check = {(row[0], row[1]): row for row in rows}
    assert by_check[("moe-tp", "M=1")][5].startswith("I 64:")
    assert by_check[("moe-tp", "M=1")][6].startswith("I 32:")
    assert by_check[("moe-ep", "M=33")][6].startswith("experts 4..7:")


def test_a_damaged_shard_fails_its_check():
    run = _torchrun("--corrupt", "tp,ep,attention")
    assert run.returncode != 0
    rows = _rows(run.stdout)
    assert len(rows) == CHECKS and all(row[2] == "NO" for row in rows), run.stdout
    assert "checks FAILED" in run.stderr
    # A damaged MoE shard still matches the reference on itself; its sum with the others fails.
    assert "outside the sum allowance" in run.stdout and "own shard" not in run.stdout


@pytest.mark.gpu
def test_nccl_on_every_visible_gpu():
    """The GPU machine: GPT-OSS-120B shapes over all visible GPUs (one when there is one)."""
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        pytest.skip("needs a GPU")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
        str(count), str(SCRIPT), "--no-record", "--iters", "5",
    ]  # fmt: skip
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
