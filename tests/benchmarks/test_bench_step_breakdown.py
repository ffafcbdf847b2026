"""Smoke test: ``benchmarks/bench_step_breakdown.py`` runs the recipe on tiny sizes and writes a
consistent JSON (so it can't rot); no timings are asserted. ``summarize`` is checked by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.bench_helpers import load_benchmark

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_step_breakdown.py"
TINY = ("model.warm_start.enabled=false", "rollout.prompts_per_iter=2", "logger=none")


@pytest.mark.slow
def test_bench_step_breakdown_runs_the_recipe_on_tiny_sizes(tmp_path):
    out = tmp_path / "breakdown.json"
    sets = [arg for s in TINY for arg in ("--set", s)]
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--scenarios",
        "cpu_default",
        "--iterations",
        "2",
        *sets,
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "outside model compute" in proc.stdout
    (result,) = json.loads(out.read_text())["results"]
    assert len(result["iterations"]) == 1  # the first of 2 is the warm-up
    assert sum(result["stages"].values()) == pytest.approx(result["wall_s"])
    parts = result["parts"]
    for key in (
        "generate/model_forward",
        "old_log_probs/forward",
        "update/forward",
        "update/backward",
        "update/grad_clip",
        "update/optimizer",
        "generate/reward",
    ):
        assert parts[key] > 0, key
    assert 0 < result["model_compute_s"] < result["wall_s"]


def test_summarize_splits_stages_and_computes_the_outside_fraction():
    bench = load_benchmark("bench_step_breakdown")
    it = {
        "time/iteration": 10.0,
        "time/generate": 4.0,
        "time/generate/model_forward": 3.0,
        "time/generate/reward": 0.5,
        "time/old_log_probs": 1.0,
        "time/old_log_probs/forward": 0.8,
        "time/advantage": 0.1,
        "time/update": 3.0,
        "time/update/forward": 1.0,
        "time/update/backward": 1.5,
        "time/update/optimizer": 0.2,
        "time/update/grad_clip": 0.1,
        "time/sync": 0.4,
    }
    slower = {**it, "time/iteration": 30.0}
    out = bench.summarize([it, slower, it])  # the median iteration: the odd one out is ignored
    assert out["wall_s"] == 10.0 and out["wall_range"] == [10.0, 30.0]
    assert out["stages"]["generation"] == pytest.approx(3.5)
    assert out["stages"]["train fwd/bwd"] == pytest.approx(2.7)
    assert out["stages"]["logging/other"] == pytest.approx(10.0 - 8.5)
    assert out["model_compute_s"] == pytest.approx(3.0 + 0.8 + 1.0 + 1.5 + 0.1 + 0.2)
    assert out["outside_model_compute"] == pytest.approx(1 - 6.6 / 10.0)
    with pytest.raises(ValueError, match="no timed iteration: use --iterations >= 2"):
        bench.summarize([])


def test_the_stages_add_up_to_the_iteration_and_other_is_never_negative():
    """Issue 31: medians taken stage by stage need not add up (here generate 9 + update 1.5 >
    wall 10: "other" was -0.5); the median iteration's own stages do."""
    bench = load_benchmark("bench_step_breakdown")
    a = {"time/iteration": 10.0, "time/generate": 9.0, "time/update": 0.5}
    b = {"time/iteration": 10.0, "time/generate": 0.5, "time/update": 9.0}
    c = {"time/iteration": 11.0, "time/generate": 9.0, "time/update": 1.5}
    out = bench.summarize([a, b, c])
    assert sum(out["stages"].values()) == pytest.approx(out["wall_s"]) == 10.0
    assert out["stages"]["logging/other"] == pytest.approx(0.5) and out["median_iteration"] == 1
    assert out["stage_ranges"]["generation"] == [0.5, 9.0]
