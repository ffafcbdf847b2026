"""The one trajectory builder (ar_torchrl.data.trajectory.build_trajectory) against a plain loop
over random samples: prompts, trained segments and untrained tool segments anywhere, rows of
different lengths, stop and length finishes; one version per batch; turn ids; reward overrides."""

from __future__ import annotations

import random

import pytest
import torch

from ar_torchrl.backends import Completion
from ar_torchrl.data.samples import Sample, Segment, sample_from_completion
from ar_torchrl.data.trajectory import build_trajectory

PAD = 0


def random_sample(rng: random.Random, *, turns: bool) -> Sample:
    segments = [Segment([rng.randint(1, 90) for _ in range(rng.randint(1, 6))])]  # the prompt
    for turn in range(rng.randint(1, 3)):
        n = rng.randint(1, 5)
        segments.append(
            Segment(
                [rng.randint(1, 90) for _ in range(n)],
                trained=True,
                log_probs=[-rng.random() for _ in range(n)],
                policy_version=4,
                turn=turn if turns else None,
            )
        )
        if rng.random() < 0.5:  # a tool answer between turns (or after the last one)
            segments.append(Segment([rng.randint(1, 90) for _ in range(rng.randint(1, 4))]))
    return Sample(
        segments,
        prompt_id=rng.randint(0, 5),
        finish_reason=rng.choice(["stop", "length"]),
        reward=rng.choice([-1.0, 0.5, 1.0]),
    )


def loop_trajectory(samples):
    """The layout written row by row, position by position (the obviously-correct twin)."""
    heads = [s.first_trained for s in samples]
    p = [sum(len(x) for x in s.segments[:k]) for s, k in zip(samples, heads)]
    r = [sum(len(x) for x in s.segments[k:]) for s, k in zip(samples, heads)]
    width_p, width = max(p), max(p) + max(r)
    out = {k: [[0] * width for _ in samples] for k in ("tokens", "attn", "loss", "turn")}
    out["lp"] = [[0.0] * width for _ in samples]
    out["reward"] = [[0.0] * width for _ in samples]
    out["done"] = [[False] * width for _ in samples]
    for b, s in enumerate(samples):
        col = width_p - p[b]
        out["turn"][b] = [-1] * width
        for seg in s.segments:
            for i, t in enumerate(seg.token_ids):
                out["tokens"][b][col] = t
                out["attn"][b][col] = 1
                if seg.trained:
                    out["loss"][b][col] = 1
                    out["lp"][b][col] = seg.log_probs[i]
                    out["turn"][b][col] = -1 if seg.turn is None else seg.turn
                col += 1
        last = max(c for c in range(width) if out["loss"][b][c])
        out["reward"][b][last], out["done"][b][last] = s.reward, True
    return out


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("turns", [False, True])
def test_builder_equals_the_loop(seed, turns):
    rng = random.Random(seed)
    samples = [random_sample(rng, turns=turns) for _ in range(rng.randint(1, 7))]
    td = build_trajectory(samples, pad_token_id=PAD)
    want = loop_trajectory(samples)
    assert td["tokens"].tolist() == want["tokens"]
    assert td["attention_mask"].long().tolist() == want["attn"]
    assert td["loss_mask"].long().tolist() == want["loss"]
    torch.testing.assert_close(td["rollout_log_prob"], torch.tensor(want["lp"]), rtol=0, atol=0)
    torch.testing.assert_close(td["next", "reward"].squeeze(-1), torch.tensor(want["reward"]))
    done = td["next", "done"].squeeze(-1)
    assert done.tolist() == want["done"]
    stop = torch.tensor([s.finish_reason == "stop" for s in samples]).unsqueeze(-1)
    assert torch.equal(td["next", "terminated"].squeeze(-1), done & stop)
    assert torch.equal(td["next", "truncated"].squeeze(-1), done & ~stop)
    assert td["prompt_id"].tolist() == [[s.prompt_id] * td.shape[1] for s in samples]
    assert (td["policy_version"] == 4).all() and not td["done"].any()
    assert ("turn_id" in td.keys()) == turns
    if turns:
        assert td["turn_id"].tolist() == want["turn"]
        turn = td["turn_id"]  # non-decreasing along each row's trained tokens (AReaL's contract)
        for b in range(len(samples)):
            t = turn[b][td["loss_mask"][b]]
            assert (t[1:] >= t[:-1]).all()


def test_single_turn_samples_of_completions_and_reward_override():
    cs = [Completion(0, [7, 2], [-0.5, -0.1], "stop"), Completion(1, [9], [-1.0], "length")]
    samples = [
        sample_from_completion([4, 5], cs[0], prompt_id=3),
        sample_from_completion([6], cs[1], prompt_id=8),
    ]
    td = build_trajectory(samples, pad_token_id=PAD, rewards=torch.tensor([[2.0], [-3.0]]))
    assert td["tokens"].tolist() == [[4, 5, 7, 2], [0, 6, 9, 0]]
    assert td["next", "reward"].sum((1, 2)).tolist() == [2.0, -3.0]  # e.g. a transform's rewards
    assert td["prompt_id"][:, 0].tolist() == [3, 8]


def test_one_batch_one_version_and_clear_errors():
    a = Sample([Segment([1]), Segment([2], True, [-0.1], policy_version=1)])
    b = Sample([Segment([1]), Segment([3], True, [-0.1], policy_version=2)])
    with pytest.raises(ValueError, match=r"one batch mixes policy versions \[1, 2\]"):
        build_trajectory([a, b], pad_token_id=PAD)
    with pytest.raises(ValueError, match="got no samples"):
        build_trajectory([], pad_token_id=PAD)
    empty = Sample([Segment([1, 2])], prompt_id=5)
    with pytest.raises(
        ValueError, match=r"sample 0 \(prompt 5, finish 'stop'\) has no trained token"
    ):
        build_trajectory([empty], pad_token_id=PAD)
    bad = Sample([Segment([1]), Segment([2, 3], True, [-0.1])])
    with pytest.raises(ValueError, match="trained segment of 2 tokens with 1 log-probs"):
        build_trajectory([bad], pad_token_id=PAD)
    with pytest.raises(ValueError, match="1 rewards for 2 samples"):
        build_trajectory([a, a], pad_token_id=PAD, rewards=[1.0])
