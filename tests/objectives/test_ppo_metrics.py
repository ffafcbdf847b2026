"""TokenPPOLoss metrics: each name has the definition the table of ar_torchrl.objectives.metrics
gives (TorchRL's for TorchRL's names, verl's for verl's), over loss_mask only; ClipPPOLoss
arguments TokenPPOLoss does not honour raise; the settings it has are checked when set."""

from __future__ import annotations

import math
import re

import pytest
import torch
from support.trajectories import tiny_actor_critic
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.modules import ProbabilisticActor
from torchrl.objectives import ClipPPOLoss, LossModule

from ar_torchrl.objectives import TokenPPOLoss
from ar_torchrl.objectives.ppo import UNSUPPORTED_CLIP_PPO_SETTINGS

torch.set_num_threads(1)

B, L = 4, 9
EPS_LOW, EPS_HIGH, DUAL, CLIP_V = 0.2, 0.28, 3.0, 0.2
#: verl's source the peer check transcribes (volcengine/verl at this commit).
VERL = "verl/trainer/ppo/core_algos.py @ b178a3cd56f58b2d502255daba591e92833930a7"


def _actor_critic():
    ac = tiny_actor_critic(seed=1)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # a non-zero value head: values, value clipping and EV are exercised
        for p in ac.model.value_head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5)
    return ac


