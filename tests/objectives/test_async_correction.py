"""Async mode as decoupled PPO (issue 19, item 3): the behaviour-policy weight
``min(exp(sample_log_prob - rollout_log_prob), tis_cap)`` on each token's policy loss, on by default
in async mode (``train.async_correction=decoupled``), logged; ``none`` is an explicit, warned
opt-out; ``algo.tis_cap`` sets the cap in any mode."""

from __future__ import annotations

import logging

import pytest
import torch
from support.recipe_helpers import typed
from support.trajectories import group_batch, perturb, tiny_actor_critic

from ar_torchrl.functional import masked_mean
from ar_torchrl.objectives import TokenGAE, TokenPPOLoss
from ar_torchrl.recipes.dapo_ppo import build
from ar_torchrl.training import plan_micro_batches, recompute_old_log_probs_and_values


def test_the_weights_are_logged_and_multiply_the_policy_loss_only():
    ac = tiny_actor_critic(seed=1)
    td = group_batch(seed=3)
    plan = plan_micro_batches(td, token_budget=1000)
    recompute_old_log_probs_and_values(ac, td, plan)
    TokenGAE(gamma=1.0, lmbda=0.9)(td)
    g = torch.Generator().manual_seed(0)
    # the behaviour policy: the anchors moved by up to +-1 nat (some weights above the cap)
    td["rollout_log_prob"] = td["sample_log_prob"] + (torch.rand(td.shape, generator=g) * 2 - 1)
    perturb(ac.model, scale=0.02, seed=4)
    plain = TokenPPOLoss(ac)(td)
    out = TokenPPOLoss(ac, tis_cap=2.0)(td)
    mask = td["loss_mask"]
    raw = torch.exp(td["sample_log_prob"] - td["rollout_log_prob"])
    torch.testing.assert_close(out["tis_weight_mean"], masked_mean(raw.clamp(max=2.0), mask))
    capped = masked_mean((raw > 2.0).float(), mask)
    torch.testing.assert_close(out["tis_weight_capped"], capped)
    assert 0 < out["tis_weight_capped"] < 1
    assert out["loss_objective"] != plain["loss_objective"]
    torch.testing.assert_close(
        out["loss_critic"], plain["loss_critic"]
    )  # the value loss: unweighted
    assert (
        "tis_weight_mean" not in plain.keys()
        and "tis_weight_mean" in TokenPPOLoss(ac, tis_cap=2.0).out_keys
    )


def test_async_mode_corrects_by_default_and_none_is_a_warned_opt_out(caplog):
    assert build.tis_cap(typed(["train.mode=sync"])) is None
    assert build.tis_cap(typed(["train.mode=async"])) == build.DECOUPLED_TIS_CAP == 2.0
    assert build.tis_cap(typed(["train.mode=async", "algo.tis_cap=5.0"])) == 5.0
    assert build.tis_cap(typed(["train.mode=sync", "algo.tis_cap=3.0"])) == 3.0
    with caplog.at_level(logging.WARNING, logger="ar_torchrl.recipes.dapo_ppo.build"):
        assert build.tis_cap(typed(["train.mode=async", "train.async_correction=none"])) is None
    assert "train.async_correction=none: the batch was sampled by the previous weights" in (
        caplog.text
    )
    with pytest.raises(ValueError, match=r"async_correction='always' is not one of"):
        typed(["train.async_correction=always"])
    with pytest.raises(ValueError, match=r"tis_cap must be > 0, got 0.0"):
        typed(["algo.tis_cap=0.0"])
