"""benchmarks/bench_weight_stream.py's kernel compiles for Hopper without a GPU, streams by
cp.async, and takes the shared memory that holds its CTAs per SM where the GEMM's would.

Compiled in a subprocess: this session may run Triton under TRITON_INTERPRET=1, and
interpreted functions cannot be compiled (as tests/triton/test_aot.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_weight_stream.py"
RINGS = ((2, 0), (2, 2), (3, 1))  # (ring steps, unused slots) of 16 KB

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
print(json.dumps(dict(rows=rows, shapes=bench.SHAPES, panel_bytes=bench.PANEL_CHUNKS
                      * bench.CHUNK_WORDS * 4, panels=bench.PANELS)))
"""


def test_stream_kernel_compiles_with_its_ring_and_starts_at_the_gemm_shape():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", COMPILE], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    for (stages, pad), (copies, shared) in zip(RINGS, result["rows"], strict=True):
        assert copies, (stages, pad)
        assert shared == (stages + pad) * 16 * 1024, (stages, pad, shared)
    # The first shape is the fragment GEMM's decode tile at M=1: 360 CTAs (4 experts x 90
    # panels of 92 KB) of four warps, two 16 KB steps and 32 KB unused: 48 KB, 3 CTAs per SM.
    assert result["shapes"][0] == [360, 4, 16, 2, 32]
    assert (result["panels"], result["panel_bytes"]) == (360, 23 * 4096)
