"""GPU side: load the prebuilt cubin with the CUDA driver, check it against the reference and
FA3, time it against FA3 and the Triton kernel. Usage: gpu_run.py smoke|full"""

import json
import math
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, "benchmarks")

from tokenspeed_kernel_nvidia import _cute_runtime as rt  # noqa: E402

HQ, HKV, D = 64, 8, 64
BM = 128
SCALE = 1.0 / math.sqrt(D)
SMS = int(os.environ.get("CTAS", "0")) or torch.cuda.get_device_properties(0).multi_processor_count
LOG2E = math.log2(math.e)

class Variant:
    def __init__(self, name):
        self.name = name
        self.meta = json.loads((HERE / "cubin" / f"{name}.json").read_text())
        cubin = rt.Cubin((HERE / "cubin" / f"{name}.cubin").read_bytes(), self.meta["symbol"])
        self.persistent = self.meta.get("persistent", False)
        params = [rt.POINTER] * 6 + ([rt.INT32, rt.INT32, rt.FLOAT32] if self.persistent else [rt.INT32, rt.FLOAT32])
        self.kernel = rt.LoadedKernel(cubin, params, shared_bytes=self.meta["smem"])

    def _prepare(self, device):
        from cuda.bindings import driver

        kernel = self.kernel
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx in kernel._functions:
            return
        rt._make_current(idx)
        fn = rt._check(driver.cuKernelGetFunction(kernel._kernel), "cuKernelGetFunction")
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        rt._check(driver.cuFuncSetAttribute(fn, attr, self.meta["smem"]), "cuFuncSetAttribute")
        kernel._functions[idx] = fn

    def __call__(self, q, k, v, cu, max_seqlen, sinks_f32, out):
        self._prepare(q.device)
        batch = cu.numel() - 1
        bm = self.meta.get('bm', BM)
        mblocks = (max_seqlen + bm - 1) // bm
        args = [q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), cu.data_ptr(),
                sinks_f32.data_ptr(), mblocks] + ([batch] if self.persistent else []) + [SCALE * LOG2E]
        if self.persistent:
            grid = (min(SMS, mblocks * HQ * batch), 1, 1)
        else:
            grid = (HQ, batch, mblocks) if self.meta["heads_fast"] else (mblocks, HQ, batch)
        self.kernel.launch_grid(q.device, grid, self.meta["threads"], args)
        return out


_only = os.environ.get("ONLY_VARIANTS")
VARIANTS = [Variant(p.stem) for p in sorted((HERE / "cubin").glob("*.cubin"))
            if not _only or p.stem in _only.split(",")]


def inputs(lengths, seed=1):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, HQ, D, device="cuda", generator=gen).bfloat16()
    k = torch.randn(total, HKV, D, device="cuda", generator=gen).bfloat16()
    v = torch.randn(total, HKV, D, device="cuda", generator=gen).bfloat16()
    sinks = torch.randn(HQ, device="cuda", generator=gen).bfloat16()
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32,
                      device="cuda")  # fmt: skip
    return q, k, v, sinks, cu


def main(stage):
    print(torch.cuda.get_device_name(), "stage", stage, flush=True)
    from tokenspeed_kernel.ops.attention.reference import reference_prefill

    try:
        import flash_attn_interface as fa3
    except Exception as exc:  # noqa: BLE001
        print("FA3 unavailable:", exc)
        fa3 = None

    cases = [[1024, 1024], [1000, 333], [129, 7, 300], [700, 1500, 191], [1], [65, 64, 1, 2, 3, 200], [3000]] if stage == "smoke" else []
    if stage == "full":
        cases = [[4096, 1], [8192, 8192]]
    for lengths in cases:
        q, k, v, sinks, cu = inputs(lengths)
        S = max(lengths)
        ref = fo = None
        if sum(lengths) <= 4200:
            ref = torch.empty_like(q)
            reference_prefill(q, k, v, cu_seqlens=cu, max_seqlen=S, causal=True, window_left=-1,
                              sinks=sinks, softmax_scale=SCALE, out=ref, lse=None)  # fmt: skip
        if fa3 is not None:
            fo = fa3.flash_attn_varlen_func(q, k, v, cu, cu, S, S, softmax_scale=SCALE,
                                            causal=True, sinks=sinks)  # fmt: skip
            fo = fo[0] if isinstance(fo, tuple) else fo
            if ref is not None:
                print(f"lengths={lengths}: max|fa3-ref|={(fo.float() - ref.float()).abs().max().item():.4g}")
        for var in VARIANTS:
            out = torch.full_like(q, float("nan"))
            var(q, k, v, cu, S, sinks.float(), out)
            torch.cuda.synchronize()
            line = f"lengths={lengths} {var.name}: nan={out.isnan().any().item()}"
            if ref is not None:
                line += f" max|ours-ref|={(out.float() - ref.float()).abs().max().item():.4g}"
            if fo is not None:
                line += f" max|ours-fa3|={(out.float() - fo.float()).abs().max().item():.4g}"
            print(line, flush=True)

    if stage != "full":
        return
    import triton
    from tokenspeed_kernel_triton.attention import prefill

    for S, B in ((8192, 2), (4096, 4), (1024, 16)):
        vs = VARIANTS
        q, k, v, sinks, cu = inputs([S] * B)
        out = torch.empty_like(q)
        out2 = torch.empty_like(q)
        sf = sinks.float()

        def tri():
            prefill.mha_prefill(q, k, v, out=out2, lse=None, cu_seqlens=cu, max_seqlen=S,
                                causal=True, window_left=-1, sinks=sinks, softmax_scale=SCALE)

        fns = {var.name: (lambda var=var: var(q, k, v, cu, S, sf, out)) for var in vs}
        fns["triton"] = tri
        if fa3 is not None:
            fns["fa3"] = lambda: fa3.flash_attn_varlen_func(
                q, k, v, cu, cu, S, S, softmax_scale=SCALE, causal=True, sinks=sinks)
        res = {}
        for rep in range(3):
            for name, fn in fns.items():
                ms = triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")
                res.setdefault(name, []).append(ms)
        flops = 4 * HQ * D * B * S * (S + 1) / 2
        print(f"S={S}x{B}: " + "  ".join(
            f"{n}={min(v):.4f}ms ({flops / min(v) / 1e9:.0f} TFLOPs) runs={['%.4f' % x for x in v]}"
            for n, v in res.items()), flush=True)  # fmt: skip
        for var in vs:
            var(q, k, v, cu, S, sf, out)
            tri()
            torch.cuda.synchronize()
            print(f"  S={S}x{B} {var.name} max|ours-triton|={(out.float() - out2.float()).abs().max().item():.4g}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "full")
