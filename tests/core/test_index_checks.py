"""Bad values inside index tensors: a named ValueError in checked mode (before any kernel
runs) and always from the reference kernels. Valid edge values (padding slots, page-table
entries no query reads) pass."""

from __future__ import annotations

import pytest
import torch

import tokenspeed_kernel as tk
from tokenspeed_kernel import env
from tokenspeed_kernel.testing.registration import temporary_kernel

BF16, I32, I64 = torch.bfloat16, torch.int32, torch.int64
NUM_PAGES, PAGE, HQ, HKV, D = 6, 4, 4, 2, 16


@pytest.fixture
def checked(monkeypatch):
    monkeypatch.setenv(env.CHECKED_ENV, "1")
    env.reload()
    yield
    monkeypatch.delenv(env.CHECKED_ENV)
    env.reload()


def ints(values, dtype=I32):
    return torch.tensor(values, dtype=dtype)


def prefill_call(cu_seqlens=(0, 3, 7), max_seqlen=4):
    q, k, v = (torch.randn(7, h, D, dtype=BF16) for h in (HQ, HKV, HKV))
    return tk.mha_prefill, (q, k, v), dict(cu_seqlens=ints(cu_seqlens), max_seqlen=max_seqlen)


def _cache():
    return torch.randn(NUM_PAGES, PAGE, HKV, D, dtype=BF16), torch.randn(
        NUM_PAGES, PAGE, HKV, D, dtype=BF16
    )


def extend_call(cu_seqlens_q=(0, 2, 5), page_table=((0, 1), (2, 3)), cache_seqlens=(6, 8)):
    k_cache, v_cache = _cache()
    kwargs = dict(
        cu_seqlens_q=ints(cu_seqlens_q), page_table=ints(page_table),
        cache_seqlens=ints(cache_seqlens), max_seqlen_q=3,
    )  # fmt: skip
    return tk.mha_extend_with_kvcache, (torch.randn(5, HQ, D, dtype=BF16), k_cache, v_cache), kwargs


def decode_call(page_table=((0, 1), (2, 3)), cache_seqlens=(5, 8), window_left=-1):
    k_cache, v_cache = _cache()
    kwargs = dict(
        page_table=ints(page_table), cache_seqlens=ints(cache_seqlens), window_left=window_left
    )
    return tk.mha_decode_with_kvcache, (torch.randn(2, HQ, D, dtype=BF16), k_cache, v_cache), kwargs


def store_call(slots=(0, 5, -1)):
    k, v = (torch.randn(len(slots), HKV, D, dtype=BF16) for _ in range(2))
    return tk.kvcache_store, (k, v, *_cache()), dict(slot_mapping=ints(slots, I64))


BAD_CALLS = [
    (prefill_call(cu_seqlens=(1, 3, 7)), r"mha_prefill: cu_seqlens\[0\] is 1, expected 0"),
    (
        prefill_call(cu_seqlens=(0, 5, 3)),
        r"mha_prefill: cu_seqlens\[2\] is 3, expected >= cu_seqlens\[1\] \(5\)",
    ),
    (prefill_call(cu_seqlens=(0, 3, 9)), r"cu_seqlens\[2\] is 9, expected 7 \(the number of rows"),
    (prefill_call(cu_seqlens=(0, 3, 5)), r"cu_seqlens\[2\] is 5, expected 7"),
    (prefill_call(max_seqlen=3), r"mha_prefill: max_seqlen is 3, expected >= 4 \(the length of"),
    (extend_call(cu_seqlens_q=(0, 4, 2)), r"mha_extend_with_kvcache: cu_seqlens_q\[2\] is 2"),
    (extend_call(cu_seqlens_q=(0, 2, 9)), r"cu_seqlens_q\[2\] is 9, expected 5"),
    (
        extend_call(page_table=((0, 1), (2, 1000))),
        r"mha_extend_with_kvcache: page_table\[1, 1\] is 1000, expected a page id in \[0, 6\)",
    ),
    (extend_call(page_table=((-1, 1), (2, 3))), r"page_table\[0, 0\] is -1, expected a page id"),
    (
        extend_call(cache_seqlens=(6, -1)),
        r"mha_extend_with_kvcache: cache_seqlens\[1\] is -1, expected 0 <= length <= 8",
    ),
    (
        decode_call(page_table=((0, 99), (2, 3))),
        r"mha_decode_with_kvcache: page_table\[0, 1\] is 99",
    ),
    (decode_call(page_table=((0, 1), (-1, 3))), r"page_table\[1, 0\] is -1, expected a page id"),
    (decode_call(cache_seqlens=(-3, 8)), r"mha_decode_with_kvcache: cache_seqlens\[0\] is -3"),
    (decode_call(cache_seqlens=(5, 9)), r"cache_seqlens\[1\] is 9, expected 0 <= length <= 8"),
    (
        store_call(slots=(0, NUM_PAGES * PAGE, 3)),
        r"kvcache_store: slot_mapping\[1\] is 24, expected < 24 \(6 pages of 4",
    ),
]


