"""Confidence features on the value head (``value_head.confidence``): the features against a loop;
a critic with them starts with the same values as without, adds its MLP of the features in the
padded, packed and shared-prefix plans alike (ratio exactly 1), trains through the value loss, and
its weights follow the value head's (critic export yes; policy export and weight sync no)."""

from __future__ import annotations

import pytest
import torch
from support.trajectories import first_update_has_ratio_one, shared_prompt_batch, with_confidence

from ar_torchrl.functional import sampled_log_prob_features
from ar_torchrl.models.tiny import build_tiny_qwen3
from ar_torchrl.modules import (
    ConfidenceFeatures,
    LMActorCritic,
    attach_confidence_features,
    attach_value_head,
    build_separate_critic,
)
from ar_torchrl.training import plan_micro_batches, recompute_old_log_probs_and_values

torch.set_num_threads(1)


def _loop_features(log_prob, mask):
    """Per token, over the trained tokens before it / through it: lowest, mean, last (0: none)."""
    rows, width = mask.shape
    before = torch.zeros(rows, width, 3)
    through = torch.zeros(rows, width, 3)
    for b in range(rows):
        seen: list[float] = []
        for t in range(width):
            stats = lambda xs: [min(xs), sum(xs) / len(xs), xs[-1]] if xs else [0.0] * 3  # noqa: E731
            before[b, t] = torch.tensor(stats(seen))
            if mask[b, t]:
                seen.append(float(log_prob[b, t]))
            through[b, t] = torch.tensor(stats(seen))
    return before, through


@pytest.mark.parametrize("seed", range(3))
def test_sampled_log_prob_features_match_a_loop(seed):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(5, 9, generator=g) < 0.6
    mask[:, :2] = False
    mask[0] = False  # a row with no trained token
    log_prob = torch.where(mask, -3 * torch.rand(5, 9, generator=g), torch.randn(5, 9, generator=g))
    before, through = sampled_log_prob_features(log_prob, mask)
    want_before, want_through = _loop_features(log_prob, mask)
    torch.testing.assert_close(before, want_before, atol=1e-6, rtol=0)
    torch.testing.assert_close(through, want_through, atol=1e-6, rtol=0)
    with pytest.raises(TypeError, match="mask must be a bool tensor"):
        sampled_log_prob_features(log_prob, mask.float())


def _batch(groups=4, n=3, seed=0):
    td = shared_prompt_batch(groups=groups, n=n, seed=seed)
    g = torch.Generator().manual_seed(seed + 7)
    td["rollout_log_prob"] = torch.where(
        td["loss_mask"], -2 * torch.rand(td["loss_mask"].shape, generator=g), 0.0
    )
    return td


def _confident(seed=0, *, trained=True):
    model = attach_value_head(build_tiny_qwen3(99, seed=seed))
    if trained:  # an MLP that is not zero: its term is visible
        return with_confidence(model, seed)
    return attach_confidence_features(model)


def _defined(td):
    m = td["attention_mask"]
    return torch.cat([torch.zeros_like(m[:, :1]), m[:, 1:] & m[:, :-1]], dim=1)


def test_a_fresh_one_changes_nothing_and_a_trained_one_adds_its_mlp():
    td = _batch()
    plain = LMActorCritic(attach_value_head(build_tiny_qwen3(99, seed=0)))
    fresh = LMActorCritic(_confident(trained=False))
    a, b = plain(plain.select_inputs(td.clone())), fresh(fresh.select_inputs(td.clone()))
    for key in ("log_prob", "state_value", ("next", "state_value")):
        torch.testing.assert_close(a[key], b[key], atol=0, rtol=0)
    model = _confident()
    ac = LMActorCritic(model)
    out = ac(ac.select_inputs(td.clone()))
    mask = td["loss_mask"]
    before, through = sampled_log_prob_features(td["rollout_log_prob"], mask)
    with torch.no_grad():
        extra, next_extra = (
            model.value_head.confidence.net(before),
            model.value_head.confidence.net(through),
        )
    base = LMActorCritic(_without(model))  # the same weights, the head without its MLP
    ref = base(base.select_inputs(td.clone()))
    torch.testing.assert_close(out["state_value"][mask], (ref["state_value"] + extra)[mask])
    torch.testing.assert_close(
        out["next", "state_value"][mask], (ref["next", "state_value"] + next_extra)[mask]
    )
    assert (out["state_value"][~mask] == ref["state_value"][~mask]).all()  # only trained tokens


