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
        + ["--out", str(tmp_path / "report.json")]  # no earlier report: every run is on disk
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
    # the run is stamped with the sitting it ran in (the runs not run here are not)
    assert json.loads((stopped / m.SITTINGS_NAME).read_text()) == [m.sitting_id()]
    assert not (tmp_path / "cpu" / "rloo_it4_s0" / m.SITTINGS_NAME).exists()
    assert len(result["variants"]["rloo"]["runs"]) == 1  # the stopped run is not summarised
    table = m.table(result)
    assert (
        "| ppo_separate | `critic=separate` | 2 | +0.45 [+0.30, +0.60] | 0.50 [0.50, 0.50]" in table
    )
    # EV (in sample; out of sample absent from these histories), s / iteration
    assert "| -0.250 [-0.250, -0.250] | - | 2.00 [2.00, 2.00] | yes |" in table
    assert "| grpo | `algo=grpo` | 2 |" in table and "| - | - | 2.00" in table  # no critic: no EV
    block = m.docs_block(result)
    assert block.startswith("<!-- critic_budget_cpu:begin -->")
    page = tmp_path / "evidence.md"
    page.write_text("a\n<!-- critic_budget_cpu:begin -->\nold\n<!-- critic_budget_cpu:end -->\nb\n")
    m.write_docs(block, "critic_budget_cpu", page)
    assert "old" not in page.read_text() and table in page.read_text()
    real = (
        "critic_budget_cpu",
        "critic_budget_smollm2",
        "staleness_cpu",
        "matched_critic_arithmetic",
        "matched_smollm2_mixed",
        "matched_tool_smollm2",
    )
    for stem in real:  # the real page
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


def test_matched_arms_share_the_samples_per_iteration_and_table_the_critic_against_its_ceiling(
    tmp_path, monkeypatch
):
    m = load_benchmark("critic_budget")
    arms = m.VARIANT_SETS["matched"]
    for task, samples in m.MATCHED_SAMPLES_BY_TASK.items():
        task_arms = m.matched_arms(task)
        assert set(m.MATCHED_ARMS) <= set(task_arms), task  # the arms on every task
        for name, overrides in task_arms.items():  # every arm: the same samples per iteration
            prompts = next(int(o.split("=")[1]) for o in overrides if "prompts_per_iter" in o)
            assert prompts * m.samples_per_prompt(overrides) == samples, (task, name)
    assert m.matched_arms("critic_arithmetic") == arms and m.MATCHED_SAMPLES == 256
    with pytest.raises(ValueError, match="no sample count for --task 'cpu'"):
        m.matched_arms("cpu")
    assert m._ceiling("smollm2_mixed") is not None  # found by its config's name
    assert m.samples_per_prompt(arms["grpo_n8"]) == 8 and m.samples_per_prompt(()) == 4
    calls = []
    monkeypatch.setattr(m, "run_recipe", lambda run_dir, cache, *o: calls.append(o))
    args = m.parse_args(
        ["--task", "critic_arithmetic", "--variants", "matched", "--runs", str(tmp_path / "r")]
        + ["--seeds", "1", "--iterations", "5", "--out", str(tmp_path / "report.json")]
    )
    runs = tmp_path / "matched" / "critic_arithmetic"
    for name in arms:
        write_run(runs / f"{name}_it5_s0", 5, 0.1, critic=False)
        path = runs / f"{name}_it5_s0" / "metrics.jsonl"
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        for row in rows[1:]:
            row.update({"rollout/response_length": 10.0, "rollout/groups_generated": 256.0})
            row["rollout/groups_generated"] /= m.samples_per_prompt(arms[name])
            if name.startswith("ppo"):
                row["critic/explained_variance"] = 0.1 * row["step"]
            if name == "grpo_n8":  # twice the first arm's time per iteration
                row["time/update"] = 3.5
            if name == "ppo_n2":  # the within-prompt EV needs >= 2 samples per prompt
                row["critic/explained_variance_within_prompt"] = 0.05 * row["step"]
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    result = m.measure(args)
    assert calls == [] and list(result["variants"]) == list(arms)
    run = result["variants"]["ppo_n1"]["runs"][0]
    assert run["generated_tokens"] == pytest.approx(5 * 256 * 10.0)
    assert run["critic_explained_variance_late"] == pytest.approx(0.5)  # the last 20 %: step 5
    assert run["reward_curve_tokens"][0] == (pytest.approx(256 * 10 / 1e6), pytest.approx(-0.4))
    assert result["variants"]["grpo_n4"]["runs"][0]["critic_explained_variance_late"] is None
    table = m.render(result)
    assert "the starting policy's ceiling is 0.70" in table  # the shipped measurement
    assert "| ppo_n1 | `rollout.prompts_per_iter=256` `rollout.samples_per_prompt=1`" in table
    assert result["variants"]["ppo_n2"]["runs"][0]["critic_within_prompt_late"] == pytest.approx(
        0.25
    )
    assert (
        "| 1 | 0.0128 | +0.40 | 0.50 -> 0.75 | 0.500 | - | - (-) | 2.00 |" in table
    )  # no checkpoint
    assert "| 0.50 -> 0.75 | 0.500 | - | 0.250 (-) | 2.00 |" in table  # ppo_n2
    assert "| grpo_n8 |" in table and "| 0.50 -> 0.75 | - | - | - (-) | 4.00 | 2.00 |" in table
    assert "| 0.50 -> 0.75 | 0.500 | - | 0.250 (-) | 2.00 | 1.00 |" in table  # ppo_n2
    assert m.docs_block(result).startswith("<!-- matched_critic_arithmetic:begin -->")
    m.plot(result, tmp_path / "matched.png")
    assert (tmp_path / "matched.png").stat().st_size > 1000


