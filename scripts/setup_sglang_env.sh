#!/usr/bin/env bash
# Create (or reuse) the SGLang server environment used by the real-server tests and benchmarks.
#   venv:  .venv-sglang in the repo root (override with AR_TORCHRL_SGLANG_VENV=/some/path)
#   pins:  requirements/sglang-cpu-server.txt (installed with --no-deps; torch 2.14.1 + nvidia-* come
#          from the machine's local wheels when pip finds them, else from PyPI)
#   shim:  tools/sgl_kernel_shim -> $VENV/sgl_kernel_shim (put on the server's PYTHONPATH only by
#          ar_torchrl.backends.sglang.launcher.launch_sglang_server)
#   router: sglang-router (pinned with the server; its Rust binary runs in this venv's python) for
#          ar_torchrl.backends.sglang.router.launch_sglang_router (backend.router=launch)
# Idempotent: a stamp holds the hash of the pins and the shim; nothing is done when it matches.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${AR_TORCHRL_SGLANG_VENV:-$PWD/.venv-sglang}
REQ=requirements/sglang-cpu-server.txt
SHIM_SRC=tools/sgl_kernel_shim/sgl_kernel
PY=${PYTHON_SGLANG:-python3.11}
command -v "$PY" >/dev/null || { echo "setup_sglang_env: $PY not found (the pins are for Python 3.11; set PYTHON_SGLANG)" >&2; exit 1; }

want=$(cat "$REQ" "$SHIM_SRC"/*.py | sha256sum | cut -d' ' -f1)
stamp="$VENV/.ar_torchrl-sglang-installed"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  echo "setup_sglang_env: $VENV is up to date"
  exit 0
fi

echo "setup_sglang_env: installing SGLang server environment into $VENV (a few minutes, ~6.5 GB)"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --no-deps -r "$REQ"

# Import shim for sgl_kernel (no CPU build exists): a plain directory, NOT on the venv's sys.path.
rm -rf "$VENV/sgl_kernel_shim"
mkdir -p "$VENV/sgl_kernel_shim"
cp -r "$SHIM_SRC" "$VENV/sgl_kernel_shim/"
find "$VENV/sgl_kernel_shim" -name __pycache__ -prune -exec rm -rf {} +

# Cheap sanity checks: the pinned sglang is there and ships the msgspec schema the test double uses;
# the pinned sglang-router's Rust extension loads.
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md, pathlib, sysconfig
v = md.version("sglang")
schema = pathlib.Path(sysconfig.get_paths()["purelib"]) / "sglang/api/v1/api_types.py"
assert v == "0.5.23", f"expected sglang 0.5.23, found {v}"
assert schema.is_file(), f"SGLang msgspec schema missing: {schema}"
r = md.version("sglang-router")
assert r == "0.3.2", f"expected sglang-router 0.3.2, found {r}"
from sglang_router.sglang_router_rs import get_version_string
print(f"setup_sglang_env: sglang {v} OK, schema at {schema}; sglang-router {r} ({get_version_string()})")
PY
echo "$want" > "$stamp"
