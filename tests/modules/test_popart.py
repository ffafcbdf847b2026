"""PopArt normalised value targets (ar_torchrl.functional.popart, PopArtValueHead,
``algo.value_norm=popart``): the statistics against a plain loop, predictions preserved to 1e-6
across statistics updates, the value loss computed on the normalised scale, and the recipe."""

from __future__ import annotations

import math

import pytest
import torch
from support.trajectories import make_trajectory, tiny_actor_critic

from ar_torchrl.functional import clipped_value_loss
from ar_torchrl.functional.popart import popart_rescale, popart_sigma, popart_statistics
from ar_torchrl.modules import PopArtValueHead, attach_value_head

F64 = torch.float64


def test_statistics_against_a_plain_loop():
    g = torch.Generator().manual_seed(0)
    mu, nu, beta = torch.tensor(0.0, dtype=F64), torch.tensor(1.0, dtype=F64), 0.3
    m, s = 0.0, 1.0
    for k in range(6):
        t = torch.randn(7, generator=g, dtype=F64) * 3 + k
        mu, nu = popart_statistics(mu, nu, t, beta=beta, first=k == 0)
        batch_m = sum(t.tolist()) / 7
        batch_s = sum(x * x for x in t.tolist()) / 7
        m, s = (
            (batch_m, batch_s)
            if k == 0
            else ((1 - beta) * m + beta * batch_m, (1 - beta) * s + beta * batch_s)
        )
        assert mu.item() == pytest.approx(m, rel=1e-12) and nu.item() == pytest.approx(s, rel=1e-12)
    assert popart_sigma(mu, nu).item() == pytest.approx(math.sqrt(s - m * m), rel=1e-12)
    assert popart_sigma(torch.tensor(2.0), torch.tensor(4.0), eps=1e-3).item() == pytest.approx(
        1e-3
    )
    with pytest.raises(ValueError, match="non-empty 1-D tensor, got shape"):
        popart_statistics(mu, nu, torch.zeros(2, 2), beta=0.1)
    with pytest.raises(ValueError, match=r"beta must be in \(0, 1\], got 0"):
        popart_statistics(mu, nu, torch.zeros(2), beta=0)


@pytest.mark.parametrize("seed", range(3))
def test_predictions_are_preserved_to_1e_6_across_statistics_updates(seed):
    g = torch.Generator().manual_seed(seed)
    head = PopArtValueHead(16, beta=0.5)
    with torch.no_grad():
        head.weight.copy_(torch.randn(1, 16, generator=g) * 0.1)
        head.bias.fill_(0.2)
    hidden = torch.randn(5, 9, 16, generator=g)
    for k in range(5):  # returns drifting in scale and offset, as rewards do while learning
        before = head(hidden)
        head.update_statistics(torch.randn(40, generator=g) * (1 + 0.5 * k) + 0.5 * k)
        after = head(hidden)
        torch.testing.assert_close(after, before, atol=1e-6, rtol=0)
        n = head.normalize(after)
        torch.testing.assert_close(n, torch.nn.functional.linear(hidden, head.weight, head.bias))
    assert head.mu.item() != 0 and head.sigma.item() != 1 and int(head.updates) == 5
    # returns 100x larger: float32 resolves V to ~1e-7 * sigma, so preserved to 1e-6 * sigma
    before = head(hidden)
    head.update_statistics(torch.randn(40, generator=g) * 300 + 1000)
    diff = (head(hidden) - before).abs().max().item()
    assert diff <= 1e-6 * head.sigma.item(), (diff, head.sigma.item())


def test_rescale_closed_form():
    w, b = torch.tensor([[2.0, -1.0]], dtype=F64), torch.tensor([0.5], dtype=F64)
    mu, sigma, mu2, sigma2 = (torch.tensor(x, dtype=F64) for x in (1.0, 2.0, -3.0, 0.5))
    w2, b2 = popart_rescale(w, b, mu, sigma, mu2, sigma2)
    torch.testing.assert_close(w2, w * 4.0)
    torch.testing.assert_close(b2, torch.tensor([(2.0 * 0.5 + 1.0 + 3.0) / 0.5], dtype=F64))


