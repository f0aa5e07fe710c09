"""Probe: ours (this tree's moe_apply) timed beside vLLM's path, its outputs saved, so that two
trees' runs compare bit for bit.

    PYTHONPATH=.carry/peers:TREE/benchmarks bash TREE/scripts/run_from_source.sh \
        python3 benchmarks/probe_full_tiles.py TAG MODEL SHARDS SIZES WITH_PEER
"""

from __future__ import annotations

import statistics
import sys

import ab_moe_configs as ab
import bench_moe as bench
import torch

from tokenspeed_kernel import moe_plan, moe_prepare_weights
from tokenspeed_kernel.tools import peers


def case(label: str, m: int, plan, ours: list, peer: list, with_peer: bool) -> torch.Tensor:
    """Times ours (and vLLM's path) at size m; returns ours' output."""
    x, logits, out = bench.token_inputs(m)

    def apply(prepared, into):
        plan.impl.apply(
            plan, x, prepared, router_logits=logits, topk_weights=None, topk_ids=None, out=into
        )

    saved = torch.empty_like(out)
    apply(ours[0], saved)

    def forward():
        for prepared in ours:
            apply(prepared, out)

    def peer_forward():
        for p in peer:
            p(x, logits, out)

    times = [bench.time_layers(forward, 4) for _ in range(3)]
    v = bench.time_layers(peer_forward, 4) if with_peer else float("nan")
    print(
        f"{label} M={m}: ours {statistics.median(times):.1f} "
        f"[{min(times):.1f}-{max(times):.1f}] vLLM {v:.1f}",
        flush=True,
    )
    return saved.cpu()


def main() -> None:
    tag, model, shards, sizes, with_peer = sys.argv[1:6]
    sizes = [int(m) for m in sizes.split(",")]
    bench.use_model(model)
    weights = bench.checkpoint_weights()
    outs = {}
    for shard in shards.split(","):
        config, shard_weights = ab.layer(shard, weights)
        plan = moe_plan(config, device="cuda", max_num_tokens=max(*sizes, 1024))
        ours = [moe_prepare_weights(plan, shard_weights) for _ in range(4)]
        peer = [peers.TritonKernelsMoE(config, shard_weights) for _ in range(4)]
        for m in sizes:
            label = f"{tag} {model} {shard}"
            outs[f"{shard}/{m}"] = case(label, m, plan, ours, peer, with_peer == "1")
        del ours, peer
        torch.cuda.empty_cache()
    torch.save(outs, f"/tmp/outs_{tag}_{model}.pt")


if __name__ == "__main__":
    main()
