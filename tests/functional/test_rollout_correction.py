"""Rollout correction (ar_torchrl.functional.rollout_correction, RolloutCorrection presets,
TokenPPOLoss(rollout_correction=...)): weights and masks against a plain loop and against verl's
rollout_corr_helper.py (transcribed, citing file and commit), the value loss untouched, mismatch
metrics whenever the batch has rollout_log_prob, and the errors."""

from __future__ import annotations

import math

import pytest
import torch

from ar_torchrl.functional import rollout_correction, rollout_mismatch_metrics
from ar_torchrl.objectives import ROLLOUT_CORRECTION_PRESETS, RolloutCorrection, TokenPPOLoss

F64 = torch.float64


def data(seed: int, B: int = 9, L: int = 6, spread: float = 0.6):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, L, generator=g) < 0.75
    mask[0] = False  # a row without trained tokens
    mask[1] = True
    old = -torch.rand(B, L, generator=g, dtype=F64) * 2
    roll = old + spread * torch.randn(B, L, generator=g, dtype=F64)
    roll[2] = old[2]  # an exact row
    return old, roll, mask


def loop(old, roll, mask, is_level, is_cap, mask_mode, low, high):
    """The module docstring, one token at a time."""
    B, L = old.shape
    weight = [[1.0] * L for _ in range(B)]
    capped = []
    keep = [[bool(mask[b, t]) for t in range(L)] for b in range(B)]
    for b in range(B):
        ts = [t for t in range(L) if mask[b, t]]
        if not ts:
            continue
        lrs = {t: float(old[b, t] - roll[b, t]) for t in ts}
        seq = max(-20.0, min(20.0, sum(lrs.values())))
        for t in ts:
            if is_level is not None:
                raw = math.exp(lrs[t] if is_level == "token" else seq)
                weight[b][t] = min(raw, is_cap)
                capped.append(raw > is_cap)
            if mask_mode is not None:
                ratio = {
                    "token": math.exp(lrs[t]),
                    "sequence": math.exp(seq),
                    "geometric": math.exp(sum(lrs.values()) / len(ts)),
                }[mask_mode]
                keep[b][t] = (low is None or ratio >= low) and (high is None or ratio <= high)
    capped_fraction = sum(capped) / len(capped) if capped else None
    return torch.tensor(weight, dtype=F64), torch.tensor(keep), capped_fraction


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("preset", sorted(ROLLOUT_CORRECTION_PRESETS))
def test_every_preset_against_a_plain_loop(seed, preset):
    old, roll, mask = data(seed)
    rc = RolloutCorrection(preset=preset).resolved()
    if preset.startswith("geo"):  # the geometric band is +-0.1 %: make the mismatch that small
        roll = old + (roll - old) * 4e-3
    weight, keep, metrics = rollout_correction(old, roll, mask, **rc.arguments())
    w, k, capped = loop(
        old, roll, mask, rc.is_level, rc.is_cap, rc.mask_mode, rc.mask_low, rc.mask_high
    )
    torch.testing.assert_close(weight, w, atol=1e-12, rtol=1e-12)
    assert torch.equal(keep, k)
    if rc.mask_mode is not None:
        assert 0 < int((mask & ~keep).sum()) < int(mask.sum())  # the band bites, not everywhere
        rows = mask.any(-1)
        assert metrics["rollout_masked_seqs"] == pytest.approx(
            float((mask & ~keep).any(-1)[rows].double().mean())
        )
    if rc.is_level is not None:
        assert metrics["tis_weight_capped"] == pytest.approx(capped)
        assert metrics["tis_weight_mean"] == pytest.approx(float(w[mask].mean()))


def test_mismatch_metrics_against_a_loop():
    old, roll, mask = data(0)
    out = rollout_mismatch_metrics(old, roll, mask)
    diffs = [float(old[b, t] - roll[b, t]) for b in range(9) for t in range(6) if mask[b, t]]
    assert out["rollout_abs_log_ratio"] == pytest.approx(sum(map(abs, diffs)) / len(diffs))
    assert out["rollout_token_mult_prob_error"] == pytest.approx(
        sum(math.exp(abs(d)) for d in diffs) / len(diffs)
    )
    assert out["rollout_kl"] == pytest.approx(-sum(diffs) / len(diffs))
    seqs = [
        math.exp(sum(float(old[b, t] - roll[b, t]) for t in range(6) if mask[b, t]))
        for b in range(9)
        if mask[b].any()
    ]
    assert out["rollout_seq_ratio"] == pytest.approx(sum(seqs) / len(seqs))


# ----------------------------------------------------------------------------- verl
# verl/trainer/ppo/rollout_corr_helper.py at commit b178a3cd56f58b2d502255daba591e92833930a7,
# transcribed: compute_rollout_correction_weights (no batch normalisation) and
# compute_rollout_rejection_mask for the options the presets use (token_k1, seq_sum_k1,
# seq_mean_k1); verl_F.masked_sum / masked_mean written out.
SAFETY_BOUND = 20.0


