"""benchmarks/experiments/tool_arithmetic_curves.py on two hand-made runs: the summary against numbers worked
out by hand, the table, the JSON and the PNG."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.bench_helpers import benchmark_path, load_benchmark


def write_run(path, rewards, calls, evals):
    path.mkdir(parents=True)
    rows = [{"step": 0, "eval/accuracy": evals[0][0], "eval/tool_call_rate": evals[0][1]}]
    for i, (r, c) in enumerate(zip(rewards, calls), start=1):
        rows.append(
            {
                "step": i,
                "rollout/reward_mean": r,
                "rollout/accuracy": (r + 1) / 2,
                "rollout/tool_call_rate": c,
                "rollout/turns": 1 + c,
                "time/generate": 1.0,
                "time/update": 0.5,
            }
        )
    rows[-1].update({"eval/accuracy": evals[1][0], "eval/tool_call_rate": evals[1][1]})
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))


def test_summary_table_json_and_png(tmp_path):
    curves = load_benchmark("tool_arithmetic_curves")
    a, b = tmp_path / "ppo_s0", tmp_path / "grpo_s0"
    write_run(a, [-1, -0.5, 0, 0.5, 1.0], [0.2, 0.4, 0.6, 0.8, 1.0], [(0.0, 0.0), (0.75, 1.0)])
    write_run(b, [0.0] * 10, [0.5] * 10, [(0.1, 0.2), (0.1, 0.2)])
    s = curves.summarize(curves.load_run(a))
    assert s["window"] == 1 and s["iterations"] == 5  # 20 % of 5 iterations
    assert s["start"]["rollout/reward_mean"] == -1 and s["last"]["rollout/reward_mean"] == 1.0
    assert s["first"]["rollout/tool_call_rate"] == pytest.approx(0.2)
    assert s["eval_first"]["eval/accuracy"] == 0.0 and s["eval_last"]["eval/accuracy"] == 0.75
    assert s["seconds_per_iteration"] == 1.5
    t = curves.summarize(curves.load_run(b))
    assert t["window"] == 2 and t["last"]["rollout/accuracy"] == 0.5
    write_run(tmp_path / "c", [0.0, 1.0, 0.5, 0.5, 0.5], [0.1] * 5, [(0, 0), (0, 0)])
    c = curves.summarize(curves.load_run(tmp_path / "c"))
    assert c["start"]["rollout/reward_mean"] == 0.0 and c["first"]["rollout/reward_mean"] == 0.0
    assert c["last"]["rollout/reward_mean"] == 0.5
    out, png = tmp_path / "c.json", tmp_path / "c.png"
    cmd = [sys.executable, str(benchmark_path("tool_arithmetic_curves")), "--run", f"ppo:{a}"]
    cmd += ["--run", f"grpo:{b}", "--out", str(out), "--png", str(png)]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=benchmark_path("tool_arithmetic_curves").parent,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (
        "| ppo | 1 | -1.00 [-1.00, -1.00] -> 1.00 [1.00, 1.00] | 2.00 [2.00, 2.00] |" in proc.stdout
    )
    assert "| grpo | 1 |" in proc.stdout
    data = json.loads(out.read_text())
    assert set(data["runs"]) == {"ppo ppo_s0", "grpo grpo_s0"} and png.stat().st_size > 1000
