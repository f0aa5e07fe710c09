#!/usr/bin/env bash
# Compile check of FlashInfer's trtllm-gen attention (`flashinfer.mha_decode_with_kvcache.
# trtllm_gen`, sm_100/sm_103) on a machine with nvcc and no GPU: fetch flashinfer-python,
# apache-tvm-ffi and flashinfer-cubin, extract from the cubin wheel only the trtllm-gen FMHA
# artifact directory that the installed FlashInfer names (ArtifactPath.TRTLLM_GEN_FMHA),
# install FlashInfer into a scratch target dir beside this repo's torch, and run
# tests/nvidia/test_trtllm_gen_build.py against that directory: the JIT module built for
# sm_100a with nvcc, a decode kernel in the cubin table for every combination the adapter
# declares, and those cubins present with their recorded sha256. Nothing runs on a GPU.
#
#   bash scripts/check_trtllm_gen_build.sh [--wheels DIR]... [--cache DIR] [-- PYTEST_ARGS...]
#
#   --wheels DIR  wheels already downloaded (repeatable): looked up there first, without an
#                 index; whatever is not found there is downloaded from PyPI.
#   --cache DIR   downloads (0.5 GB) and the extracted cubins (1.6 GB), kept between runs
#                 (default ${XDG_CACHE_HOME:-~/.cache}/tokenspeed_kernel/trtllm_gen_check).
#   PYTHON        interpreter with torch that runs the test (default: .venv/bin/python).
#   PIP           pip command used to fetch and install (default: PYTHON -m pip, else
#                 python3 -m pip); wheels are chosen for PYTHON's version whichever runs pip.
#
# flashinfer-cubin is published up to 0.6.13 while the adapter accepts flashinfer-python from
# 0.6.14. The cubin wheel is not installed (FlashInfer would then insist on equal versions):
# its FMHA directory is extracted and named by FLASHINFER_CUBIN_DIR. Which cubin release serves
# is decided by content: the directory must be the one ArtifactPath names, and its checksums.txt
# must hash to CheckSumHash (the build checks that, with downloads disabled).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

FLASHINFER_VERSION=0.6.14
TVM_FFI_VERSION=0.1.10
CUBIN_VERSION=0.6.13

wheel_dirs=()
cache=${XDG_CACHE_HOME:-$HOME/.cache}/tokenspeed_kernel/trtllm_gen_check
while [[ $# -gt 0 ]]; do
    case "$1" in
        --wheels) wheel_dirs+=("$(cd "$2" && pwd)"); shift 2 ;;
        --cache) cache=$2; shift 2 ;;
        --) shift; break ;;
        *) echo "unknown argument $1 (expected --wheels DIR, --cache DIR or -- PYTEST_ARGS)" >&2
           exit 2 ;;
    esac
done

python=${PYTHON:-$repo/.venv/bin/python}
if [[ -n "${PIP:-}" ]]; then
    read -r -a pip <<<"$PIP"
elif "$python" -m pip --version >/dev/null 2>&1; then
    pip=("$python" -m pip)
else
    pip=(python3 -m pip)
fi
nvcc=$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")
[[ -x "$nvcc" ]] ||
    { echo "nvcc not found (PATH or \$CUDA_HOME/bin): the check compiles with it" >&2; exit 1; }
