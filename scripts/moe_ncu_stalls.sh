#!/usr/bin/env bash
# Nsight Compute view of triton.moe_apply.sm90's two grouped GEMMs on GPT-OSS-120B shapes:
# duration, active warps, issue rate and the stall reasons per issued instruction, for each M given
# (default: 1 and 4096). Run on the GPU machine from the repo root:
#   bash scripts/moe_ncu_stalls.sh [M ...]
# The SM clock is left free (--clock-control none), as in benchmarks/bench_moe.py; kernels still
# run one at a time with caches flushed between them, so durations read a little longer.
set -euo pipefail
ncu="${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}"
stalls="barrier membar long_scoreboard short_scoreboard wait math_pipe_throttle not_selected selected \
dispatch_stall mio_throttle lg_throttle no_instruction branch_resolving sleeping drain"
metrics="gpu__time_duration.sum,sm__warps_active.avg.per_cycle_active"
metrics+=",smsp__issue_active.avg.pct_of_peak_sustained_active"
metrics+=",smsp__warps_eligible.avg.per_cycle_active,dram__throughput.avg.pct_of_peak_sustained_elapsed"
metrics+=",sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active"
metrics+=",sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active"
metrics+=",sm__pipe_fmaheavy_cycles_active.avg.pct_of_peak_sustained_active"
metrics+=",sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active"
for stall in $stalls; do
    metrics+=",smsp__average_warps_issue_stalled_${stall}_per_issue_active.ratio"
done
driver="$(mktemp --suffix=.py)"
cat > "$driver" <<'PY'
import sys

sys.path.insert(0, "benchmarks")
from bench_moe import gpt_oss_tensors, run_case  # noqa: E402

prepared, scales = gpt_oss_tensors(False, "fragment")
run_case([prepared], int(sys.argv[1]), "bf16", scales, graph=False)
PY
sizes=("$@")
[ ${#sizes[@]} -eq 0 ] && sizes=(1 4096)
for tokens in "${sizes[@]}"; do
    echo "## M=$tokens (the second call's GEMM1, then GEMM2; the first call compiles)"
    bash scripts/run_from_source.sh "$ncu" --clock-control none --kernel-name regex:_fragment_gemm --launch-skip 2 \
        --launch-count 2 --metrics "$metrics" python3 "$driver" "$tokens" | grep -v "^==PROF=="
done
