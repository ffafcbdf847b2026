"""Synthetic token trajectories in the docs/design.md section 1 layout (tests only)."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from ar_torchrl.models.tiny import build_tiny_qwen3
from ar_torchrl.modules import LMActorCritic, attach_confidence_features, attach_value_head

PAD, EOS, VOCAB = 0, 2, 99


def tiny_actor_critic(seed: int = 0, **kwargs) -> LMActorCritic:
    torch.manual_seed(seed)
    return LMActorCritic(attach_value_head(build_tiny_qwen3(VOCAB, seed=seed)), **kwargs)


def with_confidence(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Attach confidence features to ``model``'s value head with non-zero MLP weights (N(0, 0.25),
    drawn from ``seed``): a fresh MLP's last layer is zero, so its term would change nothing."""
    attach_confidence_features(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.value_head.confidence.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def make_trajectory(
    prompt_lens: list[int],
    response_lens: list[int],
    *,
    seed: int = 0,
    group_size: int = 1,
    terminated: list[bool] | None = None,
) -> TensorDict:
    """Left-padded prompts + right-padded responses; reward +-1 on the last generated token."""
    g = torch.Generator().manual_seed(seed)
    batch = len(prompt_lens)
    max_p = max(prompt_lens)
    length = max_p + max(response_lens)
    tokens = torch.full((batch, length), PAD, dtype=torch.long)
    attn = torch.zeros(batch, length, dtype=torch.bool)
    loss_mask = torch.zeros(batch, length, dtype=torch.bool)
    reward = torch.zeros(batch, length, 1)
    done = torch.zeros(batch, length, 1, dtype=torch.bool)
    term = torch.zeros(batch, length, 1, dtype=torch.bool)
    for b, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        tokens[b, max_p - p : max_p + r] = torch.randint(3, VOCAB, (p + r,), generator=g)
        attn[b, max_p - p : max_p + r] = True
        loss_mask[b, max_p : max_p + r] = True
        last = max_p + r - 1
        reward[b, last] = 1.0 if torch.rand((), generator=g) < 0.5 else -1.0
        done[b, last] = True
        term[b, last] = True if terminated is None else terminated[b]
    prompt_id = (torch.arange(batch) // group_size).unsqueeze(-1).expand(batch, length).clone()
    return TensorDict(
        {
            "tokens": tokens,
            "attention_mask": attn,
            "loss_mask": loss_mask,
            "rollout_log_prob": torch.where(
                loss_mask, -torch.rand(batch, length, generator=g), 0.0
            ),
            "prompt_id": prompt_id,
            "next": {"reward": reward, "done": done, "terminated": term},
        },
        batch_size=[batch, length],
    )


def first_update_has_ratio_one(ac: LMActorCritic, td: TensorDict, plan) -> None:
    """Anchors over ``plan``, GAE, then the PPO loss on every micro-batch of ``plan``: the first
    update's ratios are exactly 1 (min and max); each micro-batch's actor + critic loss is
    backpropagated (the caller checks the gradients it cares about)."""
    from ar_torchrl.objectives import TokenGAE, TokenPPOLoss
    from ar_torchrl.training import recompute_old_log_probs_and_values

    recompute_old_log_probs_and_values(ac, td, plan)
    TokenGAE(gamma=1.0, lmbda=0.95)(td)
    loss = TokenPPOLoss(ac)
    for mb in plan.micro_batches:
        out = loss(plan.crop(td, mb))
        assert out["min_ratio"].item() == out["max_ratio"].item() == 1.0
        (out["loss_objective"] + out["loss_critic"]).backward()


PROMPTS = [3, 6, 2, 5, 4, 1]


RESPONSES = [5, 2, 7, 3, 6, 4]


def group_batch(seed=0, group_size=2):
    return make_trajectory(PROMPTS, RESPONSES, seed=seed, group_size=group_size)


def perturb(model, scale=0.05, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def tiny_batch(seed: int = 0):
    """The tests' tiny model and a trajectory whose anchors are perturbed (ratios != 1)."""
    from support.trajectories import make_trajectory, tiny_actor_critic

    ac = tiny_actor_critic(seed)
    td = make_trajectory([3, 4, 2], [5, 3, 6], seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        anchors = ac(td.select(*ac.in_keys))
    mask = td["loss_mask"]
    noise = 0.3 * torch.randn(mask.shape, generator=g)
    td["sample_log_prob"] = torch.where(mask, anchors["log_prob"] + noise, 0.0)
    td["state_value"] = anchors["state_value"]
    td["advantage"] = torch.randn(*mask.shape, 1, generator=g)
    td["value_target"] = torch.randn(*mask.shape, 1, generator=g)
    return ac, td


def shared_prompt_batch(groups: int, n: int, *, seed: int = 0, max_response: int = 9) -> TensorDict:
    """``groups`` prompts of varied lengths x ``n`` responses each (the rows of a prompt share its
    tokens, left-padded, as the n samples of a prompt do), rows shuffled; rewards +-1 on the last
    response token."""
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(3, VOCAB, (int(torch.randint(4, 12, (), generator=g)),), generator=g)
        for _ in range(groups)
    ]
    order = torch.randperm(groups * n, generator=g).tolist()
    responses = [int(torch.randint(1, max_response + 1, (), generator=g)) for _ in order]
    td = make_trajectory([len(prompts[i // n]) for i in order], responses, seed=seed)
    width = max(len(p) for p in prompts)
    for b, i in enumerate(order):
        p = prompts[i // n]
        td["tokens"][b, width - len(p) : width] = p
        td["prompt_id"][b] = i // n
    return td
