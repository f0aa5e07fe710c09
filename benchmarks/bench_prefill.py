"""Triton mha_prefill and mha_extend_with_kvcache against FlashAttention-3 at GPT-OSS shapes,
with our CuTe DSL causal prefill beside them where it runs (its cubins from
TOKENSPEED_KERNEL_CUTE_CUBINS or the DSL); rewrites benchmarks/results/prefill_<gpu>.md.

    python3 benchmarks/bench_prefill.py [--sweep] [--only causal|window] [--no-extend]
        [--rounds N] [--no-record]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import record
import torch
import triton
from record import table

from tokenspeed_kernel.ops.attention.reference import reference_extend, reference_prefill
from tokenspeed_kernel.tuning import pin_config
from tokenspeed_kernel_triton.attention import extend, prefill
from tokenspeed_kernel_triton.attention._tile_config import AttentionConfig

HQ, HKV, D = 64, 8, 64
SCALE = 1.0 / math.sqrt(D)
PREFILL_CASES = [
    (seqlen, batch, window)
    for window in (-1, 127)
    for seqlen, batch in ((1024, 16), (4096, 4), (8192, 2))
]
C = AttentionConfig
SWEEP = {
    False: [C(128, 64, 8, 4, 8), C(128, 64, 8, 2, 8), C(128, 32, 8, 3, 8), C(128, 64, 8, 3, 4)],
    True: [
        C(128, 32, 4, 3, 8, False),
        C(128, 32, 4, 4, 8, False),
        C(128, 16, 4, 3, 8, False),
        C(128, 64, 4, 3, 8, False),
        C(256, 32, 8, 3, 8, False),
        C(256, 64, 8, 3, 8, False),
        C(256, 32, 4, 3, 8, False),
        C(128, 32, 4, 3, 8, True),
    ],
}
METHOD = (
    f"GPT-OSS-120B attention: head dim {D}, {HQ} query / {HKV} KV heads, per-head sinks "
    "(bf16), bf16 q/k/v, causal; window rows use `window_left=127` (FA3 `window_size=(127, "
    "0)`). FLOPs = 4 * Hq * D * (visible keys summed over queries): useful work only, for us "
    "and for FA3. Times: `triton.testing.do_bench` medians (warmup 25 ms, rep 150 ms). FA3 "
    "runs in the same process. Numerics: relative L2 error of the bf16 output against the "
    "core fp32 reference on the same inputs, FA3's beside it. FA3 / ours = FA3's time over "
    "ours (> 1: we are faster). Config tuples: BLOCK_M, BLOCK_N, warps, stages, heads per "
    "tile, masked/unmasked split. CuTe: `cute.mha_prefill` (causal only) in the same process, "
    "timed in alternating rounds with FA3 (a do_bench median of each per round: clocks drift "
    "within a run by as much as the two differ); its time is the median over the rounds, FA3 / "
    "CuTe the median of the rounds' ratios with their range; its error against the reference "
    "comes last."
)
EXTEND_SWEEP = {
    False: [C(128, 64, 8, 4, 8), C(128, 64, 4, 3, 8), C(128, 32, 8, 3, 8), C(128, 64, 8, 2, 8)],
    True: [C(128, 32, 4, 3, 8, False), C(64, 64, 4, 3, 8, False), C(64, 32, 4, 2, 8, False)],
}


def visible_keys(seqlen: int, window: int) -> int:
    if window < 0:
        return seqlen * (seqlen + 1) // 2
    return sum(min(i + 1, window + 1) for i in range(seqlen))


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm()).item()


def prefill_inputs(seqlen, batch, gen):
    total = seqlen * batch
    q = torch.randn(total, HQ, D, device="cuda", generator=gen).bfloat16()
    k = torch.randn(total, HKV, D, device="cuda", generator=gen).bfloat16()
    v = torch.randn(total, HKV, D, device="cuda", generator=gen).bfloat16()
    sinks = torch.randn(HQ, device="cuda", generator=gen).bfloat16()  # FA3 takes bf16 sinks
    cu = torch.arange(0, total + 1, seqlen, device="cuda", dtype=torch.int32)
    return q, k, v, sinks, cu


def paired(run_peer, run_ours, rounds: int) -> tuple[float, list[float]]:
    """Our median time over `rounds` alternating rounds and each round's peer time over ours."""
    ours, ratios = [], []
    for _ in range(rounds):
        peer = bench(run_peer)
        ms = bench(run_ours)
        ours.append(ms)
        ratios.append(peer / ms)
    return statistics.median(ours), ratios


def peer_ms(run_fa3, ref, check: dict) -> float:
    """FA3's time; its error against the reference goes into `check`."""
    fa3_out = run_fa3()
    fa3_out = fa3_out[0] if isinstance(fa3_out, tuple) else fa3_out
    check["fa3_err_vs_ref"] = rel_err(fa3_out, ref)
    return bench(run_fa3)


