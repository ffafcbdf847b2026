"""ReinforcePPAdvantage (REINFORCE++): the module over its function, its keys, the registry entry
and ``algo=reinforce_pp`` in the recipe."""

from __future__ import annotations

import math

import pytest
import torch
from support.trajectories import group_batch, make_trajectory, tiny_actor_critic
from torchrl.data import LazyTensorStorage, ReplayBuffer

from ar_torchrl.functional import reinforce_pp_advantage
from ar_torchrl.objectives import (
    GRPOAdvantage,
    ReinforcePPAdvantage,
    TokenPPOLoss,
    advantage_names,
    make_advantage,
    needs_critic,
)
from ar_torchrl.objectives._keys import MissingKeyError
from ar_torchrl.training import plan_micro_batches, recompute_old_log_probs_and_values


def _batch(seed=0):
    """Six rows of ragged prompts and responses, rewards +-1 plus a dense per-token shaping term."""
    td = make_trajectory([3, 4, 2, 5, 1, 3], [5, 3, 6, 2, 4, 7], seed=seed)
    g = torch.Generator().manual_seed(seed)
    mask = td["loss_mask"].unsqueeze(-1)
    td["next", "reward"] += torch.where(mask, 0.1 * torch.randn(mask.shape, generator=g), 0.0)
    return td


def test_module_writes_its_function_broadcast_to_trained_tokens():
    td = _batch(seed=1)
    out = ReinforcePPAdvantage(gamma=0.9)(td.clone())
    adv, _ = reinforce_pp_advantage(td["next", "reward"].squeeze(-1), td["loss_mask"], gamma=0.9)
    assert out["advantage"].shape == (*td.shape, 1) and "value_target" not in out.keys()
    assert torch.equal(out["advantage"].squeeze(-1), adv)
    assert out["advantage"][~td["loss_mask"]].abs().sum() == 0
    assert float(out["advantage"][td["loss_mask"]].mean()) == pytest.approx(0.0, abs=1e-6)


def test_nested_renamed_keys_and_critic_targets():
    """Keys TorchRL-style; with critic_targets the Monte-Carlo returns are the value targets,
    the same ones GRPO writes for a value head."""
    td = _batch(seed=2)
    td["task", "r"] = td["next", "reward"].clone()
    td["masks", "train"] = td["loss_mask"].clone()
    est = ReinforcePPAdvantage(gamma=0.8, critic_targets=True).set_keys(
        reward=("task", "r"),
        loss_mask=("masks", "train"),
        advantage=("out", "adv"),
        value_target=("out", "ret"),
    )
    assert est.in_keys == [("task", "r"), ("masks", "train")]
    assert est.out_keys == [("out", "adv"), ("out", "ret")]
    est(td)
    adv, ret = reinforce_pp_advantage(td["task", "r"].squeeze(-1), td["loss_mask"], gamma=0.8)
    assert torch.equal(td["out", "adv"].squeeze(-1), adv)
    assert torch.equal(td["out", "ret"].squeeze(-1), ret)
    grpo = GRPOAdvantage(critic_targets=True, gamma=0.8)(_batch(seed=2))
    torch.testing.assert_close(td["out", "ret"], grpo["value_target"])
    with pytest.raises(KeyError, match=r"ReinforcePPAdvantage.set_keys: unknown key name 'value'"):
        est.set_keys(value="v")


def test_policy_mask_rows_train_the_critic_only():
    td = _batch(seed=3)
    policy = torch.tensor([True, False, True, True, False, True]).unsqueeze(-1).expand(td.shape)
    td["policy_mask"] = policy.clone()
    out = ReinforcePPAdvantage(critic_targets=True)(td.clone())
    mask = td["loss_mask"]
    adv, ret = reinforce_pp_advantage(
        td["next", "reward"].squeeze(-1), mask, policy_mask=policy.clone()
    )
    assert torch.equal(out["advantage"].squeeze(-1), adv)
    assert out["advantage"][~policy].abs().sum() == 0
    assert out["value_target"][~policy & mask].abs().sum() > 0  # the critic still learns there
    assert float(out["advantage"][mask & policy].mean()) == pytest.approx(0.0, abs=1e-6)


def test_recomputes_on_every_call_and_as_replay_buffer_write_transform():
    td = group_batch(seed=4, group_size=1)
    fresh = ReinforcePPAdvantage()(td.clone())["advantage"]
    stale = td.clone().set("advantage", torch.full((*td.shape, 1), 7.0))
    assert torch.equal(ReinforcePPAdvantage()(stale)["advantage"], fresh)
    rb = ReplayBuffer(storage=LazyTensorStorage(16), batch_size=2)
    rb.append_transform(ReinforcePPAdvantage(), invert=True)
    rb.extend(td.clone())
    assert torch.equal(rb[:]["advantage"], fresh)  # whitened over the batch written
    sample, info = rb.sample(return_info=True)
    assert torch.equal(sample["advantage"], fresh[info["index"]])  # not re-whitened on 2 rows
    plain = ReplayBuffer(storage=LazyTensorStorage(16), batch_size=2)
    plain.append_transform(ReinforcePPAdvantage())
    with pytest.raises(RuntimeError, match=r"ReinforcePPAdvantage\(\), invert=True\)"):
        plain.extend(td.clone())


