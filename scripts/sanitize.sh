#!/usr/bin/env bash
# compute-sanitizer over every GPU kernel (scripts/sanitize_kernels.py) on the GPU machine, then
# one findings table:
#   bash scripts/sanitize.sh [--op OP] [--max-cases N]
# TOOLS (default "memcheck racecheck initcheck") picks the tools, BUDGET_S (default 70) the
# seconds each tool may spend starting new kernel-case runs, PLAIN_BUDGET_S (default 120) the
# same for a first run without the sanitizer, which compiles the kernels (each tool then loads
# them from Triton's cache) and checks every output against the reference; TOOL_TIMEOUT_S
# (default 150) ends a tool whose run already started outlasts its budget (racecheck on a
# big MoE GEMM can take minutes; the findings table then marks that tool's log as cut
# short, and the sweep is not clean); PRESET (default
# gpt-oss-120b) names the model shapes that run first. Logs go to $SANITIZE_OUT (default
# bench-out/sanitize). Bounded by PLAIN_BUDGET_S plus one run, then TOOL_TIMEOUT_S per tool:
# about 10 minutes for the three tools, so where one command may run 10 minutes split it
# (TOOLS=memcheck, then TOOLS="racecheck initcheck"); the table says how many runs a budget
# skipped.
#
# PyTorch's caching allocator is off so that memcheck sees each tensor's own bounds and
# initcheck each allocation's own bytes, not a cached block's. PyTorch's and cuBLAS's kernels
# (the reference side and input preparation) run uninstrumented: the findings are ours.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${SANITIZE_OUT:-$root/bench-out/sanitize}"
mkdir -p "$out"
rm -f "$out"/*.log
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
run=(bash "$root/scripts/run_from_source.sh" python3 "$root/scripts/sanitize_kernels.py"
    --preset "${PRESET:-gpt-oss-120b}" "$@")
status=0
start=$SECONDS
echo "== without the sanitizer (compile, compare with the reference)"
"${run[@]}" --budget-s "${PLAIN_BUDGET_S:-120}" >"$out/plain.log" 2>&1 || status=$?
grep -E "FAILED|^runs:" "$out/plain.log"
for tool in ${TOOLS:-memcheck racecheck initcheck}; do
    echo "== compute-sanitizer --tool $tool ($((SECONDS - start)) s so far)"
    timeout "${TOOL_TIMEOUT_S:-150}" \
        compute-sanitizer --tool "$tool" --error-exitcode 99 --print-limit 1000 \
        --kernel-name-exclude kns=at::,kns=cublas,kns=cutlass,kns=nvjet,kns=xmma,kns=gemv \
        "${run[@]}" --budget-s "${BUDGET_S:-70}" >"$out/$tool.log" 2>&1 || status=$?
    grep -E "^runs:|SUMMARY" "$out/$tool.log"
done
echo "== findings ($((SECONDS - start)) s)"
python3 "$root/scripts/sanitize_kernels.py" --summarize "$out"/*.log || status=$?
exit $status