def _without(model):
    """A view of ``model`` whose value head has no confidence features (weights shared)."""
    import copy

    other = copy.copy(model)
    head = copy.copy(model.value_head)
    head._modules = {k: v for k, v in head._modules.items() if k != "confidence"}
    other._modules = {**model._modules, "value_head": head}
    return other


@pytest.mark.parametrize("budget", [48, 10_000])
def test_every_plan_gives_the_same_values_and_the_first_ratio_is_one(budget):
    td = _batch(groups=5, n=3, seed=1)
    ac = LMActorCritic(_confident(seed=1))
    real = _defined(td)
    plans = {
        "padded": plan_micro_batches(td, budget),
        "packed": plan_micro_batches(td, budget, packing=True),
        "shared": plan_micro_batches(td, budget, shared_prefix=True),
        "tree": plan_micro_batches(td, budget, shared_prefix=True, packing=True),
    }
    assert all(mb.shared and mb.packed for mb in plans["tree"].micro_batches)
    got = {name: recompute_old_log_probs_and_values(ac, td.clone(), p) for name, p in plans.items()}
    for name in ("packed", "shared", "tree"):
        for key in ("sample_log_prob", "state_value"):
            x, y = got[name][key].reshape(real.shape), got["padded"][key].reshape(real.shape)
            torch.testing.assert_close(x[real], y[real], atol=1e-6, rtol=0, msg=f"{name} {key}")
    first_update_has_ratio_one(ac, td.clone(), plans["padded"])
    grads = [p.grad for p in ac.model.value_head.confidence.parameters()]
    assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)


def test_the_separate_critic_takes_them_too_and_a_missing_key_is_named():
    policy = build_tiny_qwen3(99, seed=2)
    critic = build_separate_critic(policy)
    attach_confidence_features(critic.model)
    td = _batch(seed=2)
    out = critic(critic.select_inputs(td.clone()))
    assert out["state_value"].shape == (*td.shape, 1)
    with pytest.raises(
        KeyError, match=r"LMCritic: the value head has confidence features .*'rollout_log_prob'"
    ):
        critic(critic.select_inputs(td.exclude("rollout_log_prob")))
    ac = LMActorCritic(_confident())
    with pytest.raises(KeyError, match=r"LMActorCritic: .* read 'rollout_log_prob'"):
        ac(ac.select_inputs(td.exclude("rollout_log_prob")))
    with pytest.raises(ValueError, match="PopArt head"):
        attach_confidence_features(attach_value_head(build_tiny_qwen3(99), popart_beta=0.1))
    with pytest.raises(ValueError, match="has no `value_head`"):
        attach_confidence_features(build_tiny_qwen3(99))
    with pytest.raises(ValueError, match="hidden must be an int >= 1, got 0"):
        ConfidenceFeatures(0)


def test_its_weights_follow_the_value_head(tmp_path):
    from transformers import AutoModelForCausalLM

    from ar_torchrl.models.export import export_critic, export_policy, load_critic
    from ar_torchrl.weight_sync.names import named_policy_tensors

    model = _confident(seed=3)
    names = [k for k in model.state_dict() if "confidence" in k]
    assert names and all(k.startswith("value_head.confidence.") for k in names)
    assert not any("confidence" in n for n, _ in named_policy_tensors(model))
    policy = export_policy(model, tmp_path / "policy")
    assert AutoModelForCausalLM.from_pretrained(policy).state_dict().keys().isdisjoint(names)
    from safetensors.torch import load_file

    assert not any("value_head" in k for k in load_file(str(policy / "model.safetensors")))
    critic = export_critic(model, tmp_path / "critic")
    again = load_critic(critic).model
    for k in names:
        torch.testing.assert_close(again.state_dict()[k], model.state_dict()[k])
