"""Pieces shared by the Triton attention kernels: the online-softmax block update, the final
normalization (sinks, lse), the tile config type with its scoped pin, and device queries.

Scores live in the log2 domain (`qk_scale` = softmax_scale * log2(e)) so the exponentials are
`exp2`, one MUFU instruction each; the lse is converted back to the natural log at the end.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


@triton.jit
def attn_block_update(
    acc,
    l_i,
    m_i,
    q,
    k,
    v,
    qk_scale,
    rows,
    cols,
    seq_k,
    window_left,
    MASK: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """One key block of online softmax.

    q [BLOCK_M, D], k [D, BLOCK_N] (already transposed), v [BLOCK_N, D]; rows/cols are the
    absolute positions of the queries and keys. MASK=False is the fast path for blocks every
    query sees entirely (no compare/select, no -inf guard).
    """
    s = tl.dot(q, k)
    if MASK:
        visible = cols[None, :] < seq_k
        if IS_CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None])
        if HAS_WINDOW:
            visible = visible & (cols[None, :] >= rows[:, None] - window_left)
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_use[:, None])
    else:
        # qk_scale > 0, so max(s) * scale == max(s * scale); the scale folds into one FMA.
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_use = m_new
        p = tl.math.exp2(s * qk_scale - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def attn_finalize(acc, l_i, m_i, Sinks, heads, HAS_SINKS: tl.constexpr):
    """Divide by the softmax denominator (plus each row's head's sink term, added once, here, in the
    log2 domain against the running max). Returns (out [BLOCK_M, D] fp32, lse natural log)."""
    if HAS_SINKS:
        sink = tl.load(Sinks + heads).to(tl.float32) * 1.4426950408889634
        m_fin = tl.maximum(m_i, sink)
        alpha = tl.math.exp2(m_i - m_fin)
        l_fin = l_i * alpha + tl.math.exp2(sink - m_fin)
        acc = acc * (alpha / l_fin)[:, None]
    else:
        m_fin = m_i
        l_fin = l_i
        # l = 0 only for a query that sees nothing and has no sink: its output is zeros.
        acc = acc / tl.where(l_fin == 0.0, 1.0, l_fin)[:, None]
    lse = (m_fin + tl.math.log2(l_fin)) * 0.6931471805599453
    return acc, lse


@triton.jit
def store_rows(Out, Lse, acc, lse, out_rows, lse_rows, row_ok, offs_d, HAS_LSE: tl.constexpr):
    """Write the valid rows of one tile; out_rows/lse_rows are each row's element offset."""
    tl.store(
        Out + out_rows[:, None] + offs_d[None, :],
        acc.to(Out.dtype.element_ty),
        mask=row_ok[:, None],
    )
    if HAS_LSE:
        tl.store(Lse + lse_rows, lse, mask=row_ok)


@triton.jit
def packed_rows(t0, head_base, BLOCK_M: tl.constexpr, HEADS_PER_TILE: tl.constexpr):
    """Tile row r holds token t0 + r // HEADS_PER_TILE of query head head_base + r % H.

    Packing the query heads that share a KV head into one tile (GQA packing) loads each K/V
    block once for all of them and shrinks the token span of a tile, which is what a sliding
    window or a causal diagonal wastes work on.
    """
    offs_r = tl.arange(0, BLOCK_M)
    return t0 + offs_r // HEADS_PER_TILE, head_base + offs_r % HEADS_PER_TILE


@triton.jit
def key_block_bounds(
    first_row,
    last_row,
    seq_k,
    window_left,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """Key ranges of a query block whose rows sit at positions first_row..last_row.

    Returns (lo, full_lo, full_hi, hi): [lo, hi) holds every key some row can see (the window
    and causality bound it, so blocks outside are never visited); [full_lo, full_hi) is the
    block-aligned middle every row sees entirely, run without masks.
    """
    if IS_CAUSAL:
        hi = tl.minimum(seq_k, tl.maximum(last_row + 1, 0))
    else:
        hi = seq_k
    lo = 0
    full_lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(first_row - window_left, 0) // BLOCK_N * BLOCK_N
        # First key every row (down to the last one) still sees: last_row - window_left.
        full_lo = tl.cdiv(tl.maximum(last_row - window_left, 0), BLOCK_N) * BLOCK_N
        full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    if IS_CAUSAL:
        full_hi = tl.maximum(first_row + 1, 0) // BLOCK_N * BLOCK_N
    else:
        full_hi = hi
    full_hi = tl.maximum(tl.minimum(full_hi, seq_k // BLOCK_N * BLOCK_N), full_lo)
    return lo, full_lo, full_hi, hi


# ----------------------------------------------------------------------------- host side


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


class ConfigPin:
    """A scoped override of a kernel's heuristic config (tests and benchmarks)."""

    def __init__(self) -> None:
        self._pinned: AttentionConfig | None = None

    @property
    def pinned(self) -> AttentionConfig | None:
        return self._pinned

    @contextlib.contextmanager
    def pin(self, config: AttentionConfig) -> Iterator[AttentionConfig]:
        previous, self._pinned = self._pinned, config
        try:
            yield config
        finally:
            self._pinned = previous


@dataclass(frozen=True)
class DeviceKind:
    """What the config heuristics need to know about a device."""

    vendor: str  # "nvidia", "amd" or "interpreter"
    arch: str  # "sm_90", "gfx942", ... or "cpu"
    sm: int  # NVIDIA compute capability as 90, 80, ...; 0 elsewhere
    sm_count: int


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _device_kind(device_type: str, index: int | None) -> DeviceKind:
    if device_type != "cuda":
        return DeviceKind("interpreter", "cpu", 0, os.cpu_count() or 1)
    props = torch.cuda.get_device_properties(index)
    if torch.version.hip:
        return DeviceKind("amd", props.gcnArchName.split(":")[0], 0, props.multi_processor_count)
    sm = props.major * 10 + props.minor
    return DeviceKind("nvidia", f"sm_{sm}", sm, props.multi_processor_count)


def device_kind(device: torch.device) -> DeviceKind:
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    return _device_kind(device.type, index)
