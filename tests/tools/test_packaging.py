"""Packaging: the declared dependency ranges are the ones the lock tests, a kernel on an
untested Triton declines with a reason, and the vendor wheels install from a local wheel set
(core + one vendor wheel) and register their kernels. The full install with plain pip and the
newest torch/triton from PyPI is scripts/check_wheels.sh (CI job `wheels`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import types
import zipfile
from pathlib import Path

import pytest
import tomllib

from tokenspeed_kernel import toolchain

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("core", "triton", "amd")


def _dependencies(package: str) -> dict[str, str]:
    project = tomllib.loads(
        (ROOT / f"packages/tokenspeed-kernel-{package}/pyproject.toml").read_text()
    )
    deps = {}
    for requirement in project["project"]["dependencies"]:
        name = requirement.split(">")[0].split("<")[0].split("=")[0].strip()
        deps[name] = requirement[len(name) :]
    return deps


def _locked_version(name: str) -> str:
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    return next(p["version"] for p in lock["package"] if p["name"] == name)


def _within(version: str, spec: str) -> bool:
    as_tuple = lambda text: tuple(int(x) for x in text.split("+")[0].split(".")[:2])  # noqa: E731
    low, high = (part.lstrip("<>=") for part in spec.split(","))
    return as_tuple(low) <= as_tuple(version) < as_tuple(high)


@pytest.mark.parametrize("package", ("triton", "amd"))
def test_vendor_wheels_declare_the_locked_triton_and_torch(package):
    deps = _dependencies(package)
    assert deps["triton"] == toolchain.TESTED_TRITON
    assert _within(_locked_version("triton"), deps["triton"])
    assert _within(_locked_version("torch"), deps["torch"])
    assert deps["tokenspeed-kernel-core"] == ">=0.1.0,<0.2"


def test_core_declares_the_locked_torch():
    assert _within(_locked_version("torch"), _dependencies("core")["torch"])


def _fake_triton(monkeypatch, version: str) -> None:
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__=version))
    toolchain.triton_support.cache_clear()


def test_a_kernel_needing_missing_gluon_names_declines_on_an_untested_triton(monkeypatch):
    import triton.experimental.gluon.language  # noqa: F401  (the real Gluon names)

    _fake_triton(monkeypatch, "3.6.0")
    assert toolchain.triton_support("no_such_name").ok  # the tested release is trusted
    _fake_triton(monkeypatch, "3.8.0")
    verdict = toolchain.triton_support("thread_barrier", "no_such_name")
    assert not verdict.ok
    assert verdict.reason == (
        "triton 3.8.0 lacks gluon.language.no_such_name (tested: triton>=3.6,<3.7)"
    )
    _fake_triton(monkeypatch, "3.8.0")
    verdict = toolchain.triton_support("thread_barrier")
    assert verdict.ok and "untested" in verdict.reason
    toolchain.triton_support.cache_clear()


def _uv() -> str | None:
    # `uv run` exports UV: the uv that runs this test session.
    return os.environ.get("UV") or shutil.which("uv")


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    uv = _uv()
    if uv is None:
        pytest.skip("uv is not on PATH (run under `uv run pytest`)")
    out = tmp_path_factory.mktemp("wheels")
    subprocess.run(
        [uv, "build", "--all-packages", "--wheel", "-q", "-o", str(out)],
        cwd=ROOT,
        check=True,
        timeout=300,
    )
    return out


def test_vendor_wheel_metadata_names_core(wheels):
    for package in ("triton", "amd"):
        (wheel,) = wheels.glob(f"tokenspeed_kernel_{package}-*.whl")
        with zipfile.ZipFile(wheel) as archive:
            metadata = next(n for n in archive.namelist() if n.endswith("METADATA"))
            requires = [
                line.split(":", 1)[1].strip()
                for line in archive.read(metadata).decode().splitlines()
                if line.startswith("Requires-Dist:")
            ]
        assert "tokenspeed-kernel-core<0.2,>=0.1.0" in requires
        assert "triton<3.7,>=3.6" in requires


def test_core_and_amd_wheels_alone_import_and_register(wheels, tmp_path):
    """Core + the amd wheel from the local wheel set, offline, into a fresh venv that sees this
    environment's torch and triton but not the workspace sources."""
    uv = _uv()
    venv = tmp_path / "venv"
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    python = venv / "bin" / "python"
    found = [str(w) for p in ("core", "amd") for w in wheels.glob(f"tokenspeed_kernel_{p}-*.whl")]
    subprocess.run(
        [
            uv,
            "pip",
            "install",
            "-q",
            "--offline",
            "--no-index",
            "--no-deps",
            "--python",
            str(python),
            *found,
        ],
        check=True,
        timeout=120,
    )
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # torch and triton from this environment, without its workspace packages (their editable
    # dist-infos would announce entry points whose sources are not here).
    borrowed = tmp_path / "borrowed"
    borrowed.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if "tokenspeed" not in entry.name and not entry.name.endswith(".pth"):
            (borrowed / entry.name).symlink_to(entry)
    Path(site, "borrowed.pth").write_text(f"{borrowed}\n")
    script = (
        "import tokenspeed_kernel, tokenspeed_kernel_amd\n"
        "from tokenspeed_kernel import plugins, registry\n"
        "assert '/src/' not in tokenspeed_kernel.__file__, tokenspeed_kernel.__file__\n"
        "assert '/src/' not in tokenspeed_kernel_amd.__file__\n"
        "print([(r.name, r.status) for r in plugins.load_plugins()])\n"
        "print(sorted(n for n in registry.registered_names() if n.startswith('amd.')))\n"
    )
    done = subprocess.run(
        [python, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")},
    )
    assert done.returncode == 0, done.stderr
    assert "[('amd', 'loaded')]" in done.stdout
    assert "'amd.moe_apply'" in done.stdout and "'amd.mha_decode_with_kvcache'" in done.stdout