def group_batch(ac, *, masked: bool, seed: int = 0):
    """``[B, L]`` tokens with designed log-ratios (spread over and beyond the clip band), signed
    advantages and value moves around ``CLIP_V``; ``masked``: about a third of the tokens are not
    trained (else only position 0, which has no prediction)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 99, (B, L), generator=g)
    attn = torch.ones(B, L, dtype=torch.bool)
    mask = attn.clone()
    mask[:, 0] = False
    if masked:
        mask &= torch.rand(B, L, generator=g) > 0.35
    with torch.no_grad():
        new = ac(TensorDict({"tokens": tokens, "attention_mask": attn}, [B, L]))
    lr = torch.randn(B, L, generator=g) * 0.3
    lr[:, 2] = 1.5  # ratio 4.5: beyond the dual clip for A < 0
    if masked:
        lr[0, 5] = 25.0  # beyond the loss's +-20 clamp
        mask[:, 2] = mask[0, 5] = True
    adv = torch.randn(B, L, 1, generator=g)
    adv[:, 2] = torch.tensor([-1.0, -0.5, 0.5, 1.0]).unsqueeze(-1)
    value = new["state_value"]
    td = TensorDict(
        {
            "tokens": tokens,
            "attention_mask": attn,
            "loss_mask": mask,
            "sample_log_prob": new["log_prob"] - lr,
            "ref_log_prob": new["log_prob"] - 0.1 * torch.randn(B, L, generator=g),
            "rollout_log_prob": new["log_prob"] - lr + 0.05 * torch.randn(B, L, generator=g),
            "advantage": adv,
            "state_value": value - 0.3 * torch.randn(B, L, 1, generator=g),
            "value_target": value + torch.randn(B, L, 1, generator=g),
        },
        [B, L],
    )
    return td, new


def _with_garbage(td, finite: bool):
    """Masked positions overwritten: NaN/inf (``finite=False``) or huge finite numbers."""
    out = td.clone()
    off = ~out["loss_mask"]
    bad = (1e4, -1e4) if finite else (float("nan"), float("inf"))
    for i, key in enumerate(("sample_log_prob", "ref_log_prob", "rollout_log_prob")):
        out[key] = torch.where(off, bad[i % 2], out[key])
    for i, key in enumerate(("advantage", "state_value", "value_target")):
        out[key] = torch.where(off.unsqueeze(-1), bad[i % 2], out[key])
    return out


def _loss(ac, **kwargs):
    kw = dict(
        clip_epsilon=(EPS_LOW, EPS_HIGH), dual_clip=DUAL, clip_value=CLIP_V, entropy_coeff=0.01
    )
    return TokenPPOLoss(ac, **{**kw, **kwargs})


def _entropies(ac, tokens, attn):
    """Per-token entropy of the policy (position t predicted from t - 1; 0 at position 0), float64."""
    with torch.no_grad():
        logits = ac.model.get_output_embeddings()(ac.hidden_states(tokens, attn)).double()
    logp = logits.log_softmax(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return torch.cat([torch.zeros(ent.shape[0], 1, dtype=ent.dtype), ent[:, :-1]], 1), logits


# ---------------------------------------------------------------------------- definitions
def _loop_metrics(td, new, entropy):
    """Every metric from its docstring definition, in Python floats over the trained tokens."""
    lr, a, v, v_old, r_t, k3, drift, ent = [], [], [], [], [], [], [], []
    mismatch, seq_ratio = [], []  # pi_old vs the rollout's log-probs
    for b in range(B):
        row = []
        for t in range(L):
            if not td["loss_mask"][b, t]:
                continue
            lp, old = float(new["log_prob"][b, t]), float(td["sample_log_prob"][b, t])
            lr.append(min(max(lp - old, -20.0), 20.0))
            a.append(float(td["advantage"][b, t, 0]))
            v.append(float(new["state_value"][b, t, 0]))
            v_old.append(float(td["state_value"][b, t, 0]))
            r_t.append(float(td["value_target"][b, t, 0]))
            d = min(max(float(td["ref_log_prob"][b, t]) - lp, -20.0), 20.0)
            k3.append(min(max(math.exp(d) - d - 1.0, 0.0), 10.0))
            drift.append(abs(lp - float(td["rollout_log_prob"][b, t])))
            row.append(min(max(old - float(td["rollout_log_prob"][b, t]), -20.0), 20.0))
            ent.append(float(entropy[b, t]))
        mismatch += row
        if row:
            seq_ratio.append(math.exp(min(max(sum(row), -20.0), 20.0)))
    n = len(lr)
    r = [math.exp(x) for x in lr]

    def mean(xs):
        return sum(xs) / len(xs)

    def var(xs):
        m = mean(xs)
        return mean([(x - m) ** 2 for x in xs])

    def clip(x):
        return min(max(x, 1 - EPS_LOW), 1 + EPS_HIGH)

    resid = [t - p for t, p in zip(r_t, v)]
    return {
        "clip_fraction": mean([not (1 - EPS_LOW <= x <= 1 + EPS_HIGH) for x in r]),
        "pg_clipfrac": mean([-ai * clip(x) > -ai * x for x, ai in zip(r, a)]),
        "pg_clipfrac_lower": mean(
            [ai < 0 and max(-ai * x, -ai * clip(x)) > -DUAL * ai for x, ai in zip(r, a)]
        ),
        "kl_approx": mean([-x for x in lr]),
        "mean_ratio": mean(r),
        "max_ratio": max(r),
        "ESS": sum(r) ** 2 / sum(x * x for x in r) / n,
        "entropy": mean(ent),
        "value_clip_fraction": mean([abs(x - y) > CLIP_V for x, y in zip(v, v_old)]),
        "vf_clipfrac": mean(
            [
                (min(max(x, y - CLIP_V), y + CLIP_V) - t) ** 2 > (x - t) ** 2
                for x, y, t in zip(v, v_old, r_t)
            ]
        ),
        "explained_variance": 1 - var(resid) / (var(r_t) + torch.finfo(torch.float32).eps),
        "explained_variance_finite": 1 - var(resid) / var(r_t),
        "approx_kl": mean([(x - 1) - y for x, y in zip(r, lr)]),
        "min_ratio": min(r),
        "kl_ref": mean(k3),
        "rollout_log_prob_abs_diff": mean(drift),
        "rollout_abs_log_ratio": mean([abs(x) for x in mismatch]),
        "rollout_token_mult_prob_error": mean([math.exp(abs(x)) for x in mismatch]),
        "rollout_seq_ratio": mean(seq_ratio),
        "rollout_kl": mean([-x for x in mismatch]),
    }


def test_every_metric_is_its_documented_definition_over_loss_mask_with_garbage_elsewhere():
    ac = _actor_critic()
    td, new = group_batch(ac, masked=True, seed=1)
    entropy, _ = _entropies(ac, td["tokens"], td["attention_mask"])
    want = _loop_metrics(td, new, entropy)
    loss = _loss(ac, kl_coeff=0.1)
    out = loss(_with_garbage(td, finite=False))  # NaN / inf where loss_mask is False
    assert set(out.keys()) == set(loss.out_keys) - {"explained_variance_policy_rows"}
    metrics = {k for k in out.keys() if not k.startswith("loss_")}
    assert metrics == set(want), "every metric is checked, and only metrics"
    for key, value in want.items():
        assert out[key].item() == pytest.approx(value, rel=2e-5, abs=2e-6), key
    # the batch exercises every fraction away from 0 and 1, and the two pairs differ
    for key in ("clip_fraction", "pg_clipfrac", "value_clip_fraction", "vf_clipfrac"):
        assert 0.05 < want[key] < 0.95, key
    assert want["pg_clipfrac"] < want["clip_fraction"] and want["pg_clipfrac_lower"] > 0
    assert out["clip_fraction"].item() == (loss(td)["clip_fraction"]).item()


# ---------------------------------------------------------------------------- TorchRL
def _torchrl_clip_ppo(td, new, logits):
    """TorchRL's own ClipPPOLoss over the same tokens, flattened into one ``[N]`` sample batch:
    a Categorical actor over the same logits, a critic that outputs the same new values."""
    keep = td["loss_mask"]
    actor = ProbabilisticActor(
        TensorDictModule(torch.nn.Identity(), in_keys=["logits"], out_keys=["logits"]),
        in_keys=["logits"],
        distribution_class=torch.distributions.Categorical,
        return_log_prob=True,
    )
    critic = TensorDictModule(torch.nn.Identity(), in_keys=["v_new"], out_keys=["state_value"])
    loss = ClipPPOLoss(
        actor,
        critic,
        clip_epsilon=(EPS_LOW, EPS_HIGH),
        clip_value=CLIP_V,
        entropy_coeff=0.01,
        functional=False,
    )
    shifted = torch.cat([logits[:, :1], logits[:, :-1]], 1).float()  # row t predicts token t
    n = int(keep.sum())
    batch = TensorDict(
        {
            "logits": shifted[keep],
            "action": td["tokens"][keep],
            loss.tensor_keys.sample_log_prob: td["sample_log_prob"][keep],
            "advantage": td["advantage"][keep],
            "state_value": td["state_value"][keep],
            "value_target": td["value_target"][keep],
            "v_new": new["state_value"][keep],
        },
        [n],
    )
    return loss(batch)


def test_torchrl_names_equal_torchrl_clip_ppo_loss_on_an_unmasked_batch():
    """The reviewer's case: the clip is active on far fewer tokens than lie outside the band
    (0.22 vs 0.44 here; 0.153 vs 0.339 in the report). ``clip_fraction`` is TorchRL's."""
    ac = _actor_critic()
    td, new = group_batch(ac, masked=False, seed=0)
    _, logits = _entropies(ac, td["tokens"], td["attention_mask"])
    ours = _loss(ac, dual_clip=None)(td)
    theirs = _torchrl_clip_ppo(td, new, logits)
    n = int(td["loss_mask"].sum())
    for key in ("clip_fraction", "value_clip_fraction"):  # same counts, exactly
        assert round(ours[key].item() * n) == round(theirs[key].item() * n), key
        assert ours[key].item() == pytest.approx(theirs[key].item(), abs=1e-7), key
    for key in ("kl_approx", "mean_ratio", "max_ratio", "ESS", "entropy", "explained_variance"):
        assert ours[key].item() == pytest.approx(theirs[key].item(), rel=1e-5, abs=1e-6), key
    assert theirs["clip_fraction"].item() > 0.3 and ours["pg_clipfrac"].item() < 0.25
    assert abs(ours["vf_clipfrac"].item() - ours["value_clip_fraction"].item()) > 0.1
    assert 0.2 < ours["explained_variance"].item() < 0.9  # a real value head, not a constant


