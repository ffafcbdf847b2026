"""Interop with TorchRL 0.14.1's LLM stack: ChatEnv + TransformersWrapper + LLMCollector batches
converted by ``TokenTrajectory``, value-head-free weights for TorchRL's weight-sync helpers,
``pad_trajectories`` (against a row-by-row loop, and as a replay buffer's collate), and
examples/torchrl_llm_critic.py end to end.

The TorchRL batches are real: the example's env and reward, a real ``TransformersWrapper`` and
``LLMCollector``. ``bad_words_ids`` (a generate kwarg TorchRL passes on) restricts what the random
tiny model can sample, so that a batch deterministically holds sampled pad ids, EOS-ended rows or
rows cut by length.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from support.fuzz import fuzz
from support.trajectories import (
    PAD,
    VOCAB,
    first_update_has_ratio_one,
    make_trajectory,
    tiny_actor_critic,
)
from tensordict import TensorDict, lazy_stack, set_list_to_stack
from torchrl.collectors.llm import LLMCollector
from torchrl.data import (
    LazyStackStorage,
    LazyTensorStorage,
    ReplayBuffer,
    SamplerWithoutReplacement,
)
from torchrl.envs import StepCounter
from torchrl.envs.llm import DatasetChatEnv
from torchrl.modules.llm import TransformersWrapper

from ar_torchrl.data import pad_trajectories
from ar_torchrl.interop import TokenTrajectory, policy_state_dict, prompt_group_id
from ar_torchrl.models import build_char_tokenizer, build_tiny_qwen3
from ar_torchrl.modules import attach_value_head
from ar_torchrl.training import plan_micro_batches

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "torchrl_llm_critic.py"
EOS = 2
VOCAB_CHAR = len(build_char_tokenizer())  # 99
torch.set_num_threads(1)


def _example_module():
    spec = importlib.util.spec_from_file_location("torchrl_llm_critic", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXAMPLE = _example_module()


def torchrl_loop(
    allowed: set[int], max_new_tokens: int, *, rows: int = 8, seed: int = 0, loader=None
):
    """The example's env and a TransformersWrapper whose model may sample only ``allowed`` ids."""
    set_list_to_stack(True).set()
    torch.manual_seed(seed)
    tok = build_char_tokenizer()
    tok.padding_side = "left"
    model = attach_value_head(build_tiny_qwen3(len(tok)))
    loader = loader or EXAMPLE.prompt_loader(50, rows // 2, seed)
    env = DatasetChatEnv.from_dataloader(loader, repeats=2, batch_size=(rows,), tokenizer=tok)
    env.append_transform(StepCounter(max_steps=1))
    env.append_transform(EXAMPLE.DapoMathReward(tok))
    banned = [[t] for t in range(len(tok)) if t not in allowed]
    policy = TransformersWrapper(
        model,
        tokenizer=tok,
        input_mode="history",
        generate=True,
        return_log_probs=True,
        pad_output=False,
        generate_kwargs={
            "max_new_tokens": max_new_tokens,
            "do_sample": True,
            "temperature": 1.0,
            "bad_words_ids": banned,
        },
    )
    return env, policy


def collector_for(env, policy, **kwargs) -> LLMCollector:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # TorchRL's InitTracker notice
        return LLMCollector(env, policy=policy, track_policy_version=True, **kwargs)


def torchrl_batch(allowed: set[int], max_new_tokens: int, *, rows: int = 8, seed: int = 0):
    """One raw LLMCollector batch (and the policy) whose model may sample only ``allowed`` ids."""
    env, policy = torchrl_loop(allowed, max_new_tokens, rows=rows, seed=seed)
    collector = collector_for(env, policy, dialog_turns_per_batch=rows)
    data = next(iter(collector))
    collector.shutdown()
    return data, policy


@pytest.fixture(scope="module")
def finished_batch():
    """Only EOS and token 5 can be sampled, 4 tokens at most: EOS-ended and length-cut rows."""
    return torchrl_batch({EOS, 5}, max_new_tokens=4)


# -- the converter --------------------------------------------------------------------------------


def test_finish_from_tokens_not_from_step_counter(finished_batch):
    data, policy = finished_batch
    td = TokenTrajectory.from_policy(policy)(data)
    flat = data.reshape(-1)
    responses = flat.get(("tokens", "response"), as_list=True)
    assert flat["next", "truncated"].all(), "StepCounter(max_steps=1) marks every row truncated"
    ends_eos = torch.tensor([int(r[-1]) == EOS for r in responses])
    assert 0 < int(ends_eos.sum()) < len(responses), "the seed must give both finishes"
    terminated = td["next", "terminated"].squeeze(-1).any(-1)
    truncated = td["next", "truncated"].squeeze(-1).any(-1)
    assert torch.equal(terminated, ends_eos) and torch.equal(truncated, ~ends_eos)
    assert all(len(r) == 4 for r, e in zip(responses, ends_eos) if not e)
    # the layout: prompt right-aligned, response from column P, reward and done on its last token
    width_p = max(len(p) for p in flat.get(("tokens", "prompt"), as_list=True))
    lengths = torch.tensor([len(r) for r in responses])
    assert torch.equal(td["loss_mask"].sum(-1), lengths)
    assert torch.equal(td["loss_mask"].float().argmax(-1), torch.full_like(lengths, width_p))
    last = width_p + lengths - 1
    rows = torch.arange(len(responses))
    assert torch.equal(td["next", "done"].squeeze(-1).nonzero()[:, 1], last)
    reward = flat["next", "reward"].reshape(-1)
    assert torch.equal(td["next", "reward"][rows, last, 0], reward)
    assert td["next", "reward"].sum() == reward.sum()
    # groups from the prompt (the env repeats each prompt twice): same tokens <=> same id
    groups = td["prompt_id"][:, 0].tolist()
    prompts = [tuple(p.tolist()) for p in flat.get(("tokens", "prompt"), as_list=True)]
    assert groups[0::2] == groups[1::2]
    assert all(
        (a == b) == (pa == pb) for a, pa in zip(groups, prompts) for b, pb in zip(groups, prompts)
    )
    assert torch.equal(td["policy_version"], torch.zeros_like(td["policy_version"]))
    assert "rollout_log_prob" not in td.keys()  # "drop" is the default


def test_rollout_log_prob_recompute_and_raise(finished_batch):
    data, policy = finished_batch
    engine = data.reshape(-1).get(("log_probs", "response"), as_list=True)
    assert all(float(lp[0]) == 0.0 for lp in engine), "TorchRL 0.14.1 zeroes the first log-prob"
    td = TokenTrajectory.from_policy(policy, rollout_log_prob="recompute")(data)
    ours = [row[mask] for row, mask in zip(td["rollout_log_prob"], td["loss_mask"])]
    for mine, theirs in zip(ours, engine):
        torch.testing.assert_close(mine[1:], theirs[1:], atol=1e-5, rtol=1e-5)
        assert mine[0] < 0
    assert (td["rollout_log_prob"][~td["loss_mask"]] == 0).all()
    with pytest.raises(ValueError, match=r"row 0: the first generated token's log-prob is exactly"):
        TokenTrajectory.from_policy(policy, rollout_log_prob="raise")(data)


def test_the_converted_batch_trains_with_ratio_one(finished_batch):
    data, policy = finished_batch
    td = TokenTrajectory.from_policy(policy)(data)
    from ar_torchrl.modules import LMActorCritic

    plan = plan_micro_batches(td, token_budget=2 * td.batch_size[1])
    first_update_has_ratio_one(LMActorCritic(policy.model), td, plan)
    assert policy.model.value_head.weight.grad.norm() > 0


def test_sampled_pad_ids_are_refused():
    """TorchRL drops sampled pad ids from tokens.response: the sampled sequence is lost."""
    data, policy = torchrl_batch({PAD, 5}, max_new_tokens=6)
    responses = data.reshape(-1).get(("tokens", "response"), as_list=True)
    assert all(PAD not in r.tolist() for r in responses)
    assert any(len(r) < 6 for r in responses), "the seed must sample a pad id"
    with pytest.raises(ValueError, match=r"tokens were lost.*pad id 0.*'bad_words_ids': \[\[0\]\]"):
        TokenTrajectory(policy.tokenizer, max_new_tokens=6)(data)
    with pytest.raises(ValueError, match=r"can sample the pad id 0.*bad_words_ids"):
        TokenTrajectory.from_policy(policy)


def test_plan_micro_batches_names_the_missing_key_of_a_raw_torchrl_batch(finished_batch):
    """Issue 30: a raw LLMCollector batch gave a bare AttributeError ('NoneType' ... 'bool')."""
    data, policy = finished_batch
    assert data.batch_dims == 2  # LLMCollector's [B, 1]
    with pytest.raises(
        KeyError,
        match=r"^plan_micro_batches: the batch has no 'attention_mask' .* raw TorchRL LLM batch .*"
        r"postproc=TokenTrajectory.from_policy\(policy\)",
    ):
        plan_micro_batches(data, token_budget=512)
    with pytest.raises(
        ValueError, match=r"expects a \[B, L\] TensorDict, got batch_size \(8,\)\. This is a raw"
    ):
        plan_micro_batches(data.reshape(-1), token_budget=512)
    plan_micro_batches(TokenTrajectory.from_policy(policy)(data), token_budget=512)


def test_from_policy_accepts_an_sglang_wrapper():
    """SGLang keeps every sampled token (no bad_words_ids needed); its generate_kwargs are SGLang's
    sampling params. The wrapper is built without a server (AsyncSGLang() connects lazily)."""
    from torchrl.modules.llm import SGLangWrapper
    from torchrl.modules.llm.backends.sglang import AsyncSGLang

    tok = build_char_tokenizer()
    policy = SGLangWrapper(
        AsyncSGLang(),
        tokenizer=tok,
        input_mode="history",
        generate_kwargs={"max_new_tokens": 5, "temperature": 0.7},
    )
    conv = TokenTrajectory.from_policy(policy, rollout_log_prob="raise")
    assert (conv.max_new_tokens, conv.temperature, conv.vocab_size) == (5, 0.7, VOCAB_CHAR)
    assert sorted(conv.eos_token_ids) == [EOS] and conv.rollout_log_prob == "raise"
    greedy = SGLangWrapper(
        AsyncSGLang(), tokenizer=tok, generate_kwargs={"max_new_tokens": 3, "do_sample": False}
    )
    assert TokenTrajectory.from_policy(greedy).temperature == 1.0  # greedy log-probs: T = 1
    with pytest.raises(ValueError, match=r"SGLangWrapper.generate_kwargs has no max_new_tokens"):
        TokenTrajectory.from_policy(SGLangWrapper(AsyncSGLang(), tokenizer=tok))


def row(prompt, response, *, reward=1.0, done=True, version=0, log_probs=None) -> TensorDict:
    """One row as TorchRL's LLMCollector writes it (1-D tensors, ``[1, 1]`` reward)."""
    td = TensorDict(
        {
            "tokens": {"prompt": torch.tensor(prompt), "response": torch.tensor(response)},
            "next": {
                "reward": torch.full((1, 1), reward),
                "done": torch.tensor([done]),
                "policy_version": torch.tensor(version),
            },
        }
    )
    if log_probs is not None:
        td["log_probs", "response"] = torch.tensor(log_probs)
    return td


def test_a_sampled_pad_id_from_another_engine_is_a_token():
    """Masks, not ids, say what is padding: a kept pad-id token is trained on."""
    tok = build_char_tokenizer()
    batch = lazy_stack([row([1, 9], [5, PAD, 7, EOS]), row([1, 9, 9], [6, 7, 8, 9])])
    td = TokenTrajectory(tok, max_new_tokens=4)(batch)
    assert td["tokens"].tolist() == [[0, 1, 9, 5, 0, 7, 2], [1, 9, 9, 6, 7, 8, 9]]
    assert td["loss_mask"][0].tolist() == [False] * 3 + [True] * 4
    assert td["attention_mask"][0, 4] and td["loss_mask"][0, 4]
    assert td["next", "terminated"].any(1).flatten().tolist() == [True, False]
    # rows cut by length are truncated: 3 tokens without EOS is a loss when the cap is 4
    with pytest.raises(ValueError, match=r"row 1 has 3 generated tokens, does not end with EOS"):
        TokenTrajectory(tok, max_new_tokens=4)(lazy_stack([row([1], [EOS]), row([1], [6, 7, 8])]))
    cut = TokenTrajectory(tok, max_new_tokens=3)(lazy_stack([row([1], [EOS]), row([1], [6, 7, 8])]))
    assert cut["next", "truncated"].any(1).flatten().tolist() == [False, True]


def test_converter_errors_name_what_was_received():
    tok = build_char_tokenizer()
    conv = TokenTrajectory(tok, max_new_tokens=3)
    no_version = lazy_stack([row([1], [EOS])]).exclude(("next", "policy_version"))
    with pytest.raises(KeyError, match=r"no 'policy_version'.*track_policy_version=True"):
        conv(no_version)
    with pytest.raises(
        KeyError, match=r"no \('tokens', 'response'\).*generate=True.*it has \('next', 'done'\)"
    ):
        conv(lazy_stack([row([1], [EOS])]).exclude(("tokens", "response")))
    with pytest.raises(ValueError, match=r"row 1 is not done.*StepCounter\(max_steps=1\)"):
        conv(lazy_stack([row([1], [EOS]), row([1], [EOS], done=False)]))
    with pytest.raises(
        ValueError, match=r"row 0 has 4 generated tokens, more than max_new_tokens=3"
    ):
        conv(lazy_stack([row([1], [5, 6, 7, EOS])]))
    keep = TokenTrajectory(tok, max_new_tokens=3, rollout_log_prob="raise")
    with pytest.raises(
        ValueError, match=r"row 0: log_probs.response has shape \(3,\) for 2 tokens"
    ):
        keep(lazy_stack([row([1], [5, EOS], log_probs=[-1.0] * 3)]))
    with pytest.raises(ValueError, match=r"must be 1-D float log-probs \(pad_output=False\)"):
        keep(lazy_stack([row([1], [5, EOS], log_probs=[[-1.0] * 3] * 2)]))
    with pytest.raises(ValueError, match=r"rollout_log_prob must be one of .* got 'zeros'"):
        TokenTrajectory(tok, max_new_tokens=3, rollout_log_prob="zeros")
    with pytest.raises(ValueError, match=r"'recompute' needs the generating model"):
        TokenTrajectory(tok, max_new_tokens=3, rollout_log_prob="recompute")
    tok_eos_pad = build_char_tokenizer()
    tok_eos_pad.pad_token = tok_eos_pad.eos_token
    with pytest.raises(ValueError, match=r"eos ids \[2\] and pad id 2"):
        TokenTrajectory(tok_eos_pad, max_new_tokens=3)
    engine_lp = lazy_stack([row([1], [5, EOS], log_probs=[-0.5, -0.25])])
    kept = TokenTrajectory(tok, max_new_tokens=3, rollout_log_prob="raise")(engine_lp)
    assert kept["rollout_log_prob"][0].tolist() == [0.0, -0.5, -0.25]
    assert prompt_group_id([1, 2]) == prompt_group_id(torch.tensor([1, 2])) >= 0


def _poisoned(case: str) -> TensorDict:
    good = row([1, 9], [5, EOS])
    bad = {
        "id -1": row([1], [-1, EOS]),
        "id vocab+1000": row([1], [VOCAB_CHAR + 1000, EOS]),
        "id 2**62": row([1], [2**62, EOS]),
        "prompt id -3": row([-3], [5, EOS]),
        "reward nan": row([1], [5, EOS], reward=float("nan")),
        "reward inf": row([1], [5, EOS], reward=float("inf")),
        "reward -inf": row([1], [5, EOS], reward=float("-inf")),
        "versions 0 and 3": row([1], [5, EOS], version=3),
    }[case]
    return lazy_stack([good, bad])


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("id -1", r"row 1: \('tokens', 'response'\)\[0\] = -1 is outside the vocabulary \[0, 99\)"),
        ("id vocab+1000", r"row 1: \('tokens', 'response'\)\[0\] = 1099 is outside the vocabulary"),
        ("id 2**62", r"row 1: \('tokens', 'response'\)\[0\] = 4611686018427387904 is outside"),
        ("prompt id -3", r"row 1: \('tokens', 'prompt'\)\[0\] = -3 is outside the vocabulary"),
        ("reward nan", r"row 1: the reward \('next', 'reward'\) is nan, not finite"),
        ("reward inf", r"row 1: the reward \('next', 'reward'\) is inf, not finite"),
        ("reward -inf", r"row 1: the reward \('next', 'reward'\) is -inf, not finite"),
        (
            "versions 0 and 3",
            r"row 1 has \('next', 'policy_version'\) \[3\], row 0 has 0: one batch",
        ),
    ],
)
@pytest.mark.parametrize("mode", ["drop", "recompute"])
def test_poisoned_batches_are_refused_naming_the_row_and_the_value(case, message, mode):
    """Issue 29 N5: these converted without a word (in "recompute" mode: a bare IndexError, on
    CUDA a device-side assert)."""
    tok = build_char_tokenizer()
    model = build_tiny_qwen3(len(tok)) if mode == "recompute" else None
    conv = TokenTrajectory(tok, max_new_tokens=3, rollout_log_prob=mode, model=model)
    with pytest.raises(ValueError, match=message):
        conv(_poisoned(case))


