"""`tokenspeed-kernel`: what this machine can run and why.

tokenspeed-kernel                 platform, plugins, kernels, GPT-OSS-120B selections
tokenspeed-kernel list            every op with its kernels, platforms and traits
tokenspeed-kernel explain OP      every candidate for a preset's (or explicit) request
tokenspeed-kernel plugins         loaded, failed and skipped plugins
tokenspeed-kernel tune            measure kernels per request bucket, write a rankings file

--platform and --preset may come before or after the command. --platform only changes what
selection sees (the report, list, explain); commands that run kernels refuse it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from collections.abc import Sequence

import torch

from . import __version__, plugins, registry
from .errors import UnsupportedError
from .ops.attention.request import size_bucket
from .platform import (
    AOT_TARGETS,
    KNOWN_PLATFORMS,
    Platform,
    default_device,
    fake_platform,
    platform_of,
)
from .presets import PRESETS, ModelPreset, get_preset, report_calls
from .selector import explain
from .tools._common import platform_words

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}
# Commands that run kernels on this machine's device: a faked platform would run them on
# hardware they were not selected for.
RUNS_KERNELS = ("check", "bench", "profile", "aot", "tune")
# Commands that run the Triton kernels through the Triton interpreter when there is no GPU.
INTERPRETS_ON_CPU = ("check",)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.platform and args.command in RUNS_KERNELS:
        print(
            f"tokenspeed-kernel: error: --platform only changes what selection sees; "
            f"`{args.command}` runs kernels on this machine's device. Use "
            f"`tokenspeed-kernel --platform {args.platform} explain OP` to see what "
            f"{args.platform} would select, or `tokenspeed-kernel aot --target sm_90|gfx942|"
            f"gfx950` to compile for a GPU this machine lacks.",
            file=sys.stderr,
        )
        return 2
    if args.command in INTERPRETS_ON_CPU and not torch.cuda.is_available():
        # Triton picks the interpreter when a kernel module is imported: set it before the
        # plugins load (an explicit TRITON_INTERPRET from the caller wins).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    command = getattr(args, "run", _report)
    try:
        if args.platform:
            with fake_platform(args.platform):
                return command(args) or 0
        return command(args) or 0
    except (ValueError, UnsupportedError) as exc:
        print(f"tokenspeed-kernel: error: {exc}", file=sys.stderr)
        return 2


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def _global_options(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """--platform and --preset, accepted before the command (`top`) and after it. After it
    they default to SUPPRESS so that leaving them out keeps the value given before."""
    default = {} if top else {"default": argparse.SUPPRESS}
    parser.add_argument(
        "--platform",
        choices=sorted(KNOWN_PLATFORMS),
        help="select as if on this platform (report, list, explain; nothing runs)",
        **({"default": None} if top else default),
    )
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="the model whose shapes the report and explain use (default: gpt-oss-120b)",
        **({"default": "gpt-oss-120b"} if top else default),
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenspeed-kernel",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _global_options(parser, top=True)
    sub = parser.add_subparsers(dest="command")
    listing = sub.add_parser("list", help="every op with its registered kernels")
    listing.set_defaults(run=_list)
    plugin_list = sub.add_parser("plugins", help="plugin load results")
    plugin_list.set_defaults(run=_plugins)
    ex = sub.add_parser("explain", help="every candidate kernel for one request, and why")
    for p in (listing, plugin_list, ex):
        _global_options(p, top=False)
    ex.add_argument("op", choices=registry.op_names())
    ex.add_argument("--window", action="store_true", help="a sliding-window layer")
    ex.add_argument("--q-len", type=_positive_int, default=1, help="decode tokens per sequence")
    ex.add_argument("--kv-dtype", choices=sorted(_DTYPES), help="KV cache dtype")
    ex.add_argument("--num-tokens", type=_positive_int, help="MoE: max tokens per call")
    ex.add_argument("--weight-format", default="mxfp4", choices=("mxfp4", "fp8", "bf16"))
    ex.add_argument("--activation-format", default="bf16", choices=("bf16", "fp8"))
    ex.add_argument("--dtype", choices=("bf16", "fp16"), help="override q dtype")
    ex.add_argument("--head-dim", type=_positive_int, help="override the preset's head dim")
    ex.add_argument("--heads", type=str, help="override heads as HQ/HKV, e.g. 64/8")
    ex.add_argument("--page-size", type=_positive_int, help="override the preset's page size")
    ex.add_argument(
        "--tokens",
        type=_positive_int,
        help="query tokens of the call (decode: B*Q; store: tokens written): the size bucket "
        "measured rankings choose by (default: none, which ranks over every measured size)",
    )
    ex.add_argument("--seqlen", type=_positive_int, help="prefill/extend: longest query sequence")
    ex.add_argument("--no-sinks", action="store_true")
    ex.add_argument("--lse", action="store_true")
    ex.set_defaults(run=_explain)
    from .tools import add_tool_commands  # noqa: PLC0415  (check, bench, profile, aot, tune)

    add_tool_commands(sub)
    return parser


def _this_platform() -> Platform:
    return platform_of(default_device())


def _report(args: argparse.Namespace) -> int:
    platform = _this_platform()
    print(f"tokenspeed-kernel {__version__}  torch {torch.__version__}")
    print(f"platform: {describe_platform(platform)}")
    print()
    _plugins(args)
    _rankings()
    print()
    _list(args, traits=False)
    preset = get_preset(args.preset)
    print()
    print(f"{preset.name} on this platform ({platform.label}):")
    calls = report_calls(preset)
    rows, declines = [], defaultdict(lambda: defaultdict(list))
    for label, op, request in calls:
        explanation = explain(op, request, platform)
        rows.append((label, explanation.selected or "none (UnsupportedError)"))
        for c in explanation.candidates:
            if not c.accepted and c.priority > _priority(explanation):
                declines[c.reason][c.name].append(label)
    width = max(len(label) for label, _ in rows)
    for label, chosen in rows:
        print(f"  {label:<{width}}  -> {chosen}")
    _print_declines(declines, calls)
    _next_steps(platform, args.platform)
    return 0


def _print_declines(declines, calls) -> None:
    """Each reason once, with the kernels it stopped; a kernel that declined only some of its
    op's calls for that reason names them."""
    if not declines:
        return
    calls_per_op = defaultdict(list)
    for label, op, _ in calls:
        calls_per_op[op].append(label)
    print("\nhigher-priority kernels not selected, by reason:")
    for reason, kernels in declines.items():
        print(f"  {reason}:")
        names = [
            name
            if any(labels == all_labels for all_labels in calls_per_op.values())
            else f"{name} ({', '.join(labels)})"
            for name, labels in kernels.items()
        ]
        print(f"    {', '.join(names)}")