def test_torchrl_explained_variance_is_kept_as_torchrl_has_it_when_returns_are_constant():
    """TorchRL's epsilon gives a huge negative number; the finite variant gives 0."""
    ac = _actor_critic()
    td, new = group_batch(ac, masked=True, seed=2)
    td["value_target"] = torch.full_like(td["value_target"], 0.5)
    out = _loss(ac)(td)
    keep = td["loss_mask"]
    resid = (td["value_target"] - new["state_value"]).squeeze(-1)[keep].double()
    want = 1 - resid.var(correction=0).item() / torch.finfo(torch.float32).eps
    assert want < -1e3
    assert out["explained_variance"].item() == pytest.approx(want, rel=1e-4)
    assert out["explained_variance_finite"].item() == 0.0


# ---------------------------------------------------------------------------- verl
def _verl_fractions(td, new):
    """verl's metric lines, transcribed from ``VERL``: ``compute_policy_loss_vanilla``
    (``pg_clipfrac``, ``pg_clipfrac_lower``, with ``clip_ratio_c`` = our ``dual_clip``) and
    ``compute_value_loss`` (``vf_clipfrac``), with ``verl.utils.torch_functional.masked_mean``."""

    def masked_mean(values, mask):
        return (values * mask).sum() / (mask.sum() + 1e-8)

    response_mask = td["loss_mask"].float()
    log_prob, old_log_prob = new["log_prob"], td["sample_log_prob"]
    advantages = td["advantage"].squeeze(-1)
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    pg_losses3 = -advantages * DUAL
    pg_clipfrac_lower = masked_mean(
        torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask
    )
    vpreds, values = new["state_value"].squeeze(-1), td["state_value"].squeeze(-1)
    returns = td["value_target"].squeeze(-1)
    vpredclipped = torch.max(torch.min(vpreds, values + CLIP_V), values - CLIP_V)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    vf_clipfrac = masked_mean(torch.gt(vf_losses2, vf_losses1).float(), response_mask)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    return {
        "pg_clipfrac": pg_clipfrac,
        "pg_clipfrac_lower": pg_clipfrac_lower,
        "vf_clipfrac": vf_clipfrac,
        "kl_approx": ppo_kl,
    }


