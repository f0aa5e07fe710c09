"""Exactness for non-finite V in the tiles whose rows see and mask the same keys.

A causal or windowed prefill/extend tile, and a decode tile with Q > 1, loads keys that some of
its rows see and others mask. A masked key's weight is exactly 0, but 0 * NaN and 0 * inf are
NaN in p @ v, so a NaN or inf in V at such a key reaches the rows that mask it. The reference
gives those rows the exact sum over their visible keys, and NaN to every row that sees a key
whose V row is not all finite.

The fast kernels pay a few instructions per tile for that, after the key loop: each row of the
accumulator is summed within its warp, and the threads holding a row that is not finite set
the tile's int8 flag (a predicated store; moving the row flags to the store's layout is one
shared-memory round trip, as for the lse). A fix-up launch of the same kernel source right
after (the EXACT specialization: none of its code sits in the fast kernel, whose registers and
schedule stay as they were) scans the flags, recomputes the flagged tiles exactly, overwriting
what the fast program stored (every block masked, V rows that are not all finite zeroed for the
dot, the rows that see one set to NaN), and clears the flags it found. So the flags are zero
between calls (allocated zeroed; a flag left set by a call that stopped between the launches
only costs the next call one exact recompute of that tile, whose output is right either way).

The fix-up grid is persistent, one program per SM at most, each scanning its share of the flags
in vector loads: a full grid of early-exit programs would be as many CTAs as the fast launch,
each sized for the exact path's registers, and on finite inputs that costs waves of launches
for nothing. With finite inputs the fix-up is one small launch that reads a few KB and writes
nothing.

Measured cost on finite inputs (H100, GPT-OSS-120B shapes, `scripts/attention_ab.py --rounds
30`: CUDA graphs, L2 cold, outputs bitwise equal to the kernels without it): causal prefill
S=1024x16 / 8192x2 1.028x / 1.019x, window-127 prefill 1.04-1.05x, causal extend 4x1024 over
8192 1.006x, window-127 extend 1.07x, decode Q=4 B=16 1.036x (window 127: 13.6 -> 15.8 us, the
extra launch), decode Q=1 unchanged. The in-kernel rerun this replaces cost 1.37-1.44x on causal
prefill (docs/decisions.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenspeed_kernel.platform import platform_of

# Flags one fix-up program reads per vector load.
FLAG_CHUNK = 256

_flags: dict[tuple, torch.Tensor] = {}


def current_stream(device: torch.device) -> int:
    # The raw handle: a C call, where torch.cuda.current_stream builds a Python object.
    return torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0


def tile_flags(device: torch.device, count: int) -> torch.Tensor:
    """A zeroed int8 buffer of at least `count` flags, kept per device, stream and power-of-two
    size: no allocation on a warm call, a captured CUDA graph keeps a valid buffer, and launches
    on one stream (the only ones that share it) run in order."""
    size = max(FLAG_CHUNK, triton.next_power_of_2(count))
    key = (device, current_stream(device), size)
    flags = _flags.get(key)
    if flags is None:
        flags = _flags[key] = torch.zeros(size, dtype=torch.int8, device=device)
    return flags


def fixup_programs(device: torch.device, count: int) -> int:
    """Programs of a fix-up launch over `count` flags: one per SM, never more than the flag
    chunks there are to scan."""
    return max(1, min(platform_of(device).sm_count, triton.cdiv(count, FLAG_CHUNK)))


@triton.jit
def flag_nonfinite(Flag, acc, row_ok):
    """Sets *Flag when a row the program stores (row_ok) holds a NaN or inf in acc [M, D]. A
    row sum is finite iff its terms are (a finite row whose sum overflows only sends the tile to
    the fix-up, which recomputes the same values); it stays within a warp, and the threads
    holding a bad row store the flag themselves: no reduction across the tile."""
    row_sum = tl.sum(acc, 1)
    bad = row_ok & ((tl.abs(row_sum) < float("inf")) == 0)
    tl.store(Flag + tl.zeros_like(row_sum).to(tl.int32), 1, mask=bad)


@triton.jit
def flag_span(num_flags):
    """[lo, hi): the flags this fix-up program scans, a contiguous share of num_flags."""
    per_program = tl.cdiv(num_flags, tl.num_programs(0))
    lo = tl.program_id(0) * per_program
    return lo, tl.minimum(lo + per_program, num_flags)


@triton.jit
def any_flag(Flags, c0, hi, FLAG_CHUNK: tl.constexpr):
    """Whether a flag in [c0, min(c0 + FLAG_CHUNK, hi)) is set: one vector load."""
    offs = c0 + tl.arange(0, FLAG_CHUNK)
    return tl.max(tl.load(Flags + offs, mask=offs < hi, other=0).to(tl.int32), 0) != 0


@triton.jit
def clear_flags(Flags, c0, hi, FLAG_CHUNK: tl.constexpr):
    """Zero the flags [c0, min(c0 + FLAG_CHUNK, hi)) once their tiles are recomputed."""
    offs = c0 + tl.arange(0, FLAG_CHUNK)
    tl.store(Flags + offs, tl.zeros([FLAG_CHUNK], tl.int8), mask=offs < hi)
