"""ar_torchrl.functional against plain loops, hand-computed cases and TorchRL's own GAE."""

from __future__ import annotations

import pytest
import torch
from reference import aggregate_loop, gae_loop, grpo_loop, random_trajectory_masks
from torchrl.objectives.value.functional import generalized_advantage_estimate

from ar_torchrl import functional as F


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
    adv, tgt = F.token_gae(reward, value, mask, gamma=gamma, lmbda=lmbda, critic_lmbda=critic_lmbda)
    ref_adv, ref_tgt = gae_loop(reward, value, mask, gamma, lmbda, critic_lmbda)
    assert adv.dtype == dtype and tgt.dtype == dtype
    assert torch.allclose(adv.double(), ref_adv, **TOL[dtype])
    assert torch.allclose(tgt.double(), ref_tgt, **TOL[dtype])
    assert (adv[~mask] == 0).all() and (tgt[~mask] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("gaps", [True, False])
@pytest.mark.parametrize("gamma,lmbda", [(0.9, 0.3), (1.0, 0.95)])
def test_token_gae_long_rows_go_through_chunks(gaps, dtype, gamma, lmbda):
    """Long rows go through several chunks (c**n would leave the dtype's range in one)."""
    reward, value, mask = _ragged(7, B=3, L=3000, gaps=gaps, dtype=dtype)
    adv, tgt = F.token_gae(reward, value, mask, gamma=gamma, lmbda=lmbda)
    ref_adv, ref_tgt = gae_loop(reward, value, mask, gamma, lmbda)
    if dtype == torch.float32 or lmbda < 0.5:
        assert F._chunk_size(torch.tensor([[gamma * lmbda]]), 3000, dtype) < 3000
    tol = TOL[dtype] if dtype == torch.float64 else {"atol": 1e-4, "rtol": 1e-4}
    assert torch.allclose(adv.double(), ref_adv, **tol)
    assert torch.allclose(tgt.double(), ref_tgt, **tol)


@pytest.mark.parametrize("gaps", [True, False])
def test_token_gae_per_row_lambda_and_bootstrap(gaps):
    reward, value, mask = _ragged(3, gaps=gaps)
    lam = torch.linspace(0.0, 1.0, reward.shape[0])
    boot = torch.randn(reward.shape[0])
    adv, tgt = F.token_gae(reward, value, mask, gamma=0.97, lmbda=lam, bootstrap_value=boot)
    ref_adv, ref_tgt = gae_loop(reward, value, mask, 0.97, lam, bootstrap=boot)
    assert torch.allclose(adv.double(), ref_adv, atol=1e-6, rtol=0)
    assert torch.allclose(tgt.double(), ref_tgt, atol=1e-6, rtol=0)


@pytest.mark.parametrize("lmbda", [0.95, 1.0])
def test_token_gae_equals_torchrl_on_each_generated_segment(lmbda):
    """Per row, TorchRL's GAE on the generated segment (time = last dim) gives the same numbers."""
    reward, value, mask = _ragged(11, gaps=False, dtype=torch.float32)
    adv, tgt = F.token_gae(reward, value, mask, gamma=0.99, lmbda=lmbda)
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
    adv, tgt = F.token_gae(
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
    """Contiguous rows with one batch-wide c = gamma * lmbda < 1 go through blocks of Toeplitz
    matmuls (fewer tokens per block for small c, a padded last block for ragged lengths)."""
    reward, value, mask = _ragged(5, B=6, L=length, gaps=False, dtype=dtype)
    boot = torch.randn(6, dtype=dtype, generator=torch.Generator().manual_seed(1))
    c = gamma * lmbda
    assert F._rows_are_contiguous(mask) and F._block_size(c) >= F._MIN_BLOCK
    reward_t = reward.T.contiguous().T  # a non-contiguous layout
    adv, tgt = F.token_gae(reward_t, value, mask, gamma=gamma, lmbda=lmbda, bootstrap_value=boot)
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
    adv, tgt = F.token_gae(reward, torch.zeros(2, 4), mask, gamma=1.0, lmbda=1.0)
    assert adv[0].abs().sum() == 0 and tgt[0].abs().sum() == 0
    assert adv[1].tolist() == [0.0, 0.0, 1.0, 1.0]
    empty = torch.zeros(3, 0)
    a, t = F.token_gae(empty, empty, empty.bool(), gamma=1.0, lmbda=0.9)
    assert a.shape == (3, 0) and t.shape == (3, 0)


def test_token_gae_errors():
    r = torch.zeros(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"value has shape \(2, 4\) but reward has shape \(2, 3\)"):
        F.token_gae(r, torch.zeros(2, 4), m, gamma=1.0, lmbda=0.9)
    with pytest.raises(ValueError, match=r"squeeze the trailing feature dim"):
        F.token_gae(r.unsqueeze(-1), r.unsqueeze(-1), m.unsqueeze(-1), gamma=1.0, lmbda=0.9)
    bad = r.clone()
    bad[1, 0] = 2.0
    m2 = m.clone()
    m2[1, 0] = False
    with pytest.raises(
        ValueError,
        match=r"1 non-zero reward\(s\) on masked tokens \(first at row 1, position 0, reward 2\)",
    ):
        F.token_gae(bad, r, m2, gamma=1.0, lmbda=0.9)
    with pytest.raises(ValueError, match=r"lmbda must be in \[0, 1\]"):
        F.token_gae(r, r, m, gamma=1.0, lmbda=1.5)
    with pytest.raises(ValueError, match=r"gamma must be in \[0, 1\], got 2"):
        F.token_gae(r, r, m, gamma=2, lmbda=0.5)
    with pytest.raises(TypeError, match="mask must be a bool tensor"):
        F.token_gae(r, r, m.float(), gamma=1.0, lmbda=0.9)
    with pytest.raises(ValueError, match=r"bootstrap_value must have shape \[B\]=\(2,\)"):
        F.token_gae(r, r, m, gamma=1.0, lmbda=0.9, bootstrap_value=torch.zeros(3))


@pytest.mark.parametrize("scale", [True, False])
def test_grpo_advantage_matches_loop(scale):
    g = torch.Generator().manual_seed(0)
    reward = torch.randint(0, 2, (24,), generator=g).float() * 2 - 1
    group = torch.randint(0, 6, (24,), generator=g)
    adv, flat = F.grpo_advantage(reward, group, scale=scale)
    ref = grpo_loop(reward, group, scale=scale)
    assert torch.allclose(adv.double(), ref, atol=1e-6)
    for i in range(24):
        same = reward[group == group[i]]
        assert bool(flat[i]) == bool((same == same[0]).all())


def test_grpo_advantage_errors():
    with pytest.raises(
        ValueError, match=r"expects seq_reward \[B\] and group_id \[B\], got \(2, 1\) and \(2,\)"
    ):
        F.grpo_advantage(torch.zeros(2, 1), torch.zeros(2, dtype=torch.long))
    with pytest.raises(TypeError, match="group_id must be an integer tensor"):
        F.grpo_advantage(torch.zeros(2), torch.zeros(2))


def test_masked_reductions():
    x = torch.tensor([[1.0, 2.0, float("inf")], [3.0, float("nan"), 5.0]])
    m = torch.tensor([[True, True, False], [True, False, True]])
    assert F.masked_mean(x, m).item() == pytest.approx(11 / 4)
    assert F.masked_mean(x, m, dim=-1).tolist() == [1.5, 4.0]
    w = F.masked_whiten(x, m)
    vals = torch.tensor([1.0, 2.0, 3.0, 5.0])
    assert torch.allclose(w[m], (vals - vals.mean()) / vals.var(unbiased=False).sqrt(), atol=1e-6)
    assert (w[~m] == 0).all()
    with pytest.raises(ValueError, match=r"mask has shape \(3,\) but x has shape \(2, 3\)"):
        F.masked_mean(x, torch.ones(3, dtype=torch.bool))


@pytest.mark.parametrize("mode", F.AGGREGATION_MODES)
def test_aggregate_loss_matches_loop(mode):
    g = torch.Generator().manual_seed(1)
    mask = random_trajectory_masks(9, 17, g)
    mask[3] = False  # an all-masked row
    loss = torch.randn(9, 17, generator=g)
    loss[~mask] = float("nan")  # garbage that must not leak
    got = F.aggregate_loss(loss, mask, mode, norm_length=20)
    assert got.item() == pytest.approx(aggregate_loop(loss, mask, mode, norm_length=20), abs=1e-6)


def test_aggregate_loss_errors():
    m = torch.ones(2, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'bogus'"):
        F.aggregate_loss(torch.zeros(2, 2), m, "bogus")
    with pytest.raises(ValueError, match="needs a positive constant `norm_length`"):
        F.aggregate_loss(torch.zeros(2, 2), m, "seq_mean_token_sum_norm")


def test_clipped_surrogate_and_value_loss_against_loops():
    g = torch.Generator().manual_seed(2)
    lp, old, adv = (torch.randn(4, 6, generator=g) * 0.3 for _ in range(3))
    v, old_v, tgt = (torch.randn(4, 6, generator=g) for _ in range(3))
    m = torch.rand(4, 6, generator=g) > 0.3
    loss, ratio, clipped = F.clipped_surrogate(
        lp, old, adv, m, clip_low=0.2, clip_high=0.28, dual_clip=3.0
    )
    vloss, vclip = F.clipped_value_loss(v, old_v, tgt, m, clip_value=0.2)
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
    pg, _, _ = F.clipped_surrogate(lp, old, adv, m, clip_low=0.2, clip_high=0.2)
    vl, _ = F.clipped_value_loss(v, torch.zeros(3, 8), torch.ones(3, 8), m, clip_value=0.2)
    kl = F.k3_kl(lp, torch.zeros(3, 8), m)
    total = sum(F.aggregate_loss(x, m, "token_mean") for x in (pg, vl, kl))
    total.backward()
    assert torch.isfinite(total)
    assert (lp.grad[~m] == 0).all() and (v.grad[~m] == 0).all()
    assert (lp.grad[m] != 0).any() and (v.grad[m] != 0).any()


def test_length_adaptive_lmbda():
    assert F.length_adaptive_lmbda(
        torch.tensor([1, 20, 200]), alpha=0.05
    ).tolist() == pytest.approx([0.0, 0.0, 0.9])
    with pytest.raises(ValueError, match="alpha must be > 0"):
        F.length_adaptive_lmbda(torch.tensor([1]), alpha=0)
