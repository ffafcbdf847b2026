"""Smoke test: ``benchmarks/gpu_smoke.py --device cpu --tiny`` runs (gloo, FSDP2 at world size 1).

On a GPU the same script runs the Qwen3-0.6B shape under NCCL; here it must run end to end, report
a first-update ratio of exactly 1 on every micro-batch and move the fp32 masters (no timings are
asserted).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_smoke.py"


@pytest.mark.slow  # a benchmark script or a multi-process run: full tier only
def test_gpu_smoke_runs_on_cpu_with_a_tiny_model(tmp_path):
    out = tmp_path / "gpu_smoke.json"
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--device",
        "cpu",
        "--tiny",
        "--rows",
        "8",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "first-update ratio min / max     1.0 / 1.0" in proc.stdout
    result = json.loads(out.read_text())
    assert result["config"]["model"] == "tiny" and result["config"]["world_size"] == 1
    assert result["ratio_exactly_one"] and result["micro_batches"] >= 2
    assert result["masters_changed_fraction"] >= 0.99
    assert result["update_tokens_per_s"] > 0 and result["peak_memory_gib"] is None
