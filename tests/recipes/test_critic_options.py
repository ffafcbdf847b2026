"""The recipe's critic options that need no run: ``algo.gae.critic_lmbda`` reaches ``TokenGAE``, the
value head's own gradient-clip group, the warm-up to an EV target and the "predicts nothing" warning
(their rules), the progress bar's EV, saved rollouts, and the configuration errors. The end-to-end
runs are in tests/recipes/test_critic_pretrain.py."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from support.recipe_helpers import typed
from support.trajectories import make_trajectory, tiny_actor_critic

from ar_torchrl.recipes.dapo_ppo import build
from ar_torchrl.recipes.dapo_ppo.loop import CriticWarmup, CriticWatch, progress_fields
from ar_torchrl.recipes.dapo_ppo.rollouts import (
    ROLLOUTS_DIR,
    load_rollout,
    rollout_files,
    save_rollout,
)
from ar_torchrl.training import plan_micro_batches, ppo_update, recompute_old_log_probs_and_values

torch.set_num_threads(1)


@pytest.mark.parametrize(("override", "want"), [([], None), (["algo.gae.critic_lmbda=1.0"], 1.0)])
def test_critic_lmbda_reaches_token_gae(override, want):
    cfg = typed(override)
    gae = build.build_advantage(cfg)
    assert gae.critic_lmbda == want and gae.lmbda == 0.95
    td = make_trajectory([2, 3], [4, 3], seed=1)
    td["state_value"] = torch.randn(*td.shape, 1, generator=torch.Generator().manual_seed(0))
    target = gae(td)["value_target"].squeeze(-1)
    mask = td["loss_mask"]
    returns = td["next", "reward"].squeeze(-1).flip(-1).cumsum(-1).flip(-1)  # gamma = 1
    if want == 1.0:  # lambda 1 for the target: the Monte-Carlo return, whatever the values
        torch.testing.assert_close(target[mask], returns[mask])
    else:
        assert not torch.allclose(target[mask], returns[mask])
    with pytest.raises(ValueError, match=r"algo.gae.critic_lmbda must be >= 0 and <= 1, got 1.5"):
        typed(["algo.gae.critic_lmbda=1.5"])


def _update(cfg, grad_clip):
    ac = tiny_actor_critic(0)
    optimizer = build.build_optimizer(cfg, ac.model)
    loss = build.build_loss(cfg, ac)
    td = make_trajectory([3, 2, 4, 1], [5, 6, 3, 4], seed=2)
    plan = plan_micro_batches(td, token_budget=24)
    recompute_old_log_probs_and_values(ac, td, plan, loss=loss)
    td = build.build_advantage(cfg)(td)
    out = ppo_update(loss, optimizer, td, plan, grad_clip=grad_clip)
    head = {id(p) for p in ac.model.value_head.parameters()}

    def norm(params):
        return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))

    policy = [p for p in ac.model.parameters() if id(p) not in head and p.grad is not None]
    return out, optimizer, norm(policy), norm(ac.model.value_head.parameters())


def test_the_shared_value_head_has_its_own_gradient_clip_group():
    cfg = typed(["algo.kl_coeff=0"])  # after the step the (clipped) gradients stay to compare
    out, optimizer, policy_norm, head_norm = _update(cfg, grad_clip=None)
    groups = [(g["name"], g.get("clip_group")) for g in optimizer.param_groups]
    assert groups == [("policy", None), ("value_head", build.CRITIC_CLIP_GROUP)]
    assert out["train/grad_norm"] == pytest.approx(policy_norm, rel=1e-5)  # the policy alone
    assert out["train/grad_norm_critic"] == pytest.approx(head_norm, rel=1e-5)
    assert head_norm > 0 and policy_norm > 0
    # clipped apart: each group's gradient ends at the clip, not their concatenation
    clip = 1e-4
    out, _, policy_norm, head_norm = _update(cfg, grad_clip=clip)
    assert policy_norm == pytest.approx(clip, rel=1e-3) and head_norm == pytest.approx(
        clip, rel=1e-3
    )
    # GRPO trains no head: one group
    grpo = build.build_optimizer(typed(["algo=grpo"]), tiny_actor_critic(0).model)
    assert [(g["name"], g.get("clip_group")) for g in grpo.param_groups] == [("policy", None)]


def test_a_checkpoint_saved_before_the_clip_group_gets_it_back():
    cfg = typed()
    model = tiny_actor_critic(0).model
    optimizer = build.build_optimizer(cfg, model)
    state = optimizer.state_dict()
    for group in state["param_groups"]:
        group.pop("clip_group", None)  # as saved by an earlier version
    optimizer.load_state_dict(state)
    assert "clip_group" not in optimizer.param_groups[1]  # loading replaces the group's options
    build.critic_clip_groups(optimizer)
    assert optimizer.param_groups[1]["clip_group"] == build.CRITIC_CLIP_GROUP
    assert "clip_group" not in optimizer.param_groups[0]


def test_warmup_to_a_target_ends_at_the_first_batch_the_critic_predicts(caplog):
    warmup = CriticWarmup(4, until_ev=0.3)
    evs = [0.0, 0.1, None, 0.35, 0.1, 0.0]
    with caplog.at_level(logging.INFO, logger="ar_torchrl.recipes.dapo_ppo.loop"):
        flags = [warmup.critic_only(step, ev) for step, ev in enumerate(evs, 1)]
    assert flags == [True, True, True, False, False, False] and warmup.done
    assert "critic/explained_variance 0.350 >= 0.3 at step 4" in caplog.text
    # the cap: 2 iterations, the target never reached: warned once, then the policy trains
    capped = CriticWarmup(2, until_ev=0.9)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ar_torchrl.recipes.dapo_ppo.loop"):
        flags = [capped.critic_only(step, 0.1) for step in (1, 2, 3, 4)]
    assert flags == [True, True, False, False] and capped.done
    assert caplog.text.count("without reaching algo.critic_warmup_until_ev=0.9") == 1
    # without a target: the first N iterations, whatever the EV (as before)
    plain = CriticWarmup(2)
    assert [plain.critic_only(s, 0.99) for s in (1, 2, 3)] == [True, True, False]
    # a resumed run whose warm-up had ended does not start it again
    assert CriticWarmup(4, until_ev=0.3, done=True).critic_only(2, 0.0) is False


def test_the_critic_warning_fires_once_per_streak_and_says_how_to_check(caplog):
    watch = CriticWatch(3, run_dir="outputs/x")
    evs = [-0.2, 0.0, None, -0.1, -0.5, -0.1, 0.2, -0.3, -0.3, -0.3]
    with caplog.at_level(logging.WARNING, logger="ar_torchrl.recipes.dapo_ppo.loop"):
        fired = [watch.update(ev, step) for step, ev in enumerate(evs, 1)]
    assert [i + 1 for i, f in enumerate(fired) if f] == [4, 10]  # None neither counts nor breaks
    assert caplog.text.count("the critic predicts nothing") == 2
    assert "step 4: critic/explained_variance has been <= 0 for 3 iterations" in caplog.text
    assert "optimum when the prompt and the response prefix carry no information" in caplog.text
    assert "python benchmarks/critic_ceiling.py --run outputs/x" in caplog.text
    off = CriticWatch(0, run_dir="x")
    assert not any(off.update(-1.0) for _ in range(50))


def test_progress_bar_shows_the_critics_ev_when_there_is_one():
    metrics = {"rollout/reward_mean": 0.5, "rollout/accuracy": 0.75}
    assert progress_fields(metrics) == {"reward": "0.50", "acc": "0.75"}
    metrics["critic/explained_variance"] = 0.4321
    assert progress_fields(metrics)["ev"] == "0.43"


def test_saved_rollouts_round_trip_without_what_a_run_recomputes(tmp_path):
    td = make_trajectory([2, 3], [4, 3], seed=1)
    td["policy_version"] = torch.full(td.shape, 3, dtype=torch.int64)
    for key in ("sample_log_prob", "advantage", "value_target"):
        td[key] = torch.randn(td.shape)
    td["state_value"] = torch.randn(*td.shape, 1)
    td["next", "state_value"] = torch.randn(*td.shape, 1)
    path = save_rollout(tmp_path, 12, td)
    assert path == tmp_path / ROLLOUTS_DIR / "step_12.safetensors"
    back = load_rollout(path)
    want = td.exclude("sample_log_prob", "advantage", "value_target", ("next", "state_value"))
    assert set(back.keys(True, True)) == set(want.keys(True, True))
    for key in want.keys(True, True):
        assert back[key].dtype == want[key].dtype and torch.equal(back[key], want[key]), key
    save_rollout(tmp_path, 2, td)
    assert [p.name for p in rollout_files(tmp_path)] == [
        "step_2.safetensors",
        "step_12.safetensors",
    ]
    with pytest.raises(
        FileNotFoundError, match=r"critic.pretrain_from='.*empty': no saved rollouts"
    ):
        rollout_files(tmp_path / "empty")
    with pytest.raises(ValueError, match=r"save_rollout: expected a \[B, L\] batch"):
        save_rollout(tmp_path, 1, td[0])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["algo.critic_warmup_until_ev=0.2"],
            r"algo.critic_warmup_until_ev=0.2 is the critic's target for a warm-up, and none is set",
        ),
        (
            ["algo.critic_warmup_until_ev=1.5", "algo.critic_warmup_iters=3"],
            r"algo.critic_warmup_until_ev must be <= 1, got 1.5",
        ),
        (
            ["algo=grpo", "critic.pretrain_from=/x"],
            r"critic.pretrain_from='/x' trains a critic, but algo.critic_coeff=0.0 trains none",
        ),
        (["critic.pretrain_epochs=0"], r"critic.pretrain_epochs must be >= 1, got 0"),
        (["train.critic_warn_iters=-1"], r"train.critic_warn_iters must be >= 0, got -1"),
        (["critic.pretrain_from=' '"], r"critic.pretrain_from must be null or a path, got ''"),
        (
            ["algo=grpo", "critic.confidence_features=true"],
            r"critic.confidence_features=true adds to the critic's values, but "
            r"algo.critic_coeff=0.0 trains no critic",
        ),
        (
            ["algo.value_norm=popart", "critic.confidence_features=true"],
            r"critic.confidence_features=true adds to unnormalised values and "
            r"algo.value_norm=popart",
        ),
    ],
)
def test_critic_option_errors_name_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        typed(overrides)


def test_the_new_keys_default_to_the_old_behaviour():
    cfg = typed()
    assert cfg.algo.critic_warmup_until_ev is None and cfg.critic.pretrain_from is None
    assert cfg.train.save_rollouts is False and cfg.train.critic_warn_iters == 20
    assert cfg.algo.gae.critic_lmbda is None and cfg.critic.confidence_features is False
    assert (
        typed(
            ["algo.critic_warmup_iters=2", "algo.critic_warmup_until_ev=-0.5"]
        ).algo.critic_warmup_until_ev
        == -0.5
    )
    assert math.isfinite(cfg.critic.pretrain_epochs)


def test_within_prompt_ev_is_logged_only_with_groups():
    """``critic/explained_variance_within_prompt`` needs >= 2 samples per prompt: at one, the few
    prompts a batch draws twice would make a number out of a handful of tokens."""
    from types import SimpleNamespace

    from tensordict import TensorDict

    from ar_torchrl.recipes.dapo_ppo import loop

    mask = torch.ones(4, 3, dtype=torch.bool)
    reward = torch.zeros(4, 3, 1)
    reward[:, -1, 0] = torch.tensor([1.0, -1.0, 1.0, 1.0])
    td = TensorDict(
        {
            "loss_mask": mask,
            "state_value": torch.linspace(-1, 1, 12).reshape(4, 3, 1),
            "prompt_id": torch.tensor([0, 0, 1, 2]).unsqueeze(-1).expand(4, 3),
            "next": {"reward": reward},
        },
        [4, 3],
    )
    keys = SimpleNamespace(value="state_value", reward="reward", loss_mask="loss_mask")

    def run(n):
        cfg = SimpleNamespace(
            algo=SimpleNamespace(critic_coeff=1.0, gamma=1.0),
            rollout=SimpleNamespace(samples_per_prompt=n),
        )
        return SimpleNamespace(cfg=cfg, loss_fn=SimpleNamespace(tensor_keys=keys))

    key = "critic/explained_variance_within_prompt"
    assert key in loop.critic_metrics(run(2), td)
    got = loop.critic_metrics(run(1), td)
    assert key not in got and "critic/explained_variance" in got
