"""Probe: the warp-specialized kernel's work items, tile-major (shipped) against each tile's
row blocks rotated by the tile, beside vLLM's path. Rounds interleave; outputs compared."""

from __future__ import annotations

import argparse
import statistics

import ab_moe_configs as ab
import bench_moe as bench
import torch

from tokenspeed_kernel import moe_plan, moe_prepare_weights
from tokenspeed_kernel.tools import peers
from tokenspeed_kernel_triton.moe import fragment_ws_sm90, workspace


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shards", default="whole")
    parser.add_argument("--sizes", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default=bench.MODEL)
    args = parser.parse_args()
    bench.use_model(args.model)
    sizes = [int(m) for m in args.sizes.split(",")]
    weights = bench.checkpoint_weights()
    for shard in args.shards.split(","):
        config, shard_weights = ab.layer(shard, weights)
        plan = moe_plan(config, device="cuda", max_num_tokens=max(*sizes, 1024))
        ours = [moe_prepare_weights(plan, shard_weights) for _ in range(4)]
        peer = [peers.TritonKernelsMoE(config, shard_weights) for _ in range(4)]
        for m in sizes:
            x, logits, out = bench.token_inputs(m)

            def apply(prepared, into):
                plan.impl.apply(
                    plan, x, prepared, router_logits=logits, topk_weights=None,
                    topk_ids=None, out=into,
                )  # fmt: skip

            outs = []
            for rotate in (False, True):  # True: the gcd rule
                fragment_ws_sm90.ROTATE[0] = rotate
                o = torch.empty_like(out)
                workspace.poison_scratch()
                apply(ours[0], o)
                outs.append(o)
            diff = (outs[0].float() - outs[1].float()).abs().max().item()

            def forward():
                for p in ours:
                    apply(p, out)

            def peer_forward():
                for p in peer:
                    p(x, logits, out)

            times = {"vllm": [], False: [], True: []}
            runners = ["vllm", False, True]
            for r in range(args.rounds):
                t = r % 3
                for k in runners[t:] + runners[:t]:
                    if k == "vllm":
                        times[k].append(bench.time_layers(peer_forward, 4))
                    else:
                        fragment_ws_sm90.ROTATE[0] = k
                        times[k].append(bench.time_layers(forward, 4))
            v = statistics.median(times["vllm"])
            a = statistics.median(times[False])
            b = statistics.median(times[True])
            print(
                f"{args.model} {shard} M={m}: vLLM {v:.1f} tile-major {a:.1f} rotated {b:.1f}"
                f" rotated/tile-major {b / a:.3f} vLLM/rotated {v / b:.3f}"
                f" vLLM/tile-major {v / a:.3f} max|diff| {diff:.2e}",
                flush=True,
            )
        del ours, peer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
