"""Policy-loss variants (ar_torchrl.functional.policy_losses, the POLICY_LOSSES registry,
TokenPPOLoss(policy_loss=...)): autograd's gradient w.r.t. the log-probs equals each paper's closed
form, masked tokens get exactly zero gradient, the expected gradient on an enumerated categorical
policy is the policy gradient, and the losses agree with verl's and TRL's code (transcribed below,
citing file and commit)."""

from __future__ import annotations

import pytest
import torch
from support.trajectories import tiny_batch

from ar_torchrl.functional import aggregate_loss, cispo_surrogate, gspo_surrogate
from ar_torchrl.objectives import make_policy_loss, policy_loss_names

F64 = torch.float64


def batch(seed: int, B: int = 8, L: int = 7, spread: float = 0.3, row_adv: bool = True):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, L, generator=g) < 0.7
    mask[0] = True
    mask[1, :] = False  # a row without trained tokens
    mask[1, 0] = False
    mask[2, 3] = True
    old = -torch.rand(B, L, generator=g, dtype=F64) * 3
    lp = (old + spread * torch.randn(B, L, generator=g, dtype=F64)).requires_grad_(True)
    adv = torch.randn(B, 1 if row_adv else L, generator=g, dtype=F64).expand(B, L).clone()
    return lp, old, adv, mask


def call(fn, lp, old, adv, mask, clip_low: float = 0.2, clip_high: float = 0.2):
    """A registered loss function, called as TokenPPOLoss calls it: ``(loss, metrics)``."""
    return fn(lp, old, adv, mask, clip_low=clip_low, clip_high=clip_high, dual_clip=None)


def grad_of(loss: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, lp, retain_graph=True)
    return g


# ----------------------------------------------------------------------------- closed forms
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("row_adv", [True, False])
def test_gspo_sequence_gradient_is_the_closed_form(seed, row_adv):
    lp, old, adv, mask = batch(seed, row_adv=row_adv)
    cl, ch = 0.01, 0.015
    loss, ratio, clipped = gspo_surrogate(lp, old, adv, mask, clip_low=cl, clip_high=ch)
    total = aggregate_loss(loss, mask, "seq_mean_token_mean")
    g = grad_of(total, lp)
    rows = mask.any(-1)
    expect = torch.zeros_like(g)
    for b in range(lp.shape[0]):
        n = int(mask[b].sum())
        if n == 0:
            continue
        s = torch.exp(sum(lp[b, t] - old[b, t] for t in range(lp.shape[1]) if mask[b, t]) / n)
        a = sum(adv[b, t] for t in range(lp.shape[1]) if mask[b, t]) / n
        is_clipped = (a > 0 and s > 1 + ch) or (a < 0 and s < 1 - cl)
        assert bool(clipped[b][mask[b]].all()) == bool(is_clipped)
        for t in range(lp.shape[1]):
            if mask[b, t] and not is_clipped:
                expect[b, t] = -a * s / n / rows.sum()
        torch.testing.assert_close(ratio[b][mask[b]], s.detach().expand(n))
    torch.testing.assert_close(g, expect, atol=1e-12, rtol=1e-10)


def test_the_gspo_cases_exercise_both_branches():
    """The closed-form tests above see clipped and unclipped tokens (the clip band is tight)."""
    n_clipped = n_free = 0
    for seed in range(4):
        for row_adv in (True, False):
            for token_level in (False, True):
                lp, old, adv, mask = batch(seed, row_adv=row_adv)
                _, _, clipped = gspo_surrogate(
                    lp, old, adv, mask, clip_low=0.01, clip_high=0.015, token_level=token_level
                )
                n_clipped += int(clipped.sum())
                n_free += int((mask & ~clipped).sum())
    assert n_clipped > 50 and n_free > 50


