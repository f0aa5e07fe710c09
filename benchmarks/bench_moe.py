"""moe_apply on GPT-OSS-120B shapes (E=128, top-4, H=I=2880, MXFP4 weights with e8m0 scales),
or with --model gpt-oss-20b on its 32 experts, side by side with vLLM 0.26's own GPT-OSS MoE on
Hopper (peer:vllm.triton_kernels, OpenAI's triton_kernels as vLLM vendors it;
tokenspeed_kernel/tools/peers.py), and optionally each Triton kernel variant; rewrites the
model's section of benchmarks/results/moe_<gpu>.md.

Floors and ceilings are measured in the same run:
- decode (small M) is bound by reading the distinct selected experts' weights once
  (W13 8.81 MB + W2 4.41 MB per expert, scales included, unpadded): floor = bytes / the
  device-to-device copy bandwidth (torch copy_, bytes read + written);
- prefill (large M) is bound by matmul throughput: M*k*2*(H*2I + I*H) FLOPs against the bf16
  dense rate of torch.matmul 8192^3.

The side-by-side table needs triton_kernels importable (vLLM's vendored copy on PYTHONPATH:
`pip download --no-deps vllm==0.26.0`, unzip, vllm/third_party/triton_kernels); without it the
peer's columns say why. Before timing, both are checked on the same weights (M = 1, 64, 1024)
and the run stops if either is off: ours against the core reference (bf16 tolerance); the peer,
which rounds where the reference does not (bf16 SwiGLU intermediate, bf16 per-expert outputs
before the top-k sum) and so misses it by more than that tolerance, against an emulation of its
own rounding (tools/peers.py `compare_to_emulation`). Each side's error against the reference
is recorded.

    PYTHONPATH=.carry/peers python3 benchmarks/bench_moe.py [--model gpt-oss-20b] [--sizes 1,4]
        [--no-peer] [--variants sm90,portable-bf16,...] [--sweep] [--profile] [--no-record]
"""

from __future__ import annotations

import argparse
import sys
import time

import energy
import record
import torch
from triton.testing import do_bench, do_bench_cudagraph

from tokenspeed_kernel import (
    expert_parallel_shard,
    moe_plan,
    moe_prepare_weights,
    tensor_parallel_shard,
)
from tokenspeed_kernel.ops.moe.types import MoEConfig, MoEWeights
from tokenspeed_kernel.presets import get_preset
from tokenspeed_kernel.registry import get_kernel
from tokenspeed_kernel.testing import compare, moe_plan_for, tolerance
from tokenspeed_kernel.tools import peers
from tokenspeed_kernel.tuning import pin_config
from tokenspeed_kernel_triton.moe import moe, moe_sm90
from tokenspeed_kernel_triton.moe.fragment_config_sm90 import FragmentConfig
from tokenspeed_kernel_triton.moe.layout import prepare_weights
from tokenspeed_kernel_triton.moe.moe import MoETileConfig

# The GPT-OSS models share every MoE shape but their experts' count (tokenspeed_kernel.presets);
# use_model switches E, CONFIG and the shard tables' degrees between them: each model's tensor-
# and expert-parallel degree as it is served on several GPUs (120B on 8, 20B on 2).
MODELS = {"gpt-oss-120b": ("GPT-OSS-120B", 8), "gpt-oss-20b": ("GPT-OSS-20B", 2)}
MODEL = "gpt-oss-120b"
E, TOP_K, H, I = 128, 4, 2880, 2880  # noqa: E741
TP = EP = 8


def expert_bytes(intermediate: int) -> int:
    """One expert's MXFP4 weights and scales (unpadded) at `intermediate` channels."""
    return (2 * intermediate * H // 2 + 2 * intermediate * H // 32) + (
        H * intermediate // 2 + H * intermediate // 32
    )


EXPERT_BYTES = expert_bytes(I)


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300)
    return 2 * src.numel() / (ms * 1e-3)


def bf16_matmul_rate() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: torch.matmul(a, b), warmup=50, rep=300)
    return 2 * 8192**3 / (ms * 1e-3)