def test_positive_log_probs_and_empty_batches_are_refused():
    tok = build_char_tokenizer()
    keep = TokenTrajectory(tok, max_new_tokens=3, rollout_log_prob="raise")
    with pytest.raises(
        ValueError, match=r"row 1: log_probs.response\[1\] = 0.25 is positive .*tolerance 0.0001"
    ):
        keep(
            lazy_stack(
                [
                    row([1], [5, EOS], log_probs=[-1.0, -0.5]),
                    row([1], [5, EOS], log_probs=[-1.0, 0.25]),
                ]
            )
        )
    within = keep(lazy_stack([row([1], [5, EOS], log_probs=[-1.0, 1e-4])]))  # the tolerance
    assert within["rollout_log_prob"][0, -1] == pytest.approx(1e-4)
    with pytest.raises(ValueError, match=r"row 0: log_probs.response\[0\] = 0.0002 is positive"):
        keep(lazy_stack([row([1], [5, EOS], log_probs=[2e-4, -0.5])]))
    empty = lazy_stack([row([1], [EOS]), row([1], [5, EOS])])[:0]
    with pytest.raises(ValueError, match=r"the batch has no rows \(batch size \(0,\)\)"):
        TokenTrajectory(tok, max_new_tokens=3)(empty)
    # the vocabulary: the model's embedding rows by default, or vocab_size=
    big = TokenTrajectory(tok, max_new_tokens=3, vocab_size=len(tok) + 8)
    assert big(lazy_stack([row([1], [len(tok) + 7, EOS])]))["tokens"][0, 1] == len(tok) + 7
    with pytest.raises(ValueError, match=r"vocab_size must be an int >= 1, got 0"):
        TokenTrajectory(tok, max_new_tokens=3, vocab_size=0)


