"""Tile configs of the Hopper fragment GEMM (wgmma_gemm_sm90.py): what a config holds, the
configs picked by batch size (with the measurements behind them), the scaled-fragment form of a
post-scaled config, and GEMM2's split count."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class FragmentConfig:
    """block_w weight rows x block_t tokens per CTA; stages of the cp.async ring, which holds
    the activations and the weight words, each stage `chunks` K chunks of 128 (one barrier, one
    set of copies and one wgmma wait per step: fewer instructions per chunk, and the next
    chunk decodes while the last one multiplies); gemm2_split_k CTAs share each GEMM2 tile's K
    chunks, each writing a partial row that the combine sums (more CTAs, shorter chains); pdl:
    programmatic dependent launch of GEMM1, GEMM2 and the combine (each starts its CTAs while
    the previous kernel finishes; GEMM2 streams its first weights before it waits for GEMM1's
    grid, or with tile_ready for the GEMM1 CTAs of its tile, on counters);
    mma_in_flight: wait for older chunks' wgmmas within a step so that at most this many hold
    their fragment registers (long steps without the registers of all their chunks);
    post_scale: raw weight halves into the MMA against block-diagonal activations (wgmma's N is
    4 * block_t), the e8m0 factors applied to fp32 partials (fragment_steps_sm90.post_scaled_step;
    shift-decoded weights with an fp16 intermediate only, else moe_forward_sm90 falls back to
    scaled fragments); narrow_t: each GEMM runs its tiles of at most narrow_t tokens (an
    expert's last, or only, tile) in a second launch of block_w x narrow_t tiles, whose MMAs
    are that much narrower (the routing tiles stay block_t rows), with a ring of narrow_stages
    steps (0: `stages`; a narrow tile's ring takes less shared memory, so it affords more
    steps at the same CTAs per SM); below_intermediate =
    (channels, config): the config that runs instead where the padded intermediate size is
    under `channels` (for_layer: a TP shard's short GEMMs can pay more for a second
    launch than its narrower MMAs save); below_expert_channels = (channels, config): the config
    that runs instead where the local experts' padded intermediate channels together (experts x
    padded intermediate) are under `channels` (for_layer: few experts or short shards leave a
    persistent kernel few work items per SM); half_pair_rows: GEMM2 may
    store its pair rows in fp16 (half the bytes written and read back by the combine), the
    elements not below half_pair_rows_bound() in magnitude exact in float32, where
    half_pair_rows() says; warp_specialized: the full tiles run in the warp-specialized
    persistent kernel (fragment_ws_sm90: a producer warpgroup and two consumers on 256 rows,
    its own ring of 4 steps, 3 for fp16 pair rows) where the call allows it, else, and for the
    narrow tiles, in this config's fragment kernel with `stages`; warp_specialized_gemm2:
    GEMM2's full tiles too (on fp16 SwiGLU rows, unsplit); fit_widths: that kernel multiplies
    a tile of at most 64 (96) tokens with MMAs 64 (64 + 32) columns wide instead of 128."""

    block_w: int
    block_t: int
    num_warps: int
    stages: int
    gemm2_split_k: int = 1
    chunks: int = 1
    pdl: bool = False
    tile_ready: bool = False
    mma_in_flight: int | None = None
    post_scale: bool = False
    narrow_t: int = 0
    narrow_stages: int = 0
    below_intermediate: tuple[int, FragmentConfig] | None = None
    below_expert_channels: tuple[int, FragmentConfig] | None = None
    half_pair_rows: bool = False
    warp_specialized: bool = False
    warp_specialized_gemm2: bool = False
    fit_widths: bool = False

    def __post_init__(self) -> None:
        # The loop keeps STAGES - 2 copy groups in flight past the one it waits for.
        if self.stages < 2:
            raise ValueError(f"FragmentConfig: stages {self.stages} < 2")
        if self.chunks < 1 or self.chunks & (self.chunks - 1):
            raise ValueError(f"FragmentConfig: chunks {self.chunks} is not a power of two")
        if self.post_scale and self.in_flight > 2:
            raise ValueError("FragmentConfig: post_scale keeps one or two chunks' wgmmas in flight")
        if self.tile_ready and not self.pdl:
            raise ValueError("FragmentConfig: tile_ready needs pdl")
        if self.narrow_t and (
            self.post_scale
            or not 8 <= self.narrow_t < self.block_t
            or self.narrow_t & (self.narrow_t - 1)
        ):
            raise ValueError(
                f"FragmentConfig: narrow_t {self.narrow_t} is not a power of two in [8, "
                f"block_t {self.block_t}) on a scaled-fragment config"
            )
        if self.narrow_stages and (self.narrow_stages < 2 or not self.narrow_t):
            raise ValueError(
                f"FragmentConfig: narrow_stages {self.narrow_stages} needs narrow_t and at "
                f"least 2 steps"
            )
        for field in ("below_intermediate", "below_expert_channels"):
            below = getattr(self, field)
            if below is not None and not (
                isinstance(below, tuple)
                and len(below) == 2
                and isinstance(below[0], int)
                and below[0] > 0
                and isinstance(below[1], FragmentConfig)
            ):
                raise ValueError(
                    f"FragmentConfig: {field} {below!r} is not (channels > 0, FragmentConfig)"
                )
        if self.warp_specialized and (
            (self.block_w, self.block_t, self.num_warps, self.chunks) != (128, 128, 4, 1)
            or self.post_scale
            or self.tile_ready
        ):
            raise ValueError(
                "FragmentConfig: warp_specialized takes 128 x 128 tiles of 4 warps, one chunk "
                "per step, no post_scale or tile_ready"
            )
        if self.warp_specialized_gemm2 and (not self.warp_specialized or self.gemm2_split_k != 1):
            raise ValueError(
                "FragmentConfig: warp_specialized_gemm2 needs warp_specialized and no GEMM2 splits"
            )
        if self.fit_widths and not self.warp_specialized:
            raise ValueError("FragmentConfig: fit_widths is the warp-specialized kernel's")
        if not 1 <= self.in_flight <= self.chunks:
            raise ValueError(
                f"FragmentConfig: mma_in_flight {self.mma_in_flight} not in [1, chunks]"
            )

    @property
    def mma_n(self) -> int:
        """wgmma's N: the tile's tokens, four times over with post_scale."""
        return 4 * self.block_t if self.post_scale else self.block_t

    @property
    def in_flight(self) -> int:
        """Chunks whose wgmmas may run while the next chunk decodes (all of a step's: None)."""
        return self.chunks if self.mma_in_flight is None else self.mma_in_flight


_TILE_64 = FragmentConfig(128, 64, 4, 4, pdl=True, half_pair_rows=True)
_TILE_64_NARROW_32 = dataclasses.replace(_TILE_64, narrow_t=32)
_TILE_32_NARROW_16 = FragmentConfig(128, 32, 4, 4, pdl=True, narrow_t=16, half_pair_rows=True)

# GEMM1's full tiles warp-specialized, the prefill sizes' tile (CONFIGS, last entry).
_PREFILL_WS = FragmentConfig(
    128, 128, 4, 2, pdl=True, narrow_t=32, half_pair_rows=True, warp_specialized=True
)
# Both GEMMs' full tiles warp-specialized, at 128 columns: the TP shards' prefill tile.
_PREFILL_WS_BOTH = dataclasses.replace(_PREFILL_WS, warp_specialized_gemm2=True)
# 128-token tiles whose tiles of at most 64 tokens run as 128x64 on a 4-step ring: M = 1665
# to 2048 where the local experts' channels are few (CONFIGS).
_TILE_128 = FragmentConfig(
    128, 128, 4, 2, pdl=True, narrow_t=64, narrow_stages=4, half_pair_rows=True
)
# Both warp-specialized at fitted widths into float32 pair rows (TP=4 shards' too), TP=8 shards'
# into fp16 pair rows at 128 columns: M = 1665 to 2816 (CONFIGS).
_PREFILL_WS_FITTED = dataclasses.replace(
    _PREFILL_WS,
    fit_widths=True,
    warp_specialized_gemm2=True,
    below_intermediate=(
        1024,
        dataclasses.replace(
            _PREFILL_WS,
            fit_widths=True,
            warp_specialized_gemm2=True,
            half_pair_rows=False,
            below_intermediate=(512, _PREFILL_WS_BOTH),
        ),
    ),
)

# (max tokens x top_k, config), first match wins. Timings: H200, GPT-OSS-120B, shift decode,
# fp16 SwiGLU intermediate, CUDA-graph timed end to end over 4 layers' weights (L2-cold) for
# M <= 64.
CONFIGS = (
    # Decode: wgmma's smallest M (64 weight rows, one warpgroup), ring steps of four K chunks,
    # GEMM2 split in two, programmatic dependent launch, and the e8m0 factors applied after
    # the MMA (post_scale: two tokens per tile, block-diagonal activations as wgmma's N = 8).
    # M=1 / 4 / 16 (us): post-scaled 27.1 / 71.9 / 228.9 (with each M's wait below), against
    # scaled-fragment tiles 27.7 / 75.3 / 234.6.
    # M=1: GEMM2 waits for GEMM1's grid, two chunks' wgmmas in flight (one: 28.1; tile by
    # tile: 27.3). With panel-major weights: 23.5 us against 23.7 to 28.6 for tile waits,
    # three-step rings and GEMM2 in 3 or 4 splits.
    (
        4,
        FragmentConfig(
            64, 2, 4, 2, gemm2_split_k=2, chunks=4, pdl=True, mma_in_flight=2, post_scale=True
        ),
    ),
    # M=4: GEMM2 waits for GEMM1 tile by tile (it starts in GEMM1's last wave), one chunk's
    # wgmma in flight (two: 79.8 us; the grid wait: 76.7). H200, 2026-11-28, graph-timed over 4
    # layers beside vLLM: 63.3 us against 67.2 for the 128x8 tile below (TP=8 shard 24.7 / 24.0).
    (
        16,
        FragmentConfig(
            64,
            2,
            4,
            2,
            gemm2_split_k=2,
            chunks=4,
            pdl=True,
            tile_ready=True,
            mma_in_flight=1,
            post_scale=True,
        ),
    ),
    # From ~2 tokens per selected expert the decode's instructions bound the GEMMs on the
    # H200, not its HBM (ncu, M=64, the 64x8 tile: issue slots 83% busy, the ALU pipe the
    # busiest): 128 weight rows per warpgroup spread each chunk's copies, barriers and loop
    # over twice the decode (SASS per 64 rows and 128-K chunk: 191 instructions against 233
    # for 64 rows). H200, 2026-11-28, same run as vLLM's path, graph-timed over 4 layers, µs,
    # this / the previous pick / vLLM: whole layer M=8 106.3 / 114.4 (post-scaled 64x2) /
    # 173.9, M=12 149.9 / 162.0 / 229.8, M=16 182.4 / 198.8 / 283.2 (GEMM2 in 2 splits 183.8,
    # without tile counters 188.0, post-scaled 128x2 214.7); TP=8 M=8 30.3 / 35.5 / 51.9,
    # M=16 41.5 / 59.0 / 73.6; TP=2 M=16 100.6 / 116.3 / 170.1; TP=4 M=16 60.9 / 74.3 / 102.9.
    # A 4-step ring (more bytes in flight per CTA) where the intermediate is long, 3 steps on
    # TP=4 and TP=8 shards (short GEMM2s, more CTAs per SM). H200, two machines of 2026-11-28
    # (UUIDs 9a81a903, ef6c65f7), each one run beside vLLM's path, four interleaved rounds,
    # graph-timed over 4 layers, µs, 4 / 3 steps / vLLM: whole layer M=8 106.0 / 109.3 / 174.3
    # and 105.9 / 109.4 / 174.8, M=12 146.5 / 152.9 / 229.8 and 147.5 / 152.6 / 230.3, M=13
    # 168.2 / 175.5 / 248.4 and 168.4 / 174.4 / 249.3, M=16 181.7 / 188.8 / 283.3 and 181.7 /
    # 188.0 / 283.9; TP=2 M=13 91.6 / 93.9 / 145.3 and 91.3 / 93.6 / 145.9; TP=4 M=13 52.9 /
    # 51.8 / 84.5; TP=8 M=8 28.1 / 28.0 / 51.0, M=11 36.1 / 35.4 / 56.5, M=16 37.7 / 37.1 /
    # 73.3. GEMM2 in 2 splits instead gained as much on the whole layer and lost 7-12% on
    # TP=8 (M=11 37.9, M=16 40.5); both together no more than either. One other machine ran
    # the whole layer's 4-step ring 4-5% slower (docs/decisions.md).
    (
        64,
        FragmentConfig(
            128,
            8,
            4,
            4,
            pdl=True,
            tile_ready=True,
            below_intermediate=(1024, FragmentConfig(128, 8, 4, 3, pdl=True, tile_ready=True)),
        ),
    ),
    # Serving batches, where each selected expert holds a few tokens (M = 64: 256 pairs over
    # ~105 experts): the same 128x8 tile behind the multi-kernel router, which GEMM2's tile
    # counters would need the one-program router for. H200, 2026-11-28, same run as vLLM's
    # path, graph-timed over 4 layers, µs, 128x8 / the 64x8 tile picked before / vLLM: whole
    # layer M=32 300.4 / 342.0 / 435.7, M=64 418.2 / 470.9 / 567.6 (128x8 with a 4-step ring
    # 435.2, 64x8 with two chunks per step 470.4, 128x16 462.4), M=128 513.6 / 543.3 (128x16)
    # / 668.1; TP=8 M=32 61.6 / 67.3 / 83.7, M=64 82.3 / 82.5 / 110.9, M=128 90.9 / 100.3 /
    # 116.9; TP=2 M=64 218.3 / 240.6 / 321.4. At M=192 (~6 per expert, some past 8, whose
    # weights two 8-token tiles decode twice) 128x16 is level (whole 567.0 against 572.3,
    # TP=8 103.0 / 98.9), and at M=256 128x8 loses (724.2 against 590.8). H100 (memory-bound
    # there; before the multi-kernel router): M=64 64x8 tiles 584 us, 128x16 596, post-scaled
    # 64x2 / 64x4 674 / 623.
    (512, FragmentConfig(128, 8, 4, 3, pdl=True)),
    # ~4 to 8 tokens per expert (M = 129 to 256): 16-token tiles, whose tiles of at most 8
    # run in a launch of 128x8 tiles (narrow_t; at M=256 over half of them), except on TP=8
    # shards. H200, 2026-11-28, same run as vLLM's path, graph-timed over 4 layers, µs,
    # narrow_t 8 / none / vLLM: whole layer M=160 516.3 / 548.6 / 674.7, M=192 531.0 / 559.0
    # / 680.8, M=224 545.1 / 562.5 / 678.3, M=256 551.4 / 566.7 / 680.5 (3 stages 551.5);
    # TP=2 (I=1440) M=192 281.5 / 297.1 / 376.9, M=256 282.7 / 303.2 / 379.9; TP=4 (720)
    # M=192 156.2 / 163.9 / 190.8, M=256 167.8 / 167.8 / 191.3; TP=8 (360) M=192 102.1 /
    # 100.5 / 118.0, M=256 109.1 / 100.4 / 119.0. The epilogue's operands loaded before the
    # main loop (as the 8-token tiles do) lost: M=256 572.9 against 563.3, TP=8 102.1 / 100.6
    # (GEMM2 at 146 registers, three CTAs per SM).
    (
        1024,
        FragmentConfig(
            128,
            16,
            4,
            4,
            pdl=True,
            narrow_t=8,
            below_intermediate=(768, FragmentConfig(128, 16, 4, 4, pdl=True)),
        ),
    ),
    # ~8 to 16 tokens per expert (M = 257 to 512): 32-token tiles, whose tiles of at most 16
    # run in a launch of 128x16 tiles; on TP=8 shards one launch of 16-token tiles to M=384
    # (~12 an expert), of 32-token ones beyond. The 64-token tile with its 32-token narrow
    # launch (below) ran these sizes as 128x32 MMAs for every expert, and lost to vLLM's path
    # on the TP=8 shard at M=320. H200 (GPU-fb18fe09), 2026-11-28, pinned configs in one
    # process, three rounds in turned order, graph-timed over 4 layers, outputs bit for bit
    # the same, µs, 64-token tiles narrow_t 32 / 32-token narrow_t 16 / 16-token narrow_t 8 /
    # 32-token alone / 16-token alone / vLLM: whole layer M=320 666.1 / 576.2 / 580.0 / 650.5
    # / 568.7 / 679.6, M=384 675.8 / 590.4 / 629.5 / 658.1 / 598.9 / 730.8, M=448 680.9 /
    # 613.5 / 713.2 / 673.1 / 695.6 / 844.8, M=512 693.6 / 638.4 / 805.1 / 677.0 / 761.0 /
    # 939.2; TP=8 (384) M=320 128.8 / 111.9 / 115.4 / 119.7 / 107.4 / 121.4, M=384 129.3 /
    # 115.2 / 125.8 / 120.2 / 111.2 / 139.1, M=448 130.6 / 123.7 / 133.0 / 121.0 / 123.2 /
    # 146.2, M=512 131.4 / 126.9 / 146.4 / 122.2 / 135.8 / 167.8. Another H200 (GPU-010ecc4d),
    # same method, µs, 64-token narrow_t 32 / 32-token narrow_t 16 / 32-token alone / vLLM:
    # M=384 whole 698.3 / 618.8 / 706.8 / 763.4, TP=2 373.3 / 324.1 / 377.1 / 416.4, TP=4
    # 208.2 / 183.2 / 201.6 / 217.1; at M=256 the 16-token tile stays (whole 589.2 against
    # 600.9 for 32-token narrow_t 16, TP=2 317.1 / 313.8, TP=4 176.9 / 175.9), and at M=768
    # the 64-token one (whole 783.1 against 776.6 for 32-token tiles alone, TP=2 418.6 /
    # 413.6, TP=4 229.3 / 227.9: within 1.2%).
    (
        1536,
        dataclasses.replace(
            _TILE_32_NARROW_16,
            below_intermediate=(768, FragmentConfig(128, 16, 4, 4, pdl=True, half_pair_rows=True)),
        ),
    ),
    (
        2048,
        dataclasses.replace(
            _TILE_32_NARROW_16,
            below_intermediate=(768, FragmentConfig(128, 32, 4, 4, pdl=True, half_pair_rows=True)),
        ),
    ),
    # Prefill batches from M=513 to 1024: 64-token tiles waste less padding than 128 at up to ~64
    # rows per expert. 8 warps on this tile measured within run-to-run noise of 4. Two chunks
    # per step need ~2x the registers here and lost (M=4096: 3491 us against 2545). H100,
    # M=1024, one run: 1033.5 us (no PDL 1042.0, 3 stages 1070.6, GEMM2 in 2 splits 1078.0,
    # 128x32 1052.5 / 3 stages 1070.3, 64x64 1267.5 / 3 stages 1197.4, 64x32 1152.5).
    # Tiles of at most 32 tokens (at M=1024, ~32 per expert: every expert's tile about half
    # the time) in a launch of 128x32 tiles of their own: MMAs half as wide, the weights still
    # decoded once per expert. H100, same run as vLLM's path, whole layer, µs, narrow_t 32 /
    # none / 16 / vLLM: M=1024 916.1 / 1027.1 / 1033.8 / 1281.0 (3 stages 929.6), M=2048
    # 1450.3 / 1507.8 / 1423.3 / 1622.5 (8: 1440.0; the 128-token tile with 64: 1412.1).
    (4096, _TILE_64_NARROW_32),
    # M = 1025 to 1664 (~32 to 52 rows per expert): the narrow launch pays while enough
    # experts fit it, on the long intermediates longer (whole layer, TP=2: to M=1280); past
    # that, one launch of 64-token tiles beats both it and the 128-token tile below, whose
    # narrow launch and short shards pay a second launch for few tiles. H200, 2026-11-28, in
    # runs beside vLLM's path, three interleaved rounds, graph-timed over 4 layers, outputs
    # bit for bit the same (TP=2, TP=4 and M=1664 on a second machine), µs, 64-token tiles /
    # with narrow_t 32 / the 128-token tile below / vLLM: whole layer M=1152 1006.3 / 957.4 /
    # - / 1101.5, M=1280 1017.9 / 982.8 / - / 1123.0, M=1536 1057.5 / 1070.1 / - / 1127.5,
    # M=1664 1078.7 / - / 1080.4 / 1126.6; TP=2 M=1152 544.1 / 513.5 / 552.9 / 590.1, M=1280
    # 554.2 / 539.0 / 554.9 / 589.9, M=1536 573.0 / 584.3 / 571.8 / 598.6, M=1664 585.9 /
    # 593.9 / 581.9 / 603.4; TP=4 M=1152 294.6 / 292.8 / 302.7 / 323.2, M=1280 297.0 / 307.1 /
    # 303.8 / 323.4, M=1536 311.0 / 327.6 / 313.5 / 331.4, M=1664 318.0 / 334.3 / 317.5 /
    # 335.1; TP=8 M=1152 175.2 / 183.2 / - / 198.0, M=1280 177.4 / 192.1 / - / 199.9, M=1536
    # 182.9 / 208.4 / - / 203.7, M=1664 185.8 / - / 194.2 / 207.0.
    (5120, dataclasses.replace(_TILE_64_NARROW_32, below_intermediate=(1024, _TILE_64))),
    (6656, _TILE_64),
    # M = 1665 to 2048, ~52 to 64 rows per expert, where the local experts' channels are few
    # (the next paragraph): 128-token tiles whose experts of at most
    # 64 rows run as 128x64 tiles in the narrow launch, and those of 65 to 128 as one
    # 128-token tile rather than two 64-token ones (H200, µs, this with a 2-step narrow
    # ring / 64-token tiles / vLLM:
    # whole layer M=2048 1359.6 / 1459.6 / 1550.5, TP=8 246.3 / 262.7 / 293.5). The narrow
    # tiles on a 4-step ring of their own (narrow_stages): the 128-token tiles' 2 steps keep
    # two CTAs an SM, which the narrow tiles' smaller ring keeps at 4. H200, same method, µs,
    # 4 / 2 steps / vLLM: whole layer M=1792 1174.3 / 1193.5 / 1255.5, M=2048 1337.6 / 1335.0
    # / 1585.2; TP=2 M=1792 622.3 / 639.0 / 686.2; TP=4 M=1792 345.4 / 354.5 / 375.8; TP=8
    # M=1792 215.0 / 221.7 / 243.0, M=2048 242.1 / 246.2 / 293.9 (3 steps 215.2 and 242.6).
    # Where the local experts' channels are many (GPT-OSS-120B's whole layer, TP=2 and TP=4
    # shards, EP=2 and EP=4 ranks), both GEMMs warp-specialized at fitted widths, as from M >
    # 2048 (below); where few (TP=8 shards, EP=8 ranks, GPT-OSS-20B's TP=2 shard and EP=2
    # rank: 47-49 K channels against 94 K and more), whose persistent kernel would have 2-3
    # GEMM1 work items an SM, the 128-token tile. H200 (GPU-4c23b9da), 2026-11-29,
    # `benchmarks/ab_moe_configs.py`, graph-timed over 4 layers, outputs bit for bit the same,
    # µs, the 128-token tile / warp-specialized / vLLM: whole layer M=1792 1174.1 / 1148.7 /
    # 1250.9, M=2048 1335.6 / 1220.3 / 1550.1; TP=2 M=1792 640.1 / 630.6 / 685.4, M=2048 736.2 /
    # 687.8 / 839.6; TP=4 M=1792 353.9 / 356.9 / 375.7, M=2048 405.4 / 392.9 / 464.9; EP=2 M=1792
    # 619.4 / 604.4 / 826.6, M=2048 668.3 / 640.1 / 826.8; EP=4 M=1792 332.7 / 328.6 / 420.1,
    # M=2048 344.1 / 331.5 / 422.9; TP=8 M=1792 217.6 / 251.1 / 244.4, M=2048 243.1 / 254.6 /
    # 294.0; EP=8 M=1792 182.8 / 196.7 / 240.9, M=2048 195.5 / 209.1 / 241.6. GPT-OSS-20B at
    # the same tokens per expert: whole layer (94 K channels) M=448 307.3 / 309.4 / 337.5,
    # M=512 344.8 / 333.5 / 375.2; TP=2 M=448 173.7 / 186.8 / 202.1, M=512 192.2 / 189.1 /
    # 205.8; EP=2 M=448 170.6 / 184.4 / 231.7, M=512 189.6 / 200.8 / 230.3.
    # At M=1792 (56 tokens per expert) the TP=4 shard and the 94 K channels beside it lose or
    # sit level: there the warp-specialized kernel takes from 128 K channels (another H200 the
    # same day, same method, µs, the 128-token tile / warp-specialized / vLLM: whole layer
    # M=1792 1190.5 / 1166.8 / 1258.5, M=2048 1350.8 / 1238.9 / 1597.9; TP=4 M=1792 351.5 /
    # 362.4 / 378.4, M=2048 404.1 / 399.0 / 468.4).
    (7168, dataclasses.replace(_PREFILL_WS_FITTED, below_expert_channels=(131072, _TILE_128))),
    (8192, dataclasses.replace(_PREFILL_WS_FITTED, below_expert_channels=(65536, _TILE_128))),
    # From ~128 rows per expert: 128 tokens per tile halve the weight decode per MMA, and a
    # two-step ring keeps shared memory for two independent 4-warp CTAs per SM (255
    # registers), which interleave one's decode with the other's wgmmas. One 8-warp CTA of two
    # warpgroups on the same rows steps them in lockstep through the ring's barriers and
    # lost. H200, same run as vLLM's path, whole layer / TP=8 shard (I=384), µs: M=4096 2348
    # / 480 against 2503 / 489 for 128x64 (vLLM 2429 / 428), M=8192 3958 / 814 against 4470 /
    # 867 (vLLM 3998 / 698); 256x128 on 8 warps 2659 / 545 and 4415 / 917, 64x128 2948 / 581
    # and 5022 / 996, 128x128 with a three-step ring (one CTA per SM) 3493 / 680 at M=4096.
    # An expert's last tile holds its tokens past a multiple of 128, most often a few: those
    # of at most 32 run as 128x32 tiles (narrow_t). H100, same run as vLLM's path, µs,
    # narrow_t 32 / none / 16 / 8 / vLLM: whole layer M=4096 2147.2 / 2400.3 / 2134.9 / - /
    # 2485.2, M=8192 3805.4 / 4062.9 / 3840.4 / 3915.4 / 4074.4; TP=8 shard M=4096 454.6 /
    # 494.0 / 449.5 / - / 444.7, M=8192 818.4 / 846.1 / 824.6 / 830.1 / 740.3. The 64-token
    # tile above with narrow_t 16 / 32: M=4096 2481.3 / 2505.4, TP=8 497.6 / 502.0.
    # GEMM1's full tiles warp-specialized (fragment_ws_sm90: a producer warpgroup feeding two
    # consumers on 256 rows through a 4-step ring, persistent). H200, same run as vLLM's path,
    # µs, warp-specialized / this tile's fragment kernel / vLLM: whole layer M=3072 1623.3 /
    # 1709.7 / 1696.7, M=6144 3108.9 / 3241.7 / 3263.7, M=8192 3709.4 / 3810.3 / 4060.0; TP=8
    # shard M=3072 315.6 / 349.3 / 291.0, M=6144 581.0 / 624.4 / 558.9, M=8192 720.7 / 719.3 /
    # 712.9. Not at M <= 2048 (above): TP=8 M=1536 222.7 against 216.9.
    # Its tiles of at most 64 / 96 tokens multiplied 64 / 64 + 32 columns wide (fit_widths) where
    # the intermediate is the whole layer's or a TP=2 shard's, and a TP=4 shard's to M=3072; TP=8
    # shards keep 128. H200, 2026-11-28, same run as vLLM's path, graph-timed over 4 layers, three
    # interleaved rounds, outputs bit for bit the same, µs, 128 / fit_widths / 64 alone / vLLM:
    # whole layer M=3072 1622.6 / 1597.2 / 1633.0 / 1708.6, M=6144 3085.8 / 3017.5 / 3042.0 / 3257.5
    # (another run: M=4096 2058.4 / 2063.3, M=8192 3691.2 / 3683.5); TP=8 shard M=3072 287.5 / 292.9
    # / 295.1 / 291.4, M=4096 393.5 / 398.1 / 401.5 / 430.7, M=6144 547.2 / 567.4 / 543.2 / 552.7.
    # Another machine, same method, µs, 128 / fitted / vLLM: TP=2 M=3072 889.5 / 886.0 / 898.6,
    # M=5120 1492.9 / 1445.3 / 1752.3, M=6144 1695.8 / 1666.7 / 1749.3, M=7168 1772.4 / 1774.9 /
    # 1795.3, M=8192 2031.0 / 2026.0 / 2198.5; TP=4 M=3072 489.5 / 489.0 / 488.7, M=5120 840.6 /
    # 816.2 / 931.6, M=6144 932.4 / 971.6 / 950.8, M=7168 973.7 / 976.3 / 968.7. A third machine:
    # TP=4 M=2304 455.8 / 437.1 / 478.8, M=2560 465.3 / 455.8 / 482.8, M=2816 473.7 / 469.3 / 486.1,
    # M=3072 484.7 / 486.8 / 487.1, M=3584 537.4 / 538.8 / 540.2; TP=8 M=2304 271.9 / 267.2 / 278.8,
    # M=2560 275.4 / 284.5 / 284.2, M=3072 285.8 / 292.1 / 289.5.
    # GEMM2's full tiles warp-specialized too (warp_specialized_gemm2) where its rows are fp16 into
    # float32 pair rows (the whole layer, TP=2 shards, expert-parallel ranks, TP=4 shards to M=3072;
    # TP=8 shards keep fp16 pair rows on the fragment kernel): its 256-row work items over 23 K
    # chunks fill the SMs evenly where few experts each hold about one tile (EP=16 at M=3072: 8
    # experts x 12 items over 132 SMs, against 8 x 23 fragment CTAs leaving 52 SMs two), and take
    # fitted widths. Outputs bit for bit the fragment kernel's. H200 (GPU-79c90241), 2026-11-29,
    # `benchmarks/ab_moe_configs.py`, graph-timed over 4 layers beside vLLM's path, three rounds in
    # turned order, µs, GEMM1 only / both / vLLM: whole layer M=3072 1562.6 / 1479.9 / 1642.3,
    # M=6144 2955.2 / 2840.2 / 3216.1, M=8192 3578.6 / 3552.0 / 3981.6; TP=2 M=3072 870.1 / 836.5 /
    # 886.3, M=6144 1650.3 / 1590.7 / 1745.0, M=8192 2001.2 / 1980.6 / 2191.4; EP=16 M=2304 150.7 /
    # 137.7 / 158.7, M=3072 164.8 / 155.0 / 161.2, M=3840 162.0 / 154.7 / 166.0, M=6144 259.7 /
    # 241.0 / 265.9, M=8192 290.2 / 280.1 / 308.3; EP=8 (GEMM1 only: GEMM2 then in two K splits to
    # M=3584) M=2304 224.3 / 211.7 / 244.3, M=3072 241.0 / 230.4 / 246.7, M=3584 250.5 / 239.0 /
    # 250.0, M=3840 292.0 / 274.1 / 291.3, M=6144 427.7 / 406.5 / 441.1, M=8192 494.0 / 494.2 /
    # 523.4; EP=4 M=2304 401.2 / 359.1 / 424.7, M=3072 435.1 / 405.3 / 431.4, M=3840 490.5 / 489.7 /
    # 516.1, M=6144 805.1 / 763.2 / 835.5, M=8192 918.5 / 907.6 / 986.8. With float32 pair rows on
    # TP shards, GEMM1 only with fp16 rows (the pick) / both: TP=4 M=3072 485.1 / 469.4 (vLLM
    # 482.1), M=7168 962.2 / 963.7 (952.8); TP=8 M=3072 284.9 / 289.2 (288.8), M=7168 564.2 / 584.8
    # (565.4) (another H200 the same day, TP=4, µs, the pick / both / vLLM: M=2304 437.7 / 413.5
    # / 472.1, M=2560 456.7 / 437.5 / 478.7, M=2816 468.9 / 451.2 / 479.4, M=3072 485.9 / 467.7 /
    # 484.0). On the TP shards' fp16 pair rows each consumer stages its output tile through
    # shared memory of its own (a 3-step ring leaves room), which takes GEMM2 there too, at
    # 128-column MMAs: TP=8 shards and TP=4 from M > 2816, where TP=4 to M=2816 keeps float32
    # pair rows at fitted widths. H200 (GPU-f64ebbbc), 2026-11-29, same method, outputs bit for
    # bit the fragment kernel's fp16 rows, µs, GEMM2 on the fragment kernel (the pick then) /
    # warp-specialized on fp16 rows / the same fitted / vLLM: TP=8 M=2304 273.0 / 258.1 / - /
    # 278.7, M=3072 286.4 / 270.0 / 288.4 / 290.1, M=4096 393.5 / 372.1 / - / 427.4, M=6144
    # 540.0 / 513.3 / - / 552.8, M=7168 569.0 / 525.1 / 547.6 / 566.8, M=8192 667.4 / 645.5 / - /
    # 699.6; TP=4 M=4096 616.2 / 603.5 / - / 703.1, M=6144 920.2 / 891.4 / - / 934.3, M=7168
    # 964.3 / 934.2 / 959.1 / 952.0, M=8192 1120.6 / 1105.8 / - / 1180.0; TP=4, float32 rows
    # fitted (the pick then) / fp16 rows warp-specialized / vLLM: M=2304 420.3 / 440.5 / 474.3,
    # M=2816 457.0 / 464.2 / 483.5, M=3072 479.3 / 459.0 / 483.9.
    (11264, _PREFILL_WS_FITTED),
    (
        None,
        dataclasses.replace(
            _PREFILL_WS,
            fit_widths=True,
            warp_specialized_gemm2=True,
            below_intermediate=(1024, _PREFILL_WS_BOTH),
        ),
    ),
)


@functools.cache
def scaled_fragments(config: FragmentConfig) -> FragmentConfig:
    """A post-scaled config's scaled-fragment form: 8-token tiles (wgmma's N without the four
    block-diagonal groups), built once per config rather than per call."""
    return dataclasses.replace(config, post_scale=False, block_t=8)


def for_layer(
    config: FragmentConfig, padded_intermediate: int, local_experts: int
) -> FragmentConfig:
    """The config as it runs on `local_experts` experts of `padded_intermediate` channels:
    below_expert_channels' where their channels together are fewer, below_intermediate's where
    the intermediate is shorter (in turn). Every moe_apply asks: field reads where nothing
    changes."""
    while True:
        by_experts, by_intermediate = config.below_expert_channels, config.below_intermediate
        if by_experts is not None and local_experts * padded_intermediate < by_experts[0]:
            config = by_experts[1]
        elif by_intermediate is not None and padded_intermediate < by_intermediate[0]:
            config = by_intermediate[1]
        else:
            return config


@functools.cache
def grid_wait(config: FragmentConfig) -> FragmentConfig:
    """The config with GEMM2 waiting for the whole kernel before it (no tile counters): with
    fp8 activations quantized per row a pass runs between the GEMMs, and GEMM1's counters
    would not say that it is done."""
    return dataclasses.replace(config, tile_ready=False)


def gemm2_splits(requested: int, K: int) -> int:
    """The GEMM2 split count for `requested` ways over K (padded) columns: as many as there
    are non-empty splits of whole 128-column chunks."""
    chunks = K // 128
    per_split = -(-chunks // max(1, requested))
    return -(-chunks // per_split)


# fp16 pair rows, each element not below the bound exact in float32 instead; a tile holding one
# pays a predicated float32 store per element. Rows grow with the intermediate size they sum over:
# at TP=4 and TP=8 shards most tiles stay below the bound, at TP=2 and whole layers few. H200,
# GPT-OSS-120B, same run as vLLM's path, µs, fp16 / float32 rows / vLLM: TP=8 (I=384) M=1024 182.4
# / 188.0 / 239.8, M=2048 266.9 / 280.9 / 292.4, M=4096 405.1 / 435.8 / 431.0, M=8192 728.2 /
# 794.5 / 723.3; TP=4 (768) M=2048 439.8 / 446.4 / 473.2, M=8192 1237.6 / 1260.5 / 1221.1 (a
# choice per pair, before the choice per element). With it (H200, same run as vLLM, µs, fp16 /
# float32 rows): whole layer M=2048 1386.3 / 1373.2, M=4096 2069.1 / 2051.4, M=8192 3728.3 /
# 3712.8; TP=2 (1440) M=2048 734.1 / 735.3, M=4096 1134.1 / 1128.9, M=8192 2032.1 / 2035.6.
HALF_PAIR_ROWS_MAX_INTERMEDIATE = 768


def half_pair_rows(config: FragmentConfig, padded_intermediate: int, splits: int) -> bool:
    """Whether GEMM2 stores fp16 pair rows: where the config allows them, GEMM2 is unsplit
    and the intermediate size is at most HALF_PAIR_ROWS_MAX_INTERMEDIATE."""
    return (
        config.half_pair_rows
        and splits == 1
        and padded_intermediate <= HALF_PAIR_ROWS_MAX_INTERMEDIATE
    )


def half_pair_rows_bound(top_k: int) -> float:
    """The magnitude below which GEMM2's pair rows may be fp16 (FragmentConfig.half_pair_rows):
    an element below 2^(e+1) rounds to fp16 by at most 2^(e-11), so a token's top_k rows err by
    at most top_k * bound * 2^-12 <= 2^-8 together, under half the bf16 output's absolute
    tolerance (0.01) however much the rows cancel; elements at or above it stay exact."""
    return 2.0 ** math.floor(math.log2(16 / top_k))
