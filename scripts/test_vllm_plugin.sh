#!/usr/bin/env bash
# The vLLM plugin's tests (tests/vllm) in an environment of their own: the locked workspace
# plus the `vllm` dependency group (vLLM 0.26.0: a ~290 MiB wheel and ~250 packages), kept
# apart from the default .venv so that `uv run pytest` stays small and fast; there those tests
# skip. CI runs this as a second step. The environment (~8 GB) lives outside the repository,
# in ~/.cache/tokenspeed-kernel/venv-vllm unless UV_PROJECT_ENVIRONMENT names another place;
# arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m uv --version >/dev/null 2>&1 || python3 -m pip install --quiet uv
export UV_PROJECT_ENVIRONMENT="${UV_PROJECT_ENVIRONMENT:-${XDG_CACHE_HOME:-$HOME/.cache}/tokenspeed-kernel/venv-vllm}"
python3 -m uv run --group vllm pytest tests/vllm "$@"
