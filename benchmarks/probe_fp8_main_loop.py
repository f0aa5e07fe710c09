"""Probe: the Hopper MoE main loop with e4m3 fragments and FP8 wgmma against bf16 (issue 23).

Both kernels run a 128-row x 128-token tile on 4 warps over K chunks of 128: load the chunk's
words (L2-resident, one chunk ahead), decode them into wgmma's register A operand, multiply by a
static activation tile in shared memory. bf16: shift_words_sm90's decode with the e8m0 factor
(the shipped decode). fp8: the K order within a chunk is permuted so that lane quad q of a
thread's row holds only scale block q (4 words of 8 elements), and each word decodes with two
prmt lookups into a table of the block's 8 e4m3 magnitudes (built from one byte B = (R + 6) * 8,
R the block's exponent relative to its row, with 2 prmt + 2 add per row and chunk), a mask, a
shift and a sign lop3 per 4 elements.

    python3 benchmarks/probe_fp8_main_loop.py compile bf16 fp8   # SASS in /tmp, no GPU
    python3 benchmarks/probe_fp8_main_loop.py debug              # decode bit for bit (GPU)
    python3 benchmarks/probe_fp8_main_loop.py gpu                # numerics and speed (GPU)
"""

import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from tokenspeed_kernel_triton.moe.fragment_layout_sm90 import kernel_layouts
from tokenspeed_kernel_triton.moe.fragment_steps_sm90 import decode_fragment

W, T = 128, 128
NW = gl.constexpr(4)

L4 = gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 1, 0], [0, 0, 2, 0], [8, 0, 0, 0], [64, 0, 0, 0]],
    lane_bases=[[0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
    warp_bases=[[16, 0, 0, 0], [32, 0, 0, 0]],
    block_bases=[],
    shape=[W, 4, 4, 4],
)
MMA8 = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, 128, 32])
DOT8 = gl.DotOperandLayout(operand_index=0, parent=MMA8, k_width=4)

FP8_DECODE = gl.constexpr("""{
.reg .b32 m, s;
and.b32 m, $2, 0x7777;
prmt.b32 $0, $6, $10, m;
shl.b32 s, $2, 4;
lop3.b32 $0, s, 0x80808080, $0, 0xEA;
shr.u32 m, $2, 16;
and.b32 m, m, 0x7777;
prmt.b32 $1, $6, $10, m;
lop3.b32 $1, $2, 0x80808080, $1, 0xEA;
}""")
TABLE = gl.constexpr("{ .reg .b32 r; prmt.b32 r, $1, 0, $2; add.s32 $0, r, $3; }")


@gluon.jit
def fp8_fragment(words3, sw, L4: gl.constexpr, DOT8: gl.constexpr):
    """words3 [W, 4 q, 4 c] int32 in Slice(3, L4); sw [W, 4 q] scale words (4 B bytes of the
    row's blocks) in Slice(2, Slice(3, L4)) -> [W, 128] e4m3 in DOT8."""
    L3: gl.constexpr = gl.SliceLayout(3, L4)
    q = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))[None, :]
    zero = gl.zeros_like(sw)
    thi = gl.inline_asm_elementwise(
        TABLE,
        "=r,r,r,r",
        [sw, q * 0x1111 + zero, zero + 0x1C181410],
        dtype=gl.int32,
        is_pure=True,
        pack=1,
    )
    tlo = gl.inline_asm_elementwise(
        TABLE,
        "=r,r,r,r",
        [sw, q * 0x1110 + 4 + zero, zero + 0x0C080000],
        dtype=gl.int32,
        is_pure=True,
        pack=1,
    )
    zero4 = gl.zeros([words3.shape[0], 4, 4, 4], gl.int32, L4)
    w4 = gl.expand_dims(words3, 3) + zero4
    thi4 = gl.expand_dims(gl.expand_dims(thi, 2), 3) + zero4
    tlo4 = gl.expand_dims(gl.expand_dims(tlo, 2), 3) + zero4
    o1, o2 = gl.inline_asm_elementwise(
        FP8_DECODE,
        "=r,=r" + ",r" * 12,
        [w4, tlo4, thi4],
        dtype=(gl.float8e4nv, gl.float8e4nv),
        is_pure=True,
        pack=4,
    )
    f = gl.join(o1, o2)  # [W, q, c, i, h]
    f = gl.permute(f, (0, 2, 4, 1, 3))  # [W, c, h, q, i]
    f = gl.reshape(f, [words3.shape[0], 128])
    return gl.convert_layout(f, DOT8, assert_trivial=True)


