"""GPT-OSS-120B's MoE and attention sharded across N GPUs the way vLLM shards them, each rank
through the public ops, summed or gathered with torch.distributed (NCCL), checked against one
GPU running the unsharded layer; per-rank times beside the one-GPU time in
benchmarks/results/multi_gpu_x<N>_<gpu>.md (one file per GPU count).

1. MoE tensor parallel: every rank holds all 128 experts with I = 2880 split N ways
   (`tensor_parallel_shard`: whole 32-element scale groups, vLLM's split), calls moe_apply on
   its shard; an all-reduce (bf16, as an engine's) sums the ranks. M = 1, 64, 1024.
2. MoE expert parallel: 128 / N experts per rank (`expert_parallel_shard`, global ids),
   every rank routes all tokens, computes its experts' share; all-reduce.
3. Attention tensor parallel by heads: 64 / N query heads and 8 / N KV heads per rank (where
   N divides 8), sinks, full and sliding-window (127) layers: decode over a paged cache
   written with kvcache_store, and ragged prefill; the ranks' heads all-gathered.
4. Times: each rank's own op, and with its collective, beside the one-GPU op.

Attention checks compare with the one-GPU result under the bf16 tolerance of
tokenspeed_kernel.testing. An MoE check holds two: each rank's own output against the reference
kernel on that rank's shard (the bf16 tolerance: the kernel contract), and the ranks' bf16
partials summed against the one-GPU output within the partials' rounding (`sum_allowance`),
both the float32 sum and the engine's bf16 all-reduce. The script exits 1 if any check fails.

    torchrun --nproc-per-node 2 benchmarks/multi_gpu_gpt_oss.py [--sizes 1,64,1024] [--no-record]
    torchrun --nproc-per-node 2 benchmarks/multi_gpu_gpt_oss.py --backend gloo --device cpu --tiny

NVLink multicast stays off (NCCL_NVLS_ENABLE=0, set before the process group starts):
multicast can take the host's shared GPUs out of service. `--tiny` runs the same logic at
small shapes (on CPU: the reference kernels) and never writes the results file; `--corrupt`
damages one rank's shard on purpose, to show the checks fail.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass
from functools import partial

import record
import torch
import torch.distributed as dist

import tokenspeed_kernel as tk
from tokenspeed_kernel.registry import get_kernel
from tokenspeed_kernel.testing import Comparison, compare, moe_plan_for, tolerance


@dataclass(frozen=True)
class Shapes:
    experts: int
    top_k: int
    hidden: int
    intermediate: int
    q_heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    decode_lens: tuple[int, ...]  # one sequence per entry, its cached length
    prefill_lens: tuple[int, ...]


GPT_OSS_120B = Shapes(128, 4, 2880, 2880, 64, 8, 64, 16, tuple(
    [2048, 777, 130, 1] * 16), (1024, 1024, 513, 127))  # fmt: skip
TINY = Shapes(8, 2, 64, 96, 8, 2, 64, 16, (40, 150, 1), (5, 130))
WINDOW = 127  # GPT-OSS's sliding_window = 128


@dataclass
class Context:
    args: argparse.Namespace
    shapes: Shapes
    rank: int
    world: int
    device: torch.device
    gen: torch.Generator
    failures: list[str]
    # (check, size, shard, ok, max abs error, this rank's op ms, with its collective, 1 GPU ms)
    rows: list[tuple]


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="small shapes (CPU CI)")
    parser.add_argument("--sizes", default="1,64,1024", help="MoE token counts")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per measurement")
    parser.add_argument(
        "--corrupt",
        type=corruptions,
        default=frozenset(),
        help="comma list of tp, ep, attention: damage the last rank's shard of each on purpose "
        "(those checks must then fail)",
    )
    parser.add_argument("--no-record", action="store_true", help="do not write the results")
    return parser.parse_args(argv)


def corruptions(text: str) -> frozenset[str]:
    kinds = frozenset(k for k in text.split(",") if k)
    unknown = kinds - {"tp", "ep", "attention"}
    if unknown:
        raise argparse.ArgumentTypeError(
            f"--corrupt: {', '.join(sorted(unknown))}, expected tp, ep or attention"
        )
    return kinds


def init(args) -> Context:
    # Before the process group exists: NCCL reads it when its communicators start.
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    shapes = TINY if args.tiny else GPT_OSS_120B
    gen = torch.Generator(device=device).manual_seed(0)
    return Context(args, shapes, rank, world, device, gen, [], [])


def shared(ctx: Context, make) -> torch.Tensor:
    """A tensor made on rank 0 and broadcast: every rank holds the same values."""
    t = make() if ctx.rank == 0 else None
    meta = [None if t is None else (tuple(t.shape), t.dtype)]
    dist.broadcast_object_list(meta, src=0)
    shape, dtype = meta[0]
    if t is None:
        t = torch.empty(shape, dtype=dtype, device=ctx.device)
    # Collectives move bytes: uint8 views carry any dtype (gloo has no fp8 or uint8 issue).
    dist.broadcast(t.view(torch.uint8) if t.dtype.itemsize == 1 else t, src=0)
    return t


def randn(ctx: Context, *shape, gain=1.0, dtype=torch.float32):
    """Random values from rank 0's generator (call inside `shared`)."""
    return (gain * torch.randn(*shape, generator=ctx.gen, device=ctx.device)).to(dtype)


