#!/usr/bin/env bash
# Build the core and nvidia wheels, install them with plain pip into a fresh venv with the
# [fa3,flashinfer] extras (resolved from PyPI), and check from outside the workspace that the
# installed package imports, registers every adapter, sees both libraries (versions in range,
# imports working) and that selection/explain list them; then run the nvidia CPU tests there.
#
#   bash scripts/check_nvidia_wheel.sh
#       torch: the newest PyPI has within the wheels' range (a multi-GB CUDA build).
#   bash scripts/check_nvidia_wheel.sh --borrow-torch-from .venv/bin/python
#       torch, triton, numpy and pytest come from that environment (a .pth file makes them
#       visible); pip still installs core and nvidia from the local wheels and the extras'
#       libraries (tokenspeed-fa3, flashinfer-python and their dependencies) from PyPI.
#
# Without a GPU the kernels cannot run here: the check is installation, import, registration,
# the version/import verdicts and selection on a faked H100/B200.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
borrow=""
if [[ "${1:-}" == "--borrow-torch-from" ]]; then
    borrow=$2
    shift 2
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m uv --version >/dev/null 2>&1 || "$python" -m pip install --quiet uv
for package in tokenspeed-kernel-core tokenspeed-kernel-nvidia; do
    "$python" -m uv build --package "$package" --wheel --quiet -o "$work/wheels"
done
ls "$work/wheels"

"$python" -m venv "$work/venv"
venv_python="$work/venv/bin/python"
pip=("$venv_python" -m pip install --quiet --disable-pip-version-check)
if [[ -n "$borrow" ]]; then
    site=$("$venv_python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    borrowed="$work/borrowed"
    mkdir "$borrowed"
    for entry in $("$borrow" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/*; do
        case "$(basename "$entry")" in
            *tokenspeed* | *.pth) ;;
            *) ln -s "$entry" "$borrowed/" ;;
        esac
    done
    echo "$borrowed" >"$site/borrowed.pth"
fi
core=$(ls "$work"/wheels/tokenspeed_kernel_core-*.whl)
nvidia=$(ls "$work"/wheels/tokenspeed_kernel_nvidia-*.whl)
"${pip[@]}" --find-links "$work/wheels" "$core" "${nvidia}[fa3,flashinfer]" pytest
"$venv_python" -m pip list --disable-pip-version-check 2>/dev/null |
    grep -Ei '^(torch|flashinfer-python|tokenspeed|apache-tvm-ffi) ' || true

mkdir "$work/run"
cp -r tests conftest.py pyproject.toml "$work/run/"
cd "$work/run"
"$venv_python" - <<'PY'
import torch

import tokenspeed_kernel
import tokenspeed_kernel_nvidia
from tokenspeed_kernel import explain
from tokenspeed_kernel.ops.attention.request import AttentionRequest
from tokenspeed_kernel.platform import KNOWN_PLATFORMS
from tokenspeed_kernel.plugins import load_plugins
from tokenspeed_kernel_nvidia._library import FA3, FLASHINFER

for module in (tokenspeed_kernel, tokenspeed_kernel_nvidia):
    assert "/src/" not in module.__file__, f"{module.__name__} imported from {module.__file__}"
print("imports from the installed wheels")
result = next(r for r in load_plugins() if r.name == "nvidia")
assert result.status == "loaded", result.error
print("nvidia plugin registered:", ", ".join(result.kernels))
for library in (FA3, FLASHINFER):
    verdict = library.verdict()
    print(f"{library.distribution} {library.installed_version()}: {verdict.reason}")
    assert verdict.ok, verdict.reason
request = AttentionRequest(
    dtype=torch.bfloat16, kv_dtype=torch.bfloat16, head_dim=64, num_q_heads=64,
    num_kv_heads=8, page_size=64, q_len=1, causal=True, window_left=-1, sinks=True, lse=False,
)
for gpu in ("h100", "b200"):
    explanation = explain("mha_decode_with_kvcache", request, KNOWN_PLATFORMS[gpu])
    print(explanation)
    accepted = {c.name for c in explanation.candidates if c.accepted}
    want = {"h100": {"fa3.mha_decode_with_kvcache", "flashinfer.mha_decode_with_kvcache.xqa"},
            "b200": {"flashinfer.mha_decode_with_kvcache.trtllm_gen"}}[gpu]
    assert want <= accepted, f"{gpu}: {want - accepted} not accepted"
PY
# The CuTe DSL kernels need the [cute] extra, which this check does not install.
"$venv_python" -m pytest -q -p no:cacheprovider tests/nvidia --ignore-glob="*test_cute_*"
echo "nvidia wheel with [fa3,flashinfer] OK"
