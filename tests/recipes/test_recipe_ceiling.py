"""The ceiling tool (ar_torchrl.recipes.ceiling): a synthetic policy through the real env recovers
its closed-form ceilings; Monte-Carlo returns with shaping; a recipe configuration's policy and
checkpoint; clear errors."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from support.recipe_helpers import typed
from support.synthetic_policy import BernoulliTreeBackend, analytic_ceilings, tree_reward, tree_rows
from tensordict import TensorDict

from ar_torchrl.backends import SamplingParams
from ar_torchrl.checkpoint.local import save_checkpoint
from ar_torchrl.data.datasets import MathDataset
from ar_torchrl.envs import LLMEnv
from ar_torchrl.models import build_char_tokenizer
from ar_torchrl.recipes.ceiling import (
    POSITION_BUCKETS,
    ceiling_from_trajectories,
    ceiling_of_config,
    measure_ceiling,
    policy_for_ceiling,
)

torch.set_num_threads(1)


def tree_env(rows: int, k: int, per_batch: int = 16) -> LLMEnv:
    tok = build_char_tokenizer()
    return LLMEnv(
        MathDataset(tree_rows(rows)),
        tok,
        BernoulliTreeBackend(tok, seed=3),
        reward_fn=tree_reward,
        num_samples=k,
        prompts_per_batch=per_batch,
        sampling=SamplingParams(max_new_tokens=4),
    )


def test_measure_ceiling_recovers_the_closed_form_through_the_env():
    """128 prompts x 32 samples of the Bernoulli tree (support/synthetic_policy.py) through
    LLMEnv, the token trajectory and prefix states: the token, prompt and within-prompt ceilings
    within 3 standard errors."""
    truth = analytic_ceilings()
    report = measure_ceiling(tree_env(128, 32), 128, seed=1)
    assert (report.prompts, report.samples_per_prompt) == (128, 32)
    assert report.token.items == 128 * 32 * 3 and report.response_length == 3.0
    # states: the prompt, + the first step (2), + both steps (4) per prompt, all seen twice or more
    assert report.token.states <= 128 * 7 and report.prompt.states == 128
    assert truth["within_prompt"] == pytest.approx(0.4680, abs=1e-4)
    for level in ("token", "prompt", "within_prompt"):
        est = getattr(report, level)
        assert 0 < est.stderr < 0.08
        assert abs(est.ceiling - truth[level]) < 3 * est.stderr, (level, est, truth[level])
    # the last third (EOS, the outcome written) is decided: a perfect critic explains all of it
    assert set(report.by_position) == set(POSITION_BUCKETS)
    assert report.by_position["late"].ceiling == pytest.approx(1.0)
    assert report.by_position["early"].ceiling == pytest.approx(report.prompt.ceiling, abs=0.02)
    assert len(report.per_prompt) == 128 and all(p["samples"] == 32 for p in report.per_prompt)
    assert report.return_mean == pytest.approx(
        sum(p["return_mean"] for p in report.per_prompt) / 128
    )


def trajectory(tokens, attention, trained, reward, prompt_id) -> TensorDict:
    return TensorDict(
        {
            "tokens": torch.tensor(tokens),
            "attention_mask": torch.tensor(attention).bool(),
            "loss_mask": torch.tensor(trained).bool(),
            ("next", "reward"): torch.tensor(reward, dtype=torch.float32).unsqueeze(-1),
            "prompt_id": torch.tensor(prompt_id),
        },
        batch_size=[len(tokens), len(tokens[0])],
    )


def test_returns_are_reward_to_go_with_shaping_and_batches_of_any_width():
    """Two batches of different widths (the same prompt left-padded differently); a per-token
    shaping reward of -0.5 on a middle token: the token returns are sums of rewards to the end."""
    a = trajectory(
        [[0, 5, 6, 7, 8]],
        [[0, 1, 1, 1, 1]],
        [[0, 0, 1, 1, 1]],
        [[0, 0, -0.5, 0, 1.0]],
        [[0, 0, 0, 0, 0]],
    )
    b = trajectory(
        [[5, 6, 7, 9, 0, 0], [5, 6, 7, 8, 0, 0]],
        [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0]],
        [[0, 1, 1, 1, 0, 0], [0, 1, 1, 1, 0, 0]],
        [[0, 0, 0, -1.0, 0, 0], [0, 0, 0, 1.0, 0, 0]],
        [[0] * 6, [0] * 6],
    )
    report = ceiling_from_trajectories([a, b], samples_per_prompt=3, bootstrap=0)
    # returns: row a: 0.5, 1, 1; rows b: -1, -1, -1 and 1, 1, 1. States: "5" (3 tokens), "5 6"
    # (3 tokens), "5 6 7" (3 tokens); the row-a token after "5 6 7" and row b's share it.
    returns = [0.5, 1.0, 1.0, -1.0, -1.0, -1.0, 1.0, 1.0, 1.0]
    mean = sum(returns) / 9
    total = sum((r - mean) ** 2 for r in returns) / 8
    groups = [[0.5, -1.0, 1.0], [1.0, -1.0, 1.0], [1.0, -1.0, 1.0]]

    def var(g):
        m = sum(g) / len(g)
        return sum((x - m) ** 2 for x in g) / (len(g) - 1)

    within = sum(3 * var(g) for g in groups) / 9
    assert report.token.states == 3 and report.token.singletons == 0
    assert report.token.total_var == pytest.approx(total)
    assert report.token.within_var == pytest.approx(within)
    assert report.prompt.items == 3 and report.prompt.states == 1  # one prompt: 5
    assert report.return_mean == pytest.approx((0.5 - 1 + 1) / 3)
    assert report.response_length == 3.0


def test_bad_input():
    with pytest.raises(ValueError, match="prompts must be >= 2, got 1"):
        measure_ceiling(tree_env(4, 2), 1)
    with pytest.raises(ValueError, match="samples 1 response per prompt"):
        measure_ceiling(tree_env(4, 1), 4)
    with pytest.raises(ValueError, match="no trajectories given"):
        ceiling_from_trajectories([], samples_per_prompt=2)


# ----------------------------------------------------------------------------- configurations
COLD = ["model.warm_start.enabled=false", "data.num_rows=100", "rollout.max_new_tokens=4"]


def test_ceiling_of_config_samples_with_the_recipes_settings():
    cfg = typed(COLD)
    report = ceiling_of_config(cfg, prompts=6, samples_per_prompt=3, prompts_per_batch=4)
    assert report.samples_per_prompt == 3 and report.prompt.items == 8 * 3  # two batches of 4
    assert report.response_length <= 4  # rollout.max_new_tokens
    assert math.isfinite(report.token.total_var)
    held = ceiling_of_config(cfg, prompts=4, samples_per_prompt=2, split="holdout", bootstrap=0)
    assert held.prompt.items == 8
    with pytest.raises(ValueError, match="split must be 'train' or 'holdout', got 'test'"):
        ceiling_of_config(cfg, split="test")


def test_policy_for_ceiling_loads_a_checkpoint(tmp_path):
    cfg = typed(COLD)
    start, _ = policy_for_ceiling(cfg)
    trained, _ = policy_for_ceiling(cfg)
    with torch.no_grad():
        trained.lm_head.weight.add_(0.5)
    path = save_checkpoint(tmp_path / "checkpoints", step=3, model=trained)
    loaded, _ = policy_for_ceiling(cfg, path)
    assert torch.equal(loaded.lm_head.weight, trained.lm_head.weight)
    assert not torch.equal(loaded.lm_head.weight, start.lm_head.weight)
    with pytest.raises(ValueError, match="distributed \\(FSDP2\\) checkpoint directory"):
        policy_for_ceiling(cfg, tmp_path)
    separate = dataclasses.replace(cfg, critic=dataclasses.replace(cfg.critic, kind="separate"))
    with pytest.raises(ValueError, match="holds no separate critic"):
        policy_for_ceiling(separate, path)  # the checkpoint must match the configuration