# -- property-based: any small batch converts like the builder, or is refused by row ---------------


@st.composite
def _rows(draw, max_new_tokens: int = 4):
    """1-4 valid rows: prompts of 1-4 ids, responses ending with EOS or cut at max_new_tokens."""
    ids = st.integers(3, VOCAB_CHAR - 1)
    out = []
    for _ in range(draw(st.integers(1, 4))):
        prompt = draw(st.lists(st.integers(0, VOCAB_CHAR - 1), min_size=1, max_size=4))
        if draw(st.booleans()):
            response = draw(st.lists(ids, max_size=max_new_tokens - 1)) + [EOS]
        else:
            response = draw(st.lists(ids, min_size=max_new_tokens, max_size=max_new_tokens))
        reward = draw(st.floats(-10, 10, allow_nan=False, width=32))
        out.append((prompt, response, reward))
    return out, draw(st.integers(0, 2**40))


def _builder_trajectory(rows, version):
    from ar_torchrl.data.samples import Sample, Segment
    from ar_torchrl.data.trajectory import build_trajectory

    samples = [
        Sample(
            [Segment(p), Segment(r, True, [0.0] * len(r), policy_version=version)],
            prompt_id=prompt_group_id(p),
            finish_reason="stop" if r[-1] == EOS else "length",
            reward=reward,
        )
        for p, r, reward in rows
    ]
    return build_trajectory(samples, pad_token_id=PAD)


