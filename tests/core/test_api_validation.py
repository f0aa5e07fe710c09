"""Every validation error of the public ops: ValueError/TypeError naming the argument."""

from __future__ import annotations

import enum

import numpy as np
import pytest
import torch

import tokenspeed_kernel as tk

BF16, FP16, FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
I32, I64 = torch.int32, torch.int64


def prefill_args(**over):
    args = dict(
        q=torch.randn(6, 8, 64, dtype=BF16),
        k=torch.randn(6, 2, 64, dtype=BF16),
        v=torch.randn(6, 2, 64, dtype=BF16),
        cu_seqlens=torch.tensor([0, 2, 6], dtype=I32),
        max_seqlen=4,
    )
    args.update(over)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    return (q, k, v), args


def paged_args(q_shape=(3, 8, 64), cache_dtype=BF16, **over):
    cache = torch.randn(5, 16, 2, 64).to(cache_dtype)
    args = dict(
        q=torch.randn(*q_shape, dtype=BF16),
        k_cache=cache,
        v_cache=cache.clone(),
        page_table=torch.tensor([[0, 1], [2, 3], [4, 0]], dtype=I32),
        cache_seqlens=torch.tensor([5, 17, 1], dtype=I32),
    )
    args.update(over)
    q, k, v = args.pop("q"), args.pop("k_cache"), args.pop("v_cache")
    return (q, k, v), args


PREFILL_ERRORS = [
    (
        dict(q=torch.randn(6, 8, 64)),
        ValueError,
        "mha_prefill: q has dtype float32, expected bfloat16 or float16",
    ),
    (
        dict(q=torch.randn(6, 64, dtype=BF16)),
        ValueError,
        r"mha_prefill: q has shape \[6, 64\], expected 3-D",
    ),
    (dict(q=[1, 2]), TypeError, "mha_prefill: q is list, expected a torch.Tensor"),
    (
        dict(k=torch.randn(6, 2, 64, dtype=FP16)),
        ValueError,
        "k has dtype float16, expected bfloat16",
    ),
    (
        dict(k=torch.randn(5, 2, 64, dtype=BF16)),
        ValueError,
        r"k has shape \[5, 2, 64\], expected \[6, \*, 64\]",
    ),
    (
        dict(v=torch.randn(6, 2, 32, dtype=BF16)),
        ValueError,
        r"v has shape \[6, 2, 32\], expected \[6, 2, 64\]",
    ),
    (
        dict(k=torch.randn(6, 3, 64, dtype=BF16), v=torch.randn(6, 3, 64, dtype=BF16)),
        ValueError,
        "q has 8 heads and the keys 3",
    ),
    (
        dict(q=torch.randn(6, 0, 64, dtype=BF16)),
        ValueError,
        r"q has 0 heads and the keys 2, .*\(at least one each\)",
    ),
    (
        dict(q=torch.randn(6, 64, 8, dtype=BF16).transpose(1, 2)),
        ValueError,
        "q has stride 8 in its last dim",
    ),
    (
        dict(cu_seqlens=torch.tensor([0, 2, 6])),
        ValueError,
        "cu_seqlens has dtype int64, expected int32",
    ),
    (dict(cu_seqlens=torch.zeros(0, dtype=I32)), ValueError, "cu_seqlens has shape \\[0\\]"),
    (dict(max_seqlen=-1), ValueError, "max_seqlen is -1, expected an int >= 0"),
    (dict(max_seqlen=4.0), TypeError, "max_seqlen is float, expected int"),
    (dict(causal=1), TypeError, "causal is int, expected bool"),
    (dict(window_left=-2), ValueError, r"window_left is -2, expected -1 \(no window\) or >= 0"),
    (dict(window_left=True), TypeError, "window_left is bool, expected int"),
    (dict(window_left=3, causal=False), ValueError, "window_left is 3 with causal=False"),
    (dict(sinks=torch.randn(4)), ValueError, r"sinks has shape \[4\], expected \[8\]"),
    (
        dict(sinks=torch.randn(8, dtype=FP16)),
        ValueError,
        "sinks has dtype float16, expected bfloat16 or float32",
    ),
    (dict(softmax_scale=0.0), ValueError, "softmax_scale is 0.0, expected a finite float > 0"),
    (dict(softmax_scale=float("nan")), ValueError, "softmax_scale is nan"),
    (dict(softmax_scale="0.1"), TypeError, "softmax_scale is str, expected a float"),
    (dict(return_lse=1), TypeError, "return_lse is int, expected bool"),
    (
        dict(out=torch.empty(6, 8, 64, dtype=FP16)),
        ValueError,
        "out has dtype float16, expected bfloat16",
    ),
    (
        dict(out=torch.empty(6, 8, 32, dtype=BF16)),
        ValueError,
        r"out has shape \[6, 8, 32\], expected \[6, 8, 64\]",
    ),
]


