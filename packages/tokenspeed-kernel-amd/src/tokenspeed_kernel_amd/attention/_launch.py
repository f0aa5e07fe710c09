"""Host side of the Gluon attention launchers: the arch code of a launch (from core's
Platform), offset width and direct-to-LDS eligibility, GQA head packing, the ragged (prefill /
extend) tile config, and the traits the three kernels register with."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenspeed_kernel.platform import Platform, platform_of
from tokenspeed_kernel.registry import ANY
from tokenspeed_kernel.tuning import first_match, pinned_config

from ._common import ARCH_CODES, CODE_GFX942, CODE_GFX950, CODE_NVIDIA, LOG2E

# Above the portable Triton kernels (100) on CDNA, for which these are written. The same
# sources built with `arch="nvidia"` exist to test the shared body's numerics on NVIDIA GPUs,
# never to serve requests there.
PRIORITY = 200
PLATFORMS = ("amd:gfx942,gfx950",)
HEAD_DIMS = (64, 128)
HALF_DTYPES = (torch.bfloat16, torch.float16)
FP8_DTYPE = torch.float8_e4m3fn
# Buffer instructions take 32-bit byte offsets from a scalar base.
BUFFER_LIMIT_BYTES = 1 << 31


# Features every attention kernel here supports; each adds its kv dtypes and op traits.
_COMMON_TRAITS = dict(
    dtype=HALF_DTYPES, head_dim=HEAD_DIMS, gqa_ratio=ANY, window=True, sinks=True, lse=True
)


def attention_traits(kv_dtypes: tuple, **extra) -> dict:
    return {**_COMMON_TRAITS, "kv_dtype": kv_dtypes, **extra}


def launch_arch(device: torch.device, arch: str | None) -> tuple[int, Platform]:
    """(ARCH code, platform) of a launch on `device`; `arch` ("gfx942", "gfx950", "nvidia")
    overrides the platform's architecture (the tests' NVIDIA instantiation)."""
    platform = platform_of(device)
    name = arch or (platform.arch if platform.vendor == "amd" else platform.vendor)
    if name not in ARCH_CODES:
        raise ValueError(f"arch is {name!r}, expected one of {', '.join(ARCH_CODES)}")
    return ARCH_CODES[name], platform


def qk_scale_log2(head_dim: int, softmax_scale: float | None, k_scale: float = 1.0) -> float:
    """The logits' scale in base 2; an FP8 cache's key scale folds in here."""
    scale = head_dim**-0.5 if softmax_scale is None else float(softmax_scale)
    return scale * float(k_scale) * LOG2E.value


def paged_out(q: torch.Tensor, k_cache: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The output an FP8 cache gives (bfloat16) unless `out` is given."""
    if out is not None:
        return out
    dtype = torch.bfloat16 if k_cache.dtype == FP8_DTYPE else q.dtype
    return torch.empty(q.shape, dtype=dtype, device=q.device)


def optional_operands(out: torch.Tensor, lse, sinks, lse_dims: int) -> tuple:
    """(lse, sinks, lse strides); an absent operand passes `out`, which the kernel never reads
    through it (HAS_LSE / HAS_SINKS are off)."""
    lse_strides = lse.stride() if lse is not None else (0,) * lse_dims
    return lse if lse is not None else out, sinks if sinks is not None else out, lse_strides


def needs_wide_offsets(*tensors: torch.Tensor | None) -> bool:
    """True when some tensor spans 2 GiB or more: 32-bit (buffer) offsets cannot reach it."""
    for t in tensors:
        if t is None:
            continue
        span = 1 + sum(
            (size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True)
        )
        if span * t.element_size() >= BUFFER_LIMIT_BYTES:
            return True
    return False


def async_ok(arch_code: int, cache: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """Direct-to-LDS copies move 16 bytes per lane: 16-bit rows, 16-byte aligned bases and
    row strides. gfx942 has no such copy (it stages through registers)."""
    if arch_code == CODE_GFX942 or cache.element_size() != 2:
        return False
    for t in (cache, *tensors):
        if t.data_ptr() % 16 or any(s % 8 for s in t.stride()[:-1]):
            return False
    return True


def memory_flags(arch_code: int, k, v, direct_to_lds: bool | None, *tensors) -> dict:
    """BUFFER / ASYNC / WIDE of a launch reading `k`, `v` and `tensors`. `direct_to_lds`: None
    = wherever `async_ok` allows; False forces the staging through registers (the gfx942 path,
    which tests check on NVIDIA this way)."""
    wide = needs_wide_offsets(k, v, *tensors)
    allowed = async_ok(arch_code, k, v) and not wide
    copies = allowed if direct_to_lds is None else bool(direct_to_lds) and allowed
    return dict(BUFFER=arch_code != CODE_NVIDIA and not wide, ASYNC=copies, WIDE=wide)


def pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two dividing n, at most cap."""
    p = 1
    while n % (2 * p) == 0 and 2 * p <= cap:
        p *= 2
    return p


@dataclass(frozen=True)
class RaggedConfig:
    """Tiles of the ragged kernels (prefill, extend)."""

    block_m: int  # rows per program: tokens x packed heads
    block_n: int  # keys per LDS tile
    num_warps: int
    instr_m: int  # MMA instruction M (32x32 or 16x16 MFMA; 16 for mma_v2)
    max_head_pack: int  # query heads of one GQA group sharing a program


# gfx950 keys per LDS tile by head dim (160 KiB LDS): 128 at D=64, 64 at D=128.
GFX950_BLOCK_N = ((64, 128), (None, 64))


def ragged_config(arch_code: int, head_dim: int) -> RaggedConfig:
    if arch_code == CODE_GFX950:
        # 32x32 MFMA keeps the 128-row accumulator at 64 VGPRs per lane for D=128.
        return RaggedConfig(128, first_match(GFX950_BLOCK_N, head_dim), 4, 32, 16)
    if arch_code == CODE_GFX942:
        # 64 KiB LDS: 64-key tiles (32 KiB for K+V at D=128) leave room for the layout
        # conversions of Q and P; 304 CUs want many programs, so no wider tiles.
        return RaggedConfig(128, 64, 4, 32, 16)
    # NVIDIA (numerics of the shared body): mma_v2 with four 16-row warps.
    return RaggedConfig(64, 64, 4, 16, 8)


def ragged_launch(
    kernel_name: str,
    q,
    k,
    v,
    out,
    lse,
    sinks,
    *,
    max_seqlen: int,
    window_left,
    arch,
    direct_to_lds,
    num_seqs: int,
    more=(),
) -> tuple[tuple, dict]:
    """(grid, constexprs and options) shared by the prefill and extend launches; the config
    is the one pinned for `kernel_name`, else `ragged_config`'s."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    arch_code, _ = launch_arch(q.device, arch)
    cfg = pinned_config(kernel_name) or ragged_config(arch_code, head_dim)
    group = num_q_heads // k.shape[-2]
    h_pack = pow2_divisor(group, min(cfg.max_head_pack, cfg.block_m))
    grid = (-(-max_seqlen // (cfg.block_m // h_pack)), num_seqs, num_q_heads // h_pack)
    return grid, dict(
        ARCH=arch_code, HEAD_DIM=head_dim, GQA=group, H_PACK=h_pack, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, INSTR_M=cfg.instr_m, NUM_WARPS=cfg.num_warps,
        HAS_WINDOW=window_left >= 0, HAS_SINKS=sinks is not None, HAS_LSE=lse is not None,
        **memory_flags(arch_code, k, v, direct_to_lds, q, out, lse, *more),
        num_warps=cfg.num_warps,
    )  # fmt: skip
