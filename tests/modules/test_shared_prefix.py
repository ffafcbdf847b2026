"""Shared-prefix forwards (issue 31 item 1): the n samples of a prompt compute it once; the same
log-probs, values, entropies and gradients as the padded forward, and ratio exactly 1, for padded
shared crops (two backbone calls, the prefix's cache) and packed ones (the tree layout, one call)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.trajectories import first_update_has_ratio_one, shared_prompt_batch

from ar_torchrl.models.tiny import build_tiny_qwen3
from ar_torchrl.modules import (
    LMActorCritic,
    SharedPrefix,
    attach_value_head,
    build_separate_critic,
    supports_shared_prefix,
)
from ar_torchrl.objectives import TokenGAE, TokenPPOLoss
from ar_torchrl.training import plan_micro_batches, recompute_old_log_probs_and_values

torch.set_num_threads(1)


def actor_critic(seed: int = 0, **kwargs) -> LMActorCritic:
    ac = LMActorCritic(attach_value_head(build_tiny_qwen3(99, seed=seed)), **kwargs)
    with torch.no_grad():  # a value head that is not zero: values are compared too
        ac.model.value_head.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(seed))
    return ac


def defined(td) -> torch.Tensor:
    """Positions whose log-prob / value has a real previous token (the first real token of a
    row reads a padding state: its number depends on the crop, in every plan)."""
    mask = td["attention_mask"]
    return torch.cat([torch.zeros_like(mask[:, :1]), mask[:, 1:] & mask[:, :-1]], dim=1)


def shared_and_padded(td, budget, packed=False):
    shared = plan_micro_batches(td, budget, shared_prefix=True, packing=packed)
    assert all(mb.shared is not None and mb.packed == packed for mb in shared.micro_batches)
    padded = plan_micro_batches(td, budget)
    return shared, padded


LAYOUTS = pytest.mark.parametrize("packed", [False, True], ids=["padded", "tree"])


@LAYOUTS
@pytest.mark.parametrize("budget", [64, 10_000])
def test_shared_prefix_forward_gives_the_padded_log_probs_values_and_entropies(budget, packed):
    td = shared_prompt_batch(groups=5, n=4)
    ac = actor_critic(return_entropy=True)
    shared, padded = shared_and_padded(td, budget, packed)
    for mb in shared.micro_batches:  # crop by crop, and the same crop without sharing
        crop = shared.crop(td, mb)
        plain = shared.crop(td, dataclasses.replace(mb, shared=None, packed_shape=None))
        with torch.no_grad():
            a, b = ac(ac.select_inputs(crop)), ac(ac.select_inputs(plain))
        real = defined(plain)
        for key in ("log_prob", "entropy", "state_value", ("next", "state_value")):
            x, y = a[key].reshape(real.shape), b[key].reshape(real.shape)
            rtol = 1e-6 if key == "entropy" else 0  # entropies ~4.6: relative float rounding
            torch.testing.assert_close(x[real], y[real], atol=1e-6, rtol=rtol, msg=str(key))
    a = recompute_old_log_probs_and_values(ac, td.clone(), shared)
    b = recompute_old_log_probs_and_values(ac, td.clone(), padded)
    real = defined(td)
    for key in ("sample_log_prob", "state_value"):
        x, y = a[key].reshape(real.shape), b[key].reshape(real.shape)
        torch.testing.assert_close(x[real], y[real], atol=1e-6, rtol=0)


@LAYOUTS
def test_shared_prefix_gradients_equal_the_padded_ones_for_both_critics(packed):
    td = shared_prompt_batch(groups=4, n=3, seed=1)
    shared, padded = shared_and_padded(td, 10_000, packed)
    ac = actor_critic()
    policy = build_tiny_qwen3(99, seed=2)
    actor, critic = LMActorCritic(policy, critic=False), build_separate_critic(policy)
    with torch.no_grad():
        critic.model.value_head.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))

    def grads(plan, modules):
        for m in modules:
            m.zero_grad()
        mask = td["loss_mask"]
        for sub in plan.split(td):
            sub_mask = sub["loss_mask"]
            for m in modules:
                out = m(m.select_inputs(sub))
                terms = [out["state_value"].squeeze(-1)] if "state_value" in out.keys() else []
                terms += [out["log_prob"]] if "log_prob" in out.keys() else []
                sum((t * sub_mask).sum() for t in terms).div(mask.sum()).backward()
        return {n: p.grad.clone() for m in modules for n, p in m.named_parameters()}

    for modules in ([ac], [actor, critic]):
        a, b = grads(shared, modules), grads(padded, modules)
        assert a.keys() == b.keys()
        for name in a:
            torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-5, msg=name)
        trunk = [n for n in a if "layers.0." in n and a[n].abs().sum() > 0]
        assert trunk  # the gradient reached the shared prefix's computation


@LAYOUTS
def test_the_first_update_has_ratio_exactly_one_on_a_shared_prefix_plan(packed):
    td = shared_prompt_batch(groups=5, n=4, seed=3)
    plan = plan_micro_batches(td, 64, shared_prefix=True, packing=packed)
    assert len(plan) > 1 and all(mb.shared and mb.packed == packed for mb in plan.micro_batches)
    first_update_has_ratio_one(actor_critic(), td, plan)
    # a separate critic: old values from the same geometry, ratio 1, values unclipped
    policy = build_tiny_qwen3(99, seed=4)
    actor, critic = LMActorCritic(policy, critic=False), build_separate_critic(policy)
    td = shared_prompt_batch(groups=5, n=4, seed=4)
    plan = plan_micro_batches(td, 64, shared_prefix=True, packing=packed)
    loss = TokenPPOLoss(actor, critic, clip_value=0.2)
    recompute_old_log_probs_and_values(actor, td, plan, loss=loss)
    td = TokenGAE(gamma=1.0, lmbda=0.95)(td)
    for sub in plan.split(td):
        out = loss(sub)
        assert out["min_ratio"].item() == out["max_ratio"].item() == 1.0
        assert out["value_clip_fraction"].item() == 0.0


@pytest.mark.parametrize("checkpointing", ["hf", "ours"])
def test_a_model_that_cannot_share_refuses_a_shared_prefix_crop(checkpointing):
    """Under activation checkpointing (Hugging Face's returns no cache; ours would replay the
    cache writes in backward) a shared-prefix crop is an error naming why and what to do: its
    padded forward would compute more than the plan's budget."""
    from ar_torchrl.distributed.fsdp import checkpoint_decoder_layers

    ac = actor_critic()
    assert supports_shared_prefix(ac.model)
    if checkpointing == "hf":
        ac.model.gradient_checkpointing_enable()
        ac.train()
    else:
        checkpoint_decoder_layers(ac.model)
    assert not supports_shared_prefix(ac.model)
    td = shared_prompt_batch(groups=3, n=4, seed=5)
    plan = plan_micro_batches(td, 10_000, shared_prefix=True)
    crop = plan.crop(td, plan.micro_batches[0])
    assert isinstance(crop.get_non_tensor("shared_prefix"), SharedPrefix)
    critic = build_separate_critic(ac.model)
    for module in (ac, critic):
        with pytest.raises(
            ValueError, match=r"cannot compute a prefix once per group: it runs activation"
        ):
            module(module.select_inputs(crop))
    plain = plan_micro_batches(td, 10_000)  # without sharing: as before
    first_update_has_ratio_one(ac, td, plain)
    # the tree layout is one backbone call without a cache: it runs under checkpointing
    tree = plan_micro_batches(td, 10_000, packing=True, shared_prefix=True, shared_padded=False)
    assert all(mb.shared and mb.packed for mb in tree.micro_batches)
    first_update_has_ratio_one(ac, td, tree)