def test_times_compare_with_the_first_arm_only_within_one_sitting(tmp_path):
    """The last column divides an arm's time per iteration by the first arm's of the same seed only
    where both ran in one sitting (a recorded run from another machine shows "-"): stamped runs by
    their sittings, runs from before the stamp by the commit they were reported at."""
    m = load_benchmark("critic_budget")

    def run(seed, seconds, **stamp):
        return {
            "seed": seed,
            "seconds_per_iteration": seconds,
            "generated_tokens": 1e3,
            "reward_rise": 0.5,
            "eval_accuracy_start": 0.5,
            "eval_accuracy_end": 0.6,
            **stamp,
        }

    result = {
        "task": "tool_smollm2",
        "variants": {
            "ppo_n1": {
                "overrides": ["a=1"],
                "runs": [run(0, 100.0, commit="old"), run(1, 300.0, commit="new", sittings=["B"])],
            },
            "rloo_n8": {
                "overrides": ["b=2"],
                "runs": [
                    run(
                        0, 150.0, commit="new", sittings=["B"]
                    ),  # ran on another machine than ppo_n1's
                    run(1, 150.0, commit="new", sittings=["B"]),
                ],
            },
            "grpo_n8": {
                "overrides": ["c=3"],
                "runs": [
                    run(0, 50.0, commit="old"),
                    run(1, 90.0, commit="new", sittings=["A", "B"]),
                ],
            },
        },
    }
    rows = {line.split(" | ")[0][2:]: line for line in m.matched_table(result).splitlines()[2:]}
    assert rows["ppo_n1"].endswith("| 200.00 [100.00, 300.00] | 1.00 [1.00, 1.00] |")
    assert rows["rloo_n8"].endswith("| 150.00 [150.00, 150.00] | 0.50 |")  # seed 1 only
    assert rows["grpo_n8"].endswith("| 70.00 [50.00, 90.00] | 0.50 |")  # seed 0 only (same commit)


