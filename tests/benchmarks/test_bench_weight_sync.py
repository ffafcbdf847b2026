"""Smoke tests: ``benchmarks/bench_weight_sync.py --quick`` runs and writes a complete JSON.

No timings are asserted (speed is measured by the script, not tested): the trainside senders run
without a server; the SGLang senders run against the session's real server (marker ``sglang``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_weight_sync.py"


def run_quick(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "bench_weight_sync.json"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--profile", "--out", str(out), *args]
    # Output to files, not pipes: the tensor sender's file_system sharing starts torch_shm_manager,
    # which inherits the script's stdout/stderr and lives as long as the server holds its segments.
    log, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with log.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.run(cmd, stdout=stdout, stderr=stderr, timeout=600, env=os.environ.copy())
    assert proc.returncode == 0, err.read_text()[-3000:]
    assert "x raw" in log.read_text()
    return json.loads(out.read_text())


def check_rows(result: dict, methods: set[str], model: str = "tiny") -> None:
    rows = {r["method"]: r for r in result["results"]}
    assert set(rows) == methods | {"raw_safetensors", "memcpy"}
    assert result["config"]["model"] == model and result["bytes"] > 0
    raw, memcpy = rows["raw_safetensors"]["seconds"], rows["memcpy"]["seconds"]
    for r in rows.values():
        assert r["seconds"] > 0 and len(r["runs"]) == 1
        assert r["seconds_range"] == [r["seconds"]] * 2
        assert r["gb_per_s"] == pytest.approx(result["bytes"] / r["seconds"] / 1e9)
        assert r["vs_raw"] == pytest.approx(r["seconds"] / raw)
        assert r["vs_memcpy"] == pytest.approx(r["seconds"] / memcpy)


@pytest.mark.slow  # a benchmark script or a multi-process run: full tier only
def test_bench_weight_sync_trainside_senders(tmp_path):
    result = run_quick(tmp_path, "--methods", "copy,share")
    check_rows(result, {"copy", "share"})
    assert set(result["profile"]) == {"raw_safetensors"}  # no SGLang step was called
    parts = result["profile"]["raw_safetensors"]
    assert set(parts) == {"save_file", "load_file + copy"} and all(v > 0 for v in parts.values())


@pytest.mark.sglang
def test_bench_weight_sync_sglang_senders(tmp_path, sglang_server, sglang_model_dir):
    methods = "disk,tensor,distributed"
    result = run_quick(
        tmp_path,
        "--methods",
        methods,
        "--before",
        "--url",
        sglang_server.url,
        "--model-dir",
        str(sglang_model_dir),
    )
    with_flush = {f"{m}+flush" for m in methods.split(",")}  # before issue 31, side by side
    check_rows(result, set(methods.split(",")) | with_flush, model=sglang_model_dir.name)
    assert "POST /flush_cache?timeout=30" not in result["profile"]["tensor"]
    assert "POST /flush_cache?timeout=30" in result["profile"]["tensor+flush"]
    assert "write shards" in result["profile"]["disk"]
    assert "POST /update_weights_from_tensor" in result["profile"]["tensor"]
    assert "POST /update_weights_from_distributed" in result["profile"]["distributed"]
