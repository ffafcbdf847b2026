"""LLMEnv: a well-behaved TorchRL env (check_env_specs, TransformedEnv, no silent random policy),
token trajectories from its samples, rewards over the whole sample, data position resume."""

from __future__ import annotations

import time

import pytest
import torch
from support.scripted_backend import ScriptedBackend
from torchrl.envs import RewardScaling, TransformedEnv
from torchrl.envs.utils import check_env_specs

from ar_torchrl.backends import SamplingParams, TransformersBackend
from ar_torchrl.data import arithmetic_dataset, make_row
from ar_torchrl.envs import EpochSampler, LLMEnv
from ar_torchrl.models.tiny import build_char_tokenizer, build_tiny_qwen3
from ar_torchrl.rewards import dapo_math_reward
from ar_torchrl.rewards.registry import OverlongPenalty, SampleReward, TaskReward
from ar_torchrl.rewards.scoring import RewardError
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


class Counting(TransformersBackend):
    """The real trainside backend, counting its generate calls."""

    calls = 0

    def _generate(self, prompts, n, sampling):
        type(self).calls += 1
        return super()._generate(prompts, n, sampling)


def test_check_env_specs_as_a_torchrl_user_writes_it(tok, model):
    """main: `ValueError: LLMEnv.rollout: a token trajectory is one episode, got max_steps=3`; the
    test passed only by monkeypatching env.rollout."""
    env = make_env(tok, Counting(model))
    before = Counting.calls
    check_env_specs(env)
    assert Counting.calls > before  # real rollouts from the backend
    seq = env.rollout(3, break_when_any_done=False)  # three one-step episodes, auto-reset
    assert seq.batch_size == torch.Size([6, 3]) and seq["next", "done"].all()


def test_transformed_env_rolls_out_with_the_backend_and_scales_rewards(tok, model):
    """main: TransformedEnv(LLMEnv(...), RewardScaling(...)).rollout(1) never called the backend
    (TorchRL's rand_action filled random responses)."""
    env = TransformedEnv(make_env(tok, Counting(model, seed=1)), RewardScaling(loc=0.5, scale=2.0))
    check_env_specs(env)
    before = Counting.calls
    seq = env.rollout(1)[..., 0]
    assert Counting.calls == before + 1  # one generate call for the batch: the backend answered
    raw = torch.tensor([s.reward for s in env.samples(seq)])
    torch.testing.assert_close(seq["next", "reward"].reshape(-1), 0.5 + 2.0 * raw)
    for s in env.samples(seq):  # the samples hold the engine's real tokens
        assert 1 <= s.num_trained <= 6 and s.text == env.tokenizer.decode(
            s.response_ids, skip_special_tokens=True
        )
    td = env.to_token_trajectory(seq)  # the trained rewards are the transformed ones
    torch.testing.assert_close(td["next", "reward"].sum((1, 2)), 0.5 + 2.0 * raw)


def test_a_policy_is_never_random(tok, model):
    """The engine is the env's policy: rand_action (policy=None) can only say "answer"."""
    env = make_env(tok, Counting(model))
    assert env.action_spec.space.n == 1  # one action: answer with the engine
    td = env.rand_action(env.reset())
    assert (td["action"] == 0).all()


def test_rollout_returns_the_token_trajectory(tok, model):
    env = make_env(tok, TransformersBackend(model, seed=1))
    env.backend.sync_weights(named_policy_tensors(model), version=5)  # the backend owns the version
    assert not hasattr(env, "policy_version")
    td = env.collect()
    n_rows, width = td.batch_size
    longest = max(len(env.prompt_token_ids(int(i))) for i in td["prompt_id"][:, 0])
    assert n_rows == 6 and width <= longest + 6  # the batch's own width
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


def test_rollout_without_max_steps_is_the_deprecated_collect(tok):
    """0.1's ``env.rollout()`` returned the token trajectory; 0.2 dropped it for TorchRL's bare
    ``rollout() missing 1 required positional argument: 'max_steps'``. It warns and collects."""
    env = make_env(tok, ScriptedBackend(tok))
    with pytest.warns(
        DeprecationWarning, match=r"LLMEnv.rollout\(\) without max_steps .*env\.collect\(\)"
    ):
        td = env.rollout()
    assert td.batch_dims == 2 and td.shape[0] == 6 and "loss_mask" in td.keys()
    again = make_env(tok, ScriptedBackend(tok)).collect()
    assert all(
        torch.equal(td[k], again[k]) for k in again.keys(True, True)
    )  # same seeds, same batch
    with pytest.raises(
        TypeError,
        match=r"LLMEnv.rollout\(\) needs max_steps.*env.rollout\(1, \.\.\.\).*env\.collect\(\)",
    ):
        env.rollout(policy=None, break_when_any_done=False)
    assert env.rollout(1).batch_size == torch.Size([6, 1])  # TorchRL's rollout, unchanged