def test_a_report_keeps_the_runs_an_earlier_report_recorded(tmp_path, monkeypatch):
    """A fresh machine has no run dirs: the finished runs the committed report recorded are kept
    (not re-run) where the arm's overrides and the iteration count are unchanged; a run dir on
    disk wins over the record; an arm whose overrides changed runs again."""
    m = load_benchmark("critic_budget")
    calls = []
    monkeypatch.setattr(m, "run_recipe", lambda run_dir, cache, *o: calls.append(run_dir.name))
    out = tmp_path / "report.json"
    argv = ["--task", "tool_smollm2", "--variants", "matched", "--runs", str(tmp_path / "r")]
    argv += ["--seeds", "2", "--iterations", "3", "--out", str(out)]
    arms = m.matched_arms("tool_smollm2")
    runs = tmp_path / "matched" / "tool_smollm2"
    for name in arms:
        write_run(runs / f"{name}_it3_s0", 3, 0.1, critic=False)
    first = m.measure(m.parse_args(argv + ["--report-only"]))
    assert all(len(v["runs"]) == 1 for v in first["variants"].values())
    first["variants"]["grpo_n4"]["overrides"].append("algo.something=else")  # an older arm
    out.write_text(json.dumps(first))
    for name in arms:  # a new machine: no run dir of seed 0 ...
        for f in (runs / f"{name}_it3_s0").iterdir():
            f.unlink()
        (runs / f"{name}_it3_s0").rmdir()
    write_run(runs / "ppo_n1_it3_s0", 3, 0.3, critic=False)  # ... but this one
    result = m.measure(m.parse_args(argv))
    assert sorted(calls) == sorted([f"{name}_it3_s1" for name in arms] + ["grpo_n4_it3_s0"])
    assert result["variants"]["ppo_n1"]["runs"][0]["reward_rise"] == pytest.approx(0.6)  # disk
    kept = result["variants"]["rloo_n8"]["runs"][0]
    assert kept["reward_rise"] == pytest.approx(0.2) and kept["commit"] == first["code"]["commit"]
    assert "grpo_n4" not in result["variants"]  # re-run (by the fake: no history), not kept
    out.write_text(json.dumps(result))
    calls.clear()  # --only / --seeds choose what runs; the report still holds every arm recorded
    only = m.measure(m.parse_args(argv + ["--only", "rloo_n8", "--seeds", "1"]))
    assert calls == [] and set(only["variants"]) == set(arms) - {"grpo_n4"}
    out.write_text(json.dumps({**first, "iterations": 6}))  # another iteration count: none kept
    assert m.recorded_runs(out, m.parse_args(argv), arms) == {}


def test_an_arm_that_must_run_alone_holds_every_job_slot(tmp_path, monkeypatch):
    """``--jobs 2`` on the tool task: the separate-critic arm (~18 GB) never runs beside another
    run, and runs start in the table's order (seed-major)."""
    import threading
    import time

    m = load_benchmark("critic_budget")
    lock, running, seen, started = threading.Lock(), set(), [], []

    def fake(run_dir, cache, *overrides):
        with lock:
            running.add(run_dir.name)
            started.append(run_dir.name)
            seen.append(frozenset(running))
        time.sleep(0.02)
        with lock:
            running.discard(run_dir.name)

    monkeypatch.setattr(m, "run_recipe", fake)
    argv = ["--task", "tool_smollm2", "--variants", "matched", "--runs", str(tmp_path / "r")]
    argv += ["--seeds", "2", "--jobs", "2", "--out", str(tmp_path / "report.json")]
    with pytest.raises(SystemExit, match="no finished run"):  # the fake writes no history
        m.main(argv)
    arms = list(m.matched_arms("tool_smollm2"))
    order = [f"{name}_it6_s{seed}" for seed in (0, 1) for name in arms]
    assert sorted(started) == sorted(order)  # two that start together may log either way round
    assert all(abs(started.index(name) - order.index(name)) <= 1 for name in order)
    alone = [s for s in seen if any(n.startswith("ppo_separate_n2_") for n in s)]
    assert len(alone) == 2 and all(len(s) == 1 for s in alone)
    assert any(len(s) == 2 for s in seen)  # the others do run two at once


def test_no_run_starts_after_the_start_window(tmp_path, monkeypatch, capsys):
    """``--start-within 1.5`` (minutes): a run whose slot comes later is not begun (a sitting
    whose run dirs do not outlive it), and the script says which."""
    m = load_benchmark("critic_budget")
    calls = []
    clock = iter(range(0, 10_000, 60))  # each reading one minute later
    monkeypatch.setattr(m.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(m, "run_recipe", lambda run_dir, cache, *o: calls.append(run_dir.name))
    argv = ["--task", "tool_smollm2", "--variants", "matched", "--runs", str(tmp_path / "r")]
    argv += ["--seeds", "1", "--start-within", "1.5", "--out", str(tmp_path / "report.json")]
    with pytest.raises(SystemExit, match="no finished run"):
        m.main(argv)
    arms = list(m.matched_arms("tool_smollm2"))
    assert calls == [f"{arms[0]}_it6_s0"]  # read at minute 1; the next at minute 2
    assert f"not started (--start-within 1.5 min): {sorted(f'{a}_it6_s0' for a in arms[1:])}" in (
        capsys.readouterr().out
    )
