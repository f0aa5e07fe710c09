"""The floor of a decode GEMM's access pattern: stream MoE weight bytes the way the Hopper
fragment GEMM (triton.moe.wgmma) reads them, with no decode and no MMA.

Each CTA reads its own contiguous region (a 64-row weight panel of GPT-OSS-120B's GEMM1: 23
chunks of 4 KB) through a cp.async ring of `stages` steps of `step_kb`, with the kernel's
wait / CTA barrier / issue order, and XORs what lands. Unused ring slots (`pad_kb`) hold the
CTAs per SM where the real kernel's shared memory holds them. The time against the copy floor
(bytes over the device-to-device copy bandwidth) tells how much of the GEMM's own time its
memory pattern explains; the rest is its decode, MMA and latency chain.

The chain table streams both GEMMs' bytes at M=1 (GEMM1's panel, then GEMM2's split share per
CTA) as two launches, as the GEMMs run, and as one, as a fused decode kernel would. The last
table streams them in one launch with the tensor memory accelerator instead (`tma_stream_kernel`:
one thread issues each 16 KB step, an mbarrier per ring slot), with deeper rings and persistent
grids, to tell whether the copy engine or the ring bounds a fused kernel's stream.

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
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.testing import do_bench, do_bench_cudagraph

PANEL_CHUNKS = 23  # GPT-OSS-120B GEMM1: K = 2880 padded to 23 chunks of 128
CHUNK_WORDS = 1024  # 64 rows x 16 int32 words
PANELS = 360  # M=1: 4 experts x 90 panels of 64 rows


@gluon.jit
def _stream_region(base, ring, acc, num_steps, ROWS: gl.constexpr, STAGES: gl.constexpr):
    """XOR num_steps steps of [ROWS, 16] int32 from `base` (pointers of the first step) into acc
    through the ring, with the fragment GEMM's wait / CTA barrier / issue order."""
    layout: gl.constexpr = acc.type.layout
    for p in gl.static_range(STAGES - 1):
        if p < num_steps:
            async_copy.async_copy_global_to_shared(ring.index(p), base + p * ROWS * 16)
        async_copy.commit_group()
    for it in range(STAGES - 1, num_steps + STAGES - 1):
        async_copy.wait_group(STAGES - 2)
        gl.thread_barrier()
        if it < num_steps:
            async_copy.async_copy_global_to_shared(ring.index(it % STAGES), base + it * ROWS * 16)
        async_copy.commit_group()
        acc = acc ^ ring.index((it - (STAGES - 1)) % STAGES).load(layout)
    async_copy.wait_group(0)
    return acc


@gluon.jit
def stream_kernel(
    src,
    out,
    region,
    num_steps,
    src2,
    region2,
    num_steps2,
    ROWS: gl.constexpr,
    STAGES: gl.constexpr,
    PAD: gl.constexpr,
):
    """CTA p reads src[p * region :][: num_steps * ROWS * 16] int32 in steps of [ROWS, 16], then
    src2[p * region2 :][: num_steps2 * ROWS * 16] through the same ring (num_steps2 = 0: none):
    one launch streaming both GEMMs' weights, as a fused decode kernel would."""
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [gl.num_warps(), 1], [1, 0])
    smem_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, 16, layout=gl.SliceLayout(0, layout))
    offsets = rows[:, None] * 16 + cols[None, :]
    pid = gl.program_id(0).to(gl.int64)
    # PAD slots are never used: they only take shared memory, as the real kernel's buffers do.
    ring = gl.allocate_shared_memory(gl.int32, [STAGES + PAD, ROWS, 16], smem_layout)
    acc = gl.zeros([ROWS, 16], gl.int32, layout)
    acc = _stream_region(src + pid * region + offsets, ring, acc, num_steps, ROWS, STAGES)
    if num_steps2 > 0:
        gl.thread_barrier()  # every warp has read the ring's last step before it is refilled
        acc = _stream_region(src2 + pid * region2 + offsets, ring, acc, num_steps2, ROWS, STAGES)
    gl.store(out + gl.program_id(0), gl.sum(gl.sum(acc, axis=1), axis=0))