@gluon.jit
def probe_fp8(
    w_ptr,
    s_ptr,
    b_ptr,
    out_ptr,
    CHUNKS: gl.constexpr,
    REPS: gl.constexpr,
    L4: gl.constexpr,
    MMA8: gl.constexpr,
    DOT8: gl.constexpr,
    WAIT: gl.constexpr = 0,
):
    L3: gl.constexpr = gl.SliceLayout(3, L4)
    rows = gl.arange(0, 128, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    qq = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    cc = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    # words [CHUNKS, 128 rows, 16] int32, word 4q + c
    wp = w_ptr + rows[:, None, None] * 16 + (qq * 4)[None, :, None] + cc[None, None, :]
    sp = s_ptr + rows  # [CHUNKS, 128] int32
    # activations [128 tokens, 128 K] fp8, static in smem
    bl: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [NW, 1], [1, 0])
    tr = gl.arange(0, 128, layout=gl.SliceLayout(1, bl))
    tk = gl.arange(0, 128, layout=gl.SliceLayout(0, bl))
    b = gl.load(b_ptr + tr[:, None] * 128 + tk[None, :])
    b_smem = gl.allocate_shared_memory(
        gl.float8e4nv,
        [128, 128],
        gl.NVMMASharedLayout.get_default_for([128, 128], gl.float8e4nv),
        b,
    )
    fence_async_shared()
    bt = b_smem.permute((1, 0))
    acc = gl.zeros([128, 128], gl.float32, MMA8)
    words = gl.load(wp)
    sw = gl.load(sp)
    for it in range(REPS * CHUNKS):
        it % CHUNKS
        nxt = (it + 1) % CHUNKS
        words_n = gl.load(wp + nxt * 128 * 16)
        sw_n = gl.load(sp + nxt * 128)
        frag = fp8_fragment(
            words, sw[:, None] + gl.zeros([128, 4], gl.int32, gl.SliceLayout(2, L3)), L4, DOT8
        )
        acc = warpgroup_mma(frag, bt, acc, is_async=True)
        acc = warpgroup_mma_wait(WAIT, deps=[acc])
        words = words_n
        sw = sw_n
    acc = warpgroup_mma_wait(0, deps=[acc])
    orow = gl.arange(0, 128, layout=gl.SliceLayout(1, MMA8))
    ocol = gl.arange(0, 128, layout=gl.SliceLayout(0, MMA8))
    pid = gl.program_id(0)
    gl.store(out_ptr + pid * 128 * 128 + orow[:, None] * 128 + ocol[None, :], acc)


@gluon.jit
def probe_bf16(
    w_ptr,
    s_ptr,
    b_ptr,
    out_ptr,
    CHUNKS: gl.constexpr,
    REPS: gl.constexpr,
    mma: gl.constexpr,
    dot_a: gl.constexpr,
    words_layout: gl.constexpr,
    WAIT: gl.constexpr = 0,
):
    rows = gl.arange(0, 128, layout=gl.SliceLayout(1, words_layout))
    cols = gl.arange(0, 16, layout=gl.SliceLayout(0, words_layout))
    wp = w_ptr + rows[:, None] * 16 + cols[None, :]
    sp = s_ptr + rows
    bl: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    tr = gl.arange(0, 128, layout=gl.SliceLayout(1, bl))
    tk = gl.arange(0, 128, layout=gl.SliceLayout(0, bl))
    b = gl.load(b_ptr + tr[:, None] * 128 + tk[None, :])
    b_smem = gl.allocate_shared_memory(
        gl.bfloat16, [128, 128], gl.NVMMASharedLayout.get_default_for([128, 128], gl.bfloat16), b
    )
    fence_async_shared()
    bt = b_smem.permute((1, 0))
    acc = gl.zeros([128, 128], gl.float32, mma)
    words = gl.load(wp)
    sw = gl.load(sp)
    for it in range(REPS * CHUNKS):
        it % CHUNKS
        nxt = (it + 1) % CHUNKS
        words_n = gl.load(wp + nxt * 128 * 16)
        sw_n = gl.load(sp + nxt * 128)
        frag = decode_fragment(words, sw, 0, 0, dot_a, 128, True, False, False)
        acc = warpgroup_mma(frag, bt, acc, is_async=True)
        acc = warpgroup_mma_wait(WAIT, deps=[acc])
        words = words_n
        sw = sw_n
    acc = warpgroup_mma_wait(0, deps=[acc])
    orow = gl.arange(0, 128, layout=gl.SliceLayout(1, mma))
    ocol = gl.arange(0, 128, layout=gl.SliceLayout(0, mma))
    pid = gl.program_id(0)
    gl.store(out_ptr + pid * 128 * 128 + orow[:, None] * 128 + ocol[None, :], acc)