def test_a_kernel_without_dense_masks_refuses_a_tree_crop():
    """flash/flex kernels take no dense 4D mask: a packed shared crop is an error naming the
    kernel, and supports_shared_prefix (the padded layout) is unaffected."""
    from ar_torchrl.modules.shared_prefix import why_not_tree

    ac = actor_critic()
    assert why_not_tree(ac.model) is None
    td = shared_prompt_batch(groups=3, n=4, seed=5)
    plan = plan_micro_batches(td, 10_000, packing=True, shared_prefix=True)
    crop = plan.crop(td, plan.micro_batches[0])
    ac.model.config._attn_implementation = "flash_attention_2"  # only read, never run here
    assert "'flash_attention_2' takes no dense 4D mask" in why_not_tree(ac.model)
    with pytest.raises(ValueError, match=r"cannot compute a prefix once per group: its attention"):
        ac(ac.select_inputs(crop))


@LAYOUTS
@pytest.mark.parametrize("separate", [False, True])
def test_ppo_update_on_a_shared_prefix_plan_matches_the_padded_plan(separate, packed):
    """recompute_old_log_probs_and_values + ppo_update: on the shared-prefix plan the first update's
    ratio is exactly 1 and values unclipped, and its losses, gradient norm and updated weights
    are those of the same update on the padded plan."""
    from ar_torchrl.training import ppo_update

    def run(plan_kwargs):
        torch.manual_seed(0)
        if separate:
            policy = build_tiny_qwen3(99, seed=6)
            actor, critic = LMActorCritic(policy, critic=False), build_separate_critic(policy)
            with torch.no_grad():
                gen = torch.Generator().manual_seed(1)
                critic.model.value_head.weight.normal_(0, 0.1, generator=gen)
            loss = TokenPPOLoss(actor, critic, clip_value=0.2, entropy_coeff=0.01)
            modules = [actor, critic]
        else:
            actor = actor_critic(seed=6)
            loss = TokenPPOLoss(actor, clip_value=0.2, entropy_coeff=0.01)
            modules = [actor]
        td = shared_prompt_batch(groups=4, n=4, seed=6)
        plan = plan_micro_batches(td, 64, **plan_kwargs)
        recompute_old_log_probs_and_values(actor, td, plan, loss=loss)
        td = TokenGAE(gamma=1.0, lmbda=0.95)(td)
        named = {f"{i}.{n}": p for i, m in enumerate(modules) for n, p in m.named_parameters()}
        before = {n: p.detach().clone() for n, p in named.items()}
        opt = torch.optim.SGD(named.values(), lr=0.5)
        out = ppo_update(loss, opt, td, plan, epochs=1, num_minibatches=1, grad_clip=None)
        return plan, out, before, {n: p.detach().clone() for n, p in named.items()}

    plan_s, out_s, before, w_s = run({"shared_prefix": True, "packing": packed})
    plan_p, out_p, _, w_p = run({})
    assert len(plan_s) > 1 and all(mb.shared for mb in plan_s.micro_batches)
    assert all(mb.packed == packed for mb in plan_s.micro_batches)
    assert plan_s.num_tokens < plan_p.num_tokens
    assert out_s["train/min_ratio"] == out_s["train/max_ratio"] == 1.0
    assert out_s["train/value_clip_fraction"] == 0.0 and out_s["train/optimizer_steps"] == 1.0
    for key in ("train/loss_objective", "train/loss_critic", "train/loss_entropy"):
        assert out_s[key] == pytest.approx(out_p[key], abs=1e-6), key
    assert out_s["train/grad_norm"] == pytest.approx(out_p["train/grad_norm"], rel=1e-5)
    for name in w_s:
        torch.testing.assert_close(w_s[name], w_p[name], atol=1e-5, rtol=1e-5, msg=name)
    # the step moved the trunk, whose gradient came through the shared prefixes
    trunk = [n for n in w_s if "layers.0.self_attn.q_proj" in n]
    assert trunk and all((w_s[n] - before[n]).abs().max() > 1e-4 for n in trunk)
