"""ppo_update: gradient accumulation over the plan's micro-batches, NaN/inf skipping, critic warm-up."""

from __future__ import annotations

import copy

import pytest
import torch
from tensordict import TensorDict

from ar_torchrl.models.tiny import build_tiny_qwen3
from ar_torchrl.modules import LMActorCritic, attach_value_head
from ar_torchrl.objectives import TokenGAE, TokenPPOLoss
from ar_torchrl.training import (
    plan_micro_batches,
    ppo_update,
    recompute_old_log_probs_and_values,
    total_loss,
)

torch.set_num_threads(1)


def make_batch(seed: int = 0, rows: int = 6, prompt: int = 4, response: int = 5) -> TensorDict:
    """A ragged token trajectory: left-padded prompts, right-padded responses, +-1 rewards."""
    g = torch.Generator().manual_seed(seed)
    length = prompt + response
    tokens = torch.randint(3, 99, (rows, length), generator=g)
    attn = torch.zeros(rows, length, dtype=torch.bool)
    loss_mask = torch.zeros_like(attn)
    reward = torch.zeros(rows, length, 1)
    done = torch.zeros(rows, length, 1, dtype=torch.bool)
    for b in range(rows):
        p = 1 + b % prompt
        n = 1 + (b * 3) % response
        attn[b, prompt - p : prompt + n] = True
        loss_mask[b, prompt : prompt + n] = True
        reward[b, prompt + n - 1] = 1.0 if b % 2 else -1.0
        done[b, prompt + n - 1] = True
    tokens[~attn] = 0
    return TensorDict(
        {
            "tokens": tokens,
            "attention_mask": attn,
            "loss_mask": loss_mask,
            "next": {"reward": reward, "done": done, "terminated": done.clone()},
        },
        [rows, length],
    )


def setup(token_budget: int, seed: int = 0):
    model = attach_value_head(build_tiny_qwen3(99, hidden_size=32, num_heads=2, seed=seed))
    ac = LMActorCritic(model)
    td = make_batch()
    plan = plan_micro_batches(td, token_budget=token_budget)
    recompute_old_log_probs_and_values(ac, td, plan)
    td = TokenGAE(gamma=1.0, lmbda=0.95)(td)
    loss = TokenPPOLoss(ac, clip_epsilon=0.2, clip_value=0.2, critic_coeff=1.0)
    return model, td, plan, loss


def test_accumulation_over_micro_batches_equals_one_big_batch():
    model_a, td, plan_a, loss_a = setup(token_budget=10_000)
    model_b, _, plan_b, loss_b = setup(token_budget=20)
    assert len(plan_a) == 1 and len(plan_b) >= 3
    opt_a = torch.optim.SGD(model_a.parameters(), lr=0.5)
    opt_b = torch.optim.SGD(model_b.parameters(), lr=0.5)
    out_a = ppo_update(loss_a, opt_a, td.clone(), plan_a, grad_clip=None)
    out_b = ppo_update(loss_b, opt_b, td.clone(), plan_b, grad_clip=None)
    assert out_a["train/optimizer_steps"] == out_b["train/optimizer_steps"] == 1.0
    assert out_a["train/loss_objective"] == pytest.approx(out_b["train/loss_objective"], abs=1e-6)
    assert out_a["train/loss_critic"] == pytest.approx(out_b["train/loss_critic"], abs=1e-6)
    assert out_a["train/grad_norm"] == pytest.approx(out_b["train/grad_norm"], rel=1e-4)
    # the first forward reproduces the anchors: ratio exactly 1 before the step
    assert out_b["train/mean_ratio"] == pytest.approx(1.0, abs=1e-6)
    for (name, pa), pb in zip(model_a.named_parameters(), model_b.parameters()):
        torch.testing.assert_close(pa, pb, atol=2e-6, rtol=1e-4, msg=name)


def test_epochs_and_minibatches_count_steps_and_clip():
    model, td, plan, loss = setup(token_budget=20)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = ppo_update(
        loss,
        opt,
        td,
        plan,
        epochs=3,
        num_minibatches=2,
        grad_clip=1e-3,
        generator=torch.Generator().manual_seed(0),
    )
    assert out["train/optimizer_steps"] == 6.0 and out["train/skipped_steps"] == 0.0
    assert out["train/grad_norm"] > 1e-3  # reported pre-clip norm