def test_verl_names_equal_verl_formulas():
    """Peer check against verl (``VERL``); verl's masked_mean multiplies by the mask, so the masked
    positions hold finite garbage here (NaN is covered above)."""
    ac = _actor_critic()
    td, new = group_batch(ac, masked=True, seed=3)
    td = _with_garbage(td, finite=True)
    out = _loss(ac)(td)
    for key, value in _verl_fractions(td, new).items():
        assert out[key].item() == pytest.approx(value.item(), abs=1e-7), key
    assert 0 < out["pg_clipfrac_lower"].item() < out["pg_clipfrac"].item()
    assert "pg_clipfrac_lower" not in _loss(ac, dual_clip=None)(td).keys()


# ---------------------------------------------------------------------------- settings
def _settings_loss():
    return TokenPPOLoss(tiny_actor_critic(seed=0), clip_value=0.2)


def _hint(name):
    return re.escape(UNSUPPORTED_CLIP_PPO_SETTINGS[name][1])


def test_the_loss_is_a_loss_module_that_vetoes_nothing():
    """Composition, not inherit-and-veto: no ``__setattr__``/``__getattr__`` of its own anywhere
    between TokenPPOLoss and TorchRL's LossModule, and no ClipPPOLoss in its bases."""
    loss = _settings_loss()
    assert isinstance(loss, LossModule) and not isinstance(loss, ClipPPOLoss)
    mro = type(loss).__mro__
    for cls in mro[: mro.index(LossModule)]:
        assert "__setattr__" not in vars(cls) and "__getattr__" not in vars(cls), cls
    assert set(loss.tensor_keys.__dataclass_fields__) == {
        *ClipPPOLoss._AcceptedKeys.__dataclass_fields__,
        "loss_mask",
        "rollout_log_prob",
        "ref_log_prob",
        "policy_mask",
    }
    assert loss.tensor_keys.sample_log_prob == "sample_log_prob"


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("reduction", "sum", r"TokenPPOLoss\(reduction='sum'\) is not supported: every loss term"),
        ("reduction", "mean", r"reduction='mean'\) is not supported: .*loss_agg_mode=\.\.\."),
        (
            "loss_critic_type",
            "l2",
            r"TokenPPOLoss\(loss_critic_type='l2'\) is not supported: the value loss is "
            r"0\.5 \* max\(\(V - R\)\^2, \(V_clip - R\)\^2\), half of ClipPPOLoss's 'l2'",
        ),
        ("normalize_advantage", True, r"TokenGAE\(normalize_advantage=True\)"),
        ("normalize_advantage_exclude_dims", (-1,), r"whiten them in the advantage module"),
        ("advantage_norm", object(), r"whiten them in the advantage module"),
        (
            "separate_losses",
            True,
            r"one LMActorCritic, one backbone forward\) the value loss trains",
        ),
        ("samples_mc_entropy", 1, r"the entropy is exact over the vocabulary"),
        ("log_explained_variance", False, r"always logged with a critic"),
        ("delay_actor", True, r"the proximal policy is sample_log_prob"),
        ("max_importance_ratio", 100.0, r"use tis_cap: it caps exp\(sample_log_prob"),
        ("use_prioritized_weights", "auto", r"no priority weights are read"),
        ("functional", True, r"functional=False\), so DDP/FSDP-wrapped models work"),
    ],
)
def test_unhonoured_clip_ppo_settings_raise_when_passed(name, value, message):
    with pytest.raises(TypeError, match=message):
        TokenPPOLoss(tiny_actor_critic(seed=0), **{name: value})
    with pytest.raises(
        TypeError, match=rf"TokenPPOLoss\({name}=.*\) is not supported: {_hint(name)}$"
    ):
        TokenPPOLoss(tiny_actor_critic(seed=0), **{name: value})


