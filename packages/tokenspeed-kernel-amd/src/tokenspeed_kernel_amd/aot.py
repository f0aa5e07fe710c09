"""Ahead-of-time compilation of the Gluon kernels for gfx942/gfx950 on any machine (no GPU).

Each kernel module lists its representative specializations in `aot_specs(arch)`, built with
the same config heuristic its launcher uses. `compile_spec` runs `triton.compile` on a
`GluonASTSource` for `GPUTarget("hip", arch, 64)`; `isa_stats` reads what the design relies on
(MFMA, buffer operations, direct-to-LDS loads) and the resource use (VGPRs, AGPRs, LDS, scratch,
spills, waves per SIMD) from the AMDGCN assembly.

Compiling needs the real Gluon JIT functions: run it in a process without TRITON_INTERPRET
(`scripts/aot_check_amd.py` does). Kept separate from any other package's AOT helper: this
package depends on torch and triton only.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from typing import Any

# Modules (relative to this package) whose kernels are compiled ahead of time.
AOT_MODULES: list[str] = [
    "attention.prefill",
    "attention.extend",
    "attention.decode",
    "moe.grouped_gemm",
    "moe.tiny_batch",
]

ARCHS = ("gfx942", "gfx950")
# Per-CU limits used to turn register and LDS use into waves per SIMD.
LDS_BYTES = {"gfx942": 64 * 1024, "gfx950": 160 * 1024}
MAX_WAVES_PER_SIMD = 8
SIMDS_PER_CU = 4


@dataclass(frozen=True)
class AotSpec:
    """One specialization: argument types (`"*bf16"`, `"i32"`, `"fp32"`; constexprs left out),
    constexpr values, launch options, and the ISA features its design relies on."""

    name: str
    fn: Any
    signature: dict[str, str]
    constexprs: dict[str, Any]
    num_warps: int
    expect: tuple[str, ...] = ("mfma", "buffer_load")
    divisible: tuple[str, ...] = ()  # args known to be multiples of 16 (pointers: 16-byte)
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def compile_spec(spec: AotSpec, arch: str):
    """`triton.compile` the spec for `arch` ("gfx942", "gfx950", or "sm_90" for the NVIDIA
    instantiation); returns the CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    if arch.startswith("sm_"):
        target = GPUTarget("cuda", int(arch[3:]), 32)
    elif arch in ARCHS:
        target = GPUTarget("hip", arch, 64)
    else:
        raise ValueError(f"compile_spec: arch is {arch!r}, expected one of {ARCHS} or sm_NN")
    signature = dict(spec.signature)
    names = list(spec.signature)
    for name in spec.constexprs:
        signature[name] = "constexpr"
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in spec.divisible}
    source = GluonASTSource(spec.fn, signature, spec.constexprs, attrs)
    return triton.compile(source, target=target, options={"num_warps": spec.num_warps})


_NOTES = {
    "vgprs": r"; NumVgprs:\s+(\d+)",
    "agprs": r"; NumAgprs:\s+(\d+)",
    "total_vgprs": r"; TotalNumVgprs:\s+(\d+)",
    "sgprs": r"; TotalNumSgprs:\s+(\d+)",
    "scratch": r"; ScratchSize:\s+(\d+)",
    "occupancy": r"; Occupancy:\s+(\d+)",
    "vgpr_spills": r"\.vgpr_spill_count:\s+(\d+)",
    "sgpr_spills": r"\.sgpr_spill_count:\s+(\d+)",
}


def isa_stats(amdgcn: str, arch: str, num_warps: int, lds: int) -> dict[str, Any]:
    """Resources and relied-on instructions of one compiled kernel, from the assembler's kernel
    notes and metadata in its AMDGCN text; `lds` is the workgroup's LDS bytes (Triton passes
    it at launch, so the assembly's own group segment size is 0)."""
    stats: dict[str, Any] = {}
    for key, pattern in _NOTES.items():
        match = re.search(pattern, amdgcn)
        stats[key] = int(match.group(1)) if match else 0
    stats["lds"] = lds
    ops = re.findall(r"^\s+(v_mfma\w*|buffer_\w+)", amdgcn, re.M)
    stats["mfma"] = sorted({op for op in ops if op.startswith("v_mfma")})
    stats["buffer_load"] = sum(op.startswith("buffer_load") for op in ops)
    stats["buffer_store"] = sum(op.startswith("buffer_store") for op in ops)
    # Direct-to-LDS: buffer/global loads with the `lds` modifier (gfx950: 128 bits per lane).
    stats["lds_dma"] = len(re.findall(r"^\s+(?:buffer|global)_load\w*[^\n]*\blds\b", amdgcn, re.M))
    stats["waves_per_simd"] = waves_per_simd(stats, arch, num_warps)
    return stats


def waves_per_simd(stats: dict[str, Any], arch: str, num_warps: int) -> int:
    """Occupancy estimate: the compiler's register-limited occupancy (VGPR+AGPR file, 8-wave
    cap), further limited by the workgroups whose LDS fits in one CU (a workgroup's waves
    spread over the CU's 4 SIMDs)."""
    waves = stats["occupancy"] or MAX_WAVES_PER_SIMD
    if stats["lds"]:
        groups_per_cu = LDS_BYTES[arch] // stats["lds"]
        waves = min(waves, max(groups_per_cu * num_warps // SIMDS_PER_CU, 0))
    return waves


def specs(arch: str, modules: list[str] | None = None) -> list[AotSpec]:
    """The specializations of `modules` (default: every module of AOT_MODULES) for `arch`."""
    out: list[AotSpec] = []
    for module in AOT_MODULES if modules is None else modules:
        out.extend(importlib.import_module(f"{__package__}.{module}").aot_specs(arch))
    return out


def check(spec: AotSpec, arch: str) -> dict[str, Any]:
    """Compile `spec` for `arch` and summarize; errors are reported in the row, not raised."""
    row: dict[str, Any] = {"name": spec.name, "arch": arch, "notes": spec.notes}
    try:
        compiled = compile_spec(spec, arch)
    except Exception as exc:  # noqa: BLE001 - one broken kernel must not hide the others
        row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:3000])
        return row
    amdgcn = compiled.asm.get("amdgcn", "")
    stats = isa_stats(amdgcn, arch, spec.num_warps, int(compiled.metadata.shared))
    missing = [feat for feat in spec.expect if not stats.get(feat)]
    row.update(ok=not missing, missing=missing, **stats)
    return row
