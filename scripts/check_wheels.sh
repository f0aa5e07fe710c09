#!/usr/bin/env bash
# Build the three wheels, install them with plain pip into a fresh venv, and run the CPU tests
# from a copy of tests/ outside the workspace (so only the installed wheels are imported).
#
#   bash scripts/check_wheels.sh
#       torch and triton: the newest PyPI has within the wheels' declared ranges (CI job
#       `wheels`; torch from PyPI is a multi-GB CUDA build).
#   bash scripts/check_wheels.sh --borrow-torch-from .venv/bin/python
#       offline: torch, triton, numpy and pytest come from that environment (made visible to
#       the fresh venv through a .pth file); pip still resolves core from the local wheel set.
#
# Extra arguments after `--` go to pytest (default: the tests below).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
python=${PYTHON:-python3}
borrow=""
if [[ "${1:-}" == "--borrow-torch-from" ]]; then
    borrow=$2
    shift 2
fi
[[ "${1:-}" == "--" ]] && shift
tests=("$@")
if [[ ${#tests[@]} -eq 0 ]]; then
    # Every CPU test that imports only the installed packages; tests/tools needs the repo's
    # benchmarks and uv, the full Triton-interpreter suite is .ci/run's.
    tests=(tests/core tests/amd/test_amd_registration.py tests/triton/test_kvcache_store.py
        tests/triton/test_bad_inputs_probe.py)
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m uv --version >/dev/null 2>&1 || "$python" -m pip install --quiet uv
"$python" -m uv build --all-packages --wheel --quiet -o "$work/wheels"
ls "$work/wheels"

# The built wheels by path: PyPI has unrelated releases under some of these names (a
# tokenspeed-kernel-amd 0.1.4), which a bare requirement name would let pip prefer.
ours=("$work"/wheels/tokenspeed_kernel_{core,triton,amd}-*.whl)

"$python" -m venv "$work/venv"
venv_python="$work/venv/bin/python"
pip=("$venv_python" -m pip install --quiet --disable-pip-version-check)
if [[ -n "$borrow" ]]; then
    site=$("$venv_python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    borrowed="$work/borrowed"
    mkdir "$borrowed"
    # Everything but the workspace's own (editable) packages.
    for entry in $("$borrow" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/*; do
        case "$(basename "$entry")" in
            *tokenspeed* | *.pth) ;;
            *) ln -s "$entry" "$borrowed/" ;;
        esac
    done
    echo "$borrowed" >"$site/borrowed.pth"
    "${pip[@]}" --no-index "${ours[@]}"
else
    # numpy: the Triton 3.6 interpreter (the CPU tests) breaks with numpy 2.4.
    "${pip[@]}" "${ours[@]}" pytest "numpy<2.4"
fi
"$venv_python" -m pip list --disable-pip-version-check 2>/dev/null |
    grep -Ei '^(torch|triton|numpy|tokenspeed-kernel)' || true

# The tests, the root conftest.py (TRITON_INTERPRET on a CPU) and the pytest settings, away
# from the workspace sources.
mkdir "$work/run"
cp -r tests conftest.py pyproject.toml "$work/run/"
cd "$work/run"
"$venv_python" - <<'PY'
import tokenspeed_kernel, tokenspeed_kernel_amd, tokenspeed_kernel_triton
for module in (tokenspeed_kernel, tokenspeed_kernel_amd, tokenspeed_kernel_triton):
    assert "/src/" not in module.__file__, f"{module.__name__} imported from {module.__file__}"
print("imports from the installed wheels")
PY
"$venv_python" -m pytest -q -p no:cacheprovider "${tests[@]}"
echo "wheels OK ($repo, ${SECONDS} s)"
