"""GPT-OSS end to end on the public ops (tokenspeed_kernel.integrations.gpt_oss): prefill and
decode tokens/s at real shapes, with a paged KV cache; rewrites
benchmarks/results/gpt_oss_e2e_<gpu>.md.

The model has the released shapes (hidden 2880, 64 q / 8 kv heads of 64, sinks, sliding window
128 on even layers, MXFP4 experts with I = 2880: 32 experts top-4 for 20B, 128 for 120B, vocab
201088) and random weights. A run builds `--layers` of them (default 4: GPU time is scarce) and
the embedding and head; each figure is measured on that stack and on the head alone (0 layers),
and the full depth (24 or 36 layers) is projected as head + depth x per-layer time.

- prefill: one prompt of 1024 and of 8192 tokens, eager (mha_prefill, kvcache_store, moe_apply).
- decode: batch 1/16/64, one token per sequence over `--context` cached tokens, eager and as
  one CUDA graph per step.
- `--check`: layers 0 (sliding) and 1 (full) against transformers' GptOssDecoderLayer holding
  the same weights (experts dequantized to bf16; eager attention and experts): outputs of a
  300-token prefill and of one decode step after it; then the time of one layer, ours and
  transformers' (eager attention, grouped_mm experts), at prefill 1024 and decode batch 16.
- `--tiny`: CPU-sized shapes through the reference kernels, checked against transformers (when
  installed) and timed for form only: the model code runs everywhere in seconds.

    python3 benchmarks/gpt_oss_e2e.py [--model gpt-oss-120b|gpt-oss-20b] [--layers 4]
        [--context 2048] [--check] [--tiny] [--no-record]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record  # noqa: E402

from tokenspeed_kernel.integrations import gpt_oss  # noqa: E402
from tokenspeed_kernel.integrations.gpt_oss import (  # noqa: E402
    PRESETS,
    GptOssModel,
    decode_batch,
    prefill_batch,
)
from tokenspeed_kernel.tools.timing import capture_graph  # noqa: E402

PAGE_SIZE = 64
# Relative error of a layer's block output against transformers': its eager path rounds the
# attention probabilities and every expert's partial sums to bf16 (a few 1e-3 each).
REL_TOLERANCE = 3e-2
# Rows whose router picks other experts on each side (near-ties under a bf16 ulp of input).
FLIP_SHARE = 0.05


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device, *, warmup=2, reps=5) -> float:
    """Median wall time of fn() in ms, synchronized around each call."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def graph_ms(fn, device, *, reps=30) -> float:
    """Median time of one replay of fn() captured as a CUDA graph, in ms."""
    replay = capture_graph(fn, device)
    replay()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del replay
    return statistics.median(times)


