"""`tokenspeed-kernel aot --target sm_90|gfx942|gfx950`: compile every registered Triton/Gluon
kernel for a GPU this machine does not have.

Each registered kernel lists `aot_cases` (shapes, see `KernelSpec`). For a target, every kernel
whose platforms admit the target's Platform runs on each of its cases with inputs built on the
CPU and that Platform faked. Every Triton/Gluon launch is intercepted instead of run: Triton's own
binder, built for the target's backend, yields exactly the signature, constexprs, divisibility
attributes and options the JIT would compile on that GPU, and each distinct specialization is
compiled once. So the signatures come from the kernels' real launches, never from hand-typed
tables, and the compiled code is what the GPU would run.

This catches compile errors, missing matrix instructions and shared-memory overflows without
hardware. It needs real `@triton.jit` functions: TRITON_INTERPRET must be unset before any kernel
module is imported (`main` refuses otherwise).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fnmatch
import hashlib
import json
import re
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ..platform import AOT_TARGETS, fake_platform, interpreting
from ..registry import KernelSpec, kernels, op_names
from ..testing.cases import attention_case, moe_case, store_case
from ..testing.conformance import moe_plan_for
from ..testing.inputs import AttentionShape, MoEShape, StoreShape
from ._common import format_table, write_json

_SHAPES = {
    "mha_prefill": AttentionShape,
    "mha_extend_with_kvcache": AttentionShape,
    "mha_decode_with_kvcache": AttentionShape,
    "kvcache_store": StoreShape,
    "moe_apply": MoEShape,
}
# Shared memory a block may use, to flag overflows the compiler does not reject.
_SHARED_LIMIT = {target: p.shared_memory_bytes for target, p in AOT_TARGETS.items()}


@dataclasses.dataclass(frozen=True)
class Launch:
    """One specialization as the JIT would compile it on the target."""

    kernel: str  # the registered kernel whose case launched it
    fn: Any  # the JITFunction
    signature: dict[str, str]
    constexprs: dict[Any, Any]
    attrs: dict[Any, Any]
    options: Any

    @property
    def key(self) -> str:
        parts = (self.fn.__name__, self.signature, self.constexprs, self.attrs, self.options)
        return repr(parts)

    @property
    def name(self) -> str:
        return f"{self.fn.__name__}-{hashlib.sha256(self.key.encode()).hexdigest()[:8]}"


def _target(target: str):
    from triton.backends.compiler import GPUTarget

    platform = AOT_TARGETS[target]
    if platform.vendor == "nvidia":
        return GPUTarget("cuda", platform.sm, 32)
    return GPUTarget("hip", platform.arch, 64)


@contextlib.contextmanager
def intercept_launches(target: str, kernel: str, into: list[Launch]) -> Iterator[None]:
    """Inside the block, Triton launches are recorded as `Launch`es for `target`, not run."""
    from triton import knobs
    from triton.compiler import ASTSource, make_backend
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
    from triton.runtime import jit

    gpu_target = _target(target)
    backend = make_backend(gpu_target)
    binders: dict[Any, Any] = {}
    original = jit.JITFunction.run

    # Mirrors JITFunction.run up to the compile, with the target's backend in place of the
    # driver's (this machine has no such GPU).
    def record(self, *args, grid, warmup, **kwargs):
        binder = binders.get(self)
        if binder is None:
            self.ASTSource = GluonASTSource if isinstance(self, GluonJITFunction) else ASTSource
            binder = binders[self] = jit.create_function_from_signature(
                self.signature, self.params, backend
            )
        kwargs["debug"] = kwargs.get("debug", self.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        bound, specialization, _ = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(
            backend, kwargs, bound, specialization, None
        )
        into.append(Launch(kernel, self, signature, constexprs, attrs, options))

    jit.JITFunction.run = record
    try:
        yield
    finally:
        jit.JITFunction.run = original


def case_shape(spec: KernelSpec, case: Mapping[str, Any]):
    fields = {k: v for k, v in case.items() if k != "targets"}
    return _SHAPES[spec.op](**fields)


def run_case_launches(spec: KernelSpec, case: Mapping[str, Any], target: str) -> list[Launch]:
    """The launches `spec` makes on `case` on `target` (inputs on the CPU, nothing runs)."""
    shape = case_shape(spec, case)
    launches: list[Launch] = []
    name = f"aot-{spec.name}"
    with fake_platform(AOT_TARGETS[target]), intercept_launches(target, spec.name, launches):
        if spec.op == "moe_apply":
            (config, weights, x), routing = moe_case(name, shape).build("cpu")
            plan = moe_plan_for(spec, config, shape.num_tokens, "cpu")
            prepared = spec.fn.prepare_weights(plan, weights)
            spec.fn.apply(plan, x, prepared, out=torch.empty_like(x), **routing)
        else:
            build = store_case if spec.op == "kvcache_store" else None
            case_obj = build(name, shape) if build else attention_case(name, spec.op, shape)
            args, kwargs = case_obj.build("cpu")
            spec.fn(*args, **kwargs)
    return launches


def compile_launch(launch: Launch, target: str) -> dict[str, Any]:
    """Compile one launch for `target`: its assembly by stage plus `shared` bytes."""
    import triton

    source = launch.fn.ASTSource(launch.fn, launch.signature, launch.constexprs, launch.attrs)
    compiled = triton.compile(source, target=_target(target), options=launch.options.__dict__)
    asm = {k: v for k, v in compiled.asm.items() if isinstance(v, str)}
    asm["shared"] = int(getattr(compiled.metadata, "shared", 0) or 0)
    return asm


def normalized_assembly(asm: Mapping[str, Any]) -> str:
    """PTX or AMDGCN without debug info (`.loc`, `.file`, comments, debug sections and scope
    labels), so two builds of the same kernel from edited sources compare equal."""
    text = asm.get("ptx") or asm.get("amdgcn") or ""
    lines = []
    for line in text.splitlines():
        if re.match(r"\s*\.section\s+\.debug", line):
            break
        stripped = line.strip()
        if stripped.startswith((".loc", ".file", "//", ";")):
            continue
        if stripped.startswith("$L__") and "debug" in stripped:
            continue
        # Debug scope labels: referenced only from the debug sections dropped above.
        if re.fullmatch(r"(\$L__tmp|\.Ltmp)\d+:", stripped):
            continue
        lines.append(line)
    return "\n".join(lines)


def summarize(launch: Launch, target: str, asm: Mapping[str, Any]) -> dict[str, Any]:
    """What the designs rely on and what they cost, read off the assembly."""
    text = asm.get("ptx", "") or asm.get("amdgcn", "")
    ttir = asm.get("ttir", "")
    row = dict(
        kernel=launch.kernel,
        fn=launch.fn.__name__,
        name=launch.name,
        target=target,
        constexprs={str(k): repr(v) for k, v in launch.constexprs.items()},
        num_warps=launch.options.num_warps,
        shared=asm["shared"],
        shared_limit=_SHARED_LIMIT[target],
        has_dot="tt.dot" in ttir or "warp_group_dot" in ttir,
        hash=hashlib.sha256(normalized_assembly(asm).encode()).hexdigest()[:16],
    )
    row.update(_ptx_stats(text) if "ptx" in asm else _amdgcn_stats(text))
    row["missing"] = [f for f in expected_features(launch.fn) if not row.get(f)]
    row["ok"] = row["shared"] <= row["shared_limit"] and not row["missing"]
    if row["missing"]:
        row["error"] = f"lacks {', '.join(row['missing'])}, which its module's AOT_EXPECT lists"
    return row


def expected_features(fn) -> tuple[str, ...]:
    """What the jit function's design relies on (`mfma`, `wgmma`, `buffer_load`, ... as row
    keys), from `AOT_EXPECT = {jit function name: features}` in the module defining it."""
    module = sys.modules.get(getattr(fn, "__module__", ""))
    return tuple(getattr(module, "AOT_EXPECT", {}).get(fn.__name__, ()))


def _ptx_stats(ptx: str) -> dict[str, Any]:
    return dict(
        wgmma="wgmma" in ptx,
        mma="mma.sync" in ptx or "wgmma" in ptx,
        # Registers -> shared memory: operand staging or a broadcast (not cp.async/TMA copies).
        shared_stores=ptx.count("st.shared"),
        ldmatrix="ldmatrix" in ptx,
        # Programmatic dependent launch: waits for the previous grid / lets the next one start.
        grid_wait="griddepcontrol.wait" in ptx,
        launch_dependents="griddepcontrol.launch_dependents" in ptx,
    )


_AMDGCN_NOTES = {
    "vgprs": r"; NumVgprs:\s+(\d+)",
    "agprs": r"; NumAgprs:\s+(\d+)",
    "scratch": r"; ScratchSize:\s+(\d+)",
    "occupancy": r"; Occupancy:\s+(\d+)",
    "vgpr_spills": r"\.vgpr_spill_count:\s+(\d+)",
}


def _amdgcn_stats(amdgcn: str) -> dict[str, Any]:
    stats: dict[str, Any] = {}
    for key, pattern in _AMDGCN_NOTES.items():
        match = re.search(pattern, amdgcn)
        stats[key] = int(match.group(1)) if match else 0
    ops = re.findall(r"^\s+(v_mfma\w*|buffer_\w+)", amdgcn, re.M)
    stats["mfma"] = sorted({op for op in ops if op.startswith("v_mfma")})
    stats["buffer_load"] = sum(op.startswith("buffer_load") for op in ops)
    stats["buffer_store"] = sum(op.startswith("buffer_store") for op in ops)
    # Direct-to-LDS: buffer/global loads with the `lds` modifier (gfx950).
    stats["lds_dma"] = len(re.findall(r"^\s+(?:buffer|global)_load\w*[^\n]*\blds\b", amdgcn, re.M))
    return stats


def applies(spec: KernelSpec, case: Mapping[str, Any], target: str) -> bool:
    targets = case.get("targets")
    if targets is not None and target not in targets:
        return False
    platform = AOT_TARGETS[target]
    return any(not p.mismatch(platform) for p in spec.platforms)


def check_target(target: str, pattern: str = "*", dump: Path | None = None) -> list[dict]:
    """Compile every specialization the matching kernels launch on `target`; one row each.
    Errors are reported in the row, not raised, so one broken kernel does not hide the others."""
    rows: list[dict] = []
    seen: set[str] = set()
    for op in op_names():
        for spec in kernels(op):
            if not fnmatch.fnmatch(spec.name, pattern):
                continue
            for case in (c for c in spec.aot_cases if applies(spec, c, target)):
                rows += _check_case(spec, case, target, seen, dump)
    return rows


def _failure(kernel: str, name: str, target: str, error: str) -> dict:
    return dict(kernel=kernel, name=name, target=target, ok=False, error=error[:2000])


def _check_case(spec, case, target, seen: set[str], dump: Path | None) -> list[dict]:
    try:
        launches = run_case_launches(spec, case, target)
    except Exception as exc:  # noqa: BLE001 - reported per case
        return [_failure(spec.name, str(dict(case)), target, f"{type(exc).__name__}: {exc}")]
    if not launches:
        return [_failure(spec.name, str(dict(case)), target, "the case launched no Triton kernel")]
    rows = []
    for launch in launches:
        if launch.key in seen:
            continue
        seen.add(launch.key)
        try:
            asm = compile_launch(launch, target)
        except Exception as exc:  # noqa: BLE001 - reported per specialization
            rows.append(_failure(spec.name, launch.name, target, f"{type(exc).__name__}: {exc}"))
            continue
        rows.append(summarize(launch, target, asm))
        if dump is not None:
            (dump / f"{target}__{launch.name}.txt").write_text(normalized_assembly(asm))
    return rows


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "aot",
        help="compile every registered Triton/Gluon kernel for a GPU this machine lacks",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("--target", action="append", required=True, choices=sorted(AOT_TARGETS))
    p.add_argument("--kernel", default="*", help="glob over kernel names (default: all)")
    p.add_argument("--json", type=Path, help="write every row to this JSON file")
    p.add_argument("--dump", type=Path, help="write each normalized assembly and index.json here")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if interpreting():
        print("aot: TRITON_INTERPRET=1 makes kernels interpreted functions; unset it and rerun")
        return 2
    if args.dump is not None:
        args.dump.mkdir(parents=True, exist_ok=True)
    rows = [r for t in args.target for r in check_target(t, args.kernel, args.dump)]
    if args.dump is not None:
        index = {f"{r['target']}/{r['name']}": r.get("hash", "ERR") for r in rows}
        (args.dump / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True))
    if args.json is not None:
        write_json(args.json, {"rows": rows})
    if not rows:
        print(f"aot: no kernel matching {args.kernel!r} has AOT cases for {args.target}")
        return 1
    _print(rows)
    return 1 if any(not r["ok"] for r in rows) else 0


def _matrix(row: dict) -> str:
    if row.get("wgmma"):
        return "wgmma"
    if row.get("mma"):
        return "mma"
    return ",".join(row.get("mfma") or [])


def _print(rows: list[dict]) -> None:
    table = [
        [
            r["target"],
            r["kernel"],
            r["name"],
            "ok" if r["ok"] else "FAIL",
            str(r.get("shared", "")),
            _matrix(r),
            r.get("error", "")[:80],
        ]
        for r in rows
    ]
    print(
        format_table(["target", "kernel", "specialization", "", "smem", "matrix", "error"], table)
    )
    print(f"{sum(r['ok'] for r in rows)} compiled, {sum(not r['ok'] for r in rows)} failed")
