"""benchmarks/experiments/algo_options.py: the summary of a finished run (not re-run), the table and the docs
block it writes, on synthetic histories (the runs themselves are recipe runs)."""

from __future__ import annotations

import json
import math

import pytest
from support.bench_helpers import load_benchmark


def module():
    return load_benchmark("algo_options")


def write_run(run_dir, iterations: int, weight: float, bad: bool = False) -> None:
    run_dir.mkdir(parents=True)
    rows = [{"step": 0, "eval/accuracy": 0.5}]
    for i in range(1, iterations + 1):
        rows.append(
            {
                "step": i,
                "rollout/reward_mean": -0.5 + 0.1 * i,
                "rollout/accuracy": 0.1 * i,
                "train/tis_weight_mean": weight,
                "train/loss_objective": math.nan if bad and i == 2 else 0.1,
            }
        )
    rows[-1]["eval/accuracy"] = 0.75
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_a_finished_run_is_summarised_without_running(tmp_path):
    m = module()
    write_run(tmp_path / "a", 10, weight=0.9)
    out = m.one_run(tmp_path / "a", tmp_path / "cache", ("x=1",), 0, 10, ("train/tis_weight_mean",))
    assert out["wall_s"] is None and out["all_finite"]  # not re-run
    assert out["reward_rise"] == pytest.approx(0.8) and out["eval_accuracy_end"] == 0.75
    assert out["diagnostics"] == {"train/tis_weight_mean": pytest.approx(0.9)}
    assert out["diagnostics_logged"] == {"train/tis_weight_mean": 10}
    write_run(tmp_path / "b", 10, weight=1.0, bad=True)
    assert not m.one_run(tmp_path / "b", tmp_path / "c", (), 0, 10, ())["all_finite"]


def test_table_and_docs_block(tmp_path):
    m = module()
    runs = []
    for seed, w in enumerate((0.9, 1.1)):
        write_run(tmp_path / f"r{seed}", 5, weight=w)
        runs.append(
            m.one_run(tmp_path / f"r{seed}", tmp_path, (), seed, 5, ("train/tis_weight_mean",))
        )
    result = {
        "machine": {"torch": "2.13.0+cpu", "cpu_count": 2},
        "iterations": 5,
        "variants": {"async_decoupled": {"overrides": ["train.mode=async"], "runs": runs}},
    }
    table = m.table(result)
    assert "| async_decoupled | `train.mode=async` | 2 | +0.40 [+0.40, +0.40] |" in table
    assert "`train/tis_weight_mean` 1.000 [0.900, 1.100]" in table
    page = tmp_path / "evidence.md"
    page.write_text(f"head\n{m.BEGIN}\nold\n{m.END}\ntail\n")
    m.write_docs(m.docs_block(result), page)
    text = page.read_text()
    assert text.startswith("head\n") and text.endswith("\ntail\n") and "old" not in text
    assert "| async_decoupled |" in text and "5 iterations per run" in text
    page.write_text("no block")
    with pytest.raises(SystemExit, match="has no"):
        m.write_docs("x", page)
    assert m.BEGIN in m.DOCS_PAGE.read_text() and m.DOCS_PAGE.parent.name == "docs"