def graph_us(run, buffer_sets: int) -> float:
    """CUDA-graph time of `run` in us, per buffer set (layer) it streams; run once before the
    graph so that its kernels are compiled outside it."""
    run()
    torch.cuda.synchronize()
    return do_bench_cudagraph(run, rep=100) * 1e3 / buffer_sets


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
                buffer,
                0,
                0,
                ROWS=rows,
                STAGES=stages,
                PAD=pad_kb // step_kb,
                num_warps=warps,
            )

    us = graph_us(run, len(buffers))
    return us, ctas * steps * rows * 64


# Both GEMMs at M=1, whole 16 KB steps of 4 chunks: GEMM1 a 64-row panel of 23 chunks (6 steps,
# the last one partly zero-filled in the GEMM), GEMM2 a split of 12 chunks (3 steps).
CHAIN_STEPS = (6, 3)
CHAIN_STEP_ROWS = 256  # rows of 16 int32 words: 16 KB steps


def time_chain(layers, out, fused: bool, stages: int = 2, pad_kb: int = 32) -> tuple[float, int]:
    """(us per layer, bytes read) streaming each layer's (GEMM1, GEMM2) buffers with PANELS CTAs
    of four warps and 16 KB steps: two launches (the GEMMs as they run now), or one launch whose
    CTAs stream their GEMM1 region and then their GEMM2 region (`fused`)."""
    rows = CHAIN_STEP_ROWS
    steps1, steps2 = CHAIN_STEPS
    region1, region2 = steps1 * rows * 16, steps2 * rows * 16
    common = dict(ROWS=rows, STAGES=stages, PAD=pad_kb // 16, num_warps=4)

    def run():
        for first, second in layers:
            if fused:
                stream_kernel[(PANELS,)](
                    first, out, region1, steps1, second, region2, steps2, **common
                )
            else:
                stream_kernel[(PANELS,)](first, out, region1, steps1, first, 0, 0, **common)
                stream_kernel[(PANELS,)](second, out, region2, steps2, second, 0, 0, **common)

    us = graph_us(run, len(layers))
    return us, PANELS * (steps1 + steps2) * rows * 64


def chain_table(bandwidth: float) -> list[str]:
    """Both GEMMs' weight streams at M=1 over 4 layers' distinct buffers: two launches against
    one, with the ring of the GEMM (2 steps, 3 CTAs per SM) and a deeper one; then the same
    bytes by TMA (tma_chain_table)."""
    steps1, steps2 = CHAIN_STEPS
    layers = [
        tuple(
            torch.randint(
                0,
                1 << 20,
                (PANELS * steps * CHAIN_STEP_ROWS * 16,),
                dtype=torch.int32,
                device="cuda",
            )
            for steps in CHAIN_STEPS
        )
        for _ in range(4)
    ]
    out = torch.empty(PANELS, dtype=torch.int32, device="cuda")
    total = PANELS * (steps1 + steps2) * CHAIN_STEP_ROWS * 64
    lines = [
        "",
        f"Both GEMMs at M=1: {PANELS} CTAs stream {steps1} then {steps2} steps of 16 KB each "
        f"({total / 1e6:.1f} MB per layer, copy floor {total / bandwidth * 1e6:.2f} us), as two "
        "launches or as one:",
        "",
        "| launches | ring steps | unused KB | us per layer | TB/s read |",
        "| --- | --- | --- | --- | --- |",
    ]
    for fused, stages, pad_kb in ((False, 2, 32), (True, 2, 32), (False, 3, 16), (True, 3, 16)):
        us, read = time_chain(layers, out, fused, stages, pad_kb)
        lines.append(
            f"| {1 if fused else 2} | {stages} | {pad_kb} | {us:.2f} | {read / us / 1e6:.2f} |"
        )
        print(lines[-1], flush=True)
    return lines + tma_chain_table(layers, out, bandwidth)


@gluon.jit
def _issue_tma_step(desc1, desc2, ring, ready, step, pid, steps1, steps2, STAGES: gl.constexpr):
    """Step `step` of this CTA's sequence (its steps1 steps of desc1's rows, then steps2 of
    desc2's) into ring slot step % STAGES, signalling that slot's barrier when it lands."""
    ROWS: gl.constexpr = desc1.block_type.shape[0]
    slot = step % STAGES
    mbarrier.expect(ready.index(slot), ROWS * 64)
    if step < steps1:
        row = (pid * steps1 + step) * ROWS
        tma.async_copy_global_to_shared(desc1, [row, 0], ready.index(slot), ring.index(slot))
    else:
        row = (pid * steps2 + step - steps1) * ROWS
        tma.async_copy_global_to_shared(desc2, [row, 0], ready.index(slot), ring.index(slot))


@gluon.jit
def tma_stream_kernel(desc1, desc2, out, steps1, steps2, STAGES: gl.constexpr):
    """CTA p reads its steps1 steps of [ROWS, 16] int32 from desc1 (rows p * steps1 * ROWS ..),
    then its steps2 steps from desc2, by TMA through a ring of STAGES slots, all of them in
    flight: a slot is refilled as soon as every warp has XORed it."""
    ROWS: gl.constexpr = desc1.block_type.shape[0]
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [gl.num_warps(), 1], [1, 0])
    pid = gl.program_id(0)
    ring = gl.allocate_shared_memory(gl.int32, [STAGES, ROWS, 16], desc1.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(STAGES):
        mbarrier.init(ready.index(b), count=1)
    fence_async_shared()  # the barriers' init before the copy engine signals them
    total = steps1 + steps2
    for p in gl.static_range(STAGES):
        if p < total:
            _issue_tma_step(desc1, desc2, ring, ready, p, pid, steps1, steps2, STAGES)
    acc = gl.zeros([ROWS, 16], gl.int32, layout)
    for step in range(total):
        slot = step % STAGES
        mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
        acc = acc ^ ring.index(slot).load(layout)
        gl.thread_barrier()  # every warp has read the slot before the copy engine refills it
        if step + STAGES < total:
            fence_async_shared()
            _issue_tma_step(desc1, desc2, ring, ready, step + STAGES, pid, steps1, steps2, STAGES)
    gl.store(out + pid, gl.sum(gl.sum(acc, axis=1), axis=0))


# The TMA form of the chain, in one launch: (CTAs, panels per CTA, ring steps). 360 CTAs as
# the GEMMs (3 per SM), then 120 (one per SM) streaming three panels' worth each.
TMA_SHAPES = ((PANELS, 1, 2), (PANELS, 1, 3), (PANELS, 1, 4), (PANELS // 3, 3, 4))
TMA_SHAPES += ((PANELS // 3, 3, 8), (PANELS // 3, 3, 12))


# A TMA step lands as the plain row-major tile the cp.async ring holds (no swizzle).
STEP_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


def step_descriptor(buffer: torch.Tensor) -> TensorDescriptor:
    """A TMA descriptor over `buffer` as rows of 16 int32 words, one 16 KB step per copy."""
    return TensorDescriptor.from_tensor(buffer.view(-1, 16), [CHAIN_STEP_ROWS, 16], STEP_LAYOUT)


def time_tma_chain(descriptors, out, ctas: int, panels: int, stages: int) -> float:
    """us per layer streaming each layer's (GEMM1, GEMM2) descriptors with `ctas` CTAs of four
    warps, each taking `panels` GEMM1 panels' steps and as many GEMM2 shares."""
    steps1, steps2 = CHAIN_STEPS

    def run():
        for desc1, desc2 in descriptors:
            tma_stream_kernel[(ctas,)](
                desc1, desc2, out, panels * steps1, panels * steps2, STAGES=stages, num_warps=4
            )

    return graph_us(run, len(descriptors))


def tma_chain_table(layers, out, bandwidth: float) -> list[str]:
    """Both GEMMs' streams at M=1 in one launch by TMA, over the chain table's buffers."""
    steps1, steps2 = CHAIN_STEPS
    total = PANELS * (steps1 + steps2) * CHAIN_STEP_ROWS * 64
    descriptors = [(step_descriptor(first), step_descriptor(second)) for first, second in layers]
    lines = [
        "",
        f"Both GEMMs at M=1 in one launch by TMA ({total / 1e6:.1f} MB per layer, copy floor "
        f"{total / bandwidth * 1e6:.2f} us):",
        "",
        "| CTAs | panels per CTA | ring steps | us per layer | TB/s read |",
        "| --- | --- | --- | --- | --- |",
    ]
    for ctas, panels, stages in TMA_SHAPES:
        us = time_tma_chain(descriptors, out, ctas, panels, stages)
        lines.append(f"| {ctas} | {panels} | {stages} | {us:.2f} | {total / us / 1e6:.2f} |")
        print(lines[-1], flush=True)
    return lines


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
    del buffers
    lines += chain_table(bandwidth)
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