def checkpoint_weights() -> MoEWeights:
    """GPT-OSS checkpoint-layout weights of E experts: random e2m1 codes, e8m0 scales 119..121
    (entries near 1/sqrt(2880)), fp32 biases (1.7 GB on the GPU at E=128)."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def mx(rows, cols):
        u8 = dict(generator=g, device="cuda", dtype=torch.uint8)
        return (
            torch.randint(0, 256, (E, rows, cols // 2), **u8),
            torch.randint(119, 122, (E, rows, cols // 32), **u8),
        )

    w13, s13 = mx(2 * I, H)
    w2, s2 = mx(H, I)
    return MoEWeights(
        w13=w13,
        w2=w2,
        w13_scale=s13,
        w2_scale=s2,
        w13_bias=0.5 * torch.randn(E, 2 * I, generator=g, device="cuda"),
        w2_bias=0.5 * torch.randn(E, H, generator=g, device="cuda"),
    )


def gpt_oss_tensors(static: bool, word_order: str = "natural", **fragment_options):
    w = checkpoint_weights()
    prepared = prepare_weights(
        "mxfp4",
        H,
        I,
        w13=w.w13,
        w2=w.w2,
        w13_scale=w.w13_scale,
        w2_scale=w.w2_scale,
        w13_bias=w.w13_bias,
        w2_bias=w.w2_bias,
        word_order=word_order,
        **fragment_options,
    )
    scales = (3.5 / 448, 24.0 / 448) if static else (None, None)
    return prepared, scales


def weight_copies(prepared: dict, layers: int) -> list[dict]:
    """`layers` distinct copies of the prepared weights, as a model's layers are: run in turn,
    each finds only the other layers' bytes in L2 (the L2 holds 50 MB; one layer reads 53 MB
    at M=1), as in a real forward pass."""
    return [prepared] + [
        {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in prepared.items()}
        for _ in range(layers - 1)
    ]


def token_inputs(m: int, skew: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """M tokens' x [M, H] bf16 and router logits [M, E] (seeded by M), and an output buffer.
    `skew` adds a fixed per-expert bias of that many standard deviations to the logits, so that
    some experts take more tokens than others, as a trained router's do (SKEW: the loads)."""
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, H, generator=g, device="cuda").to(torch.bfloat16)
    logits = torch.randn(m, E, generator=g, device="cuda")
    if skew:
        bias = torch.randn(E, generator=torch.Generator().manual_seed(0)).to("cuda")
        logits += skew * bias
    return x, logits, torch.empty_like(x)


def layer_forward(x, prepared: dict, logits, out, act: str = "bf16", scales=(None, None)):
    """One layer's forward through the kernel its weights were prepared for: fragment word
    order is triton.moe_apply.sm90's layout, natural order triton.moe_apply's."""
    forward = moe_sm90.moe_forward_sm90 if prepared["word_order"] == "fragment" else moe.moe_forward
    forward(
        x,
        prepared,
        top_k=TOP_K,
        out=out,
        router_logits=logits,
        activation_format=act,
        w13_input_scale=scales[0],
        w2_input_scale=scales[1],
    )


def run_case(layers, m, act, scales, *, graph: bool, config=None):
    """Microseconds per layer for M tokens through `layers` (a list of prepared weights, each
    layer's forward in turn), and the number of distinct selected experts."""
    x, logits, out = token_inputs(m)

    def fn():
        for prepared in layers:
            layer_forward(x, prepared, logits, out, act, scales)

    def timed():
        fn()
        ms = do_bench_cudagraph(fn, rep=200) if graph else do_bench(fn, warmup=25, rep=200)
        return ms * 1e3 / len(layers)

    if config is not None:
        kernel = moe_sm90 if isinstance(config, FragmentConfig) else moe
        with pin_config(kernel.KERNEL_NAME, config):
            us = timed()
    else:
        us = timed()
    distinct = int(torch.topk(logits, TOP_K, dim=-1).indices.unique().numel())
    return us, distinct


# ---------------------------------------------------------------- side by side with the peer

# Powers of two and sizes between them (8 and 12 at decode, 384, and from 1024 at prefill):
# tile picks and the peer's own heuristics change with the rows per expert and its token
# count, so a table of powers of two alone flatters. 1664: the peer's time holds flat from
# M=1280 (its 64-row blocks) while ours climbs to within 1% of it (docs/decisions.md).
PEER_SIZES = (
    1, 4, 8, 12, 16, 64, 256, 384, 1024, 1536, 1664, 2048, 3072, 4096, 6144, 7168, 8192
)  # fmt: skip
CHECK_SIZES = (1, 64, 256, 1024)
# Skewed routing (token_inputs' `skew`): 0.25 standard deviations of per-expert bias put the
# busiest expert at about 4.3x the mean load from M = 256 (uniform: 2.1x at M=256, 1.2x at
# 8192) and leave a few experts idle, the imbalance a trained router shows under load; its
# tables run at fewer sizes, one per tile regime.
SKEW = 0.25
SKEW_SIZES = (16, 64, 256, 1024, 3072, 8192)
CONFIG = MoEConfig(E, TOP_K, H, I, weight_format="mxfp4", activation_format="bf16")


