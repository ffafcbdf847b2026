"""ar_torchrl.functional.critic_health: Monte-Carlo returns along trained tokens, position thirds
and an explained variance that is undefined (nan) where the returns do not vary, each against a
plain loop; the EV is verl's ``critic/vf_explained_var`` up to verl's ``+ 1e-5``."""

from __future__ import annotations

import math

import pytest
import torch

from ar_torchrl.functional import (
    explained_variance_or_nan,
    explained_variance_within_groups,
    monte_carlo_returns,
    position_thirds,
    token_gae,
)

torch.set_num_threads(1)


def _batch(seed: int, rows: int = 6, width: int = 11):
    """Rows of prompt, trained tokens with gaps (tool tokens), padding; rewards on trained tokens."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, width, generator=g) < 0.6
    mask[:, :2] = False  # a prompt
    mask[0] = False  # a row without trained tokens
    reward = torch.where(mask, torch.randn(rows, width, generator=g), 0.0)
    return reward, mask


def _loop_returns(reward, mask, gamma):
    out = [[0.0] * reward.shape[1] for _ in range(reward.shape[0])]
    for b in range(reward.shape[0]):
        ret = 0.0
        for t in reversed(range(reward.shape[1])):
            if mask[b, t]:
                ret = float(reward[b, t]) + gamma * ret
                out[b][t] = ret
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
def test_monte_carlo_returns_are_the_discounted_sums_along_trained_tokens(seed, gamma):
    reward, mask = _batch(seed)
    got = monte_carlo_returns(reward, mask, gamma=gamma)
    want = torch.tensor(_loop_returns(reward, mask, gamma))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # TokenGAE's value target at lambda = 1 is the same return whatever the values
    _, target = token_gae(reward, torch.randn(reward.shape), mask, gamma=gamma, lmbda=1.0)
    torch.testing.assert_close(target, want, atol=1e-5, rtol=1e-5)


def test_monte_carlo_returns_reject_a_reward_off_the_trained_tokens():
    reward, mask = torch.tensor([[1.0, 1.0]]), torch.tensor([[False, True]])
    with pytest.raises(ValueError, match=r"non-zero reward\(s\) on masked tokens"):
        monte_carlo_returns(reward, mask, gamma=1.0)


@pytest.mark.parametrize("seed", range(3))
def test_position_thirds_match_a_loop(seed):
    _, mask = _batch(seed, rows=8, width=13)
    got = position_thirds(mask)
    for b in range(mask.shape[0]):
        trained = [t for t in range(mask.shape[1]) if mask[b, t]]
        for t in range(mask.shape[1]):
            want = 3 * trained.index(t) // len(trained) if t in trained else -1
            assert int(got[b, t]) == want, (b, t)
    ones = position_thirds(torch.ones(1, 9, dtype=torch.bool))
    assert ones.tolist() == [[0, 0, 0, 1, 1, 1, 2, 2, 2]]
    with pytest.raises(ValueError, match=r"loss_mask must be a bool \[B, L\] tensor, got shape"):
        position_thirds(torch.ones(3, dtype=torch.bool))


def _loop_ev(value, target, mask):
    v = [float(x) for x, m in zip(value.flatten(), mask.flatten()) if m]
    r = [float(x) for x, m in zip(target.flatten(), mask.flatten()) if m]

    def var(xs):
        mean = sum(xs) / len(xs)
        return sum((x - mean) ** 2 for x in xs) / len(xs)

    return 1 - var([a - b for a, b in zip(r, v)]) / var(r)


@pytest.mark.parametrize("seed", range(4))
def test_explained_variance_or_nan_is_the_plain_formula_and_verls(seed):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(4, 9, generator=g)
    value = 0.6 * target + 0.5 * torch.randn(4, 9, generator=g) + 3.0  # a shift changes nothing
    mask = torch.rand(4, 9, generator=g) < 0.7
    got = float(explained_variance_or_nan(value, target, mask))
    assert got == pytest.approx(_loop_ev(value, target, mask), abs=1e-9)
    # verl/trainer/ppo/metric_utils.py compute_data_metrics (volcengine/verl@07c9cf137c885a5b492c
    # 3440d98f1a7e8887f7ca): 1 - var(returns - values) / (var(returns) + 1e-5), torch.var
    # (unbiased) over the response-masked tokens
    r, v = torch.masked_select(target, mask), torch.masked_select(value, mask)
    verl = float(1.0 - torch.var(r - v) / (torch.var(r) + 1e-5))
    assert got == pytest.approx(verl, abs=1e-4)


def test_explained_variance_is_undefined_without_spread_or_tokens():
    mask = torch.ones(2, 3, dtype=torch.bool)
    assert math.isnan(explained_variance_or_nan(torch.randn(2, 3), torch.full((2, 3), -1.0), mask))
    none = torch.zeros(2, 3, dtype=torch.bool)
    assert math.isnan(explained_variance_or_nan(torch.randn(2, 3), torch.randn(2, 3), none))
    # a constant prediction of varying returns explains nothing: exactly 0, not undefined
    target = torch.tensor([[1.0, -1.0, 1.0]])
    assert float(explained_variance_or_nan(torch.zeros(1, 3), target, mask[:1])) == 0.0
    with pytest.raises(TypeError, match=r"mask must be a bool tensor, got dtype torch.float32"):
        explained_variance_or_nan(target, target, torch.ones(1, 3))
    with pytest.raises(ValueError, match=r"mask has shape \(1, 3\) but value has shape \(3,\)"):
        explained_variance_or_nan(torch.zeros(3), target, mask[:1])


def _loop_within(value, target, groups):
    """explained_variance_within_groups by hand: per-group means, then the plain formula."""
    value, target, groups = value.tolist(), target.tolist(), groups.tolist()
    members = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    rc, vc = [0.0] * len(value), [0.0] * len(value)
    for idx in members.values():
        mr = sum(target[i] for i in idx) / len(idx)
        mv = sum(value[i] for i in idx) / len(idx)
        for i in idx:
            rc[i], vc[i] = target[i] - mr, value[i] - mv
    ones = torch.ones(len(rc), dtype=torch.bool)
    return _loop_ev(
        torch.tensor(vc, dtype=torch.float64), torch.tensor(rc, dtype=torch.float64), ones
    )


@pytest.mark.parametrize("seed", range(4))
def test_explained_variance_within_groups_matches_a_loop(seed):
    g = torch.Generator().manual_seed(seed)
    groups = torch.randint(0, 5, (40,), generator=g) * 7 - 3  # arbitrary, negative ids included
    offset = torch.randn(5, generator=g)[torch.unique(groups, return_inverse=True)[1]] * 3
    target = torch.randn(40, generator=g) + offset
    value = 0.5 * target + 0.3 * torch.randn(40, generator=g)
    got = float(explained_variance_within_groups(value, target, groups))
    assert got == pytest.approx(_loop_within(value, target, groups), abs=1e-9)
    # a value that knows only the group (its mean return) explains nothing within the groups,
    # although its plain explained variance is high
    per_group = torch.zeros(5, dtype=torch.float64).index_add_(
        0, torch.unique(groups, return_inverse=True)[1], target.double()
    )
    inverse = torch.unique(groups, return_inverse=True)[1]
    prompt_only = (per_group / torch.bincount(inverse, minlength=5))[inverse].float()
    assert float(explained_variance_within_groups(prompt_only, target, groups)) == pytest.approx(
        0.0, abs=1e-6
    )
    assert (
        float(explained_variance_or_nan(prompt_only, target, torch.ones(40, dtype=torch.bool)))
        > 0.3
    )


def test_explained_variance_within_groups_is_undefined_without_spread_and_checks_shapes():
    target = torch.tensor([1.0, 1.0, -1.0, -1.0])  # constant within each group
    groups = torch.tensor([0, 0, 1, 1])
    assert math.isnan(explained_variance_within_groups(torch.randn(4), target, groups))
    assert math.isnan(explained_variance_within_groups(torch.zeros(0), torch.zeros(0), groups[:0]))
    with pytest.raises(ValueError, match=r"value must be 1-D \[N\].*got shape \(2, 2\)"):
        explained_variance_within_groups(torch.zeros(2, 2), target, groups)
    with pytest.raises(ValueError, match=r"one shape \[N\], got \(3,\), \(4,\) and \(4,\)"):
        explained_variance_within_groups(torch.zeros(3), target, groups)
    with pytest.raises(TypeError, match=r"groups must be an integer tensor.*torch.float32"):
        explained_variance_within_groups(target, target, groups.float())
