tar -xJf .carry/wheels/fa3x/fa3.tar.xz -C /tmp && python3 -m pip install -q --no-deps --no-compile --target /tmp/nvlibs /tmp/tokenspeed_fa3-*.whl 2>/dev/null
export PYTHONPATH=/tmp/nvlibs PYTHONUNBUFFERED=1
R="bash scripts/run_from_source.sh"
nvidia-smi --query-gpu=name --format=csv,noheader
$R python3 benchmarks/prefill_pipes_experiment/gpu_run.py smoke 2>&1 | grep -v Warn
$R python3 benchmarks/prefill_pipes_experiment/gpu_run.py full 2>&1 | grep -v Warn