def use_model(name: str) -> None:
    """Benchmark `name`'s MoE layer (one of MODELS) from here on: its experts' count E, CONFIG
    and the shard tables' degrees TP and EP."""
    global MODEL, E, CONFIG, TP, EP
    if name not in MODELS:
        raise SystemExit(f"--model: {name!r} is not one of {', '.join(MODELS)}")
    preset = get_preset(name)
    assert (preset.top_k, preset.hidden_size, preset.intermediate_size) == (TOP_K, H, I)
    MODEL, E = name, preset.num_experts
    TP = EP = MODELS[name][1]
    CONFIG = MoEConfig(E, TOP_K, H, I, weight_format="mxfp4", activation_format="bf16")


PEER_COLUMNS = [
    "M",
    "distinct experts",
    "busiest expert",
    "floor µs",
    "ours µs",
    "vLLM µs",
    "vLLM / ours",
]
PEER_COLUMNS += ["ours x floor", "vLLM x floor", "ours % bf16 dense", "vLLM % bf16 dense"]
PEER_COLUMNS += ["ours mJ (W)", "vLLM mJ (W)"]


def check_same_function(
    config: MoEConfig, weights: MoEWeights, plan, ours, peer, skew: float = 0.0
) -> list[str]:
    """Markdown lines: at CHECK_SIZES, ours (moe_apply) against the core reference (bf16
    tolerance) and the peer against the emulation of its rounding (`compare_to_emulation`),
    then each side's, and the emulation's, error against the reference; raises AssertionError
    if either check fails."""
    reference = get_kernel("moe_apply", "reference.moe_apply")
    ref_plan = moe_plan_for(reference, config, max(CHECK_SIZES), "cuda")
    ref_prepared = reference.fn.prepare_weights(ref_plan, weights)  # float32, 12.7 GB unsharded
    t = ref_prepared.tensors
    tol = tolerance(torch.bfloat16)
    lines = [
        "",
        "Same function: ours against the reference within the bf16 tolerance (atol "
        f"{tol.atol:g}, rtol {tol.rtol:g}); vLLM against the reference's math rounded where "
        "vLLM's kernels round (bf16 SwiGLU intermediate, bf16 per-expert outputs), within that "
        "tolerance plus one bf16 step per expert, few elements past the tolerance alone. "
        "Errors against the float32 reference, for the record: ours, vLLM, and vLLM's rounding "
        "alone (emulated).",
        "",
    ]
    failures = []
    for m in CHECK_SIZES:
        x, logits, _ = token_inputs(m, skew)
        expected = torch.empty_like(x)
        reference.fn.apply(ref_plan, x, ref_prepared, router_logits=logits, out=expected)
        got_ours = torch.empty_like(x)
        plan.impl.apply(
            plan, x, ours, router_logits=logits, topk_weights=None, topk_ids=None, out=got_ours
        )
        got_peer = peer(x, logits)
        emulated, steps = peers.triton_kernels_moe_emulation(
            config, x, logits, t["w13"], t["w2"], t["w13_bias"], t["w2_bias"]
        )
        checks = (
            compare(got_ours, expected, dtype=torch.bfloat16, name=f"ours M={m} vs reference"),
            peers.compare_to_emulation(got_peer, emulated, steps, name=f"vLLM M={m}"),
        )
        recorded = [
            compare(out, expected, dtype=torch.bfloat16, name=f"{who} M={m} vs reference")
            for who, out in (("vLLM", got_peer), ("vLLM's rounding (emulated)", emulated))
        ]
        lines += [f"- {c}" for c in (*checks, *recorded)]
        failures += [str(c) for c in checks if not c.ok]
        diff = (got_ours.float() - got_peer.float()).abs()
        lines.append(
            f"- vLLM - ours M={m}: max abs {diff.max():.3e}, rms {diff.pow(2).mean().sqrt():.3e}"
        )
        print(*lines[-5:], sep="\n", flush=True)
    del ref_prepared, t
    torch.cuda.empty_cache()
    if failures:
        raise AssertionError("not the same function: " + "; ".join(failures))
    return lines


