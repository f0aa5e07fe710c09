"""The attention backend inside vLLM's own objects, on CPU tensors (the reference kernels):
vLLM's Attention layer builds our impl, vLLM's allocator reshapes the cache to our shape, our
metadata builder reads vLLM's CommonAttentionMetadata, and each step's output matches an
independent float64 attention (GQA, sinks, sliding window, paged cache, FP8 cache)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

pytest.importorskip("vllm", reason="needs vLLM 0.26: run bash scripts/test_vllm_plugin.sh")

import torch  # noqa: E402
from vllm.config import CacheConfig  # noqa: E402
from vllm.model_executor.layers.attention import Attention  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.worker.gpu.attn_utils import _reshape_attention_kv_cache  # noqa: E402

from tokenspeed_kernel_vllm.attention import (  # noqa: E402
    TokenspeedAttentionBackend,
    TokenspeedAttentionMetadataBuilder,
)

pytestmark = pytest.mark.usefixtures("allow_reference")

HQ, HKV, D, PAGE = 8, 2, 64, 16
NUM_BLOCKS = 24
FP8 = torch.float8_e4m3fn


def make_layer(vllm_config, *, sliding_window, kv_cache_dtype="bfloat16", sinks=True,
               heads=(HQ, HKV), device="cpu"):  # fmt: skip
    """vLLM's own Attention layer (as GPT-OSS builds it) with our backend. The cache dtype is
    named: "auto" means the model config's dtype, and these tests build no model config."""
    vllm_config.cache_config.block_size = PAGE
    cache_config = CacheConfig(block_size=PAGE, cache_dtype=kv_cache_dtype)
    hq, hkv = heads
    sink_values = (torch.randn(hq) * 2).to(device)
    sink_param = torch.nn.Parameter(sink_values, requires_grad=False) if sinks else None
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # vLLM builds models under the model dtype
    try:
        layer = Attention(
            hq, D, D**-0.5, num_kv_heads=hkv, cache_config=cache_config,
            per_layer_sliding_window=sliding_window, prefix="model.layers.0.attn",
            sinks=sink_param, attn_backend=TokenspeedAttentionBackend,
        )  # fmt: skip
    finally:
        torch.set_default_dtype(default)
    layer.process_weights_after_loading(torch.bfloat16)
    return layer


def allocate_cache(layer, vllm_config, num_blocks, device):
    """The cache as vLLM's GPU runner makes it: a raw byte buffer of the layer's spec,
    reshaped by vLLM's own _reshape_attention_kv_cache to our get_kv_cache_shape."""
    spec = layer.get_kv_cache_spec(vllm_config)
    assert spec.block_size == PAGE
    raw = torch.zeros(num_blocks * spec.page_size_bytes, dtype=torch.int8, device=device)
    shape = TokenspeedAttentionBackend.get_kv_cache_shape(
        num_blocks, PAGE, layer.num_kv_heads, D, cache_dtype_str=layer.kv_cache_dtype
    )
    kv_cache = _reshape_attention_kv_cache(raw, spec, shape, tuple(range(5)), num_blocks, None)
    # Finite garbage in every slot: only the written ones may matter.
    garbage = torch.randn(kv_cache.shape, device=device)
    kv_cache.copy_(garbage.to(FP8).view(torch.uint8) if kv_cache.dtype == torch.uint8 else garbage)
    return spec, kv_cache


@dataclass
class Request:
    blocks: list[int]
    k: list[torch.Tensor] = field(default_factory=list)  # per token [Hkv, D], as written
    v: list[torch.Tensor] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.k)


