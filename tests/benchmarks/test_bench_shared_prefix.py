"""Smoke test: ``benchmarks/bench_shared_prefix.py --quick`` runs and writes a consistent JSON.

No timings are asserted; the script itself checks that the shared-prefix plan, the packed one and the
tree (packed shared) one give the padded plan's log-probs and values (float32, 1e-5) before timing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_shared_prefix.py"


@pytest.mark.slow  # a benchmark script: full tier only
def test_bench_shared_prefix_quick(tmp_path: Path) -> None:
    out = tmp_path / "bench_shared_prefix.json"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "x anchor" in proc.stdout and "x total" in proc.stdout
    result = json.loads(out.read_text())
    config = result["config"]
    assert config["quick"] and config["ns"] == [1, 4] and len(config["load_average"]) == 2
    assert [r["n"] for r in result["results"]] == [1, 4]
    for r in result["results"]:
        padded, shared, packed, tree = (r[p] for p in ("padded", "shared", "packed", "tree"))
        assert packed["computed_tokens"] <= padded["computed_tokens"]
        if r["n"] > 1:  # the tree layout: each prompt once per group, no response padding
            assert tree["computed_tokens"] < packed["computed_tokens"]
        assert r["rows"] == config["prompts"] * r["n"]
        assert 0 <= r["max_abs_diff"] <= 1e-5
        assert r["prompt_tokens_mean"] > 0 and 1 <= r["response_tokens_mean"] <= config["max_new"]
        # n = 1: nothing to share, the same tokens; n = 4: each prompt once per group
        if r["n"] == 1:
            assert shared["computed_tokens"] == padded["computed_tokens"]
        else:
            assert shared["computed_tokens"] < padded["computed_tokens"]
        for row in (padded, shared, packed, tree):
            for stage in ("anchor", "train", "total"):
                assert row[f"{stage}_s"] > 0
                lo, med, hi = row[f"{stage}_s_speedup"]
                assert 0 < lo <= med <= hi
        assert padded["anchor_s_speedup"] == [1.0, 1.0, 1.0]
