"""e4m3 GEMM2 warp-specialized against the fragment kernel: bit-equality and graph timing."""

import dataclasses
import statistics
import time

import bench_moe as bench
import torch

from tokenspeed_kernel import moe_plan, moe_prepare_weights, tensor_parallel_shard
from tokenspeed_kernel.tuning import pin_config
from tokenspeed_kernel_triton.moe import moe_sm90
from tokenspeed_kernel_triton.moe.fragment_config_sm90 import FragmentConfig

t0 = time.time()
w = bench.checkpoint_weights()
fp8 = dataclasses.replace(bench.CONFIG, activation_format="fp8")
ON_W = FragmentConfig(
    128,
    128,
    4,
    2,
    pdl=True,
    narrow_t=32,
    half_pair_rows=True,
    warp_specialized=True,
    warp_specialized_gemm2=True,
    fit_widths=True,
)
ON_T = dataclasses.replace(ON_W, fit_widths=False)
layers = {}
for static in (True, False):
    ws = dataclasses.replace(w, w13_input_scale=3.5 / 448, w2_input_scale=24 / 448) if static else w
    layers[f"whole static={static}"] = ((fp8, ws), ON_W, (4096, 8192))
    layers[f"tp8 static={static}"] = (
        tensor_parallel_shard(fp8, ws, rank=0, world_size=8),
        ON_T,
        (8192,),
    )
for name, ((config, weights), on, sizes) in layers.items():
    off = dataclasses.replace(on, warp_specialized_gemm2=False)
    plan = moe_plan(config, device="cuda", max_num_tokens=8192)
    ours = [moe_prepare_weights(plan, weights) for _ in range(4)]
    print(name, flush=True)
    # Bit equality under skewed routing: experts with 1 .. 200 tokens.
    for m in (300, 3072):
        g = torch.Generator(device="cuda").manual_seed(m)
        x = torch.randn(m, 2880, generator=g, device="cuda").to(torch.bfloat16)
        lg = torch.randn(m, 128, generator=g, device="cuda")
        first = 0
        for e, count in enumerate((1, 5, 16, 17, 32, 33, 64, 65, 128, 129, 200)):
            lg[torch.arange(first, first + count, device="cuda") % m, 32 + e] += 30.0
            first += count
        outs = []
        for cfg in (off, on):
            out = torch.empty_like(x)
            with pin_config(moe_sm90.KERNEL_NAME, cfg):
                plan.impl.apply(
                    plan, x, ours[0], router_logits=lg, topk_weights=None, topk_ids=None, out=out
                )
            outs.append(out)
        same = torch.equal(outs[0], outs[1])
        diff = (outs[0].float() - outs[1].float()).abs().max().item()
        print(
            f"  M={m} skewed: bit-equal {same} max diff {diff:.3e} finite {bool(outs[1].isfinite().all())}",
            flush=True,
        )
    for m in sizes:
        x, logits, out = bench.token_inputs(m)

        def fwd():
            for p in ours:
                plan.impl.apply(
                    plan, x, p, router_logits=logits, topk_weights=None, topk_ids=None, out=out
                )

        times = {"off": [], "on": []}
        for r in range(2):
            for label, cfg in (
                (("off", off), ("on", on)) if r % 2 == 0 else (("on", on), ("off", off))
            ):
                with pin_config(moe_sm90.KERNEL_NAME, cfg):
                    times[label].append(bench.time_layers(fwd, len(ours)))
        a, b = statistics.median(times["off"]), statistics.median(times["on"])
        print(
            f"  M={m}: fragment GEMM2 {a:.1f} us, warp-specialized {b:.1f} us, x{a / b:.3f} ({time.time() - t0:.0f} s)",
            flush=True,
        )
    del ours
    torch.cuda.empty_cache()
