"""TokenGAE, GRPOAdvantage, TokenPPOLoss and recompute_old_log_probs_and_values on a tiny Qwen3."""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

import pytest
import torch
from support.reference import gae_loop
from support.trajectories import group_batch, make_trajectory, perturb, tiny_actor_critic
from tensordict import TensorDict
from tensordict.utils import NestedKey
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.objectives.value import ValueEstimatorBase

from ar_torchrl.functional import AGGREGATION_MODES
from ar_torchrl.modules import LMActorCritic
from ar_torchrl.objectives import GRPOAdvantage, TokenGAE, TokenPPOLoss
from ar_torchrl.training import plan_micro_batches, ppo_update, recompute_old_log_probs_and_values

torch.set_num_threads(1)


# ---------------------------------------------------------------------------- ratio exactly 1
def test_first_update_has_ratio_exactly_one_over_the_plan():
    ac = tiny_actor_critic(seed=0)
    perturb(ac.model.value_head, scale=0.5)  # non-zero values so value clipping is exercised
    td = group_batch()
    plan = plan_micro_batches(td, token_budget=24)
    assert len(plan) >= 3
    recompute_old_log_probs_and_values(ac, td, plan)
    td = TokenGAE(gamma=1.0, lmbda=0.95)(td)
    loss = TokenPPOLoss(ac, clip_epsilon=(0.2, 0.28), clip_value=0.2, entropy_coeff=0.01)
    for mb in plan.split(td):
        out = loss(mb)
        assert out["min_ratio"].item() == 1.0 and out["max_ratio"].item() == 1.0
        assert out["mean_ratio"].item() == 1.0
        assert out["approx_kl"].item() == 0.0
        assert out["clip_fraction"].item() == 0.0 and out["value_clip_fraction"].item() == 0.0


def test_anchors_follow_the_micro_batch_geometry():
    """Rows with 3 and 2 generated tokens, planned together or apart: the anchors are exactly what
    the forward over each plan's own crops gives, and each plan's training pass has ratio 1."""
    ac = tiny_actor_critic(seed=2)
    perturb(ac.model.value_head, scale=0.5)
    base = make_trajectory([4, 2], [3, 2], seed=5)
    together = plan_micro_batches(base, token_budget=64)
    apart = plan_micro_batches(base, token_budget=7)
    assert [mb.rows for mb in together.micro_batches] == [(0, 1)]
    assert [(mb.rows, mb.width) for mb in apart.micro_batches] == [((0,), 7), ((1,), 4)]
    loss = TokenPPOLoss(ac, clip_value=0.2)
    for plan in (together, apart):
        td = recompute_old_log_probs_and_values(ac, base.clone(), plan)
        for sub in plan.split(td):
            with torch.no_grad():
                direct = ac(sub.select("tokens", "attention_mask"))
            assert torch.equal(sub["sample_log_prob"], direct["log_prob"])
            assert torch.equal(sub["state_value"], direct["state_value"])
            out = loss(TokenGAE()(sub))
            assert out["min_ratio"].item() == out["max_ratio"].item() == 1.0
        rows_outside = ~torch.zeros_like(td["attention_mask"])
        for mb in plan.micro_batches:
            rows_outside[list(mb.rows), mb.start : mb.end] = False
        assert (td["sample_log_prob"][rows_outside] == 0).all()


def test_first_update_from_zero_head_gives_finite_loss_and_nonzero_head_grad():
    ac = tiny_actor_critic(seed=0)
    td = group_batch()
    plan = plan_micro_batches(td, token_budget=1000)
    recompute_old_log_probs_and_values(ac, td, plan)
    td = TokenGAE(gamma=1.0, lmbda=0.95)(td)
    loss = TokenPPOLoss(ac, clip_value=0.2)
    (mb,) = plan.split(td)
    out = loss(mb)
    total = out["loss_objective"] + out["loss_critic"]
    assert torch.isfinite(total)
    total.backward()
    grad = ac.model.value_head.weight.grad
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    assert ac.model.value_head.bias.grad.abs().sum() > 0


# ---------------------------------------------------------------------------- masking
def _grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _loss_and_grads(ac, loss, td):
    ac.zero_grad()
    out = loss(td)
    total = sum(v for k, v in out.items() if k.startswith("loss_"))
    total.backward()
    return total.detach(), _grads(ac)


