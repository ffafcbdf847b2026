"""ar_torchrl.functional against plain loops, hand-computed cases and TorchRL's own GAE."""

from __future__ import annotations

import math

import pytest
import torch
from support.reference import (
    aggregate_loop,
    explained_variance_loop,
    gae_loop,
    grpo_loop,
    random_trajectory_masks,
    surrogate_loop,
    whiten_loop,
)
from torchrl.objectives.value.functional import generalized_advantage_estimate

from ar_torchrl import functional


def _ragged(seed, B=12, L=40, gaps=True, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    mask = random_trajectory_masks(B, L, g, gaps=gaps)
    reward = torch.where(mask, torch.randn(B, L, generator=g), 0.0)
    value = torch.randn(B, L, generator=g) * 3  # garbage at masked positions on purpose
    return reward.to(dtype), value.to(dtype), mask


# token_gae computes in its input dtype: float64 inputs must match the float64 loop to 1e-6 (it
# gets ~1e-12); float32 inputs match to float32 precision (relative 1e-5 over rows of 40 tokens).
TOL = {torch.float64: {"atol": 1e-6, "rtol": 0.0}, torch.float32: {"atol": 1e-5, "rtol": 1e-5}}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("gaps", [True, False])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    "gamma,lmbda,critic_lmbda",
    [
        (1.0, 0.95, None),
        (0.99, 0.9, 1.0),
        (1.0, 1.0, None),
        (0.0, 0.95, None),
        (1.0, 0.0, None),
        (0.5, 0.3, 0.7),
        (0.9, 0.01, None),
        (1.0, 1e-3, 0.5),
    ],
)
def test_token_gae_matches_loop(seed, gaps, dtype, gamma, lmbda, critic_lmbda):
    reward, value, mask = _ragged(seed, gaps=gaps, dtype=dtype)
    adv, tgt = functional.token_gae(
        reward, value, mask, gamma=gamma, lmbda=lmbda, critic_lmbda=critic_lmbda
    )
    ref_adv, ref_tgt = gae_loop(reward, value, mask, gamma, lmbda, critic_lmbda)
    assert adv.dtype == dtype and tgt.dtype == dtype
    assert torch.allclose(adv.double(), ref_adv, **TOL[dtype])
    assert torch.allclose(tgt.double(), ref_tgt, **TOL[dtype])
    assert (adv[~mask] == 0).all() and (tgt[~mask] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("gaps", [True, False])
@pytest.mark.parametrize("gamma,lmbda", [(0.9, 0.3), (1.0, 0.95)])
def test_token_gae_long_rows_go_through_chunks(gaps, dtype, gamma, lmbda):
    """Long rows span many blocks of the two-level suffix sum (and c**n would underflow)."""
    reward, value, mask = _ragged(7, B=3, L=3000, gaps=gaps, dtype=dtype)
    adv, tgt = functional.token_gae(reward, value, mask, gamma=gamma, lmbda=lmbda)
    ref_adv, ref_tgt = gae_loop(reward, value, mask, gamma, lmbda)
    tol = TOL[dtype] if dtype == torch.float64 else {"atol": 1e-4, "rtol": 1e-4}
    assert torch.allclose(adv.double(), ref_adv, **tol)
    assert torch.allclose(tgt.double(), ref_tgt, **tol)


@pytest.mark.parametrize("gaps", [True, False])
def test_token_gae_per_row_lambda_and_bootstrap(gaps):
    reward, value, mask = _ragged(3, gaps=gaps)
    lam = torch.linspace(0.0, 1.0, reward.shape[0])
    boot = torch.randn(reward.shape[0])
    adv, tgt = functional.token_gae(
        reward, value, mask, gamma=0.97, lmbda=lam, bootstrap_value=boot
    )
    ref_adv, ref_tgt = gae_loop(reward, value, mask, 0.97, lam, bootstrap=boot)
    assert torch.allclose(adv.double(), ref_adv, atol=1e-6, rtol=0)
    assert torch.allclose(tgt.double(), ref_tgt, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("gaps", [True, False])
def test_token_gae_per_row_lambda_on_long_rows(gaps, dtype):
    """Per-row factors use blocks of ~sqrt(L) tokens (L=700: 27, a padded last block)."""
    reward, value, mask = _ragged(4, B=5, L=700, gaps=gaps, dtype=dtype)
    lam = torch.tensor([0.0, 0.3, 0.9, 0.99, 1.0])
    critic = torch.tensor([1.0, 0.95, 0.5, 0.0, 0.7])
    adv, tgt = functional.token_gae(
        reward, value, mask, gamma=0.999, lmbda=lam, critic_lmbda=critic
    )
    ref_adv, ref_tgt = gae_loop(reward, value, mask, 0.999, lam, critic)
    tol = TOL[dtype] if dtype == torch.float64 else {"atol": 1e-4, "rtol": 1e-4}
    assert torch.allclose(adv.double(), ref_adv, **tol)
    assert torch.allclose(tgt.double(), ref_tgt, **tol)


@pytest.mark.parametrize("lmbda", [0.95, 1.0])
def test_token_gae_equals_torchrl_on_each_generated_segment(lmbda):
    """Per row, TorchRL's GAE on the generated segment (time = last dim) gives the same numbers."""
    reward, value, mask = _ragged(11, gaps=False, dtype=torch.float32)
    adv, tgt = functional.token_gae(reward, value, mask, gamma=0.99, lmbda=lmbda)
    for b in range(reward.shape[0]):
        seg = mask[b].nonzero().flatten()
        if seg.numel() == 0:
            continue
        r = reward[b, seg].view(1, -1, 1)
        v = value[b, seg].view(1, -1, 1)
        nv = torch.cat([v[:, 1:], torch.zeros(1, 1, 1)], dim=1)
        done = torch.zeros_like(r, dtype=torch.bool)
        done[:, -1] = True
        ta, tt = generalized_advantage_estimate(0.99, lmbda, v, nv, r, done, done.clone())
        assert torch.allclose(adv[b, seg], ta.flatten(), atol=1e-5)
        assert torch.allclose(tgt[b, seg], tt.flatten(), atol=1e-5)


def test_token_gae_hand_computed_terminal_reward_and_truncation():
    # Row 0: prompt (2), 3 generated, pad. Row 1: truncated response filling the row, bootstrapped.
    reward = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    value = torch.tensor([[5.0, 5.0, 0.5, 0.25, 0.5, 7.0], [9.0, 0.1, 0.2, 0.3, 0.4, 0.5]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    adv, tgt = functional.token_gae(
        reward, value, mask, gamma=1.0, lmbda=0.5, bootstrap_value=torch.tensor([0.0, 2.0])
    )
    # Row 0: deltas = [0.25-0.5, 0.5-0.25, 1-0.5] = [-0.25, 0.25, 0.5]; A = [-0.25+0.5*0.5, 0.25+0.5*0.5, 0.5]
    assert torch.allclose(adv[0], torch.tensor([0, 0, -0.25 + 0.5 * 0.5, 0.5, 0.5, 0]))
    assert torch.allclose(tgt[0], torch.tensor([0, 0, 0.5, 0.75, 1.0, 0]))
    # Row 1: last delta = 0 + 2.0 - 0.5 = 1.5, others 0.1 each -> A_t = 0.1 + 0.5 A_{t+1}
    a4 = 1.5
    a3 = 0.1 + 0.5 * a4
    assert torch.allclose(adv[1, 4:], torch.tensor([a3, a4]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("length", [5, 16, 1203])
@pytest.mark.parametrize("gamma,lmbda", [(1.0, 0.95), (0.99, 0.5), (0.02, 0.5), (0.9, 0.01)])
def test_token_gae_blocked_path_contiguous_rows(dtype, length, gamma, lmbda):
    """Contiguous rows (no compaction) with one batch-wide c = gamma * lmbda < 1: blocks of Toeplitz
    matmuls, a padded last block for ragged lengths, weights below eps**2 dropped for small c."""
    reward, value, mask = _ragged(5, B=6, L=length, gaps=False, dtype=dtype)
    boot = torch.randn(6, dtype=dtype, generator=torch.Generator().manual_seed(1))
    assert functional.check_gae_inputs(reward, value, mask)  # contiguous: the layout is used as is
    reward_t = reward.T.contiguous().T  # a non-contiguous layout
    adv, tgt = functional.token_gae(
        reward_t, value, mask, gamma=gamma, lmbda=lmbda, bootstrap_value=boot
    )
    ref_adv, ref_tgt = gae_loop(reward, value, mask, gamma, lmbda, bootstrap=boot)
    assert adv.dtype == dtype and tgt.dtype == dtype
    assert torch.allclose(adv.double(), ref_adv, **TOL[dtype])
    assert torch.allclose(tgt.double(), ref_tgt, **TOL[dtype])
    assert (adv[~mask] == 0).all() and (tgt[~mask] == 0).all()


def test_token_gae_all_masked_row_and_zero_length():
    reward = torch.zeros(2, 4)
    mask = torch.zeros(2, 4, dtype=torch.bool)
    mask[1, 2:] = True
    reward[1, 3] = 1.0
    adv, tgt = functional.token_gae(reward, torch.zeros(2, 4), mask, gamma=1.0, lmbda=1.0)
    assert adv[0].abs().sum() == 0 and tgt[0].abs().sum() == 0
    assert adv[1].tolist() == [0.0, 0.0, 1.0, 1.0]
    empty = torch.zeros(3, 0)
    a, t = functional.token_gae(empty, empty, empty.bool(), gamma=1.0, lmbda=0.9)
    assert a.shape == (3, 0) and t.shape == (3, 0)


def test_token_gae_errors():
    r = torch.zeros(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"value has shape \(2, 4\) but reward has shape \(2, 3\)"):
        functional.token_gae(r, torch.zeros(2, 4), m, gamma=1.0, lmbda=0.9)
    with pytest.raises(ValueError, match=r"squeeze the trailing feature dim"):
        functional.token_gae(
            r.unsqueeze(-1), r.unsqueeze(-1), m.unsqueeze(-1), gamma=1.0, lmbda=0.9
        )
    bad = r.clone()
    bad[1, 0] = 2.0
    m2 = m.clone()
    m2[1, 0] = False
    with pytest.raises(
        ValueError,
        match=r"1 non-zero reward\(s\) on masked tokens \(first at row 1, position 0, reward 2\)",
    ):
        functional.token_gae(bad, r, m2, gamma=1.0, lmbda=0.9)
    with pytest.raises(ValueError, match=r"lmbda must be in \[0, 1\]"):
        functional.token_gae(r, r, m, gamma=1.0, lmbda=1.5)
    with pytest.raises(ValueError, match=r"token_gae: gamma must be >= 0 and <= 1, got 2"):
        functional.token_gae(r, r, m, gamma=2, lmbda=0.5)
    with pytest.raises(TypeError, match="mask must be a bool tensor"):
        functional.token_gae(r, r, m.float(), gamma=1.0, lmbda=0.9)
    with pytest.raises(ValueError, match=r"bootstrap_value must have shape \[B\]=\(2,\)"):
        functional.token_gae(r, r, m, gamma=1.0, lmbda=0.9, bootstrap_value=torch.zeros(3))


@pytest.mark.parametrize("scale", [True, False])
def test_grpo_advantage_matches_loop(scale):
    g = torch.Generator().manual_seed(0)
    reward = torch.randint(0, 2, (24,), generator=g).float() * 2 - 1
    group = torch.randint(0, 6, (24,), generator=g)
    adv, flat = functional.grpo_advantage(reward, group, scale=scale)
    ref = grpo_loop(reward, group, scale=scale)
    assert torch.allclose(adv.double(), ref, atol=1e-6)
    for i in range(24):
        same = reward[group == group[i]]
        assert bool(flat[i]) == bool((same == same[0]).all())


def test_grpo_advantage_errors():
    with pytest.raises(
        ValueError, match=r"expects seq_reward \[B\] and group_id \[B\], got \(2, 1\) and \(2,\)"
    ):
        functional.grpo_advantage(torch.zeros(2, 1), torch.zeros(2, dtype=torch.long))
    with pytest.raises(TypeError, match="group_id must be an integer tensor"):
        functional.grpo_advantage(torch.zeros(2), torch.zeros(2))


def test_masked_reductions():
    x = torch.tensor([[1.0, 2.0, float("inf")], [3.0, float("nan"), 5.0]])
    m = torch.tensor([[True, True, False], [True, False, True]])
    assert functional.masked_mean(x, m).item() == pytest.approx(11 / 4)
    assert functional.masked_mean(x, m, dim=-1).tolist() == [1.5, 4.0]
    w = functional.masked_whiten(x, m)
    vals = torch.tensor([1.0, 2.0, 3.0, 5.0])
    assert torch.allclose(w[m], (vals - vals.mean()) / vals.std(), atol=1e-6)  # unbiased std
    assert (w[~m] == 0).all()
    with pytest.raises(ValueError, match=r"mask has shape \(3,\) but x has shape \(2, 3\)"):
        functional.masked_mean(x, torch.ones(3, dtype=torch.bool))


@pytest.mark.parametrize("mode", functional.AGGREGATION_MODES)
def test_aggregate_loss_matches_loop(mode):
    g = torch.Generator().manual_seed(1)
    mask = random_trajectory_masks(9, 17, g)
    mask[3] = False  # an all-masked row
    loss = torch.randn(9, 17, generator=g)
    loss[~mask] = float("nan")  # garbage that must not leak
    got = functional.aggregate_loss(loss, mask, mode, norm_length=20)
    assert got.item() == pytest.approx(aggregate_loop(loss, mask, mode, norm_length=20), abs=1e-6)


def test_aggregate_loss_errors():
    m = torch.ones(2, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'bogus'"):
        functional.aggregate_loss(torch.zeros(2, 2), m, "bogus")
    with pytest.raises(ValueError, match="needs a positive constant `norm_length`"):
        functional.aggregate_loss(torch.zeros(2, 2), m, "seq_mean_token_sum_norm")


def test_clipped_surrogate_and_value_loss_against_loops():
    g = torch.Generator().manual_seed(2)
    lp, old, adv = (torch.randn(4, 6, generator=g) * 0.3 for _ in range(3))
    v, old_v, tgt = (torch.randn(4, 6, generator=g) for _ in range(3))
    m = torch.rand(4, 6, generator=g) > 0.3
    loss, ratio, clipped = functional.clipped_surrogate(
        lp, old, adv, m, clip_low=0.2, clip_high=0.28, dual_clip=3.0
    )
    vloss, vclip = functional.clipped_value_loss(v, old_v, tgt, m, clip_value=0.2)
    for b in range(4):
        for t in range(6):
            if not m[b, t]:
                assert loss[b, t] == 0 and vloss[b, t] == 0 and not clipped[b, t]
                continue
            r = float(torch.exp(lp[b, t] - old[b, t]))
            a = float(adv[b, t])
            pg = max(-r * a, -min(max(r, 0.8), 1.28) * a)
            if a < 0:
                pg = min(pg, -3.0 * a)
            assert float(loss[b, t]) == pytest.approx(pg, rel=1e-6, abs=1e-6)
            vc = float(old_v[b, t]) + min(max(float(v[b, t] - old_v[b, t]), -0.2), 0.2)
            ref_v = 0.5 * max(
                (float(v[b, t]) - float(tgt[b, t])) ** 2, (vc - float(tgt[b, t])) ** 2
            )
            assert float(vloss[b, t]) == pytest.approx(ref_v, rel=1e-6, abs=1e-6)


def test_masked_positions_get_exactly_zero_gradient():
    g = torch.Generator().manual_seed(3)
    m = torch.rand(3, 8, generator=g) > 0.4
    lp = torch.randn(3, 8, generator=g).requires_grad_()
    v = torch.randn(3, 8, generator=g).requires_grad_()
    old = torch.where(m, lp.detach() + 0.1, float("inf"))  # inf garbage where masked
    adv = torch.where(m, torch.randn(3, 8, generator=g), float("nan"))
    pg, _, _ = functional.clipped_surrogate(lp, old, adv, m, clip_low=0.2, clip_high=0.2)
    vl, _ = functional.clipped_value_loss(v, torch.zeros(3, 8), torch.ones(3, 8), m, clip_value=0.2)
    kl = functional.k3_kl(lp, torch.zeros(3, 8), m)
    total = sum(functional.aggregate_loss(x, m, "token_mean") for x in (pg, vl, kl))
    total.backward()
    assert torch.isfinite(total)
    assert (lp.grad[~m] == 0).all() and (v.grad[~m] == 0).all()
    assert (lp.grad[m] != 0).any() and (v.grad[m] != 0).any()


def test_length_adaptive_lmbda():
    assert functional.length_adaptive_lmbda(
        torch.tensor([1, 20, 200]), alpha=0.05
    ).tolist() == pytest.approx([0.0, 0.0, 0.9])
    with pytest.raises(ValueError, match="alpha must be > 0"):
        functional.length_adaptive_lmbda(torch.tensor([1]), alpha=0)


# ----------------------------------------------------------------------------- issue 9 hardening
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("seed", range(3))
def test_masked_whiten_unbiased_matches_loop(seed, dtype):
    """Bessel-corrected (n - 1) variance, as verl, TRL, NeMo-RL and TorchRL's ClipPPOLoss."""
    g = torch.Generator().manual_seed(seed)
    mask = random_trajectory_masks(5, 11, g)
    x = (torch.randn(5, 11, generator=g) * 3 + 1).to(dtype)
    x[~mask] = float("nan")  # garbage that must not leak
    got = functional.masked_whiten(x, mask)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    assert torch.allclose(got.double(), whiten_loop(x, mask), atol=tol, rtol=0)
    one = torch.zeros(5, 11, dtype=torch.bool)
    one[2, 3] = True  # a single trained element: variance 0, whitened value 0 (never NaN)
    assert functional.masked_whiten(torch.ones(5, 11, dtype=dtype), one).abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_explained_variance_matches_loop_and_is_always_finite(dtype):
    g = torch.Generator().manual_seed(4)
    mask = random_trajectory_masks(6, 9, g)
    target = torch.randn(6, 9, generator=g).to(dtype)
    value = (target + 0.3 * torch.randn(6, 9, generator=g)).to(dtype)
    got = functional.explained_variance(value, target, mask).item()
    assert got == pytest.approx(explained_variance_loop(value, target, mask), abs=1e-5)
    const = torch.full_like(target, 0.1)  # Var[target] == 0 (0.1's mean has rounding error)
    one = torch.zeros_like(mask)
    one[1, 4] = True
    cases = [
        (value, const, mask, 0.0),  # constant target, varying values: was -inf
        (const - 0.5, const, mask, 1.0),  # constant target, constant residual
        (value, target, one, 1.0),  # one trained token: was nan
        (value, target, torch.zeros_like(mask), 0.0),  # no trained token
    ]
    for v, t, m, expected in cases:
        out = functional.explained_variance(v, t, m)
        assert torch.isfinite(out) and out.item() == expected
        assert explained_variance_loop(v, t, m) == pytest.approx(expected)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_rewards_are_errors_naming_row_and_position(bad):
    reward, value, mask = _ragged(2, B=4, L=10, gaps=False)
    pos = int(mask[2].nonzero()[0])
    reward[2, pos] = bad
    with pytest.raises(
        ValueError,
        match=rf"token_gae: non-finite reward {bad} at row 2, position {pos} \(1 of 4 rows",
    ):
        functional.token_gae(reward, value, mask, gamma=1.0, lmbda=0.95)
    masked = torch.zeros(4, 10)
    masked[3, 0] = bad  # also on a masked token (not reported as a mere "non-zero" reward)
    with pytest.raises(ValueError, match=r"non-finite reward .* at row 3, position 0"):
        functional.token_gae(masked, value, mask, gamma=1.0, lmbda=0.95)
    seq = torch.tensor([1.0, -1.0, bad, 1.0])
    with pytest.raises(
        ValueError, match=rf"grpo_advantage: non-finite sequence reward {bad} at row 2 \("
    ):
        functional.grpo_advantage(seq, torch.tensor([0, 0, 1, 1]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_clipped_surrogate_matches_loop_over_extreme_log_ratios(dtype, dual_clip):
    """Log-ratios from -120 to 120 (float32's exp overflows above ~88.7): clamped to +-20 as verl."""
    g = torch.Generator().manual_seed(5)
    old = torch.randn(6, 40, generator=g).to(dtype)
    lp = (old + torch.linspace(-120, 120, 40)).to(dtype)
    adv = torch.randn(6, 40, generator=g).to(dtype)
    adv[0] = 0.0  # advantage 0 with an overflowing ratio: inf * 0 was NaN
    mask = torch.rand(6, 40, generator=g) > 0.2
    lp.requires_grad_()
    loss, ratio, _ = functional.clipped_surrogate(
        lp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=dual_clip
    )
    ref = surrogate_loop(lp.detach(), old, adv, mask, 0.2, 0.28, dual_clip)
    assert torch.allclose(
        loss.double(), ref, rtol=1e-6 if dtype == torch.float64 else 1e-5, atol=1e-6
    )
    functional.aggregate_loss(loss, mask, "token_mean").backward()
    assert torch.isfinite(loss).all() and torch.isfinite(lp.grad).all()
    assert (lp.grad[0] == 0).all()  # advantage 0: zero gradient, not NaN
    assert torch.isfinite(ratio).all() and float(ratio.detach().max()) == pytest.approx(
        math.exp(20.0), rel=1e-5
    )


def test_clamp_changes_nothing_inside_the_range():
    g = torch.Generator().manual_seed(6)
    lp, old, adv = (torch.randn(4, 16, generator=g) * 3 for _ in range(3))
    mask = torch.ones(4, 16, dtype=torch.bool)
    assert float((lp - old).abs().max()) < functional.LOG_RATIO_CLAMP
    loss, ratio, _ = functional.clipped_surrogate(lp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    raw = torch.exp(lp - old)
    assert torch.equal(ratio, raw)
    assert torch.equal(loss, torch.maximum(-raw * adv, -raw.clamp(0.8, 1.2) * adv))
    assert torch.equal(functional.masked_log_ratio(lp, old, mask), lp - old)
    kl = functional.k3_kl(lp, old, mask, clamp=1e9)
    ref = torch.exp(old - lp) - (old - lp) - 1
    assert torch.equal(kl, ref.clamp(0.0, 1e9))


@pytest.mark.parametrize(
    ("name", "home"),
    [
        ("clipped_surrogate", "policy_losses"),
        ("masked_log_ratio", "policy_losses"),
        ("pessimistic_clip", "policy_losses"),
        ("LOG_RATIO_CLAMP", "policy_losses"),
        ("k3_kl", "kl"),
    ],
)
def test_names_that_left_functional_losses_keep_an_alias_for_one_release(name, home):
    import importlib

    from ar_torchrl.functional import losses

    with pytest.warns(
        DeprecationWarning, match=rf"losses\.{name} is now ar_torchrl\.functional\.{home}\.{name}"
    ):
        old = getattr(losses, name)
    assert old is getattr(importlib.import_module(f"ar_torchrl.functional.{home}"), name)
    with pytest.raises(AttributeError, match="has no attribute 'clipped_surogate'"):
        losses.clipped_surogate  # noqa: B018
