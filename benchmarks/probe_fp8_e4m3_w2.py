"""Probe: fp8 activations with w2 half precision (before) against w2 as e4m3 fragments (issue
23), bf16 beside, graph-timed over 4 layers, rounds interleaved; whole layer and TP=8 shard.

    PYTHONPATH=<vLLM's triton_kernels dir> bash scripts/run_from_source.sh \
        python3 benchmarks/probe_fp8_e4m3_w2.py
"""

import os, sys, statistics

sys.path.insert(0, "benchmarks")
import torch
import bench_moe as b
from tokenspeed_kernel import tensor_parallel_shard
from tokenspeed_kernel_triton.moe.layout import prepare_weights

layers = 4
reps = int(os.environ.get("REPS", "2"))
sizes = [int(m) for m in os.environ.get("SIZES", "1,4,16,64,256,1024,4096,8192").split(",")]
shards = os.environ.get("SHARDS", "whole,tp8").split(",")
w = b.checkpoint_weights()
for shard in shards:
    if shard == "whole":
        cfg, ws = b.CONFIG, w
    else:
        cfg, ws = tensor_parallel_shard(b.CONFIG, w, rank=0, world_size=int(shard[2:]))
    H, I = cfg.hidden_size, cfg.intermediate_size

    def prep(**opt):
        return prepare_weights(
            "mxfp4",
            H,
            I,
            w13=ws.w13,
            w2=ws.w2,
            w13_scale=ws.w13_scale,
            w2_scale=ws.w2_scale,
            w13_bias=ws.w13_bias,
            w2_bias=ws.w2_bias,
            word_order="fragment",
            **opt,
        )

    V = {}
    V["bf16"] = (b.weight_copies(prep(), layers), "bf16", (None, None))
    for static in (True, False):
        sc = (3.5 / 448, 24.0 / 448) if static else (None, None)
        tag = "static" if static else "dynamic"
        V[f"fp8 {tag} before"] = (b.weight_copies(prep(), layers), "fp8", sc)
        p = prep(e4m3_w2=True)
        assert p["w2_decode"] == "e4m3"
        V[f"fp8 {tag} e4m3 w2"] = (b.weight_copies(p, layers), "fp8", sc)
    for m in sizes:
        res = {}
        for r in range(reps):
            for label, (lay, act, sc) in V.items():
                us, _ = b.run_case(lay, m, act, sc, graph=True)
                res.setdefault(label, []).append(us)
        med = {k: statistics.median(v) for k, v in res.items()}
        line = " | ".join(f"{k} {med[k]:.1f}" for k in med)
        ratios = ", ".join(
            f"{t}: before/e4m3 {med[f'fp8 {t} before'] / med[f'fp8 {t} e4m3 w2']:.3f}, bf16/e4m3 {med['bf16'] / med[f'fp8 {t} e4m3 w2']:.3f}"
            for t in ("static", "dynamic")
        )
        print(f"{shard} M={m}: {line} || {ratios}", flush=True)
    del V
    torch.cuda.empty_cache()
