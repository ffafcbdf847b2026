"""benchmarks/experiments/critic_targets.py without sampling a policy: the state-mean target
against a loop, one training epoch of a tiny critic on synthetic trajectories, and the table."""

from __future__ import annotations

import argparse

import pytest
import torch
from support.bench_helpers import load_benchmark


def _data(seed: int = 0, rows: int = 12, width: int = 7) -> dict:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 9, (rows, width), generator=g)
    tokens[:, :2] = torch.arange(rows).unsqueeze(-1) // 4 + 10  # 3 prompts x 4 samples
    tokens[:, 2] = torch.randint(3, 5, (rows,), generator=g)  # a shared first response token
    attention = torch.ones(rows, width, dtype=torch.bool)
    mask = attention.clone()
    mask[:, :2] = False
    outcome = torch.where(torch.rand(rows, generator=g) < 0.5, 1.0, -1.0)
    from ar_torchrl.functional import prefix_state_ids

    states = prefix_state_ids(tokens, attention)
    return {
        "tokens": tokens,
        "attention_mask": attention,
        "loss_mask": mask,
        "returns": torch.where(mask, outcome.unsqueeze(-1), 0.0),
        "states": states,
        "prompt": states[:, 2],
        "log_prob": torch.where(mask, -torch.rand(rows, width, generator=g) * 3, 0.0),
    }


def test_state_means_are_the_mean_return_of_each_state_over_the_training_tokens():
    m = load_benchmark("critic_targets")
    data = _data()
    got = m.state_means(data)
    mask, states, returns = data["loss_mask"], data["states"], data["returns"]
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[b, t]:
                assert got[b, t] == 0.0
                continue
            same = [
                float(returns[i, j])
                for i in range(mask.shape[0])
                for j in range(mask.shape[1])
                if mask[i, j] and states[i, j] == states[b, t]
            ]
            assert float(got[b, t]) == pytest.approx(sum(same) / len(same), abs=1e-6)


def test_an_epoch_trains_and_evaluates_and_the_table_names_the_ceiling():
    from ar_torchrl.models.tiny import build_tiny_qwen3
    from ar_torchrl.modules import build_separate_critic

    m = load_benchmark("critic_targets")
    data = _data()
    args = argparse.Namespace(seed=0, lr=3e-3, epochs=2, batch=5)
    critic = build_separate_critic(build_tiny_qwen3(20, seed=0))
    records = m.train(critic, data, m.state_means(data), args, _data(1), "state means")
    assert [r["epoch"] for r in records] == [1, 2]
    assert set(m.KEYS) <= set(records[-1]) and records[-1]["loss"] < records[0]["loss"] + 1.0
    # a zero value head predicts 0 everywhere before training: EV of a constant is 0
    fresh = m.evaluate(build_separate_critic(build_tiny_qwen3(20, seed=0)), data)
    assert fresh["critic/explained_variance"] == pytest.approx(0.0, abs=1e-9)
    result = {
        "config": {"batch": 5, "samples": 4, "lr": 3e-3, "seed": 0},
        "rows": {"train": 12, "eval": 12},
        "prompts": {"train": 3, "eval": 3},
        "seconds": 60.0,
        "machine": {"torch": "x"},
        "arms": {"state means": records},
        "ceiling_eval": m._ceilings(data),
    }
    table = m.table(result)
    assert "| state means | 2 (6) |" in table and "| **ceiling** of the held-out prompts |" in table
    assert "critic_targets.py --write-docs" in m.docs_block(result)
    block = m.docs_block(result)
    assert block.startswith("<!-- critic_targets:begin -->") and block.endswith(
        "<!-- critic_targets:end -->"
    )


def test_the_confidence_table_uses_only_what_precedes_each_token():
    m = load_benchmark("critic_targets")
    data = _data(2)
    length, low = m.confidence_features(data)
    mask, lp = data["loss_mask"], data["log_prob"]
    bins = torch.tensor(m.LOG_PROB_BINS)
    for b in range(mask.shape[0]):
        seen = 0.0
        for t in range(mask.shape[1]):
            if mask[b, t]:
                assert int(low[b, t]) == int(torch.bucketize(torch.tensor(seen), bins))
                assert int(length[b, t]) == 2  # the two prompt tokens
                seen = min(seen, float(lp[b, t]))
    # on its own training data the table returns each key's mean training return
    values = m.lookup_values(data, data, confidence=True)
    key = length * 100 + low
    for b, t in mask.nonzero().tolist():
        same = (key == key[b, t]) & mask
        assert float(values[b, t]) == pytest.approx(float(data["returns"][same].mean()), abs=1e-6)
    flat = m.lookup_values(data, data, confidence=False)  # prompt length only: one key here
    assert torch.allclose(
        flat[mask], data["returns"][mask].mean().expand(int(mask.sum())), atol=1e-6
    )


def test_the_confidence_arm_is_the_library_option_and_trains():
    """The third trained arm is ``critic.confidence_features``' module on the separate critic
    (its features are tested in tests/modules/test_confidence.py): it starts as the critic (zero
    output layer) and its MLP trains on the script's batches."""
    from ar_torchrl.models.tiny import build_tiny_qwen3
    from ar_torchrl.modules import attach_confidence_features, build_separate_critic

    m = load_benchmark("critic_targets")
    data = _data(3)
    critic = build_separate_critic(build_tiny_qwen3(20, seed=0))
    attach_confidence_features(critic.model)
    before = m.evaluate(critic, data)
    assert before["critic/explained_variance"] == pytest.approx(0.0, abs=1e-9)
    args = argparse.Namespace(seed=0, lr=3e-3, epochs=1, batch=6)
    records = m.train(critic, data, data["returns"], args, data, "confidence")
    mlp = list(critic.model.value_head.confidence.parameters())
    assert records[0]["loss"] > 0 and all(p.grad is not None for p in mlp)
    assert any(p.grad.abs().sum() > 0 for p in mlp)
