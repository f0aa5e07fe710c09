"""Ahead-of-time compile of every AMD MoE Gluon specialization for gfx942 and gfx950 (no GPU):
each compiles, uses MFMA (the grouped GEMMs; the tiny-batch GEMVs run on the vector units) and
buffer loads/stores, the gfx950 FP8 path uses the scaled MFMA on the MXFP4 bytes, nothing spills,
and the NVIDIA instantiation (the one the GPU tests run) compiles to mma.sync.

Runs scripts/aot_check_amd.py in subprocesses: the session may have TRITON_INTERPRET=1 set and
Gluon kernels only compile as real JIT functions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "aot_check_amd.py"
ARCHS = ("gfx942", "gfx950")
MODULES = ("moe.grouped_gemm", "moe.tiny_batch")
BF16_MFMA = {"gfx942": "v_mfma_f32_16x16x16_bf16", "gfx950": "v_mfma_f32_16x16x32_bf16"}
SCALED_MFMA = "v_mfma_scale_f32_16x16x128_f8f6f4"
ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


@pytest.fixture(scope="session")
def moe_aot_rows() -> dict[str, list[dict]]:
    only = [arg for module in MODULES for arg in ("--only", module)]
    procs = {
        arch: subprocess.Popen(
            [sys.executable, str(SCRIPT), "--arch", arch, *only],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        for arch in ARCHS
    }
    rows = {}
    for arch, proc in procs.items():
        out, err = proc.communicate(timeout=900)
        assert out.strip(), f"aot_check_amd.py --arch {arch} printed nothing:\n{err[-3000:]}"
        rows[arch] = json.loads(out)
    return rows


@pytest.mark.parametrize("arch", ARCHS)
def test_every_moe_spec_compiles_with_buffer_ops(moe_aot_rows, arch):
    rows = moe_aot_rows[arch]
    names = {r["name"] for r in rows}
    assert any(n.startswith("moe_gemm1") for n in names) and any(
        n.startswith("tiny_gemm2") for n in names
    )
    failed = {r["name"]: r.get("error") or f"missing {r['missing']}" for r in rows if not r["ok"]}
    assert not failed, f"{arch}: {failed}"
    for row in rows:
        assert row["buffer_load"] > 0 and row["buffer_store"] > 0, row


@pytest.mark.parametrize("arch", ARCHS)
def test_grouped_gemm_mfma_and_gfx950_scaled_mfma_for_fp8(moe_aot_rows, arch):
    for row in moe_aot_rows[arch]:
        if not row["name"].startswith("moe_gemm"):
            assert row["mfma"] == [], f"{row['name']}: GEMV should not use MFMA"
            continue
        fp8 = "_fp8_" in row["name"]
        if arch == "gfx950" and fp8:
            assert row["mfma"] == [SCALED_MFMA], row
        else:
            assert row["mfma"] == [BF16_MFMA[arch]], row


@pytest.mark.parametrize("arch", ARCHS)
def test_moe_kernels_do_not_spill(moe_aot_rows, arch):
    for row in moe_aot_rows[arch]:
        assert row["scratch"] == 0 and row["vgpr_spills"] == 0, row
        assert row["waves_per_simd"] >= 2, row


def test_nvidia_instantiation_compiles_to_mma_sync():
    code = (
        "from tokenspeed_kernel_amd import aot\n"
        "from tokenspeed_kernel_amd.moe import grouped_gemm, tiny_batch\n"
        "specs = grouped_gemm.aot_specs('sm_90')[:6] + tiny_batch.aot_specs('sm_90')[:2]\n"
        "for s in specs:\n"
        "    ptx = aot.compile_spec(s, 'sm_90').asm['ptx']\n"
        "    print(s.name, 'mma.sync' in ptx)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split() for line in out.stdout.strip().splitlines())
    assert len(lines) == 8
    for name, has_mma in lines.items():
        assert has_mma == ("True" if name.startswith("moe_gemm") else "False"), name
