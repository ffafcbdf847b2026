"""benchmarks/experiments/critic_budget.py on synthetic histories: finished runs are summarised and not re-run,
an unfinished run resumes from its checkpoint, the table, docs block and PNG (the runs
themselves are recipe runs)."""

from __future__ import annotations

import json

import pytest
from support.bench_helpers import load_benchmark


def write_run(run_dir, iterations: int, slope: float, critic: bool = True) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = [{"step": 0, "eval/accuracy": 0.5}]
    for i in range(1, iterations + 1):
        row = {
            "step": i,
            "rollout/reward_mean": -0.5 + slope * i,
            "rollout/accuracy": 0.1,
            "time/update": 1.5,
            "time/generate": 0.5,
        }
        if critic:
            row["train/explained_variance"] = -0.1 * i
        rows.append(row)
    rows[-1]["eval/accuracy"] = 0.75
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_runs_are_summarised_resumed_and_tabled(tmp_path, monkeypatch):
    m = load_benchmark("critic_budget")
    calls = []
    monkeypatch.setattr(m, "run_recipe", lambda run_dir, cache, *o: calls.append((run_dir, o)))
    args = m.parse_args(
        ["--task", "cpu", "--runs", str(tmp_path), "--seeds", "2", "--iterations", "4"]
    )
    for name in m.VARIANTS:
        for seed in range(2):
            write_run(tmp_path / "cpu" / f"{name}_it4_s{seed}", 4, 0.1 * (seed + 1), "ppo" in name)
    stopped = tmp_path / "cpu" / "rloo_it4_s1"
    write_run(stopped, 2, 0.2, critic=False)  # stopped at iteration 2, with a checkpoint
    (stopped / "checkpoints").mkdir()
    (stopped / "checkpoints" / "step_2.pt").write_bytes(b"x")
    result = m.measure(args)
    assert [run_dir for run_dir, _ in calls] == [stopped]  # only the unfinished run runs again
    overrides = calls[0][1]
    assert f"train.resume_from={stopped}" in overrides and "algo=rloo" in overrides
    assert "seed=1" in overrides and "train.iterations=4" in overrides
    assert len(result["variants"]["rloo"]["runs"]) == 1  # the stopped run is not summarised
    table = m.table(result)
    assert (
        "| ppo_separate | `critic=separate` | 2 | +0.45 [+0.30, +0.60] | 0.50 [0.50, 0.50]" in table
    )
    assert "| -0.250 [-0.250, -0.250] | 2.00 [2.00, 2.00] | yes |" in table  # EV, s / iteration
    assert "| grpo | `algo=grpo` | 2 |" in table and "| - | 2.00" in table  # no critic: no EV
    block = m.docs_block(result)
    assert block.startswith("<!-- critic_budget_cpu:begin -->")
    page = tmp_path / "evidence.md"
    page.write_text("a\n<!-- critic_budget_cpu:begin -->\nold\n<!-- critic_budget_cpu:end -->\nb\n")
    m.write_docs(block, "critic_budget_cpu", page)
    assert "old" not in page.read_text() and table in page.read_text()
    for stem in ("critic_budget_cpu", "critic_budget_smollm2", "staleness_cpu"):  # the real page
        assert all(marker in m.DOCS_PAGE.read_text() for marker in m.begin_end(stem))
    m.plot(result, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 1000


def test_summary_of_one_run():
    m = load_benchmark("critic_budget")
    h = [{"step": 0, "eval/accuracy": 0.25}]
    h += [{"step": i, "rollout/reward_mean": float(i), "rollout/accuracy": 0.5} for i in (1, 2)]
    s = m.summarize(h)
    assert s["explained_variance"] is None and s["reward_rise"] == pytest.approx(1.0)
    assert s["reward_curve"] == [(1, 1.0), (2, 2.0)] and s["eval_curve"] == [(0, 0.25)]
