"""reinforce_pp_advantage against a plain loop and against verl's REINFORCE++ estimator."""

from __future__ import annotations

import math

import pytest
import torch
from support.reference import random_trajectory_masks

from ar_torchrl.functional import reinforce_pp_advantage

F64 = torch.float64


def reinforce_pp_loop(reward, mask, gamma, whiten_mask=None, eps=1e-8):
    """Row by row, trained token by trained token (masked tokens skipped), then one whitening over
    the batch's trained tokens with the n - 1 variance: the REINFORCE++ recipe in words."""
    B, L = reward.shape
    ret = torch.zeros(B, L, dtype=F64)
    for b in range(B):
        g = 0.0
        for t in reversed(range(L)):
            if mask[b, t]:
                g = float(reward[b, t]) + gamma * g
                ret[b, t] = g
    over = mask if whiten_mask is None else mask & whiten_mask
    vals = [float(ret[b, t]) for b in range(B) for t in range(L) if over[b, t]]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    adv = torch.zeros(B, L, dtype=F64)
    for b in range(B):
        for t in range(L):
            if over[b, t]:
                adv[b, t] = (float(ret[b, t]) - mean) / math.sqrt(var + eps)
    return adv, ret


# ---- verl, transcribed: volcengine/verl@b178a3cd56f58b2d502255daba591e92833930a7
# verl/trainer/ppo/core_algos.py compute_reinforce_plus_plus_outcome_advantage (config.gamma passed
# as `gamma`) and verl/utils/torch_functional.py masked_sum / masked_mean / masked_var /
# masked_whiten, line for line.
def _verl_masked_sum(values, mask, axis=None):
    valid_values = torch.where(mask.bool(), values, 0.0)
    return (valid_values * mask).sum(axis=axis)


def _verl_masked_mean(values, mask, axis=None):
    s = _verl_masked_sum(values, mask, axis)
    return s / (mask.sum(axis=axis) + 1e-8)


def _verl_masked_var(values, mask, unbiased=True):
    mean = _verl_masked_mean(values, mask)
    centered_values = values - mean
    variance = _verl_masked_mean(centered_values**2, mask)
    if unbiased:
        mask_sum = mask.sum()
        if mask_sum == 0:
            raise ValueError("At least one element in the mask has to be 1.")
        if mask_sum == 1:
            raise ValueError("The sum of the mask is one, which can cause a division by zero.")
        bessel_correction = mask_sum / (mask_sum - 1)
        variance = variance * bessel_correction
    return variance


def _verl_masked_whiten(values, mask, shift_mean=True):
    mean, var = _verl_masked_mean(values, mask), _verl_masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


def verl_reinforce_pp(token_level_rewards, response_mask, gamma):
    with torch.no_grad():
        returns = torch.zeros_like(token_level_rewards)
        running_return = 0

        for t in reversed(range(token_level_rewards.shape[1])):
            running_return = token_level_rewards[:, t] + gamma * running_return
            returns[:, t] = running_return
            # Reset after EOS
            running_return = running_return * response_mask[:, t]

        advantages = _verl_masked_whiten(returns, response_mask)
        advantages = advantages * response_mask

    return advantages, returns


# ---- end of the transcription


def _batch(seed, *, B=12, L=30, gaps=False, outcome=False, dtype=F64):
    """Ragged prompt + response rows; dense per-token rewards (a KL-shaped reward) or one 0/1
    outcome on each row's last trained token."""
    g = torch.Generator().manual_seed(seed)
    mask = random_trajectory_masks(B, L, g, gaps=gaps)
    if outcome:
        last = torch.where(mask, torch.arange(L), -1).max(-1).values
        reward = torch.zeros(B, L, dtype=dtype)
        hit = (torch.rand(B, generator=g) < 0.4) & (last >= 0)  # rows without tokens: none
        reward[torch.arange(B), last.clamp_min(0)] = hit.to(dtype)
    else:
        reward = torch.where(mask, torch.randn(B, L, generator=g, dtype=dtype), 0.0)
    return reward, mask


@pytest.mark.parametrize("outcome", [False, True])
@pytest.mark.parametrize("gaps", [False, True])
@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.5, 0.0])
@pytest.mark.parametrize("seed", range(3))
def test_reinforce_pp_matches_plain_loop(seed, gamma, gaps, outcome):
    reward, mask = _batch(seed, gaps=gaps, outcome=outcome)
    adv, ret = reinforce_pp_advantage(reward, mask, gamma=gamma)
    ref_adv, ref_ret = reinforce_pp_loop(reward, mask, gamma)
    torch.testing.assert_close(ret, ref_ret, atol=1e-10, rtol=0)
    torch.testing.assert_close(adv, ref_adv, atol=1e-8, rtol=0)
    assert abs(float(adv[mask].mean())) < 1e-10  # whitened: zero mean over trained tokens
    assert float(adv[mask].std()) == pytest.approx(1.0, abs=1e-6)


