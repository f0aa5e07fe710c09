"""Pieces shared by the Triton MoE kernels: the tile config with its per-platform heuristic and
scoped pin, device queries, and the padding rule. Imports neither core nor the attention kernels.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# H and I are padded to a multiple of this (GPT-OSS 2880 -> 2944, +2.2% bytes and FLOPs) so that
# every K step and N block of both GEMMs is full: BLOCK_K and BLOCK_N (<= 128; GEMM1's N is 2I,
# so up to 256 there) divide it and the inner loop needs no K/N masks. 64 would leave 2880
# unpadded but forces BLOCK_K = 64 and GEMM2's BLOCK_N = 64, which cost more than 2.2%.
PAD_MULTIPLE = 128

# Weight formats as the kernels' W_FORMAT constexpr (host ints; constexpr twins for jit code).
WEIGHT_FORMAT_CODES = {"bf16": 0, "fp8": 1, "mxfp4": 2}
W_BF16 = tl.constexpr(0)
W_FP8 = tl.constexpr(1)
W_MXFP4 = tl.constexpr(2)


@triton.jit
def round_to_bf16(x, INTERPRETED: tl.constexpr):
    """x float32 -> bfloat16, rounded to nearest even. The Triton 3.6 interpreter's float32 ->
    bfloat16 cast truncates and garbles subnormals, so there the rounding is done on the bits and
    the top half reinterpreted (finite x)."""
    if INTERPRETED:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def round_to_fp8(x, INTERPRETED: tl.constexpr):
    """x float32 within +-448 -> float8_e4m3fn, rounded to nearest even. The Triton 3.6
    interpreter rounds values just below a power of two down a whole binade (124.7 -> 64), so
    there x is first rounded to e4m3 precision in float32: 3 mantissa bits on the bits for
    normals, multiples of 2^-9 (the subnormal step, via an exact magic-number add) below 2^-6."""
    if INTERPRETED:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
        normal = bits.to(tl.float32, bitcast=True)
        sub = (x + 12288.0) - 12288.0
        x = tl.where(tl.abs(x) < 0.015625, sub, normal)
    return x.to(tl.float8e4nv)


def round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class DeviceInfo:
    """What the config heuristics need to know about a device."""

    vendor: str  # "nvidia", "amd" or "interpreter"
    arch: str  # "sm_90", "gfx942", ... or "cpu"
    sm_count: int


@functools.cache
def _device_info(device_type: str, index: int | None) -> DeviceInfo:
    if device_type != "cuda":
        return DeviceInfo("interpreter", "cpu", os.cpu_count() or 1)
    props = torch.cuda.get_device_properties(index)
    if torch.version.hip:
        return DeviceInfo("amd", props.gcnArchName.split(":")[0], props.multi_processor_count)
    return DeviceInfo("nvidia", f"sm_{props.major}{props.minor}", props.multi_processor_count)


def device_info(device: torch.device) -> DeviceInfo:
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    return _device_info(device.type, index)


@dataclass(frozen=True)
class MoETileConfig:
    """Tiles of the grouped GEMMs (GEMM1's BLOCK_N counts interleaved gate/up rows, so it
    produces BLOCK_N/2 SwiGLU outputs). block_m is also the expert padding of the sorted rows."""

    block_m: int
    block_n1: int
    block_n2: int
    block_k: int
    num_warps: int
    num_stages: int


# (max tokens x top_k, config), first match wins. One line of hardware reason each.
_NVIDIA = (
    # Decode: weight streaming. 16 rows is the smallest MMA tile; narrow N blocks give ~370
    # CTAs per GEMM at M=1, and 6 stages of 4 KB weight loads hide HBM latency (measured on
    # H200: 97 us at M=1 vs 108 us with BLOCK_K 256 x 4 stages).
    (64, MoETileConfig(16, 64, 64, 128, 4, 6)),
    # Mid batches, up to 4096 tokens x top-4 (~128 rows per GPT-OSS expert): 64-row tiles with
    # 4 warps; measured on H200 at M=4096: 4.04 ms vs 4.22 ms with the 128-row tile below,
    # which wins from M=8192 (6.97 vs 7.16 ms).
    (16384, MoETileConfig(64, 128, 128, 64, 4, 4)),
    # Prefill: matmul-bound; 128x128 wgmma tiles with 8 warps, 3 stages fit shared memory
    # together with the in-register dequantized weight tile.
    (None, MoETileConfig(128, 128, 128, 64, 8, 3)),
)
_AMD = (
    # CDNA: 64 KB LDS on gfx942 bounds stages x tile; wave64 makes 4 warps = 256 threads.
    (64, MoETileConfig(16, 64, 64, 128, 4, 2)),
    (2048, MoETileConfig(64, 128, 128, 64, 4, 2)),
    (None, MoETileConfig(128, 128, 128, 64, 8, 2)),
)
# The interpreter runs numpy per program: small tiles keep padding waste (and test time) low.
_INTERPRETER = ((None, MoETileConfig(16, 64, 64, 128, 4, 1)),)


class ConfigPin:
    """A scoped override of the heuristic tile config (tests and benchmarks)."""

    def __init__(self) -> None:
        self.pinned: MoETileConfig | None = None

    @contextlib.contextmanager
    def pin(self, config: MoETileConfig) -> Iterator[MoETileConfig]:
        previous, self.pinned = self.pinned, config
        try:
            yield config
        finally:
            self.pinned = previous


PIN = ConfigPin()


def pick_config(num_pairs: int, info: DeviceInfo) -> MoETileConfig:
    """The tile config for `num_pairs` = tokens x top_k on `info`'s device."""
    if PIN.pinned is not None:
        return PIN.pinned
    return first_match({"nvidia": _NVIDIA, "amd": _AMD}.get(info.vendor, _INTERPRETER), num_pairs)


def first_match(table, num_pairs: int):
    """The config of the first (max pairs or None, config) row of `table` that covers
    `num_pairs`; every table ends with a catch-all (None) row."""
    for limit, config in table:
        if limit is None or num_pairs <= limit:
            return config
    raise AssertionError("unreachable: every table ends with a catch-all row")


@functools.cache
def has_ptx_decode(info) -> bool:
    """Whether the MXFP4 byte-permute decoder (inline PTX with mul.rn.bf16x2) runs on `info`'s
    device: NVIDIA sm_90 and newer, compiled (the interpreter cannot run PTX). Cached: every
    moe_apply asks."""
    if info.vendor != "nvidia" or not info.arch.startswith("sm_"):
        return False
    return int(info.arch[3:].rstrip("a")) >= 90


def pin_config(config: MoETileConfig):
    """Context manager: every MoE launch inside uses `config`."""
    return PIN.pin(config)
