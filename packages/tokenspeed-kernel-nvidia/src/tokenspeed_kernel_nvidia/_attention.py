"""What the library attention adapters share: the contract's index rules applied before a
library sees the tensors, the exact merge of a sink into an output computed without it, and
per-device workspaces allocated once.

The libraries read page ids, sequence lengths and offsets as they are; the contract
(ARCHITECTURE.md section 5) says an out-of-range value is clamped and never makes a kernel
read outside its tensors. Each clamp is one small elementwise kernel on [B] or [B, pages]
ints (about 2 us in eager mode, less inside a CUDA graph), paid on every call.
"""

from __future__ import annotations

import threading

import torch

_FLOAT32 = torch.float32
_NEG_INF = float("-inf")


def clamp_page_table(page_table: torch.Tensor, num_pages: int) -> torch.Tensor:
    """page ids into [0, num_pages): a bad id reads some page of the cache, never past it."""
    return page_table.clamp(0, num_pages - 1)


def clamp_seqlens(cache_seqlens: torch.Tensor, page_table: torch.Tensor, page_size: int):
    """cache_seqlens into [0, pages per sequence * P] (negative counts as 0)."""
    return cache_seqlens.clamp(0, page_table.shape[1] * page_size)


def clamp_offsets(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Ragged offsets into [0, T]."""
    return cu_seqlens.clamp(0, num_tokens)


def dense_last_dim(x: torch.Tensor) -> torch.Tensor:
    """x itself when its last dim is contiguous (what every library needs), else a copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def no_key_lse(lse: torch.Tensor) -> torch.Tensor:
    """A row that saw no key has lse -inf in the contract; kernels built without a sink write
    +inf there (FA3's non-split epilogue does), and no finite input gives +inf otherwise."""
    return lse.masked_fill(lse == float("inf"), _NEG_INF)


def sink_merge(lse_no_sink: torch.Tensor, sinks: torch.Tensor):
    """How to turn attention computed without a sink into attention with it, exactly.

    An output row computed without the sink is sum_k p_k v_k / L (L = sum_k exp(s_k)), its
    lse_no_sink [..., Hq] = log L. With the sink the denominator is L + exp(sink): the row
    scales by L / (L + exp(sink)) = sigmoid(log L - sink) and the lse becomes
    logaddexp(log L, sink). Returns (weight [..., Hq], lse [..., Hq]) in float32. The limits
    follow the contract: a row with no key gets weight 0 (its out is 0) and lse = sink; sink
    +inf gives weight 0, lse +inf; sink -inf gives weight 1 and the lse unchanged.
    """
    sink = sinks.to(_FLOAT32)
    lse = no_key_lse(lse_no_sink.to(_FLOAT32))
    # -inf - -inf is NaN: a row with no key and a -inf sink keeps weight 0 (its out is 0).
    weight = torch.where(lse == _NEG_INF, 0.0, torch.sigmoid(lse - sink))
    return weight, torch.logaddexp(lse, sink)


_workspaces: dict[tuple[str, torch.device], torch.Tensor] = {}
_workspace_lock = threading.Lock()


def workspace(name: str, device: torch.device, nbytes: int) -> torch.Tensor:
    """A zeroed uint8 buffer of `nbytes`, allocated once per (name, device) and reused by every
    call: no allocation on the hot path, and the same address inside and outside CUDA graphs
    (make the first call, which allocates it, before capturing)."""
    key = (name, device)
    buffer = _workspaces.get(key)
    if buffer is None:
        with _workspace_lock:
            buffer = _workspaces.get(key)
            if buffer is None:
                buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
                _workspaces[key] = buffer
    if buffer.numel() != nbytes:
        raise ValueError(
            f"workspace {name!r} on {device} has {buffer.numel()} bytes, asked for {nbytes}"
        )
    return buffer