def _priority(explanation) -> int:
    for c in explanation.candidates:
        if c.name == explanation.selected:
            return c.priority
    return -(10**9)


def describe_platform(platform: Platform) -> str:
    if platform.vendor != "cpu":
        return platform_words(platform)
    return (
        f"{platform_words(platform)} (no GPU: ops run the reference kernels; "
        "`check` runs the Triton kernels through the Triton interpreter)"
    )


def _next_steps(platform: Platform, faked: str | None) -> None:
    steps = [("explain mha_decode_with_kvcache --window", "every candidate for one call, and why")]
    if platform.vendor == "cpu" and not faked:
        steps += [
            ("--platform h100", "this report as an H100 would select"),
            ("check --op kvcache_store", "kernels against the reference (Triton interpreter)"),
        ]
    elif faked:
        target = next((t for t, p in AOT_TARGETS.items() if p == platform), "sm_90")
        steps.append((f"aot --target {target}", "compile the kernels for this GPU, here"))
    else:
        steps.append(("check", "every kernel against the reference on this GPU"))
    steps.append(("--help", "every command"))
    print("\nnext:")
    width = max(len(command) for command, _ in steps)
    for command, what in steps:
        print(f"  tokenspeed-kernel {command:<{width}}  {what}")


def _plugins(args: argparse.Namespace) -> int:
    results = plugins.load_plugins()
    print(f"plugins ({plugins.ENTRY_POINT_GROUP}):")
    if not results:
        print("  none installed")
    for r in results:
        if r.status == "loaded":
            what = f"loaded, {len(r.kernels)} kernels"
        elif r.status == "failed":
            what = f"FAILED: {r.error}"
        else:
            what = f"skipped ({r.detail})"
        print(f"  {r.name:<10} {r.target:<50} {what}")
    return 1 if args.command == "plugins" and any(r.status == "failed" for r in results) else 0


