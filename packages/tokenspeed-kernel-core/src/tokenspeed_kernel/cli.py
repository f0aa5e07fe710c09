"""`tokenspeed-kernel`: what this machine can run and why.

tokenspeed-kernel                 platform, plugins, kernels, GPT-OSS-120B selections
tokenspeed-kernel list            every op with its kernels, platforms and traits
tokenspeed-kernel explain OP      every candidate for a preset's (or explicit) request
tokenspeed-kernel plugins         loaded, failed and skipped plugins
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from . import __version__, plugins, registry
from .errors import UnsupportedError
from .platform import KNOWN_PLATFORMS, Platform, default_device, fake_platform, platform_of
from .presets import PRESETS, ModelPreset, get_preset, report_calls
from .selector import explain

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    command = getattr(args, "run", _report)
    try:
        if args.platform:
            with fake_platform(args.platform):
                return command(args) or 0
        return command(args) or 0
    except (ValueError, UnsupportedError) as exc:
        print(f"tokenspeed-kernel: error: {exc}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenspeed-kernel",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--platform",
        choices=sorted(KNOWN_PLATFORMS),
        help="pretend to run on this platform (selection only, nothing runs)",
    )
    parser.add_argument("--preset", default="gpt-oss-120b", choices=sorted(PRESETS))
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("list", help="every op with its registered kernels").set_defaults(run=_list)
    sub.add_parser("plugins", help="plugin load results").set_defaults(run=_plugins)
    ex = sub.add_parser("explain", help="every candidate kernel for one request, and why")
    ex.add_argument("op", choices=registry.op_names())
    ex.add_argument("--window", action="store_true", help="a sliding-window layer")
    ex.add_argument("--q-len", type=int, default=1, help="decode tokens per sequence")
    ex.add_argument("--kv-dtype", choices=sorted(_DTYPES), help="KV cache dtype")
    ex.add_argument("--num-tokens", type=int, help="MoE: max tokens per call")
    ex.add_argument("--weight-format", default="mxfp4", choices=("mxfp4", "fp8", "bf16"))
    ex.add_argument("--activation-format", default="bf16", choices=("bf16", "fp8"))
    ex.add_argument("--dtype", choices=("bf16", "fp16"), help="override q dtype")
    ex.add_argument("--head-dim", type=int, help="override the preset's head dim")
    ex.add_argument("--heads", type=str, help="override heads as HQ/HKV, e.g. 64/8")
    ex.add_argument("--page-size", type=int, help="override the preset's page size")
    ex.add_argument("--no-sinks", action="store_true")
    ex.add_argument("--lse", action="store_true")
    ex.set_defaults(run=_explain)
    from .tools import add_tool_commands  # noqa: PLC0415  (check, bench, profile)

    add_tool_commands(sub)
    return parser


def _this_platform() -> Platform:
    return platform_of(default_device())


def _report(args: argparse.Namespace) -> int:
    platform = _this_platform()
    print(f"tokenspeed-kernel {__version__}  torch {torch.__version__}")
    print(f"platform: {platform}")
    print()
    _plugins(args)
    print()
    _list(args, traits=False)
    preset = get_preset(args.preset)
    print()
    print(f"{preset.name} on this platform ({platform.vendor} {platform.arch}):")
    rows = []
    for label, op, request in report_calls(preset):
        explanation = explain(op, request, platform)
        chosen = explanation.selected or "none (UnsupportedError)"
        declined = [
            f"{c.name}: {c.reason}"
            for c in explanation.candidates
            if not c.accepted and c.priority > _priority(explanation)
        ]
        why = "; ".join(declined) if declined else "highest-priority kernel that accepts"
        rows.append((label, chosen, why))
    width = max(len(r[0]) for r in rows)
    chosen_width = max(len(r[1]) for r in rows)
    for label, chosen, why in rows:
        print(f"  {label:<{width}}  -> {chosen:<{chosen_width}}  ({why})")
    return 0


def _priority(explanation) -> int:
    for c in explanation.candidates:
        if c.name == explanation.selected:
            return c.priority
    return -(10**9)


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


def _list(args: argparse.Namespace, traits: bool = True) -> int:
    print("operators and kernels (best first):")
    for op in registry.op_names():
        print(f"  {op}:")
        for spec in registry.kernels(op):
            where = ", ".join(str(p) for p in spec.platforms)
            print(f"    {spec.name:<40} priority {spec.priority:<4} platforms {where}")
            if traits:
                shown = "; ".join(
                    f"{k}={registry.describe_value(v) if v is not True else 'yes'}"
                    for k, v in sorted(spec.traits.items())
                )
                print(f"      traits: {shown}")
    return 0


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
    if args.heads:
        hq, _, hkv = args.heads.partition("/")
        if not (hq.isdigit() and hkv.isdigit()) or int(hkv) == 0 or int(hq) % int(hkv):
            raise ValueError(f"--heads is {args.heads!r}, expected HQ/HKV with HQ % HKV == 0")
        if op != "kvcache_store":
            overrides["num_q_heads"] = int(hq)
        overrides["num_kv_heads"] = int(hkv)
    return request._replace(**overrides)


if __name__ == "__main__":
    sys.exit(main())
