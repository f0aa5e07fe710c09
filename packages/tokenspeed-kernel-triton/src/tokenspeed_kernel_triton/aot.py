"""Ahead-of-time compile check: build every kernel's representative specializations for GPUs
this machine does not have (sm_90, gfx942, gfx950), to catch compile errors, missing matrix
instructions and shared-memory overflows without hardware.

Each kernel module listed in `AOT_KERNELS` exposes `aot_specs(kind: DeviceKind) ->
list[AotSpec]`, built with the same config heuristic its launcher uses on that device.
Compiling needs real `@triton.jit` functions: run this in a process where TRITON_INTERPRET is
unset (scripts/aot_check.py does).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from triton.backends.compiler import GPUTarget

from .attention._common import DeviceKind

# Modules (relative to this package) whose kernels the check compiles.
AOT_KERNELS: list[str] = [
    "attention.prefill",
    "attention.extend",
    "attention.decode",
    "attention.kvcache_store",
    "moe.routing",
    "moe.grouped_gemm",
    "moe.wgmma_gemm",
    "moe.quant",
    "moe.combine",
]

TARGETS: dict[str, tuple[GPUTarget, DeviceKind]] = {
    "sm_90": (GPUTarget("cuda", 90, 32), DeviceKind("nvidia", "sm_90", 90, 132)),
    "gfx942": (GPUTarget("hip", "gfx942", 64), DeviceKind("amd", "gfx942", 0, 304)),
    "gfx950": (GPUTarget("hip", "gfx950", 64), DeviceKind("amd", "gfx950", 0, 256)),
}

# Shared memory (LDS) a workgroup may use, per target.
SHARED_LIMIT = {"sm_90": 232448, "gfx942": 65536, "gfx950": 163840}


@dataclass(frozen=True)
class AotSpec:
    """One specialization: the jit function, its argument types (`"*bf16"`, `"i32"`,
    `"fp32"`, ...; constexpr arguments are left out), constexpr values and launch options."""

    name: str
    fn: Any
    signature: dict[str, str]
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int
    options: dict[str, Any] = field(default_factory=dict)
    # Integer/pointer arguments the launcher guarantees divisible by 16 (Triton's JIT specializes
    # on that at run time; AOT has to be told).
    divisible: tuple[str, ...] = ()


def compile_for(
    kernel_jit_fn,
    signature: dict,
    constexprs: dict,
    target: str,
    *,
    num_warps: int = 4,
    num_stages: int = 2,
    divisible: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Compile one specialization for `target` ("sm_90", "gfx942", "gfx950").

    Returns the assembly by stage (`ptx`/`amdgcn`, `ttgir`, ...) plus `shared` (bytes of
    shared memory) and `n_regs`/`n_spills` where the backend reports them.
    """
    import triton
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

    if target not in TARGETS:
        raise ValueError(f"compile_for: target is {target!r}, expected one of {', '.join(TARGETS)}")
    gpu_target, _ = TARGETS[target]
    full_signature = dict(signature)
    for name in constexprs:
        full_signature[name] = "constexpr"
    names = list(signature)
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    if isinstance(kernel_jit_fn, GluonJITFunction):
        source = GluonASTSource(kernel_jit_fn, full_signature, constexprs, attrs)
    else:
        source = triton.compiler.ASTSource(
            fn=kernel_jit_fn, signature=full_signature, constexprs=constexprs, attrs=attrs
        )
    compiled = triton.compile(
        source, target=gpu_target, options={"num_warps": num_warps, "num_stages": num_stages}
    )
    result: dict[str, Any] = {k: v for k, v in compiled.asm.items() if isinstance(v, str)}
    result["shared"] = int(getattr(compiled.metadata, "shared", 0) or 0)
    return result


def specs_for(target: str) -> list[AotSpec]:
    """Every registered module's specializations for `target`."""
    _, kind = TARGETS[target]
    specs: list[AotSpec] = []
    for module in AOT_KERNELS:
        mod = importlib.import_module(f"{__package__}.{module}")
        specs.extend(mod.aot_specs(kind))
    return specs


def check_target(target: str) -> list[dict[str, Any]]:
    """Compile every spec for `target`; one summary row per spec (errors are reported, not
    raised, so one broken kernel does not hide the others)."""
    rows = []
    for spec in specs_for(target):
        row: dict[str, Any] = {"name": spec.name, "target": target}
        try:
            asm = compile_for(
                spec.fn,
                spec.signature,
                spec.constexprs,
                target,
                num_warps=spec.num_warps,
                num_stages=spec.num_stages,
                divisible=spec.divisible,
            )
        except Exception as exc:  # noqa: BLE001 - reported per spec
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
            rows.append(row)
            continue
        text = asm.get("ptx", "") or asm.get("amdgcn", "")
        row.update(
            ok=True,
            # Kernels with a tl.dot must lower it to the matrix units; reductions and copies
            # have none to check.
            has_dot="tt.dot" in asm.get("ttir", "") or "warp_group_dot" in asm.get("ttir", ""),
            shared=asm["shared"],
            shared_limit=SHARED_LIMIT[target],
            wgmma="wgmma" in text,
            mma="mma.sync" in text or "wgmma" in text,
            mfma="v_mfma" in text,
            # Registers -> shared memory (how many st.shared): operand staging for the MMA, or
            # a scalar broadcast (not cp.async/TMA copies, nor wgmma's shared-memory reads).
            shared_stores=text.count("st.shared"),
            ldmatrix="ldmatrix" in text,
            # Programmatic dependent launch: waits for the previous kernel / lets the next start.
            grid_wait="griddepcontrol.wait" in text,
            launch_dependents="griddepcontrol.launch_dependents" in text,
        )
        rows.append(row)
    return rows