@pytest.mark.parametrize("over, exc, match", PREFILL_ERRORS)
def test_prefill_errors(over, exc, match):
    args, kwargs = prefill_args(**over)
    with pytest.raises(exc, match=match):
        tk.mha_prefill(*args, **kwargs)


PAGED_ERRORS = [
    (
        dict(k_cache=torch.randn(5, 16, 2, 64)),
        ValueError,
        "k_cache has dtype float32, expected bfloat16 or float8_e4m3fn",
    ),
    (
        dict(k_cache=torch.randn(5, 16, 2, 32, dtype=BF16)),
        ValueError,
        r"k_cache has shape \[5, 16, 2, 32\], expected \[\*, \*, \*, 64\]",
    ),
    (
        dict(k_cache=torch.randn(5, 16, 128, dtype=BF16)),
        ValueError,
        "k_cache has shape .* expected 4-D",
    ),
    (
        dict(v_cache=torch.randn(5, 8, 2, 64, dtype=BF16)),
        ValueError,
        r"v_cache has shape \[5, 8, 2, 64\], expected \[5, 16, 2, 64\]",
    ),
    (
        dict(page_table=torch.zeros(3, 2, dtype=I64)),
        ValueError,
        "page_table has dtype int64, expected int32",
    ),
    (
        dict(page_table=torch.zeros(2, 2, dtype=I32)),
        ValueError,
        r"page_table has shape \[2, 2\], expected \[3, \*\]",
    ),
    (
        dict(cache_seqlens=torch.ones(3, dtype=I64)),
        ValueError,
        "cache_seqlens has dtype int64, expected int32",
    ),
    (
        dict(cache_seqlens=torch.ones(4, dtype=I32)),
        ValueError,
        r"cache_seqlens has shape \[4\], expected \[3\]",
    ),
    (dict(k_scale=0.5), ValueError, "k_scale is 0.5, expected None for a bfloat16 cache"),
    (dict(window_left=-3), ValueError, "window_left is -3"),
    (
        dict(out=torch.empty(3, 8, 64, dtype=FP16)),
        ValueError,
        "out has dtype float16, expected bfloat16",
    ),
]


@pytest.mark.parametrize("over, exc, match", PAGED_ERRORS)
def test_decode_errors(over, exc, match):
    args, kwargs = paged_args(**over)
    with pytest.raises(exc, match="mha_decode_with_kvcache: " + match):
        tk.mha_decode_with_kvcache(*args, **kwargs)


def test_decode_q_shape_errors():
    args, kwargs = paged_args(q_shape=(3, 0, 8, 64))
    with pytest.raises(ValueError, match="expected Q >= 1 tokens per sequence"):
        tk.mha_decode_with_kvcache(*args, **kwargs)
    args, kwargs = paged_args(q_shape=(3, 64))
    with pytest.raises(ValueError, match="q has shape \\[3, 64\\], expected 3-D or 4-D"):
        tk.mha_decode_with_kvcache(*args, **kwargs)


def test_fp8_cache_scale_errors():
    for bad, exc, match in [
        (0.0, ValueError, "k_scale is 0.0, expected a finite float > 0"),
        (float("inf"), ValueError, "k_scale is inf"),
        ("1", TypeError, "k_scale is str, expected a float"),
    ]:
        args, kwargs = paged_args(cache_dtype=FP8, k_scale=bad)
        with pytest.raises(exc, match=match):
            tk.mha_decode_with_kvcache(*args, **kwargs)