@fuzz(60)
@given(_rows())
def test_valid_random_batches_convert_to_the_builders_trajectory(batch):
    rows, version = batch
    tok = build_char_tokenizer()
    td = TokenTrajectory(tok, max_new_tokens=4)(
        lazy_stack([row(p, r, reward=reward, version=version) for p, r, reward in rows])
    )
    want = _builder_trajectory(rows, version)
    assert set(td.keys(True, True)) == set(want.keys(True, True)) - {"rollout_log_prob"}
    for key in td.keys(True, True):
        assert torch.equal(td[key], want[key]), key


_POISONS = {
    "id": st.sampled_from([-1, -(2**62), VOCAB_CHAR, VOCAB_CHAR + 1000, 2**62]),
    "reward": st.sampled_from([float("nan"), float("inf"), float("-inf")]),
    "version": st.integers(1, 2**40),
}


@fuzz(60)
@given(_rows(), st.sampled_from(sorted(_POISONS)), st.data())
def test_poisoned_random_batches_are_refused_naming_the_row(batch, poison, data):
    rows, version = batch
    if poison == "version" and len(rows) == 1:
        rows = rows * 2  # a version can only be mixed with another row's
    target = data.draw(st.integers(0, len(rows) - 1), label="poisoned row")
    value = data.draw(_POISONS[poison], label="value")
    shown = version + value if poison == "version" else value
    built = []
    for i, (p, r, reward) in enumerate(rows):
        poisoned = i == target
        built.append(
            row(
                p,
                [value, *r[1:]] if poisoned and poison == "id" else r,
                reward=value if poisoned and poison == "reward" else reward,
                version=shown if poisoned and poison == "version" else version,
            )
        )
    named = 1 if poison == "version" and target == 0 else target  # row 0 sets the version
    with pytest.raises(ValueError, match=rf"row {named}\b.*{re.escape(str(shown))}"):
        TokenTrajectory(build_char_tokenizer(), max_new_tokens=4)(lazy_stack(built))