class Engine:
    """Plays vLLM's model runner for one layer: slots, block tables, metadata, the two calls."""

    def __init__(self, layer, vllm_config, num_requests, *, sliding_window,
                 num_blocks=NUM_BLOCKS, device="cpu"):  # fmt: skip
        self.layer, self.impl = layer, layer.impl
        # vLLM's window counts the query: it sees itself and sliding_window - 1 keys before.
        self.window_left = -1 if sliding_window is None else sliding_window - 1
        self.device, self.hq, self.hkv = torch.device(device), layer.num_heads, layer.num_kv_heads
        self.spec, self.kv_cache = allocate_cache(layer, vllm_config, num_blocks, device)
        self.builder = TokenspeedAttentionMetadataBuilder(
            self.spec, [layer.layer_name], vllm_config, self.device
        )
        blocks = torch.randperm(num_blocks).tolist()  # pages in no particular order
        per = num_blocks // num_requests
        self.requests = [Request(blocks[i * per : (i + 1) * per]) for i in range(num_requests)]

    def step(self, batch: list[tuple[int, int]], *, padding: int = 0, exact_bound: bool = True):
        """Run one step: `batch` = (request, new tokens), decodes first as vLLM orders them.
        Returns (output, metadata, expected float64 output)."""
        lens = [n for _, n in batch]
        total = sum(lens)
        dev = self.device
        q = torch.randn(total + padding, self.hq, D, device=dev).to(torch.bfloat16)
        k = torch.randn(total + padding, self.hkv, D, device=dev).to(torch.bfloat16)
        v = torch.randn(total + padding, self.hkv, D, device=dev).to(torch.bfloat16)
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        slots, seq_lens = [], []
        for (r, n), s in zip(batch, starts[:-1], strict=True):
            req = self.requests[r]
            for i in range(n):
                pos = req.length
                slots.append(req.blocks[pos // PAGE] * PAGE + pos % PAGE)
                req.k.append(k[s + i].cpu())
                req.v.append(v[s + i].cpu())
            seq_lens.append(req.length)
        slot_mapping = torch.tensor(slots + [-1] * padding, dtype=torch.int64, device=dev)
        width = max(len(self.requests[r].blocks) for r, _ in batch)
        table = [self.requests[r].blocks[:width] for r, _ in batch]
        table = torch.tensor(table, dtype=torch.int32, device=dev)
        query_start = torch.tensor(starts, dtype=torch.int32)
        seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=query_start.to(dev), query_start_loc_cpu=query_start,
            seq_lens=seq_lens_cpu.to(dev), num_reqs=len(batch), num_actual_tokens=total,
            max_query_len=max(lens), max_seq_len=max(seq_lens), block_table_tensor=table,
            slot_mapping=slot_mapping,
            seq_lens_cpu_upper_bound=seq_lens_cpu if exact_bound else None,
        )  # fmt: skip
        self.impl.do_kv_cache_update(self.layer, k, v, self.kv_cache, slot_mapping)
        metadata = self.builder.build(0, common)
        sentinel = 123.0
        out = torch.full((total + padding, self.hq, D), sentinel, dtype=torch.bfloat16, device=dev)
        self.impl.forward(self.layer, q, k, v, self.kv_cache, metadata, out)
        assert (out[total:] == sentinel).all(), "rows past num_actual_tokens were written"
        fresh = metadata.prefill is not None and metadata.prefill.fresh
        decode_rows = metadata.num_decode_tokens
        # A fresh prefill attends over the keys passed in; every other row reads the cache.
        expected = torch.cat([
            self.expected(q[s : s + n].cpu(), self.requests[r], exact=fresh and s >= decode_rows)
            for (r, n), s in zip(batch, starts[:-1], strict=True)
        ])  # fmt: skip
        return out[:total].cpu(), metadata, expected

    def expected(self, q, req: Request, *, exact: bool) -> torch.Tensor:
        """float64 attention of q [n, Hq, D], the last n positions of `req`. `exact`: the keys
        are the ones passed in (a fresh prompt); else as the cache holds them (FP8 rounding)."""
        k = torch.stack(req.k).double()
        v = torch.stack(req.v).double()
        if not exact and self.impl.fp8:
            ks, vs = self.layer._k_scale_float, self.layer._v_scale_float
            k = (k / ks).to(FP8).double() * ks
            v = (v / vs).to(FP8).double() * vs
        sinks = None if self.impl.sinks is None else self.impl.sinks.cpu()
        return reference_attention(
            q.double(), k, v, window_left=self.window_left, sinks=sinks,
            scale=D**-0.5,
        )  # fmt: skip


class DecodeBuffers:
    """vLLM's runner for decode-only steps under a full CUDA graph: one set of persistent
    buffers (batch rows, padded past the live requests), metadata built once over them, every
    step refilled in place: what a captured graph replays."""

    def __init__(self, engine: Engine, batch: int):
        self.engine, self.batch = engine, batch
        dev, width = engine.device, max(len(r.blocks) for r in engine.requests)
        self.q = torch.zeros(batch, engine.hq, D, dtype=torch.bfloat16, device=dev)
        self.k = torch.zeros(batch, engine.hkv, D, dtype=torch.bfloat16, device=dev)
        self.v = torch.zeros_like(self.k)
        self.out = torch.zeros_like(self.q)
        self.slot_mapping = torch.full((batch,), -1, dtype=torch.int64, device=dev)
        self.table = torch.zeros(batch, width, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(batch, dtype=torch.int32, device=dev)
        starts = torch.arange(batch + 1, dtype=torch.int32)
        self.common = CommonAttentionMetadata(
            query_start_loc=starts.to(dev), query_start_loc_cpu=starts, seq_lens=self.seq_lens,
            num_reqs=batch, num_actual_tokens=batch, max_query_len=1,
            max_seq_len=width * PAGE, block_table_tensor=self.table,
            slot_mapping=self.slot_mapping, seq_lens_cpu_upper_bound=None,
        )  # fmt: skip
        self.metadata = engine.builder.build(0, self.common)

    def fill(self):
        """One new token for every request, written into the buffers in place (padding rows:
        no slot, no length); returns the requests' float64 expected outputs."""
        engine = self.engine
        for r, req in enumerate(engine.requests):
            q, k, v = (
                torch.randn(t.shape[1:]).to(torch.bfloat16) for t in (self.q, self.k, self.v)
            )
            pos = req.length
            req.k.append(k)
            req.v.append(v)
            self.q[r], self.k[r], self.v[r] = q, k, v
            self.slot_mapping[r] = req.blocks[pos // PAGE] * PAGE + pos % PAGE
            self.seq_lens[r] = req.length
            self.table[r] = torch.tensor(req.blocks[: self.table.shape[1]], dtype=torch.int32)
        return torch.cat([
            engine.expected(self.q[r : r + 1].cpu(), req, exact=False)
            for r, req in enumerate(engine.requests)
        ])  # fmt: skip

    def step(self):
        """The two calls vLLM's model makes for the layer, on the buffers."""
        engine = self.engine
        engine.impl.do_kv_cache_update(
            engine.layer, self.k, self.v, engine.kv_cache, self.slot_mapping
        )
        engine.impl.forward(
            engine.layer, self.q, self.k, self.v, engine.kv_cache, self.metadata, self.out
        )


def reference_attention(q, k, v, *, window_left, sinks, scale):
    """q [n, Hq, D] at the last n of L positions; k/v [L, Hkv, D]; float64 throughout."""
    n, length = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    logits = torch.einsum("nhd,lhd->hnl", q, k) * scale
    pos = torch.arange(length - n, length)[:, None]
    key = torch.arange(length)[None, :]
    visible = key <= pos
    if window_left >= 0:
        visible &= key >= pos - window_left
    logits = logits.masked_fill(~visible, -math.inf)
    if sinks is not None:
        sink = sinks.double()[:, None, None].expand(-1, n, 1)
        logits = torch.cat([logits, sink], dim=-1)
        v = torch.cat([v, torch.zeros(1, *v.shape[1:], dtype=v.dtype)])
    weights = torch.softmax(logits, dim=-1)
    return torch.einsum("hnl,lhd->nhd", weights, v)


def assert_close(actual, expected, *, atol):
    err = (actual.double() - expected).abs()
    worst = err.argmax()
    assert err.max() <= atol, (
        f"max error {err.max():.4f} at {list(torch.unravel_index(worst, err.shape))}, "
        f"RMS {err.pow(2).mean().sqrt():.5f} (tolerance {atol})"
    )


@pytest.mark.parametrize("sliding_window", [None, 8], ids=["full", "window8"])
def test_prefill_decode_mixed_match_float64(vllm_config, sliding_window):
    torch.manual_seed(0)
    layer = make_layer(vllm_config, sliding_window=sliding_window)
    engine = Engine(layer, vllm_config, num_requests=4, sliding_window=sliding_window)
    # Step 1: three fresh prompts (one of a single token) -> mha_prefill.
    out, md, expected = engine.step([(0, 19), (1, 1), (2, 33)])
    assert md.decode is None and md.prefill.fresh
    assert_close(out, expected, atol=2e-2)
    # Step 2: one token each -> mha_decode_with_kvcache, a page boundary crossed on the way.
    for _ in range(14):
        out, md, expected = engine.step([(0, 1), (1, 1), (2, 1)])
        assert md.prefill is None and md.num_decode_tokens == 3
        assert_close(out, expected, atol=2e-2)
    # Step 3: mixed batch, decodes first: two decodes, a chunk over a cached context and a
    # fresh prompt -> decode + mha_extend_with_kvcache (not every prefill row is fresh).
    out, md, expected = engine.step([(1, 1), (2, 1), (0, 7), (3, 12)], padding=3)
    assert md.num_decode_tokens == 2 and not md.prefill.fresh
    assert_close(out, expected, atol=2e-2)
    # Fresh prompts only, but no CPU bound on the lengths: extend, still exact.
    out, md, expected = engine.step([(3, 5)], exact_bound=False)
    assert not md.prefill.fresh
    assert_close(out, expected, atol=2e-2)


def test_fp8_cache_with_scales(vllm_config):
    torch.manual_seed(1)
    layer = make_layer(vllm_config, sliding_window=8, kv_cache_dtype="fp8")
    layer._k_scale_float, layer._v_scale_float = 0.5, 0.25
    engine = Engine(layer, vllm_config, num_requests=2, sliding_window=8)
    assert engine.kv_cache.dtype == torch.uint8  # vLLM allocates FP8 caches as bytes
    out, md, expected = engine.step([(0, 21), (1, 9)])
    assert md.prefill.fresh
    assert_close(out, expected, atol=2e-2)
    for _ in range(3):
        out, md, expected = engine.step([(0, 1), (1, 1)])
        assert_close(out, expected, atol=3e-2)
    out, md, expected = engine.step([(1, 1), (0, 6)])
    assert md.num_decode_tokens == 1 and not md.prefill.fresh
    assert_close(out, expected, atol=3e-2)


def test_no_sinks_full_attention(vllm_config):
    torch.manual_seed(2)
    layer = make_layer(vllm_config, sliding_window=None, sinks=False)
    engine = Engine(layer, vllm_config, num_requests=2, sliding_window=None)
    for batch in ([(0, 17), (1, 4)], [(0, 1), (1, 1)], [(0, 1), (1, 3)]):
        out, _, expected = engine.step(batch)
        assert_close(out, expected, atol=2e-2)


def test_profiling_run_without_metadata_gives_zeros(vllm_config):
    layer = make_layer(vllm_config, sliding_window=None)
    q = torch.randn(5, HQ, D).to(torch.bfloat16)
    k = torch.randn(5, HKV, D).to(torch.bfloat16)
    out = torch.full((5, HQ, D), 7.0, dtype=torch.bfloat16)
    layer.impl.forward(layer, q, k, k, torch.empty(0), None, out)
    assert (out == 0).all()


def test_window_is_vllm_sliding_window_minus_one(vllm_config):
    layer = make_layer(vllm_config, sliding_window=128)
    assert layer.impl.window_left == 127  # GPT-OSS: 128 keys including the query itself


def test_fused_output_quantization_is_refused(vllm_config):
    layer = make_layer(vllm_config, sliding_window=None)
    q = torch.randn(2, HQ, D).to(torch.bfloat16)
    with pytest.raises(NotImplementedError, match="fused output quantization"):
        layer.impl.forward(layer, q, q, q, torch.empty(0), None, q, output_scale=torch.ones(1))


def test_decode_metadata_reads_the_runner_buffers_in_place(vllm_config):
    """A full CUDA graph replays the metadata built at capture: the decode batch's page table
    and lengths must be the runner's persistent buffers, not copies, so a replay reads what the
    runner wrote for this step. Steps refilled in place then match float64 attention."""
    layer = make_layer(vllm_config, sliding_window=8)
    engine = Engine(layer, vllm_config, 3, sliding_window=8)
    engine.step([(0, 20), (1, 1), (2, 9)])
    buffers = DecodeBuffers(engine, batch=5)
    decode = buffers.metadata.decode
    assert buffers.metadata.prefill is None and buffers.metadata.num_decode_tokens == 5
    assert decode.page_table.data_ptr() == buffers.table.data_ptr()
    assert decode.cache_seqlens.data_ptr() == buffers.seq_lens.data_ptr()
    for _ in range(3):
        expected = buffers.fill()
        buffers.step()
        assert_close(buffers.out[:3].cpu(), expected, atol=2e-2)


def test_kv_cache_shape_is_our_layout():
    shape = TokenspeedAttentionBackend.get_kv_cache_shape(10, 16, HKV, D)
    assert shape == (2, 10, 16, HKV, D)  # kv_cache[0] / [1] = [num_pages, P, Hkv, D]
    with pytest.raises(ValueError, match="block size 24, expected one of 16, 32"):
        TokenspeedAttentionBackend.get_kv_cache_shape(10, 24, HKV, D)
    with pytest.raises(ValueError, match="kv cache dtype 'fp8_e5m2'"):
        TokenspeedAttentionBackend.get_kv_cache_shape(10, 16, HKV, D, "fp8_e5m2")