def test_masked_positions_change_neither_loss_nor_gradients():
    ac = tiny_actor_critic(seed=1)
    perturb(ac.model.value_head, scale=0.5)
    td = group_batch(seed=3)
    plan = plan_micro_batches(td, token_budget=1000)
    recompute_old_log_probs_and_values(ac, td, plan)
    td["ref_log_prob"] = td["sample_log_prob"] - 0.1
    td = TokenGAE(gamma=1.0, lmbda=0.9)(td)
    perturb(ac.model, scale=0.02, seed=4)  # ratios != 1
    loss = TokenPPOLoss(
        ac,
        clip_epsilon=(0.2, 0.28),
        dual_clip=3.0,
        clip_value=0.2,
        entropy_coeff=0.01,
        kl_coeff=0.1,
        tis_cap=2.0,
    )
    ref_total, ref_grads = _loss_and_grads(ac, loss, td)

    garbage = td.clone()
    masked = ~garbage["loss_mask"]
    g = torch.Generator().manual_seed(9)
    for key in ("sample_log_prob", "ref_log_prob", "rollout_log_prob"):
        garbage[key] = torch.where(
            masked, torch.randn(masked.shape, generator=g) * 50, garbage[key]
        )
    for key in ("advantage", "state_value", "value_target"):
        noise = torch.randn(masked.shape, generator=g).unsqueeze(-1) * 50
        garbage[key] = torch.where(masked.unsqueeze(-1), noise, garbage[key])
    pad = ~garbage["attention_mask"]
    garbage["tokens"] = torch.where(
        pad, torch.randint(3, 99, pad.shape, generator=g), garbage["tokens"]
    )
    total, grads = _loss_and_grads(ac, loss, garbage)
    assert torch.equal(total, ref_total)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert torch.equal(grads[name], ref_grads[name]), name


def test_gae_ignores_values_at_masked_positions():
    td = group_batch(seed=4)
    td["state_value"] = torch.randn(*td.shape, 1)
    a = TokenGAE(gamma=1.0, lmbda=0.95)(td.clone())["advantage"]
    td["state_value"] = torch.where(td["loss_mask"].unsqueeze(-1), td["state_value"], 1e6)
    b = TokenGAE(gamma=1.0, lmbda=0.95)(td.clone())["advantage"]
    assert torch.equal(a, b)


def test_metrics_are_computed_over_loss_mask_only():
    ac = tiny_actor_critic(seed=1)
    td = group_batch(seed=3)
    plan = plan_micro_batches(td, token_budget=1000)
    recompute_old_log_probs_and_values(ac, td, plan)
    td = TokenGAE()(td)
    # a huge log-prob shift on masked tokens would blow up every unmasked metric
    td["sample_log_prob"] = torch.where(td["loss_mask"], td["sample_log_prob"], -30.0)
    out = TokenPPOLoss(ac, entropy_coeff=0.01)(td)
    assert out["max_ratio"].item() == 1.0 and out["clip_fraction"].item() == 0.0
    assert out["approx_kl"].item() == 0.0
    lp = td["rollout_log_prob"]
    expected = (td["sample_log_prob"] - lp).abs()[td["loss_mask"]].mean()
    assert out["rollout_log_prob_abs_diff"].item() == pytest.approx(expected.item(), rel=1e-6)


# ---------------------------------------------------------------------------- accumulation
@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_gradient_accumulation_with_global_normalizer_equals_full_batch(mode):
    ac = tiny_actor_critic(seed=5)
    perturb(ac.model.value_head, scale=0.5)
    td = group_batch(seed=6)
    full_plan = plan_micro_batches(td, token_budget=10_000)
    recompute_old_log_probs_and_values(ac, td, full_plan)
    td["ref_log_prob"] = td["sample_log_prob"] + 0.05
    td = TokenGAE(gamma=1.0, lmbda=0.95)(td)
    perturb(ac.model, scale=0.03, seed=7)
    loss = TokenPPOLoss(
        ac,
        clip_epsilon=(0.2, 0.28),
        clip_value=0.2,
        entropy_coeff=0.01,
        kl_coeff=0.1,
        loss_agg_mode=mode,
        norm_length=16,
    )
    _, full = _loss_and_grads(ac, loss, next(full_plan.split(td)))

    plan = plan_micro_batches(td, token_budget=20)
    subs = list(plan.split(td))
    assert len(subs) >= 3
    norm = loss.global_normalizer(subs)
    ac.zero_grad()
    for sub in subs:
        out = loss(sub, normalizer=norm)
        sum(v for k, v in out.items() if k.startswith("loss_")).backward()
    acc = _grads(ac)
    for name, g in full.items():
        # to 1e-5 relative to the gradient's scale (float32 sums of up to ~100 terms)
        scale = max(1.0, float(g.abs().max()))
        assert float((acc[name] - g).abs().max()) <= 1e-5 * scale, name


