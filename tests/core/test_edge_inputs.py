"""Odd inputs that used to slip through or fail deep inside torch: strided sinks, meta
tensors, ints past 32 bits, numpy scalars, bad MoE configs and devices. Each gets a named
error (or, for numpy scalars, simply works)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import tokenspeed_kernel as tk

BF16, FP8, I32, I64 = torch.bfloat16, torch.float8_e4m3fn, torch.int32, torch.int64


def prefill(seed=0, **over):
    # The same seed gives the same inputs, for calls whose outputs are compared.
    torch.manual_seed(seed)
    q, k, v = (torch.randn(9, h, 16, dtype=BF16) for h in (4, 2, 2))
    kwargs = dict(cu_seqlens=torch.tensor([0, 4, 9], dtype=I32), max_seqlen=5) | over
    return tk.mha_prefill(q, k, v, **kwargs)


def decode(q_dtype=BF16, cache_dtype=BF16, device="cpu", seed=0, **over):
    torch.manual_seed(seed)
    cache = torch.randn(4, 8, 2, 16).to(cache_dtype)
    args = dict(
        q=torch.randn(2, 4, 16, dtype=q_dtype),
        k_cache=cache,
        v_cache=torch.randn(4, 8, 2, 16).to(cache_dtype),
        page_table=torch.tensor([[0, 1], [2, 3]], dtype=I32),
        cache_seqlens=torch.tensor([9, 13], dtype=I32),
    )
    args = {name: t.to(device) for name, t in args.items()} | over
    q, k, v = args.pop("q"), args.pop("k_cache"), args.pop("v_cache")
    return tk.mha_decode_with_kvcache(q, k, v, **args)


def test_strided_sinks_are_refused():
    base = torch.randn(8, dtype=torch.float32)
    with pytest.raises(ValueError, match="mha_prefill: sinks has stride 2 in its last dim"):
        prefill(sinks=base[::2])
    with pytest.raises(ValueError, match="mha_decode_with_kvcache: sinks has stride 2"):
        decode(sinks=base[::2])
    prefill(sinks=base[::2].contiguous())


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda: decode(device="meta"),
            "mha_decode_with_kvcache: q is on meta: meta tensors hold no data",
        ),
        (
            lambda: decode(page_table=torch.tensor([[0, 1], [2, 3]], dtype=I32, device="meta")),
            "page_table is on meta, expected cpu",
        ),
        (
            lambda: decode(out=torch.empty(2, 4, 16, dtype=BF16, device="meta")),
            "out is on meta, expected cpu",
        ),
        (
            lambda: tk.kvcache_store(
                *(torch.randn(2, 2, 16, dtype=BF16, device="meta") for _ in range(2)),
                *(torch.randn(3, 4, 2, 16, dtype=BF16, device="meta") for _ in range(2)),
                slot_mapping=torch.tensor([1, 5], dtype=I64, device="meta"),
            ),
            "kvcache_store: k is on meta: meta tensors hold no data",
        ),
    ],
)
def test_meta_tensors_get_a_named_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize(
    "over, match",
    [
        (dict(window_left=2**64), f"window_left is {2**64}, expected <= 2147483647"),
        (dict(window_left=2**31), f"window_left is {2**31}, expected <= 2147483647"),
        (dict(max_seqlen=2**40), f"max_seqlen is {2**40}, expected an int <= 2147483647"),
        (dict(window_left=np.int64(-7)), r"window_left is -7, expected -1 \(no window\)"),
    ],
)
def test_ints_outside_int32_are_value_errors(over, match):
    with pytest.raises(ValueError, match="mha_prefill: " + match):
        prefill(**over)


def test_window_left_int32_max_still_works():
    seed = int(torch.randint(1 << 30, ()))
    torch.testing.assert_close(prefill(seed, window_left=2**31 - 1), prefill(seed))


class Width(int):
    pass


def test_numpy_and_int_subclass_scalars_work():
    seed = int(torch.randint(1 << 30, ()))
    expected = decode(seed=seed, softmax_scale=0.1, window_left=3)
    for scale, window in ((np.float64(0.1), np.int64(3)), (np.float32(0.1), Width(3))):
        out = decode(seed=seed, softmax_scale=scale, window_left=window)
        torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)
    fp8 = dict(seed=seed, cache_dtype=FP8, k_scale=np.float64(0.5), v_scale=np.float32(2.0))
    torch.testing.assert_close(
        decode(**fp8), decode(seed=seed, cache_dtype=FP8, k_scale=0.5, v_scale=2.0), rtol=0, atol=0
    )
    k_cache = torch.randn(3, 4, 2, 16).to(FP8)
    k, v = torch.randn(2, 2, 16, dtype=BF16), torch.randn(2, 2, 16, dtype=BF16)
    slots = torch.tensor([1, 6], dtype=I64)
    tk.kvcache_store(
        k, v, k_cache, k_cache.clone(), slot_mapping=slots, k_scale=np.float64(2.0), v_scale=1
    )


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(alpha=math.nan), ValueError, "SwiGLU: alpha is nan, expected a finite float > 0"),
        (dict(alpha=math.inf), ValueError, "SwiGLU: alpha is inf, expected a finite float > 0"),
        (dict(alpha=0.0), ValueError, "SwiGLU: alpha is 0.0, expected a finite float > 0"),
        (dict(alpha=-1.702), ValueError, "SwiGLU: alpha is -1.702"),
        (dict(alpha="1.7"), TypeError, "SwiGLU: alpha is str, expected a float"),
        (dict(limit=-7.0), ValueError, r"SwiGLU: limit is -7.0, expected a float >= 0"),
        (dict(limit=math.nan), ValueError, "SwiGLU: limit is nan"),
        (dict(limit=-math.inf), ValueError, "SwiGLU: limit is -inf"),
        (dict(limit=True), TypeError, "SwiGLU: limit is bool, expected a float"),
    ],
)
def test_swiglu_rejects_bad_parameters(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        tk.SwiGLU(**kwargs)


def test_swiglu_accepts_numpy_and_unclamped_limit():
    act = tk.SwiGLU(alpha=np.float32(1.5), limit=math.inf)
    assert type(act.alpha) is float and act.alpha == 1.5 and act.limit == math.inf


@pytest.mark.parametrize("has_bias", ["no", 1, None, np.bool_(True)])
def test_moe_config_has_bias_must_be_bool(has_bias):
    with pytest.raises(TypeError, match="MoEConfig: has_bias is .*, expected True or False"):
        tk.MoEConfig(8, 2, 64, 96, has_bias=has_bias)


def test_moe_config_takes_numpy_sizes_as_plain_ints():
    config = tk.MoEConfig(np.int64(8), np.int32(2), 64, 96)
    assert type(config.num_experts) is int and config == tk.MoEConfig(8, 2, 64, 96)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 3)])
def test_moe_plan_on_a_missing_gpu_is_a_named_error(device):
    with pytest.raises(ValueError, match="moe_plan: device is cuda.*torch sees no CUDA/ROCm"):
        tk.moe_plan(tk.MoEConfig(8, 2, 64, 96), device=device)


@pytest.mark.parametrize(
    "device, match",
    [
        ("meta", "device is meta, expected cpu or cuda"),
        ("nonsense", "device is 'nonsense', expected a torch device"),
    ],
)
def test_moe_plan_device_errors(device, match):
    with pytest.raises(ValueError, match="moe_plan: " + match):
        tk.moe_plan(tk.MoEConfig(8, 2, 64, 96), device=device)


def test_plan_weights_mismatch_names_each_differing_field():
    config = tk.MoEConfig(8, 2, 64, 96, weight_format="bf16", has_bias=False)
    other = tk.MoEConfig(8, 3, 64, 96, weight_format="bf16", has_bias=False)
    plan, other_plan = (tk.moe_plan(c, device="cpu") for c in (config, other))
    weights = tk.MoEWeights(
        w13=torch.randn(8, 192, 64, dtype=BF16), w2=torch.randn(8, 64, 96, dtype=BF16)
    )
    prepared = tk.moe_prepare_weights(other_plan, weights)
    x, logits = torch.randn(2, 64, dtype=BF16), torch.randn(2, 8)
    with pytest.raises(
        ValueError,
        match="moe_apply: weights do not match the plan: config.top_k is 3 in the "
        "weights, 2 in the plan$",
    ):
        tk.moe_apply(plan, x, prepared, logits)
