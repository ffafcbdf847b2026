#!/usr/bin/env bash
# The test command (README and CI run exactly this): build or reuse both environments, run pytest.
#   .venv         the library (torch 2.13 CPU)            -> scripts/setup.sh
#   .venv-sglang  a real SGLang 0.5.23 server for tests   -> scripts/setup_sglang_env.sh
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k gae`).
#
# Fast tier for contributors: `bash scripts/test.sh --fast` (or AR_TORCHRL_TESTS=fast) skips the
# SGLang venv build (6.3 GB) and deselects the tests marked `slow` (end-to-end runs) and `sglang`
# (real servers), as the README says; the SGLang client's tests on the protocol double still run
# when .venv-sglang exists (they need SGLang's own schema from it) and are skipped otherwise. CI
# runs the complete command without --fast.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--fast" ]; then
  export AR_TORCHRL_TESTS=fast
  shift
fi
bash scripts/setup.sh
marker=()
if [ "${AR_TORCHRL_TESTS:-}" = "fast" ]; then
  marker=(-m "not slow and not sglang")
else
  bash scripts/setup_sglang_env.sh
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# One pytest worker per core (2 here; AR_TORCHRL_TEST_WORKERS=0 runs in one process): tests that
# share a costly session or module fixture (the SGLang server, a recipe run) are grouped onto one
# worker by tests/conftest.py, so each fixture is still built once.
workers=${AR_TORCHRL_TEST_WORKERS:-2}
set +e
.venv/bin/python -m pytest tests ar_torchrl -n "$workers" --dist loadgroup "${marker[@]}" "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests (exit 5)"; exit 0
fi
exit "$rc"
