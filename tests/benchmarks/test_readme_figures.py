"""benchmarks/experiments/readme_figures.py: the figures it computes and the docs block it writes.

The runs themselves are recipe runs (tests/recipes/test_recipe.py covers them); here the summary of a
history, the block and its insertion are checked on a synthetic result.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.bench_helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


def module():
    return load_benchmark("readme_figures")


def history(rise: float) -> list[dict]:
    steps = [{"step": 0, "eval/reward_mean": -0.5, "eval/accuracy": 0.25}]
    for i in range(1, 11):
        r = -0.5 + rise * (i > 8)  # the last 2 iterations (20 %) are better by `rise`
        steps.append(
            {
                "step": i,
                "rollout/reward_mean": r,
                "rollout/accuracy": (r + 1) / 2,
                "time/generate": 0.2,
                "time/update": 0.1,
            }
        )
    steps[-1].update({"eval/reward_mean": 0.5, "eval/accuracy": 0.75})
    return steps


def test_figures_of_a_history():
    f = module().figures(history(0.8))
    assert f["iterations"] == 10 and f["reward_rise"] == pytest.approx(0.8)
    assert (f["accuracy_first"], f["accuracy_last"]) == pytest.approx((0.25, 0.65))
    assert (f["eval_accuracy_start"], f["eval_accuracy_end"]) == (0.25, 0.75)
    assert f["stage_s_per_iteration"] == pytest.approx(0.3)


def test_block_states_load_and_threads_and_replaces_the_docs_section(tmp_path):
    mod = module()
    run = {
        "wall_s": 120.0,
        "load_avg_before": (0.5, 0.4, 0.3),
        "load_avg_after": (1.5, 1, 1),
        **mod.figures(history(0.9)),
    }
    result = {
        "machine": {"threads": 1, "cpu_count": 2, "torch": "2.13.0"},
        "warm_start_s": 16.0,
        "default": [run] * 5,
        "grpo": run,
        "rloo": [run] * 5,
        "ci": [run] * 5,
    }
    block = mod.docs_block(result)
    assert "| reward rise | +0.90 | +0.90 | +0.90 | +0.90 | +0.90 |" in block
    assert "`algo=rloo` (10 iterations, leave-one-out baselines, no critic) rose by +0.90" in block
    assert "takes 2.0 minutes" in block and "1 thread, 2 cores" in block
    assert "load average 0.5-1.5" in block
    page = tmp_path / "evidence.md"
    page.write_text(f"intro\n{mod.BEGIN}\nold figures\n{mod.END}\nrest\n")
    mod.write_docs(block, page)
    assert page.read_text() == f"intro\n{mod.BEGIN}\n{block}\n{mod.END}\nrest\n"
    assert mod.DOCS_PAGE == ROOT / "docs" / "evidence.md"
    text = mod.DOCS_PAGE.read_text()
    assert text.count(mod.BEGIN) == text.count(mod.END) == 1  # the real page has the block
    assert mod.BEGIN not in (ROOT / "README.md").read_text()  # the front door quotes, no block


def test_the_docs_blocks_are_what_the_committed_results_give():
    """Each marked block of docs/evidence.md is the script's rendering of its committed JSON (the
    block and the results moved together; a hand edit of a block would be overwritten)."""
    import json

    figures, algo, budget = (
        load_benchmark(n) for n in ("readme_figures", "algo_options", "critic_budget")
    )
    results = ROOT / "benchmarks" / "results"
    text = figures.DOCS_PAGE.read_text()
    blocks = [
        f"{figures.BEGIN}\n{figures.docs_block(json.loads((results / 'readme_figures.json').read_text()))}\n{figures.END}",
        algo.docs_block(json.loads((results / "algo_options.json").read_text())),
    ]
    for stem in (
        "critic_budget_cpu",
        "critic_budget_smollm2",
        "staleness_cpu",
        "matched_critic_arithmetic",
        "matched_smollm2_mixed",
        "matched_tool_smollm2",
    ):
        blocks.append(budget.docs_block(json.loads((results / f"{stem}.json").read_text())))
    for stem in ("critic_offline", "critic_targets"):
        blocks.append(
            load_benchmark(stem).docs_block(json.loads((results / f"{stem}.json").read_text()))
        )
    for block in blocks:
        assert block in text, block.splitlines()[0]


def test_hydra_flags_go_before_the_overrides():
    """``--config-name`` among the overrides (critic_budget.py's smollm2 task) must precede them:
    Hydra's argparse refuses ``a=1 --config-name x b=2``."""
    m = module()
    cmd = m.recipe_command(Path("/r"), "--config-name", "x", "seed=1", "--config-dir=d", "a=2")
    assert cmd[2:] == [
        "--config-name",
        "x",
        "--config-dir=d",
        "hydra.run.dir=/r",
        "train.plot=false",
        "seed=1",
        "a=2",
    ]
    cmd = m.recipe_command(Path("/r"), "seed=1")
    assert cmd[2:] == ["hydra.run.dir=/r", "train.plot=false", "seed=1"]
