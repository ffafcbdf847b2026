"""LLMEnv: TorchRL specs, token-trajectory rollouts, rewards, data position resume."""

from __future__ import annotations

import functools

import pytest
import torch
from scripted_backend import ScriptedBackend
from torchrl.envs.utils import check_env_specs

from ar_torchrl.backends import SamplingParams, TransformersBackend
from ar_torchrl.data import arithmetic_dataset, make_row
from ar_torchrl.envs import EpochSampler, LLMEnv
from ar_torchrl.models.tiny import build_char_tokenizer, build_tiny_qwen3
from ar_torchrl.rewards import dapo_math_reward
from ar_torchrl.weight_sync import named_policy_tensors

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_qwen3(len(tok), seed=0)


def make_env(tok, backend, **kwargs):
    defaults = dict(
        num_samples=2, prompts_per_batch=3, sampling=SamplingParams(max_new_tokens=6, seed=None)
    )
    return LLMEnv(arithmetic_dataset(20, seed=0), tok, backend, **{**defaults, **kwargs})


def test_check_env_specs(tok, model):
    env = make_env(tok, TransformersBackend(model))
    env.rollout = functools.partial(
        LLMEnv.rollout, env, token_trajectory=False
    )  # TorchRL's own rollout
    check_env_specs(env)
    seq = env.rollout(1)
    assert seq.batch_size == torch.Size([6, 1]) and seq["next", "done"].all()


def test_rollout_returns_the_token_trajectory(tok, model):
    env = make_env(tok, TransformersBackend(model, seed=1))
    env.backend.sync_weights(named_policy_tensors(model), version=5)  # the backend owns the version
    assert not hasattr(env, "policy_version")
    td = env.rollout()
    n_rows, width = td.batch_size
    assert n_rows == 6 and width <= env.max_prompt_tokens + 6
    prompt_ids = td["prompt_id"][:, 0]
    assert prompt_ids.view(3, 2).unique(dim=1).shape == (3, 1)  # groups of num_samples rows
    for b in range(n_rows):
        row_prompt = td["tokens"][b][td["attention_mask"][b] & ~td["loss_mask"][b]].tolist()
        messages = env.dataset[int(prompt_ids[b])]["prompt"]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert tok.decode(row_prompt) == text
        response = td["tokens"][b][td["loss_mask"][b]].tolist()
        assert 1 <= len(response) <= 6
        # rollout log-probs vs a plain full forward of the unpadded row
        with torch.no_grad():
            logits = model(torch.tensor([row_prompt + response])).logits[0]
        ref = torch.log_softmax(logits[len(row_prompt) - 1 : -1], -1).gather(
            -1, torch.tensor(response)[:, None]
        )[:, 0]
        torch.testing.assert_close(
            td["rollout_log_prob"][b][td["loss_mask"][b]], ref, atol=1e-5, rtol=0
        )
        truth = env.dataset[int(prompt_ids[b])]["reward_model"]["ground_truth"]
        expected = dapo_math_reward(tok.decode(response, skip_special_tokens=True), truth)
        last = int(td["loss_mask"][b].nonzero()[-1])
        assert td["next", "reward"][b, last, 0] == expected
        assert td["next", "reward"][b].abs().sum() == abs(expected)
    assert (td["policy_version"] == 5).all()


def test_scripted_rewards_and_overlong_penalty(tok):
    env = make_env(tok, ScriptedBackend(tok), sampling=SamplingParams(max_new_tokens=12))
    td = env.rollout()
    seq_reward = td["next", "reward"].sum((1, 2)).view(3, 2)
    assert seq_reward.tolist() == [[1.0, -1.0]] * 3  # sample 0 right, sample 1 off by one
    assert td["next", "terminated"].any(-2).all()  # every response ended with EOS
    # cap 10: "Answer: 3" + EOS fits (stop), "Answer: 12" + EOS is cut (length, still right)
    rows = [make_row("What is 1 + 2?", "3", index=0), make_row("What is 5 + 7?", "12", index=1)]
    env = LLMEnv(
        rows,
        tok,
        ScriptedBackend(tok),
        num_samples=2,
        prompts_per_batch=2,
        shuffle=False,
        sampling=SamplingParams(max_new_tokens=10),
        overlong_buffer_len=4,
    )
    td = env.rollout()
    assert td["loss_mask"].sum(-1).tolist() == [10, 10, 10, 10]
    assert td["next", "terminated"].squeeze(-1).any(-1).tolist() == [True, True, False, False]
    assert td["next", "truncated"].squeeze(-1).any(-1).tolist() == [False, False, True, True]
    # task reward +1/-1, overlong penalty -(10 - (10 - 4)) / 4 = -1 for every row
    assert td["next", "reward"].sum((1, 2)).tolist() == [0.0, -2.0, 0.0, -2.0]