def test_errors_name_the_key_and_the_fix():
    td = _batch(seed=0)
    with pytest.raises(
        ValueError, match=r"expects a \[B, L\] token trajectory, got batch_size \(6,\)"
    ):
        ReinforcePPAdvantage()(td[:, 0])
    with pytest.raises(MissingKeyError, match=r"missing key 'loss_mask' \(bool \[B, L\]"):
        ReinforcePPAdvantage()(td.exclude("loss_mask"))
    with pytest.raises(TypeError, match=r"'loss_mask' must be bool, got torch.int64"):
        ReinforcePPAdvantage()(td.clone().set("loss_mask", td["loss_mask"].long()))
    with pytest.raises(ValueError, match=r"\('next', 'reward'\) has shape \(6, \d+, 2\)"):
        ReinforcePPAdvantage()(
            td.clone().set(("next", "reward"), td["next", "reward"].expand(-1, -1, 2))
        )
    with pytest.raises(
        ValueError, match=r"ReinforcePPAdvantage: gamma must be >= 0 and <= 1, got 2"
    ):
        ReinforcePPAdvantage(gamma=2.0)
    with pytest.raises(ValueError, match=r"ReinforcePPAdvantage: eps must be >= 0, got -1"):
        ReinforcePPAdvantage(eps=-1.0)


def test_registered_without_a_critic_and_with_one():
    assert "reinforce_pp" in advantage_names() and not needs_critic("reinforce_pp")
    plain = make_advantage("reinforce_pp")
    assert type(plain) is ReinforcePPAdvantage and not plain.critic_targets and plain.gamma == 1.0
    with_head = make_advantage("reinforce_pp", critic=True, gamma=0.9)
    assert with_head.critic_targets and with_head.gamma == 0.9
    with pytest.raises(
        ValueError, match=r"'reinforce_pp' has no option 'scale'; its options: \[\]"
    ):
        make_advantage("reinforce_pp", scale=True)


def test_one_ppo_step_with_one_sample_per_prompt_moves_the_policy():
    """No groups: six prompts, one sample each, and the policy still gets a gradient (GRPO's
    advantage would be 0 on every row)."""
    ac = tiny_actor_critic(seed=0)
    td = group_batch(seed=5, group_size=1)
    assert GRPOAdvantage()(td.clone())["advantage"].abs().sum() == 0
    plan = plan_micro_batches(td, token_budget=30)
    recompute_old_log_probs_and_values(ac, td, plan)
    td = ReinforcePPAdvantage()(td)
    loss = TokenPPOLoss(ac, critic_coeff=None)
    norm = loss.global_normalizer(list(plan.split(td)))
    for sub in plan.split(td):
        out = loss(sub, normalizer=norm)
        sum(v for k, v in out.items() if k.startswith("loss_")).backward()
    grad = sum(float(p.grad.abs().sum()) for p in ac.parameters() if p.grad is not None)
    assert math.isfinite(grad) and grad > 0


def test_algo_reinforce_pp_config():
    """``algo=reinforce_pp`` selects it without a value head; on the PPO config (a value head)
    ``algo.advantage_mode=reinforce_pp`` keeps the head training on the returns."""
    from support.recipe_helpers import typed

    from ar_torchrl.recipes.dapo_ppo import build as recipe

    cfg = typed(["algo=reinforce_pp", "rollout.samples_per_prompt=1"])
    assert cfg.algo.advantage_mode == "reinforce_pp" and cfg.algo.critic_coeff == 0.0
    module = recipe.build_advantage(cfg)
    assert type(module) is ReinforcePPAdvantage and not module.critic_targets
    with_head = recipe.build_advantage(
        typed(["algo.advantage_mode=reinforce_pp", "algo.gamma=0.99"])
    )
    assert with_head.critic_targets and with_head.gamma == 0.99


@pytest.mark.slow
def test_algo_reinforce_pp_end_to_end(tmp_path, cache_dir):
    """Two iterations of the recipe, 32 prompts x 1 sample: finite losses, no critic loss."""
    from support.recipe_runs import run_recipe

    keys = ["algo=reinforce_pp", "rollout.prompts_per_iter=32", "rollout.samples_per_prompt=1"]
    keys += ["train.iterations=2", "train.eval_every=0", "train.plot=false"]
    _, history = run_recipe(tmp_path / "run", cache_dir, *keys)
    steps = [h for h in history if "train/loss_objective" in h]
    assert len(steps) == 2
    for h in steps:
        assert math.isfinite(h["train/loss_objective"]) and "train/loss_critic" not in h
        assert h["train/optimizer_steps"] == 2 and h["train/skipped_steps"] == 0
