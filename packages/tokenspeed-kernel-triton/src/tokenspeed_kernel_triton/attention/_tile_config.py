"""Host side of the prefill/extend tile kernels (`_tiles.py`): the tile config with its
per-platform heuristic, and the launch plan (grid, constexprs) from the pinned or chosen config.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton

from tokenspeed_kernel.platform import Platform, platform_of
from tokenspeed_kernel.tuning import pinned_config


@dataclass(frozen=True)
class AttentionConfig:
    """Tile shape and launch parameters of the prefill/extend kernels."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # Query heads of one KV head packed into a tile (GQA packing); capped by the GQA ratio.
    heads_per_tile: int = 1
    # Split the key range into masked edges and an unmasked middle (three pipelined loops).
    # Off, one masked loop: better when a tile visits only a few key blocks (sliding window),
    # where each extra loop would restart the load pipeline.
    split_mask: bool = True

    def packing(self, group: int) -> int:
        """Heads per tile for GQA ratio `group`: a power of two dividing it, leaving at least
        one token per tile."""
        heads = 1
        while heads * 2 <= min(self.heads_per_tile, self.block_m) and group % (heads * 2) == 0:
            heads *= 2
        return heads


def choose_config(platform: Platform, head_dim: int, window: bool) -> AttentionConfig:
    """Tile config of the prefill and extend kernels; each branch names the hardware reason."""
    if platform.vendor == "cpu":
        # The interpreter runs every block op in numpy: small tiles keep CPU tests fast while
        # short sequences still cross several blocks and pages (masked and unmasked paths run).
        return AttentionConfig(32, 16, 1, 1, heads_per_tile=2)
    if platform.vendor == "amd":
        # CDNA: 64-wide wavefronts, 4 warps fill a CU's SIMDs; K/V (gathered rows too) go
        # through LDS, 64 KB on gfx942 (160 KB on gfx950), so hd 128 drops to single-buffered
        # K/V there.
        stages = 1 if head_dim > 64 and platform.arch == "gfx942" else 2
        return AttentionConfig(128, 64, 4, stages, heads_per_tile=8)
    if platform.sm == 90:
        # Hopper: GQA packing puts 8 heads x 16 tokens in a 128-row tile over 8 warps (two
        # warpgroups, wgmma m64 each); K/V load once per 8 heads; 3 cp.async stages of 64-key
        # blocks (paged rows cannot use TMA) measured best (H100 prefill: 411-435 TFLOP/s
        # causal hd 64, vs 329-368 with 128-key blocks). A sliding window (memory-bound: each
        # tile visits ~5 key blocks) wants short tiles (8 tokens x 8 heads) on 32-key blocks in
        # one masked loop: little masked waste, one pipeline warm-up per tile.
        if window:
            return AttentionConfig(64, 32, 4, 3, heads_per_tile=8, split_mask=False)
        return AttentionConfig(128, 64, 8, 3, heads_per_tile=8)
    # Ampere/Ada (mma.sync) and newer parts: 4 warps x 32 rows; 2-3 cp.async stages fit
    # 100-164 KB of shared memory.
    return AttentionConfig(128, 64, 4, 3 if head_dim <= 64 else 2, heads_per_tile=8)


def plan_tiles(kernel_name, q, num_kv_heads, cu_seqlens_q, max_seqlen_q, window_left, sinks, lse):
    """(grid, num_m_blocks, constexprs and launch options) of a prefill/extend launch, from
    the config pinned for `kernel_name` or the platform's heuristic; None: nothing to compute."""
    num_seqs = cu_seqlens_q.shape[0] - 1
    if q.shape[0] == 0 or num_seqs == 0 or max_seqlen_q == 0:
        return None
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    has_window = window_left >= 0
    config = pinned_config(kernel_name) or choose_config(
        platform_of(q.device), head_dim, has_window
    )
    group = num_q_heads // num_kv_heads
    heads_per_tile = config.packing(group)
    num_m_blocks = triton.cdiv(max_seqlen_q, config.block_m // heads_per_tile)
    grid = (num_m_blocks, num_q_heads // heads_per_tile, num_seqs)
    meta = dict(
        GROUP=group,
        HEADS_PER_TILE=heads_per_tile,
        HEAD_DIM=head_dim,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        HAS_WINDOW=has_window,
        HAS_SINKS=sinks is not None,
        HAS_LSE=lse is not None,
        SPLIT_MASK=config.split_mask,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return grid, num_m_blocks, meta