def test_scripted_rewards_and_overlong_penalty(tok):
    env = make_env(tok, ScriptedBackend(tok), sampling=SamplingParams(max_new_tokens=12))
    td = env.collect()
    seq_reward = td["next", "reward"].sum((1, 2)).view(3, 2)
    assert seq_reward.tolist() == [[1.0, -1.0]] * 3  # sample 0 right, sample 1 off by one
    assert td["next", "terminated"].any(-2).all()  # every response ended with EOS
    # cap 10: "Answer: 3" + EOS fits (stop), "Answer: 12" + EOS is cut (length, still right)
    rows = [make_row("What is 1 + 2?", "3", index=0), make_row("What is 5 + 7?", "12", index=1)]
    shaped = OverlongPenalty(TaskReward(dapo_math_reward), max_len=10, buffer_len=4)
    env = LLMEnv(
        rows,
        tok,
        ScriptedBackend(tok),
        num_samples=2,
        prompts_per_batch=2,
        shuffle=False,
        sampling=SamplingParams(max_new_tokens=10),
        reward_fn=shaped,  # shaping is a wrapper of the reward, not an env argument
    )
    seq = env.rollout(1)[..., 0]
    td = env.to_token_trajectory(seq)
    assert td["loss_mask"].sum(-1).tolist() == [10, 10, 10, 10]
    assert td["next", "terminated"].squeeze(-1).any(-1).tolist() == [True, True, False, False]
    assert td["next", "truncated"].squeeze(-1).any(-1).tolist() == [False, False, True, True]
    # task reward +1/-1, overlong penalty -(10 - (10 - 4)) / 4 = -1 for every row
    assert td["next", "reward"].sum((1, 2)).tolist() == [0.0, -2.0, 0.0, -2.0]
    # "correct" is the task's: a right answer stays right when it is long
    assert [s.correct for s in env.samples(seq)] == [True, False, True, False]


def test_missing_chat_template_and_no_prompt_tokenised_before_it_is_drawn(tok, model):
    plain = build_char_tokenizer()
    plain.chat_template = None
    with pytest.raises(ValueError, match="the tokenizer has no chat template"):
        make_env(plain, TransformersBackend(model))
    env = make_env(tok, TransformersBackend(model))
    assert env._prompt_cache == {}  # main tokenised every prompt of the dataset to find a width
    env.collect()
    assert len(env._prompt_cache) == 3


def test_state_dict_resumes_data_position_and_sampling(tok, model):
    env = make_env(tok, TransformersBackend(model, seed=3))
    env.collect()
    state = env.state_dict()
    expected = env.collect()
    fresh = make_env(tok, TransformersBackend(model, seed=99))
    fresh.load_state_dict(state)
    resumed = fresh.collect()
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
        env.collect()
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
    td = env.collect()  # "Answer: 13" (prompt 1, sample 1) scores inf: its row is dropped
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
        env.collect()


def test_rows_carry_the_version_the_backend_stamped(tok, model):
    backend = TransformersBackend(model, seed=1)
    env = make_env(tok, backend)
    assert (env.collect()["policy_version"] == 0).all()
    backend.sync_weights(named_policy_tensors(model), version=3)
    assert (env.collect()["policy_version"] == 3).all()


def test_the_reward_sees_the_whole_sample(tok):
    """A reward reading the token count, the finish reason and a non-DAPO row field."""
    seen = []

    def reward(sample):
        seen.append((sample.num_trained, sample.finish_reason, sample.row["extra_info"]["index"]))
        return -0.1 * sample.num_trained

    env = make_env(
        tok, ScriptedBackend(tok), reward_fn=reward, sampling=SamplingParams(max_new_tokens=12)
    )
    seq = env.rollout(1)[..., 0]
    samples = env.samples(seq)
    assert [s.reward for s in samples] == pytest.approx([-0.1 * s.num_trained for s in samples])
    assert all(f == "stop" for _, f, _ in seen) and {i for *_, i in seen} == {
        int(i) for i in seq["prompt_id"]
    }


def test_a_raising_or_slow_reward_names_the_row(tok):
    def raising(sample):
        raise KeyError("answer")

    env = make_env(
        tok, ScriptedBackend(tok), reward_fn=raising, sampling=SamplingParams(max_new_tokens=12)
    )
    with pytest.raises(
        RewardError,
        match=r"reward .*raising raised KeyError: 'answer' on batch row 0 \(prompt index \d+, arithmetic row \d+",
    ):
        env.collect()
    slow = SampleReward(lambda s: time.sleep(5) or 1.0, name="slow")
    env = make_env(
        tok,
        ScriptedBackend(tok),
        reward_fn=slow,
        reward_timeout_s=0.2,
        sampling=SamplingParams(max_new_tokens=12),
    )
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"reward slow took more than 0.2 s on batch row 0"):
        env.collect()
    assert time.monotonic() - start < 3  # the deadline, not the reward's 5 s
