"""ppo_update's metrics are those of each whole mini-batch (issue 27 item 1a): independent of the
micro-batch split and equal to a plain loop over the batch; a failed micro-batch at lambda = 1
does not drag explained variance to -Var(V)/eps; an undefined metric is left out, never logged."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from support.trajectories import make_trajectory, perturb, tiny_actor_critic

from ar_torchrl.objectives import TokenGAE, TokenPPOLoss
from ar_torchrl.objectives.metrics import EV_EPS
from ar_torchrl.training import plan_micro_batches, ppo_update, recompute_old_log_probs_and_values

torch.set_num_threads(1)

PROMPTS, RESPONSES = [3, 6, 2, 5, 4, 1, 3, 2], [5, 2, 7, 3, 6, 4, 1, 5]
SPLITS = [(1000, False), (40, False), (24, False), (16, False), (40, True), (16, True)]


def _batch(lmbda: float = 0.95, failed: set[int] | None = None, everything_failed=False):
    """Anchors, then GAE, then a perturbed policy (ratios != 1); ``failed`` rows get reward -1 and
    the others +1 (``everything_failed``: every row -1)."""
    ac = tiny_actor_critic(seed=2)
    perturb(ac.model.value_head, scale=0.1, seed=3)
    td = make_trajectory(PROMPTS, RESPONSES, seed=3)
    if failed is not None or everything_failed:
        done = td["next", "done"].squeeze(-1)
        for b in range(td.shape[0]):
            bad = everything_failed or b in failed
            td["next", "reward"][b, done[b]] = -1.0 if bad else 1.0
    recompute_old_log_probs_and_values(ac, td, plan_micro_batches(td, token_budget=1000))
    td = TokenGAE(gamma=1.0, lmbda=lmbda)(td)
    perturb(ac.model, scale=0.02, seed=4)
    return ac, td


def _update(ac, td, budget, packing, *, lr=0.1, num_minibatches=1):
    ac = copy.deepcopy(ac)
    plan = plan_micro_batches(td, token_budget=budget, packing=packing)
    optimizer = torch.optim.SGD(ac.parameters(), lr=lr)
    return ppo_update(
        TokenPPOLoss(ac, clip_value=0.2),
        optimizer,
        td.clone(),
        plan,
        num_minibatches=num_minibatches,
        generator=torch.Generator().manual_seed(0),
    )


def _reference(ac, td) -> dict[str, float]:
    """The metrics of the whole batch in one plain loop (one padded forward, Python floats)."""
    with torch.no_grad():
        new = ac(td.select(*ac.in_keys))
    ratios, returns, values = [], [], []
    for b, t in td["loss_mask"].nonzero().tolist():
        lr = float(new["log_prob"][b, t]) - float(td["sample_log_prob"][b, t])
        ratios.append(math.exp(min(max(lr, -20.0), 20.0)))
        returns.append(float(td["value_target"][b, t, 0]))
        values.append(float(new["state_value"][b, t, 0]))
    n = len(ratios)

    def var(xs):
        mean = sum(xs) / len(xs)
        return sum((x - mean) ** 2 for x in xs) / len(xs)

    resid = [r - v for r, v in zip(returns, values)]
    return {
        "explained_variance": 1 - var(resid) / (var(returns) + EV_EPS),
        "explained_variance_finite": 1 - var(resid) / var(returns),
        "max_ratio": max(ratios),
        "min_ratio": min(ratios),
        "ESS": sum(ratios) ** 2 / sum(r * r for r in ratios) / n,
        "mean_ratio": sum(ratios) / n,
    }


@pytest.mark.parametrize("lmbda", [0.95, 1.0])
def test_metrics_are_the_whole_batch_for_any_micro_batch_split(lmbda):
    ac, td = _batch(lmbda)
    want = _reference(ac, td)
    outs = [_update(ac, td, budget, packing) for budget, packing in SPLITS]
    assert {len(plan_micro_batches(td, b, packing=p)) for b, p in SPLITS} >= {1, 3, 5}
    for (budget, packing), out in zip(SPLITS, outs):
        for key, value in want.items():
            got = out[f"train/{key}"]
            assert got == pytest.approx(value, rel=1e-5, abs=1e-6), (budget, packing, key)
            assert got == pytest.approx(outs[0][f"train/{key}"], abs=1e-6), (budget, packing, key)
    assert want["max_ratio"] > 1.01 and want["min_ratio"] < 0.99  # the policy moved
    assert abs(want["explained_variance"]) > 0.05  # a value head that is not constant


def test_a_micro_batch_whose_rows_all_failed_keeps_explained_variance_finite():
    """lambda = 1 (Monte-Carlo returns): the micro-batch of failed rows has constant returns, its
    own TorchRL explained variance is -Var(V)/eps; the mini-batch's is the whole batch's."""
    td = make_trajectory(PROMPTS, RESPONSES, seed=3)
    plan = plan_micro_batches(td, token_budget=24)
    failed = set(plan.micro_batches[0].rows)
    ac, td = _batch(1.0, failed=failed)
    alone = TokenPPOLoss(ac, clip_value=0.2)(plan.crop(td, plan.micro_batches[0]))
    assert alone["explained_variance"].item() < -1e3  # what averaging per micro-batch logged
    want = _reference(ac, td)["explained_variance"]
    for budget, packing in SPLITS:
        got = _update(ac, td, budget, packing)["train/explained_variance"]
        assert math.isfinite(got) and got > -1.0
        assert got == pytest.approx(want, abs=1e-6), (budget, packing)


def test_an_undefined_metric_is_left_out_of_the_iteration_average():
    """Two mini-batches, one of failed rows only (constant returns, EV undefined): the iteration's
    explained variance is the other one's; the finite variant averages both (0 for the flat one);
    with every row failed no mini-batch defines it and the key is absent."""
    td = make_trajectory(PROMPTS, RESPONSES, seed=3)
    plan = plan_micro_batches(td, token_budget=60)
    assert len(plan) == 2
    flat, varied = plan.micro_batches
    ac, td = _batch(1.0, failed=set(flat.rows) | {varied.rows[0]})
    out = _update(ac, td, 60, False, lr=0.0, num_minibatches=2)  # lr 0: both at the same weights
    loss = TokenPPOLoss(ac, clip_value=0.2)
    on_varied = loss(plan.crop(td, varied))
    on_flat = loss(plan.crop(td, flat))
    assert out["train/optimizer_steps"] == 2.0 and on_flat["explained_variance"].item() < -1e3
    ev = on_varied["explained_variance"].item()
    assert out["train/explained_variance"] == pytest.approx(ev, abs=1e-6)
    assert on_flat["explained_variance_finite"].item() == 0.0
    finite = on_varied["explained_variance_finite"].item() / 2
    assert out["train/explained_variance_finite"] == pytest.approx(finite, abs=1e-6)
    ac, td = _batch(1.0, everything_failed=True)
    out = _update(ac, td, 24, False)
    assert "train/explained_variance" not in out
    assert out["train/explained_variance_finite"] == 0.0 and "train/max_ratio" in out
