"""The values inside index tensors (offsets, sequence lengths, page ids, slots, expert ids).

Reading them means copying them to the host, which synchronizes the stream, so the ops run
these checks only in checked mode (`TOKENSPEED_KERNEL_CHECKED=1`); the reference kernels, the
numerics oracle, always run them. Outside checked mode the kernels skip or clamp the values
these checks reject (ARCHITECTURE.md section 5 states each outcome). Every error reads
"<op>: <arg>[<i>] is <value>, expected ...". Each function takes the arguments the op hands
its kernel and returns what it read, so a reference kernel reads each tensor once.
"""

from __future__ import annotations

import torch

# The ops' registry names, spelled out: importing the request modules here would tie this
# module into both op packages' import order.
MHA_PREFILL, MHA_EXTEND, MHA_DECODE = (
    "mha_prefill",
    "mha_extend_with_kvcache",
    "mha_decode_with_kvcache",
)
KVCACHE_STORE, MOE_APPLY = "kvcache_store", "moe_apply"


def _first_true(bad: torch.Tensor) -> tuple[int, ...] | None:
    """The index of the first True element of `bad`, or None."""
    hits = bad.nonzero()
    return tuple(hits[0].tolist()) if hits.shape[0] else None


def _offsets(op: str, name: str, offsets: torch.Tensor, total: int) -> list[int]:
    """Sequence offsets: from 0, never decreasing, to `total` rows."""
    bounds = offsets.tolist()
    if bounds[0] != 0:
        raise ValueError(f"{op}: {name}[0] is {bounds[0]}, expected 0")
    for i in range(1, len(bounds)):
        if bounds[i] < bounds[i - 1]:
            raise ValueError(
                f"{op}: {name}[{i}] is {bounds[i]}, expected >= {name}[{i - 1}] "
                f"({bounds[i - 1]}): offsets never decrease"
            )
    if bounds[-1] != total:
        raise ValueError(
            f"{op}: {name}[{len(bounds) - 1}] is {bounds[-1]}, expected {total} "
            "(the number of rows of q)"
        )
    return bounds


def _longest(op: str, name: str, bounds: list[int], max_name: str, max_len: int) -> None:
    for b in range(len(bounds) - 1):
        if bounds[b + 1] - bounds[b] > max_len:
            raise ValueError(
                f"{op}: {max_name} is {max_len}, expected >= {bounds[b + 1] - bounds[b]} "
                f"(the length of sequence {b} in {name})"
            )


def _paged(op, k_cache, page_table, cache_seqlens, q_lens, window_left) -> list[int]:
    """cache_seqlens within what page_table covers, and every page id a query can see (from
    the first query's window start to the sequence end) in [0, num_pages). `q_lens[b]` is
    the number of query rows of sequence b (its last positions)."""
    num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
    capacity = page_table.shape[1] * page_size
    seqlens = cache_seqlens.tolist()
    for b, seqlen in enumerate(seqlens):
        if not 0 <= seqlen <= capacity:
            raise ValueError(
                f"{op}: cache_seqlens[{b}] is {seqlen}, expected 0 <= length <= {capacity} "
                f"(page_table holds {page_table.shape[1]} pages of {page_size} per sequence)"
            )
    lengths = torch.tensor(seqlens, dtype=torch.int64)
    start = lengths - torch.tensor(q_lens, dtype=torch.int64)
    start = (start - window_left).clamp(min=0) if window_left >= 0 else torch.zeros_like(start)
    columns = torch.arange(page_table.shape[1])
    first_page, end_page = start // page_size, (lengths + page_size - 1) // page_size
    read = (columns >= first_page[:, None]) & (columns < end_page[:, None])
    pages = page_table.cpu()
    bad = _first_true(read & ((pages < 0) | (pages >= num_pages)))
    if bad is not None:
        b, j = bad
        raise ValueError(
            f"{op}: page_table[{b}, {j}] is {int(pages[b, j])}, expected a page id in "
            f"[0, {num_pages}) (sequence {b} reads positions {j * page_size}.. from it)"
        )
    return seqlens


def check_prefill(cu_seqlens: torch.Tensor, total: int, max_seqlen: int) -> list[int]:
    """Returns cu_seqlens as a list."""
    bounds = _offsets(MHA_PREFILL, "cu_seqlens", cu_seqlens, total)
    _longest(MHA_PREFILL, "cu_seqlens", bounds, "max_seqlen", max_seqlen)
    return bounds


def check_extend(
    q, k_cache, cu_seqlens_q, page_table, cache_seqlens, max_seqlen_q, window_left
) -> tuple[list[int], list[int]]:
    """Returns (cu_seqlens_q, cache_seqlens) as lists."""
    bounds = _offsets(MHA_EXTEND, "cu_seqlens_q", cu_seqlens_q, q.shape[0])
    _longest(MHA_EXTEND, "cu_seqlens_q", bounds, "max_seqlen_q", max_seqlen_q)
    q_lens = [end - begin for begin, end in zip(bounds[:-1], bounds[1:], strict=True)]
    seqlens = _paged(MHA_EXTEND, k_cache, page_table, cache_seqlens, q_lens, window_left)
    return bounds, seqlens


def check_decode(q, k_cache, page_table, cache_seqlens, window_left) -> list[int]:
    """`q` is [B, Q, Hq, D]. Returns cache_seqlens as a list."""
    q_lens = [q.shape[1]] * q.shape[0]
    return _paged(MHA_DECODE, k_cache, page_table, cache_seqlens, q_lens, window_left)


def check_store(k_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Slots below num_pages * page_size (a negative slot skips its token: padding)."""
    capacity = k_cache.shape[0] * k_cache.shape[1]
    bad = _first_true(slot_mapping >= capacity)
    if bad is not None:
        (i,) = bad
        raise ValueError(
            f"{KVCACHE_STORE}: slot_mapping[{i}] is {int(slot_mapping[i])}, expected < "
            f"{capacity} ({k_cache.shape[0]} pages of {k_cache.shape[1]}; negative skips)"
        )


def check_moe_apply(topk_ids: torch.Tensor, num_experts: int) -> None:
    bad = _first_true((topk_ids < 0) | (topk_ids >= num_experts))
    if bad is not None:
        m, j = bad
        raise ValueError(
            f"{MOE_APPLY}: topk_ids[{m}, {j}] is {int(topk_ids[m, j])}, expected an expert "
            f"id in [0, {num_experts})"
        )