def test_missing_chat_template_and_too_long_prompts(tok, model):
    plain = build_char_tokenizer()
    plain.chat_template = None
    with pytest.raises(ValueError, match="the tokenizer has no chat template"):
        make_env(plain, TransformersBackend(model))
    env = make_env(tok, TransformersBackend(model), max_prompt_tokens=10)
    with pytest.raises(ValueError, match=r"exceed max_prompt_tokens=10; raise max_prompt_tokens"):
        env.rollout()
    with pytest.raises(ValueError, match="a token trajectory is one episode, got max_steps=2"):
        env.rollout(2)


def test_state_dict_resumes_data_position_and_sampling(tok, model):
    env = make_env(tok, TransformersBackend(model, seed=3))
    env.rollout()
    state = env.state_dict()
    expected = env.rollout()
    fresh = make_env(tok, TransformersBackend(model, seed=99))
    fresh.load_state_dict(state)
    resumed = fresh.rollout()
    assert torch.equal(resumed["tokens"], expected["tokens"])
    assert torch.equal(resumed["prompt_id"], expected["prompt_id"])


def test_epoch_sampler_covers_each_epoch_once():
    sampler = EpochSampler(7, seed=2)
    drawn = sampler.draw(21)
    for epoch in range(3):
        assert sorted(drawn[7 * epoch : 7 * epoch + 7]) == list(range(7))
    assert drawn[:7] != drawn[7:14]  # reshuffled per epoch
    assert EpochSampler(4, shuffle=False).draw(6) == [0, 1, 2, 3, 0, 1]


def test_non_finite_reward_is_an_error_naming_row_prompt_and_value(tok):
    def reward(text, truth):
        return float("nan") if text.endswith("3") else 1.0

    rows = [make_row("What is 1 + 2?", "3", index=0), make_row("What is 5 + 7?", "12", index=1)]
    env = LLMEnv(
        rows,
        tok,
        ScriptedBackend(tok),
        num_samples=2,
        prompts_per_batch=2,
        shuffle=False,
        reward_fn=reward,
        sampling=SamplingParams(max_new_tokens=12),
    )
    with pytest.raises(
        ValueError,
        match=r"reward_fn returned nan for batch row 0 \(prompt index 0, response 'Answer: 3'\)",
    ):
        env.rollout()
    with pytest.raises(ValueError, match="non_finite_reward must be 'raise' or 'drop'"):
        LLMEnv(rows, tok, ScriptedBackend(tok), non_finite_reward="zero")


def test_non_finite_reward_rows_can_be_dropped_and_counted(tok):
    def reward(text, truth):
        return float("inf") if text.endswith("13") else (1.0 if text.endswith(truth) else -1.0)

    rows = [make_row("What is 1 + 2?", "3", index=0), make_row("What is 5 + 7?", "12", index=1)]
    env = LLMEnv(
        rows,
        tok,
        ScriptedBackend(tok),
        num_samples=2,
        prompts_per_batch=2,
        shuffle=False,
        reward_fn=reward,
        sampling=SamplingParams(max_new_tokens=12),
        non_finite_reward="drop",
    )
    td = env.rollout()  # "Answer: 13" (prompt 1, sample 1) scores inf: its row is dropped
    assert td.shape[0] == 3 and env.non_finite_rewards_dropped == 1
    assert td["prompt_id"][:, 0].tolist() == [0, 0, 1]
    assert td["next", "reward"].sum((1, 2)).tolist() == [1.0, -1.0, 1.0]
    assert env.state_dict()["non_finite_rewards_dropped"] == 1


class OutOfVocab(ScriptedBackend):
    def _generate(self, prompts, n, sampling):
        out = super()._generate(prompts, n, sampling)
        out[3].token_ids[0] = len(self.tokenizer)
        return out


def test_token_ids_outside_the_vocabulary_are_refused(tok):
    env = make_env(tok, OutOfVocab(tok), sampling=SamplingParams(max_new_tokens=12))
    with pytest.raises(
        ValueError,
        match=rf"batch row 3 \(prompt index \d+\) has token ids \[{len(tok)}\] outside the tokenizer's vocabulary \[0, {len(tok)}\)",
    ):
        env.rollout()


def test_rows_carry_the_version_the_backend_stamped(tok, model):
    backend = TransformersBackend(model, seed=1)
    env = make_env(tok, backend)
    assert (env.rollout()["policy_version"] == 0).all()
    backend.sync_weights(named_policy_tensors(model), version=3)
    assert (env.rollout()["policy_version"] == 3).all()
