"""Ahead-of-time compile of every registered Triton kernel specialization (tokenspeed_kernel_triton
.aot.AOT_KERNELS) for Hopper and CDNA3/CDNA4, on a machine with none of them: catches compile
errors, lost matrix instructions and shared-memory (LDS) overflows before a GPU run.

Runs scripts/aot_check.py in subprocesses: this session may have imported the kernels under
TRITON_INTERPRET=1, and interpreted functions cannot be compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "aot_check.py"
TARGETS = ("sm_90", "gfx942", "gfx950")


@pytest.fixture(scope="module")
def aot_rows() -> dict[str, list[dict]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # One process per target, concurrently: each spends its time in LLVM/ptxas.
    procs = {
        target: subprocess.Popen(
            [sys.executable, str(SCRIPT), "--package", "triton", "--target", target],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for target in TARGETS
    }
    rows = {}
    for target, proc in procs.items():
        out, err = proc.communicate(timeout=900)
        assert out.strip(), f"aot_check.py --target {target} printed nothing:\n{err[-3000:]}"
        rows[target] = json.loads(out)
    return rows


@pytest.mark.parametrize("target", TARGETS)
def test_every_spec_compiles(aot_rows, target):
    rows = aot_rows[target]
    assert rows, f"no AOT specs registered for {target}"
    failed = {row["name"]: row["error"] for row in rows if not row["ok"]}
    assert not failed, f"{target}: {failed}"


@pytest.mark.parametrize("target", TARGETS)
def test_matrix_instructions_and_shared_memory(aot_rows, target):
    assert any(row.get("has_dot") for row in aot_rows[target]), "no kernel with a tl.dot"
    for row in aot_rows[target]:
        if not row["ok"]:
            continue
        assert row["shared"] <= row["shared_limit"], (
            f"{row['name']}: {row['shared']} B of shared memory > {row['shared_limit']}"
        )
        if not row["has_dot"]:
            continue
        if target.startswith("sm_"):
            assert row["wgmma"] or row["mma"], f"{row['name']}: no wgmma/mma in the PTX"
        else:
            assert row["mfma"], f"{row['name']}: no v_mfma in the AMDGCN"


def test_hopper_moe_keeps_weight_fragments_in_registers(aot_rows):
    """triton.moe.wgmma's point: MXFP4 words decode straight into wgmma's register A operand.
    Words and activations arrive by cp.async (the decode tiles read the words back from the
    ring with one 16-byte ld.shared per row), so no specialization stages an operand in
    shared memory or reloads one with ldmatrix, as the portable kernel's decode -> st.shared
    -> ldmatrix path does."""
    rows = [row for row in aot_rows["sm_90"] if row["name"].startswith("moe_wgmma_")]
    from tokenspeed_kernel_triton.moe import fragment_config, wgmma_gemm

    # Every tile config in every (GEMM, intermediate, weight decode) form it takes: post-scaled
    # configs take shift-decoded GEMM1 weights and fp16 GEMM2s only.
    post_forms = [
        (gemm1, inter, dec)
        for gemm1, inter, dec in wgmma_gemm._AOT_VARIANTS
        if dec == "shift" and (gemm1 or inter == "fp16")
    ]
    expected = sum(
        len(post_forms if config.post_scale else wgmma_gemm._AOT_VARIANTS)
        for _, config in fragment_config.CONFIGS
    )
    assert len(rows) == expected, [row["name"] for row in rows]
    for row in rows:
        assert row["ok"] and row["wgmma"], row
        # One st.shared where GEMM2 polls its tile's counter (thread 0 loads it, the CTA
        # reads it back): none for operands.
        polls = "gemm2" in row["name"] and "_tiles" in row["name"]
        assert row["shared_stores"] == int(polls) and not row["ldmatrix"], row
        # Decode configs launch dependently: both GEMMs let the next kernel start early and
        # wait for their predecessor's grid, except GEMM2 waiting for GEMM1 tile by tile.
        pdl = "_pdl" in row["name"]
        waits_for_grid = pdl and ("gemm1" in row["name"] or "_tiles" not in row["name"])
        assert row["launch_dependents"] == pdl, row
        assert row["grid_wait"] == waits_for_grid, row


def test_hopper_moe_decode_neighbours_join_the_dependent_launch(aot_rows):
    """Around the decode GEMMs: the one-program router lets GEMM1 start early, and the combine
    waits for GEMM2 (their sm_90 specializations); AMD's have neither."""
    for target in aot_rows:
        rows = {row["name"]: row for row in aot_rows[target]}
        sm90 = target == "sm_90"
        assert rows["moe_route_small"]["launch_dependents"] == sm90, target
        assert rows["moe_combine"]["grid_wait"] == sm90, target