class NaNOnce:
    """Wraps a loss: the ``bad_call``-th call returns a NaN objective (tests step skipping)."""

    def __init__(self, loss, bad_call: int, value: float = float("nan")):
        self.loss, self.bad_call, self.value, self.calls = loss, bad_call, value, 0

    def global_normalizer(self, tds):
        return self.loss.global_normalizer(tds)

    def __call__(self, td, normalizer=None):
        self.calls += 1
        out = self.loss(td, normalizer=normalizer)
        if self.calls == self.bad_call:
            out["loss_objective"] = out["loss_objective"] * self.value
        return out


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_loss_skips_the_step_and_counts_it(value):
    model, td, plan, loss = setup(token_budget=10_000)
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = ppo_update(NaNOnce(loss, bad_call=1, value=value), opt, td, plan, epochs=2)
    assert out["train/skipped_steps"] == 1.0 and out["train/optimizer_steps"] == 1.0
    # the skipped step left no gradient behind; the other step trained
    changed = [n for n, p in model.state_dict().items() if not torch.equal(p, before[n])]
    assert changed


def test_all_steps_non_finite_leaves_weights_untouched():
    model, td, plan, loss = setup(token_budget=20)
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    bad = NaNOnce(loss, bad_call=2)  # the second micro-batch of the only mini-batch
    out = ppo_update(bad, opt, td, plan, epochs=1)
    assert out == {"train/optimizer_steps": 0.0, "train/skipped_steps": 1.0}
    for name, p in model.state_dict().items():
        assert torch.equal(p, before[name]), name


def test_critic_warmup_updates_only_the_value_head():
    model, td, plan, loss = setup(token_budget=10_000)
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = ppo_update(
        loss,
        opt,
        td,
        plan,
        loss_keys=("loss_critic",),
        trainable=list(model.value_head.parameters()),
    )
    assert out["train/optimizer_steps"] == 1.0
    changed = {n for n, p in model.state_dict().items() if not torch.equal(p, before[n])}
    assert changed == {"value_head.weight", "value_head.bias"}


def test_errors_name_what_is_wrong():
    model, td, plan, loss = setup(token_budget=10_000)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"plan was made for batch size \(6, 9\), got \(3, 9\)"):
        ppo_update(loss, opt, td[:3], plan)
    with pytest.raises(ValueError, match="epochs must be >= 1, got 0"):
        ppo_update(loss, opt, td, plan, epochs=0)
    with pytest.raises(KeyError, match=r"no \['loss_foo'\]"):
        total_loss(TensorDict({"loss_objective": torch.tensor(1.0)}, []), ["loss_foo"])
    with pytest.raises(TypeError, match="has no global_normalizer"):
        ppo_update(lambda td, normalizer=None: None, opt, td, plan)


@pytest.mark.parametrize("bad", [0, -1.0])
def test_ppo_update_rejects_zero_or_negative_grad_clip(bad):
    """grad_clip=-1 used to flip the gradient's sign, grad_clip=0 froze training silently."""
    w = torch.nn.Parameter(torch.ones(1))
    td = TensorDict({"attention_mask": torch.ones(2, 3, dtype=torch.bool)}, [2, 3])
    plan = plan_micro_batches(td, token_budget=6)
    with pytest.raises(ValueError, match=r"ppo_update: grad_clip must be > 0, got"):
        ppo_update(
            lambda td, normalizer: None,
            torch.optim.SGD([w], lr=0.1),
            td,
            plan,
            grad_clip=bad,
            normalizer=lambda m: 1.0,
        )


@pytest.mark.parametrize(
    ("kwargs", "error", "msg"),
    [
        ({"num_minibatches": 0}, ValueError, r"ppo_update: num_minibatches must be >= 1, got 0"),
        ({"epochs": 1.5}, TypeError, r"ppo_update: epochs must be an integer, got 1.5 \(float\)"),
        ({"epochs": True}, TypeError, r"ppo_update: epochs must be an integer, got True \(bool\)"),
    ],
)
def test_ppo_update_checks_its_integer_arguments(kwargs, error, msg):
    w = torch.nn.Parameter(torch.ones(1))
    td = TensorDict({"attention_mask": torch.ones(2, 3, dtype=torch.bool)}, [2, 3])
    plan = plan_micro_batches(td, token_budget=6)
    with pytest.raises(error, match=msg):
        ppo_update(
            lambda td, normalizer: None,
            torch.optim.SGD([w], lr=0.1),
            td,
            plan,
            normalizer=lambda m: 1.0,
            **kwargs,
        )
