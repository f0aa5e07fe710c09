"""The query-tile flash attention prefill and extend share: the online-softmax block update,
the key loop over contiguous or paged keys (masked edges around an unmasked middle) and the
final normalization (sinks, lse). Their tile config and launch plan are in `_tile_config.py`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import LN2, LOG2E, merge_sink


@triton.jit
def visible_keys(
    rows, cols, key_ok, window_left, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr
):
    """[rows, cols] mask of the keys each row sees: existing, causally at or before the row,
    inside its window."""
    visible = key_ok[None, :]
    if IS_CAUSAL:
        visible = visible & (cols[None, :] <= rows[:, None])
    if HAS_WINDOW:
        visible = visible & (cols[None, :] >= rows[:, None] - window_left)
    return visible


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
    key_ok,
    window_left,
    MASK: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """One key block of online softmax.

    q [BLOCK_M, D], k [D, BLOCK_N] (already transposed), v [BLOCK_N, D]; rows/cols are the
    absolute positions of the queries and keys; key_ok says which keys exist (in the
    sequence). MASK=False is the fast path for blocks every query sees entirely (no
    compare/select, no -inf guard).
    """
    s = tl.dot(q, k)
    if MASK:
        visible = visible_keys(rows, cols, key_ok, window_left, IS_CAUSAL, HAS_WINDOW)
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
def _load_key_block(k_ptrs, v_ptrs, key_ok, MASK: tl.constexpr):
    """K^T [D, BLOCK_N] and V [BLOCK_N, D]; under MASK, keys past the sequence end (the next
    sequence's, or past the tensor) are not read and hold 0."""
    if MASK:
        k = tl.load(k_ptrs, mask=key_ok[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=key_ok[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    return k, v


@triton.jit
def _contiguous_key_block(keys, n0, cols, seq_k, MASK: tl.constexpr):
    """(K^T [D, BLOCK_N], V [BLOCK_N, D], key_ok) of keys n0.. of one sequence stored
    token-major."""
    k_base, v_base, stride_kt, stride_vt, offs_n, offs_d = keys
    # 64-bit block base, 32-bit offsets inside the block: no overflow at any length.
    n0_64 = tl.cast(n0, tl.int64)
    k_ptrs = k_base + n0_64 * stride_kt + offs_n[None, :] * stride_kt + offs_d[:, None]
    v_ptrs = v_base + n0_64 * stride_vt + offs_n[:, None] * stride_vt + offs_d[None, :]
    key_ok = cols < seq_k
    k, v = _load_key_block(k_ptrs, v_ptrs, key_ok, MASK)
    return k, v, key_ok


@triton.jit
def _paged_key_block(
    keys, n0, cols, seq_k, MASK: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr
):
    """(K^T, V, key_ok) of keys n0.. gathered from a paged cache, token p at page p // P, slot
    p % P. A page id outside [0, num_pages) is clamped into it, so no load leaves the cache
    (the keys read are another page's: the contract's unspecified outcome for a bad id). Cost:
    an integer min and max per page id read, no load predicate on the unmasked path."""
    (
        K,
        V,
        page_row,
        num_pages,
        kv_head_k,
        kv_head_v,
        stride_kp,
        stride_kt,
        stride_vp,
        stride_vt,
        offs_n,
        offs_d,
    ) = keys
    in_seq = cols < seq_k
    if PAGE_SIZE % BLOCK_N == 0:
        # Loop bounds are BLOCK_N-aligned, so the block lies in one page: one page-table
        # read, and contiguous rows the compiler can see as such.
        page = tl.load(page_row + n0 // PAGE_SIZE).to(tl.int64)
        slot_in_page = n0 % PAGE_SIZE + offs_n
    else:
        if MASK:
            page = tl.load(page_row + cols // PAGE_SIZE, mask=in_seq, other=0)
        else:
            page = tl.load(page_row + cols // PAGE_SIZE)
        page = page.to(tl.int64)
        slot_in_page = cols % PAGE_SIZE
    page = tl.minimum(tl.maximum(page, 0), num_pages - 1)
    k_rows = page * stride_kp + slot_in_page * stride_kt
    v_rows = page * stride_vp + slot_in_page * stride_vt
    k_ptrs = K + kv_head_k + k_rows[None, :] + offs_d[:, None]
    v_ptrs = V + kv_head_v + v_rows[:, None] + offs_d[None, :]
    k, v = _load_key_block(k_ptrs, v_ptrs, in_seq, MASK)
    return k, v, in_seq


@triton.jit
def _attend_key_range(
    state,
    q,
    tile,
    keys,
    lo,
    hi,
    MASK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    """Online softmax over the key blocks [lo, hi). PAGE_SIZE 0: keys stored token-major
    (`keys` as `_contiguous_key_block` takes them); else a paged cache (`_paged_key_block`).
    An FP8 cache's blocks are converted to q's dtype in registers."""
    acc, l_i, m_i = state
    rows, seq_k, window_left, qk_scale, offs_n = tile
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + offs_n
        if PAGE_SIZE == 0:
            k, v, key_ok = _contiguous_key_block(keys, n0, cols, seq_k, MASK)
        else:
            k, v, key_ok = _paged_key_block(keys, n0, cols, seq_k, MASK, PAGE_SIZE, BLOCK_N)
        acc, l_i, m_i = attn_block_update(
            acc, l_i, m_i, q, k.to(q.dtype), v.to(q.dtype), qk_scale, rows, cols, key_ok,
            window_left, MASK, IS_CAUSAL, HAS_WINDOW,
        )  # fmt: skip
    return acc, l_i, m_i


@triton.jit
def attend_key_ranges(
    q,
    tile,
    keys,
    bounds,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SPLIT_MASK: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    """(acc, l, m) of a query tile over its visible keys (`bounds` from `key_block_bounds`):
    one masked loop, or masked edges around an unmasked middle (SPLIT_MASK). `tile` is (rows,
    seq_k, window_left, qk_scale, offs_n), `keys` as the PAGE_SIZE's block loader takes them."""
    lo, full_lo, full_hi, hi = bounds
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    state = (acc, l_i, m_i)
    if not SPLIT_MASK:
        state = _attend_key_range(
            state, q, tile, keys, lo, hi, True, BLOCK_N, IS_CAUSAL, HAS_WINDOW, PAGE_SIZE
        )
    else:
        if HAS_WINDOW:
            state = _attend_key_range(
                state, q, tile, keys, lo, full_lo, True, BLOCK_N, IS_CAUSAL, HAS_WINDOW, PAGE_SIZE
            )
        state = _attend_key_range(
            state, q, tile, keys, full_lo, full_hi, False, BLOCK_N, IS_CAUSAL, HAS_WINDOW, PAGE_SIZE
        )
        state = _attend_key_range(
            state, q, tile, keys, full_hi, hi, True, BLOCK_N, IS_CAUSAL, HAS_WINDOW, PAGE_SIZE
        )
    return state


@triton.jit
def attend_exact(
    q,
    tile,
    keys,
    bounds,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    """(acc, l, m) of a query tile over the same key blocks as `attend_key_ranges`, every block
    masked, with the reference's outcome for non-finite V: a key masked for a row contributes
    nothing to it whatever its V, and a row that sees a key whose V row holds a NaN or inf gets
    NaN. p @ v cannot give that by itself (0 * NaN is NaN, and V is shared by the rows that see
    and mask a key), so such V rows are zeroed for the dot and the rows that see them set to
    NaN here. The fix-up launch's path (`_fixup.py`): V goes through registers."""
    lo, _, _, hi = bounds
    rows, seq_k, window_left, qk_scale, offs_n = tile
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    poisoned = tl.zeros([BLOCK_M], dtype=tl.int32)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + offs_n
        if PAGE_SIZE == 0:
            k, v, key_ok = _contiguous_key_block(keys, n0, cols, seq_k, True)
        else:
            k, v, key_ok = _paged_key_block(keys, n0, cols, seq_k, True, PAGE_SIZE, BLOCK_N)
        v = v.to(q.dtype)
        bad_key = tl.max(tl.where(tl.abs(v.to(tl.float32)) < float("inf"), 0, 1), 1)
        visible = visible_keys(rows, cols, key_ok, window_left, IS_CAUSAL, HAS_WINDOW)
        poisoned = tl.maximum(poisoned, tl.max(tl.where(visible, bad_key[None, :], 0), 1))
        acc, l_i, m_i = attn_block_update(
            acc, l_i, m_i, q, k.to(q.dtype), tl.where(bad_key[:, None] > 0, 0.0, v), qk_scale,
            rows, cols, key_ok, window_left, True, IS_CAUSAL, HAS_WINDOW,
        )  # fmt: skip
    acc = tl.where(poisoned[:, None] > 0, float("nan"), acc)
    return acc, l_i, m_i


@triton.jit
def attn_finalize(acc, l_i, m_i, Sinks, heads, HAS_SINKS: tl.constexpr):
    """Divide by the softmax denominator (plus each row's head's sink term, added once, here, in
    the log2 domain against the running max). Returns (out [BLOCK_M, D] fp32, lse natural log).
    """
    # l = 0 only for a query that sees nothing and has no sink (or a -inf one): zeros.
    if HAS_SINKS:
        sink = tl.load(Sinks + heads).to(tl.float32) * LOG2E
        m_fin, alpha, l_fin = merge_sink(m_i, l_i, sink)
        acc = acc * (alpha / tl.where(l_fin == 0.0, 1.0, l_fin))[:, None]
    else:
        m_fin = m_i
        l_fin = l_i
        acc = acc / tl.where(l_fin == 0.0, 1.0, l_fin)[:, None]
    lse = (m_fin + tl.math.log2(l_fin)) * LN2
    return acc, lse


@triton.jit
def sequence_span(CuSeqlens, seq, num_tokens):
    """(first token, length) of sequence `seq`, with its offsets clamped to [0, num_tokens]: a
    bad cu_seqlens never moves a read or write outside the T rows, and an end before the start
    gives a length <= 0, an empty sequence (the caller's t0 >= length exit). Cost: four
    integer min/max per program."""
    start = tl.minimum(tl.maximum(tl.load(CuSeqlens + seq), 0), num_tokens)
    end = tl.minimum(tl.maximum(tl.load(CuSeqlens + seq + 1), 0), num_tokens)
    return start, end - start


@triton.jit
def tile_program(
    pid_m, pid_h, seq, num_m_blocks, HEADS_PER_TILE: tl.constexpr, HEAVY_FIRST: tl.constexpr
):
    """(query block, first query head, sequence) of the program at grid ids (pid_m, pid_h,
    seq). HEAVY_FIRST: later blocks see more keys (causal, no window), so they launch first and
    the last wave is made of short ones (load balance across SMs)."""
    head_base = pid_h * HEADS_PER_TILE
    if HEAVY_FIRST:
        pid_m = num_m_blocks - 1 - pid_m
    return pid_m, head_base, seq


@triton.jit
def query_tile(
    Q,
    first_token,
    t0,
    head_base,
    n_rows,
    stride_qt,
    stride_qh,
    BLOCK_M: tl.constexpr,
    HEADS_PER_TILE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """The tile of query rows t0.. (of n_rows) of the sequence starting at token first_token:
    (q, tok0 (int64 first_token), tile0 (int64 first token of the tile; in-tile offsets stay
    32-bit), local token, row, head and validity of each tile row, offs_n, offs_d)."""
    tok0 = first_token.to(tl.int64)
    rows, heads = packed_rows(t0, head_base, BLOCK_M, HEADS_PER_TILE)
    row_ok = rows < n_rows
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    tile0 = tok0 + t0
    local = rows - t0
    q = tl.load(
        Q + tile0 * stride_qt + (local * stride_qt + heads * stride_qh)[:, None] + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    return q, tok0, tile0, local, rows, heads, row_ok, offs_n, offs_d


@triton.jit
def store_rows(
    Out, Lse, acc, lse, tile0, local, heads, row_ok, offs_d, strides, HAS_LSE: tl.constexpr
):
    """Write the valid rows of one tile (Out [T, H, D], Lse [T, H]); tile0 as in `query_tile`."""
    stride_ot, stride_oh, stride_lt = strides
    Out = Out + tile0 * stride_ot
    Lse = Lse + tile0 * stride_lt
    out_rows = local * stride_ot + heads * stride_oh
    lse_rows = local * stride_lt + heads
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