# FlashInfer takes the toolkit root from CUDA_HOME, else from where `nvcc` is found: a wrapper
# script on PATH (/usr/local/bin/nvcc) would point it at /usr/local, so ask nvcc itself.
if [[ -z "${CUDA_HOME:-}${CUDA_PATH:-}" ]]; then
    top=$("$nvcc" --dryrun -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p')
    CUDA_HOME=$(cd "${top:-$(dirname "$nvcc")/..}" && pwd -P)
    export CUDA_HOME
fi
"$python" -c "import torch" ||
    { echo "$python cannot import torch: set PYTHON to an interpreter with torch" >&2; exit 1; }
pyver=$("$python" -c "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')")

mkdir -p "$cache/wheels"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
quiet=(--quiet --disable-pip-version-check)
# Binary wheels for PYTHON's version, whichever interpreter runs pip.
binary=(--only-binary=:all: --python-version "$pyver")
find_links=()
for dir in "${wheel_dirs[@]}"; do
    find_links+=(--find-links "$dir")
done

# fetch DEST [--no-deps] REQUIREMENT...: wheels into DEST, from the --wheels dirs alone when
# they hold them all, else from the index as well (which pip then prefers: hence one call per
# pinned wheel below, so that a wheel found locally is never downloaded).
fetch() {
    local dest=$1
    shift
    if [[ ${#find_links[@]} -gt 0 ]] &&
        "${pip[@]}" download "${quiet[@]}" "${binary[@]}" --no-index "${find_links[@]}" \
            --dest "$dest" "$@" 2>/dev/null; then
        return
    fi
    "${pip[@]}" download "${quiet[@]}" "${binary[@]}" "${find_links[@]}" --dest "$dest" "$@"
}

start=$SECONDS
for pinned in "flashinfer-python==$FLASHINFER_VERSION" "apache-tvm-ffi==$TVM_FFI_VERSION" \
    "flashinfer-cubin==$CUBIN_VERSION"; do
    fetch "$cache/wheels" --no-deps "$pinned"
done
flashinfer_wheel=$(ls "$cache"/wheels/flashinfer_python-"$FLASHINFER_VERSION"-*.whl)
cubin_wheel=$(ls "$cache"/wheels/flashinfer_cubin-"$CUBIN_VERSION"-*.whl)
tvm_wheel=$("$python" - "$cache/wheels" "$TVM_FFI_VERSION" <<'PY'
import sys
from pathlib import Path

from packaging.tags import sys_tags
from packaging.utils import parse_wheel_filename

# The wheel dir may hold tvm-ffi builds for other Pythons (cp312-abi3 beside cp311).
supported = list(sys_tags())
best = None
for path in Path(sys.argv[1]).glob(f"apache_tvm_ffi-{sys.argv[2]}-*.whl"):
    ranks = [supported.index(t) for t in parse_wheel_filename(path.name)[3] if t in supported]
    if ranks and (best is None or min(ranks) < best[0]):
        best = (min(ranks), path)
if best is None:
    sys.exit(f"no apache_tvm_ffi-{sys.argv[2]} wheel for this Python in {sys.argv[1]}")
print(best[1])
PY
)
echo "wheels: $(basename "$flashinfer_wheel") $(basename "$tvm_wheel") $(basename "$cubin_wheel")"

# FlashInfer's own requirements that PYTHON lacks. nvidia-cutlass-dsl, cuda-tile and
# nvidia-cudnn-frontend are left out: FlashInfer imports without them, and the trtllm-gen
# module uses none of them.
missing=$("$python" - "$flashinfer_wheel" <<'PY'
import importlib.metadata
import sys
import zipfile

from packaging.requirements import Requirement

optional = {"nvidia-cutlass-dsl", "cuda-tile", "nvidia-cudnn-frontend", "apache-tvm-ffi"}
with zipfile.ZipFile(sys.argv[1]) as wheel:
    name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    metadata = wheel.read(name).decode()
for line in metadata.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    requirement = Requirement(line.split(":", 1)[1].strip())
    if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
        continue
    if requirement.name in optional:
        continue
    try:
        version = importlib.metadata.version(requirement.name)
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version is None or not requirement.specifier.contains(version, prereleases=True):
        if requirement.name == "torch":
            sys.exit(f"{sys.executable} has torch {version}, FlashInfer needs {requirement}")
        print(requirement)
PY
)

install=("$flashinfer_wheel" "$tvm_wheel")
if [[ -n "$missing" ]]; then
    echo "FlashInfer requirements $python lacks: $(echo $missing)"
    mapfile -t requirements <<<"$missing"
    fetch "$work/deps" "${requirements[@]}"
    # Their own dependencies are installed only where PYTHON lacks them, so that nothing in the
    # target dir shadows what torch was installed with.
    mapfile -t -O ${#install[@]} install < <("$python" - "$work/deps" <<'PY'
import importlib.metadata
import sys
from pathlib import Path

from packaging.utils import parse_wheel_filename

for path in sorted(Path(sys.argv[1]).glob("*.whl")):
    try:
        importlib.metadata.version(parse_wheel_filename(path.name)[0])
    except importlib.metadata.PackageNotFoundError:
        print(path)
PY
    )
fi
target="$work/site"
PIP_ROOT_USER_ACTION=ignore "${pip[@]}" install "${quiet[@]}" "${binary[@]}" --no-deps --no-index \
    --target "$target" "${install[@]}"
export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$target/bin:$PATH"  # ninja, when it came from a wheel

# FlashInfer logs under FLASHINFER_WORKSPACE_BASE on import: keep that out of ~/.cache.
artifact=$(FLASHINFER_WORKSPACE_BASE="$work" "$python" -c \
    "from flashinfer.artifacts import ArtifactPath; print(ArtifactPath.TRTLLM_GEN_FMHA)")
cubins="$cache/cubins"
"$python" - "$cubin_wheel" "$artifact" "$cubins" <<'PY'
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

wheel_path, artifact, root = sys.argv[1], sys.argv[2].strip("/"), Path(sys.argv[3])
destination = root / artifact
if (destination / "checksums.txt").is_file():
    print(f"cubins: {destination} (extracted before)")
    sys.exit(0)
prefix = f"flashinfer_cubin/cubins/{artifact}/"
with zipfile.ZipFile(wheel_path) as wheel:
    members = [m for m in wheel.namelist() if m.startswith(prefix) and not m.endswith("/")]
    if not any(m == prefix + "checksums.txt" for m in members):
        sys.exit(
            f"{Path(wheel_path).name} has no {prefix}checksums.txt: this flashinfer-cubin does "
            f"not ship the FMHA artifact directory the installed FlashInfer names ({artifact})"
        )
    root.mkdir(parents=True, exist_ok=True)
    # Extracted beside the destination and renamed into place: an interrupted run leaves no
    # half-filled directory that a later run would take for complete.
    staging = Path(tempfile.mkdtemp(dir=root))
    for member in members:
        target = staging / member[len(prefix):]
        target.parent.mkdir(parents=True, exist_ok=True)
        with wheel.open(member) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst)
destination.parent.mkdir(parents=True, exist_ok=True)
staging.rename(destination)
print(f"cubins: {len(members)} files of {artifact} into {destination}")
PY

# FlashInfer's trtllm-gen sources include cuBLASLt's and NVRTC's headers, and its modules link
# -lcuda, which a toolkit resolves against the driver stub (lib64/stubs/libcuda.so). Toolkits
# assembled from the nvidia-cuda-* wheels have neither: the headers then come from the wheels
# torch depends on (nvidia-cublas, nvidia-cuda-nvrtc), and a stub is made from cuda.h (the
# module is only built here, never loaded).
probe="$work/probe"
mkdir "$probe"
printf '#include <nvrtc.h>\n#include <cublasLt.h>\n' >"$probe/headers.cu"
if ! "$nvcc" -E -x cu "$probe/headers.cu" -o /dev/null 2>/dev/null; then
    mapfile -t header_dirs < <("$python" - <<'PY'
import importlib.util
from pathlib import Path

spec = importlib.util.find_spec("nvidia")
roots = [Path(p) for p in (spec.submodule_search_locations if spec else [])]
for header in ("nvrtc.h", "cublasLt.h"):
    found = sorted({h.parent for root in roots for h in root.glob(f"*/include/{header}")})
    if found:
        print(found[0])
PY
    )
    flags=""
    for dir in $(printf '%s\n' "${header_dirs[@]}" | sort -u); do
        flags+=" -isystem $dir"
    done
    # shellcheck disable=SC2086 # one flag pair per directory
    "$nvcc" -E -x cu $flags "$probe/headers.cu" -o /dev/null ||
        { echo "nvcc finds no nvrtc.h/cublasLt.h, nor does $python's nvidia wheels" >&2; exit 1; }
    FLASHINFER_EXTRA_CUDAFLAGS="${FLASHINFER_EXTRA_CUDAFLAGS:-}$flags"
    export FLASHINFER_EXTRA_CUDAFLAGS
    echo "cuBLASLt/NVRTC headers from: ${flags# }"
fi
printf 'int probe(void) { return 0; }\n' >"$probe/link.c"
cc -fPIC -c "$probe/link.c" -o "$probe/link.o"
# The link line of FlashInfer's build.ninja (jit/cpp_ext.py), on a probe object.
link=(-shared -L"$CUDA_HOME/lib64" -L"$CUDA_HOME/lib64/stubs" -lcudart -lcuda)
if ! c++ "$probe/link.o" "${link[@]}" -o "$probe/link.so" 2>/dev/null; then
    # What the toolkit's stub is: every driver function cuda.h declares, under the driver's
    # soname, so that the module records its dependency on libcuda.so.1 as it would there.
    mkdir "$work/stubs"
    printf '#include <cuda.h>\n' | cc -E -I"$CUDA_HOME/include" -x c - | "$python" -c '
import re, sys
names = sorted(set(re.findall(r"\bCUresult\s+(cu\w+)\s*\(", sys.stdin.read())))
print("".join(f"int {name}(void) {{ return 0; }}\n" for name in names))
' >"$work/stubs/libcuda.c"
    cc -shared -fPIC -Wl,-soname,libcuda.so.1 "$work/stubs/libcuda.c" -o "$work/stubs/libcuda.so"
    c++ "$probe/link.o" "${link[@]}" -L"$work/stubs" -o "$probe/link.so" || {
        echo "the link line of FlashInfer's modules fails under CUDA_HOME=$CUDA_HOME" >&2
        exit 1
    }
    FLASHINFER_EXTRA_LDFLAGS="${FLASHINFER_EXTRA_LDFLAGS:-} -L$work/stubs"
    export FLASHINFER_EXTRA_LDFLAGS
    echo "no libcuda stub in the toolkit: linking against one made from cuda.h"
fi
echo "setup took $((SECONDS - start)) s"

export TOKENSPEED_KERNEL_TRTLLM_GEN_CUBINS="$cubins"
"$python" -m pytest -q -rs -p no:cacheprovider tests/nvidia/test_trtllm_gen_build.py "$@"
echo "trtllm-gen build check OK ($((SECONDS - start)) s in all)"
