"""`tokenspeed-kernel aot`: every registered Triton/Gluon kernel compiles for Hopper, CDNA3 and
CDNA4 on a machine with none of them, from its real launches, with the matrix instructions and
memory behaviour its design relies on.

The compiles run in subprocesses: this test session has TRITON_INTERPRET=1, under which kernels
are interpreted functions that cannot be compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

TARGETS = ("sm_90", "gfx942", "gfx950")
_ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def _aot(*args: str, **popen) -> subprocess.Popen:
    command = [sys.executable, "-m", "tokenspeed_kernel.cli", "aot", *args]
    return subprocess.Popen(command, env=_ENV, text=True, **popen)


@pytest.fixture(scope="module")
def aot_rows(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("aot")
    # One process per target, concurrently: each spends its time in LLVM and ptxas.
    procs = {
        t: _aot("--target", t, "--json", str(out / f"{t}.json"), stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT)
        for t in TARGETS
    }  # fmt: skip
    rows = {}
    for target, proc in procs.items():
        log, _ = proc.communicate(timeout=1500)
        path = out / f"{target}.json"
        assert path.exists(), f"aot --target {target} wrote no rows:\n{log[-4000:]}"
        rows[target] = json.loads(path.read_text())["rows"]
    return rows


@pytest.mark.parametrize("target", TARGETS)
def test_every_specialization_compiles(aot_rows, target):
    rows = aot_rows[target]
    kernels = {row["kernel"] for row in rows}
    expected = {"triton.mha_prefill", "triton.mha_decode_with_kvcache", "triton.moe_apply"}
    assert expected <= kernels, f"{target}: kernels with AOT cases: {sorted(kernels)}"
    failed = {row["name"]: row.get("error", row) for row in rows if not row["ok"]}
    assert not failed, f"{target}: {failed}"


@pytest.mark.parametrize("target", TARGETS)
def test_matrix_instructions_and_shared_memory(aot_rows, target):
    rows = aot_rows[target]
    assert any(row["has_dot"] for row in rows), "no kernel with a tl.dot"
    for row in rows:
        assert row["shared"] <= row["shared_limit"], row
        if not row["has_dot"]:
            continue
        if target.startswith("sm_"):
            assert row["wgmma"] or row["mma"], f"{row['name']}: no wgmma/mma in the PTX"
        else:
            assert row["mfma"], f"{row['name']}: no v_mfma in the AMDGCN"


def test_hopper_moe_keeps_weight_fragments_in_registers(aot_rows):
    """triton.moe_apply.sm90's point: MXFP4 words decode straight into wgmma's register A
    operand, so no GEMM stages an operand through shared memory or reloads one with ldmatrix.
    A few st.shared at most, none in the main loop: the epilogue's per-token values (pairs,
    factors) converted into the accumulator layout, GEMM2 polling its tile counter, a GEMM2
    storing fp16 pair rows staging its output tile after the main loop, and the
    warp-specialized kernel's two words by which Triton starts its partitions (plus two per
    epilogue past the first: with fit_widths its consumers have four, 128, 64 and 64 + 32
    columns wide; GEMM2's four epilogues convert their pairs and routing weights too, and its
    128-column one into fp16 pair rows also takes its tile's peak across warps)."""
    from tokenspeed_kernel_triton.moe.fragment_ws_sm90 import _warp_specialized_kernel
    from tokenspeed_kernel_triton.moe.wgmma_gemm_sm90 import _fragment_gemm_kernel

    half_rows = f"({[p.name for p in _fragment_gemm_kernel.params].index('HALF_ROWS')},)"
    ws_params = [p.name for p in _warp_specialized_kernel.params]
    fit_widths_key = f"({ws_params.index('FIT_WIDTHS')},)"
    swiglu_key = f"({ws_params.index('SWIGLU')},)"
    gemms = [
        row
        for row in aot_rows["sm_90"]
        if row["kernel"] == "triton.moe_apply.sm90" and row["wgmma"]
    ]
    assert gemms, "no wgmma specialization of triton.moe_apply.sm90"
    specialized = [row for row in gemms if row["fn"] == "_warp_specialized_kernel"]
    assert any(row["constexprs"][swiglu_key] == "True" for row in specialized)  # GEMM1
    assert any(row["constexprs"][swiglu_key] == "False" for row in specialized)  # GEMM2
    # GEMM2 into a TP shard's fp16 pair rows, at 128 columns.
    assert any(
        row["constexprs"][swiglu_key] == "False" and row["constexprs"][fit_widths_key] == "False"
        for row in specialized
    )
    assert any(row["constexprs"].get(half_rows) == "True" for row in gemms)
    assert any(row["constexprs"][fit_widths_key] == "True" for row in specialized)
    for row in gemms:
        assert not row["ldmatrix"], row
        limit = 4
        if row in specialized and row["constexprs"][swiglu_key] == "False":
            limit = 18 if row["constexprs"][fit_widths_key] == "True" else 8
        elif row in specialized and row["constexprs"][fit_widths_key] == "True":
            limit = 10
        assert row["shared_stores"] <= limit, row


