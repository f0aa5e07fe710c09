#!/usr/bin/env bash
# vLLM 0.26.0 for a machine that has torch 2.11 / triton 3.6 / transformers 5 but no vLLM and no
# network (the GPU machine), small enough to travel with one call (`carry`, 64 MiB in all).
#
#   bash scripts/vllm_gpu_bundle.sh            # here, with PyPI: build .carry/vllm-bundle/
#   bash scripts/vllm_gpu_bundle.sh --install  # there: unpack into /tmp/vllm-site, print that path
#   bash scripts/vllm_gpu_bundle.sh --check-cuda-platform  # here, after --install: see below
#
# then: PYTHONPATH=/tmp/vllm-site bash scripts/run_from_source.sh \
#           python3 -m pytest -q -m gpu tests/vllm/test_gpu.py
#
# The bundle is one tar.xz of a site directory: vLLM's Python sources (no compiled libraries)
# and the cp312 manylinux wheels, unpacked, of the packages tests/vllm reaches that such a
# machine lacks. The list below was found by running tests/vllm in a Python 3.12 environment
# holding only torch, triton, transformers, numpy and pytest, adding each module that failed to
# import; versions are those of the vllm dependency group's lock. Packages the GPU machine also
# has (psutil, requests, aiohttp, ...) travel too, so that the bundle runs as tested whatever
# versions it finds there; being first on PYTHONPATH, the bundle's copies win. So do three that
# torch and transformers bring but these packages need recent (typing-extensions >= 4.16 for
# pydantic, anyio >= 4.10 for openai, idna >= 3.18 for httpx2).
#
# Left out of vLLM's wheel (about 660 MiB): every compiled library (*.so: _C_stable_libtorch
# 75 MiB, _moe_C 45 MiB, FlashAttention 2/3 435 MiB, DeepGEMM, FlashMLA, ...), the vllm-rs
# binary and C++/CUDA headers. tests/vllm calls none of vLLM's compiled ops (the plugin's kernels
# are ours), and vLLM imports most of these inside try/except (DeepGEMM, FlashMLA, _moe_C then
# report themselves unavailable). Two it needs on CUDA, where xz brings them to no less than
# 53 MiB (CUDA code compresses poorly), are replaced by Python modules of the same name that
# log a warning when imported: vllm/platforms/cuda.py imports vllm._C_stable_libtorch
# unconditionally (and w8a8_utils asks two CUTLASS capability queries at import: these
# answer False), and the Attention layer's module imports vllm.vllm_flash_attn, which needs
# _vllm_fa2_C or _vllm_fa3_C. Any other vLLM compiled op then fails with AttributeError naming
# it; nothing in tests/vllm calls one. Fine for driving vLLM's classes, not for `vllm serve`.
# --check-cuda-platform finds such needs without a GPU: it runs tests/vllm's CPU tests through
# the installed bundle with vLLM's CUDA platform (capability 9.0) as the current platform, so
# that vLLM imports and builds what it would on the GPU machine (arguments go to pytest).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bundle="$root/.carry/vllm-bundle"
archive="$bundle/vllm-site.tar.xz"

if [ "${1:-}" = "--install" ]; then
    site="${VLLM_SITE:-/tmp/vllm-site}"
    [ -f "$archive" ] || { echo "vllm_gpu_bundle: $archive is missing (build it with" \
        "'bash scripts/vllm_gpu_bundle.sh' and carry .carry/vllm-bundle)" >&2; exit 1; }
    rm -rf "$site"
    mkdir -p "$site"
    tar -xJf "$archive" -C "$site"
    echo "vllm_gpu_bundle: unpacked into $site; use PYTHONPATH=$site" >&2
    echo "$site"
    exit 0
