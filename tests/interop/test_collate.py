"""completions_to_trajectory: the [B, L] layout of docs/design.md section 1, exactly."""

from __future__ import annotations

import pytest
import torch

from ar_torchrl.backends import Completion
from ar_torchrl.interop import completions_to_trajectory

PAD = 0


def make_batch():
    prompts = [[11, 12, 13], [21]]
    completions = [
        Completion(0, [31, 2], [-0.5, -0.25], "stop"),
        Completion(0, [32, 33, 34], [-1.0, -2.0, -3.0], "length"),
        Completion(1, [0], [-0.75], "stop"),  # a sampled token equal to the pad id
        Completion(1, [41, 42, 43], [-0.1, -0.2, -0.3], "abort"),
    ]
    return prompts, completions


def test_layout_left_pad_prompt_right_pad_response():
    prompts, completions = make_batch()
    td = completions_to_trajectory(
        prompts,
        completions,
        [1.0, -1.0, 0.5, -0.5],
        pad_token_id=PAD,
        prompt_id=[7, 9],
        policy_version=3,
    )
    assert td.batch_size == torch.Size([4, 6])
    assert td["tokens"].tolist() == [
        [11, 12, 13, 31, 2, PAD],
        [11, 12, 13, 32, 33, 34],
        [PAD, PAD, 21, 0, PAD, PAD],
        [PAD, PAD, 21, 41, 42, 43],
    ]
    assert td["attention_mask"].int().tolist() == [
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 1],
    ]
    assert td["loss_mask"].int().tolist() == [
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 1, 1, 1],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1, 1],
    ]
    expected_lp = [
        [0, 0, 0, -0.5, -0.25, 0],
        [0, 0, 0, -1.0, -2.0, -3.0],
        [0, 0, 0, -0.75, 0, 0],
        [0, 0, 0, -0.1, -0.2, -0.3],
    ]
    torch.testing.assert_close(td["rollout_log_prob"], torch.tensor(expected_lp), atol=0, rtol=0)
    assert td["rollout_log_prob"].dtype == torch.float32
    reward = td["next", "reward"].squeeze(-1)
    assert reward.tolist() == [
        [0, 0, 0, 0, 1.0, 0],
        [0, 0, 0, 0, 0, -1.0],
        [0, 0, 0, 0.5, 0, 0],
        [0, 0, 0, 0, 0, -0.5],
    ]
    last = [[4], [5], [3], [5]]
    done = td["next", "done"].squeeze(-1)
    assert [row.nonzero().flatten().tolist() for row in done] == last
    terminated = td["next", "terminated"].squeeze(-1)
    assert terminated.any(-1).tolist() == [True, False, True, False]  # cut by length/abort -> False
    assert (td["next", "truncated"].squeeze(-1) == done & ~terminated).all()
    for key in ("done", "terminated", "truncated"):
        assert td[key].shape == (4, 6, 1) and not td[key].any()
    assert (
        td["prompt_id"][:, 0].tolist() == [7, 7, 9, 9]
        and (td["prompt_id"] == td["prompt_id"][:, :1]).all()
    )
    assert (td["policy_version"] == 3).all() and td["policy_version"].dtype == torch.int64


def test_default_prompt_ids_are_prompt_indices():
    prompts, completions = make_batch()
    td = completions_to_trajectory(prompts, completions, [0.0] * 4, pad_token_id=PAD)
    assert td["prompt_id"][:, -1].tolist() == [0, 0, 1, 1]


def test_errors_name_the_problem():
    prompts, completions = make_batch()
    with pytest.raises(ValueError, match="3 rewards for 4 completions"):
        completions_to_trajectory(prompts, completions, [0.0] * 3, pad_token_id=PAD)
    empty = [*completions[:3], Completion(1, [], [], "abort")]
    with pytest.raises(
        ValueError, match=r"sample 3 \(prompt 1, finish 'abort'\) has no trained token"
    ):
        completions_to_trajectory(prompts, empty, [0.0] * 4, pad_token_id=PAD)
    with pytest.raises(
        ValueError, match="completion 0 has prompt_index 5, but there are 2 prompts"
    ):
        completions_to_trajectory(
            prompts, [Completion(5, [1], [0.0], "stop")], [0.0], pad_token_id=PAD
        )
    with pytest.raises(ValueError, match="1 prompt_id for 2 prompts"):
        completions_to_trajectory(prompts, completions, [0.0] * 4, pad_token_id=PAD, prompt_id=[1])


def test_group_ids_is_the_deprecated_name_of_prompt_id():
    prompts, completions = make_batch()
    rewards = [1.0, -1.0, 0.5, -0.5]
    new = completions_to_trajectory(
        prompts, completions, rewards, pad_token_id=PAD, prompt_id=[7, 9]
    )
    with pytest.warns(DeprecationWarning, match=r"group_ids=\.\.\.\) is now prompt_id="):
        old = completions_to_trajectory(
            prompts, completions, rewards, pad_token_id=PAD, group_ids=[7, 9]
        )
    assert old["prompt_id"][:, 0].tolist() == [7, 7, 9, 9]
    assert all(torch.equal(old[k], new[k]) for k in new.keys(True, True))
    with pytest.raises(TypeError, match=r"pass prompt_id= only \(group_ids= is its old name\)"):
        completions_to_trajectory(
            prompts, completions, rewards, pad_token_id=PAD, prompt_id=[7, 9], group_ids=[7, 9]
        )
