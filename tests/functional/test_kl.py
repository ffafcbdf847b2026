"""KL penalties (ar_torchrl.functional.kl_penalty): each estimator's value against a plain loop, and
its expected gradient, enumerated exactly over a small categorical policy (no sampling), against the
analytic gradient the module documents: k1 none, k2 the reverse KL's, k3 the forward KL's,
k3_unbiased the reverse KL's under any sampling policy."""

from __future__ import annotations

import math

import pytest
import torch

from ar_torchrl.functional import kl_penalty

V = 7
F64 = torch.float64  # exact comparisons: double precision throughout


def policies(seed: int):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(V, generator=g, dtype=F64).requires_grad_(True)
    ref = torch.log_softmax(torch.randn(V, generator=g, dtype=F64), -1)
    old = torch.log_softmax(torch.randn(V, generator=g, dtype=F64), -1)  # another sampling policy
    return theta, ref, old


def expected_grad(estimator: str, seed: int, off_policy: bool) -> tuple[torch.Tensor, ...]:
    """grad_theta of E_{x ~ q}[k(x)] (sum over the whole vocabulary, q fixed), and the analytic
    gradients of KL(pi || ref) and KL(ref || pi)."""
    theta, ref, old = policies(seed)
    lp = torch.log_softmax(theta, -1)
    q = old.exp() if off_policy else lp.detach().exp()
    old_lp = old if off_policy else lp.detach()
    mask = torch.ones(1, V, dtype=torch.bool)
    k = kl_penalty(lp[None], ref[None], mask, estimator=estimator, old_log_prob=old_lp[None])[0]
    (grad,) = torch.autograd.grad((q * k).sum(), theta, retain_graph=True)
    pi = lp.exp()
    (reverse,) = torch.autograd.grad((pi * (lp - ref)).sum(), theta, retain_graph=True)
    lp2 = torch.log_softmax(theta, -1)
    (forward,) = torch.autograd.grad((ref.exp() * (ref - lp2)).sum(), theta)
    return grad, reverse, forward


@pytest.mark.parametrize("seed", range(5))
def test_each_estimator_gives_the_documented_gradient_exactly(seed):
    g1, reverse, forward = expected_grad("k1", seed, off_policy=False)
    torch.testing.assert_close(
        g1, torch.zeros(V, dtype=F64), atol=1e-12, rtol=0
    )  # no gradient as a loss
    g2, _, _ = expected_grad("k2", seed, off_policy=False)
    torch.testing.assert_close(g2, reverse, atol=1e-12, rtol=1e-10)
    g3, _, _ = expected_grad("k3", seed, off_policy=False)
    torch.testing.assert_close(
        g3, forward, atol=1e-12, rtol=1e-10
    )  # the forward KL (OpenRLHF #1309)
    assert (g3 - reverse).abs().max() > 1e-3  # ... which is not the reverse one
    gu, _, _ = expected_grad("k3_unbiased", seed, off_policy=True)
    torch.testing.assert_close(gu, reverse, atol=1e-12, rtol=1e-10)  # off-policy and still exact
    gu_on, _, _ = expected_grad("k3_unbiased", seed, off_policy=False)
    torch.testing.assert_close(gu_on, reverse, atol=1e-12, rtol=1e-10)
    g3_off, _, _ = expected_grad("k3", seed, off_policy=True)
    assert (g3_off - reverse).abs().max() > 1e-3 and (g3_off - forward).abs().max() > 1e-3


@pytest.mark.parametrize("seed", range(3))
def test_values_k1_k3_estimate_the_reverse_kl_on_policy(seed):
    theta, ref, old = policies(seed)
    lp = torch.log_softmax(theta, -1).detach()
    pi, mask = lp.exp(), torch.ones(1, V, dtype=torch.bool)
    kl = float((pi * (lp - ref)).sum())
    for est in ("k1", "k3"):
        k = kl_penalty(lp[None], ref[None], mask, estimator=est)[0]
        assert float((pi * k).sum()) == pytest.approx(kl, rel=1e-10)
    k = kl_penalty(lp[None], ref[None], mask, estimator="k3_unbiased", old_log_prob=old[None])[0]
    assert float((old.exp() * k).sum()) == pytest.approx(kl, rel=1e-10)  # importance-corrected