# ---------------------------------------------------------------------------- GAE <-> GRPO swap
def _ppo_iteration(ac, adv_module, optimizer, seed):
    td = group_batch(seed=seed, group_size=3)
    plan = plan_micro_batches(td, token_budget=30)
    recompute_old_log_probs_and_values(ac, td, plan)
    td = adv_module(td)
    loss = TokenPPOLoss(
        ac, clip_value=0.2, critic_coeff=1.0 if isinstance(adv_module, TokenGAE) else None
    )
    norm = loss.global_normalizer(list(plan.split(td)))
    optimizer.zero_grad()
    metrics = []
    for sub in plan.split(td):
        out = loss(sub, normalizer=norm)
        sum(v for k, v in out.items() if k.startswith("loss_")).backward()
        metrics.append(out)
    optimizer.step()
    return torch.stack([m["loss_objective"] for m in metrics]).sum()


@pytest.mark.parametrize("mode", ["gae", "grpo"])
def test_swapping_gae_for_grpo_is_one_line(mode):
    ac = tiny_actor_critic(seed=0)
    before = [p.detach().clone() for p in ac.parameters()]
    optimizer = torch.optim.Adam(ac.parameters(), lr=1e-3)
    # the one line that changes:
    adv_module = TokenGAE(gamma=1.0, lmbda=0.95) if mode == "gae" else GRPOAdvantage()
    for it in range(2):
        assert torch.isfinite(_ppo_iteration(ac, adv_module, optimizer, seed=it))
    moved = sum(float((p.detach() - b).abs().sum()) for p, b in zip(ac.parameters(), before))
    assert moved > 0


# ---------------------------------------------------------------------------- TokenGAE module
def test_token_gae_module_matches_loop_with_nested_renamed_keys():
    td = group_batch(seed=8)
    td["critic", "v"] = torch.randn(*td.shape, 1)
    td["next", "task", "r"] = td["next", "reward"].clone()
    est = TokenGAE(gamma=0.99, lmbda=0.9, critic_lmbda=1.0)
    est.set_keys(
        value=("critic", "v"), reward=("task", "r"), advantage=("out", "adv"), loss_mask="loss_mask"
    )
    est(td)
    ref_a, ref_t = gae_loop(
        td["next", "reward"].squeeze(-1),
        td["critic", "v"].squeeze(-1),
        td["loss_mask"],
        0.99,
        0.9,
        1.0,
    )
    assert torch.allclose(td["out", "adv"].squeeze(-1).double(), ref_a, atol=1e-6)
    assert torch.allclose(td["value_target"].squeeze(-1).double(), ref_t, atol=1e-6)


def test_token_gae_set_keys_accepts_inherited_names():
    """Pins the TorchRL 0.14.1 behaviour our _AcceptedKeys works around: a dataclass subclass that
    only adds a field loses the inherited names in ``set_keys``."""

    class Naive(ValueEstimatorBase):
        @dataclass
        class _AcceptedKeys(ValueEstimatorBase._AcceptedKeys):
            loss_mask: NestedKey = "loss_mask"

        default_keys = _AcceptedKeys

        def forward(self, tensordict, **kw):
            return tensordict

    with pytest.raises(KeyError, match="advantage is not an accepted tensordict key"):
        Naive(value_network=None).set_keys(advantage="adv")
    TokenGAE().set_keys(advantage="adv", value_target="tgt", loss_mask=("m", "x"))


def test_token_gae_bootstrap_truncated_and_adaptive_lambda():
    ac = tiny_actor_critic(seed=0)
    perturb(ac.model.value_head, scale=0.5)
    td = make_trajectory([2, 3], [3, 4], seed=2, terminated=[True, False])
    recompute_old_log_probs_and_values(ac, td, plan_micro_batches(td, token_budget=100))
    boot = TokenGAE(gamma=1.0, lmbda=1.0, bootstrap_truncated=True)(td.clone())
    plain = TokenGAE(gamma=1.0, lmbda=1.0)(td.clone())
    mask = td["loss_mask"]
    assert torch.equal(boot["advantage"][0], plain["advantage"][0])  # terminated row unchanged
    last = mask[1].nonzero().max()
    v_after = td["next", "state_value"][1, last, 0]
    diff = (boot["advantage"][1] - plain["advantage"][1]).squeeze(-1)[mask[1]]
    assert torch.allclose(diff, v_after.expand_as(diff), atol=1e-6)
    ada = TokenGAE(gamma=1.0, adaptive_lmbda_alpha=0.5)(td.clone())
    lam = 1 - 1 / (0.5 * mask.sum(-1).double())
    ref, _ = gae_loop(
        td["next", "reward"].squeeze(-1), td["state_value"].squeeze(-1), mask, 1.0, lam
    )
    assert torch.allclose(ada["advantage"].squeeze(-1).double(), ref, atol=1e-6)


