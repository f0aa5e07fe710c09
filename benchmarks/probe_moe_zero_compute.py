"""Probe (with TS_MOE_ZERO=1 at this commit: the ring steps XOR their words instead of decoding
and multiplying): ours only, graph-timed. SIZES="whole:1024,4096,8192;tp8:3072,8192", REPS."""
import os, sys, statistics
sys.path.insert(0, "benchmarks")
import torch
import bench_moe as b
from tokenspeed_kernel import moe_plan, moe_prepare_weights, tensor_parallel_shard
weights = b.checkpoint_weights()
reps = int(os.environ.get("REPS", "2"))
tag = os.environ.get("TS_MOE_ZERO", "0")
for part in os.environ["SIZES"].split(";"):
    label, ms = part.split(":")
    if label == "whole":
        config, w = b.CONFIG, weights
    else:
        config, w = tensor_parallel_shard(b.CONFIG, weights, rank=0, world_size=int(label[2:]))
    ms = [int(m) for m in ms.split(",")]
    plan = moe_plan(config, device="cuda", max_num_tokens=max(ms))
    ours = [moe_prepare_weights(plan, w) for _ in range(4)]
    for m in ms:
        x, logits, out = b.token_inputs(m)
        def fn():
            for p in ours:
                plan.impl.apply(plan, x, p, router_logits=logits, topk_weights=None, topk_ids=None, out=out)
        ts = [b.time_layers(fn, 4) for _ in range(reps)]
        print(f"zero={tag} {label} M={m}: {statistics.median(ts):.1f} [{min(ts):.1f}-{max(ts):.1f}]", flush=True)
    del ours
    torch.cuda.empty_cache()