def test_the_value_loss_is_computed_on_the_normalised_scale():
    from ar_torchrl.objectives import TokenGAE, TokenPPOLoss
    from ar_torchrl.training import recompute_old_log_probs_and_values
    from ar_torchrl.training.micro_batch import plan_micro_batches

    ac = tiny_actor_critic(0)
    model = ac.model
    del model.value_head
    attach_value_head(model, popart_beta=1.0)
    head = model.value_head
    td = make_trajectory([3, 4, 2], [5, 3, 6], seed=1)
    r = td["next", "reward"]  # outcomes 15, -5, 15: returns far from unit scale
    outcome = torch.tensor([15.0, -5.0, 15.0]).view(3, 1, 1)
    td["next", "reward"] = torch.where(r != 0, outcome.expand_as(r), r)
    recompute_old_log_probs_and_values(ac, td, plan_micro_batches(td, token_budget=1000))
    td = TokenGAE()(td)
    mask = td["loss_mask"]
    head.update_statistics(td["value_target"][mask])
    assert head.sigma.item() > 3
    loss = TokenPPOLoss(ac, clip_value=0.2)
    out = loss(td)
    value = ac(td.select(*ac.in_keys))["state_value"].squeeze(-1).detach()
    per_token, _ = clipped_value_loss(
        head.normalize(value),
        head.normalize(td["state_value"].squeeze(-1)),
        head.normalize(td["value_target"].squeeze(-1)),
        mask,
        clip_value=0.2,
    )
    expect = per_token[mask].mean()
    torch.testing.assert_close(out["loss_critic"].detach(), expect)
    out["loss_critic"].backward()
    assert head.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="already has a plain ValueHead"):
        attach_value_head(tiny_actor_critic(0).model, popart_beta=0.1)
    assert {"value_head.mu", "value_head.nu", "value_head.updates"} <= model._keys_to_ignore_on_save


@pytest.mark.slow
def test_recipe_with_popart_and_critic_epochs(tmp_path, cache_dir):
    from support.recipe_runs import run_recipe

    _, history = run_recipe(
        tmp_path / "run",
        cache_dir,
        "algo.value_norm=popart",
        "algo.critic_epochs=2",  # and one more value-head pass per actor pass
        "train.iterations=2",
        "train.eval_every=0",
        "train.checkpoint_every=0",
        "train.plot=false",
        "logger=none",
    )
    steps = [h for h in history if "train/value_norm_sigma" in h]
    assert len(steps) == 2
    assert all(math.isfinite(v) for h in steps for v in h.values() if isinstance(v, float))
    assert steps[0]["train/value_norm_sigma"] != 1.0 and "train/loss_critic" in steps[-1]
    # algo.critic_epochs=2: as many extra value-head-only optimizer steps as joint ones
    assert all(
        h["train/critic_extra/optimizer_steps"] == h["train/optimizer_steps"] > 0 for h in steps
    )


def test_popart_on_a_model_built_on_the_meta_device(tmp_path):
    """algo.value_norm=popart on the FSDP2 path that builds model.path on meta: the PopArt layer is
    sharded and loaded with the rest; a saved PopArt head (statistics included) predicts as before."""
    from ar_torchrl.distributed import distributed, load_pretrained_weights, shard_actor_critic
    from ar_torchrl.distributed.loading import build_meta_model
    from ar_torchrl.modules import LMActorCritic, save_policy
    from ar_torchrl.recipes.dapo_ppo.build import use_popart

    saved = tiny_actor_critic(0).model
    use_popart(saved, 0.5)
    torch.nn.init.normal_(saved.value_head.weight)
    saved.value_head.update_statistics(torch.tensor([3.0, 9.0, 12.0]))
    save_policy(saved, tmp_path / "policy")
    h = torch.randn(3, saved.config.hidden_size)
    want = saved.value_head(h)
    with distributed("cpu", process_group=True) as ctx:
        model = build_meta_model(tmp_path / "policy")
        use_popart(model, 0.5)
        assert model.value_head.weight.is_meta and not model.value_head.mu.is_meta
        ac = shard_actor_critic(LMActorCritic(model), ctx, compute_dtype="float32")
        info = load_pretrained_weights(ac, tmp_path / "policy")
        head = ac.model.value_head
        assert isinstance(head, PopArtValueHead) and info["value_head"].endswith(".safetensors")
        assert float(head.mu) == float(saved.value_head.mu) != 0.0
        assert torch.equal(head.weight.full_tensor(), saved.value_head.weight)
        got = torch.nn.functional.linear(h, head.weight.full_tensor(), head.bias.full_tensor())
        assert torch.allclose(got.double() * head.sigma + head.mu, want.double(), atol=1e-6)