def test_token_gae_errors():
    with pytest.raises(ValueError, match=r"TokenGAE: lmbda must be >= 0 and <= 1, got 1.5"):
        TokenGAE(lmbda=1.5)
    td = group_batch()
    with pytest.raises(
        KeyError, match=r"missing key 'state_value' .*recompute_old_log_probs_and_values"
    ):
        TokenGAE()(td.clone())
    flat = TensorDict({"x": torch.zeros(3)}, [3])
    with pytest.raises(
        ValueError, match=r"expects a \[B, L\] token trajectory .* got batch_size \(3,\)"
    ):
        TokenGAE()(flat)
    td["state_value"] = torch.zeros(*td.shape, 2)
    with pytest.raises(ValueError, match=r"'state_value' has shape \(6, 13, 2\)"):
        TokenGAE()(td)


# ---------------------------------------------------------------------------- GRPOAdvantage
def test_grpo_advantage_module_broadcasts_and_counts_zero_spread_groups():
    """Zero-spread groups get advantage 0 and are counted; dropping them (DAPO's dynamic sampling)
    is the collector's one implementation (WeightSyncCollector(dynamic_sampling=True))."""
    td = group_batch(seed=1, group_size=2)
    td["next", "reward"].zero_()
    rows = torch.arange(6)
    last = td["loss_mask"].long().cumsum(-1).argmax(-1)
    rewards = torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0, 1.0])  # group 1 has zero spread
    td["next", "reward"][rows, last, 0] = rewards
    mod = GRPOAdvantage()
    out = mod(td)
    assert out.shape[0] == 6 and mod.stats == {"groups": 3, "groups_zero_spread": 1}
    adv = out["advantage"].squeeze(-1)
    assert (adv[~out["loss_mask"]] == 0).all() and (adv[2:4] == 0).all()
    with pytest.raises(TypeError, match="drop_zero_spread"):
        GRPOAdvantage(drop_zero_spread=True)
    for r in range(6):
        vals = adv[r][out["loss_mask"][r]]
        assert torch.allclose(vals, vals[0].expand_as(vals))
    assert adv[0][out["loss_mask"][0]][0].item() == pytest.approx(
        1 / 2**0.5, rel=1e-5
    )  # (1 - 0) / std([1, -1])


def test_grpo_advantage_as_replay_buffer_write_transform():
    """TorchRL's invert=True: computed on extend (whole groups), samples keep the stored values."""
    td = group_batch(seed=2, group_size=3)
    expected = GRPOAdvantage()(td.clone())["advantage"]
    rb = ReplayBuffer(storage=LazyTensorStorage(16), batch_size=2)
    rb.append_transform(GRPOAdvantage(), invert=True)
    rb.extend(td.clone())
    assert torch.equal(rb[:]["advantage"], expected)
    sample, info = rb.sample(return_info=True)
    assert torch.equal(sample["advantage"], expected[info["index"]])  # not recomputed on 2 rows
    plain = ReplayBuffer(storage=LazyTensorStorage(16), batch_size=2)
    plain.append_transform(GRPOAdvantage())
    with pytest.raises(RuntimeError, match=r"append_transform\(GRPOAdvantage\(\), invert=True\)"):
        plain.extend(td.clone())


def test_both_estimators_recompute_on_every_call():
    """One call contract: a stale advantage in the batch is overwritten by both modules."""
    td = group_batch(seed=5, group_size=2)
    td["state_value"] = torch.randn(*td.shape, 1)
    for module in (TokenGAE(gamma=1.0, lmbda=0.9), GRPOAdvantage()):
        fresh = module(td.clone())["advantage"]
        stale = td.clone().set("advantage", torch.full((*td.shape, 1), 7.0))
        assert torch.equal(module(stale)["advantage"], fresh), type(module).__name__


