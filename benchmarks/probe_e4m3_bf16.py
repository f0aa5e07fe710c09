"""Probe (TS_PROBE_E4M3_BF16 at prepare): bf16 activations against w2 as e4m3 fragments, the
SwiGLU rows x 8 as two e4m3 terms, two FP8 MMAs a GEMM2 chunk, beside the shipped path and
vLLM's. From benchmarks/: python3 probe_e4m3_bf16.py whole:16,64,256:64,256 (shard:sizes:checks)."""
import os, sys, statistics
import torch
import bench_moe as bench
from tokenspeed_kernel import moe_plan, moe_prepare_weights, tensor_parallel_shard
from tokenspeed_kernel.registry import get_kernel
from tokenspeed_kernel.testing import compare, moe_plan_for, tolerance
from tokenspeed_kernel.tools import peers

def prep(plan, w, e4):
    if e4:
        os.environ["TS_PROBE_E4M3_BF16"] = "1"
    else:
        os.environ.pop("TS_PROBE_E4M3_BF16", None)
    p = moe_prepare_weights(plan, w)
    os.environ.pop("TS_PROBE_E4M3_BF16", None)
    return p

def main():
    spec = [s.split(":") for s in sys.argv[1:]]  # shard:sizes(comma):checksizes
    weights = bench.checkpoint_weights()
    reference = get_kernel("moe_apply", "reference.moe_apply")
    for shard, sizes, checks in spec:
        sizes = [int(m) for m in sizes.split(",")]
        checks = [int(m) for m in checks.split(",")] if checks else []
        if shard == "whole":
            config, w = bench.CONFIG, weights
        else:
            config, w = tensor_parallel_shard(bench.CONFIG, weights, rank=0, world_size=int(shard[2:]))
        plan = moe_plan(config, device="cuda", max_num_tokens=max(*sizes, 1024))
        ship = [prep(plan, w, False) for _ in range(4)]
        e4 = [prep(plan, w, True) for _ in range(4)]
        print(shard, "w2_decode", ship[0].tensors["w2_decode"] if hasattr(ship[0], "tensors") else "?", 
              e4[0].tensors["w2_decode"] if hasattr(e4[0], "tensors") else "?", flush=True)
        peer = [peers.TritonKernelsMoE(config, w) for _ in range(4)]
        if checks:
            ref_plan = moe_plan_for(reference, config, max(checks), "cuda")
            ref_prepared = reference.fn.prepare_weights(ref_plan, w)
            tol = tolerance(torch.bfloat16)
            for m in checks:
                x, logits, _ = bench.token_inputs(m)
                expected = torch.empty_like(x)
                reference.fn.apply(ref_plan, x, ref_prepared, router_logits=logits, out=expected)
                for name, p in (("ship", ship[0]), ("e4m3", e4[0])):
                    got = torch.empty_like(x)
                    plan.impl.apply(plan, x, p, router_logits=logits, topk_weights=None, topk_ids=None, out=got)
                    torch.cuda.synchronize()
                    err = (got.double() - expected.double()).abs()
                    ratio = err / (tol.atol + tol.rtol * expected.double().abs())
                    print(f"  {shard} M={m} {name}: {compare(got, expected, dtype=torch.bfloat16, name='x')}; worst err/tol {ratio.max().item():.3f}, over {(ratio > 1).sum().item()} of {ratio.numel()}", flush=True)
            del ref_prepared
            torch.cuda.empty_cache()
        for m in sizes:
            x, logits, out = bench.token_inputs(m)
            def fwd(ps):
                def f():
                    for p in ps:
                        plan.impl.apply(plan, x, p, router_logits=logits, topk_weights=None, topk_ids=None, out=out)
                return f
            def pf():
                for p in peer:
                    p(x, logits, out)
            runners = [("vllm", pf), ("ship", fwd(ship)), ("e4m3", fwd(e4))]
            times = {n: [] for n, _ in runners}
            for r in range(3):
                order = runners[r % 3:] + runners[:r % 3]
                for n, f in order:
                    times[n].append(bench.time_layers(f, 4))
            med = {n: statistics.median(t) for n, t in times.items()}
            print(f"{shard} M={m}: " + " / ".join(f"{n} {med[n]:.1f} [{min(times[n]):.1f}-{max(times[n]):.1f}]" for n in times)
                  + f"; vLLM/ship {med['vllm']/med['ship']:.3f}, vLLM/e4m3 {med['vllm']/med['e4m3']:.3f}, e4m3/ship {med['e4m3']/med['ship']:.3f}", flush=True)
        del ship, e4, peer
        torch.cuda.empty_cache()

main()
