"""Synthetic token trajectories in the docs/design.md section 1 layout (tests only)."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from ar_torchrl.models.tiny import build_tiny_qwen3
from ar_torchrl.modules import LMActorCritic, attach_value_head

PAD, EOS, VOCAB = 0, 2, 99


def tiny_actor_critic(seed: int = 0, **kwargs) -> LMActorCritic:
    torch.manual_seed(seed)
    return LMActorCritic(attach_value_head(build_tiny_qwen3(VOCAB, seed=seed)), **kwargs)


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
