"""MoE scratch buffers (moe/workspace.py): one storage per slot and dtype, reused by smaller
calls and grown by larger ones, so a warm moe_apply allocates nothing (checked on the GPU by
tests/triton/test_engine_ready_gpu.py)."""

from __future__ import annotations

import torch

from tokenspeed_kernel_triton.moe import workspace
from tokenspeed_kernel_triton.moe.workspace import scratch


def test_a_slot_reuses_its_storage_and_grows():
    first = scratch("test-slot", (4, 8), torch.float32, "cpu")
    assert first.shape == (4, 8) and first.dtype == torch.float32
    smaller = scratch("test-slot", (3, 5), torch.float32, "cpu")
    assert smaller.data_ptr() == first.data_ptr() and smaller.is_contiguous()
    larger = scratch("test-slot", (16, 8), torch.float32, "cpu")
    assert larger.shape == (16, 8)
    assert scratch("test-slot", (2,), torch.float32, "cpu").data_ptr() == larger.data_ptr()


def test_slots_and_dtypes_do_not_share():
    a = scratch("test-a", (8,), torch.int32, "cpu")
    b = scratch("test-b", (8,), torch.int32, "cpu")
    c = scratch("test-a", (8,), torch.float32, "cpu")
    assert len({a.data_ptr(), b.data_ptr(), c.data_ptr()}) == 3
    assert scratch("test-empty", (0, 4), torch.int32, "cpu").shape == (0, 4)


def test_generation_counts_allocations_only():
    """Replay recipes (moe/replay.py) hold scratch views: `generation` tells them a buffer
    they hold was replaced."""
    start = workspace.generation
    scratch("test-generation", (8,), torch.int32, "cpu")
    assert workspace.generation == start + 1
    scratch("test-generation", (4,), torch.int32, "cpu")  # fits: the same buffer
    assert workspace.generation == start + 1
    scratch("test-generation", (9,), torch.int32, "cpu")
    assert workspace.generation == start + 2


def test_poison_fills_floating_buffers_with_nan_and_leaves_integer_ones():
    rows = scratch("test-poison-rows", (4,), torch.float16, "cpu").fill_(1.0)
    table = scratch("test-poison-table", (4,), torch.int32, "cpu").fill_(7)
    workspace.poison_scratch()
    assert rows.isnan().all()
    assert table.tolist() == [7, 7, 7, 7]
