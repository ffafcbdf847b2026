"""A separate critic model (``LMCritic``, ``TokenPPOLoss(actor, critic_network)``): the same values
as the shared head over the same weights, gradients that stay on their side, ratio exactly 1 and
exact old values over the micro-batch plan (padded and packed), and the errors."""

from __future__ import annotations

import pytest
import torch
from support.trajectories import VOCAB, make_trajectory
from tensordict import TensorDict

from ar_torchrl.models.tiny import build_tiny_qwen3
from ar_torchrl.modules import (
    PACKED_KEY,
    LMActorCritic,
    LMCritic,
    attach_value_head,
    build_separate_critic,
)
from ar_torchrl.objectives import GRPOAdvantage, TokenGAE, TokenPPOLoss
from ar_torchrl.training import plan_micro_batches, ppo_update, recompute_old_log_probs_and_values

PROMPTS, RESPONSES = [3, 5, 2, 4, 1, 6], [4, 1, 7, 3, 5, 2]


def _perturbed_head(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.value_head.weight.copy_(torch.randn(model.value_head.weight.shape, generator=g))
        model.value_head.bias.fill_(0.3)
    return model


def _pair(seed: int = 0, critic_seed: int = 7):
    """An actor over one tiny Qwen3 and a critic over another (different weights, a non-zero head)."""
    actor = LMActorCritic(build_tiny_qwen3(VOCAB, seed=seed), critic=False)
    critic = LMCritic(
        _perturbed_head(attach_value_head(build_tiny_qwen3(VOCAB, seed=critic_seed)), 1)
    )
    return actor, critic


@pytest.mark.parametrize("packed", [False, True])
def test_critic_values_equal_the_shared_heads_over_the_same_weights(packed):
    """LMCritic over a model computes exactly the values LMActorCritic computes over it."""
    model = _perturbed_head(attach_value_head(build_tiny_qwen3(VOCAB, seed=3)), 2)
    td = make_trajectory(PROMPTS, RESPONSES, seed=1)
    plan = plan_micro_batches(td, token_budget=40, packing=packed)
    shared_ac, critic = LMActorCritic(model), LMCritic(model)
    for sub in plan.split(td):
        assert bool(sub.get_non_tensor(PACKED_KEY, False)) == packed
        with torch.no_grad():
            shared = shared_ac(shared_ac.select_inputs(sub))
            alone = critic(critic.select_inputs(sub))
        assert torch.equal(shared["state_value"], alone["state_value"])
        assert torch.equal(shared["next", "state_value"], alone["next", "state_value"])
        assert alone["state_value"].abs().sum() > 0


def test_critic_keys_are_renamed_with_set_keys():
    critic = LMCritic(attach_value_head(build_tiny_qwen3(VOCAB, seed=0)))
    critic.set_keys(value=("critic", "v"))
    assert critic.tensor_keys.next_value == ("next", "critic", "v")
    assert critic.out_keys == [("critic", "v"), ("next", "critic", "v")]
    td = TensorDict(
        {
            "tokens": torch.randint(3, VOCAB, (2, 5)),
            "attention_mask": torch.ones(2, 5, dtype=torch.bool),
        },
        [2, 5],
    )
    assert critic(td)["critic", "v"].shape == (2, 5, 1)
    with pytest.raises(KeyError, match=r"LMCritic.set_keys: unknown key name 'log_prob'"):
        critic.set_keys(log_prob="lp")


@pytest.mark.parametrize("packed", [False, True])
def test_first_update_has_ratio_one_and_exact_old_values_with_a_separate_critic(packed):
    actor, critic = _pair()
    td = make_trajectory(PROMPTS, RESPONSES, seed=2)
    plan = plan_micro_batches(td, token_budget=40, packing=packed)
    assert len(plan) >= 2
    loss = TokenPPOLoss(actor, critic, clip_epsilon=(0.2, 0.28), clip_value=0.2)
    recompute_old_log_probs_and_values(
        actor, td, plan, loss=loss
    )  # the loss's critic gives the old values
    assert td["state_value"][td["loss_mask"]].abs().sum() > 0
    td = TokenGAE(gamma=1.0, lmbda=0.95)(td)
    for sub in plan.split(td):
        with torch.no_grad():
            direct = critic(critic.select_inputs(sub))
        assert torch.equal(sub["state_value"], direct["state_value"])  # the training geometry
        out = loss(sub)
        assert out["min_ratio"].item() == out["max_ratio"].item() == 1.0
        assert out["value_clip_fraction"].item() == 0.0 and out["vf_clipfrac"].item() == 0.0


def test_gradients_stay_on_their_side():
    """The value loss reaches the critic's parameters only, the policy terms the actor's only."""
    actor, critic = _pair()
    td = make_trajectory(PROMPTS, RESPONSES, seed=3)
    plan = plan_micro_batches(td, token_budget=1000)
    loss = TokenPPOLoss(actor, critic_network=critic, clip_value=0.2, entropy_coeff=0.01)
    recompute_old_log_probs_and_values(actor, td, plan, critic=critic)
    td = TokenGAE(gamma=1.0, lmbda=0.95)(td)
    params = {"actor": list(actor.parameters()), "critic": list(critic.parameters())}
    for term, gets, spared in (
        ("loss_critic", "critic", "actor"),
        ("loss_objective", "actor", "critic"),
        ("loss_entropy", "actor", "critic"),
    ):
        for p in [*params["actor"], *params["critic"]]:
            p.grad = None
        loss(td)[term].backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in params[gets]), term
        assert all(p.grad is None for p in params[spared]), term
    # the critic's whole model learns (trunk and head), not only its head
    for p in [*params["actor"], *params["critic"]]:
        p.grad = None
    loss(td)["loss_critic"].backward()
    trunk = [p for n, p in critic.model.named_parameters() if not n.startswith("value_head")]
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in trunk)


