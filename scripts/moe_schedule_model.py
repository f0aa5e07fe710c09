"""A model of how the warp-specialized MoE kernel's persistent CTAs share out their work items
(fragment_ws_sm90): the busiest CTA's load, in full-item units, under four orders.

    python3 scripts/moe_schedule_model.py [--experts 128] [--local 128] [--sizes 2048,4096]

Routing as bench_moe.py draws it (standard normal logits, seeded by M, top-4; the CPU's
generator, so other draws of the same law), 128-token tiles per local expert, narrow_t 32.
Item costs: a tile of at most 64 tokens 0.6 of a full item, 65-96 0.85 (the fitted widths;
measured 0.65-0.75 on the TP=8 shard), a block whose second consumer is padding 0.6. Orders:

- skipped: every tile's items by grid stride, a narrow tile's skipped in place (before f16a542);
- listed: the stride over the tiles past narrow_t (routing's full_tiles);
- widest first: that list with the experts whose last listed tile is widest first;
- counter: each item to the CTA that frees first, in list order (a greedy lower bound).

Each order turns a tile's row blocks where fragment_ws_sm90.rotates_row_blocks says. The mean
load is the ideal. Figures: docs/decisions.md ("Only the tiles past narrow_t shared out")."""

from __future__ import annotations

import argparse
import heapq
import math

import torch

NARROW_T, TILE, SMS = 32, 128, 132


def tiles_of(m: int, experts: int, local: int, top_k: int = 4) -> list[list[int]]:
    """Each local expert's tiles' token counts for M = m."""
    g = torch.Generator().manual_seed(m)
    ids = torch.topk(torch.randn(m, experts, generator=g), top_k, dim=-1).indices.flatten()
    loads = torch.bincount(ids, minlength=experts)[:local].tolist()
    return [[min(TILE, n - t) for t in range(0, n, TILE)] for n in loads]


def cost(tokens: int) -> float:
    return 0.6 if tokens <= 64 else 0.85 if tokens <= 96 else 1.0


def items(tiles: list[int], blocks: int, padded_last: bool) -> list[float]:
    """Work items in stride order, a skipped item costing 0."""
    rotate = math.gcd(SMS, blocks) > 1
    out = []
    for ordinal, tokens in enumerate(tiles):
        for b in range(blocks):
            block = (b + ordinal) % blocks if rotate else b
            last = padded_last and block == blocks - 1
            out.append(0.0 if tokens <= NARROW_T else cost(tokens) * (0.6 if last else 1.0))
    return out


def loads(expert_tiles: list[list[int]], blocks: int, padded_last: bool) -> dict[str, float]:
    flat = [t for tiles in expert_tiles for t in tiles]
    listed = [t for t in flat if t > NARROW_T]

    def widest(tiles):
        kept = [t for t in tiles if t > NARROW_T]
        return -cost(kept[-1]) if kept else 0.0

    ordered = [t for tiles in sorted(expert_tiles, key=widest) for t in tiles if t > NARROW_T]

    def stride(work):
        return max(sum(work[c::SMS]) for c in range(SMS))

    def counter(work):
        free = [0.0] * SMS
        for c in work:
            heapq.heappush(free, heapq.heappop(free) + c)
        return max(free)

    work = items(listed, blocks, padded_last)
    return {
        "skipped": stride(items(flat, blocks, padded_last)),
        "listed": stride(work),
        "widest first": stride(items(ordered, blocks, padded_last)),
        "counter": counter(work),
        "mean": sum(work) / SMS,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--local", type=int, default=None, help="local experts (EP rank 0)")
    parser.add_argument("--sizes", default="2048,4096,8192")
    parser.add_argument("--gemm1-rows", type=int, default=5760, help="2I of the shard")
    args = parser.parse_args()
    local = args.local or args.experts
    gemms = {"GEMM1": args.gemm1_rows, "GEMM2": 2880}
    for m in (int(s) for s in args.sizes.split(",")):
        tiles = tiles_of(m, args.experts, local)
        for name, rows in gemms.items():
            blocks = -(-rows // 256)
            padded_last = rows % 256 and rows % 256 <= 128
            row = loads(tiles, blocks, bool(padded_last))
            cells = ", ".join(f"{k} {v:.2f}" for k, v in row.items())
            print(f"M={m} {name}: {cells}")


if __name__ == "__main__":
    main()