def test_grpo_stats_describe_the_last_call_only():
    td = group_batch(seed=1, group_size=2)
    last = td["loss_mask"].long().cumsum(-1).argmax(-1)
    td["next", "reward"].zero_()
    td["next", "reward"][torch.arange(6), last, 0] = torch.tensor([1.0, -1.0, 1.0, 1.0, 1.0, 1.0])
    grpo = GRPOAdvantage()
    for _ in range(3):  # running totals would read 9 groups, 6 zero-spread
        grpo(td.clone())
        assert grpo.stats == {"groups": 3, "groups_zero_spread": 2}
    GRPOAdvantage.compute(grpo, td[:2].clone())
    assert grpo.stats == {"groups": 1, "groups_zero_spread": 0}


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_estimators_reject_non_finite_rewards_naming_row_and_position(bad):
    td = group_batch(seed=3, group_size=2)
    td["state_value"] = torch.zeros(*td.shape, 1)
    pos = int(td["loss_mask"][4].nonzero()[-1])
    td["next", "reward"][4, pos, 0] = bad
    for module in (TokenGAE(), GRPOAdvantage()):
        name = type(module).__name__
        with pytest.raises(
            ValueError,
            match=rf"{name}: non-finite reward \('next', 'reward'\) {bad} at row 4, position {pos}",
        ):
            module(td.clone())


def test_grpo_advantage_errors():
    td = group_batch()
    td["next", "reward"][0, 0] = 1.0  # prompt token
    with pytest.raises(ValueError, match="non-zero reward\\(s\\) on masked tokens"):
        GRPOAdvantage()(td)
    with pytest.raises(KeyError, match="missing key 'prompt_id'"):
        GRPOAdvantage()(group_batch().exclude("prompt_id"))


# ---------------------------------------------------------------------------- TokenPPOLoss API
def test_loss_builds_token_gae_when_advantage_is_missing():
    ac = tiny_actor_critic(seed=0)
    td = group_batch()
    plan = plan_micro_batches(td, token_budget=1000)
    recompute_old_log_probs_and_values(ac, td, plan)
    loss = TokenPPOLoss(ac)
    loss.make_value_estimator(gamma=1.0, lmbda=0.5)
    assert isinstance(loss.value_estimator, TokenGAE) and loss.value_estimator.lmbda == 0.5
    out = loss(td)
    assert "advantage" in td.keys() and torch.isfinite(out["loss_objective"])
    with pytest.raises(ValueError, match="unsupported value_type"):
        loss.make_value_estimator("td0")


