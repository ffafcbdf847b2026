"""The pure parts of the SmolLM2 benchmark scripts (the runs themselves are benchmarks, not tests):
the rollout-vs-trainer log-prob gaps of compare_backends_smollm2.py and the curve summary of
smollm2_curves.py, each against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch
from support.bench_helpers import load_benchmark
from tensordict import TensorDict


def test_drift_counts_generated_tokens_only():
    td = TensorDict(
        {
            "rollout_log_prob": torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, 9.0]]),
            "sample_log_prob": torch.tensor([[5.0, -1.1, -1.8], [0.0, -0.5, 0.0]]),
            "loss_mask": torch.tensor([[False, True, True], [False, True, False]]),
        },
        [2, 3],
    )
    gaps = load_benchmark("compare_backends_smollm2").drift(td)
    assert gaps["drift_mean"] == pytest.approx((0.1 + 0.2 + 0.0) / 3)
    assert gaps["drift_max"] == pytest.approx(0.2)
    expected_ratio = (math.exp(-0.1) + math.exp(0.2) + 1.0) / 3
    assert gaps["rollout_mean_ratio"] == pytest.approx(expected_ratio)


def test_backend_table_and_summary():
    bench = load_benchmark("compare_backends_smollm2")
    row = dict.fromkeys(bench.METRICS, 1.0)
    results = {
        "trainside": [{**row, "rollout": 0, "tokens": [1, 2]}],
        "sglang": [{**row, "rollout": 0, "loss": 1.5, "tokens": [1, 2]}],
    }
    lines = bench.table(results).splitlines()
    assert len(lines) == 2 + len(bench.METRICS) and "| 0 | loss | 1 | 1.5 | 5.00e-01 |" in lines
    stats = bench.summary(results)
    assert stats["same_tokens"] == [True] and stats["max_abs_diff"]["loss"] == 0.5
    assert stats["all_finite"]


def test_curve_summary_and_plot(tmp_path):
    curves = load_benchmark("smollm2_curves")
    history = [{"step": 0, "eval/accuracy": 0.5}]
    history += [
        {
            "step": i,
            "rollout/reward_mean": i / 10,
            "rollout/accuracy": i / 20,
            "time/generate": 2.0,
            "time/old_log_probs": 1.0,
            "time/update": 3.0,
            "time/sync": 0.0,
        }
        for i in range(1, 11)
    ]
    history[-1]["eval/accuracy"] = 0.75
    s = curves.summarize(history)
    assert s["iterations"] == 10 and s["eval_accuracy"] == [(0, 0.5), (10, 0.75)]
    assert s["reward_first20"] == pytest.approx(0.15) and s["reward_last20"] == pytest.approx(0.95)
    assert s["reward_rise"] == pytest.approx(0.8)
    assert s["seconds_per_iteration"]["time/update"] == 3.0
    assert s["reward_curve"][:2] == [(1, 0.1), (2, 0.2)] and len(s["reward_curve"]) == 10
    assert curves.seed_mean([s["eval_accuracy"], [(0, 0.0), (5, 1.0)]]) == ([0], [0.25])
    curves.plot([("ppo", "ppo s0", history), ("ppo", "ppo s1", history[:4])], tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 5_000
