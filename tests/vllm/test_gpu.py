"""The plugin's attention and MoE classes on a GPU at GPT-OSS-120B shapes, with the kernels the
selector picks there (the reference kernels may not serve: TOKENSPEED_KERNEL_VLLM_REFERENCE is
unset, so a layer only the reference could serve fails to build). Needs vLLM 0.26 and a GPU:
`pytest -m gpu tests/vllm/test_gpu.py`."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vLLM 0.26: run bash scripts/test_vllm_plugin.sh")

import torch  # noqa: E402
from test_attention import DecodeBuffers, Engine, assert_close, make_layer  # noqa: E402
from test_vllm_moe import assert_close as assert_moe_close  # noqa: E402
from test_vllm_moe import run_ranks  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_reference", "vllm_config")]

# GPT-OSS-120B per rank at TP 1: 64 query heads, 8 KV heads, head dim 64, window 128.
GPT_OSS_HEADS = (64, 8)
GPT_OSS_MOE = dict(num_experts=128, top_k=4, hidden=2880, intermediate=2880)


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8"])
@pytest.mark.parametrize("sliding_window", [None, 128], ids=["full", "window128"])
def test_attention_at_gpt_oss_120b_shapes(vllm_config, kv_cache_dtype, sliding_window):
    torch.manual_seed(0)
    layer = make_layer(
        vllm_config, sliding_window=sliding_window, kv_cache_dtype=kv_cache_dtype,
        heads=GPT_OSS_HEADS, device="cuda",
    )  # fmt: skip
    if kv_cache_dtype == "fp8":
        layer._k_scale_float, layer._v_scale_float = 0.5, 0.25
    engine = Engine(
        layer, vllm_config, 4, sliding_window=sliding_window, num_blocks=512, device="cuda"
    )
    tol = 2e-2 if kv_cache_dtype == "bfloat16" else 4e-2
    out, md, expected = engine.step([(0, 700), (1, 1), (2, 300)])
    assert md.prefill.fresh
    assert_close(out, expected, atol=tol)
    for _ in range(3):
        out, md, expected = engine.step([(0, 1), (1, 1), (2, 1)])
        assert_close(out, expected, atol=tol)
    out, md, expected = engine.step([(0, 1), (2, 1), (1, 150), (3, 64)], padding=5)
    assert md.num_decode_tokens == 2 and not md.prefill.fresh
    assert_close(out, expected, atol=tol)


@pytest.mark.parametrize("sliding_window", [None, 128], ids=["full", "window128"])
def test_decode_steps_replay_in_a_cuda_graph(vllm_config, sliding_window):
    """A decode-only step (cache update and attention) captured once in a CUDA graph, as vLLM's
    full graphs capture it at a padded batch size, then replayed over the runner's buffers
    refilled in place: each replay matches float64 attention over the cache as it grew."""
    torch.manual_seed(0)
    layer = make_layer(
        vllm_config, sliding_window=sliding_window, heads=GPT_OSS_HEADS, device="cuda"
    )
    engine = Engine(
        layer, vllm_config, 4, sliding_window=sliding_window, num_blocks=512, device="cuda"
    )
    engine.step([(0, 700), (1, 1), (2, 300), (3, 130)])
    buffers = DecodeBuffers(engine, batch=8)
    expected = buffers.fill()  # eager first: compiles and allocates outside the capture
    buffers.step()
    assert_close(buffers.out[:4].cpu(), expected, atol=2e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        buffers.step()
    for _ in range(4):
        expected = buffers.fill()
        buffers.out.fill_(float("nan"))
        graph.replay()
        assert_close(buffers.out[:4].cpu(), expected, atol=2e-2)


@pytest.mark.parametrize(("tp", "ep"), [(1, 1), (4, 1), (8, 1), (1, 4)])
def test_moe_at_gpt_oss_120b_shapes(tp, ep):
    total, expected, layers = run_ranks(
        GPT_OSS_MOE, tp=tp, ep=ep, num_tokens=33, device="cuda", kernel=None
    )
    assert all(not layer.quant_method.plan.kernel.startswith("reference") for layer in layers)
    assert_moe_close(total, expected)
