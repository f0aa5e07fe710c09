"""benchmarks/patches/moe_stream_only.patch (the M=1 zero-compute probe of
benchmarks/results/moe_h200_session11.md) still applies to the Hopper fragment GEMM, and with
it the decode GEMMs compile without their wgmmas (TS_MOE_STREAM_ONLY=2) or with them (0).

Applied to a copy of the package's sources; compiled in a subprocess without
TRITON_INTERPRET, as tests/triton/test_aot.py."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATCH = ROOT / "benchmarks" / "patches" / "moe_stream_only.patch"
SOURCES = Path("packages") / "tokenspeed-kernel-triton" / "src"

COMPILE = """
from tokenspeed_kernel_triton.aot import TARGETS, compile_for
from tokenspeed_kernel_triton.moe import wgmma_gemm
spec = next(s for s in wgmma_gemm.aot_specs(TARGETS["sm_90"][1]) if s.name.endswith("_c4_pdl_post"))
asm = compile_for(spec.fn, spec.signature, spec.constexprs, "sm_90", num_warps=spec.num_warps,
                  divisible=spec.divisible)
print(asm["ptx"].count("wgmma.mma_async"))
"""


def _wgmmas(sources: Path, mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TS_MOE_STREAM_ONLY=mode, PYTHONPATH=str(sources))
    done = subprocess.run(
        [sys.executable, "-c", COMPILE], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(shutil.which("git") is None, reason="git applies the patch")
def test_stream_only_patch_applies_and_removes_the_mmas(tmp_path):
    shutil.copytree(ROOT / SOURCES, tmp_path / SOURCES)
    done = subprocess.run(
        ["git", "apply", str(PATCH)], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert _wgmmas(tmp_path / SOURCES, "0") > 0
    assert _wgmmas(tmp_path / SOURCES, "2") == 0