def test_against_a_plain_loop_masked_positions_zero_with_no_gradient():
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(3, 5, generator=g, dtype=F64) * 3).requires_grad_(True)
    ref = -torch.rand(3, 5, generator=g, dtype=F64) * 3
    old = -torch.rand(3, 5, generator=g, dtype=F64) * 3
    mask = torch.rand(3, 5, generator=g) > 0.3
    garbage = torch.where(mask, ref, torch.full_like(ref, float("nan")))
    for est in ("k1", "k2", "k3", "k3_unbiased"):
        out = kl_penalty(lp, garbage, mask, estimator=est, old_log_prob=old)
        for b in range(3):
            for t in range(5):
                if not mask[b, t]:
                    assert out[b, t] == 0.0
                    continue
                d = float(lp[b, t].detach() - ref[b, t])
                k3 = math.exp(-d) - 1 + d
                want = {
                    "k1": d,
                    "k2": d * d / 2,
                    "k3": k3,
                    "k3_unbiased": math.exp(float(lp[b, t].detach() - old[b, t])) * k3,
                }[est]
                assert float(out[b, t].detach()) == pytest.approx(want, rel=1e-12)
        (grad,) = torch.autograd.grad(out.sum(), lp)
        assert (grad[~mask] == 0).all() and torch.isfinite(grad).all()


def test_bad_inputs_are_named():
    lp, mask = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"estimator must be one of \['k1', 'k2', 'k3', 'k3_un"):
        kl_penalty(lp, lp, mask, estimator="k4")
    with pytest.raises(ValueError, match=r"needs old_log_prob \(the sampling policy's"):
        kl_penalty(lp, lp, mask, estimator="k3_unbiased")
    with pytest.raises(ValueError, match=r"ref_log_prob has shape \(2, 4\) but log_prob has"):
        kl_penalty(lp, torch.zeros(2, 4), mask, estimator="k2")
    with pytest.raises(ValueError, match=r"old_log_prob has shape \(3, 3\) but log_prob has"):
        kl_penalty(lp, lp, mask, estimator="k3_unbiased", old_log_prob=torch.zeros(3, 3))
    with pytest.raises(TypeError, match="mask must be a bool tensor"):
        kl_penalty(lp, lp, mask.long(), estimator="k1")


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "k3_unbiased"])
def test_token_ppo_loss_uses_the_estimator_on_trained_tokens(estimator):
    from support.trajectories import group_batch, perturb, tiny_actor_critic

    from ar_torchrl.functional import masked_mean
    from ar_torchrl.objectives import TokenGAE, TokenPPOLoss
    from ar_torchrl.training import plan_micro_batches, recompute_old_log_probs_and_values

    ac = tiny_actor_critic(seed=1)
    td = group_batch(seed=3)
    plan = plan_micro_batches(td, token_budget=1000)
    recompute_old_log_probs_and_values(ac, td, plan)
    td["ref_log_prob"] = td["sample_log_prob"] - 0.1 * torch.rand(td["sample_log_prob"].shape)
    td = TokenGAE(gamma=1.0, lmbda=0.9)(td)
    perturb(ac.model, scale=0.02, seed=4)  # the policy moved: log_prob != sample_log_prob
    loss = TokenPPOLoss(ac, kl_coeff=0.5, kl_estimator=estimator)
    out = loss(td)
    new = ac(td.clone())  # the policy's log-probs in the same forward geometry
    lp, mask = new["log_prob"], td["loss_mask"]
    want = kl_penalty(
        lp, td["ref_log_prob"], mask, estimator=estimator, old_log_prob=td["sample_log_prob"]
    )
    torch.testing.assert_close(out["loss_kl"], 0.5 * masked_mean(want, mask), rtol=1e-5, atol=1e-7)
    k3 = kl_penalty(lp, td["ref_log_prob"], mask, estimator="k3")
    torch.testing.assert_close(out["kl_ref"], masked_mean(k3, mask), rtol=1e-5, atol=1e-7)


