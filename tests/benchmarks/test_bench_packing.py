"""Smoke test: ``benchmarks/bench_packing.py --quick`` runs and writes a consistent JSON.

No timings are asserted; the script itself checks that packed log-probs and values equal the padded
ones (float32, 1e-4) and that ``packing="auto"`` chose what its threshold says before timing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_packing.py"


@pytest.mark.slow  # a benchmark script or a multi-process run: full tier only
@pytest.mark.parametrize("dist", ["lognormal", "uniform"])
def test_bench_packing_quick(tmp_path: Path, dist: str) -> None:
    out = tmp_path / "bench_packing.json"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--dist", dist, "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "padding %" in proc.stdout
    result = json.loads(out.read_text())
    assert result["config"]["device"] == "cpu" and result["config"]["quick"]
    padded, packed = result["results"]
    assert (padded["mode"], packed["mode"]) == ("padded", "packed")
    assert padded["real_tokens"] == packed["real_tokens"] > 0
    assert packed["computed_tokens"] <= padded["computed_tokens"]
    for row in (padded, packed):
        assert row["padding_fraction"] == pytest.approx(
            1 - row["real_tokens"] / row["computed_tokens"]
        )
        for stage in ("anchor", "train"):
            assert row[f"{stage}_tokens_per_s"] == pytest.approx(
                row["real_tokens"] / row[f"{stage}_s"]
            )
        assert row["anchor_speedup"] > 0 and row["train_speedup"] > 0
        for stage in ("anchor", "train"):
            lo, med, hi = row[f"{stage}_speedup_range"]
            assert 0 < lo <= med <= hi
    auto = result["auto"]
    assert auto["padded_padding"] == pytest.approx(padded["padding_fraction"])
    assert auto["choice"] == (
        "packed" if auto["padded_padding"] >= auto["min_padding"] else "padded"
    )
    assert all(0 <= d <= 1e-4 for d in result["check_max_abs_diff"].values())
