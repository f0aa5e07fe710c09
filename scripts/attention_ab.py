"""A/B timing of the Triton attention launchers against an earlier copy of the package, in one
process, at GPT-OSS-120B shapes (hd 64, 64 query heads, 8 KV heads, sinks, bf16), GPU only.

    python scripts/attention_ab.py --snapshot <commit>      # here: write the "before" copy
    bash scripts/run_from_source.sh python scripts/attention_ab.py   # GPU: time both sides

The snapshot is the whole `tokenspeed_kernel_triton` package at <commit> (the attention modules
import its launch helpers), importable as `ab_before_triton` from .carry/ab_before (git-ignored;
send it along with the run). Each case captures a CUDA graph of launches over enough input
copies that the working set exceeds L2 (cold caches, as serving sees them), replays both sides
alternately for --rounds rounds and prints median microseconds per call, the ratio
after/before and whether both sides wrote bitwise the same outputs.
"""

from __future__ import annotations

import argparse
import importlib
import io
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "packages/tokenspeed-kernel-triton/src/tokenspeed_kernel_triton"
BEFORE = "ab_before_triton"
HQ, HKV, D, PAGE = 64, 8, 64, 64
L2_BYTES = 128 << 20  # over the 50 MB L2 of an H100/H200 twice: each replay starts cold
SCALE = D**-0.5


def snapshot(commit: str, dest: Path) -> None:
    """Write PACKAGE at `commit` to dest/BEFORE."""
    archive = subprocess.run(
        ["git", "archive", commit, PACKAGE], cwd=REPO, check=True, capture_output=True
    ).stdout
    target = dest / BEFORE
    if target.exists():
        raise SystemExit(f"{target} exists; remove it first")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if member.isfile():
                rel = Path(member.name).relative_to(PACKAGE)
                (target / rel).parent.mkdir(parents=True, exist_ok=True)
                (target / rel).write_bytes(tar.extractfile(member).read())
    print(f"wrote {target} ({commit})")


