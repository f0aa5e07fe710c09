#!/usr/bin/env bash
# compute-sanitizer over every GPU kernel (scripts/sanitize_kernels.py), on the GPU machine:
#   bash scripts/sanitize.sh [--op OP] [--preset gpt-oss-120b] [--max-cases N]
# TOOLS="memcheck racecheck initcheck" picks the tools (default memcheck racecheck). PyTorch's
# caching allocator is off so that memcheck sees each tensor's own bounds, not a cached block's.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
status=0
for tool in ${TOOLS:-memcheck racecheck}; do
    echo "== compute-sanitizer --tool $tool"
    compute-sanitizer --tool "$tool" --error-exitcode 99 --print-limit 20 \
        bash "$root/scripts/run_from_source.sh" python3 "$root/scripts/sanitize_kernels.py" "$@" \
        || status=$?
done
exit $status
