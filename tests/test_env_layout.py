"""envs.layout: fixed-width actions from completions, and any rows back to a token trajectory."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from ar_torchrl.backends import Completion
from ar_torchrl.envs.layout import completions_to_actions, sequence_specs, sequences_to_trajectory


def _seq(prompts, responses, rewards, prompt_ids, version=2):
    width, max_new = max(map(len, prompts)), max(map(len, responses))
    n = len(prompts)
    tokens = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.bool)
    for b, p in enumerate(prompts):
        tokens[b, width - len(p) :], mask[b, width - len(p) :] = torch.tensor(p), True
    cs = [Completion(b, r, [-0.5] * len(r), "stop") for b, r in enumerate(responses)]
    for c in cs:
        c.policy_version = version
    acts = completions_to_actions(
        cs, max_new_tokens=max_new, pad_token_id=0, vocab=99, prompt_ids=prompt_ids
    )
    return TensorDict(
        {
            "prompt_tokens": tokens,
            "prompt_mask": mask,
            "prompt_id": torch.tensor(prompt_ids),
            **acts,
            "next": {"reward": torch.tensor(rewards).unsqueeze(-1)},
        },
        [n],
    )


def test_any_subset_of_rows_becomes_a_trajectory_with_its_own_width():
    seq = _seq([[5, 6, 7], [8], [9, 9]], [[10, 2], [11, 12, 2], [13]], [1.0, -1.0, 1.0], [4, 8, 8])
    td = sequences_to_trajectory(seq[torch.tensor([False, True, True])], pad_token_id=0)
    assert td.batch_size == torch.Size([2, 2 + 3])  # longest kept prompt 2, longest response 3
    assert td["tokens"].tolist() == [[0, 8, 11, 12, 2], [9, 9, 13, 0, 0]]
    assert td["prompt_id"][:, 0].tolist() == [8, 8] and (td["policy_version"] == 2).all()
    assert td["next", "reward"].sum((1, 2)).tolist() == [-1.0, 1.0]


def test_mixed_versions_are_refused_once_where_the_batch_is_built_and_bad_ids_per_row():
    a, b = Completion(0, [5], [-0.1], "stop"), Completion(0, [6], [-0.1], "stop")
    b.policy_version = 1
    actions = completions_to_actions(
        [a, b], max_new_tokens=2, pad_token_id=0, vocab=99, prompt_ids=[0, 0]
    )
    assert actions["policy_version"].tolist() == [0, 1]  # each row carries its own version
    seq = _seq([[5], [5]], [[5], [6]], [1.0, -1.0], [0, 0])
    seq["policy_version"] = torch.tensor([0, 1])
    with pytest.raises(ValueError, match=r"one batch mixes policy versions \[0, 1\]"):
        sequences_to_trajectory(seq, pad_token_id=0)
    with pytest.raises(ValueError, match=r"batch row 0 \(prompt index 7\) has token ids \[99\]"):
        completions_to_actions(
            [Completion(0, [99], [-0.1], "stop")],
            max_new_tokens=2,
            pad_token_id=0,
            vocab=99,
            prompt_ids=[7],
        )
    specs = sequence_specs(2, prompt_width=3, vocab=99, max_new=2)
    assert specs["full_action_spec"]["response_tokens"].space.high.max() == 98