def time_layers(fn, layers: int) -> float:
    """Microseconds per layer of `fn` (which runs every layer once), CUDA-graph replayed."""
    fn()
    return do_bench_cudagraph(fn, rep=100) * 1e3 / layers


def expert_loads(logits: torch.Tensor, config: MoEConfig) -> tuple[int, int, int]:
    """(distinct selected experts, the busiest one's tokens, (token, expert) pairs) of router
    logits [M, E], counting `config`'s local experts only."""
    loads = torch.bincount(torch.topk(logits, TOP_K, dim=-1).indices.flatten(), minlength=E)
    local = loads[config.expert_offset : config.expert_offset + config.num_local_experts]
    return int((local > 0).sum()), int(local.max()), int(local.sum())


def layer_forwards(m: int, plan, ours: list, peer_layers: list, skew: float = 0.0):
    """(ours, the peer's, the router logits): functions that run M tokens (token_inputs)
    through each of their layers once, ours as a user calls moe_apply."""
    x, logits, out = token_inputs(m, skew)

    def ours_fn():
        for prepared in ours:
            plan.impl.apply(
                plan, x, prepared, router_logits=logits, topk_weights=None, topk_ids=None, out=out
            )

    def peer_fn():
        for layer in peer_layers:
            layer(x, logits, out)

    return ours_fn, peer_fn, logits


def time_pair(
    m: int, plan, ours: list, peer_layers: list, skew: float = 0.0
) -> tuple[float, float, tuple[int, int, int], list]:
    """(ours µs, the peer's µs or nan, `expert_loads`, the energy cells: [ours, the peer's]
    mJ per layer and mean W, "-" where unmeasured) per layer for M tokens."""
    ours_fn, peer_fn, logits = layer_forwards(m, plan, ours, peer_layers, skew)
    t_ours = time_layers(ours_fn, len(ours))
    t_peer = time_layers(peer_fn, len(peer_layers)) if peer_layers else float("nan")
    cells = []
    for fn, layers in ((ours_fn, ours), (peer_fn, peer_layers)):
        measured = energy.per_call(fn) if layers else None
        cells.append(
            "-" if measured is None else f"{measured[0] / len(layers):.1f} ({measured[1]:.0f})"
        )
    return t_ours, t_peer, expert_loads(logits, plan.config), cells