def case_rows(label, flops, run, out, ref, check, fa3_ms, configs, kernel_name) -> list[dict]:
    """The heuristic row beside FA3, then one row per pinned config (errors reported)."""
    ms = bench(run)
    rows = [
        dict(
            case=label,
            config="heuristic",
            ms=ms,
            tflops=flops / ms / 1e9,
            fa3_ms=fa3_ms,
            fa3_tflops=fa3_ms and flops / fa3_ms / 1e9,
            **check,
        )
    ]
    for config in configs:
        try:
            with pin_config(kernel_name, config):
                run()
                err = rel_err(out, ref)
                ms = bench(run)
        except Exception as exc:  # noqa: BLE001 - a config that does not fit is reported
            rows.append(dict(case=label, config=str(config), error=str(exc)[:200]))
            continue
        rows.append(
            dict(case=label, config=str(config), ms=ms, tflops=flops / ms / 1e9, err_vs_ref=err)
        )
    return rows


def run_prefill_case(seqlen, batch, window, fa3, sweep, rounds) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(seqlen + window)
    q, k, v, sinks, cu = prefill_inputs(seqlen, batch, gen)
    kwargs = dict(
        cu_seqlens=cu,
        max_seqlen=seqlen,
        causal=True,
        window_left=window,
        sinks=sinks,
        softmax_scale=SCALE,
    )
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], HQ), float("nan"), device="cuda")
    prefill.mha_prefill(q, k, v, out=out, lse=lse, **kwargs)
    ref, ref_lse = torch.empty_like(q, dtype=torch.float32), torch.empty_like(lse)
    reference_prefill(q, k, v, out=ref, lse=ref_lse, **kwargs)
    check = dict(
        err_vs_ref=rel_err(out, ref),
        lse_max_err=(lse - ref_lse).abs().max().item(),
        nan=bool(out.isnan().any() or lse.isnan().any()),
    )
    fa3_ms = run_fa3 = None
    if fa3 is not None:
        window_size = (window, 0) if window >= 0 else (-1, -1)

        def run_fa3():
            return fa3.flash_attn_varlen_func(
                q,
                k,
                v,
                cu,
                cu,
                seqlen,
                seqlen,
                softmax_scale=SCALE,
                causal=True,
                window_size=window_size,
                sinks=sinks,
            )

        fa3_ms = peer_ms(run_fa3, ref, check)
    label = f"prefill {'causal' if window < 0 else f'window{window}'} S={seqlen}x{batch}"
    flops = 4 * HQ * D * batch * visible_keys(seqlen, window)

    def run():
        prefill.mha_prefill(q, k, v, out=out, lse=None, **kwargs)

    cute = cute_prefill()
    if cute is not None and window < 0:
        cute_out = torch.full_like(q, float("nan"))

        def run_cute():
            cute.mha_prefill(q, k, v, out=cute_out, lse=None, **kwargs)

        run_cute()
        check["cute_err_vs_ref"] = rel_err(cute_out, ref)
        if run_fa3 is None:
            check["cute_ms"] = bench(run_cute)
        else:
            check["cute_ms"], check["fa3_over_cute"] = paired(run_fa3, run_cute, rounds)
    configs = sweep[window >= 0] if sweep else ()
    return case_rows(label, flops, run, out, ref, check, fa3_ms, configs, prefill.KERNEL_NAME)


def cute_prefill():
    """The CuTe DSL prefill module where it can run here (sm_90 with the DSL or its cubins),
    else None."""
    try:
        from tokenspeed_kernel.ops.attention.request import AttentionRequest
        from tokenspeed_kernel.platform import platform_of
        from tokenspeed_kernel_nvidia import cute_prefill as cute
    except ImportError:
        return None
    request = AttentionRequest(torch.bfloat16, torch.bfloat16, D, HQ, HKV, sinks=True)
    return cute if cute.supports(request, platform_of(torch.device("cuda"))).ok else None