fi
if [ "${1:-}" = "--check-cuda-platform" ]; then
    shift
    site="${VLLM_SITE:-/tmp/vllm-site}"
    cd "$root"
    # vLLM prefers an out-of-tree platform plugin to the platforms it detects: this one is its
    # CUDA platform answering a Hopper's capability without asking a GPU (NVML) for it.
    fake="$(mktemp -d)"
    info="$fake/tokenspeed_cuda_check-0.dist-info"
    mkdir -p "$info"
    printf 'Metadata-Version: 2.1\nName: tokenspeed-cuda-check\nVersion: 0\n' > "$info/METADATA"
    printf '[vllm.platform_plugins]\ncuda_check = tokenspeed_cuda_check:platform\n' \
        > "$info/entry_points.txt"
    cat > "$fake/tokenspeed_cuda_check.py" <<'EOF'
def platform():
    return "tokenspeed_cuda_check_platform.HopperWithoutGpu"
EOF
    cat > "$fake/tokenspeed_cuda_check_platform.py" <<'EOF'
from vllm.platforms.cuda import NonNvmlCudaPlatform
from vllm.platforms.interface import DeviceCapability


class HopperWithoutGpu(NonNvmlCudaPlatform):
    @classmethod
    def get_device_capability(cls, device_id=0):
        return DeviceCapability(9, 0)
EOF
    PYTHONPATH="$fake:$site" bash scripts/run_from_source.sh python3 -c \
        'from vllm.platforms import current_platform as p; assert p.is_cuda(), p'
    PYTHONPATH="$fake:$site" exec bash scripts/run_from_source.sh \
        python3 -m pytest -q -m "not gpu" tests/vllm "$@"
fi
if [ $# -gt 0 ]; then
    echo "usage: bash scripts/vllm_gpu_bundle.sh [--install | --check-cuda-platform [ARGS]]" >&2
    exit 2
fi

VLLM=vllm==0.26.0
DEPS=(
    aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-types==0.8.0
    anyio==4.16.0 apache-tvm-ffi==0.1.10 attrs==26.1.0 cachetools==8.0.2 cbor2==6.3.0
    charset-normalizer==3.5.3 cloudpickle==3.1.3 compressed-tensors==0.17.0 einops==0.8.2
    frozenlist==1.8.0 httpx2==2.16.2 idna==3.20 llguidance==1.7.6 loguru==0.7.3 msgspec==0.22.0
    multidict==7.2.1 openai-harmony==0.0.8 openai==3.57.0 pillow==13.0.0
    prometheus-client==0.26.0 propcache==0.5.4 protobuf==6.33.6 psutil==7.2.2 py-cpuinfo==9.0.0
    pybase64==1.5.1 pydantic-core==2.50.5 pydantic==2.14.4 pyzmq==27.3.0 requests==2.34.2
    sniffio==1.3.1 typing-extensions==4.16.0 typing-inspection==0.4.5 urllib3==2.8.0
    uvloop==0.23.0 xgrammar==0.2.7 yarl==1.25.1
)
# pip matches manylinux tags exactly; these cover every wheel above (llguidance is 2_31).
PLATFORMS=()
for tag in manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 \
    manylinux_2_17 manylinux2014 manylinux_2_12 manylinux2010 manylinux_2_5 manylinux1; do
    PLATFORMS+=(--platform "${tag}_x86_64")
done
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}")
wheels="${VLLM_BUNDLE_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/tokenspeed-kernel/vllm-bundle-wheels}"
mkdir -p "$wheels"

wheel_of() {  # the downloaded wheel of NAME==VERSION (wheel names normalise - and . to _)
    local name="${1%%==*}" version="${1##*==}"
    name="$(echo "$name" | tr 'A-Z.-' 'a-z__')"
    local found=("$wheels/${name}-${version}-"*.whl)
    [ -f "${found[0]}" ] || { echo "vllm_gpu_bundle: no wheel for $1 in $wheels" >&2; exit 1; }
    echo "${found[0]}"
}

python3 -m pip download --quiet --no-deps "${TARGET[@]}" -d "$wheels" "$VLLM" "${DEPS[@]}"

stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
python3 - "$(wheel_of "$VLLM")" "$stage" <<'EOF'
import fnmatch
import sys
import zipfile

wheel, dest = sys.argv[1], sys.argv[2]
drop = ["*.so", "*.so.*", "vllm/vllm-rs", "*.h", "*.hpp", "*.cuh", "*.inl", "*.cu", "*.cpp"]
kept = dropped = 0
with zipfile.ZipFile(wheel) as z:
    for info in z.infolist():
        if any(fnmatch.fnmatch(info.filename, pattern) for pattern in drop):
            dropped += info.file_size
            continue
        z.extract(info, dest)
        kept += info.file_size
print(f"vllm_gpu_bundle: vLLM wheel: kept {kept / 2**20:.1f} MiB,", end=" ")
print(f"left out {dropped / 2**20:.1f} MiB")
EOF
cat > "$stage/vllm/_C_stable_libtorch.py" <<'EOF'
"""Stands in for vLLM's compiled op library `_C_stable_libtorch`, which
scripts/vllm_gpu_bundle.sh leaves out (75 MiB; 53 MiB after xz, more than a call carries beside
the rest). vllm/platforms/cuda.py imports it unconditionally, and w8a8_utils asks two of its
CUTLASS capability queries while being imported; those are defined here to answer False (no
CUTLASS kernel is in this bundle). Every other torch.ops._C op stays undefined, so a call of
one fails with AttributeError naming it."""

import logging

import torch

logging.getLogger("vllm").warning(
    "vllm._C_stable_libtorch is not in this bundle (scripts/vllm_gpu_bundle.sh): vLLM's own "
    "compiled ops are unavailable; only code that does not call them runs"
)

_lib = torch.library.Library("_C", "FRAGMENT")
for _query in (
    "cutlass_scaled_mm_supports_fp8",
    "cutlass_scaled_mm_supports_block_fp8",
):
    _lib.define(f"{_query}(int cuda_device_capability) -> bool")
    _lib.impl(_query, lambda cuda_device_capability: False, "CompositeExplicitAutograd")
EOF
cat > "$stage/vllm/vllm_flash_attn/_vllm_fa2_C.py" <<'EOF'
"""Stands in for vLLM's FlashAttention-2 library, which scripts/vllm_gpu_bundle.sh leaves out
(290 MiB): vllm/vllm_flash_attn/__init__.py raises ImportError unless FlashAttention 2 or 3
imports, and on CUDA the module of vLLM's Attention layer imports it (through fa_utils). It
registers no op, so vLLM believes FlashAttention 2 is there and a call of it fails with
AttributeError (torch.ops._vllm_fa2_C); name the attention backend (tests/vllm names ours)."""

import logging

logging.getLogger("vllm").warning(
    "vllm.vllm_flash_attn._vllm_fa2_C is not in this bundle (scripts/vllm_gpu_bundle.sh): "
    "FlashAttention calls fail; name another attention backend"
)
EOF
dep_wheels=()
for spec in "${DEPS[@]}"; do
    dep_wheels+=("$(wheel_of "$spec")")
done
python3 -m pip install --quiet --no-deps --no-index --no-compile "${TARGET[@]}" \
    --target "$stage" "${dep_wheels[@]}"
# Console scripts (with this machine's interpreter path) and bytecode are of no use there.
rm -rf "$stage/bin"
find "$stage" -name __pycache__ -prune -exec rm -rf {} +

mkdir -p "$bundle"
rm -f "$archive"
tar -C "$stage" -cf - . | xz -6 -T0 > "$archive"
{
    echo "vllm-site.tar.xz: $VLLM without compiled libraries, plus:"
    printf '  %s\n' "${DEPS[@]}"
} > "$bundle/CONTENTS.txt"
echo "vllm_gpu_bundle: $archive: $(du -m "$archive" | cut -f1) MiB" \
    "($(du -sm "$stage" | cut -f1) MiB unpacked)" >&2