@pytest.mark.parametrize("seed", range(4))
def test_gspo_token_gradient_is_the_closed_form_and_stays_on_its_token(seed):
    lp, old, adv, mask = batch(seed, row_adv=False)
    cl, ch = 0.01, 0.015
    loss, ratio, clipped = gspo_surrogate(
        lp, old, adv, mask, clip_low=cl, clip_high=ch, token_level=True
    )
    g = grad_of(aggregate_loss(loss, mask, "token_mean"), lp)
    n_tok = mask.sum()
    expect = torch.zeros_like(g)
    for b in range(lp.shape[0]):
        n = int(mask[b].sum())
        if n == 0:
            continue
        s = torch.exp(sum(lp[b, t] - old[b, t] for t in range(lp.shape[1]) if mask[b, t]) / n)
        for t in range(lp.shape[1]):
            if not mask[b, t]:
                continue
            a = adv[b, t]
            tok_clipped = (a > 0 and s > 1 + ch) or (a < 0 and s < 1 - cl)
            assert bool(clipped[b, t]) == bool(tok_clipped)
            if not tok_clipped:
                expect[b, t] = -a * s / n_tok
    torch.testing.assert_close(g, expect, atol=1e-12, rtol=1e-10)
    # sg[lp]: one token's loss has a gradient on that token only
    b, t = 0, 2
    g_one = grad_of(loss[b, t], lp)
    assert g_one[b, t] != 0 or clipped[b, t]
    g_one[b, t] = 0
    assert torch.count_nonzero(g_one) == 0