def peer_side_by_side(args, bw: float, dense: float) -> tuple[str | None, list[str]]:
    """(the peer's origin or None, the section's lines): moe_apply as a user calls it (plan,
    prepare, apply) against peer:vllm.triton_kernels on the same checkpoint weights, each over
    `args.layers` distinct copies in turn: the whole layer, rank 0's shard at TP=8 and at
    EP=8, then the whole layer and the TP=8 shard under skewed routing."""
    sizes = PEER_SIZES if not args.sizes else tuple(int(m) for m in args.sizes.split(","))
    weights = checkpoint_weights()
    shard_config, shard_weights = tensor_parallel_shard(CONFIG, weights, rank=0, world_size=TP)
    ep_config, ep_weights = expert_parallel_shard(CONFIG, weights, rank=0, world_size=EP)
    try:
        origin = peers.triton_kernels_origin()
    except ImportError as exc:
        origin, note = None, f"not importable ({exc})"
    else:
        if torch.cuda.get_device_capability() != (9, 0):
            raise SystemExit("bench_moe: the vLLM peer reproduces the sm_90 path; use --no-peer")
        note = ""
    lines = [
        "ours = `moe_apply` as planned for this GPU (plan, prepare, apply; the kernel is named "
        "under each table); vLLM = peer:vllm.triton_kernels, vLLM 0.26's GPT-OSS MoE on "
        "sm_90 (TRITON MXFP4 backend: OpenAI triton_kernels routing + matmul_ogs with fused "
        "SwiGLU, weights swizzled as vLLM does; tools/peers.py). Both on the same checkpoint "
        "weights and inputs, CUDA-graph replayed over "
        f"{args.layers} layers' distinct weight copies in turn (L2-cold, as in a model); vLLM / "
        "ours > 1: ours is faster. floor = the distinct selected experts' bytes / copy "
        "bandwidth; % bf16 dense for M >= 1024; mJ (W) = energy per layer and mean power over "
        "about a second more of the same replays (NVML's counter; benchmarks/energy.py): "
        "where both run at the GPU's power limit, a layer's time is its energy over it.",
    ]
    shard_title = (
        f"Tensor parallel, TP={TP}: rank 0's shard (I={shard_config.intermediate_size} of "
        f"{I}, `tensor_parallel_shard`), as each of {TP} GPUs runs it before the engine's "
        "all-reduce; the same inputs and routing"
    )
    ep_title = (
        f"Expert parallel, EP={EP}: rank 0's {ep_config.num_local_experts} experts of {E} "
        f"(`expert_parallel_shard`), as each of {EP} GPUs runs them on every token before the "
        "engine's all-reduce, pairs routed to other ranks' experts contributing nothing; the "
        "same inputs and routing. vLLM's path runs as OpenAI's simulated expert parallelism "
        "(`routing(..., simulated_ep)`, keeping rank 0's pairs), where vLLM maps ids through "
        "its expert map first; the matmuls are the same. distinct experts, floor and % bf16 "
        "dense count the local experts' pairs only."
    )
    skewed_sizes = SKEW_SIZES if not args.sizes else sizes
    skewed = (
        f", routed with skew: the same logits plus {SKEW} standard deviations of a fixed "
        "per-expert bias (`token_inputs`), so that a few experts take several times the mean "
        "load (the busiest expert column) and some none."
    )
    sections = (
        ("The whole layer.", CONFIG, weights, sizes, 0.0),
        (shard_title + ".", shard_config, shard_weights, sizes, 0.0),
        (ep_title, ep_config, ep_weights, sizes, 0.0),
        ("The whole layer" + skewed, CONFIG, weights, skewed_sizes, SKEW),
        (shard_title + skewed, shard_config, shard_weights, skewed_sizes, SKEW),
    )
    for title, config, layer_weights, table_sizes, skew in sections:
        if skew and args.no_skew:
            continue
        lines += ["", title, ""]
        lines += side_by_side_table(args, bw, dense, config, layer_weights, table_sizes, note, skew)
        torch.cuda.empty_cache()
    return origin, lines


def side_by_side_row(m, loads, config, times, energy_cells, bw, dense, note: str) -> list:
    """One row of PEER_COLUMNS: `loads` as `expert_loads` gives them, `times` (ours µs, the
    peer's µs or nan). Where no pair is local (an expert-parallel rank at M=1) there is no
    floor and no rate to state."""
    distinct, busiest, pairs = loads
    t_ours, t_peer = times
    i = config.intermediate_size
    floor = distinct * expert_bytes(i) / bw * 1e6
    flops = pairs * 2 * (H * 2 * i + i * H)

    def over_floor(us):
        return f"{us / floor:.2f}" if floor and us == us else "-"

    def pct(us):
        return f"{100 * flops / (us * 1e-6) / dense:.0f}%" if m >= 1024 and us == us else "-"

    peer_cells = [f"{t_peer:.1f}", f"{t_peer / t_ours:.2f}"] if t_peer == t_peer else [note, "-"]
    return (
        [m, distinct, busiest, f"{floor:.1f}" if floor else "-", f"{t_ours:.1f}", *peer_cells]
        + [over_floor(t_ours), over_floor(t_peer), pct(t_ours), pct(t_peer)]
        + energy_cells
    )


def side_by_side_table(
    args, bw, dense, config, weights, sizes, note: str, skew: float = 0.0
) -> list[str]:
    """The table of ours against the peer for one layer shape and routing skew, then the
    same-function lines (`note` says why the peer's columns are empty, "" when it runs)."""
    plan = moe_plan(config, device="cuda", max_num_tokens=max(sizes + CHECK_SIZES))
    ours = [moe_prepare_weights(plan, weights) for _ in range(args.layers)]
    peer_layers = (
        [] if note else [peers.TritonKernelsMoE(config, weights) for _ in range(args.layers)]
    )
    checks = (
        check_same_function(config, weights, plan, ours[0], peer_layers[0], skew)
        if peer_layers
        else []
    )
    rows = []
    for m in sizes:
        t_ours, t_peer, loads, energy_cells = time_pair(m, plan, ours, peer_layers, skew)
        rows.append(
            side_by_side_row(m, loads, config, (t_ours, t_peer), energy_cells, bw, dense, note)
        )
        print(rows[-1], flush=True)
    return record.table(PEER_COLUMNS, rows) + ["", f"ours: {plan.kernel}."] + checks


