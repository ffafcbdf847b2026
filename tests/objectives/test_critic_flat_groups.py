"""Rows for the critic only (``policy_mask``; dynamic sampling's zero-spread groups with
``rollout.critic_flat_groups``): the policy terms equal those of the batch without those rows, the
value loss is that of the whole batch, TokenGAE whitens over the policy's tokens, and micro-batch
accumulation with the split normaliser equals one forward."""

from __future__ import annotations

import pytest
import torch
from support.trajectories import make_trajectory, tiny_actor_critic

from ar_torchrl.objectives import TokenGAE, TokenPPOLoss
from ar_torchrl.training import recompute_old_log_probs_and_values
from ar_torchrl.training.micro_batch import plan_micro_batches

POLICY_ROWS = 3  # rows 0-2 train the policy, rows 3-5 only the critic


def batch(seed: int = 0):
    ac = tiny_actor_critic(seed)
    td = make_trajectory([3, 4, 2, 3, 2, 4], [5, 3, 6, 4, 6, 2], seed=seed)
    recompute_old_log_probs_and_values(ac, td, plan_micro_batches(td, token_budget=1000))
    with torch.no_grad():  # ratios != 1: perturb the policy after the anchors
        for p in ac.model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
    rows = torch.arange(td.shape[0]) < POLICY_ROWS
    td["policy_mask"] = td["loss_mask"] & rows.unsqueeze(-1)
    return ac, td


def grads(ac, loss):
    ac.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in ac.named_parameters() if p.grad is not None}


def test_gae_whitens_over_the_policy_tokens_only():
    _, td = batch()
    full = TokenGAE(normalize_advantage=True)(td.clone())
    alone = TokenGAE(normalize_advantage=True)(td[:POLICY_ROWS].exclude("policy_mask"))
    m = td["loss_mask"][:POLICY_ROWS]
    torch.testing.assert_close(full["advantage"][:POLICY_ROWS][m], alone["advantage"][m])
    torch.testing.assert_close(  # value targets do not depend on the whitening
        full["value_target"][:POLICY_ROWS], alone["value_target"]
    )
    unmasked = TokenGAE(normalize_advantage=True)(td.clone().exclude("policy_mask"))
    assert not torch.allclose(unmasked["advantage"][:POLICY_ROWS][m], alone["advantage"][m])


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_policy_terms_see_the_policy_rows_and_the_critic_sees_every_row(agg):
    ac, td = batch()
    td = TokenGAE()(td)
    kw = {"entropy_coeff": 0.01, "loss_agg_mode": agg, "kl_coeff": 0.1}
    td["ref_log_prob"] = td["sample_log_prob"] - 0.05
    loss = TokenPPOLoss(ac, **kw)
    out = loss(td.clone())
    policy_only = loss(td[:POLICY_ROWS].exclude("policy_mask").clone())
    every_row = loss(td.clone().exclude("policy_mask"))
    for key in ("loss_objective", "loss_entropy", "loss_kl", "clip_fraction", "kl_ref", "entropy"):
        torch.testing.assert_close(out[key], policy_only[key], msg=key)
    for key in ("loss_critic", "explained_variance", "vf_clipfrac"):
        torch.testing.assert_close(out[key], every_row[key], msg=key)
    torch.testing.assert_close(
        out["explained_variance_policy_rows"], policy_only["explained_variance"]
    )
    g_obj = grads(ac, out["loss_objective"])
    g_obj_alone = grads(ac, loss(td[:POLICY_ROWS].exclude("policy_mask").clone())["loss_objective"])
    for name in g_obj:
        torch.testing.assert_close(g_obj[name], g_obj_alone[name], msg=name)


def test_accumulating_micro_batches_with_the_split_normaliser_equals_one_forward():
    ac, td = batch(1)
    td = TokenGAE()(td)
    loss = TokenPPOLoss(ac)
    whole = grads(ac, _total(loss(td.clone())))
    micro = [td[i : i + 2].clone() for i in range(0, td.shape[0], 2)]
    norm = loss.global_normalizer(micro)
    assert isinstance(norm, dict) and float(norm["policy"]) < float(norm["critic"])
    ac.zero_grad()
    for mb in micro:
        _total(loss(mb, normalizer=norm)).backward()
    for name, p in ac.named_parameters():
        if name in whole:
            torch.testing.assert_close(p.grad, whole[name], msg=name)
    with pytest.raises(
        ValueError, match="the policy and the value terms have different normalisers"
    ):
        loss(micro[0], normalizer=float(norm["critic"]))


def _total(out):
    return sum(v for k, v in out.items() if k.startswith("loss_"))


def test_ppo_update_trains_with_critic_only_rows():
    """The training loop's default normaliser handles the split form (one process)."""
    from ar_torchrl.training import ppo_update

    ac, td = batch(2)
    td = TokenGAE()(td)
    loss = TokenPPOLoss(ac)
    opt = torch.optim.SGD(ac.parameters(), lr=0.1)
    before = {n: p.detach().clone() for n, p in ac.named_parameters()}
    plan = plan_micro_batches(td, token_budget=20)
    assert len(plan.micro_batches) > 1
    metrics = ppo_update(loss, opt, td, plan, epochs=1)
    assert (
        metrics["train/optimizer_steps"] == 1 and "train/explained_variance_policy_rows" in metrics
    )
    assert any(not torch.equal(before[n], p) for n, p in ac.named_parameters())
