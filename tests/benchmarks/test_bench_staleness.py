"""Smoke test: ``benchmarks/bench_staleness.py --quick --backends trainside`` runs and writes a
consistent JSON (no timing is asserted: the lags and counts of each mode are)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_staleness.py"


@pytest.mark.slow
def test_quick_run_on_the_trainside_backend(tmp_path):
    out = tmp_path / "bench_staleness.json"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--backends", "trainside", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| trainside | lag2_partial |" in proc.stdout
    rows = json.loads(out.read_text())["results"]["trainside"]
    assert list(rows) == ["sync", "async", "lag2_partial"]
    assert rows["sync"]["ratio_to_sync"] == 1.0 and rows["sync"]["mean_token_lag"] == 0.0
    assert rows["async"]["mean_token_lag"] == 1.0 and rows["async"]["interruptions"] == 0
    assert 0.0 < rows["lag2_partial"]["mean_token_lag"] <= 2.0
    assert all(r["samples_per_s"] > 0 and r["length_max"] <= 24 for r in rows.values())
