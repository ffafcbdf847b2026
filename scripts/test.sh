#!/usr/bin/env bash
# The test command (README and CI run exactly this): build or reuse both environments, run pytest.
#   .venv         the library (torch 2.13 CPU)            -> scripts/setup.sh
#   .venv-sglang  a real SGLang 0.5.23 server for tests   -> scripts/setup_sglang_env.sh
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k gae`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_sglang_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
set +e
.venv/bin/python -m pytest tests ar_torchrl "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests (exit 5)"; exit 0
fi
exit "$rc"