@pytest.mark.parametrize("target", ("gfx942", "gfx950"))
def test_amd_kernels_use_buffer_ops_and_never_spill(aot_rows, target):
    rows = [row for row in aot_rows[target] if row["kernel"].startswith("amd.")]
    assert rows, f"no amd kernel compiled for {target}"
    for row in rows:
        assert row["buffer_load"] > 0, f"{row['name']}: no buffer loads"
        # No register spills. A few words of stack are allowed: the FP8 sliding-window extend
        # launch on gfx942 keeps 20 bytes there (it did before the AOT check saw real launches).
        assert row["vgpr_spills"] == 0 and row["scratch"] <= 32, row


def test_direct_to_lds_copies_on_gfx950_only(aot_rows):
    amd = {t: [r for r in aot_rows[t] if r["kernel"].startswith("amd.mha")] for t in TARGETS[1:]}
    assert any(row["lds_dma"] for row in amd["gfx950"]), "no direct-to-LDS load on gfx950"
    assert not any(row["lds_dma"] for row in amd["gfx942"])


PROBE = textwrap.dedent(
    """
    import os, sys
    os.environ.pop("TRITON_INTERPRET", None)
    import triton, triton.language as tl
    import tokenspeed_kernel as tk
    from tokenspeed_kernel.tools import aot

    @triton.jit
    def _copy(K, KC, Slots, stride, odd, D: tl.constexpr):
        pid = tl.program_id(0)
        slot = tl.load(Slots + pid)
        offs = tl.arange(0, D)
        tl.store(KC + slot * stride + offs, tl.load(K + pid * stride + odd * 0 + offs))

    def store(k, v, k_cache, v_cache, *, slot_mapping, k_scale, v_scale):
        _copy[(k.shape[0],)](k, k_cache, slot_mapping, k.stride(0), 7, D=k.shape[-1])

    tk.register_kernel(
        "kvcache_store", name="probe.kvcache_store", backend="probe",
        platforms=["nvidia:sm_80+"], priority=1,
        traits=dict(dtype=tk.ANY, kv_dtype=tk.ANY, head_dim=tk.ANY, page_size=tk.ANY),
        aot_cases=[dict(num_tokens=5, num_kv_heads=1, head_dim=64, page_size=16, num_pages=4)],
    )(store)
    [launch] = aot.run_case_launches(tk.get_kernel("kvcache_store", "probe.kvcache_store"),
                                     {"num_tokens": 5, "num_kv_heads": 1, "head_dim": 64,
                                      "page_size": 16, "num_pages": 4}, "sm_90")
    print(launch.signature)
    print(sorted(k for k, v in launch.attrs.items() if v))
    [row] = aot.check_target("sm_90", "probe.*")
    print(row["ok"], row["fn"])
    """
)


def test_signatures_come_from_the_launch(tmp_path):
    """The JIT's own binder types the arguments: pointers by dtype, the stride (64, a multiple
    of 16) marked divisible, D a constexpr; nothing is hand-typed."""
    script = tmp_path / "probe.py"  # @triton.jit needs its source in a file
    script.write_text(PROBE)
    done = subprocess.run(
        [sys.executable, str(script)],
        env={**_ENV, "TOKENSPEED_KERNEL_PLUGINS": ""},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    signature, attrs, row = done.stdout.strip().splitlines()[-3:]
    assert "'K': '*bf16'" in signature and "'Slots': '*i64'" in signature, signature
    assert "'odd': 'i32'" in signature and "'D': 'constexpr'" in signature, signature
    # The pointers and the stride (64) are divisible by 16; 7 is not.
    assert attrs == "[(0,), (1,), (2,), (3,)]", attrs
    assert row == "True _copy"