def test_reinforce_pp_float32_matches_float64_loop():
    reward, mask = _batch(4, gaps=True, dtype=torch.float32)
    adv, ret = reinforce_pp_advantage(reward, mask, gamma=0.95)
    ref_adv, ref_ret = reinforce_pp_loop(reward, mask, 0.95)
    assert adv.dtype == ret.dtype == torch.float32
    torch.testing.assert_close(adv.to(F64), ref_adv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret.to(F64), ref_ret, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("outcome", [False, True])
@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.5])
@pytest.mark.parametrize("seed", range(4))
def test_reinforce_pp_equals_verl(seed, gamma, outcome):
    """Peer test: verl's estimator on the same [B, L] batch (one run of trained tokens per row,
    after a masked prompt and before padding: verl's response layout) gives the same advantages
    everywhere and the same returns on trained tokens (verl leaves partial sums on masked
    positions; its caller never reads them). Conventions shared: mean shift, the n - 1 variance,
    1e-8 inside the square root. verl adds 1e-8 to the token count of its means (a relative
    1e-8 / n): the tolerance is 1e-7."""
    reward, mask = _batch(seed, B=16, L=40, outcome=outcome)
    ours, ours_ret = reinforce_pp_advantage(reward, mask, gamma=gamma)
    theirs, theirs_ret = verl_reinforce_pp(reward, mask.to(F64), gamma)
    torch.testing.assert_close(ours, theirs, atol=1e-7, rtol=0)
    torch.testing.assert_close(ours_ret[mask], theirs_ret[mask], atol=1e-12, rtol=0)


def test_reinforce_pp_departs_from_verl_across_masked_gaps():
    """Multi-turn rows (a tool output, masked, between two turns): verl zeroes its running return
    at every masked token, so the first turn gets none of the outcome; here it carries across the
    gap (as token_gae and verl's own GAE with an observation mask do)."""
    mask = torch.tensor([[False, True, True, False, False, True, True]] * 2)
    reward = torch.zeros(2, 7, dtype=F64)
    reward[0, 6] = 1.0
    ours_adv, ours = reinforce_pp_advantage(reward, mask, gamma=0.5)
    _, theirs = verl_reinforce_pp(reward, mask.to(F64), 0.5)
    assert ours[0].tolist() == [0.0, 0.125, 0.25, 0.0, 0.0, 0.5, 1.0]
    assert theirs[0, 1:3].tolist() == [0.0, 0.0]  # verl: the first turn learns nothing
    assert torch.equal(ours[0, 5:], theirs[0, 5:])  # the last turn agrees
    assert ours_adv[0, 1] > ours_adv[1, 1]  # the successful row's first turn is credited


def test_reinforce_pp_policy_mask_whitens_over_policy_rows_only():
    reward, mask = _batch(7, gaps=True)
    policy = torch.zeros_like(mask)
    policy[::2] = True  # odd rows: kept for a critic only
    adv, ret = reinforce_pp_advantage(reward, mask, gamma=1.0, policy_mask=policy)
    ref_adv, ref_ret = reinforce_pp_loop(reward, mask, 1.0, whiten_mask=policy)
    torch.testing.assert_close(adv, ref_adv, atol=1e-8, rtol=0)
    torch.testing.assert_close(ret, ref_ret, atol=1e-10, rtol=0)  # returns on every row
    assert adv[1::2].abs().sum() == 0 and ret[1::2].abs().sum() > 0


def test_reinforce_pp_one_sample_per_prompt_and_flat_batch():
    """No groups: a lone row gets a non-zero advantage; a batch whose returns are all equal (every
    row failed) gets 0 everywhere, never NaN; masked positions are 0 whatever sits there."""
    mask = torch.tensor([[False, True, True], [False, True, True], [False, False, True]])
    reward = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    adv, _ = reinforce_pp_advantage(reward, mask)
    assert adv[0, 2] > 0 > adv[1, 2] and adv[:, 0].tolist() == [0.0, 0.0, 0.0]
    flat, ret = reinforce_pp_advantage(torch.zeros(3, 3), mask)
    assert flat.abs().sum() == 0 and ret.abs().sum() == 0 and torch.isfinite(flat).all()
    single, _ = reinforce_pp_advantage(reward[2:], mask[2:])  # one trained token: 0 (verl raises)
    assert single.tolist() == [[0.0, 0.0, 0.0]]


def test_reinforce_pp_errors_name_what_was_received():
    reward, mask = _batch(0)
    stray = reward.clone()
    stray[0, 0] = 1.0  # position 0 is a prompt token
    with pytest.raises(
        ValueError, match=r"reinforce_pp_advantage: 1 non-zero reward\(s\) on masked"
    ):
        reinforce_pp_advantage(stray, mask)
    nan = reward.clone()
    nan[mask.nonzero()[0].tolist()] = float("nan")
    with pytest.raises(
        ValueError, match=r"reinforce_pp_advantage: non-finite reward nan at row \d+, position \d+"
    ):
        reinforce_pp_advantage(nan, mask)
    with pytest.raises(
        ValueError, match=r"reinforce_pp_advantage: gamma must be >= 0 and <= 1, got 1.5"
    ):
        reinforce_pp_advantage(reward, mask, gamma=1.5)
    with pytest.raises(ValueError, match=r"reinforce_pp_advantage: eps must be >= 0, got -1"):
        reinforce_pp_advantage(reward, mask, eps=-1.0)
    with pytest.raises(ValueError, match=r"policy_mask must be a bool tensor .* got torch.int64"):
        reinforce_pp_advantage(reward, mask, policy_mask=mask.long())
    with pytest.raises(
        ValueError, match=r"expects \[B, L\] tensors, got reward of shape \(12, 30, 1\)"
    ):
        reinforce_pp_advantage(reward.unsqueeze(-1), mask.unsqueeze(-1))
