"""Collate backend completions into the ``[B, L]`` token trajectory of docs/design.md section 1."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict

from ar_torchrl.backends.base import Completion

__all__ = ["completions_to_trajectory"]


def _check_inputs(prompts, completions, rewards, prompt_id) -> None:
    if not completions:
        raise ValueError("completions_to_trajectory: got no completions")
    if len(rewards) != len(completions):
        raise ValueError(
            f"completions_to_trajectory: {len(rewards)} rewards for {len(completions)} completions; "
            "pass one reward per completion (prompt-major order)"
        )
    if prompt_id is not None and len(prompt_id) != len(prompts):
        raise ValueError(
            f"completions_to_trajectory: {len(prompt_id)} prompt_id for {len(prompts)} prompts"
        )
    for row, c in enumerate(completions):
        if not 0 <= c.prompt_index < len(prompts):
            raise ValueError(
                f"completions_to_trajectory: completion {row} has prompt_index {c.prompt_index}, "
                f"but there are {len(prompts)} prompts"
            )
        if len(c) == 0:
            raise ValueError(
                f"completions_to_trajectory: completion {row} (prompt {c.prompt_index}, finish "
                f"{c.finish_reason!r}) has no tokens; there is no token to put its reward on"
            )


def completions_to_trajectory(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Completion],
    rewards: Sequence[float] | torch.Tensor,
    *,
    pad_token_id: int,
    prompt_id: Sequence[int] | None = None,
    policy_version: int = 0,
) -> TensorDict:
    """Build the token trajectory: left-padded prompt, right-padded response, one row per completion.

    Row ``b`` holds ``prompts[completions[b].prompt_index]`` right-aligned in the first ``P``
    columns (``P`` = longest prompt) and the completion from column ``P`` on; ``L = P + R`` with
    ``R`` the longest completion. Written keys (all with batch size ``[B, L]``):

    - ``"tokens"`` int64 (``pad_token_id`` where ``attention_mask`` is False),
      ``"attention_mask"``, ``"loss_mask"`` (generated tokens only) bool;
    - ``"rollout_log_prob"`` float32 (the backend's log-probs, 0 off ``loss_mask``);
    - ``("next", "reward")`` ``[B, L, 1]`` float32: ``rewards[b]`` on the last generated token;
    - ``("next", "done")`` True and ``("next", "terminated")`` True on the last generated token when
      it was a stop (``finish_reason == "stop"``); a completion cut by length or aborted is
      ``("next", "truncated")`` instead. Root ``"done"``/``"terminated"``/``"truncated"`` are False
      (TorchRL's convention: the done state of the *current* step);
    - ``"prompt_id"`` int64 (``prompt_id[prompt_index]``, default ``prompt_index``) and
      ``"policy_version"`` int64, broadcast along ``L``.

    Args:
        prompts: ``P`` prompts' token ids.
        completions: completions (any order; prompt-major from a backend).
        rewards: one task reward per completion.
        pad_token_id: id written in padding (masks, not ids, say what is padding).
        prompt_id: GRPO group id of each prompt (e.g. a dataset index).
        policy_version: weight version that produced the completions.

    Example:
        >>> cs = [Completion(0, [7, 2], [-0.5, -0.1], "stop"), Completion(1, [9], [-1.0], "length")]
        >>> td = completions_to_trajectory([[4, 5], [6]], cs, [1.0, -1.0], pad_token_id=0)
        >>> td.batch_size, td["tokens"].tolist()
        (torch.Size([2, 4]), [[4, 5, 7, 2], [0, 6, 9, 0]])
        >>> td["next", "reward"].squeeze(-1).tolist()
        [[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, -1.0, 0.0]]
        >>> td["next", "terminated"].squeeze(-1).any(-1).tolist()
        [True, False]
    """
    _check_inputs(prompts, completions, rewards, prompt_id)
    n_rows = len(completions)
    width_p = max(len(prompts[c.prompt_index]) for c in completions)
    width = width_p + max(len(c) for c in completions)
    tokens = torch.full((n_rows, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((n_rows, width), dtype=torch.bool)
    loss_mask = torch.zeros((n_rows, width), dtype=torch.bool)
    log_prob = torch.zeros((n_rows, width), dtype=torch.float32)
    last = torch.zeros(n_rows, dtype=torch.long)
    for row, c in enumerate(completions):
        prompt = list(prompts[c.prompt_index])
        start, end = width_p - len(prompt), width_p + len(c)
        tokens[row, start:end] = torch.tensor(prompt + list(c.token_ids), dtype=torch.long)
        attention[row, start:end] = True
        loss_mask[row, width_p:end] = True
        log_prob[row, width_p:end] = torch.tensor(c.log_probs, dtype=torch.float32)
        last[row] = end - 1
    rows = torch.arange(n_rows)
    reward = torch.zeros((n_rows, width, 1), dtype=torch.float32)
    reward[rows, last, 0] = torch.as_tensor(rewards, dtype=torch.float32)
    done = torch.zeros((n_rows, width, 1), dtype=torch.bool)
    done[rows, last, 0] = True
    stop = torch.tensor([c.finish_reason == "stop" for c in completions])
    terminated = done & stop.view(-1, 1, 1)
    groups = [
        c.prompt_index if prompt_id is None else prompt_id[c.prompt_index] for c in completions
    ]
    false = torch.zeros((n_rows, width, 1), dtype=torch.bool)
    return TensorDict(
        {
            "tokens": tokens,
            "attention_mask": attention,
            "loss_mask": loss_mask,
            "rollout_log_prob": log_prob,
            "prompt_id": torch.tensor(groups, dtype=torch.long)
            .unsqueeze(-1)
            .expand(-1, width)
            .clone(),
            "policy_version": torch.full((n_rows, width), int(policy_version), dtype=torch.long),
            "done": false,
            "terminated": false.clone(),
            "truncated": false.clone(),
            "next": {
                "reward": reward,
                "done": done,
                "terminated": terminated,
                "truncated": done & ~terminated,
            },
        },
        batch_size=[n_rows, width],
    )
