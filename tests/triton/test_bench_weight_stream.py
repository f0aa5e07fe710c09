"""benchmarks/bench_weight_stream.py's kernels compile for Hopper without a GPU: the cp.async
stream, taking the shared memory that holds its CTAs per SM where the GEMM's would, and the TMA
stream, with one 16 KB slot and one mbarrier per ring step.

Compiled in a subprocess: this session may run Triton under TRITON_INTERPRET=1, and
interpreted functions cannot be compiled (as tests/triton/test_aot.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_weight_stream.py"
RINGS = ((2, 0), (2, 2), (3, 1))  # (ring steps, unused slots) of 16 KB
TMA_RINGS = (2, 4)

COMPILE = f"""
import importlib.util, json
from tokenspeed_kernel_triton.aot import compile_for
spec = importlib.util.spec_from_file_location("bench_weight_stream", {str(BENCH)!r})
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
rows = []
for stages, pad in {RINGS!r}:
    asm = compile_for(
        bench.stream_kernel,
        {{"src": "*i32", "out": "*i32", "region": "i32", "num_steps": "i32", "src2": "*i32",
          "region2": "i32", "num_steps2": "i32"}},
        dict(ROWS=256, STAGES=stages, PAD=pad),
        "sm_90",
        divisible=("src", "out", "region", "src2", "region2"),
    )
    rows.append(("cp.async.cg.shared.global" in asm["ptx"], asm["shared"]))
desc = f"tensordesc<i32[{{bench.CHAIN_STEP_ROWS}}, 16],{{bench.STEP_LAYOUT!r}}>"
tma_rows = []
for stages in {TMA_RINGS!r}:
    asm = compile_for(
        bench.tma_stream_kernel,
        {{"desc1": desc, "desc2": desc, "out": "*i32", "steps1": "i32", "steps2": "i32"}},
        dict(STAGES=stages),
        "sm_90",
        divisible=("out",),
    )
    ptx = asm["ptx"]
    tma_rows.append(("cp.async.bulk.tensor.2d" in ptx and "cp.async.cg" not in ptx,
                     "mbarrier.try_wait" in ptx, asm["shared"]))
print(json.dumps(dict(rows=rows, tma_rows=tma_rows, shapes=bench.SHAPES,
                      panel_bytes=bench.PANEL_CHUNKS * bench.CHUNK_WORDS * 4,
                      panels=bench.PANELS)))
"""


def test_stream_kernels_compile_with_their_rings_and_start_at_the_gemm_shape():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", COMPILE], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    for (stages, pad), (copies, shared) in zip(RINGS, result["rows"], strict=True):
        assert copies, (stages, pad)
        assert shared == (stages + pad) * 16 * 1024, (stages, pad, shared)
    for stages, (bulk_copies, waits, shared) in zip(TMA_RINGS, result["tma_rows"], strict=True):
        assert bulk_copies and waits, stages
        # The slots, then one 8-byte mbarrier per slot (padded to 16 bytes).
        assert stages * 16 * 1024 < shared <= stages * 16 * 1024 + max(16, 8 * stages), shared
    # The first shape is the fragment GEMM's decode tile at M=1: 360 CTAs (4 experts x 90
    # panels of 92 KB) of four warps, two 16 KB steps and 32 KB unused: 48 KB, 3 CTAs per SM.
    assert result["shapes"][0] == [360, 4, 16, 2, 32]
    assert (result["panels"], result["panel_bytes"]) == (360, 23 * 4096)