def test_a_replaced_critic_is_the_one_the_loss_trains_and_anchors_with():
    """``loss.critic_network = other``: the old values and the value loss come from ``other``, and
    only ``other`` gets gradients."""
    actor, critic = _pair()
    other = LMCritic(_perturbed_head(attach_value_head(build_tiny_qwen3(VOCAB, seed=9)), 5))
    td = make_trajectory(PROMPTS, RESPONSES, seed=6)
    plan = plan_micro_batches(td, token_budget=1000)
    loss = TokenPPOLoss(actor, critic, clip_value=0.2)
    loss.critic_network = other
    recompute_old_log_probs_and_values(actor, td, plan, loss=loss)
    with torch.no_grad():
        assert torch.equal(td["state_value"], other(other.select_inputs(td))["state_value"])
    td = TokenGAE(gamma=1.0, lmbda=0.95)(td)
    loss(td)["loss_critic"].backward()
    assert all(p.grad is None for p in critic.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in other.parameters())
    fresh = TokenPPOLoss(actor, other, clip_value=0.2)(td)
    assert torch.equal(loss(td)["loss_critic"], fresh["loss_critic"])


def test_ppo_update_trains_both_and_grpo_targets_reach_the_separate_critic():
    actor, critic = _pair()
    td = make_trajectory(PROMPTS, RESPONSES, seed=4, group_size=2)
    plan = plan_micro_batches(td, token_budget=40)
    loss = TokenPPOLoss(actor, critic, clip_value=0.2)
    recompute_old_log_probs_and_values(actor, td, plan, loss=loss)
    td = GRPOAdvantage(critic_targets=True)(td)
    before = {
        "actor": [p.detach().clone() for p in actor.parameters()],
        "critic": [p.detach().clone() for p in critic.parameters()],
    }
    opt = torch.optim.AdamW([*actor.parameters(), *critic.parameters()], lr=1e-2)
    out = ppo_update(loss, opt, td, plan, epochs=1)
    assert out["train/optimizer_steps"] == 1.0 and out["train/loss_critic"] > 0
    for side, modules in (("actor", actor), ("critic", critic)):
        moved = [not torch.equal(a, b) for a, b in zip(before[side], modules.parameters())]
        assert any(moved), side


def test_build_separate_critic_copies_the_policy_without_sharing():
    policy = attach_value_head(build_tiny_qwen3(VOCAB, seed=5))
    _perturbed_head(policy, 3)
    critic = build_separate_critic(policy)
    assert critic.model is not policy and critic.model.value_head is not policy.value_head
    assert critic.model.value_head.weight.abs().sum() == 0  # a fresh zero head, not the policy's
    for (name, a), (_, b) in zip(
        policy.model.named_parameters(), critic.model.model.named_parameters()
    ):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr(), name
    smaller = build_tiny_qwen3(VOCAB, seed=1, hidden_size=32)
    assert build_separate_critic(policy, smaller).model is smaller


def test_the_loss_names_what_is_wrong_with_a_critic():
    actor, critic = _pair()
    shared = LMActorCritic(attach_value_head(build_tiny_qwen3(VOCAB, seed=0)))
    with pytest.raises(
        ValueError, match=r"critic_network was given but actor_critic computes values"
    ):
        TokenPPOLoss(shared, critic)
    with pytest.raises(ValueError, match=r"critic_network was given with critic_coeff=0.0"):
        TokenPPOLoss(actor, critic, critic_coeff=0.0)
    with pytest.raises(
        TypeError, match=r"critic_network=\.\.\.\) takes an LMCritic .* got LMActorCritic"
    ):
        TokenPPOLoss(actor, shared)
    with pytest.raises(
        ValueError, match=r"needs a critic: an LMActorCritic with a value head .* or a"
    ):
        TokenPPOLoss(actor)
    loss = TokenPPOLoss(actor, critic)
    assert loss.separate_critic and not TokenPPOLoss(shared).separate_critic
    td = make_trajectory(PROMPTS, RESPONSES, seed=5)
    # critic_network is a module of the loss, as in TorchRL: a replacement that does not fit is
    # named when the loss is called
    loss.critic_network = shared
    with pytest.raises(TypeError, match=r"takes an LMCritic .* got LMActorCritic"):
        loss(td)
    with pytest.raises(ValueError, match=r"a separate critic was given but actor_critic computes"):
        recompute_old_log_probs_and_values(
            shared, td, plan_micro_batches(td, token_budget=1000), critic=critic
        )