def _paged(torch, batch, ctx, q_len, window, sinks):
    """Launcher kwargs of a decode (q_len per sequence, q [B, Q, Hq, D]) over a paged cache."""
    pages = batch * -(-ctx // PAGE)
    k_cache = torch.randn(pages, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(pages, device="cuda", dtype=torch.int32).view(batch, -1)
    q = torch.randn(batch, q_len, HQ, D, device="cuda", dtype=torch.bfloat16)
    kwargs = dict(
        page_table=table,
        cache_seqlens=torch.full((batch,), ctx, device="cuda", dtype=torch.int32),
        window_left=window, sinks=sinks, softmax_scale=SCALE, k_scale=1.0, v_scale=1.0,
        out=torch.empty_like(q), lse=torch.empty(q.shape[:-1], device="cuda"),
    )  # fmt: skip
    return (q, k_cache, v_cache), kwargs


def make_inputs(torch, kind, size, window, sinks):
    """(positional args, kwargs) of one launch; kwargs holds `out` and `lse`."""
    if kind == "prefill":
        seqlen, batch = size
        tokens = seqlen * batch
        q = torch.randn(tokens, HQ, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(tokens, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in "kv")
        kwargs = dict(
            cu_seqlens=torch.arange(0, tokens + 1, seqlen, device="cuda", dtype=torch.int32),
            max_seqlen=seqlen, causal=True, window_left=window, sinks=sinks,
            softmax_scale=SCALE, out=torch.empty_like(q),
            lse=torch.empty(tokens, HQ, device="cuda"),
        )  # fmt: skip
        return (q, k, v), kwargs
    if kind == "extend":
        batch, ctx, new = size
        (q, k_cache, v_cache), kwargs = _paged(torch, batch, ctx, new, window, sinks)
        q = q.view(batch * new, HQ, D)
        kwargs.update(
            cu_seqlens_q=torch.arange(0, batch * new + 1, new, device="cuda", dtype=torch.int32),
            max_seqlen_q=new, out=torch.empty_like(q),
            lse=torch.empty(batch * new, HQ, device="cuda"),
        )  # fmt: skip
        return (q, k_cache, v_cache), kwargs
    batch, ctx, q_len = size
    return _paged(torch, batch, ctx, q_len, window, sinks)


# (name, kind, size, window): prefill size (S, B); extend (B, ctx, new tokens); decode (B, ctx,
# new tokens per sequence).
CASES = [
    *(
        (f"prefill {label} S={s}x{b}", "prefill", (s, b), w)
        for label, w in (("causal", -1), ("window127", 127))
        for s, b in ((1024, 16), (8192, 2))
    ),
    ("extend causal 4x1024 new/8192", "extend", (4, 8192, 1024), -1),
    ("extend window127 4x1024 new/8192", "extend", (4, 8192, 1024), 127),
    *(
        (f"decode {label} B={b} ctx 8192", "decode", (b, 8192, 1), w)
        for label, w in (("full", -1), ("window127", 127))
        for b in (1, 16, 64)
    ),
    ("decode full B=16 Q=4 ctx 8192", "decode", (16, 8192, 4), -1),
    ("decode window127 B=16 Q=4 ctx 8192", "decode", (16, 8192, 4), 127),
]


def _case_bytes(args, kwargs):
    tensors = [*args, kwargs["out"], kwargs["lse"]]
    return sum(t.numel() * t.element_size() for t in tensors)


def time_case(torch, launchers, case, rounds):
    """{side: [us per call per round]}, and whether the sides' outputs are bitwise equal."""
    name, kind, size, window = case
    sinks = torch.randn(HQ, device="cuda")
    first = make_inputs(torch, kind, size, window, sinks)
    copies = max(1, -(-L2_BYTES // _case_bytes(*first)))
    inputs = [first] + [make_inputs(torch, kind, size, window, sinks) for _ in range(copies - 1)]
    outs = {}
    for side, launch in launchers.items():
        args, kwargs = inputs[0]
        launch[kind](*args, **kwargs)  # compile outside the capture
        torch.cuda.synchronize()
        outs[side] = (kwargs["out"].clone(), kwargs["lse"].clone())
    same = all(torch.equal(a, b) for a, b in zip(*outs.values(), strict=True))
    graphs = {}
    for side, launch in launchers.items():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for args, kwargs in inputs:
                launch[kind](*args, **kwargs)
        graph.replay()
        graphs[side] = graph
    torch.cuda.synchronize()
    times = {side: [] for side in launchers}
    for _ in range(rounds):
        for side, graph in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times[side].append(start.elapsed_time(end) * 1000 / copies)
    return times, same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--snapshot", metavar="COMMIT", help="write the 'before' copy and exit")
    parser.add_argument("--before-dir", type=Path, default=REPO / ".carry" / "ab_before")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("-k", default="", help="only cases whose name contains this")
    args = parser.parse_args()
    if args.snapshot:
        snapshot(args.snapshot, args.before_dir)
        return
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("attention_ab.py times GPU kernels; no CUDA device here")
    sys.path.insert(0, str(args.before_dir))
    launchers = {}
    for side, package in (
        ("before", f"{BEFORE}.attention"),
        ("after", "tokenspeed_kernel_triton.attention"),
    ):
        launchers[side] = {
            "prefill": importlib.import_module(f"{package}.prefill").mha_prefill,
            "extend": importlib.import_module(f"{package}.extend").mha_extend_with_kvcache,
            "decode": importlib.import_module(f"{package}.decode").mha_decode_with_kvcache,
        }
    print(f"{torch.cuda.get_device_name()}; median of {args.rounds} alternating graph replays")
    print(f"{'case':<38} {'before us':>10} {'after us':>10} {'after/before':>13} {'bitwise':>8}")
    for case in CASES:
        if args.k not in case[0]:
            continue
        torch.manual_seed(0)
        times, same = time_case(torch, launchers, case, args.rounds)
        before, after = (statistics.median(times[side]) for side in ("before", "after"))
        print(f"{case[0]:<38} {before:10.1f} {after:10.1f} {after / before:13.3f} {same!s:>8}")


if __name__ == "__main__":
    main()