def compile_local(mode, chunks=23, reps=8):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {
        "w_ptr": "*i32",
        "s_ptr": "*i32",
        "b_ptr": "*fp8e4nv" if mode == "fp8" else "*bf16",
        "out_ptr": "*fp32",
        "CHUNKS": "constexpr",
        "REPS": "constexpr",
    }
    if mode == "fp8":
        fn = probe_fp8
        sig.update(L4="constexpr", MMA8="constexpr", DOT8="constexpr", WAIT="constexpr")
        cx = {
            "CHUNKS": chunks,
            "REPS": reps,
            "L4": L4,
            "MMA8": MMA8,
            "DOT8": DOT8,
            "WAIT": int(os.environ.get("WAIT", "0")),
        }
    else:
        fn = probe_bf16
        lay = kernel_layouts(128, 128, 4, 1)
        sig.update(mma="constexpr", dot_a="constexpr", words_layout="constexpr", WAIT="constexpr")
        cx = {
            "CHUNKS": chunks,
            "REPS": reps,
            "mma": lay["mma"],
            "dot_a": lay["dot_a"],
            "words_layout": lay["words_layout"],
            "WAIT": int(os.environ.get("WAIT", "0")),
        }
    src = GluonASTSource(fn, sig, cx)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    return k


if __name__ == "__main__" and sys.argv[1] == "compile":
    for mode in sys.argv[2:]:
        k = compile_local(mode)
        print(
            mode,
            "regs",
            k.n_regs if hasattr(k, "n_regs") else "?",
            "spills",
            getattr(k, "n_spills", "?"),
        )
        with open(f"/tmp/probe_{mode}.cubin", "wb") as f:
            f.write(k.asm["cubin"])
        open(f"/tmp/probe_{mode}.ptx", "w").write(k.asm["ptx"])


E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)