def verl_weights(log_ratio, response_mask, rollout_is, rollout_is_threshold):
    if rollout_is == "token":
        w = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    else:
        log_ratio_sum = (log_ratio * response_mask).sum(-1).unsqueeze(-1)
        w = torch.exp(torch.clamp(log_ratio_sum, min=-SAFETY_BOUND, max=SAFETY_BOUND))
        w = w.expand_as(log_ratio)
    w = w * response_mask
    return w.clamp(max=rollout_is_threshold).detach()


def verl_rejection(log_ratio, response_mask, option, threshold: str):
    lower, upper = (float(x) for x in threshold.split("_"))
    lower_log, upper_log = math.log(lower), math.log(upper)
    token_k1 = -torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)
    if option == "token_k1":
        keep = (token_k1 >= lower_log) & (token_k1 <= upper_log)
    else:
        s = (token_k1 * response_mask).sum(-1)
        if option == "seq_mean_k1":
            s = s / response_mask.sum(-1).clamp_min(1e-8)
        keep = ((s >= lower_log) & (s <= upper_log)).unsqueeze(-1).expand_as(response_mask)
    return response_mask * keep.to(response_mask.dtype)


VERL_OPTION = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    "preset", ["token_is", "seq_is", "icepop", "mis", "seq_is_mis", "geo_mask"]
)
def test_presets_match_verl(seed, preset):
    """Same weights and the same kept tokens as verl. verl's ``*_k1`` bounds apply to ``-lr`` (the
    inverse ratio): our band ``[low, high]`` is verl's threshold ``"{1/high}_{1/low}"``; for the
    symmetric presets (``mis``: 0.5-2.0) that is verl's own default string."""
    old, roll, mask = data(seed)
    if preset == "geo_mask":
        roll = old + (roll - old) * 4e-3
    rc = RolloutCorrection(preset=preset).resolved()
    weight, keep, _ = rollout_correction(old, roll, mask, **rc.arguments())
    m = mask.to(F64)
    log_ratio = torch.where(mask, old - roll, 0.0)
    if rc.is_level is not None:
        theirs = verl_weights(log_ratio, m, rc.is_level, rc.is_cap)
        torch.testing.assert_close(torch.where(mask, weight, 0.0), theirs, atol=1e-12, rtol=0)
    if rc.mask_mode is not None:
        threshold = f"{1 / rc.mask_high!r}_{1 / rc.mask_low!r}"
        if preset in ("mis", "seq_is_mis"):
            assert threshold == "0.5_2.0"  # verl decoupled_seq_is_rs's default
        theirs = verl_rejection(log_ratio, m, VERL_OPTION[rc.mask_mode], threshold)
        assert torch.equal(keep, theirs.bool())


# ----------------------------------------------------------------------------- the loss
def loss_batch(seed: int = 0):
    from support.trajectories import tiny_batch

    ac, td = tiny_batch(seed)
    g = torch.Generator().manual_seed(seed + 1)
    mask = td["loss_mask"]
    td["rollout_log_prob"] = torch.where(
        mask, td["sample_log_prob"] + 0.5 * torch.randn(mask.shape, generator=g), 0.0
    )
    return ac, td


def grads(ac, loss) -> dict[str, torch.Tensor]:
    ac.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in ac.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("preset", ["seq_is", "icepop", "seq_is_mis"])
def test_the_correction_weights_the_policy_term_only(preset):
    ac, td = loss_batch()
    plain = TokenPPOLoss(ac, clip_epsilon=(0.2, 0.28))
    corrected = TokenPPOLoss(ac, clip_epsilon=(0.2, 0.28), rollout_correction={"preset": preset})
    a, b = plain(td.clone()), corrected(td.clone())
    torch.testing.assert_close(a["loss_critic"], b["loss_critic"], atol=0, rtol=0)
    assert not torch.allclose(a["loss_objective"], b["loss_objective"])
    ga, gb = grads(ac, a["loss_critic"]), grads(ac, b["loss_critic"])
    assert ga.keys() == gb.keys()
    for name in ga:
        assert torch.equal(ga[name], gb[name]), name  # the value loss's gradient is untouched
    # the objective equals the per-token loss times the weight and the keep-mask, same normaliser
    rc = corrected.rollout_correction
    mask = td["loss_mask"]
    w, keep, _ = rollout_correction(
        td["sample_log_prob"], td["rollout_log_prob"], mask, **rc.arguments()
    )
    lp = ac(td.select(*ac.in_keys))["log_prob"].detach()
    from ar_torchrl.functional import aggregate_loss, clipped_surrogate

    per_token, _, _ = clipped_surrogate(
        lp, td["sample_log_prob"], td["advantage"].squeeze(-1), mask, clip_low=0.2, clip_high=0.28
    )
    expect = aggregate_loss(torch.where(keep, per_token * w, 0.0), mask, "token_mean")
    torch.testing.assert_close(b["loss_objective"].detach(), expect)
    if rc.mask_mode is not None:
        assert 0 < b["rollout_masked_tokens"] < 1