# Alternative tiles timed by --sweep, per M (the heuristic's pick is among them).
SWEEP = {
    1: [
        MoETileConfig(16, 64, 64, 128, 4, 6),
        MoETileConfig(16, 32, 32, 128, 4, 6),
        MoETileConfig(16, 64, 64, 128, 4, 8),
    ],
    4096: [MoETileConfig(128, 128, 128, 64, 8, 3), MoETileConfig(64, 128, 128, 64, 4, 4)],
    8192: [MoETileConfig(128, 128, 128, 64, 8, 3), MoETileConfig(64, 128, 128, 64, 4, 4)],
}


# The same for triton.moe_apply.sm90: post-scaled decode tiles with the ring two or three
# steps deep, one or two chunks' wgmmas in flight, GEMM2 in 2 to 4 splits waiting for GEMM1's
# grid, or in 2 tile by tile (why the pick wins: docs/decisions.md); at serving batches
# (M = 64: ~2.4 tokens per selected expert; 256: ~8) narrower token tiles than the prefill
# tile's 64, which pads each expert's few tokens to 64 MMA columns, with and without
# programmatic dependent launch and GEMM2's split; from M = 1024 the prefill tiles with and
# without PDL, narrower and wider in tokens or rows, with and without a narrow launch for
# short tiles (narrow_t). Post-scaled and tile-by-tile configs need the one-program router
# (routing.FUSED_MAX_PAIRS), so only up to M = 16.
_POST = dict(block_w=64, block_t=2, num_warps=4, chunks=4, pdl=True, post_scale=True)
FRAGMENT_SWEEP = {
    m: [
        FragmentConfig(**_POST, stages=stages, gemm2_split_k=split, mma_in_flight=in_flight)
        for stages in (2, 3)
        for split in (2, 3, 4)
        for in_flight in (1, 2)
    ]
    + [
        FragmentConfig(**_POST, stages=2, gemm2_split_k=2, mma_in_flight=n, tile_ready=True)
        for n in (1, 2)
    ]
    for m in (1, 4, 16)
}
FRAGMENT_SWEEP[64] = [
    FragmentConfig(64, 8, 4, 3, pdl=True),
    FragmentConfig(64, 8, 4, 4, pdl=True),
    FragmentConfig(64, 8, 4, 3, chunks=2, pdl=True),
    FragmentConfig(64, 8, 4, 3, gemm2_split_k=2, chunks=2, pdl=True),
    FragmentConfig(64, 8, 4, 3, gemm2_split_k=2, chunks=2),
    FragmentConfig(64, 16, 4, 4, pdl=True),
    FragmentConfig(128, 16, 4, 4, pdl=True),
]
FRAGMENT_SWEEP[256] = [
    FragmentConfig(128, 16, 4, 4, pdl=True),
    FragmentConfig(128, 16, 4, 4),
    FragmentConfig(64, 16, 4, 4, pdl=True),
    FragmentConfig(64, 8, 4, 3, chunks=2, pdl=True),
    FragmentConfig(128, 32, 4, 4, pdl=True),
    FragmentConfig(128, 64, 4, 4, pdl=True),
]
FRAGMENT_SWEEP[1024] = [
    FragmentConfig(128, 64, 4, 4, pdl=True, narrow_t=32),
    FragmentConfig(128, 64, 4, 4, pdl=True),
    FragmentConfig(128, 64, 4, 4, pdl=True, narrow_t=16),
    FragmentConfig(128, 64, 4, 3, pdl=True, narrow_t=32),
    FragmentConfig(128, 32, 4, 4, pdl=True),
    FragmentConfig(64, 64, 4, 4, pdl=True),
    FragmentConfig(128, 64, 4, 4, gemm2_split_k=2, pdl=True, narrow_t=32),
]
FRAGMENT_SWEEP[2048] = [
    FragmentConfig(128, 64, 4, 4, pdl=True, narrow_t=32),
    FragmentConfig(128, 64, 4, 4, pdl=True),
    FragmentConfig(128, 64, 4, 4, pdl=True, narrow_t=16),
    FragmentConfig(128, 128, 4, 2, pdl=True, narrow_t=64),
]
FRAGMENT_SWEEP[4096] = FRAGMENT_SWEEP[8192] = [
    FragmentConfig(128, 128, 4, 2, pdl=True, narrow_t=32),
    FragmentConfig(128, 128, 4, 2, pdl=True),
    FragmentConfig(128, 128, 4, 2, pdl=True, narrow_t=16),
    FragmentConfig(128, 64, 4, 4, pdl=True, narrow_t=16),
    FragmentConfig(256, 128, 8, 3, pdl=True),
]