@pytest.mark.parametrize("seed", range(3))
def test_gspo_token_equals_gspo_for_one_advantage_per_sequence(seed):
    """The paper: with A constant over a sequence, GSPO-token's gradient is GSPO's."""
    lp, old, adv, mask = batch(seed, row_adv=True)
    grads = []
    for token_level in (False, True):
        loss, _, _ = gspo_surrogate(
            lp, old, adv, mask, clip_low=0.05, clip_high=0.08, token_level=token_level
        )
        grads.append(grad_of(aggregate_loss(loss, mask, "seq_mean_token_mean"), lp))
    torch.testing.assert_close(grads[0], grads[1], atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("weight_min", [None, 0.8])
def test_cispo_gradient_is_the_clipped_weight_times_advantage_on_every_token(seed, weight_min):
    lp, old, adv, mask = batch(seed, row_adv=False, spread=0.6)
    wmax = 1.3
    loss, weight, clipped = cispo_surrogate(
        lp, old, adv, mask, weight_max=wmax, weight_min=weight_min
    )
    g = grad_of(aggregate_loss(loss, mask, "token_mean"), lp)
    r = torch.exp(lp.detach() - old)
    w = r.clamp(min=weight_min, max=wmax)
    expect = torch.where(mask, -w * adv / mask.sum(), torch.zeros_like(w))
    torch.testing.assert_close(g, expect, atol=1e-12, rtol=1e-10)
    assert clipped.any()
    assert (g[clipped] != 0).all()  # the clipped tokens keep their gradient (CISPO's point)
    torch.testing.assert_close(weight[mask], w[mask])


def test_torchrl_cispo_gives_clipped_tokens_no_gradient_ours_does():
    """TorchRL 0.14's CISPOLoss (torchrl/objectives/llm/grpo.py, ``_compute_policy_objective``)
    clamps the log-weight without detaching: a clamped token has zero gradient. Pinned, so that a
    TorchRL fix shows up here; ours keeps ``-w A`` on it."""
    from torchrl.objectives.llm.grpo import CISPOLoss

    class _Bounds:  # the one attribute _compute_policy_objective reads
        _clip_bounds = (torch.log1p(torch.tensor(-0.2)), torch.log1p(torch.tensor(0.28)))

    log_weight = torch.tensor([[0.0, 1.0, -1.0]], dtype=F64, requires_grad=True)
    adv = torch.ones(1, 3, dtype=F64)
    gain, _ = CISPOLoss._compute_policy_objective(_Bounds(), log_weight, adv)
    (g_torchrl,) = torch.autograd.grad(gain.sum(), log_weight)
    assert g_torchrl[0, 1] == 0 and g_torchrl[0, 2] == 0 and g_torchrl[0, 0] != 0

    lp = log_weight.detach().clone().requires_grad_(True)
    loss, _, clipped = cispo_surrogate(
        lp,
        torch.zeros(1, 3, dtype=F64),
        adv,
        torch.ones(1, 3, dtype=torch.bool),
        weight_max=1.28,
        weight_min=0.8,
    )
    (g_ours,) = torch.autograd.grad(loss.sum(), lp)
    assert clipped.tolist() == [[False, True, True]]
    torch.testing.assert_close(g_ours, torch.tensor([[-1.0, -1.28, -0.8]], dtype=F64))


# ----------------------------------------------------------------------------- masking
@pytest.mark.parametrize("name", ["gspo", "gspo_token", "cispo"])
def test_masked_tokens_get_exactly_zero_gradient_whatever_they_hold(name):
    lp, old, adv, mask = batch(0, row_adv=False)
    garbage = lp.detach().clone()
    garbage[~mask] = float("nan")
    old = old.clone()
    old[~mask] = float("inf")
    adv = adv.clone()
    adv[~mask] = float("-inf")
    x = garbage.requires_grad_(True)
    fn = make_policy_loss(name)
    loss, metrics = call(fn, x, old, adv, mask)
    clipped = metrics["pg_clipfrac"]
    total = aggregate_loss(loss, mask, "token_mean")
    (g,) = torch.autograd.grad(total, x)
    assert torch.isfinite(total) and torch.isfinite(g).all()
    assert (g[~mask] == 0).all() and (loss[~mask] == 0).all() and not clipped[~mask].any()
    assert (g[mask] != 0).any()


# ----------------------------------------------------------------------------- categorical policy
V = 6


@pytest.mark.parametrize("seed", range(3))
def test_expected_gradients_on_an_enumerated_categorical_policy(seed):
    """One-token sequences from a categorical over V tokens, sampled by ``old``: the expected loss
    ``sum_x old(x) loss(x)`` is exact (no sampling). CISPO's expected gradient is
    ``-sum_x old(x) clip(w(x)) A(x) grad log pi(x)``; with a cap that never binds it is the policy
    gradient ``-grad E_pi[A]``, and so is GSPO's at ``pi = old`` (ratio 1, inside any band)."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(V, generator=g, dtype=F64).requires_grad_(True)
    old = torch.log_softmax(theta.detach() + 0.4 * torch.randn(V, generator=g, dtype=F64), -1)
    A = torch.randn(V, generator=g, dtype=F64)
    mask = torch.ones(V, 1, dtype=torch.bool)

    def expected(loss_fn, th):
        lp = torch.log_softmax(th, -1)
        loss, _ = call(loss_fn, lp[:, None], old[:, None], A[:, None], mask)
        return (old.exp() * loss[:, 0]).sum()

    lp = torch.log_softmax(theta, -1)
    (pg,) = torch.autograd.grad(-(lp.exp() * A).sum(), theta)  # -grad E_pi[A]
    for wmax in (1e6, 1.1):
        fn = make_policy_loss("cispo", {"weight_max": wmax})
        (gc,) = torch.autograd.grad(expected(fn, theta), theta)
        pi = lp.detach().exp()
        w = (pi / old.exp()).clamp(max=wmax)
        closed = -sum(
            old.exp()[x] * w[x] * A[x] * (torch.eye(V, dtype=F64)[x] - pi) for x in range(V)
        )
        torch.testing.assert_close(gc, closed, atol=1e-12, rtol=1e-10)
        if wmax == 1e6:
            torch.testing.assert_close(gc, pg, atol=1e-12, rtol=1e-10)
    theta_old = old.clone().requires_grad_(True)  # pi = old
    (pg_old,) = torch.autograd.grad(-(torch.softmax(theta_old, -1) * A).sum(), theta_old)
    for name in ("gspo", "gspo_token", "clip"):
        (gg,) = torch.autograd.grad(expected(make_policy_loss(name), theta_old), theta_old)
        torch.testing.assert_close(gg, pg_old, atol=1e-12, rtol=1e-10)


# ----------------------------------------------------------------------------- peers
def verl_gspo(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high):
    """verl ``compute_policy_loss_gspo`` (verl/trainer/ppo/core_algos.py, commit b178a3cd56f5),
    transcribed; ``agg_loss(..., "seq-mean-token-mean")`` written out."""
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = (
        log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    )
    log_seq_importance_ratio = torch.clamp(log_seq_importance_ratio, max=10.0)
    seq_importance_ratio = torch.exp(log_seq_importance_ratio)
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(
        seq_importance_ratio, 1 - clip_ratio_low, 1 + clip_ratio_high
    )
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    seq_losses = torch.sum(pg_losses * response_mask, dim=-1) / seq_lengths
    seq_mask = (torch.sum(response_mask, dim=-1) > 0).float()
    return (seq_losses * seq_mask).sum() / seq_mask.sum()


def verl_cispo(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high):
    """verl ``compute_policy_loss_cispo`` (same file and commit), token-mean aggregation."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    clipped_ratio_sg = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high).detach()
    pg_losses = -clipped_ratio_sg * advantages * log_prob
    return (pg_losses * response_mask).sum() / response_mask.sum()


def trl_loss(per_token_logps, old_per_token_logps, advantages, mask, loss_type, level, eps):
    """TRL ``GRPOTrainer._compute_loss`` (trl/trainer/grpo_trainer.py, commit f2cd57710ae3),
    transcribed for ``loss_type`` "grpo" / "cispo", ``importance_sampling_level`` "token" /
    "sequence", ``beta = 0``, one process, no accumulation; ``advantages`` is ``[B]``."""
    epsilon_low, epsilon_high = eps
    advantages = advantages.unsqueeze(1)
    log_ratio = per_token_logps - old_per_token_logps
    if level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        log_importance_weights = log_importance_weights.unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    if loss_type == "cispo":
        clamped_ratios = torch.clamp(coef_1, max=epsilon_high).detach()
        per_token_loss = -clamped_ratios * advantages * per_token_logps
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def same_loss_and_gradient(ours, theirs, lp) -> None:
    """Our aggregated loss equals the peer's, and so does its gradient w.r.t. the log-probs."""
    torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(grad_of(ours, lp), grad_of(theirs, lp), atol=1e-12, rtol=1e-10)


def peer_batch(seed: int):
    lp, old, adv, mask = batch(seed, spread=0.2)
    mask[1, :3] = True  # TRL averages over every row: give each row trained tokens
    return lp, old, adv, mask


@pytest.mark.parametrize("seed", range(3))
def test_gspo_token_matches_verl(seed):
    lp, old, adv, mask = peer_batch(seed)
    theirs = verl_gspo(old, lp, adv, mask.to(F64), 0.01, 0.02)
    loss, _, _ = gspo_surrogate(lp, old, adv, mask, clip_low=0.01, clip_high=0.02, token_level=True)
    ours = aggregate_loss(loss, mask, "seq_mean_token_mean")
    same_loss_and_gradient(ours, theirs, lp)


@pytest.mark.parametrize("seed", range(3))
def test_cispo_matches_verl_and_trl(seed):
    lp, old, adv, mask = peer_batch(seed)
    theirs = verl_cispo(old, lp, adv, mask.to(F64), 0.2, 0.28)
    loss, _, _ = cispo_surrogate(lp, old, adv, mask, weight_max=1.28, weight_min=0.8)
    ours = aggregate_loss(loss, mask, "token_mean")
    same_loss_and_gradient(ours, theirs, lp)
    row_adv = adv[:, 0]
    theirs = trl_loss(lp, old, row_adv, mask.to(F64), "cispo", "token", (0.2, 1.1))
    loss, _, _ = cispo_surrogate(lp, old, adv, mask, weight_max=1.1)
    ours = aggregate_loss(loss, mask, "token_mean")
    same_loss_and_gradient(ours, theirs, lp)


@pytest.mark.parametrize("seed", range(3))
def test_gspo_sequence_and_clip_match_trl(seed):
    lp, old, adv, mask = peer_batch(seed)
    row_adv = adv[:, 0]
    theirs = trl_loss(lp, old, row_adv, mask.to(F64), "grpo", "sequence", (0.01, 0.02))
    loss, _, _ = gspo_surrogate(lp, old, adv, mask, clip_low=0.01, clip_high=0.02)
    ours = aggregate_loss(loss, mask, "seq_mean_token_mean")
    same_loss_and_gradient(ours, theirs, lp)
    theirs = trl_loss(lp, old, row_adv, mask.to(F64), "grpo", "token", (0.2, 0.28))
    loss, _ = call(make_policy_loss("clip"), lp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    ours = aggregate_loss(loss, mask, "seq_mean_token_mean")
    torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=1e-10)


# ----------------------------------------------------------------------------- registry, loss
def test_registry_names_and_errors():
    assert policy_loss_names()[:4] == ("clip", "gspo", "gspo_token", "cispo")
    with pytest.raises(ValueError, match=r"unknown policy loss 'cipso' \(did you mean 'cispo'\?\)"):
        make_policy_loss("cipso")
    with pytest.raises(ValueError, match="dual_clip=3.0 is a clause of the clipped surrogate"):
        make_policy_loss("gspo", dual_clip=3.0)
    with pytest.raises(ValueError, match="weight_min=2.0 is above weight_max=1.5"):
        make_policy_loss("cispo", {"weight_max": 1.5, "weight_min": 2.0})
    with pytest.raises(ValueError, match=r"policy loss 'gspo' has no option 'clip_hi'"):
        make_policy_loss("gspo", {"clip_hi": 0.1})


@pytest.mark.parametrize("name", ["clip", "gspo", "gspo_token", "cispo"])
def test_token_ppo_loss_uses_the_registered_policy_loss(name):
    from ar_torchrl.objectives import TokenPPOLoss

    ac, td = tiny_batch(seed=0)
    options = {"clip_low": 0.05, "clip_high": 0.05} if name.startswith("gspo") else None
    loss_fn = TokenPPOLoss(
        ac, policy_loss=name, policy_loss_options=options, loss_agg_mode="seq_mean_token_mean"
    )
    out = loss_fn(td)
    mask = td["loss_mask"]
    lp = ac(td.select(*ac.in_keys))["log_prob"].detach()
    fn = make_policy_loss(name, options)
    expect, metrics = call(fn, lp, td["sample_log_prob"], td["advantage"].squeeze(-1), mask)
    torch.testing.assert_close(
        out["loss_objective"].detach(), aggregate_loss(expect, mask, "seq_mean_token_mean")
    )
    assert out["pg_clipfrac"] == metrics["pg_clipfrac"][mask].float().mean()
    assert "loss_critic" in out.keys()
    out["loss_objective"].backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in ac.parameters())