def prefill_step(model, length, cache):
    device = model.device
    batch, positions = prefill_batch([length], PAGE_SIZE, -(-length // PAGE_SIZE), device)
    ids = torch.randint(0, model.shape.vocab_size, (length,), device=device)
    last = batch.cu_seqlens[1:].long() - 1
    return lambda: model.forward(ids, positions, cache, batch, last=last)


def decode_step(model, batch_size, context, cache):
    device = model.device
    pages_per_seq = -(-(context + 1) // PAGE_SIZE)
    batch, positions = decode_batch([context] * batch_size, PAGE_SIZE, pages_per_seq, device)
    ids = torch.randint(0, model.shape.vocab_size, (batch_size,), device=device)
    return lambda: model.forward(ids, positions, cache, batch)


def random_cache(model, num_pages):
    cache = model.new_cache(num_pages, PAGE_SIZE)
    for t in (*cache.k, *cache.v):
        t.normal_()
    return cache


def measure(model, depth, args) -> list[list[str]]:
    """Rows of (phase, case, eager ms, graph ms, tokens/s at the measured and full depth)."""
    device, head = model.device, model.truncated(0)
    rows = []
    n = len(model.layers)

    def row(phase, case, tokens, ours, base, graph=None, graph_base=None):
        per_layer = (ours - base) / n if n else 0.0
        full = base + depth * per_layer
        cells = [phase, case, f"{ours:.2f}", "-" if graph is None else f"{graph:.3f}"]
        best, best_full = ours, full
        if graph is not None:
            best = graph
            best_full = graph_base + depth * (graph - graph_base) / n
        cells += [
            f"{per_layer:.3f}",
            f"{tokens / best * 1e3:,.0f}",
            f"{tokens / best_full * 1e3:,.0f}",
        ]
        rows.append(cells)
        print(" | ".join(cells), flush=True)

    for length in args.prefill:
        cache = model.new_cache(-(-length // PAGE_SIZE), PAGE_SIZE)
        ours = time_ms(prefill_step(model, length, cache), device, reps=args.reps)
        base = time_ms(prefill_step(head, length, cache), device, reps=args.reps)
        row("prefill", f"1 x {length}", length, ours, base)
    for batch_size in args.decode:
        pages = batch_size * -(-(args.context + 1) // PAGE_SIZE)
        cache = random_cache(model, pages)
        step, head_step = decode_step(model, batch_size, args.context, cache), None
        ours = time_ms(step, device, reps=args.reps)
        head_step = decode_step(head, batch_size, args.context, cache)
        base = time_ms(head_step, device, reps=args.reps)
        graph = graph_base = None
        if device.type == "cuda":
            try:
                graph = graph_ms(step, device)
                graph_base = graph_ms(head_step, device)
            except Exception as exc:  # recorded in the table: the eager figures still stand
                print(f"graph capture failed: {exc!r}", flush=True)
                graph = graph_base = None
        row(
            "decode",
            f"B={batch_size} ctx {args.context}",
            batch_size,
            ours,
            base,
            graph,
            graph_base,
        )
        del cache
    return rows


def check(model, args) -> tuple[list[str], bool]:
    """Layers 0 and 1 against transformers' decoder layer, block by block: lines for the record,
    and whether any error is beyond REL_TOLERANCE.

    Routing is a discrete choice: where two implementations' router inputs differ by a bf16
    ulp, a token whose 4th and 5th expert logits nearly tie takes a different expert on each
    side, and its MoE output differs by a whole expert's share. So the MoE block is checked on
    transformers' own attention output (identical router input: no flip is expected), and the
    whole layer's error is taken over the tokens whose experts agree, with the flipped tokens
    counted (at most FLIP_SHARE of them)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    device, shape = model.device, model.shape
    lines = ["", "## Check against transformers' GptOssDecoderLayer (same weights)", ""]
    rows, speed, failed = [], [], False
    length = args.check_tokens
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(length, shape.hidden_size, generator=g, device=device).bfloat16()
    positions = torch.arange(length, device=device)
    for index in (0, 1):
        layer, config = gpt_oss.transformers_layer(model, index)
        rotary = GptOssRotaryEmbedding(config).to(device)
        cos_sin = rotary(x[None], positions[None])
        make_mask = (
            create_sliding_window_causal_mask if shape.is_sliding(index) else create_causal_mask
        )
        mask = make_mask(config, x[None], None, None, positions[None])
        routed = []
        hook = layer.mlp.router.register_forward_hook(functools.partial(_keep_experts, routed))
        with torch.no_grad():
            attn = layer.self_attn(
                hidden_states=layer.input_layernorm(x[None]), attention_mask=mask,
                position_embeddings=cos_sin,
            )[0]  # fmt: skip
            mid = (x[None] + attn)[0]
            expected = mid + layer.mlp(layer.post_attention_layernorm(mid[None]))[0][0]
        hook.remove()
        theirs_experts = routed[0]
        # Ours: prefill the first length-1 tokens into a fresh cache, then decode the last one.
        cache = model.new_cache(-(-length // PAGE_SIZE), PAGE_SIZE)
        cos, sin = gpt_oss.rope_cos_sin(model.inv_freq, model.rope_scaling, positions)
        batch, _ = prefill_batch([length - 1], PAGE_SIZE, cache.k[0].shape[0], device)
        ours_mid = [model.attention_block(index, x[:-1], cos[:-1], sin[:-1], cache, batch)]
        batch, _ = decode_batch([length - 1], PAGE_SIZE, cache.k[0].shape[0], device)
        ours_mid.append(model.attention_block(index, x[-1:], cos[-1:], sin[-1:], cache, batch))
        ours_mid = torch.cat(ours_mid)
        prefill, decode, every = slice(0, length - 1), slice(length - 1, length), slice(None)
        kind = "sliding" if shape.is_sliding(index) else "full"
        whole = model.moe_block(index, ours_mid)
        # (block, phase, rows, ours on those rows, transformers, residual input, router input)
        cases = (
            ("attention", "prefill", prefill, ours_mid[prefill], mid, x, None),
            ("attention", "decode", decode, ours_mid[decode], mid, x, None),
            # transformers' attention output into our MoE block: M = length and M = 1.
            ("moe", f"M={length}", every, model.moe_block(index, mid), expected, mid, mid),
            ("moe", "M=1", decode, model.moe_block(index, mid[decode]), expected, mid, mid),
            ("layer", "prefill", prefill, whole[prefill], expected, x, ours_mid),
            ("layer", "decode", decode, whole[decode], expected, x, ours_mid),
        )
        for block, phase, sl, ours, ref, residual, router_input in cases:
            ref, residual = ref[sl].float(), residual[sl].float()
            same = torch.ones(ours.shape[0], dtype=torch.bool, device=device)
            if router_input is not None:
                same = _same_experts(model, index, router_input[sl], theirs_experts[sl])
            flips = int((~same).sum())
            err = ours.float()[same] - ref[same]
            rel = (err.norm() / (ref[same] - residual[same]).norm()).item()
            ok = rel < REL_TOLERANCE and flips <= FLIP_SHARE * ours.shape[0]
            failed |= not ok
            rows.append(
                [index, kind, block, phase, int(same.sum()), flips,
                 f"{err.abs().max().item():.4f}", f"{rel:.2e}", "ok" if ok else "FAIL"]
            )  # fmt: skip
            print(" | ".join(map(str, rows[-1])), flush=True)
        if device.type == "cuda":
            try:
                speed += _speed_rows(model, index, layer, config, args)
            except Exception as exc:  # the numerics above still stand; say what failed
                print(f"speed comparison failed: {exc!r}", flush=True)
                speed.append([index, "failed", repr(exc)[:120], "-", "-"])
        del layer
        torch.cuda.empty_cache() if device.type == "cuda" else None
    lines += [
        f"Input: {length} random tokens' hidden states (N(0,1), bf16); ours prefills the first "
        f"{length - 1} into a paged cache and decodes the last. Blocks: attention = x + "
        "attention(norm(x)); moe = transformers' attention output plus our MoE block on it (the "
        "same router input on both sides); layer = both of ours. Error = ours - transformers "
        "over the rows whose top-k experts agree (`flipped`: rows whose experts differ, at most "
        f"{FLIP_SHARE:.0%}); relative = |error| / |transformers' block output| (the output "
        "minus the block's residual input).",
        "",
    ]
    header = ["layer", "attention", "block", "phase", "compared", "flipped", "max abs error"]
    lines += record.table([*header, "relative", f"< {REL_TOLERANCE}"], rows)
    if speed:
        lines += ["", "Time of one layer (ms), same weights:", ""]
        lines += record.table(
            ["layer", "case", "ours", "transformers", "transformers / ours"], speed
        )
    return lines, failed


def _keep_experts(into, _module, _args, out):
    """Forward hook of transformers' router: keep its expert ids [T, k]."""
    into.append(out[2])


def _same_experts(model, index, router_input, theirs):
    """[T] bool: our top-k experts for router_input [T, H] are transformers' `theirs` [T, k]."""
    _, logits = model.moe_inputs(index, router_input)
    ours = torch.topk(logits.float(), theirs.shape[-1], dim=-1).indices
    return (ours.sort(-1).values == theirs.sort(-1).values).all(-1)


def _speed_rows(model, index, layer, config, args):
    from transformers import DynamicCache
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    device, shape = model.device, model.shape
    layer.mlp.experts.config._experts_implementation = "grouped_mm"
    rotary = GptOssRotaryEmbedding(config).to(device)
    make_mask = create_sliding_window_causal_mask if shape.is_sliding(index) else create_causal_mask
    rows = []
    # Prefill 1 x 1024.
    length = 1024
    x = torch.randn(length, shape.hidden_size, device=device).bfloat16()
    positions = torch.arange(length, device=device)
    cos, sin = gpt_oss.rope_cos_sin(model.inv_freq, model.rope_scaling, positions)
    cache = model.new_cache(length // PAGE_SIZE, PAGE_SIZE)
    batch, _ = prefill_batch([length], PAGE_SIZE, length // PAGE_SIZE, device)
    ours = time_ms(lambda: model.layer_forward(index, x, cos, sin, cache, batch), device)
    cos_sin = rotary(x[None], positions[None])
    mask = make_mask(config, x[None], None, None, positions[None])
    with torch.no_grad():
        theirs = time_ms(
            lambda: layer(x[None], attention_mask=mask, position_embeddings=cos_sin), device
        )
    rows.append(
        [index, f"prefill 1 x {length}", f"{ours:.3f}", f"{theirs:.3f}", f"{theirs / ours:.2f}"]
    )
    # Decode B=16 over 1024 cached tokens.
    bsz, ctx = 16, 1024
    kv = torch.randn(bsz, shape.num_kv_heads, ctx, shape.head_dim, device=device).bfloat16()
    hf_cache = DynamicCache(config=config)
    hf_cache.update(kv, kv.clone(), index)
    xd = torch.randn(bsz, 1, shape.hidden_size, device=device).bfloat16()
    pos = torch.full((bsz, 1), ctx, device=device)
    cos_sin = rotary(xd, pos)
    mask = make_mask(config, xd, None, hf_cache, pos)

    cached = hf_cache.layers[index]
    kept = (cached.keys, cached.values)

    def theirs_step():  # every call sees the same context: the appended token is dropped
        out = layer(xd, attention_mask=mask, position_embeddings=cos_sin, past_key_values=hf_cache)
        cached.keys, cached.values = kept
        return out

    with torch.no_grad():
        theirs = time_ms(theirs_step, device)
    pages_per_seq = -(-(ctx + 1) // PAGE_SIZE)
    cache = random_cache(model.truncated(index + 1), bsz * pages_per_seq)
    batch, positions = decode_batch([ctx] * bsz, PAGE_SIZE, pages_per_seq, device)
    cos, sin = gpt_oss.rope_cos_sin(model.inv_freq, model.rope_scaling, positions)
    xd2 = xd[:, 0].contiguous()
    step = lambda: model.layer_forward(index, xd2, cos, sin, cache, batch)  # noqa: E731
    ours = time_ms(step, device)
    ours_graph = graph_ms(step, device)
    rows.append(
        [
            index,
            f"decode B={bsz} ctx {ctx} (eager)",
            f"{ours:.3f}",
            f"{theirs:.3f}",
            f"{theirs / ours:.2f}",
        ]
    )
    rows.append(
        [
            index,
            f"decode B={bsz} ctx {ctx} (ours graph)",
            f"{ours_graph:.3f}",
            f"{theirs:.3f}",
            f"{theirs / ours_graph:.2f}",
        ]
    )
    for r in rows:
        print(r, flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("gpt-oss-120b", "gpt-oss-20b"), default="gpt-oss-120b")
    parser.add_argument("--layers", type=int, default=4, help="layers built and measured")
    parser.add_argument("--context", type=int, default=2048, help="cached tokens at decode")
    parser.add_argument(
        "--prefill", type=lambda s: [int(v) for v in s.split(",")], default=[1024, 8192]
    )
    parser.add_argument(
        "--decode", type=lambda s: [int(v) for v in s.split(",")], default=[1, 16, 64]
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--check", action="store_true", help="also check layers 0/1 against transformers"
    )
    parser.add_argument("--check-tokens", type=int, default=300)
    parser.add_argument("--tiny", action="store_true", help="CPU-sized shapes, reference kernels")
    record.add_record_argument(parser)
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    preset = PRESETS["tiny" if args.tiny else args.model]
    depth = preset.num_layers
    if args.tiny:
        args.layers, args.prefill, args.decode, args.context = 2, [24], [1, 3], 20
        args.reps, args.check_tokens = 1, 20
    shape = type(preset)(**{**preset.__dict__, "num_layers": args.layers})
    start = time.perf_counter()
    model = GptOssModel(shape, device=device, max_num_tokens=max(8192, *args.prefill))
    _sync(device)
    built = time.perf_counter() - start
    print(f"built {args.layers} layers in {built:.1f} s; {model.moe_plan}", flush=True)
    rows = measure(model, depth, args)

    name = "tiny" if args.tiny else args.model
    title = f"GPT-OSS end to end ({name} shapes), {record.device_name()}"
    lines = record.header(
        title, record.device_name(), {"transformers": record.package_version("transformers")}
    )
    lines += [
        f"{args.layers} of {depth} layers built (random weights, MXFP4 experts, "
        f"{shape.num_experts} experts top-{shape.top_k}), embedding and head included; paged KV "
        f"cache, page {PAGE_SIZE}. Per-layer ms = (stack - head alone) / {args.layers}; "
        f"full-depth tokens/s projects head + {depth} x per-layer (graph times where given).",
        f"MoE plan: {model.moe_plan}",
        "",
    ]
    columns = [
        "phase",
        "case",
        "eager ms",
        "graph ms",
        "per-layer ms",
        f"tokens/s ({args.layers} layers)",
        f"tokens/s ({depth} layers, projected)",
    ]
    lines += record.table(columns, rows)
    failed = False
    if args.check:
        check_lines, failed = check(model, args)
        lines += check_lines
    if args.tiny:
        print("\n".join(lines))
    else:
        record.write("gpt_oss_e2e", lines, device=record.device_name(), record=not args.no_record)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