def test_unhonoured_settings_are_not_settings_of_the_loss():
    """The value each setting behaves as is accepted by the constructor; the loss has none of
    them, except the two TorchRL's LossModule reads, which read as what the loss does."""
    loss = _settings_loss()
    assert set(UNSUPPORTED_CLIP_PPO_SETTINGS) >= {
        "reduction",
        "loss_critic_type",
        "normalize_advantage",
        "separate_losses",
        "samples_mc_entropy",
        "delay_actor",
        "max_importance_ratio",
    }
    for name, (honoured, _) in UNSUPPORTED_CLIP_PPO_SETTINGS.items():
        if name in ("functional", "use_prioritized_weights"):
            assert getattr(loss, name) is False, name
        else:
            assert not hasattr(loss, name), name
        if name not in ("reduction", "loss_critic_type", "samples_mc_entropy"):
            TokenPPOLoss(tiny_actor_critic(seed=0), **{name: honoured})
    with pytest.raises(TypeError, match=r"got an unexpected keyword argument 'clip_valu'"):
        TokenPPOLoss(tiny_actor_critic(seed=0), clip_valu=0.2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"critic": None},
            r"TokenPPOLoss\(critic=None\) is not supported: pass the critic as critic_network",
        ),
        (
            {"entropy_bonus": True},
            r"TokenPPOLoss\(entropy_bonus=True\) is not supported: set entropy_coeff",
        ),
        ({"gamma": 0.99}, r"loss.make_value_estimator\(gamma=\.\.\.\)"),
        (
            {"value_key": "v"},
            r"TokenPPOLoss\(value_key='v'\) is not supported: use loss.set_keys\(value=\.\.\.\)",
        ),
        (
            {"device": "cpu"},
            r"TokenPPOLoss\(device='cpu'\) is not supported: the buffers are created on actor_critic's device",
        ),
    ],
)
def test_clip_ppo_only_constructor_arguments_name_the_replacement(kwargs, message):
    with pytest.raises(TypeError, match=message):
        TokenPPOLoss(tiny_actor_critic(seed=0), **kwargs)


