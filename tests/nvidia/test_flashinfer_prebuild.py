"""`python -m tokenspeed_kernel_nvidia.flashinfer.prebuild` on the CPU, against a stand-in of
FlashInfer's JIT (flashinfer.jit.fused_moe / flashinfer.jit.env as 0.6.14 and 0.7.x lay them
out): the spec is FlashInfer's sm_90 CUTLASS MoE, extra header and library directories reach
FlashInfer's FLASHINFER_EXTRA_* flags before the spec is made, the job count reaches ninja
through MAX_JOBS, and the linked library lands where FlashInfer loads prebuilt modules from."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest

from tokenspeed_kernel_nvidia.flashinfer import prebuild

FLAG_VARS = ("FLASHINFER_EXTRA_CFLAGS", "FLASHINFER_EXTRA_CUDAFLAGS", "FLASHINFER_EXTRA_LDFLAGS")


class FakeSpec:
    """JitSpec's surface prebuild uses: name, sources, build_dir, jit_library_path, build()."""

    def __init__(self, jit_dir: Path, env_at_creation: dict):
        self.name = "fused_moe_90"
        self.sources = [Path("a.cu"), Path("b.cu")]
        self.build_dir = jit_dir / self.name
        self.jit_library_path = self.build_dir / f"{self.name}.so"
        self.env_at_creation = env_at_creation
        self.builds = []

    def build(self, verbose):
        self.builds.append((verbose, os.environ.get("MAX_JOBS")))
        self.build_dir.mkdir(parents=True, exist_ok=True)
        self.jit_library_path.write_bytes(b"\x7fELF module")


@pytest.fixture
def clean_env(monkeypatch):
    for name in (*FLAG_VARS, "MAX_JOBS", "FLASHINFER_CUDA_ARCH_LIST"):
        # setenv first: monkeypatch then restores the variable's original state at teardown,
        # undoing what prebuild writes into os.environ too.
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


@pytest.fixture
def fake_flashinfer(tmp_path, monkeypatch, clean_env):
    specs = []

    def gen_cutlass_fused_moe_sm90_module():
        names = (*FLAG_VARS, "FLASHINFER_CUDA_ARCH_LIST")
        specs.append(FakeSpec(tmp_path / "jit", {k: os.environ.get(k) for k in names}))
        return specs[-1]

    package = types.ModuleType("flashinfer")
    jit = types.ModuleType("flashinfer.jit")
    fused_moe = types.ModuleType("flashinfer.jit.fused_moe")
    fused_moe.gen_cutlass_fused_moe_sm90_module = gen_cutlass_fused_moe_sm90_module
    env = types.ModuleType("flashinfer.jit.env")
    env.FLASHINFER_AOT_DIR = tmp_path / "site" / "flashinfer" / "data" / "aot"
    jit.fused_moe, jit.env, package.jit = fused_moe, env, jit
    for module in (package, jit, fused_moe, env):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    return specs, env.FLASHINFER_AOT_DIR


def test_installs_where_flashinfer_loads_prebuilt_modules(fake_flashinfer):
    specs, aot_dir = fake_flashinfer
    assert prebuild.main(["--jobs", "3"]) == 0
    (spec,) = specs
    assert spec.builds == [(False, "3")]
    installed = aot_dir / "fused_moe_90" / "fused_moe_90.so"
    assert installed.read_bytes() == b"\x7fELF module"
    # No GPU is probed: the arch list is set before FlashInfer makes the spec.
    assert spec.env_at_creation["FLASHINFER_CUDA_ARCH_LIST"] == "9.0a"


def test_extra_dirs_reach_flashinfer_flags_before_the_spec(fake_flashinfer, tmp_path, monkeypatch):
    specs, aot_dir = fake_flashinfer
    monkeypatch.setenv("FLASHINFER_EXTRA_LDFLAGS", "-Wl,--as-needed")
    out = tmp_path / "out"
    argv = ["--include", "/opt/cu13/include", "--lib", "/opt/cu13/lib", "--out", str(out)]
    assert prebuild.main(argv) == 0
    env = specs[0].env_at_creation
    assert env["FLASHINFER_EXTRA_CFLAGS"] == "-isystem /opt/cu13/include"
    assert env["FLASHINFER_EXTRA_CUDAFLAGS"] == "-isystem /opt/cu13/include"
    assert env["FLASHINFER_EXTRA_LDFLAGS"] == "-Wl,--as-needed -L/opt/cu13/lib"
    assert (out / "fused_moe_90" / "fused_moe_90.so").exists()
    assert not aot_dir.exists()


def test_without_flashinfer_says_what_to_install(monkeypatch, capsys, clean_env):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    monkeypatch.setitem(sys.modules, "flashinfer.jit", None)
    monkeypatch.setitem(sys.modules, "flashinfer.jit.fused_moe", None)
    assert prebuild.main([]) == 2
    assert "tokenspeed-kernel-nvidia[flashinfer]" in capsys.readouterr().err
