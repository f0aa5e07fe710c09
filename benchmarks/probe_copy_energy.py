"""Probe: energy per byte of weight words reaching registers, through shared memory (cp.async
into a 4-slot ring, 3 groups in flight, then 16-byte loads from the ring: the MoE kernels'
path) against 16-byte loads straight from global memory, [128, 64] int32 tiles XORed into
registers, from an L2-sized buffer and from HBM; with idle power (128 W) taken out too.
On the GPU, from benchmarks/: python3 probe_copy_energy.py"""

import functools

import torch
from energy import per_call
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

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


@gluon.jit
def _tma_copies(desc, n_tiles, iters, out):
    pid = gl.program_id(0)
    ring = gl.allocate_shared_memory(gl.bfloat16, [4, 128, 128], _SMEM)
    bars = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(4):
        mbarrier.init(bars.index(s), count=1)
    for i in range(iters):
        if i >= 3:
            # Copy i - 3 landed, so at most three are in flight and slot i % 4 (copy i - 4,
            # waited for last iteration) is free.
            mbarrier.wait(bars.index((i - 3) % 4), (i - 3) // 4 % 2)
        tile = (pid * 7919 + i * 104729) % n_tiles
        mbarrier.expect(bars.index(i % 4), 32768)
        tma.async_copy_global_to_shared(desc, [tile * 128, 0], bars.index(i % 4), ring.index(i % 4))
    for j in gl.static_range(3):
        i = iters - 3 + j
        mbarrier.wait(bars.index(i % 4), i // 4 % 2)
    r = gl.arange(0, 128, layout=gl.SliceLayout(1, _COPY))
    c = gl.arange(0, 128, layout=gl.SliceLayout(0, _COPY))
    offs = r[:, None] * 128 + c[None, :]
    gl.store(out + pid * 16384 + offs, ring.index(0).load(_COPY), mask=offs < 0)


_WORDS = gl.constexpr(gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0]))
_PLAIN = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))


@gluon.jit
def _through_smem(src, n_tiles, iters, out, never):
    pid = gl.program_id(0)
    ring = gl.allocate_shared_memory(gl.int32, [4, 128, 64], _PLAIN)
    r = gl.arange(0, 128, layout=gl.SliceLayout(1, _WORDS))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, _WORDS))
    offs = r[:, None] * 64 + c[None, :]
    acc = gl.zeros([128, 64], gl.int32, _WORDS)
    for i in range(iters):
        tile = (pid * 7919 + i * 104729) % n_tiles
        async_copy.async_copy_global_to_shared(
            ring.index(i % 4), src + tile.to(gl.int64) * 8192 + offs
        )
        async_copy.commit_group()
        async_copy.wait_group(2)
        gl.thread_barrier()
        if i >= 2:
            acc ^= ring.index((i - 2) % 4).load(_WORDS)
    async_copy.wait_group(0)
    # never = -1 at run time: the XORs and the loads they take stay live.
    gl.store(out + pid * 8192 + offs, acc, mask=offs < never)


@gluon.jit
def _to_registers(src, n_tiles, iters, out, never):
    pid = gl.program_id(0)
    r = gl.arange(0, 128, layout=gl.SliceLayout(1, _WORDS))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, _WORDS))
    offs = r[:, None] * 64 + c[None, :]
    acc = gl.zeros([128, 64], gl.int32, _WORDS)
    for i in range(iters):
        tile = (pid * 7919 + i * 104729) % n_tiles
        acc ^= gl.load(src + tile.to(gl.int64) * 8192 + offs)
    # never = -1 at run time: the XORs and the loads they take stay live.
    gl.store(out + pid * 8192 + offs, acc, mask=offs < never)


def to_registers(megabytes: int, ctas: int, direct: bool, iters: int = 2000) -> str:
    src = torch.randint(-(2**31), 2**31 - 1, (megabytes * 2**20 // 4,), device="cuda",
                        dtype=torch.int32)  # fmt: skip
    out = torch.empty(ctas * 8192, dtype=torch.int32, device="cuda")
    kernel = _to_registers if direct else _through_smem
    fn = functools.partial(kernel[(ctas,)], src, src.numel() // 8192, iters, out, -1, num_warps=4)
    us = graph_time(fn)
    mj, watts = per_call(fn, seconds=1.0)
    nbytes = ctas * iters * 8192 * 4
    net = mj - 0.128 * us
    how = "ld.global" if direct else "cp.async + ld.shared"
    return (
        f"{how} from {megabytes} MB, {ctas} CTAs: {us:.1f} us, {nbytes / us / 1e6:.2f} TB/s, "
        f"{mj:.2f} mJ, {watts:.0f} W, {mj * 1e9 / nbytes:.1f} pJ/B, "
        f"{net * 1e9 / nbytes:.1f} pJ/B without idle"
    )


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


def copies(megabytes: int, ctas: int, by_tma: bool, iters: int = 2000) -> str:
    src = torch.randn(megabytes * 2**20 // 2, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(ctas * TILE, dtype=torch.bfloat16, device="cuda")
    if by_tma:
        desc = TensorDescriptor.from_tensor(src.view(-1, 128), [128, 128], _SMEM.value)
        kernel, source = _tma_copies, desc
    else:
        kernel, source = _copies, src
    fn = functools.partial(kernel[(ctas,)], source, src.numel() // TILE, iters, out, num_warps=4)
    us = graph_time(fn)
    mj, watts = per_call(fn, seconds=1.0)
    nbytes = ctas * iters * TILE * 2
    how = "TMA" if by_tma else "cp.async"
    return (
        f"{how} from {megabytes} MB, {ctas} CTAs: {us:.1f} us, {nbytes / us / 1e6:.2f} TB/s, "
        f"{mj:.2f} mJ, {watts:.0f} W, {mj * 1e9 / nbytes:.1f} pJ/B"
    )


def main() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for megabytes in (48, 4096):
        for ctas in (sms, 2 * sms, 4 * sms):
            for direct in (False, True):
                print(to_registers(megabytes, ctas, direct), flush=True)


if __name__ == "__main__":
    main()