def run_extend_case(ctx, new, batch, window, page, fa3, sweep) -> list[dict]:
    """Chunked prefill: `new` query tokens at the end of `ctx` cached tokens, page `page`."""
    gen = torch.Generator(device="cuda").manual_seed(ctx + new + window)
    pages_per_seq = ctx // page
    num_pages = batch * pages_per_seq
    k_cache = torch.randn(num_pages, page, HKV, D, device="cuda", generator=gen).bfloat16()
    v_cache = torch.randn(num_pages, page, HKV, D, device="cuda", generator=gen).bfloat16()
    page_table = torch.randperm(num_pages, device="cuda", generator=gen).int()
    page_table = page_table.view(batch, pages_per_seq)
    q = torch.randn(batch * new, HQ, D, device="cuda", generator=gen).bfloat16()
    sinks = torch.randn(HQ, device="cuda", generator=gen).bfloat16()  # FA3 takes bf16 sinks
    cu_q = torch.arange(0, batch * new + 1, new, device="cuda", dtype=torch.int32)
    seqlens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    kwargs = dict(
        cu_seqlens_q=cu_q,
        page_table=page_table,
        cache_seqlens=seqlens,
        max_seqlen_q=new,
        window_left=window,
        sinks=sinks,
        softmax_scale=SCALE,
        k_scale=1.0,
        v_scale=1.0,
    )
    out = torch.full_like(q, float("nan"))

    def run():
        extend.mha_extend_with_kvcache(q, k_cache, v_cache, out=out, lse=None, **kwargs)

    run()
    ref = torch.empty_like(q, dtype=torch.float32)
    reference_extend(q, k_cache, v_cache, out=ref, lse=None, **kwargs)
    check = dict(err_vs_ref=rel_err(out, ref), nan=bool(out.isnan().any()))
    fa3_ms = None
    if fa3 is not None:
        window_size = (window, 0) if window >= 0 else (-1, -1)
        fa3_ms = peer_ms(
            lambda: fa3.flash_attn_with_kvcache(
                q,
                k_cache,
                v_cache,
                cache_seqlens=seqlens,
                page_table=page_table,
                cu_seqlens_q=cu_q,
                max_seqlen_q=new,
                softmax_scale=SCALE,
                causal=True,
                window_size=window_size,
                sinks=sinks,
            ),
            ref,
            check,
        )
    label = (
        f"extend {'causal' if window < 0 else f'window{window}'} ctx={ctx} new={new}"
        f"x{batch} page{page}"
    )
    flops = 4 * HQ * D * batch * (visible_keys(ctx, window) - visible_keys(ctx - new, window))
    configs = sweep[window >= 0] if sweep else ()
    return case_rows(label, flops, run, out, ref, check, fa3_ms, configs, extend.KERNEL_NAME)


def _cells(r: dict) -> list[object]:
    if "error" in r:
        return [r["case"], r["config"], f"error: {r['error'][:80]}", *[""] * 7]
    fa3_ms = r.get("fa3_ms")
    peer = ["", "", ""]
    if fa3_ms:
        peer = [f"{fa3_ms:.3f}", f"{r['fa3_tflops']:.0f}", f"{fa3_ms / r['ms']:.2f}"]
    cute = ["", ""]
    if r.get("cute_ms"):
        ratios = r.get("fa3_over_cute")
        paired_ratio = ""
        if ratios:
            paired_ratio = (
                f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}, "
                f"{len(ratios)} rounds)"
            )
        cute = [f"{r['cute_ms']:.3f}", paired_ratio]
    err = f"{r['err_vs_ref']:.1e}"
    if "fa3_err_vs_ref" in r:
        err += f" / {r['fa3_err_vs_ref']:.1e}"
    if "cute_err_vs_ref" in r:
        err += f" / {r['cute_err_vs_ref']:.1e}"
    if r.get("nan"):
        err += " (NaN in the output)"
    return [r["case"], r["config"], f"{r['ms']:.3f}", f"{r['tflops']:.0f}", *peer, *cute, err]


def prefill_lines(rows: list[dict]) -> list[str]:
    """The heuristic rows side by side with FA3, then the pinned configs (--sweep)."""
    columns = ["case", "config", "ms", "TFLOP/s", "FA3 ms", "FA3 TFLOP/s", "FA3 / ours"]
    columns += ["CuTe ms", "FA3 / CuTe", "rel err vs ref (ours / FA3 / CuTe)"]
    lines = table(columns, (_cells(r) for r in rows if r["config"] == "heuristic"))
    swept = [r for r in rows if r["config"] != "heuristic"]
    if swept:
        lines += ["", "Pinned configs (`tuning.pin_config(<kernel name>, config)`):", ""]
        lines += table(columns, (_cells(r) for r in swept))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time pinned configs")
    parser.add_argument("--no-extend", action="store_true")
    parser.add_argument("--only", choices=("causal", "window"), help="prefill cases to run")
    parser.add_argument(
        "--rounds", type=int, default=7, help="alternating CuTe / FA3 rounds per causal case"
    )
    record.add_record_argument(parser)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least one round")
    try:
        import flash_attn_interface as fa3
    except ImportError:
        fa3 = None
        print("FA3 (flash_attn_interface) not importable: peer columns stay empty")
    name = torch.cuda.get_device_name()
    rows: list[dict] = []
    for seqlen, batch, window in PREFILL_CASES:
        if args.only and (window >= 0) != (args.only == "window"):
            continue
        sweep = SWEEP if args.sweep else None
        rows += run_prefill_case(seqlen, batch, window, fa3, sweep, args.rounds)
        print(json.dumps(rows[-1]), flush=True)
    if not args.no_extend:
        for window, page in ((-1, 64), (127, 64), (-1, 16)):
            sweep = EXTEND_SWEEP if args.sweep and page == 64 else None
            rows += run_extend_case(8192, 2048, 2, window, page, fa3, sweep)
            print(json.dumps(rows[-1]), flush=True)
    fa3_version = record.package_version("tokenspeed-fa3", "flash-attn-3", "flash_attn_3")
    lines = record.header(
        f"Prefill and extend attention against FlashAttention-3, {name}", name, {"FA3": fa3_version}
    )
    lines += [METHOD, "", *prefill_lines(rows)]
    record.write("prefill", lines, device=name, record=not args.no_record)


if __name__ == "__main__":
    main()