def moe_layer(ctx: Context) -> tuple[tk.MoEConfig, tk.MoEWeights]:
    """GPT-OSS MXFP4 experts: random e2m1 codes, e8m0 scales aimed at entries ~1/sqrt(K)."""
    s = ctx.shapes
    E, H, I = s.experts, s.hidden, s.intermediate  # noqa: E741
    u8 = dict(generator=ctx.gen, device=ctx.device, dtype=torch.uint8)

    def mx(rows, cols):
        center = round(127 + math.log2(1 / (2.9 * math.sqrt(cols))))
        codes = lambda: torch.randint(0, 256, (E, rows, cols // 2), **u8)  # noqa: E731
        scales = lambda: torch.randint(center - 1, center + 2, (E, rows, cols // 32), **u8)  # noqa: E731
        return shared(ctx, codes), shared(ctx, scales)

    w13, s13 = mx(2 * I, H)
    w2, s2 = mx(H, I)
    weights = tk.MoEWeights(
        w13=w13,
        w2=w2,
        w13_scale=s13,
        w2_scale=s2,
        w13_bias=shared(ctx, lambda: randn(ctx, E, 2 * I, gain=0.5)),
        w2_bias=shared(ctx, lambda: randn(ctx, E, H, gain=0.5)),
    )
    return tk.MoEConfig(E, s.top_k, H, I), weights


def prepare(ctx: Context, config, weights, max_tokens: int):
    plan = tk.moe_plan(config, device=ctx.device, max_num_tokens=max_tokens)
    return plan, tk.moe_prepare_weights(plan, weights)


def reference_fn(ctx: Context, config, weights, max_tokens: int):
    """The reference kernel on these (shard) weights: a function (x, logits) -> out."""
    spec = get_kernel("moe_apply", "reference.moe_apply")
    plan = moe_plan_for(spec, config, max_tokens, ctx.device)
    prepared = spec.fn.prepare_weights(plan, weights)

    def apply(x, logits):
        out = torch.empty_like(x)
        spec.fn.apply(plan, x, prepared, router_logits=logits, out=out)
        return out

    return apply


def corrupt_shard(ctx: Context, kind: str, config, weights):
    """--corrupt: the last rank keeps a w2 bias (TP: the sum adds it twice) or takes its
    neighbour's expert ids (EP: its weights meet the wrong tokens)."""
    if kind not in ctx.args.corrupt or ctx.rank != ctx.world - 1:
        return config, weights
    if kind == "tp":
        bias = torch.ones_like(weights.w2_bias)
        return config, tk.MoEWeights(**{**vars(weights), "w2_bias": bias})
    offset = config.expert_offset - 1 if config.expert_offset else config.expert_offset + 1
    offset = min(offset, config.num_experts - config.num_local_experts)
    return tk.MoEConfig(**{**vars(config), "expert_offset": offset}), weights


def elapsed_ms(ctx: Context, fn, *, iters: int) -> float:
    """Mean ms per call: warm-up, then `iters` back-to-back calls. Every rank runs the same
    number of calls (fn may hold a collective)."""
    for _ in range(3):
        fn()
    cuda = ctx.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(ctx.device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if cuda:
        torch.cuda.synchronize(ctx.device)
    return (time.perf_counter() - start) * 1e3 / iters


def check(ctx: Context, what: tuple, results: list[Comparison], times) -> None:
    """what = (check, size, shard); results: this rank's comparisons, the last the one whose
    max abs error the table shows. The ranks agree on the verdict."""
    failed = [r for r in results if not r.ok]
    verdict = torch.tensor([1.0 if failed else 0.0], device=ctx.device)
    dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
    ok = verdict.item() == 0.0
    ctx.failures += [f"rank {ctx.rank}: {r}" for r in failed]
    ctx.rows.append((*what, ok, results[-1].max_abs, *times))


def half_step(t: torch.Tensor) -> torch.Tensor:
    """Half a bf16 ulp of each value (float32): 2^(floor(log2|t|) - 8), 0 at 0."""
    t = t.float()
    _, exponent = torch.frexp(t)  # |t| = m 2^exponent, m in [0.5, 1)
    return torch.where(t == 0, 0.0, torch.ldexp(torch.ones_like(t), exponent - 9))


def sum_allowance(want: torch.Tensor, rounding: torch.Tensor) -> torch.Tensor:
    """Bound on |sum of the ranks' bf16 partials - one GPU's output|, `rounding` = sum over the
    ranks of half_step(partial). Sharding regroups exact sums (TP: GEMM2's over I, w2's bias
    on one rank; EP: the top-k pairs'), so before rounding the two differ by float32 order
    only, inside atol + rtol |want|; each rank's rounding moves its partial by at most its half
    step (the rounded value's bounds it: rounding never drops a binade), the one GPU's by
    half_step(want). Where the partials cancel, their half steps exceed any tolerance on
    |want| (tests/triton/test_moe_parallel.py derives and tests the same bound)."""
    tol = tolerance(torch.bfloat16)
    want = want.float()
    return tol.atol + tol.rtol * want.abs() + rounding + half_step(want)


def within(name: str, got: torch.Tensor, want: torch.Tensor, allowance) -> Comparison:
    """|got - want| <= allowance everywhere (float64 on the CPU), as a Comparison."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    err = (got - want).abs().nan_to_num(nan=math.inf)
    excess = err - allowance.double().cpu()
    flat = int(excess.reshape(-1).argmax())
    at = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), err.shape))
    bad = int((excess > 0).sum())
    message = (
        f"{bad}/{err.numel()} outside the sum allowance; max abs {float(err.max()):.3e}; "
        f"worst at {at}: got {float(got[at]):.6g}, expected {float(want[at]):.6g}, "
        f"allowance {float(allowance[at]):.3e}"
    )
    return Comparison(
        name,
        ok=bad == 0,
        max_abs=float(err.max()),
        max_rel=math.nan,
        rms=float(err.pow(2).mean().sqrt()),
        worst_index=at,
        actual=float(got[at]),
        expected=float(want[at]),
        num_bad=bad,
        numel=err.numel(),
        message=message,
    )


def moe_sizes(ctx: Context) -> list[int]:
    return [1, 7, 33] if ctx.args.tiny else [int(m) for m in ctx.args.sizes.split(",")]


def run_moe(ctx: Context) -> None:
    """Items 1, 2 and their times: TP and EP shards, all-reduced, against one GPU."""
    config, weights = moe_layer(ctx)
    sizes = moe_sizes(ctx)
    full = prepare(ctx, config, weights, max(sizes))
    split = dict(rank=ctx.rank, world_size=ctx.world)
    shards = {
        "moe-tp": corrupt_shard(ctx, "tp", *tk.tensor_parallel_shard(config, weights, **split)),
        "moe-ep": corrupt_shard(ctx, "ep", *tk.expert_parallel_shard(config, weights, **split)),
    }
    del weights
    prepared = {name: prepare(ctx, c, w, max(sizes)) for name, (c, w) in shards.items()}
    # The reference on the very shard this rank runs (a damaged one included: a damaged shard
    # still matches it, only the sum can show the damage).
    references = {name: reference_fn(ctx, c, w, max(sizes)) for name, (c, w) in shards.items()}
    del shards
    for m in sizes:
        x = shared(ctx, lambda m=m: randn(ctx, m, config.hidden_size, dtype=torch.bfloat16))
        logits = shared(ctx, lambda m=m: randn(ctx, m, config.num_experts))
        want = tk.moe_apply(full[0], x, full[1], logits)
        one_gpu = elapsed_ms(
            ctx, partial(tk.moe_apply, full[0], x, full[1], logits), iters=ctx.args.iters
        )
        for name, layer in prepared.items():
            what = (name, f"M={m}", shard_label(name, layer[0].config))
            shard_ref = references[name](x, logits)
            check_moe_shard(ctx, what, layer, x, logits, (shard_ref, want), one_gpu)


def check_moe_shard(ctx: Context, what: tuple, layer, x, logits, wants, one_gpu: float) -> None:
    """This rank's shard on x against the reference on that shard; the ranks' partials summed
    (float32, and the engine's bf16 all-reduce) against the one-GPU output."""
    plan, shard = layer
    shard_ref, want = wants
    out = torch.empty_like(x)

    def own():
        tk.moe_apply(plan, x, shard, logits, out=out)

    def summed():
        own()
        dist.all_reduce(out)

    own()
    partial = out.clone()
    # One float32 all-reduce carries the sum, the ranks' half steps and sum |partial|.
    stats = torch.stack([partial.float(), half_step(partial), partial.float().abs()])
    dist.all_reduce(stats)
    total, rounding, magnitude = stats
    allowance = sum_allowance(want, rounding)
    summed()
    reduced = out.clone()
    # A bf16 all-reduce rounds each of its world - 1 running sums (in an order the collective
    # picks); every running sum is at most sum |partial| in size, plus the earlier roundings'
    # (world - 1) 2^-9 relative, under 2^-6 for 8 ranks.
    reduce_rounding = (ctx.world - 1) * half_step(magnitude * (1 + 2**-6))
    label = " ".join(what[:2])
    results = [
        compare(partial, shard_ref, dtype=torch.bfloat16, name=f"{label} own shard"),
        within(f"{label} float32 sum", total, want, allowance),
        within(f"{label} bf16 all-reduce", reduced, want, allowance + reduce_rounding),
    ]
    iters = ctx.args.iters
    times = (elapsed_ms(ctx, own, iters=iters), elapsed_ms(ctx, summed, iters=iters))
    check(ctx, what, results, (*times, one_gpu))


def shard_label(name: str, config: tk.MoEConfig) -> str:
    if name == "moe-ep":
        last = config.expert_offset + config.num_local_experts - 1
        return f"experts {config.expert_offset}..{last}"
    return f"I {config.intermediate_size}"


def head_slices(ctx: Context) -> tuple[slice, slice]:
    """This rank's query and KV heads (contiguous blocks, each KV head with its query group)."""
    s = ctx.shapes
    hq, hkv = s.q_heads // ctx.world, s.kv_heads // ctx.world
    return (
        slice(ctx.rank * hq, (ctx.rank + 1) * hq),
        slice(ctx.rank * hkv, (ctx.rank + 1) * hkv),
    )


def shard_q(ctx: Context, q: torch.Tensor, sinks: torch.Tensor, heads: slice):
    """This rank's query heads and sinks; --corrupt attention: the last rank's in reverse."""
    q, sinks = q[..., heads, :], sinks[heads]
    if "attention" in ctx.args.corrupt and ctx.rank == ctx.world - 1:
        q, sinks = q.flip(-2), sinks.flip(0)
    return q.contiguous(), sinks.contiguous()


def prefill_ops(ctx: Context, window: int, sinks: torch.Tensor):
    """(one-GPU prefill, this rank's) over the same ragged batch."""
    s, bf16 = ctx.shapes, torch.bfloat16
    lens = s.prefill_lens
    T = sum(lens)
    q = shared(ctx, lambda: randn(ctx, T, s.q_heads, s.head_dim, dtype=bf16))
    k = shared(ctx, lambda: randn(ctx, T, s.kv_heads, s.head_dim, dtype=bf16))
    v = shared(ctx, lambda: randn(ctx, T, s.kv_heads, s.head_dim, dtype=bf16))
    offsets = torch.tensor([0, *lens], dtype=torch.int64).cumsum(0)
    opts = dict(
        cu_seqlens=offsets.to(torch.int32).to(ctx.device), max_seqlen=max(lens), window_left=window
    )
    q_heads, kv_heads = head_slices(ctx)
    q_r, sinks_r = shard_q(ctx, q, sinks, q_heads)
    k_r, v_r = k[:, kv_heads].contiguous(), v[:, kv_heads].contiguous()
    return (
        lambda: tk.mha_prefill(q, k, v, sinks=sinks, **opts),
        lambda: tk.mha_prefill(q_r, k_r, v_r, sinks=sinks_r, **opts),
    )


def paged_cache(ctx: Context, heads: slice | None, k: torch.Tensor, v: torch.Tensor, slots):
    """Caches [pages, P, heads, D] written through kvcache_store (all heads when None)."""
    s = ctx.shapes
    if heads is not None:
        k, v = k[:, heads].contiguous(), v[:, heads].contiguous()
    pages = sum(-(-n // s.page_size) for n in s.decode_lens)
    shape = (pages, s.page_size, k.shape[1], s.head_dim)
    k_cache = torch.zeros(shape, dtype=k.dtype, device=ctx.device)
    v_cache = torch.zeros_like(k_cache)
    tk.kvcache_store(k, v, k_cache, v_cache, slot_mapping=slots)
    return k_cache, v_cache


def decode_ops(ctx: Context, window: int, sinks: torch.Tensor):
    """(one-GPU decode, this rank's): one new token per sequence over a paged cache."""
    s, bf16, P = ctx.shapes, torch.bfloat16, ctx.shapes.page_size
    lens = s.decode_lens
    page_counts = [-(-n // P) for n in lens]
    page_table = torch.zeros(len(lens), max(page_counts), dtype=torch.int32)
    slots, first = [], 0
    for b, n in enumerate(lens):
        page_table[b, : page_counts[b]] = torch.arange(first, first + page_counts[b])
        slots += [(first + p // P) * P + p % P for p in range(n)]
        first += page_counts[b]
    slots = torch.tensor(slots, dtype=torch.int64, device=ctx.device)
    k = shared(ctx, lambda: randn(ctx, sum(lens), s.kv_heads, s.head_dim, dtype=bf16))
    v = shared(ctx, lambda: randn(ctx, sum(lens), s.kv_heads, s.head_dim, dtype=bf16))
    q = shared(ctx, lambda: randn(ctx, len(lens), s.q_heads, s.head_dim, dtype=bf16))
    q_heads, kv_heads = head_slices(ctx)
    full_cache = paged_cache(ctx, None, k, v, slots)
    own_cache = paged_cache(ctx, kv_heads, k, v, slots)
    q_r, sinks_r = shard_q(ctx, q, sinks, q_heads)
    opts = dict(
        page_table=page_table.to(ctx.device),
        cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=ctx.device),
        window_left=window,
    )
    return (
        lambda: tk.mha_decode_with_kvcache(q, *full_cache, sinks=sinks, **opts),
        lambda: tk.mha_decode_with_kvcache(q_r, *own_cache, sinks=sinks_r, **opts),
    )


def check_heads(ctx: Context, what: tuple, full, own) -> None:
    """Run one-GPU and sharded attention; all-gather the ranks' heads; compare and time."""
    iters = ctx.args.iters
    want = full()
    one_gpu = elapsed_ms(ctx, full, iters=iters)
    parts = [torch.empty_like(own()) for _ in range(ctx.world)]

    def gathered():
        dist.all_gather(parts, own().contiguous())

    gathered()
    got = torch.cat(parts, dim=-2)
    times = (elapsed_ms(ctx, own, iters=iters), elapsed_ms(ctx, gathered, iters=iters))
    result = compare(got, want, dtype=torch.bfloat16, name=" ".join(what[:2]))
    check(ctx, what, [result], (*times, one_gpu))


def run_attention(ctx: Context) -> None:
    """Item 3 and its times: heads split N ways, decode and prefill, full and sliding layers."""
    s = ctx.shapes
    if s.kv_heads % ctx.world:
        print(f"attention skipped: {s.kv_heads} KV heads do not split {ctx.world} ways")
        return
    sinks = shared(ctx, lambda: randn(ctx, s.q_heads))
    q_heads, kv_heads = head_slices(ctx)
    shard = f"q {q_heads.start}..{q_heads.stop - 1}, kv {kv_heads.start}..{kv_heads.stop - 1}"
    for window in (-1, WINDOW):
        layer = "full" if window < 0 else f"window {window}"
        prefill = f"T={sum(s.prefill_lens)} {layer}"
        check_heads(ctx, ("attn-prefill", prefill, shard), *prefill_ops(ctx, window, sinks))
        decode = f"B={len(s.decode_lens)} {layer}"
        check_heads(ctx, ("attn-decode", decode, shard), *decode_ops(ctx, window, sinks))


def report(ctx: Context) -> None:
    """Rank 0 writes every rank's rows: one line per check, a column per rank."""
    rows = [None] * ctx.world
    dist.all_gather_object(rows, ctx.rows)
    failures = [None] * ctx.world
    dist.all_gather_object(failures, ctx.failures)
    if ctx.rank != 0:
        return
    columns = ["check", "size", "ok", "max abs err", "1 GPU ms"]
    columns += [f"rank {r}: shard, op ms / with collective" for r in range(ctx.world)]
    table = []
    for i, (name, size, _, ok, _, _, _, one_gpu) in enumerate(rows[0]):
        worst = max(ranks[i][4] for ranks in rows)
        cells = [f"{r[i][2]}: {r[i][5]:.3f} / {r[i][6]:.3f}" for r in rows]
        table.append([name, size, "yes" if ok else "NO", f"{worst:.2e}", f"{one_gpu:.3f}", *cells])
    name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
    device = f"{ctx.world} x {name}, {ctx.args.backend}"
    lines = notes(ctx) + record.table(columns, table)
    lines += [f"- FAILED {message}" for messages in failures for message in messages]
    if ctx.args.tiny or ctx.args.no_record:
        print("\n".join(lines))
    else:
        title = f"GPT-OSS-120B MoE and attention over {ctx.world} GPUs against one"
        record.write(f"multi_gpu_x{ctx.world}", record.header(title, device) + lines, device=device)


def notes(ctx: Context) -> list[str]:
    s = ctx.shapes
    return [
        f"MoE: E {s.experts} top-{s.top_k}, H {s.hidden}, I {s.intermediate}, MXFP4 weights, "
        "bias; TP shards split I in whole 32-element scale groups (vLLM's split), w2 bias on "
        "rank 0; EP ranks hold contiguous expert blocks, ids global; outputs all-reduced in "
        "bf16. Attention: "
        f"{s.q_heads} query / {s.kv_heads} KV heads, D {s.head_dim}, sinks, page {s.page_size};"
        " each rank's heads all-gathered. Attention checked against the one-GPU output under the "
        "bf16 tolerance, |err| <= 1e-2 + 1.6e-2 |expected|; MoE: each rank's output against "
        "the reference on its shard under that tolerance, and the sum of the ranks' bf16 "
        "partials (float32, and the bf16 all-reduce) against one GPU within 1e-2 + 1.6e-2 "
        "|expected| + half a bf16 step of each partial and of the expected value (+ world - 1 "
        "half steps of sum |partial| for the bf16 all-reduce's running sums). Max abs err: the "
        "worst rank's (MoE: the bf16 all-reduce's). "
        f"Times: eager, wall clock per call, mean of {ctx.args.iters} calls after 3 warm-up, "
        "launch overhead included; `op` is the rank's own call, `with collective` adds its "
        "all-reduce / all-gather.",
        "",
    ]


def main(argv=None) -> int:
    args = parse(argv)
    ctx = init(args)
    try:
        run_moe(ctx)
        run_attention(ctx)
        report(ctx)
    finally:
        dist.destroy_process_group()
    failed = [row for row in ctx.rows if not row[3]]
    if failed and ctx.rank == 0:
        print(f"{len(failed)} of {len(ctx.rows)} checks FAILED", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