def test_token_ppo_loss_refuses_an_unknown_estimator():
    from support.trajectories import tiny_actor_critic

    from ar_torchrl.objectives import TokenPPOLoss

    with pytest.raises(ValueError, match=r"kl_estimator='k4' is not one of \['k1', 'k2', 'k3'"):
        TokenPPOLoss(tiny_actor_critic(seed=0), kl_coeff=0.1, kl_estimator="k4")


# ---------------------------------------------------------------------------- KL in the reward
def test_kl_reward_shaping_against_a_loop_then_gae():
    from support.reference import gae_loop
    from tensordict import TensorDict

    from ar_torchrl.objectives import KLRewardShaping, TokenGAE

    g = torch.Generator().manual_seed(0)
    B, L = 3, 6
    mask = torch.rand(B, L, generator=g) > 0.3
    old, ref = -torch.rand(B, L, generator=g) * 2, -torch.rand(B, L, generator=g) * 2
    reward = torch.where(mask, torch.randn(B, L, generator=g), 0.0)
    value = torch.randn(B, L, generator=g)
    td = TensorDict(
        {
            "loss_mask": mask,
            "sample_log_prob": old,
            "ref_log_prob": ref,
            "state_value": value.unsqueeze(-1),
            "next": {"reward": reward.unsqueeze(-1).clone()},
        },
        [B, L],
    )
    shaping = KLRewardShaping(beta=0.2, estimator="k2")
    shaping(td)
    for b in range(B):
        for t in range(L):
            d = float(old[b, t] - ref[b, t])
            want = float(reward[b, t]) - (0.2 * d * d / 2 if mask[b, t] else 0.0)
            assert float(td["next", "reward"][b, t, 0]) == pytest.approx(want, rel=1e-6)
    want_kl = float(torch.where(mask, 0.5 * (old - ref) ** 2, 0.0).sum() / mask.sum())
    assert shaping.last_kl == pytest.approx(want_kl, rel=1e-6)
    TokenGAE(gamma=1.0, lmbda=0.9, normalize_advantage=False)(td)
    adv, _ = gae_loop(td["next", "reward"].squeeze(-1), value, mask, gamma=1.0, lmbda=0.9)
    torch.testing.assert_close(td["advantage"].squeeze(-1).double(), adv, rtol=1e-5, atol=1e-6)


def test_kl_reward_shaping_bad_inputs():
    from tensordict import TensorDict

    from ar_torchrl.objectives import KLRewardShaping

    with pytest.raises(ValueError, match="KLRewardShaping: beta must be > 0, got 0"):
        KLRewardShaping(beta=0)
    with pytest.raises(ValueError, match=r"estimator='k3_unbiased' is not one of \['k1', 'k2'"):
        KLRewardShaping(beta=0.1, estimator="k3_unbiased")
    td = TensorDict(
        {
            "loss_mask": torch.ones(1, 2, dtype=torch.bool),
            "sample_log_prob": torch.zeros(1, 2),
            "next": {"reward": torch.zeros(1, 2, 1)},
        },
        [1, 2],
    )
    with pytest.raises(KeyError, match=r"missing key 'ref_log_prob' \(reference log-probs"):
        KLRewardShaping(beta=0.1)(td)


@pytest.mark.slow
def test_recipe_kl_in_reward_runs_and_is_refused_for_grpo(tmp_path, cache_dir):
    from support.recipe_runs import run_recipe

    keys = ["train.iterations=2", "train.eval_every=0", "train.plot=false"]
    keys += ["algo.kl_coeff=0", "algo.kl_in_reward=0.05"]
    _, history = run_recipe(tmp_path / "run", cache_dir, *keys)
    steps = [h for h in history if "rollout/reward_mean" in h]
    assert len(steps) == 2 and all(math.isfinite(h["train/kl_in_reward"]) for h in steps)
    assert steps[0]["train/kl_in_reward"] == 0.0  # the first batch: policy == reference
    assert steps[1]["train/kl_in_reward"] != 0.0 and "train/loss_kl" not in steps[1]
    from support.recipe_helpers import (
        typed,  # the config check, in-process (no second recipe launch)
    )

    with pytest.raises(ValueError, match=r"algo.kl_in_reward=0.05 shapes the per-token rewards"):
        typed(["algo=grpo", "algo.kl_in_reward=0.05"])