def _private_registry(monkeypatch):
    """Registrations in this test stay in it (the registry's entries are restored afterwards)."""
    from ar_torchrl.objectives import POLICY_LOSSES

    monkeypatch.setattr(POLICY_LOSSES, "_entries", dict(POLICY_LOSSES._entries))
    return POLICY_LOSSES


def test_token_ppo_loss_calls_the_registered_loss_with_the_clip_range_of_the_moment(monkeypatch):
    from ar_torchrl.objectives import TokenPPOLoss, register_policy_loss

    _private_registry(monkeypatch)
    clip, calls = make_policy_loss("clip"), []

    @register_policy_loss("recording")
    def _recording():
        def fn(log_prob, old_log_prob, advantage, mask, *, clip_low, clip_high, dual_clip):
            calls.append((clip_low, clip_high, dual_clip))
            loss, metrics = clip(
                log_prob,
                old_log_prob,
                advantage,
                mask,
                clip_low=clip_low,
                clip_high=clip_high,
                dual_clip=dual_clip,
            )
            return loss, {**metrics, "tokens_seen": mask.clone()}

        return fn

    ac, td = tiny_batch(seed=0)
    loss_fn = TokenPPOLoss(ac, policy_loss="recording", clip_epsilon=(0.2, 0.28))
    out = loss_fn(td)
    loss_fn.clip_epsilon = 0.1  # scheduled: the next call gets the new range
    loss_fn(td)
    assert calls == [
        (pytest.approx(0.2), pytest.approx(0.28), None),
        (pytest.approx(0.1), pytest.approx(0.1), None),
    ]
    assert out["tokens_seen"].item() == 1.0  # a loss's own metric is reported (a mean over T)
    builtin = TokenPPOLoss(ac, clip_epsilon=(0.2, 0.28))(td)
    for key in ("loss_objective", "pg_clipfrac", "clip_fraction"):
        torch.testing.assert_close(out[key], builtin[key], msg=key)


def test_the_default_clip_is_the_registered_clip_entry(monkeypatch):
    from ar_torchrl.objectives import TokenPPOLoss, register_policy_loss
    from ar_torchrl.objectives.policy_loss import ClipConfig

    registry = _private_registry(monkeypatch)
    ac, td = tiny_batch(seed=1)
    before = TokenPPOLoss(ac, dual_clip=3.0)(td)
    clip = make_policy_loss("clip", dual_clip=3.0)
    del registry._entries["clip"]

    @register_policy_loss("clip", config=ClipConfig)
    def _doubled(options):
        def fn(log_prob, old_log_prob, advantage, mask, **clip_range):
            loss, metrics = clip(log_prob, old_log_prob, advantage, mask, **clip_range)
            return 2 * loss, {**metrics, "pg_clipfrac": torch.ones_like(mask)}

        return fn

    after = TokenPPOLoss(ac, dual_clip=3.0)(td)
    torch.testing.assert_close(after["loss_objective"], 2 * before["loss_objective"])
    assert after["pg_clipfrac"].item() == 1.0 != before["pg_clipfrac"].item()
    assert after["pg_clipfrac_lower"] == before["pg_clipfrac_lower"]