def profile_case(prepared, m: int) -> list[str]:
    """Markdown rows of per-kernel device time (us per call) for M tokens, bf16 activations."""
    from torch.profiler import ProfilerActivity, profile

    x, logits, out = token_inputs(m)
    calls = 20

    def fn():
        layer_forward(x, prepared, logits, out)

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = ["| kernel | us per call |", "| --- | --- |"]
    for event in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:8]:
        if event.device_time_total > 0:
            rows.append(f"| {event.key[:60]} | {event.device_time_total / calls:.1f} |")
    return rows


# label -> (registered kernel, activation format, static fp8 scales, word order, prepare options)
VARIANTS = {
    "sm90": ("triton.moe_apply.sm90", "bf16", False, "fragment", {}),
    "sm90-hilo": (
        "triton.moe_apply.sm90, bf16 hi + lo intermediate",
        "bf16",
        False,
        "fragment",
        {"f16_intermediate": False},
    ),
    "sm90-prmt": (
        "triton.moe_apply.sm90, byte-permute decode, hi + lo",
        "bf16",
        False,
        "fragment",
        {"f16_intermediate": False, "shift_decode": False},
    ),
    "sm90-fp8-dynamic": (
        "triton.moe_apply.sm90, fp8 dynamic",
        "fp8",
        False,
        "fragment",
        {"e4m3_w2": True},
    ),
    "sm90-fp8-static": (
        "triton.moe_apply.sm90, fp8 static",
        "fp8",
        True,
        "fragment",
        {"e4m3_w2": True},
    ),
    "portable-bf16": ("triton.moe_apply", "bf16", False, "natural", {}),
    "portable-fp8-dynamic": ("triton.moe_apply, fp8 dynamic", "fp8", False, "natural", {}),
    "portable-fp8-static": ("triton.moe_apply, fp8 static", "fp8", True, "natural", {}),
}
COLUMNS = ["M", "kernel", "distinct experts", "floor µs", "eager µs", "graph µs (1 layer)"]
COLUMNS += ["graph µs (L2-cold)", "x floor", "TFLOP/s", "% bf16 dense"]


def time_sizes(label, args, bw: float, dense: float) -> tuple[list[list], list[str]]:
    """Table rows of one variant at each M, and its sweep / profile lines."""
    kernel, act, static, word_order, options = VARIANTS[label]
    prepared, scales = gpt_oss_tensors(static, word_order, **options)
    one, cold = [prepared], weight_copies(prepared, args.layers)
    sizes = (1, 4, 16, 64, 1024, 4096, 8192) if act == "bf16" else (1, 64, 1024, 4096, 8192)
    if args.sizes:
        sizes = tuple(int(m) for m in args.sizes.split(","))
    rows = []
    for m in sizes:
        eager, distinct = run_case(one, m, act, scales, graph=False)
        decode = m <= 64
        warm = run_case(one, m, act, scales, graph=True)[0] if decode else float("nan")
        graph = run_case(cold, m, act, scales, graph=True)[0] if decode else float("nan")
        best = graph if decode else eager
        floor = distinct * EXPERT_BYTES / bw * 1e6
        rate = m * TOP_K * 2 * (H * 2 * I + I * H) / (best * 1e-6)
        rows.append(
            [m, kernel, distinct, f"{floor:.1f}", f"{eager:.1f}", f"{warm:.1f}", f"{graph:.1f}"]
            + [f"{best / floor:.2f}", f"{rate / 1e12:.0f}", f"{100 * rate / dense:.0f}%"]
        )
        print(rows[-1], flush=True)
    extra = sweep_lines(label, sizes, one, cold, act, scales, args.layers) if args.sweep else []
    if args.profile and label in ("sm90", "portable-bf16"):
        for m in (1, 4096):
            extra += ["", f"Per-kernel device time, {kernel}, M={m} (torch.profiler, 20 calls):"]
            extra += ["", *profile_case(prepared, m)]
    return rows, extra


