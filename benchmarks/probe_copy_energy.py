"""Probe: energy per byte of cp.async copies into shared memory, from an L2-resident buffer and
from HBM, in the MoE producer's pattern ([128, 128] bf16 tiles, 16 bytes a thread, 3 groups in
flight), idle power, and a dense bf16 matmul's energy per FLOP with random and with
MXFP4-valued operands. On the GPU, from benchmarks/: python3 probe_copy_energy.py"""

import functools

import torch
from energy import per_call
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

_COPY = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0]))
_SMEM = gl.constexpr(gl.NVMMASharedLayout.get_default_for([128, 128], gl.bfloat16))
TILE = 128 * 128


@gluon.jit
def _copies(src, n_tiles, iters, out):
    pid = gl.program_id(0)
    ring = gl.allocate_shared_memory(gl.bfloat16, [4, 128, 128], _SMEM)
    r = gl.arange(0, 128, layout=gl.SliceLayout(1, _COPY))
    c = gl.arange(0, 128, layout=gl.SliceLayout(0, _COPY))
    offs = r[:, None] * 128 + c[None, :]
    for i in range(iters):
        tile = (pid * 7919 + i * 104729) % n_tiles
        async_copy.async_copy_global_to_shared(
            ring.index(i % 4), src + tile.to(gl.int64) * 16384 + offs
        )
        async_copy.commit_group()
        async_copy.wait_group(2)
    async_copy.wait_group(0)
    # Never stored (offs >= 0): keeps the copies' destination live.
    gl.store(out + pid * 16384 + offs, ring.index(0).load(_COPY), mask=offs < 0)


def graph_time(fn, n=20):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n * 1e3


def copies(megabytes: int, ctas: int, iters: int = 2000) -> str:
    src = torch.randn(megabytes * 2**20 // 2, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(ctas * TILE, dtype=torch.bfloat16, device="cuda")
    fn = functools.partial(_copies[(ctas,)], src, src.numel() // TILE, iters, out, num_warps=4)
    us = graph_time(fn)
    mj, watts = per_call(fn, seconds=1.0)
    nbytes = ctas * iters * TILE * 2
    return (
        f"copies from {megabytes} MB, {ctas} CTAs: {us:.1f} us, {nbytes / us / 1e6:.2f} TB/s, "
        f"{mj:.2f} mJ, {watts:.0f} W, {mj * 1e9 / nbytes:.1f} pJ/B"
    )


def matmul(label: str, x: torch.Tensor, y: torch.Tensor) -> str:
    out = torch.empty(x.shape[0], y.shape[1], device="cuda", dtype=torch.bfloat16)
    fn = functools.partial(torch.matmul, x, y, out=out)
    us = graph_time(fn)
    mj, watts = per_call(fn, seconds=1.5)
    flops = 2 * x.shape[0] * x.shape[1] * y.shape[1]
    return (
        f"matmul {label}: {us:.1f} us, {flops / us / 1e6:.0f} TFLOP/s, {mj:.1f} mJ, "
        f"{watts:.0f} W, {mj * 1e9 / flops:.3f} pJ/FLOP"
    )


def main() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for megabytes in (16, 32, 48, 4096):
        for ctas in (sms, 2 * sms):
            print(copies(megabytes, ctas), flush=True)
    _, watts = per_call(functools.partial(torch.cuda._sleep, 2_000_000), seconds=1.0)
    print(f"idle (a sleep kernel): {watts:.0f} W", flush=True)
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.bfloat16)
    b = torch.randn(n, n, device="cuda").to(torch.bfloat16)
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], device="cuda")
    e2m1 = torch.cat((e2m1, -e2m1))
    codes = torch.randint(0, 16, (n, n), device="cuda")
    scales = 2.0 ** torch.randint(-8, -5, (n, n // 32), device="cuda")
    w = (e2m1[codes] * scales.repeat_interleave(32, 1)).to(torch.bfloat16)
    print(matmul("random x random", a, b), flush=True)
    print(matmul("MXFP4 values x random", w, b), flush=True)


if __name__ == "__main__":
    main()
