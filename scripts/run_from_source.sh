#!/usr/bin/env bash
# Run the project from its sources on a GPU machine that has torch/triton but none of our
# packages installed: sources on PYTHONPATH, entry points through a throwaway *.dist-info.
# Usage: bash scripts/run_from_source.sh CMD...
#   e.g. bash scripts/run_from_source.sh tokenspeed-kernel check --op moe_apply
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
ep="$(mktemp -d)"
info="$ep/tokenspeed_kernel_dev-0.dist-info"
mkdir -p "$info"
printf 'Metadata-Version: 2.1\nName: tokenspeed-kernel-dev\nVersion: 0\n' > "$info/METADATA"
printf '[tokenspeed_kernel.plugins]\ntriton = tokenspeed_kernel_triton.registration:register\namd = tokenspeed_kernel_amd.registration:register\nnvidia = tokenspeed_kernel_nvidia.registration:register\n[vllm.general_plugins]\ntokenspeed_kernel = tokenspeed_kernel_vllm.plugin:register\n' > "$info/entry_points.txt"
export PYTHONPATH="$ep:$root/packages/tokenspeed-kernel-core/src:$root/packages/tokenspeed-kernel-triton/src:$root/packages/tokenspeed-kernel-amd/src:$root/packages/tokenspeed-kernel-nvidia/src:$root/packages/tokenspeed-kernel-vllm/src${PYTHONPATH:+:$PYTHONPATH}"
if [ "$1" = "tokenspeed-kernel" ]; then
    shift
    exec python3 -m tokenspeed_kernel.cli "$@"
fi
exec "$@"