@pytest.mark.parametrize("over, exc, match", PAGED_ERRORS[:8])
def test_extend_errors(over, exc, match):
    args, kwargs = paged_args(**over)
    kwargs.update(cu_seqlens_q=torch.tensor([0, 1, 2, 3], dtype=I32), max_seqlen_q=1)
    with pytest.raises(exc, match="mha_extend_with_kvcache: " + match):
        tk.mha_extend_with_kvcache(*args, **kwargs)


def test_extend_own_errors():
    args, kwargs = paged_args()
    kwargs.update(cu_seqlens_q=torch.tensor([0, 1, 2, 3], dtype=I64), max_seqlen_q=1)
    with pytest.raises(ValueError, match="cu_seqlens_q has dtype int64, expected int32"):
        tk.mha_extend_with_kvcache(*args, **kwargs)
    kwargs.update(cu_seqlens_q=torch.tensor([0, 1, 2], dtype=I32))
    with pytest.raises(ValueError, match=r"page_table has shape \[3, 2\], expected \[2, \*\]"):
        tk.mha_extend_with_kvcache(*args, **kwargs)
    kwargs.update(cu_seqlens_q=torch.tensor([0, 1, 2, 3], dtype=I32), max_seqlen_q=None)
    with pytest.raises(TypeError, match="max_seqlen_q is NoneType, expected int"):
        tk.mha_extend_with_kvcache(*args, **kwargs)


class Window(enum.IntEnum):
    GPT_OSS = 127


# Valid calls, the unusual spellings included: each must pass the checker (one definition of
# validity, which also serves the decode path) and reach the kernel.
VALID_PAGED = [
    dict(),
    dict(window_left=3, sinks=torch.randn(8, dtype=BF16), softmax_scale=0.2, return_lse=True),
    dict(softmax_scale=np.float64(0.1)),
    dict(softmax_scale=np.float32(0.1)),
    dict(softmax_scale=1),
    dict(window_left=Window.GPT_OSS),
    dict(window_left=np.int64(5)),
    dict(out=torch.empty(3, 8, 64, dtype=BF16)),
    dict(cache_dtype=FP8, k_scale=np.float64(0.5), v_scale=np.float32(2.0)),
    dict(cache_dtype=FP8, k_scale=2, out=torch.empty(3, 8, 64, dtype=FP16)),
    dict(q_shape=(3, 2, 8, 64)),
]


@pytest.mark.parametrize("over", VALID_PAGED)
def test_valid_paged_calls_pass(over):
    args, kwargs = paged_args(**over)
    out = tk.mha_decode_with_kvcache(*args, **kwargs)
    assert (out[0] if isinstance(out, tuple) else out).shape == args[0].shape
    if len(args[0].shape) == 3:
        kwargs.update(cu_seqlens_q=torch.tensor([0, 1, 2, 3], dtype=I32), max_seqlen_q=1)
        tk.mha_extend_with_kvcache(*args, **kwargs)


def test_options_reach_the_kernel_as_plain_python_numbers():
    seen = {}

    def spy(q, k_cache, v_cache, **kwargs):
        seen.update(kwargs)

    tk.register_kernel(
        "mha_decode_with_kvcache",
        name="spy.decode_options",
        backend="spy",
        platforms=["cpu"],
        priority=1000,
        traits={t: tk.ANY for t in ("dtype", "kv_dtype", "head_dim", "gqa_ratio", "page_size")}
        | {"q_len": tk.ANY, "window": True},
    )(spy)
    try:
        args, kwargs = paged_args(
            cache_dtype=FP8, window_left=np.int64(5), softmax_scale=np.float32(0.5), k_scale=2
        )
        tk.mha_decode_with_kvcache(*args, **kwargs)
    finally:
        tk.registry.unregister_kernel("spy.decode_options")
    for name, value in (("window_left", 5), ("softmax_scale", 0.5), ("k_scale", 2.0)):
        assert type(seen[name]) is type(value) and seen[name] == value, name