def _rankings() -> None:
    from . import rankings  # noqa: PLC0415

    sources = rankings.sources()
    if not sources:
        print(
            "rankings: none (priorities decide; `tokenspeed-kernel tune` measures, "
            f"{rankings.RANKINGS_ENV}=FILE uses what it wrote)"
        )
    for source in sources:
        p = source.platform
        where = " ".join(x for x in (p["vendor"], p["arch"], p.get("name")) if x)
        print(f"rankings: {source.origin}: {where}, {len(source.entries)} buckets")


def _list(args: argparse.Namespace, traits: bool = True) -> int:
    print("operators and kernels (best first):")
    for op in registry.op_names():
        print(f"  {op}:")
        for spec in registry.kernels(op):
            where = ", ".join(str(p) for p in spec.platforms)
            print(f"    {spec.name:<40} priority {spec.priority:<4} platforms {where}")
            if traits:
                shown = "; ".join(f"{k}={trait_text(v)}" for k, v in sorted(spec.traits.items()))
                print(f"      traits: {shown}")
    return 0


def trait_text(value: object) -> str:
    """A trait value as people read it: `yes`, integer sets in numeric order, and a run of
    consecutive integers as a range (`1..64`)."""
    if value is True:
        return "yes"
    if isinstance(value, (set, frozenset)) and value and all(type(v) is int for v in value):
        numbers = sorted(value)
        if len(numbers) > 2 and numbers[-1] - numbers[0] == len(numbers) - 1:
            return f"{numbers[0]}..{numbers[-1]}"
        return "{" + ", ".join(map(str, numbers)) + "}"
    return registry.describe_value(value)


def _explain(args: argparse.Namespace) -> int:
    preset = get_preset(args.preset)
    op = args.op
    request = _request_from_args(op, preset, args)
    explanation = explain(op, request, _this_platform())
    print(explanation)
    return 0 if explanation.selected else 1


def _request_from_args(op: str, preset: ModelPreset, args: argparse.Namespace):
    kv_dtype = _DTYPES[args.kv_dtype] if args.kv_dtype else None
    if op == "moe_apply":
        tokens = args.num_tokens or preset.decode_batch
        return preset.moe_request(
            tokens, weight_format=args.weight_format, activation_format=args.activation_format
        )
    if op == "kvcache_store":
        request = preset.kvcache_store_request(kv_dtype)
    else:
        request = preset.attention_request(
            op, window=args.window, q_len=args.q_len, kv_dtype=kv_dtype
        )
        request = request._replace(sinks=not args.no_sinks, lse=args.lse)
    overrides = {}
    if args.dtype:
        overrides["dtype"] = _DTYPES[args.dtype]
        if kv_dtype is None:
            overrides["kv_dtype"] = _DTYPES[args.dtype]
    if args.head_dim:
        overrides["head_dim"] = args.head_dim
    if args.page_size and op != "mha_prefill":
        overrides["page_size"] = args.page_size
    if args.tokens:
        overrides["tokens"] = size_bucket(args.tokens)
    if args.seqlen and op in ("mha_prefill", "mha_extend_with_kvcache"):
        overrides["seqlen"] = size_bucket(args.seqlen)
    if args.heads:
        hq, _, hkv = args.heads.partition("/")
        if not (hq.isdigit() and hkv.isdigit()) or 0 in (int(hq), int(hkv)) or int(hq) % int(hkv):
            raise ValueError(
                f"--heads is {args.heads!r}, expected HQ/HKV: positive, with HQ % HKV == 0"
            )
        if op != "kvcache_store":
            overrides["num_q_heads"] = int(hq)
        overrides["num_kv_heads"] = int(hkv)
    return request._replace(**overrides)


if __name__ == "__main__":
    sys.exit(main())
