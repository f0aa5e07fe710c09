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
# bench-out/sanitize). GPUS (default: every GPU nvidia-smi lists) splits each pass into that
# many processes, one per GPU (`--shard K/N`, logs <tool>.<K>.log), so a machine of several
# GPUs sweeps that many times the runs in the same time. Bounded by PLAIN_BUDGET_S plus one
# run, then TOOL_TIMEOUT_S per tool: about 10 minutes for the three tools, so where one command
# may run 10 minutes split it (TOOLS=memcheck, then TOOLS="racecheck initcheck"); the table says
# how many runs a budget skipped.
#
# PyTorch's caching allocator is off so that memcheck sees each tensor's own bounds and
# initcheck each allocation's own bytes, not a cached block's. Under memcheck and racecheck
# PyTorch's and cuBLAS's kernels (the reference side and input preparation) run
# uninstrumented: the findings are ours. The filter matches substrings of mangled names, so
# PyTorch's kernels are named by their mangled namespaces (_ZN2at: at::, _ZN3c10: c10::).
# Driver API errors are not reported: cuda-bindings probes every driver entry point it knows
# with cuGetProcAddress on first use, and each one this driver lacks is an "error" (34 per
# process on driver 580); our own driver calls check their status and raise, failing the run.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${SANITIZE_OUT:-$root/bench-out/sanitize}"
mkdir -p "$out"
rm -f "$out"/*.log
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
run=(bash "$root/scripts/run_from_source.sh" python3 "$root/scripts/sanitize_kernels.py"
    --preset "${PRESET:-gpt-oss-120b}" "$@")
gpus=${GPUS:-$(nvidia-smi -L | grep -c '^GPU')}
status=0
start=$SECONDS

# pass NAME BUDGET "SCRIPT ARGS" [PREFIX...]: the sweep as $gpus processes, shard K on GPU K,
# each logging to $out/NAME.K.log; fails if any shard does.
pass() {
    local name=$1 budget=$2 extra=$3 pids=() k
    shift 3
    for ((k = 0; k < gpus; k++)); do
        # shellcheck disable=SC2086  # $extra: zero or more words
        CUDA_VISIBLE_DEVICES=$k "$@" "${run[@]}" --budget-s "$budget" --shard "$k/$gpus" $extra \
            >"$out/$name.$k.log" 2>&1 &
        pids+=($!)
    done
    local failed=0
    for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
    grep -hE "FAILED|^runs:|SUMMARY" "$out/$name".*.log
    return $failed
}

echo "== without the sanitizer (compile, compare with the reference) on $gpus GPU(s)"
pass plain "${PLAIN_BUDGET_S:-120}" "" || status=1
for tool in ${TOOLS:-memcheck racecheck initcheck}; do
    echo "== compute-sanitizer --tool $tool ($((SECONDS - start)) s so far)"
    if [ "$tool" = initcheck ]; then
        # initcheck does not see the writes of kernels it skips, so it skips none and runs each
        # kernel alone on inputs copied from the host (--kernel-only): no reference beside it.
        extra=--kernel-only filter=()
    else
        # CUTLASS templates (cuBLAS's) by their mangled namespace, _ZN7cutlass: our CuTe DSL
        # kernels' symbols start with kernel_cutlass_ and must stay instrumented.
        extra="" filter=(--kernel-name-exclude
            kns=_ZN2at,kns=_ZN3c10,kns=cublas,kns=_ZN7cutlass,kns=nvjet,kns=xmma,kns=gemv)
    fi
    pass "$tool" "${BUDGET_S:-70}" "$extra" timeout "${TOOL_TIMEOUT_S:-150}" \
        compute-sanitizer --tool "$tool" --error-exitcode 99 --print-limit 1000 \
        --report-api-errors no "${filter[@]}" || status=1
done
echo "== findings ($((SECONDS - start)) s)"
python3 "$root/scripts/sanitize_kernels.py" --summarize "$out"/*.log || status=1
exit $status