def sweep_lines(label, sizes, one, cold, act, scales, layers: int) -> list[str]:
    """Times of the alternative tiles (SWEEP, FRAGMENT_SWEEP) at the sizes run, each with its
    largest difference from the heuristic pick's output (which the side-by-side run checks
    against the reference): a tile that computes something else shows there."""
    if act != "bf16":
        return []
    lines = ["", f"Tile sweep ({label}, µs; M <= 1024: graph-timed over {layers} layers; "
             "max |tile - pick| on one layer's output):", ""]  # fmt: skip
    for m, configs in (FRAGMENT_SWEEP if label.startswith("sm90") else SWEEP).items():
        if m not in sizes:
            continue
        x, logits, _ = token_inputs(m)
        picked = torch.empty_like(x)
        layer_forward(x, one[0], logits, picked, act, scales)
        for config in configs:
            kernel = moe_sm90 if isinstance(config, FragmentConfig) else moe
            try:
                us = run_case(
                    cold if m <= 1024 else one, m, act, scales, graph=m <= 1024, config=config
                )
                tiled = torch.empty_like(x)
                with pin_config(kernel.KERNEL_NAME, config):
                    layer_forward(x, one[0], logits, tiled, act, scales)
                diff = (tiled.float() - picked.float()).abs().max().item()
                lines.append(f"- M={m} {config}: {us[0]:.1f} µs, max diff {diff:.3e}")
            except Exception as exc:  # noqa: BLE001 - a tile that does not fit is reported
                lines.append(f"- M={m} {config}: failed {type(exc).__name__}: {str(exc)[:120]}")
            print(lines[-1], flush=True)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time alternative tiles")
    parser.add_argument("--profile", action="store_true", help="per-kernel device times")
    parser.add_argument(
        "--no-peer", action="store_true", help="skip the side-by-side table with vLLM's path"
    )
    parser.add_argument(
        "--variants",
        default="",
        help=f"comma-separated kernel variants to tabulate too, from {', '.join(VARIANTS)}",
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=4,
        help="distinct weight copies run in turn for the L2-cold times",
    )
    parser.add_argument("--sizes", default=None, help="comma-separated M (default: all)")
    parser.add_argument(
        "--no-skew", action="store_true", help="skip the side-by-side tables with skewed routing"
    )
    parser.add_argument("--model", default=MODEL, choices=MODELS)
    record.add_record_argument(parser)
    args = parser.parse_args()
    use_model(args.model)
    started = time.monotonic()
    torch.backends.cuda.matmul.allow_tf32 = False
    name = torch.cuda.get_device_name()
    bw, dense = copy_bandwidth(), bf16_matmul_rate()
    body = [
        f"E={E}, top-{TOP_K}, H=I={H}, MXFP4 weights (random codes, e8m0 scales 119..121), fp32 "
        "biases, bf16 activations unless the kernel column says fp8; routing and combine "
        f"included. Copy bandwidth {bw / 1e12:.2f} TB/s (torch d2d, read + written), bf16 dense "
        f"matmul 8192^3 {dense / 1e12:.0f} TFLOP/s, expert bytes {EXPERT_BYTES / 1e6:.2f} MB "
        "(MXFP4 + scales, unpadded), all measured in this run.",
        "",
    ]
    origin = None
    if not args.no_peer:
        origin, lines = peer_side_by_side(args, bw, dense)
        body += lines
    if args.variants:
        body += [
            "",
            "Kernel variants: decode (M <= 64) is CUDA-graph timed over one layer's weights and "
            f"over {args.layers} layers' distinct copies in turn (L2-cold; x floor uses it); "
            "prefill is timed eagerly (do_bench).",
            "",
        ]
        rows, extra = [], []
        for label in args.variants.split(","):
            variant_rows, variant_extra = time_sizes(label, args, bw, dense)
            rows += variant_rows
            extra += variant_extra
            torch.cuda.empty_cache()
        body += record.table(COLUMNS, sorted(rows, key=lambda row: row[0])) + extra
    peer_versions = {} if args.no_peer else {peers.MOE_PEER: origin}
    title = f"MoE (moe_apply), {MODELS[MODEL][0]} shapes, {name}"
    lines = record.header(title, name, peer_versions)
    lines += body + ["", f"Whole run: {time.monotonic() - started:.0f} s."]
    record.write("moe", lines, device=name, record=not args.no_record, section=MODEL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
