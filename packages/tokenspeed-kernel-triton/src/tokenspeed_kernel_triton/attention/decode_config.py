"""Launch configuration of the decode kernels: the per-platform tile heuristic and the split
count chosen from the work and the platform's SM count. Host-side only; nothing here reads a
device value."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import triton

from tokenspeed_kernel.platform import Platform


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the decode kernels. `num_splits=None`: chosen from the work."""

    block_n: int
    num_warps: int
    num_stages: int
    ctas_per_sm: int
    num_splits: int | None = None


MAX_SPLITS = 128  # the reduce holds every split's lse of a row in one tile
# Fixed cost of a program (q load, page-table chain, partial store) in units of one key block:
# a program is a DRAM round trip or two of latency before its first block streams.
_PROGRAM_OVERHEAD_BLOCKS = 1
_LONG_SPLIT_BLOCKS = 8  # key blocks per split from which a deeper cp.async pipeline pays
_STAGING_BYTES = 4096  # q tile and the bf16 probabilities staged through shared memory


def heuristic_config(platform: Platform, head_dim: int) -> DecodeConfig:
    """Per-platform tile and pipeline choice, each with its hardware reason."""
    if platform.vendor == "cpu":
        # The interpreter's cost is per block op, not per byte: small tiles keep CPU tests fast.
        return DecodeConfig(block_n=16, num_warps=1, num_stages=1, ctas_per_sm=1)
    if platform.vendor == "amd":
        # CDNA: 64 KB LDS per CU; two LDS stages of K+V (16-32 KB) leave room for 2 workgroups,
        # and 4 wavefronts of 64 lanes cover a 16x64 mfma tile set.
        return DecodeConfig(block_n=64, num_warps=4, num_stages=2, ctas_per_sm=2)
    # NVIDIA sm_80+: 3 cp.async stages of a 64-key K+V tile (16 KB at d=64) keep ~48 KB in
    # flight per CTA; 228 KB of shared memory fits 4 such CTAs (2 at d=128) per SM, which is
    # what a memory-bound gather needs to cover DRAM latency.
    ctas = 4 if head_dim <= 64 else 2
    return DecodeConfig(block_n=64, num_warps=4, num_stages=3, ctas_per_sm=ctas)


def choose_num_splits(programs: int, blocks: int, sm_count: int, ctas_per_sm: int) -> int:
    """Splits per sequence that minimize the modeled time of the phase-1 grid.

    `programs` = sequences x KV heads x query tiles, `blocks` = key blocks of the longest
    visible range (from shapes, never from device values). Time ~ waves x (blocks per split +
    fixed overhead), where a wave is sm_count x ctas_per_sm resident programs: few programs
    leave SMs idle (split more), many splits pay the overhead and the reduce (split less).
    """
    if blocks <= 1 or programs <= 0:
        return 1
    slots = max(1, sm_count * ctas_per_sm)
    best, best_cost = 1, None
    for splits in range(1, min(blocks, MAX_SPLITS) + 1):
        per_split = -(-blocks // splits)
        effective = -(-blocks // per_split)
        if effective != splits:
            continue  # the same chunking as a smaller split count
        waves = -(-programs * splits // slots)
        cost = waves * (per_split + _PROGRAM_OVERHEAD_BLOCKS)
        if best_cost is None or cost < best_cost:
            best, best_cost = splits, cost
    return best


@functools.lru_cache(maxsize=1024)
def plan_decode(
    platform: Platform,
    kv_bytes: int,
    batch: int,
    q_len: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    max_pages: int,
    window_left: int,
    pinned: DecodeConfig | None,
) -> tuple[DecodeConfig, int, int]:
    """(config, BLOCK_M, splits) for one call shape; cached: the hot path pays a dict lookup."""
    config = pinned or heuristic_config(platform, head_dim)
    group = num_q_heads // num_kv_heads
    # 16 rows is the smallest tensor-core tile; 64 caps the score tile's registers.
    block_m = min(max(16, triton.next_power_of_2(q_len * group)), 64)
    m_tiles = -(-q_len * group // block_m)
    max_keys = max_pages * page_size
    if window_left >= 0:
        # Visible keys of the Q tokens: W + Q, plus one block of misalignment.
        max_keys = min(max_keys, window_left + q_len + config.block_n)
    blocks = -(-max_keys // config.block_n)
    splits = config.num_splits
    if splits is None:
        splits = choose_num_splits(
            batch * num_kv_heads * m_tiles, blocks, platform.sm_count, config.ctas_per_sm
        )
    splits = max(1, min(splits, MAX_SPLITS))
    # Long streams: 5 stages make Triton's pipeliner keep two K/V tiles in flight behind the
    # page-table read instead of one (H200, B=64 x 8192: 270 -> 251 us). Only when the grid
    # still fits in one wave at the larger shared-memory footprint (B=128 x 4096 with a
    # second, partial wave: 252 -> 290 us), and not on short splits, where the deeper
    # prologue costs more than it hides.
    deep_smem = 2 * 2 * config.block_n * head_dim * kv_bytes + _STAGING_BYTES
    resident = platform.shared_memory_per_sm_bytes // deep_smem
    programs = batch * num_kv_heads * m_tiles * splits
    if (
        pinned is None
        and platform.vendor == "nvidia"
        and programs <= platform.sm_count * resident
        and -(-blocks // splits) >= _LONG_SPLIT_BLOCKS
    ):
        config = dataclasses.replace(config, num_stages=5)
    return config, block_m, splits