def test_plan_less_value_fallback_warns_and_says_why():
    """Values computed without the micro-batch plan lose the ratio-exactly-1 property: say so."""
    ac = tiny_actor_critic(seed=0)
    td = group_batch()
    td["sample_log_prob"] = torch.zeros(td.shape)
    loss = TokenPPOLoss(ac).make_value_estimator()
    with pytest.warns(
        UserWarning, match=r"without the micro-batch plan.*recompute_old_log_probs_and_values"
    ):
        loss.value_estimator(td)
    assert "state_value" in td.keys() and "advantage" in td.keys()
    anchored = group_batch()
    recompute_old_log_probs_and_values(
        ac, anchored, plan_micro_batches(anchored, token_budget=1000)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # anchored values: no warning
        loss.value_estimator(anchored)


def test_truncated_importance_sampling_weights_policy_loss():
    ac = tiny_actor_critic(seed=0)
    td = group_batch()
    recompute_old_log_probs_and_values(ac, td, plan_micro_batches(td, token_budget=1000))
    td = TokenGAE()(td)
    plain = TokenPPOLoss(ac, critic_coeff=None)(td)["loss_objective"]
    td["rollout_log_prob"] = td["sample_log_prob"] - 0.5  # weight exp(0.5) capped at 1.2
    tis = TokenPPOLoss(ac, critic_coeff=None, tis_cap=1.2)(td)["loss_objective"]
    assert tis.item() == pytest.approx(1.2 * plain.item(), rel=1e-5)
    with pytest.raises(
        KeyError,
        match=r"rollout correction \(is_level='token', is_cap=1.2\) needs 'rollout_log_prob'",
    ):
        TokenPPOLoss(ac, tis_cap=1.2)(td.exclude("rollout_log_prob"))


def test_loss_errors():
    ac = tiny_actor_critic()
    for kwargs, msg in [
        (
            {"clip_epsilon": 1.5},
            r"clip_epsilon must be a float in \(0, 1\) or \(low, high\) with 0 < low < 1 and high > 0, got 1.5",
        ),
        ({"clip_epsilon": (0.2, 0.3, 0.4)}, "clip_epsilon must be a float in"),
        ({"dual_clip": 0.5}, r"TokenPPOLoss: dual_clip must be > 1, got 0.5 \(e.g. 3.0\)"),
        (
            {"clip_value": -1.0},
            r"clip_value must be > 0, got -1.0 \(None disables value clipping\)",
        ),
        ({"loss_agg_mode": "mean"}, r"loss_agg_mode='mean' is not one of \['token_mean'"),
        ({"loss_agg_mode": "seq_mean_token_sum_norm"}, "needs norm_length"),
        ({"kl_coeff": -1.0}, "kl_coeff must be >= 0, got -1.0"),
        ({"entropy_coeff": -0.01}, "entropy_coeff must be >= 0, got -0.01"),
        ({"critic_coeff": -1.0}, "critic_coeff must be >= 0, got -1.0"),
        ({"tis_cap": 0.0}, "tis_cap must be > 0, got 0.0"),
        (
            {"norm_length": 0, "loss_agg_mode": "seq_mean_token_sum_norm"},
            "norm_length must be >= 1",
        ),
    ]:
        with pytest.raises(ValueError, match=msg):
            TokenPPOLoss(ac, **kwargs)
    with pytest.raises(TypeError, match="needs an LMActorCritic, got Linear"):
        TokenPPOLoss(torch.nn.Linear(2, 2))
    td = TokenGAE()(group_batch().set("state_value", torch.zeros(6, 13, 1)))
    with pytest.raises(
        KeyError,
        match=r"missing key 'sample_log_prob' \(PPO anchors: run recompute_old_log_probs_and_values",
    ):
        TokenPPOLoss(ac)(td)
    td["sample_log_prob"] = torch.zeros(6, 13)
    with pytest.raises(KeyError, match="missing key 'ref_log_prob'"):
        TokenPPOLoss(ac, kl_coeff=0.1)(td)
    td["loss_mask"] = td["loss_mask"].float()
    with pytest.raises(TypeError, match="'loss_mask' must be bool, got torch.float32"):
        TokenPPOLoss(ac)(td)


def test_grpo_critic_targets_are_monte_carlo_returns():
    """``critic_targets=True``: value_target = discounted reward-to-go over loss_mask tokens (loop)."""
    torch.manual_seed(0)
    mask = torch.tensor([[False, True, True, True, False], [False, False, True, True, True]])
    reward = torch.zeros(2, 5)
    reward[0, 3], reward[1, 4], reward[1, 2] = 1.0, -1.0, 0.25
    td = TensorDict(
        {
            "loss_mask": mask,
            "prompt_id": torch.zeros(2, 5, dtype=torch.long),
            "next": {"reward": reward.unsqueeze(-1)},
        },
        [2, 5],
    )
    gamma = 0.9
    out = GRPOAdvantage(critic_targets=True, gamma=gamma)(td)
    expected = torch.zeros(2, 5)
    for b in range(2):
        ret = 0.0
        for t in reversed(range(5)):
            if mask[b, t]:
                ret = float(reward[b, t]) + gamma * ret
                expected[b, t] = ret
    torch.testing.assert_close(out["value_target"].squeeze(-1), expected)
    assert "value_target" not in GRPOAdvantage()(td.exclude("advantage", "value_target")).keys()
    with pytest.raises(ValueError, match=r"GRPOAdvantage: gamma must be >= 0 and <= 1, got 1.5"):
        GRPOAdvantage(critic_targets=True, gamma=1.5)
    with pytest.raises(ValueError, match=r"GRPOAdvantage: eps must be >= 0, got -0.1"):
        GRPOAdvantage(eps=-0.1)
    with pytest.raises(TypeError, match=r"GRPOAdvantage: scale must be true or false, got 'no'"):
        GRPOAdvantage(scale="no")


# ---------------------------------------------------------------------------- keys and metrics
def _chain(ac, ref, td, renamed: bool):
    """anchors -> GAE -> ppo_update with default keys, or with every key nested and renamed."""
    loss = TokenPPOLoss(ac, clip_value=0.2, kl_coeff=0.1, entropy_coeff=0.01)
    if renamed:
        td = td.clone()
        for old, new in [
            ("tokens", ("in", "ids")),
            ("attention_mask", ("in", "attn")),
            ("loss_mask", ("in", "train")),
            (("next", "reward"), ("next", "task", "r")),
            (("next", "done"), ("next", "task", "d")),
            (("next", "terminated"), ("next", "task", "t")),
        ]:
            td.rename_key_(old, new)
        for module in (ac, ref):
            module.set_keys(
                tokens=("in", "ids"),
                attention_mask=("in", "attn"),
                log_prob=("out", "lp"),
                value=("out", "v"),
                entropy=("out", "h"),
            )
        loss.set_keys(
            sample_log_prob=("anchor", "lp"),
            value=("out", "v"),
            ref_log_prob=("anchor", "ref"),
            loss_mask=("in", "train"),
            advantage=("adv", "a"),
            value_target=("adv", "t"),
            reward=("task", "r"),
            done=("task", "d"),
            terminated=("task", "t"),
        )
    plan = plan_micro_batches(td, token_budget=24, attention_mask_key=ac.tensor_keys.attention_mask)
    recompute_old_log_probs_and_values(ac, td, plan, ref_actor=ref, loss=loss)
    loss.value_estimator(td)  # the loss's TokenGAE follows the loss's keys
    opt = torch.optim.SGD(ac.parameters(), lr=0.1)
    return td, ppo_update(loss, opt, td, plan, epochs=2, generator=torch.Generator().manual_seed(0))


def test_nested_renamed_keys_through_the_whole_chain():
    """Anchors, GAE, loss and ppo_update all read the modules' keys: same numbers as the defaults."""
    base = group_batch(seed=7)
    results = []
    for renamed in (False, True):
        ac = tiny_actor_critic(seed=3)
        perturb(ac.model.value_head, scale=0.5)
        ref = LMActorCritic(copy.deepcopy(ac.model), critic=False)
        perturb(ref.model, scale=0.02, seed=9)
        results.append((_chain(ac, ref, base.clone(), renamed), ac))
    ((td_a, out_a), ac_a), ((td_b, out_b), ac_b) = results
    assert ("anchor", "ref") in td_b.keys(True) and ("next", "out", "v") in td_b.keys(True)
    assert torch.equal(td_a["advantage"], td_b["adv", "a"])
    assert torch.equal(td_a["value_target"], td_b["adv", "t"])
    assert out_a == out_b and out_a["train/kl_ref"] > 0 and out_a["train/optimizer_steps"] == 2
    for pa, pb in zip(ac_a.parameters(), ac_b.parameters()):
        assert torch.equal(pa, pb)


def test_grpo_set_keys_nested_and_unknown_name():
    td = group_batch(seed=2, group_size=2)
    td.rename_key_("prompt_id", ("meta", "group"))
    grpo = GRPOAdvantage().set_keys(group=("meta", "group"), advantage=("adv", "grpo"))
    assert grpo.in_keys == [("next", "reward"), "loss_mask", ("meta", "group")]
    out = grpo(td.clone())
    ref = GRPOAdvantage()(td.clone().set("prompt_id", td["meta", "group"]))
    assert torch.equal(out["adv", "grpo"], ref["advantage"])
    with pytest.raises(KeyError, match="unknown key name 'groups'"):
        GRPOAdvantage().set_keys(groups="x")


def test_loss_emits_torchrl_metric_names_and_lists_every_key_in_out_keys():
    ac = tiny_actor_critic(seed=1)
    td = group_batch(seed=3)
    recompute_old_log_probs_and_values(ac, td, plan_micro_batches(td, token_budget=1000))
    td["ref_log_prob"] = td["sample_log_prob"] - 0.1
    td = TokenGAE()(td)
    perturb(ac.model, scale=0.02, seed=4)  # ratios != 1
    configs = [{}, {"critic_coeff": None}, {"entropy_coeff": 0.01, "kl_coeff": 0.1}]
    for kwargs in configs:
        loss = TokenPPOLoss(ac, **kwargs)
        out = loss(td)
        only_with_policy_mask = {"explained_variance_policy_rows"}
        assert set(out.keys()) == set(loss.out_keys) - only_with_policy_mask, kwargs
        assert set(loss(td.exclude("rollout_log_prob")).keys()) == set(loss.out_keys) - {
            "rollout_log_prob_abs_diff",
            "rollout_abs_log_ratio",
            "rollout_token_mult_prob_error",
            "rollout_seq_ratio",
            "rollout_kl",
            *only_with_policy_mask,
        }
        with_policy = td.clone().set("policy_mask", td["loss_mask"].clone())
        if kwargs.get("critic_coeff", 1.0):
            assert set(loss(with_policy).keys()) == set(loss.out_keys), kwargs
    assert "entropy" in out.keys()  # entropy_coeff > 0 computes it; without, it is omitted
    assert "entropy" not in TokenPPOLoss(tiny_actor_critic(seed=1))(td).keys()
    # the metrics against plain loops over the trained tokens
    with torch.no_grad():
        new = ac(td.select("tokens", "attention_mask"))["log_prob"]
    mask = td["loss_mask"]
    lr = (new - td["sample_log_prob"])[mask].double()
    r = lr.exp()
    expected = {
        "kl_approx": (-lr).mean(),
        "approx_kl": ((r - 1) - lr).mean(),
        "mean_ratio": r.mean(),
        "max_ratio": r.max(),
        "min_ratio": r.min(),
        "ESS": r.sum() ** 2 / (r**2).sum() / r.numel(),
    }
    for key, value in expected.items():
        assert out[key].item() == pytest.approx(value.item(), rel=1e-5, abs=1e-7), key
    assert 0 < out["ESS"].item() < 1


def test_loss_stays_finite_at_extreme_log_ratios():
    """A log-ratio of 100 (exp overflows float32): finite loss, metrics and gradients."""
    ac = tiny_actor_critic(seed=0)
    td = group_batch(seed=1)
    recompute_old_log_probs_and_values(ac, td, plan_micro_batches(td, token_budget=1000))
    td = TokenGAE()(td)
    mask = td["loss_mask"]
    td["sample_log_prob"] = torch.where(mask, td["sample_log_prob"] - 100.0, 0.0)
    td["rollout_log_prob"] = torch.where(mask, td["sample_log_prob"] - 100.0, 0.0)
    td["advantage"][0] = 0.0  # advantage 0 with an overflowing ratio: was a NaN loss
    out = TokenPPOLoss(ac, clip_value=0.2, tis_cap=2.0)(td)
    total = out["loss_objective"] + out["loss_critic"]
    total.backward()
    assert all(torch.isfinite(v).all() for v in out.values())
    assert all(torch.isfinite(p.grad).all() for p in ac.parameters() if p.grad is not None)


def test_loss_metrics_are_finite_for_one_and_zero_trained_tokens():
    ac = tiny_actor_critic(seed=0)
    td = group_batch(seed=1)
    recompute_old_log_probs_and_values(ac, td, plan_micro_batches(td, token_budget=1000))
    td = TokenGAE()(td)
    one = torch.zeros_like(td["loss_mask"])
    one[2, int(td["loss_mask"][2].nonzero()[0])] = True
    for mask, ev in ((one, 1.0), (torch.zeros_like(one), 0.0)):
        out = TokenPPOLoss(ac)(td.clone().set("loss_mask", mask))
        assert all(torch.isfinite(v) for v in out.values())
        assert out["explained_variance"].item() == ev  # was nan for one token
    assert out["min_ratio"].item() == out["max_ratio"].item() == 1.0


def test_actor_only_module_as_reference_and_critic_errors():
    """critic=False: no value head needed, no value keys; the loss then refuses a critic term."""
    from ar_torchrl.models.tiny import build_tiny_qwen3

    bare = build_tiny_qwen3(99, seed=0)
    ref = LMActorCritic(bare, critic=False)
    assert ref.out_keys == ["log_prob"] and not hasattr(bare, "value_head")
    ac = tiny_actor_critic(seed=0)
    td = group_batch(seed=2)
    recompute_old_log_probs_and_values(
        ac, td, plan_micro_batches(td, token_budget=1000), ref_actor=ref
    )
    assert torch.equal(td["ref_log_prob"], td["sample_log_prob"])  # same weights
    actor_only = LMActorCritic(copy.deepcopy(bare), critic=False)
    td2 = group_batch(seed=2)
    recompute_old_log_probs_and_values(actor_only, td2, plan_micro_batches(td2, token_budget=1000))
    assert "state_value" not in td2.keys() and ("next", "state_value") not in td2.keys(True)
    out = TokenPPOLoss(actor_only, critic_coeff=None)(GRPOAdvantage()(td2))
    assert torch.isfinite(out["loss_objective"]) and "loss_critic" not in out.keys()
    with pytest.raises(
        ValueError, match=r"critic_coeff=1.0 needs a critic: an LMActorCritic with a value head"
    ):
        TokenPPOLoss(actor_only)
