"""Backend completions -> the ``[B, L]`` token trajectory, through the one builder."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from tensordict import TensorDict

from ar_torchrl.data.samples import sample_from_completion
from ar_torchrl.data.trajectory import build_trajectory

if TYPE_CHECKING:
    from ar_torchrl.backends.base import Completion

__all__ = ["completions_to_trajectory"]


def completions_to_trajectory(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Completion],
    rewards: Sequence[float] | torch.Tensor,
    *,
    pad_token_id: int,
    prompt_id: Sequence[int] | None = None,
    policy_version: int | None = None,
    group_ids: Sequence[int] | None = None,
) -> TensorDict:
    """The token trajectory of backend completions: each completion with its prompt as a
    single-turn :class:`~ar_torchrl.data.samples.Sample`, built by
    :func:`~ar_torchrl.data.trajectory.build_trajectory` (the one builder; see it for the keys).

    Args:
        prompts: ``P`` prompts' token ids (``completions[b].prompt_index`` indexes them).
        completions: completions (any order; prompt-major from a backend).
        rewards: one task reward per completion.
        pad_token_id: id written in padding.
        prompt_id: the ``"prompt_id"`` of each prompt (its group for GRPO: e.g. a dataset index;
            default the prompt's index).
        policy_version: overrides the completions' own ``policy_version``.
        group_ids: the 0.1 name of ``prompt_id`` (deprecated: a ``DeprecationWarning``; removed in
            ar_torchrl 0.2).

    Example:
        >>> from ar_torchrl.backends import Completion
        >>> cs = [Completion(0, [7, 2], [-0.5, -0.1], "stop"), Completion(1, [9], [-1.0], "length")]
        >>> td = completions_to_trajectory([[4, 5], [6]], cs, [1.0, -1.0], pad_token_id=0)
        >>> td.batch_size, td["tokens"].tolist()
        (torch.Size([2, 4]), [[4, 5, 7, 2], [0, 6, 9, 0]])
    """
    if group_ids is not None:
        if prompt_id is not None:
            raise TypeError(
                "completions_to_trajectory: pass prompt_id= only (group_ids= is its old name), "
                "got both"
            )
        warnings.warn(
            "completions_to_trajectory(group_ids=...) is now prompt_id=... (the trajectory's "
            "'prompt_id' key); the old keyword goes in ar_torchrl 0.2",
            DeprecationWarning,
            stacklevel=2,
        )
        prompt_id = group_ids
    if prompt_id is not None and len(prompt_id) != len(prompts):
        raise ValueError(
            f"completions_to_trajectory: {len(prompt_id)} prompt_id for {len(prompts)} prompts"
        )
    samples = []
    for row, c in enumerate(completions):
        if not 0 <= c.prompt_index < len(prompts):
            raise ValueError(
                f"completions_to_trajectory: completion {row} has prompt_index {c.prompt_index}, "
                f"but there are {len(prompts)} prompts"
            )
        if policy_version is not None:
            c = dataclasses.replace(c, policy_version=int(policy_version))
        group = c.prompt_index if prompt_id is None else prompt_id[c.prompt_index]
        samples.append(sample_from_completion(prompts[c.prompt_index], c, prompt_id=int(group)))
    if len(rewards) != len(samples):
        raise ValueError(
            f"completions_to_trajectory: {len(rewards)} rewards for {len(samples)} completions; "
            "pass one reward per completion (prompt-major order)"
        )
    return build_trajectory(samples, pad_token_id=pad_token_id, rewards=rewards)