def _raises(call, match):
    fn, args, kwargs = call
    with pytest.raises(ValueError, match=match):
        fn(*args, **kwargs)


@pytest.mark.parametrize("call, match", BAD_CALLS)
def test_the_reference_kernels_always_name_bad_index_values(call, match):
    assert not env.checked
    _raises(call, match)


@pytest.mark.parametrize("call, match", BAD_CALLS)
def test_checked_mode_names_bad_index_values_before_any_kernel_runs(checked, call, match):
    fn, args, kwargs = call
    op = fn.__name__
    ran = []
    with (
        temporary_kernel(op, f"probe.{op}", lambda *a, **k: ran.append(op), priority=10**6),
        tk.use_kernel(op, f"probe.{op}"),
    ):
        _raises(call, match)
    assert ran == []


VALID_EDGES = [
    # Entries past a sequence's last page are never read: engines leave garbage there.
    decode_call(page_table=((0, -7), (2, 3)), cache_seqlens=(3, 8)),
    # A window of 1 key: the first page of a sequence at length 8 is out of every window.
    decode_call(page_table=((0, 1), (555, 3)), cache_seqlens=(5, 8), window_left=1),
    decode_call(cache_seqlens=(0, 8)),
    store_call(slots=(-1, NUM_PAGES * PAGE - 1, -5)),
    prefill_call(cu_seqlens=(0, 0, 7), max_seqlen=7),
]


@pytest.mark.parametrize("call", VALID_EDGES)
def test_valid_edge_values_pass_in_checked_mode(checked, call):
    fn, args, kwargs = call
    fn(*args, **kwargs)


def _moe_call(top_k_ids):
    config = tk.MoEConfig(4, 2, 32, 32, weight_format="bf16", has_bias=False)
    plan = tk.moe_plan(config, device="cpu")
    weights = tk.MoEWeights(
        w13=torch.randn(4, 64, 32, dtype=BF16), w2=torch.randn(4, 32, 32, dtype=BF16)
    )
    prepared = tk.moe_prepare_weights(plan, weights)
    x = torch.randn(3, 32, dtype=BF16)
    topk_weights = torch.rand(3, 2) + 0.1
    return plan, x, prepared, topk_weights, ints(top_k_ids)


@pytest.mark.parametrize("bad", [4, -1, 2**20])
@pytest.mark.parametrize("mode", ["reference", "checked"])
def test_moe_topk_ids_out_of_range(monkeypatch, mode, bad):
    plan, x, prepared, weights, ids = _moe_call([[0, 1], [bad, 3], [2, 1]])
    if mode == "checked":
        monkeypatch.setenv(env.CHECKED_ENV, "1")
        env.reload()
    try:
        with pytest.raises(
            ValueError,
            match=rf"moe_apply: topk_ids\[1, 0\] is {bad}, expected an expert id in \[0, 4\)",
        ):
            tk.moe_apply(plan, x, prepared, topk_weights=weights, topk_ids=ids)
    finally:
        monkeypatch.delenv(env.CHECKED_ENV, raising=False)
        env.reload()


def test_checked_mode_is_read_through_env_and_off_by_default(monkeypatch):
    monkeypatch.delenv(env.CHECKED_ENV, raising=False)
    env.reload()
    assert env.CHECKED_ENV in env.NAMES and env.checked is False
    monkeypatch.setenv(env.CHECKED_ENV, "1")
    env.reload()
    assert env.checked is True
    monkeypatch.delenv(env.CHECKED_ENV)
    env.reload()
