import json, sys
from pathlib import Path
import torch, triton
from tokenspeed_kernel_nvidia import _cute_runtime as rt
from cuda.bindings import driver
HERE = Path(__file__).resolve().parent
ITERS = 4096
out = torch.zeros(132 * 512, device="cuda")
print(torch.cuda.get_device_name(), flush=True)
res = {}
for meta_path in sorted(HERE.glob("cubin/*.json")):
    meta = json.loads(meta_path.read_text())
    name = meta_path.stem
    cub = rt.Cubin((HERE / "cubin" / f"{name}.cubin").read_bytes(), meta["symbol"])
    k = rt.LoadedKernel(cub, [rt.POINTER, rt.INT32, rt.FLOAT32], shared_bytes=meta["smem"])
    fn = rt._check(driver.cuKernelGetFunction(k._kernel), "get")
    rt._check(driver.cuFuncSetAttribute(fn, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, meta["smem"]), "attr")
    k._functions[0] = fn
    nthreads = 128 * len(meta["roles"])
    run = lambda: k.launch_grid(out.device, (132, 1, 1), nthreads, [out.data_ptr(), ITERS, 0.5])
    run(); torch.cuda.synchronize()
    ms = min(triton.testing.do_bench(run, warmup=20, rep=100, return_mode="median") for _ in range(2))
    res[name] = ms
    print(f"{name:24s} {ms*1e3/ITERS*1e3:8.1f} ns/iter  finite={torch.isfinite(out).all().item()}", flush=True)
