"""The recipe with bounded staleness (``train.max_policy_lag=2``) and partial rollouts, end to end,
and the configuration errors of both keys."""

from __future__ import annotations

import math

import pytest
from support.recipe_helpers import typed
from support.recipe_runs import run_recipe


@pytest.mark.slow
def test_bounded_staleness_with_partial_rollouts_trains_within_the_bound(tmp_path, cache_dir):
    """train.mode=async train.max_policy_lag=2 train.partial_rollouts=true: batches are generated
    ahead (admission control), the trainer's syncs interrupt the batch being generated, every
    batch's oldest token lags at most 2 versions, the token-lag fractions describe every trained
    token, and the decoupled correction weights the policy loss."""
    _, history = run_recipe(
        tmp_path,
        cache_dir,
        "train.mode=async",
        "train.max_policy_lag=2",
        "train.partial_rollouts=true",
        "train.iterations=5",
        "train.eval_every=5",
        "train.eval_prompts=8",
        "train.plot=false",
    )
    steps = history[1:]
    assert [h["step"] for h in steps] == [1, 2, 3, 4, 5]
    for h in steps:
        assert 0 <= h["rollout/policy_lag"] <= 2
        fractions = [h[f"rollout/token_lag_{lag}"] for lag in range(3)]
        assert sum(fractions) == pytest.approx(1.0) and all(0 <= f <= 1 for f in fractions)
        assert math.isfinite(h["train/loss_objective"]) and "train/tis_weight_mean" in h
    assert steps[0]["rollout/policy_lag"] == 0 and max(h["rollout/policy_lag"] for h in steps) >= 1
    assert steps[-1]["rollout/interruptions"] >= 0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["train.max_policy_lag=2"],
            r"train.mode=sync: train.max_policy_lag=2 generates batches ahead",
        ),
        (
            ["train.partial_rollouts=true"],
            r"train.mode=sync: train.partial_rollouts=true generates",
        ),
        (["train.mode=async", "train.max_policy_lag=0"], r"train.max_policy_lag must be >= 1"),
    ],
)
def test_staleness_config_errors_name_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        typed(overrides)
