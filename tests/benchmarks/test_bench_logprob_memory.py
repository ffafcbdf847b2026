"""Smoke test: ``benchmarks/bench_logprob_memory.py --quick`` runs and writes a consistent JSON.

Peak memory (not time) is a property of the code, so the quick run's budgeted path is also checked
to stay well below the naive ``log_softmax`` (the script asserts equal results before reporting).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_logprob_memory.py"


@pytest.mark.slow  # a benchmark script or a multi-process run: full tier only
def test_bench_logprob_memory_quick(tmp_path: Path) -> None:
    out = tmp_path / "bench_logprob_memory.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "x less than naive" in proc.stdout
    result = json.loads(out.read_text())
    cfg = result["config"]
    assert (cfg["vocab"], cfg["batch"], cfg["length"], cfg["quick"]) == (32768, 2, 256, True)
    assert cfg["budget_chunk_tokens"] == 4 * 2**20 // (32768 * 4 * 5)
    rows = {(r["path"], r["pass"]): r for r in result["results"]}
    assert set(rows) == {
        (p, s) for p in ("naive", "chunk_4096", "budget") for s in ("anchor_no_grad", "train_grad")
    }
    for (_path, pass_), row in rows.items():
        assert row["max_abs_diff_vs_naive"] <= 1e-4
        naive = rows["naive", pass_]["peak_bytes"]
        assert row["x_less_than_naive"] == naive / max(row["peak_bytes"], 1)
    for pass_ in ("anchor_no_grad", "train_grad"):  # naive: ~130-200 MiB; budgeted: a few MiB
        assert rows["budget", pass_]["peak_bytes"] < rows["naive", pass_]["peak_bytes"] / 4