def test_a_tensor_on_another_device_type_is_refused():
    # The meta device has no index, like the CPU: comparing device indices alone would pass it.
    args, kwargs = paged_args(page_table=torch.empty(3, 2, dtype=I32, device="meta"))
    with pytest.raises(ValueError, match="page_table is on meta, expected cpu"):
        tk.mha_decode_with_kvcache(*args, **kwargs)
    args, kwargs = store_args(v=torch.empty(3, 2, 64, dtype=BF16, device="meta"))
    with pytest.raises(ValueError, match="v is on meta, expected cpu"):
        tk.kvcache_store(*args, **kwargs)


@pytest.mark.parametrize(
    "over, exc, match",
    [
        (dict(softmax_scale=np.bool_(True)), TypeError, "softmax_scale is bool, expected a float"),
        (dict(window_left=1.0), TypeError, "window_left is float, expected int"),
        (dict(window_left=np.int64(-2)), ValueError, "window_left is -2"),
        (dict(q=[[1.0]]), TypeError, "q is list, expected a torch.Tensor"),
        (dict(k_cache=None), TypeError, "k_cache is NoneType, expected a torch.Tensor"),
        (dict(sinks=[0.0] * 8), TypeError, "sinks is list, expected a torch.Tensor"),
        (dict(out=object()), TypeError, "out is object, expected a torch.Tensor"),
    ],
)
def test_odd_arguments_get_named_errors_never_assertion_errors(over, exc, match):
    args, kwargs = paged_args(**over)
    with pytest.raises(exc, match="mha_decode_with_kvcache: " + match):
        tk.mha_decode_with_kvcache(*args, **kwargs)


def store_args(**over):
    cache = torch.zeros(4, 16, 2, 64, dtype=BF16)
    args = dict(
        k=torch.randn(3, 2, 64, dtype=BF16),
        v=torch.randn(3, 2, 64, dtype=BF16),
        k_cache=cache,
        v_cache=cache.clone(),
        slot_mapping=torch.tensor([0, 17, -1], dtype=I64),
    )
    args.update(over)
    return [args.pop(n) for n in ("k", "v", "k_cache", "v_cache")], args


STORE_ERRORS = [
    (
        dict(slot_mapping=torch.tensor([0, 1, 2], dtype=I32)),
        ValueError,
        "slot_mapping has dtype int32, expected int64",
    ),
    (
        dict(slot_mapping=torch.tensor([0, 1], dtype=I64)),
        ValueError,
        r"slot_mapping has shape \[2\], expected \[3\]",
    ),
    (
        dict(v=torch.randn(3, 2, 64, dtype=FP16)),
        ValueError,
        "v has dtype float16, expected bfloat16",
    ),
    (
        dict(k_cache=torch.zeros(4, 16, 2, 64, dtype=FP16)),
        ValueError,
        "k_cache has dtype float16, expected bfloat16 or float8_e4m3fn",
    ),
    (
        dict(k_cache=torch.zeros(4, 16, 1, 64, dtype=BF16)),
        ValueError,
        r"k_cache has shape \[4, 16, 1, 64\], expected \[\*, \*, 2, 64\]",
    ),
    (
        dict(v_cache=torch.zeros(4, 16, 2, 64, dtype=FP8)),
        ValueError,
        "v_cache has dtype float8_e4m3fn, expected bfloat16",
    ),
    (dict(k_scale=2.0), ValueError, "k_scale is 2.0, expected None for a bfloat16 cache"),
]


@pytest.mark.parametrize("over, exc, match", STORE_ERRORS)
def test_kvcache_store_errors(over, exc, match):
    args, kwargs = store_args(**over)
    with pytest.raises(exc, match="kvcache_store: " + match):
        tk.kvcache_store(*args, **kwargs)


def test_valid_store_calls_pass():
    tk.kvcache_store(*store_args()[0], **store_args()[1])
    fp8 = torch.zeros(4, 16, 2, 64, dtype=FP8)
    args, kwargs = store_args(k_cache=fp8, v_cache=fp8.clone(), k_scale=np.float64(0.5), v_scale=1)
    tk.kvcache_store(*args, **kwargs)
