"""Smoke test: ``benchmarks/bench_gae.py --quick`` runs and writes a complete JSON (so it can't rot).

No timings are asserted (speed is measured by the script, not tested); the script itself asserts
that token_gae equals both TorchRL GAE paths to 1e-4 before timing, so a run that exits 0 has
passed that check, and the JSON numbers are checked for consistency here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.bench_helpers import load_benchmark

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gae.py"
PATHS = {"token_gae", "torchrl_loop", "torchrl_vec"}


@pytest.fixture(scope="module")
def quick_result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "bench_gae.json"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--threads", "1,2", "--batches", "8,16"]
    cmd += ["--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "speed-up vs TorchRL fastest" in proc.stdout
    return json.loads(out.read_text())


@pytest.mark.slow  # a benchmark script or a multi-process run: full tier only
def test_bench_gae_quick_json_has_every_row(quick_result: dict) -> None:
    cfg = quick_result["config"]
    assert (cfg["batches"], cfg["length"], cfg["prompt"], cfg["quick"]) == ([8, 16], 512, 64, True)
    assert cfg["gae_bytes"] == 8 * 512 * 17  # of the first batch size
    assert set(cfg["load_avg_1m"]) == {"before", "after"}
    assert len(cfg["token_gae_file_sha256"]) == 16  # which token_gae was timed
    rows = quick_result["results"]
    keys = {(r["path"], r["batch"], r["lmbda"], r["threads"]) for r in rows}
    assert keys == {
        (p, b, lam, t) for p in PATHS for b in (8, 16) for lam in (0.95, 1.0) for t in (1, 2)
    }
    assert len(rows) == 24


@pytest.mark.slow  # a benchmark script or a multi-process run: full tier only
def test_bench_gae_quick_numbers_are_consistent(quick_result: dict) -> None:
    for row in quick_result["results"]:
        assert 0 < row["min_ms"] <= row["ms"] and row["reps"] == len(row["wall_ms"]) >= 1
        assert row["cpu_ms"] > 0
        bw = quick_result["bandwidth"][str(row["threads"])]["copy_gbs"]
        assert row["bound_ms"] == pytest.approx(row["batch"] * 512 * 17 / (bw * 1e9) * 1e3)
        assert row["x_bandwidth_bound"] == pytest.approx(row["ms"] / row["bound_ms"])
    for b in (8, 16):
        for lam in (0.95, 1.0):
            for threads in (1, 2):
                group = [
                    r
                    for r in quick_result["results"]
                    if (r["batch"], r["lmbda"], r["threads"]) == (b, lam, threads)
                ]
                fastest = min(r["ms"] for r in group if r["path"] != "token_gae")
                for r in group:
                    assert r["speedup_vs_torchrl_fastest"] == pytest.approx(fastest / r["ms"])
                    lo, med, hi = r["speedup_range"]
                    assert 0 < lo <= med <= hi
    for errors in quick_result["check_max_abs_diff"].values():
        assert set(errors) == {"torchrl_loop", "torchrl_vec"}
        assert all(0.0 <= e <= 1e-4 for e in errors.values())
    t = quick_result["targets"]
    assert t["speedup_met"] == (t["worst_speedup"] >= 5.0)
    assert t["x_bound_met"] == (t["worst_x_bound"] <= 10.0)


def test_bench_gae_check_rejects_a_wrong_torchrl_result() -> None:
    bench = load_benchmark("bench_gae")
    data = bench.make_batch(4, 32, 8, seed=0)
    trl = bench.torchrl_inputs(data, 8)
    paths = bench.make_paths(data, trl, 0.95)
    errors = bench.check_equal(data, paths, 8)
    assert max(errors.values()) < 1e-6
    good = paths["torchrl_loop"]
    paths["torchrl_loop"] = lambda: tuple(x + 1e-3 for x in good())
    with pytest.raises(AssertionError, match=r"torchrl_loop differs from token_gae by 0\.001"):
        bench.check_equal(data, paths, 8)
