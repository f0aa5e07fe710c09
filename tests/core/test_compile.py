"""The public ops under torch.compile on the CPU (reference kernels): one graph with no breaks,
the same numbers as eager, no recompile per batch size, and every custom op's fake kernel."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import tokenspeed_kernel as tk
from tokenspeed_kernel.ops import library
from tokenspeed_kernel.testing.inputs import MoEShape, generator, moe_weights

# Importing Inductor touches torch.jit.script_method, which torch 2.11 deprecates: torch's own
# warning, nothing these tests call.
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"
)

BF16, I32 = torch.bfloat16, torch.int32
HQ, HKV, D, PAGE, PAGES = 4, 2, 32, 4, 24
MOE = MoEShape(num_tokens=1, num_experts=4, top_k=2, hidden_size=HQ * D, intermediate_size=64)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def layer():
    gen = generator("compile")
    plan = tk.moe_plan(MOE.config(), device="cpu", max_num_tokens=64)
    weights = tk.moe_prepare_weights(plan, moe_weights(MOE, gen))
    caches = [torch.randn(PAGES, PAGE, HKV, D, generator=gen).to(BF16) for _ in range(2)]
    return dict(
        plan=plan,
        weights=weights,
        norm=torch.rand(HQ * D, generator=gen) + 0.5,
        proj=(torch.randn(HQ * D, (HQ + 2 * HKV) * D, generator=gen) / 16).to(BF16),
        router=torch.randn(HQ * D, MOE.num_experts, generator=gen),
        sinks=torch.randn(HQ, generator=gen),
        caches=caches,
    )


def _step(x, page_table, cache_seqlens, slots, layer):
    """One decode layer: RMSNorm, qkv projection, store, attention (sinks, window), MoE."""
    h = x.float()
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * layer["norm"]).to(BF16)
    qkv = h @ layer["proj"]
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
    k_cache, v_cache = layer["caches"]
    tk.kvcache_store(
        k.reshape(-1, HKV, D), v.reshape(-1, HKV, D), k_cache, v_cache, slot_mapping=slots
    )
    attn = tk.mha_decode_with_kvcache(
        q.reshape(-1, HQ, D), k_cache, v_cache, page_table=page_table,
        cache_seqlens=cache_seqlens, sinks=layer["sinks"], window_left=5,
    )  # fmt: skip
    y = x + attn.reshape(x.shape)
    logits = y.float() @ layer["router"]
    return y + tk.moe_apply(layer["plan"], y, layer["weights"], logits)


def _batch(batch, seed=0):
    gen = generator("batch", batch, seed)
    x = torch.randn(batch, HQ * D, generator=gen).to(BF16)
    page_table = torch.randperm(PAGES, generator=gen)[: batch * 3].view(batch, 3).to(I32)
    cache_seqlens = torch.randint(1, 3 * PAGE, (batch,), generator=gen, dtype=I32)
    last = cache_seqlens.long() - 1
    slots = page_table.gather(1, (last // PAGE)[:, None])[:, 0].long() * PAGE + last % PAGE
    return x, page_table, cache_seqlens, slots


def test_decode_layer_compiles_to_one_graph_and_matches_eager(layer):
    args = _batch(3)
    explained = torch._dynamo.explain(_step)(*args, layer)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    expected = _step(*args, layer)
    # aot_eager functionalizes the mutated caches and outputs as Inductor does, without
    # Inductor's fused bf16 rounding in the norm, so eager's numbers are matched exactly.
    got = torch.compile(_step, fullgraph=True, backend="aot_eager")(*args, layer)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_prefill_compiles_with_dynamic_tokens_without_recompiling():
    def attend(q, k, v, cu_seqlens, sinks):
        out, lse = tk.mha_prefill(
            q, k, v, cu_seqlens=cu_seqlens, max_seqlen=16, window_left=3, sinks=sinks,
            return_lse=True,
        )  # fmt: skip
        return out * 2, lse

    counter = CompileCounter()
    compiled = torch.compile(attend, fullgraph=True, backend=counter)
    sinks = torch.randn(HQ)
    for tokens in (7, 12):
        gen = generator("prefill", tokens)
        q = torch.randn(tokens, HQ, D, generator=gen).to(BF16)
        k, v = (torch.randn(tokens, HKV, D, generator=gen).to(BF16) for _ in range(2))
        cu = torch.tensor([0, 3, tokens], dtype=I32)
        torch._dynamo.mark_dynamic(q, 0)
        torch._dynamo.mark_dynamic(k, 0)
        torch._dynamo.mark_dynamic(v, 0)
        for got, want in zip(compiled(q, k, v, cu, sinks), attend(q, k, v, cu, sinks), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert counter.frame_count == 1


def test_decode_batch_size_is_dynamic(layer):
    counter = CompileCounter()
    compiled = torch.compile(_step, fullgraph=True, backend=counter)
    for batch in (2, 5):
        args = _batch(batch, seed=1)
        for t in args:
            torch._dynamo.mark_dynamic(t, 0)
        expected = _step(*args, layer)
        torch.testing.assert_close(compiled(*args, layer), expected, rtol=0, atol=0)
    assert counter.frame_count == 1


def _opcheck_cases(layer):
    gen = generator("opcheck")
    q3 = torch.randn(2, HQ, D, generator=gen).to(BF16)
    q = torch.randn(6, HQ, D, generator=gen).to(BF16)
    kv = torch.randn(6, HKV, D, generator=gen).to(BF16)
    k_cache, v_cache = (c.clone() for c in layer["caches"])
    table = torch.arange(6, dtype=I32).view(2, 3)
    lens = torch.tensor([5, 9], dtype=I32)
    cu = torch.tensor([0, 2, 6], dtype=I32)
    sinks = layer["sinks"]
    x = torch.randn(2, HQ * D, generator=gen).to(BF16)
    return {
        "mha_prefill": (q, kv, kv, cu, 4, True, -1, sinks, None, torch.empty_like(q),
                        torch.empty(6, HQ)),
        "mha_extend_with_kvcache": (q, k_cache, v_cache, cu, table, lens, 4, 3, None, 0.2,
                                    torch.empty_like(q), None, None, None),
        "mha_decode_with_kvcache": (q3, k_cache, v_cache, table, lens, -1, sinks, None,
                                    torch.empty_like(q3), torch.empty(2, HQ), None, None),
        "kvcache_store": (kv, kv, k_cache, v_cache, torch.arange(6) * 3, None, None),
        "moe_apply": (id(layer["plan"]), x, id(layer["weights"]), torch.randn(2, 4), None, None,
                      torch.empty_like(x)),
    }  # fmt: skip


@pytest.mark.parametrize(
    "op",
    [
        "mha_prefill",
        "mha_extend_with_kvcache",
        "mha_decode_with_kvcache",
        "kvcache_store",
        "moe_apply",
    ],
)
def test_custom_op_passes_opcheck(op, layer):
    args = _opcheck_cases(layer)[op]
    torch.library.opcheck(getattr(torch.ops.tokenspeed, op).default, args)
    assert library  # the import above registered the namespace


def test_inductor_runs_the_custom_ops_in_place(layer):
    """The default backend: the functionalized mutations come back as writes to the caller's
    `out` and caches, with eager's numbers."""

    def decode(q, page_table, cache_seqlens, out):
        k_cache, v_cache = layer["caches"]
        tk.mha_decode_with_kvcache(
            q, k_cache, v_cache, page_table=page_table, cache_seqlens=cache_seqlens,
            sinks=layer["sinks"], out=out,
        )  # fmt: skip
        return out.float().sum()

    x, page_table, cache_seqlens, _ = _batch(2, seed=2)
    q = x.view(2, HQ, D)
    expected, got = torch.empty_like(q), torch.empty_like(q)
    total = torch.compile(decode, fullgraph=True)(q, page_table, cache_seqlens, got)
    decode(q, page_table, cache_seqlens, expected)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(total, expected.float().sum())


def test_compiled_moe_apply_names_a_plan_moe_plan_did_not_make(layer):
    copied = dataclasses.replace(layer["plan"])  # equal, but never registered
    x = torch.randn(2, HQ * D).to(BF16)
    logits = torch.randn(2, MOE.num_experts)
    compiled = torch.compile(tk.moe_apply, fullgraph=True, backend="aot_eager")
    with pytest.raises(TypeError, match="plan was not returned by moe_plan"):
        compiled(copied, x, layer["weights"], logits)
