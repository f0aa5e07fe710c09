"""The floor of a decode GEMM's access pattern: stream MoE weight bytes the way the Hopper
fragment GEMM (triton.moe.wgmma) reads them, with no decode and no MMA.

Each CTA reads its own contiguous region (a 64-row weight panel of GPT-OSS-120B's GEMM1: 23
chunks of 4 KB) through a cp.async ring of `stages` steps of `step_kb`, with the kernel's
wait / CTA barrier / issue order, and XORs what lands. Unused ring slots (`pad_kb`) hold the
CTAs per SM where the real kernel's shared memory holds them. The time against the copy floor
(bytes over the device-to-device copy bandwidth) tells how much of the GEMM's own time its
memory pattern explains; the rest is its decode, MMA and latency chain.

    python3 benchmarks/bench_weight_stream.py [--out FILE.md]

Timed with CUDA graphs over four distinct buffers (L2-cold), per kernel.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.testing import do_bench, do_bench_cudagraph

PANEL_CHUNKS = 23  # GPT-OSS-120B GEMM1: K = 2880 padded to 23 chunks of 128
CHUNK_WORDS = 1024  # 64 rows x 16 int32 words
PANELS = 360  # M=1: 4 experts x 90 panels of 64 rows


@gluon.jit
def stream_kernel(
    src, out, region, num_steps, ROWS: gl.constexpr, STAGES: gl.constexpr, PAD: gl.constexpr
):
    """CTA p reads src[p * region :][: num_steps * ROWS * 16] int32 in steps of [ROWS, 16]."""
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [gl.num_warps(), 1], [1, 0])
    smem_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, 16, layout=gl.SliceLayout(0, layout))
    base = src + gl.program_id(0).to(gl.int64) * region + rows[:, None] * 16 + cols[None, :]
    # PAD slots are never used: they only take shared memory, as the real kernel's buffers do.
    ring = gl.allocate_shared_memory(gl.int32, [STAGES + PAD, ROWS, 16], smem_layout)
    for p in gl.static_range(STAGES - 1):
        async_copy.async_copy_global_to_shared(ring.index(p), base + p * ROWS * 16)
        async_copy.commit_group()
    acc = gl.zeros([ROWS, 16], gl.int32, layout)
    for it in range(STAGES - 1, num_steps + STAGES - 1):
        async_copy.wait_group(STAGES - 2)
        gl.thread_barrier()
        if it < num_steps:
            async_copy.async_copy_global_to_shared(ring.index(it % STAGES), base + it * ROWS * 16)
        async_copy.commit_group()
        acc = acc ^ ring.index((it - (STAGES - 1)) % STAGES).load(layout)
    async_copy.wait_group(0)
    gl.store(out + gl.program_id(0), gl.sum(gl.sum(acc, axis=1), axis=0))


# (CTAs, warps, step KB, ring steps, unused KB): GEMM1's shape at M=1 first (360 CTAs, 16 KB
# steps, two of them, ~50 KB of shared memory: 3 CTAs per SM), then deeper rings, more and
# fewer CTAs per SM, and persistent grids.
SHAPES = (
    (PANELS, 4, 16, 2, 32),
    (PANELS, 4, 16, 3, 16),
    (PANELS, 4, 8, 6, 0),
    (PANELS, 4, 16, 2, 0),
    (PANELS, 4, 16, 4, 0),
    (264, 4, 16, 4, 32),
    (132, 4, 16, 8, 64),
    (132, 8, 16, 8, 64),
    (2 * PANELS, 4, 8, 2, 0),
)


def time_shape(buffers, out, ctas, warps, step_kb, stages, pad_kb) -> tuple[float, int]:
    """(us per kernel, bytes read) for one shape over the buffers in turn."""
    total = buffers[0].numel()
    region = total // ctas
    rows = step_kb * 1024 // 64
    steps = region // (rows * 16)

    def run():
        for buffer in buffers:
            stream_kernel[(ctas,)](
                buffer,
                out,
                region,
                steps,
                ROWS=rows,
                STAGES=stages,
                PAD=pad_kb // step_kb,
                num_warps=warps,
            )

    run()
    torch.cuda.synchronize()
    us = do_bench_cudagraph(run, rep=100) * 1e3 / len(buffers)
    return us, ctas * steps * rows * 64


def copy_bandwidth() -> float:
    """Bytes read + written per second of a 1 GiB device-to-device copy (as bench_moe.py)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (do_bench(lambda: dst.copy_(src)) * 1e-3)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    total = PANELS * PANEL_CHUNKS * CHUNK_WORDS
    buffers = [
        torch.randint(0, 1 << 20, (total,), dtype=torch.int32, device="cuda") for _ in range(4)
    ]
    out = torch.empty(2 * PANELS, dtype=torch.int32, device="cuda")
    bandwidth = copy_bandwidth()
    lines = [
        f"# Weight stream floor, {torch.cuda.get_device_name()}, {datetime.date.today()}",
        "",
        f"{total * 4 / 1e6:.1f} MB (GPT-OSS-120B GEMM1 at M=1); copy bandwidth "
        f"{bandwidth / 1e12:.2f} TB/s, so the copy floor is {total * 4 / bandwidth * 1e6:.2f} us.",
        "",
        "| CTAs | warps | step KB | ring steps | unused KB | us | TB/s read |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    print("\n".join(lines), flush=True)
    for shape in SHAPES:
        us, read = time_shape(buffers, out, *shape)
        lines.append("| " + " | ".join(map(str, shape)) + f" | {us:.2f} | {read / us / 1e6:.2f} |")
        print(lines[-1], flush=True)
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