def fp8_reference_a(words, bbytes):
    """words [C, 128, 16] int32, bbytes [C, 128, 4] -> A [128, C*128] float64 in MMA order."""
    C = words.shape[0]
    w = words.to(torch.int64) & 0xFFFFFFFF
    A = torch.zeros(128, C, 4, 2, 4, 4, dtype=torch.float64)  # row, chunk, c, h, q, i
    for q in range(4):
        R = (bbytes[:, :, q].to(torch.int64) // 8 - 6).double()  # [C, 128]
        for c in range(4):
            word = w[:, :, 4 * q + c]
            for i in range(4):
                for h in range(2):
                    if h == 0:
                        mag = (word >> (4 * i)) & 7
                        sign = (word >> (8 * i + 3)) & 1
                    else:
                        mag = (word >> (16 + 4 * i)) & 7
                        sign = (word >> (8 * i + 7)) & 1
                    v = E2M1[mag] * (1 - 2 * sign).double() * torch.exp2(R)
                    A[:, :, c, h, q, i] = v.T
    return A.reshape(128, C * 128)


def run_gpu():
    import triton.testing

    dev = "cuda"
    C = 23
    torch.manual_seed(0)
    words = torch.randint(-(2**31), 2**31 - 1, (C, 128, 16), dtype=torch.int32)
    bbytes = (torch.randint(1, 13, (C, 128, 4)) * 8).to(torch.uint8)
    sw = bbytes.contiguous().view(torch.int32).reshape(C, 128)
    act = (torch.randn(128, 128) * 2).to(torch.float8_e4m3fn)
    # correctness + accumulation error, REPS=1, grid 1
    for wait in (0, 1):
        out = torch.zeros(1, 128, 128, device=dev)
        probe_fp8[(1,)](
            words.to(dev),
            sw.to(dev),
            act.to(dev),
            out,
            CHUNKS=C,
            REPS=1,
            L4=L4,
            MMA8=MMA8,
            DOT8=DOT8,
            WAIT=wait,
            num_warps=4,
        )
        A = fp8_reference_a(words, bbytes)
        Bm = act.double()
        ref = torch.zeros(128, 128, dtype=torch.float64)
        for ch in range(C):
            ref += A[:, ch * 128 : (ch + 1) * 128] @ Bm.T
        got = out[0].double().cpu()
        denom = torch.zeros(128, 128, dtype=torch.float64)
        for ch in range(C):
            denom += A[:, ch * 128 : (ch + 1) * 128].abs() @ Bm.abs().T
        err = (got - ref).abs()
        print(
            f"wait({wait}) fp8 decode check: max abs err {err.max():.4g}, max |ref| {ref.abs().max():.4g}, "
            f"max err / sum|a||b| {(err / denom).max():.3g}, median {(err / denom).median():.3g}, "
            f"median err/|ref| {(err / ref.abs()).median():.3g}"
        )
    A32 = A.float()
    ref32 = torch.zeros(128, 128, dtype=torch.float32)
    for ch in range(C):
        ref32 += A32[:, ch * 128 : (ch + 1) * 128] @ Bm.float().T
    e32 = (ref32.double() - ref).abs()
    print(
        f"fp32 sums vs fp64: max err / sum|a||b| {(e32 / denom).max():.3g}, median {(e32 / denom).median():.3g}"
    )
    # timing
    reps = int(os.environ.get("REPS", "8"))
    for mode, wait in (("bf16", 0), ("fp8", 0), ("bf16", 1), ("fp8", 1), ("bf16", 0), ("fp8", 0)):
        for grid in (264, 1056):
            o = torch.empty(grid, 128, 128, device=dev)
            if mode == "fp8":

                def f():
                    return probe_fp8[(grid,)](
                        words.to(dev),
                        sw.to(dev),
                        act.to(dev),
                        o,
                        CHUNKS=C,
                        REPS=reps,
                        L4=L4,
                        MMA8=MMA8,
                        DOT8=DOT8,
                        WAIT=wait,
                        num_warps=4,
                    )
            else:
                lay = kernel_layouts(128, 128, 4, 1)
                wd = words.to(dev)
                sd = torch.full((C, 128), 0x7F7F7F7F, dtype=torch.int32, device=dev)
                ad = torch.randn(128, 128, device=dev).bfloat16()

                def f():
                    return probe_bf16[(grid,)](
                        wd,
                        sd,
                        ad,
                        o,
                        CHUNKS=C,
                        REPS=reps,
                        mma=lay["mma"],
                        dot_a=lay["dot_a"],
                        words_layout=lay["words_layout"],
                        WAIT=wait,
                        num_warps=4,
                    )

            f()
            torch.cuda.synchronize()
            ms = triton.testing.do_bench(f, warmup=50, rep=300)
            flops = 2 * 128 * 128 * 128 * C * reps * grid
            print(
                f"{mode} wait({wait}) grid {grid}: {ms * 1e3:.1f} us, {flops / ms / 1e9:.0f} TFLOP/s, {ms * 1e6 / (C * reps * grid / 132):.1f} ns per chunk per SM"
            )


if __name__ == "__main__" and sys.argv[1] == "gpu":
    run_gpu()


def run_debug():
    dev = "cuda"
    torch.manual_seed(1)
    C = 1
    words = torch.randint(-(2**31), 2**31 - 1, (C, 128, 16), dtype=torch.int32)
    bbytes = (torch.randint(1, 13, (C, 128, 4)) * 8).to(torch.uint8)
    sw = bbytes.contiguous().view(torch.int32).reshape(C, 128)
    act = torch.eye(128).to(torch.float8_e4m3fn)
    out = torch.zeros(1, 128, 128, device=dev)
    probe_fp8[(1,)](
        words.to(dev),
        sw.to(dev),
        act.to(dev),
        out,
        CHUNKS=C,
        REPS=1,
        L4=L4,
        MMA8=MMA8,
        DOT8=DOT8,
        num_warps=4,
    )
    A = fp8_reference_a(words, bbytes)
    got = out[0].double().cpu()
    bad = ~((got == A) | (got.isnan() & A.isnan()))
    print("nan", got.isnan().sum().item(), "mismatch", bad.sum().item(), "of", bad.numel())
    if bad.any():
        r, m = bad.nonzero()[0].tolist()
        print("first bad row", r, "m", m, "got", got[r, m].item(), "want", A[r, m].item())
        print("bad per m (row 0):", bad[0].nonzero().flatten().tolist()[:40])
        print("bad rows:", bad.any(1).nonzero().flatten().tolist()[:40])
        # where does got[0, m] appear in A[0]?
        for m in range(0, 32):
            hits = (A[0] == got[0, m]).nonzero().flatten().tolist()
            print(m, got[0, m].item(), A[0, m].item(), hits[:6])


if __name__ == "__main__" and sys.argv[1] == "debug":
    run_debug()