def test_mismatch_metrics_are_logged_whenever_the_batch_has_rollout_log_prob():
    ac, td = loss_batch()
    out = TokenPPOLoss(ac)(td.clone())
    expect = rollout_mismatch_metrics(
        td["sample_log_prob"], td["rollout_log_prob"], td["loss_mask"]
    )
    for key, value in expect.items():
        torch.testing.assert_close(out[key], value)
        assert key in TokenPPOLoss(ac).out_keys
    assert "tis_weight_mean" not in out.keys()
    without = TokenPPOLoss(ac)(td.clone().exclude("rollout_log_prob"))
    assert "rollout_abs_log_ratio" not in without.keys()


def test_tis_cap_is_the_token_is_preset():
    ac, td = loss_batch()
    a = TokenPPOLoss(ac, tis_cap=1.5)(td.clone())
    b = TokenPPOLoss(ac, rollout_correction={"preset": "token_is", "is_cap": 1.5})(td.clone())
    for key in ("loss_objective", "tis_weight_mean", "tis_weight_capped"):
        torch.testing.assert_close(a[key], b[key], atol=0, rtol=0)
    c = TokenPPOLoss(ac, tis_cap=1.5, rollout_correction={"preset": "icepop"})
    assert c.rollout_correction.is_level == "token" and c.rollout_correction.mask_mode == "token"


def test_errors_name_what_to_fix():
    ac, td = loss_batch()
    with pytest.raises(
        KeyError, match=r"the rollout correction \(preset='mis'.*needs 'rollout_log_prob'"
    ):
        TokenPPOLoss(ac, rollout_correction={"preset": "mis"})(td.exclude("rollout_log_prob"))
    with pytest.raises(ValueError, match="rollout_correction.preset='icepo' is not one of"):
        TokenPPOLoss(ac, rollout_correction={"preset": "icepo"})
    with pytest.raises(ValueError, match="mask_mode='token' needs mask_low and/or mask_high"):
        RolloutCorrection(mask_mode="token").check("config: algo.rollout_correction.")
    with pytest.raises(ValueError, match="is_cap=3.0 is set but no is_level"):
        RolloutCorrection(is_cap=3.0).check()
    with pytest.raises(ValueError, match="mask_low=2.0 is above mask_high=1.0"):
        RolloutCorrection(mask_mode="sequence", mask_low=2.0, mask_high=1.0).check()
    with pytest.raises(ValueError, match="tis_cap=2.0 and rollout_correction"):
        TokenPPOLoss(ac, tis_cap=2.0, rollout_correction={"preset": "seq_is"})
    with pytest.raises(TypeError, match="takes a RolloutCorrection or a dict"):
        TokenPPOLoss(ac, rollout_correction="icepop")


# ----------------------------------------------------------------------------- the recipe
def test_the_recipe_selects_policy_loss_and_correction_from_the_config():
    from support.recipe_helpers import typed
    from support.trajectories import tiny_actor_critic

    from ar_torchrl.recipes.dapo_ppo import build

    ac = tiny_actor_critic(0)
    cfg = typed(
        [
            "algo.policy_loss=cispo",
            "algo.cispo.weight_max=3.0",
            "algo.rollout_correction.preset=icepop",
            "algo.rollout_correction.mask_low=0.3",
        ]
    )
    loss = build.build_loss(cfg, ac)
    rc = loss.rollout_correction
    assert loss.policy_loss == "cispo" and loss._policy_loss_fn.keywords["weight_max"] == 3.0
    assert (rc.mask_mode, rc.mask_low, rc.mask_high, rc.is_level) == ("token", 0.3, 5.0, None)
    # async: a preset with an IS weight is the behaviour correction; one without keeps the default
    seq = build.build_loss(
        typed(["train.mode=async", "algo.rollout_correction.preset=seq_is_mis"]), ac
    )
    assert seq.rollout_correction.is_level == "sequence" and seq.tis_cap is None
    ice = build.build_loss(typed(["train.mode=async", "algo.rollout_correction.preset=icepop"]), ac)
    assert (ice.rollout_correction.is_level, ice.rollout_correction.is_cap) == ("token", 2.0)
    with pytest.raises(ValueError, match=r"config: algo.rollout_correction.preset='ice' is not"):
        typed(["algo.rollout_correction.preset=ice"])
    with pytest.raises(ValueError, match=r"config: algo.policy_loss='gpso' is not one of"):
        typed(["algo.policy_loss=gpso"])
    with pytest.raises(ValueError, match=r"config: algo.tis_cap=2.0 and algo.rollout_correction"):
        typed(["algo.tis_cap=2.0", "algo.rollout_correction.preset=seq_is"])
    with pytest.raises(ValueError, match=r"config: algo.gspo.clip_low must be"):
        typed(["algo.gspo.clip_low=1.5"])
    with pytest.raises(ValueError, match="rollout.critic_flat_groups=true keeps the groups"):
        typed(["rollout.critic_flat_groups=true"])