def test_loss_mask_key_is_the_loss_mask_key_and_renames_it():
    ac = _actor_critic()
    td, _ = group_batch(ac, masked=True, seed=4)
    loss = _loss(ac)
    assert loss.loss_mask_key == "loss_mask"
    want = loss(td)
    loss.loss_mask_key = ("masks", "train")
    assert loss.tensor_keys.loss_mask == ("masks", "train")
    renamed = td.clone().set(("masks", "train"), td["loss_mask"]).exclude("loss_mask")
    got = loss(renamed)
    assert all(torch.equal(got[k], want[k]) for k in want.keys())
    for bad in (None, "auto"):
        with pytest.raises(
            ValueError,
            match=rf"TokenPPOLoss.loss_mask_key = {bad!r} is not supported: every term and metric "
            r"is reduced over the bool \[B, L\] entry \('masks', 'train'\) \(TorchRL's 'auto'",
        ):
            loss.loss_mask_key = bad


def test_schedulable_settings_are_honoured_or_raise_when_set():
    ac = _actor_critic()
    td, _ = group_batch(ac, masked=True, seed=5)
    loss = _loss(ac, entropy_coeff=0.0)
    assert not hasattr(loss, "loss_critic")  # ClipPPOLoss's unmasked critic loss is not ours
    loss.critic_network = tiny_actor_critic(seed=2)  # a module, as TorchRL's: checked when used
    with pytest.raises(
        TypeError, match=r"critic_network=\.\.\.\) takes an LMCritic .* got LMActorCritic"
    ):
        loss(td)
    loss.critic_network = ac  # the actor's own value head again
    with pytest.raises(
        ValueError, match=r"entropy_coeff = 0.01 has no effect on a loss built with entropy_coeff=0"
    ):
        loss.entropy_coeff = 0.01
    with pytest.raises(ValueError, match=r"entropy_bonus = True needs entropies"):
        loss.entropy_bonus = True
    with pytest.raises(
        TypeError,
        match=r"clip_value = True is not supported \(ClipPPOLoss reads True as 'clip at clip_epsilon'\)",
    ):
        loss.clip_value = True
    with pytest.raises(ValueError, match=r"TokenPPOLoss: clip_value must be > 0, got -0.1"):
        loss.clip_value = -0.1
    with pytest.raises(ValueError, match=r"critic_coeff = None is not supported once built: set 0"):
        loss.critic_coeff = None
    with pytest.raises(
        ValueError, match=r"set_keys\(action=\.\.\.\) is not supported: the actions are the tokens"
    ):
        loss.set_keys(action="tokens")
    no_critic = TokenPPOLoss(ac, critic_coeff=None)
    with pytest.raises(
        ValueError, match=r"critic_coeff = 0.5 has no effect on a loss built without a critic term"
    ):
        no_critic.critic_coeff = 0.5
    # what ClipPPOLoss schedules, TokenPPOLoss follows
    before = loss(td)
    loss.clip_value, loss.critic_coeff, loss.clip_epsilon_high = 0.05, 0.0, 0.1
    after = loss(td)
    assert after["value_clip_fraction"] > before["value_clip_fraction"]
    assert after["loss_critic"].item() == 0.0 and after["clip_fraction"] > before["clip_fraction"]
    loss.clip_value = None
    assert loss(td)["value_clip_fraction"].item() == 0.0
