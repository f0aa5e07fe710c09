"""Ahead-of-time compile of every AMD Gluon attention specialization for gfx942 and gfx950 on a
machine without an AMD GPU: each compiles, uses the instructions its design relies on (MFMA,
buffer loads/stores, gfx950 direct-to-LDS loads), fits the LDS, and neither spills VGPRs nor
uses scratch; the committed KERNEL_REPORT.md matches what the compiler emits.

Runs scripts/aot_check_amd.py in subprocesses (one per arch, concurrently): this session may
have TRITON_INTERPRET=1 set, and Gluon kernels only compile as real JIT functions."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "aot_check_amd.py"
REPORT_SCRIPT = ROOT / "scripts" / "amd_kernel_report.py"
REPORT = ROOT / "packages" / "tokenspeed-kernel-amd" / "KERNEL_REPORT.md"
ARCHS = ("gfx942", "gfx950")
MODULES = ("attention.prefill", "attention.extend", "attention.decode")
LDS_LIMIT = {"gfx942": 64 * 1024, "gfx950": 160 * 1024}
MFMA = {"gfx942": ("v_mfma_f32_32x32x8_bf16", "v_mfma_f32_16x16x16_bf16"),
        "gfx950": ("v_mfma_f32_32x32x16_bf16", "v_mfma_f32_16x16x32_bf16")}  # fmt: skip


@pytest.fixture(scope="session")
def aot_rows() -> dict[str, list[dict]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    only = [arg for module in MODULES for arg in ("--only", module)]
    procs = {
        arch: subprocess.Popen(
            [sys.executable, str(SCRIPT), "--arch", arch, *only],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
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
def test_every_spec_compiles_with_mfma_and_buffer_ops(aot_rows, arch):
    rows = aot_rows[arch]
    assert {r["name"].split("_")[0] for r in rows} >= {"prefill", "extend", "decode"}
    failed = {r["name"]: r.get("error") or f"missing {r['missing']}" for r in rows if not r["ok"]}
    assert not failed, f"{arch}: {failed}"
    for row in rows:
        assert row["buffer_load"] > 0, f"{row['name']}: no buffer loads"
        if not row["name"].startswith("decode_reduce"):
            assert row["buffer_store"] > 0, f"{row['name']}: no buffer stores"
            assert set(row["mfma"]) <= set(MFMA[arch]) and row["mfma"], (
                f"{row['name']}: MFMA {row['mfma']}, expected among {MFMA[arch]}"
            )


def test_direct_to_lds_copies_on_gfx950_only(aot_rows):
    for row in aot_rows["gfx950"]:
        # 16-bit K/V tiles go straight to LDS; FP8 is converted in registers on the way.
        if row["name"].endswith("bf16") or row["name"].startswith("prefill"):
            assert row["lds_dma"] > 0, f"{row['name']}: no direct-to-LDS loads on gfx950"
    assert all(row["lds_dma"] == 0 for row in aot_rows["gfx942"])


@pytest.mark.parametrize("arch", ARCHS)
def test_lds_fits_and_nothing_spills_to_memory(aot_rows, arch):
    for row in aot_rows[arch]:
        assert 0 < row["lds"] <= LDS_LIMIT[arch] or row["name"].startswith("decode_reduce"), row
        assert row["scratch"] == 0 and row["vgpr_spills"] == 0, row
        assert row["waves_per_simd"] >= 1, row


def test_committed_report_covers_every_spec(aot_rows):
    """Every compiled specialization has its row in KERNEL_REPORT.md with the same LDS size
    and MFMA instructions. Register counts are left out of the comparison: LLVM's allocation
    can differ by a few registers between otherwise identical compiles."""
    spec = importlib.util.spec_from_file_location("amd_kernel_report", REPORT_SCRIPT)
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    committed = {}
    for line in REPORT.read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 11:
            committed[(cells[0], cells[1])] = cells
    rows = [r for rs in aot_rows.values() for r in rs]
    for line in report.table(rows).splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        got = committed.get((cells[0], cells[1]))
        assert got is not None, f"KERNEL_REPORT.md lacks {cells[0]} on {cells[1]}"
        for col in (4, 5, 8, 10):  # LDS bytes, scratch, MFMA, LDS DMA
            assert got[col] == cells[col], f"KERNEL_REPORT.md is stale for {cells[:2]}: {got}"