# -- weights for TorchRL's weight-sync helpers ----------------------------------------------------


def test_policy_state_dict_feeds_torchrl_weight_sync_without_value_head():
    from torchrl.weight_update.llm import get_model_metadata, get_sglang_model_metadata
    from torchrl.weight_update.weight_sync_schemes import WeightStrategy

    model = attach_value_head(build_tiny_qwen3(VOCAB))
    hf_names = set(build_tiny_qwen3(VOCAB).state_dict())
    assert {"value_head.weight", "value_head.bias"} <= set(get_model_metadata(model))  # the trap
    sd = policy_state_dict(model)
    for metadata in (get_model_metadata(sd), get_sglang_model_metadata(sd)):
        assert set(metadata) == hf_names
        assert metadata["model.norm.weight"] == (torch.float32, torch.Size([64]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "state_dict strategy is experimental"
        for strategy in (WeightStrategy("state_dict"), WeightStrategy("tensordict")):
            extracted = strategy.extract_weights(sd)
            names = set(extracted.keys())
            assert names == hf_names, strategy.extract_as
        # the LLM schemes' strategy: weights extracted from the trainer land on a plain HF model
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)  # the dict holds views: it follows in-place optimizer steps
        engine = build_tiny_qwen3(VOCAB, seed=1)
        strategy = WeightStrategy("state_dict")
        strategy.apply_weights(engine, strategy.extract_weights(sd))
    assert all(torch.equal(engine.state_dict()[k], model.state_dict()[k]) for k in hf_names)
    bf16 = policy_state_dict(model, dtype=torch.bfloat16)
    assert {t.dtype for t in bf16.values()} == {torch.bfloat16}


# -- pad_trajectories -----------------------------------------------------------------------------


def random_batch(seed: int, rows: int) -> TensorDict:
    """A trajectory with every kind of key: tokens, masks, floats [B, L] and [B, L, 1], row keys."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, 12, (rows,), generator=g).tolist()
    responses = torch.randint(1, 9, (rows,), generator=g).tolist()
    td = make_trajectory(prompts, responses, seed=seed, group_size=2)
    mask = td["loss_mask"]
    td["sample_log_prob"] = torch.where(mask, -torch.rand(mask.shape, generator=g), 0.0)
    td["state_value"] = torch.where(mask, torch.randn(mask.shape, generator=g), 0.0).unsqueeze(-1)
    td["policy_version"] = torch.full(mask.shape, seed, dtype=torch.long)
    td["next", "truncated"] = td["next", "done"] & ~td["next", "terminated"]
    return td


def pad_by_loop(batches: list[TensorDict], row_keys=("prompt_id", "policy_version")) -> dict:
    """The slow twin: every row's real prompt and response tokens, re-laid out one by one."""
    spans = []  # (batch, row, prompt start, boundary, response end)
    for i, td in enumerate(batches):
        boundary = int(td["loss_mask"].any(0).float().argmax())
        for r in range(td.batch_size[0]):
            attn = td["attention_mask"][r].tolist()
            p = sum(attn[:boundary])
            q = sum(attn[boundary:])
            spans.append((i, r, boundary - p, boundary, boundary + q))
    width_p = max(b - s for _, _, s, b, _ in spans)
    width = width_p + max(e - b for _, _, _, b, e in spans)
    out = {}
    for key in batches[0].keys(include_nested=True, leaves_only=True):
        rows = []
        for i, r, start, boundary, end in spans:
            x = batches[i].get(key)[r]
            if key in row_keys:
                rows.append(x[:1].expand(width, *x.shape[1:]))
                continue
            fill = PAD if key == "tokens" else 0
            new = x.new_full((width, *x.shape[1:]), fill)
            for col in range(start, end):  # one position at a time
                new[width_p - boundary + col] = x[col]
            rows.append(new)
        out[key] = torch.stack(rows)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pad_trajectories_matches_the_loop(seed):
    batches = [random_batch(10 * seed + k, rows=2 + k) for k in range(3)]
    got = pad_trajectories(batches)
    want = pad_by_loop(batches)
    assert set(got.keys(include_nested=True, leaves_only=True)) == set(want)
    for key, value in want.items():
        assert torch.equal(got.get(key), value), key
    assert got.batch_size == (sum(b.batch_size[0] for b in batches), want["tokens"].shape[1])


def test_pad_trajectories_errors():
    a = random_batch(0, 3)
    with pytest.raises(ValueError, match=r"non-empty list of \[B, L\] token trajectories"):
        pad_trajectories([])
    with pytest.raises(ValueError, match=r"trajectory 1 has different keys.*sample_log_prob"):
        pad_trajectories([a, random_batch(1, 2).exclude("sample_log_prob")])
    empty = a.clone()
    empty["loss_mask"] = torch.zeros_like(empty["loss_mask"])
    with pytest.raises(ValueError, match=r"trajectory 0 has no trained token"):
        pad_trajectories([empty])
    right_padded_prompt = make_trajectory([3, 5], [2, 2])  # row 0's prompt: columns 2-4
    right_padded_prompt["attention_mask"][0, :3] = torch.tensor([True, False, False])
    with pytest.raises(
        ValueError, match=r"trajectory 0, row 0: 'attention_mask' is not a left-padded"
    ):
        pad_trajectories([right_padded_prompt])
    varying = a.clone()
    varying["prompt_id"][0, -1] += 1
    with pytest.raises(ValueError, match=r"'prompt_id' is a per-row key .* varies along L"):
        pad_trajectories([varying])
    other_pad = random_batch(1, 2)
    other_pad["tokens"][~other_pad["attention_mask"]] = 7
    with pytest.raises(ValueError, match=r"several ids at padded positions.*\[0, 7\]"):
        pad_trajectories([a, other_pad])
    assert pad_trajectories([a, other_pad], pad_token_id=0)["tokens"].shape[0] == 5


def test_replay_buffer_of_several_batches():
    """The failures of a buffer holding batches of widths 92 and 89, and the fix: the collate."""
    a = make_trajectory([80, 82], [10, 8], seed=0)
    b = make_trajectory([79, 80], [9, 6], seed=1)
    assert (a.batch_size[1], b.batch_size[1]) == (92, 89)
    dense = ReplayBuffer(storage=LazyTensorStorage(8))
    dense.extend(a)
    with pytest.raises(RuntimeError, match=r"indexed destination TensorDict batch size .* differs"):
        dense.extend(b)
    ragged = ReplayBuffer(
        storage=LazyStackStorage(8), sampler=SamplerWithoutReplacement(), batch_size=4
    )
    ragged.extend(a)
    ragged.extend(b)
    with pytest.raises(RuntimeError, match="Failed to stack tensors"):
        plan_micro_batches(ragged.sample(), token_budget=400)

    buffer = ReplayBuffer(
        storage=LazyStackStorage(8),
        sampler=SamplerWithoutReplacement(),
        batch_size=4,
        collate_fn=pad_trajectories,
    )
    buffer.extend(a)
    buffer.extend(b)
    sample, info = buffer.sample(return_info=True)
    assert sample.batch_size == (4, 92)  # widest prompt (82) + widest response (10)
    assert torch.equal(sample["tokens"], pad_trajectories([a, b])["tokens"][info["index"]])
    ac = tiny_actor_critic()
    plan = plan_micro_batches(sample, token_budget=200)
    assert len(plan.micro_batches) == 2
    first_update_has_ratio_one(ac, sample, plan)


def test_the_converters_collate_fn_pads_with_its_pad_id():
    """Item 1's second half: the pad id from the converter, not inferred from the batches."""
    tok = build_char_tokenizer()
    conv = TokenTrajectory(tok, max_new_tokens=4)
    a = conv(lazy_stack([row([1, 9], [5, EOS]), row([1, 9, 9], [6, 7, 8, 9])]))
    b = conv(lazy_stack([row([1], [5, 6, 7, 8])]))  # no padding at all
    buffer = ReplayBuffer(storage=LazyStackStorage(8), batch_size=3, collate_fn=conv.collate_fn)
    buffer.extend(a)
    buffer.extend(b)
    sample = buffer.sample()
    assert sample.batch_size[0] == 3
    assert (sample["tokens"][~sample["attention_mask"]] == conv.pad_token_id).all()
    assert torch.equal(
        conv.collate_fn([a, b])["tokens"], pad_trajectories([a, b], pad_token_id=0)["tokens"]
    )


def test_llm_collector_fills_a_replay_buffer_of_token_trajectories():
    """sota grpo's pattern: the collector extends a LazyStackStorage buffer, the trainer samples.
    The second batch's prompts are longer, so the two batches have different widths."""
    ab = [(1, 2), (3, 4), (123456, 654321), (111111, 222222)]
    rows = [{"query": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in ab]
    loader = torch.utils.data.DataLoader(
        rows, batch_size=1, collate_fn=lambda b: {k: [r[k] for r in b] for k in b[0]}
    )
    env, policy = torchrl_loop({EOS, 5}, 3, rows=4, loader=loader)
    buffer = ReplayBuffer(
        storage=LazyStackStorage(16),
        sampler=SamplerWithoutReplacement(),
        batch_size=8,
        collate_fn=pad_trajectories,
    )
    postproc = TokenTrajectory.from_policy(policy)
    widths = []

    def convert(td):
        out = postproc(td)
        widths.append(out.batch_size[1])
        return out

    collector = collector_for(
        env,
        policy,
        dialog_turns_per_batch=4,
        total_dialog_turns=8,
        replay_buffer=buffer,
        postproc=convert,
    )
    for _ in collector:  # with a buffer the collector yields None
        collector.increment_version()
    collector.shutdown()
    assert len(buffer) == 8 and len(set(widths)) == 2, widths
    sample = buffer.sample()
    assert sample.batch_size[1] == max(widths)
    assert sorted(set(sample["policy_version"][:, 0].tolist())) == [0, 1]
    from ar_torchrl.modules import LMActorCritic

    plan = plan_micro_batches(sample, token_budget=4 * sample.batch_size[1])
    first_update_has_ratio_one(LMActorCritic(policy.model), sample, plan)


# -- the example ----------------------------------------------------------------------------------

#: names of this library that main() calls; every line that uses one carries a marker
LIBRARY_CALLS = re.compile(
    r"\b(attach_value_head|TokenTrajectory|LMActorCritic|TokenGAE|TokenPPOLoss|plan_micro_batches|"
    r"recompute_old_log_probs_and_values|ppo_update|TorchRLBackend|named_policy_tensors|gae)[.(]"
)


def test_the_example_adds_the_critic_in_five_lines_beyond_torchrls_loop():
    """The Must-show count: with either engine, at most 5 added lines ([ar_torchrl +]) beyond
    TorchRL's own loop plus the converter; every other use of the library replaces a TorchRL line
    ([ar_torchrl ~]) and says which."""
    import inspect

    source = inspect.getsource(EXAMPLE.main).splitlines()
    added = [x for x in source if "# [ar_torchrl +]" in x]
    converter = [x for x in source if "# [ar_torchrl converter]" in x]
    replaced = [x for x in source if "# [ar_torchrl ~]" in x]
    assert len(added) == 5 and len(converter) == 1, added
    assert len(replaced) == 5  # actor, loss, update; SGLang's sync scheme and its sync
    calls = [x for x in source if LIBRARY_CALLS.search(x.split("#")[0])]
    unmarked = [x for x in calls if "# [ar_torchrl" not in x]
    assert not unmarked, unmarked
    assert len(calls) == len(added) + len(converter) + len(replaced)
    sglang_only = [x for x in replaced if "sync" in x]
    assert len(sglang_only) == 2  # the transformers engine samples with the trained model itself


LINE = re.compile(
    r"iter +(\d+) .*first-minibatch ratio min (\S+) max (\S+) \((\d+) micro-batches\)"
    r"  value-head grad (\S+)"
)


@pytest.mark.slow
def test_example_runs_torchrl_loop_with_the_critic():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}"}
    env["PYTHONPATH"] += os.environ.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--iterations", "2", "--no-warm-start"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [LINE.search(x) for x in proc.stdout.splitlines() if x.startswith("iter")]
    assert len(lines) == 2 and all(lines), proc.stdout
    for match in lines:
        assert match[2] == match[3] == "1.0", match[0]  # min_ratio == max_ratio == 1.0 exactly
        assert int(match[4]) >= 2  # the first mini-batch accumulated several micro-batches
        assert float(match[5]) > 0, match[0]  # the value head got a gradient


@pytest.mark.sglang
@pytest.mark.slow
def test_example_runs_torchrl_loop_with_an_sglang_wrapper(
    sglang_server, sglang_api_key, monkeypatch
):
    """The same loop with ``SGLangWrapper`` against the real server: first ratio exactly 1, the
    value head trained, the server's log-probs equal to the trainer's (1e-4) in every iteration,
    also after the weight sync of the first update."""
    from support.torchrl_sglang import authorized
    from torchrl.modules.llm import SGLangWrapper
    from torchrl.modules.llm.backends.sglang import AsyncSGLang

    from ar_torchrl.backends.torchrl import TorchRLBackend
    from ar_torchrl.weight_sync import named_policy_tensors

    authorized(monkeypatch, sglang_server.url, sglang_api_key)
    tok = build_char_tokenizer()
    # the server serves the example's starting policy (--no-warm-start: the seed-0 tiny Qwen3)
    with TorchRLBackend(SGLangWrapper(AsyncSGLang.connect(sglang_server.url), tokenizer=tok)) as e:
        e.sync_weights(named_policy_tensors(build_tiny_qwen3(len(tok))), version=0)
    history = EXAMPLE.main(
        2,
        engine="sglang",
        url=sglang_server.url,
        warm_start=False,
        prompts_per_batch=2,
        group_size=2,
        max_new_tokens=6,
        num_minibatches=1,  # 4 rows: one micro-batch of the 512-token budget
    )
    assert len(history) == 2
    for row in history:
        assert row["first_min_ratio"] == row["first_max_ratio"] == 1.0
        assert row["value_head_grad_norm"] > 0
        assert row["engine_log_prob_max_abs_diff"] <= 1e-4


def test_torchrls_log_prob_key_name_through_set_keys():
    """docs/torchrl.md's key table: TorchRL 0.14's ClipPPOLoss calls the old log-prob
    "action_log_prob"; TokenPPOLoss keeps "sample_log_prob" and takes TorchRL's through set_keys,
    which the anchors and the update read from the loss."""
    from torchrl.objectives import ClipPPOLoss

    from ar_torchrl.objectives import TokenGAE, TokenPPOLoss
    from ar_torchrl.training import ppo_update, recompute_old_log_probs_and_values

    assert ClipPPOLoss._AcceptedKeys().sample_log_prob == "action_log_prob"
    td = make_trajectory([3, 4], [5, 3])
    ac = tiny_actor_critic(0)
    loss = TokenPPOLoss(ac)
    assert loss.tensor_keys.sample_log_prob == "sample_log_prob"
    loss.set_keys(sample_log_prob="action_log_prob")
    plan = plan_micro_batches(td, token_budget=200)
    recompute_old_log_probs_and_values(ac, td, plan, loss=loss)
    assert "action_log_prob" in td.keys() and "sample_log_prob" not in td.keys()
    TokenGAE()(td)
    out = ppo_update(loss, torch.optim.SGD(loss.parameters(), lr=0.0), td, plan)
    assert out["train/min_ratio"] == out["train/max_ratio"] == 1.0
