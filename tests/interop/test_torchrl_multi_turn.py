"""Multi-turn TorchRL dialogs -> token trajectories (issue 30 item 3).

A TorchRL user's tool episode (``DatasetChatEnv`` + a ``ToolTransformBase`` tool transform +
``TransformersWrapper`` + ``LLMCollector(yield_completed_trajectories=True)``) is converted by
``TokenTrajectory`` into exactly the trajectory ``ToolEnv`` builds for the same episode (same tokens,
masks, turn ids, rewards, flags), and trains (first update ratio exactly 1, token- and turn-level
GAE). The policy is :class:`support.scripted_lm.ScriptedToolLM` (a random tiny model never calls a
tool); ``ToolEnv`` generates with the same ``TransformersWrapper`` through ``TorchRLBackend``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from support.scripted_lm import scripted_tool_lm, torchrl_tool_env
from support.trajectories import first_update_has_ratio_one
from tensordict import TensorDict, lazy_stack, set_list_to_stack
from torchrl.collectors.llm import LLMCollector
from torchrl.modules.llm import TransformersWrapper

from ar_torchrl.backends import SamplingParams
from ar_torchrl.backends.torchrl import TorchRLBackend
from ar_torchrl.data.tasks import tool_arithmetic_rows
from ar_torchrl.envs import ToolEnv
from ar_torchrl.interop import TokenTrajectory
from ar_torchrl.models import build_char_tokenizer, build_tiny_qwen3
from ar_torchrl.modules import LMActorCritic, attach_value_head
from ar_torchrl.objectives import TokenGAE, TokenPPOLoss
from ar_torchrl.tools import ToolConfig
from ar_torchrl.training import plan_micro_batches, recompute_old_log_probs_and_values

torch.set_num_threads(1)
MAX_NEW = 40
LAYOUT = [
    "tokens",
    "attention_mask",
    "loss_mask",
    "turn_id",
    ("next", "reward"),
    ("next", "done"),
    ("next", "terminated"),
    ("next", "truncated"),
]


@pytest.fixture(scope="module")
def episode():
    """Two tool episodes, each collected by TorchRL and by ToolEnv with the same policy."""
    set_list_to_stack(True).set()
    tok = build_char_tokenizer()
    rows = tool_arithmetic_rows(2, seed=0)
    policy = TransformersWrapper(
        scripted_tool_lm(tok),
        tokenizer=tok,
        input_mode="history",
        generate=True,
        pad_output=False,
        generate_kwargs={"max_new_tokens": MAX_NEW, "do_sample": False, "bad_words_ids": [[0]]},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # TorchRL's InitTracker notice
        collector = LLMCollector(
            torchrl_tool_env(list(rows), tok),
            policy=policy,
            dialog_turns_per_batch=4,
            track_policy_version=True,
            yield_completed_trajectories=True,
        )
    data = next(iter(collector))
    collector.shutdown()
    tool_env = ToolEnv(
        rows,
        tok,
        TorchRLBackend(policy),
        toolbox=ToolConfig().build(),
        num_samples=1,
        prompts_per_batch=2,
        shuffle=False,
        sampling=SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0),
        max_turns=3,
    )
    return tok, policy, data, tool_env.collect()


def test_a_chat_env_tool_episode_converts_token_for_token_like_tool_env(episode):
    tok, policy, data, tool_env = episode
    assert data.batch_size == (4,)  # two dialogs of two turns, turn after turn
    assert data["next", "done"].flatten().tolist() == [False, True, False, True]
    td = TokenTrajectory.from_policy(policy)(data)
    assert td.batch_size == tool_env.batch_size
    for key in LAYOUT:
        assert torch.equal(td[key], tool_env[key]), key
    # what the rows hold: the call (turn 0), the tool's answer (masked), the answer (turn 1)
    row = td["tokens"][0][td["attention_mask"][0]]
    text = tok.decode(row)
    assert text.count("<|im_start|>assistant\n") == 2 and "<|im_start|>tool\n3717<|im_end|>" in text
    turn0 = tok.decode(row[td["turn_id"][0][td["attention_mask"][0]] == 0])
    turn1 = tok.decode(row[td["turn_id"][0][td["attention_mask"][0]] == 1])
    assert (turn0, turn1) == (
        '<tool name="calculator">59*63</tool><|im_end|>',
        "Answer: 3717<|im_end|>",
    )
    masked = row[~td["loss_mask"][0][td["attention_mask"][0]]]
    assert "tool\n3717" in tok.decode(masked) and "Answer: 3717" not in tok.decode(masked)
    assert td["next", "reward"].sum((1, 2)).tolist() == [1.0, 1.0]  # both answers right
    assert td["next", "terminated"].any(1).flatten().tolist() == [True, True]
    assert (td["policy_version"] == 0).all()


@pytest.mark.parametrize("timestep", ["token", "turn"])
def test_a_two_turn_training_iteration_from_the_converted_dialogs(episode, timestep):
    _, policy, data, _ = episode
    td = TokenTrajectory.from_policy(policy)(data)
    model = attach_value_head(build_tiny_qwen3(99))
    actor_critic = LMActorCritic(model)
    plan = plan_micro_batches(td, token_budget=td.batch_size[1])  # one row per micro-batch
    assert len(plan.micro_batches) == 2
    recompute_old_log_probs_and_values(actor_critic, td, plan)
    TokenGAE(gamma=1.0, lmbda=0.95, timestep=timestep)(td)
    tool_tokens = td["attention_mask"] & ~td["loss_mask"] & (td["turn_id"] == -1)
    assert (td["advantage"][tool_tokens] == 0).all()
    if timestep == "turn":  # one advantage per turn, broadcast to its tokens
        for b in range(2):
            for turn in (0, 1):
                adv = td["advantage"][b][td["turn_id"][b] == turn]
                assert adv.unique().numel() == 1
    loss = TokenPPOLoss(actor_critic)
    for mb in plan.micro_batches:
        out = loss(plan.crop(td, mb))
        assert out["min_ratio"].item() == out["max_ratio"].item() == 1.0
        (out["loss_objective"] + out["loss_critic"]).backward()
    assert model.value_head.weight.grad.norm() > 0


def test_first_update_ratio_one_with_the_shared_helper(episode):
    _, policy, data, _ = episode
    td = TokenTrajectory.from_policy(policy, turn_ids=True)(data)
    plan = plan_micro_batches(td, token_budget=2 * td.batch_size[1])
    first_update_has_ratio_one(LMActorCritic(attach_value_head(build_tiny_qwen3(99))), td, plan)


# -- synthetic dialogs: what the converter refuses and how it splits ------------------------------

EOS = 2


def step(prompt, response, *, done, reward=0.0, version=0, terminated=None, traj=None):
    td = TensorDict(
        {
            "tokens": {"prompt": torch.tensor(prompt), "response": torch.tensor(response)},
            "next": {
                "reward": torch.full((1, 1), reward),
                "done": torch.tensor([done]),
                "terminated": torch.tensor([done if terminated is None else terminated]),
                "policy_version": torch.tensor(version),
            },
        }
    )
    if traj is not None:
        td["collector", "traj_ids"] = torch.tensor(traj)
    return td


def dialog(version1=0, traj=None, reward=1.0):
    """Prompt [1, 40]; turn 0 [7, EOS]; a tool inserts [50, 51]; turn 1 [8, EOS]."""
    return [
        step([1, 40], [7, EOS], done=False, traj=traj),
        step(
            [1, 40, 7, EOS, 50, 51], [8, EOS], done=True, reward=reward, version=version1, traj=traj
        ),
    ]


def convert(steps, **kwargs):
    return TokenTrajectory(build_char_tokenizer(), max_new_tokens=3, **kwargs)(lazy_stack(steps))


def test_dialogs_split_at_done_and_a_single_turn_dialog_in_a_multi_turn_batch():
    td = convert([*dialog(), step([1, 41], [9, EOS], done=True, reward=-1.0)])
    assert td.batch_size == (2, 8)
    assert td["turn_id"].tolist() == [[-1, -1, 0, 0, -1, -1, 1, 1], [-1, -1, 0, 0, -1, -1, -1, -1]]
    assert td["next", "reward"].sum((1, 2)).tolist() == [1.0, -1.0]
    assert td["next", "terminated"].any(1).flatten().tolist() == [True, True]
    single = convert([step([1, 41], [9, EOS], done=True)])
    assert (
        "turn_id" not in single.keys()
        and "turn_id" in convert([step([1, 41], [9, EOS], done=True)], turn_ids=True).keys()
    )
    # a [B, T] batch: one dialog per row; the collector's trajectory ids split too
    rows = lazy_stack([lazy_stack(dialog()), lazy_stack(dialog(reward=-1.0))])
    assert rows.batch_size == (2, 2)
    two = TokenTrajectory(build_char_tokenizer(), max_new_tokens=3)(rows)
    assert two["next", "reward"].sum((1, 2)).tolist() == [1.0, -1.0]
    assert torch.equal(two["tokens"][0], two["tokens"][1])


def test_a_dialog_cut_by_the_turn_cap_is_truncated():
    cut = dialog()
    cut[1]["next", "terminated"] = torch.tensor([False])  # StepCounter ended it, not the env
    td = convert(cut)
    assert td["next", "truncated"].any(1).flatten().tolist() == [True]
    length = [step([1, 40], [7, 8, 9], done=True)]  # one turn at max_new_tokens: truncated
    assert convert(length)["next", "truncated"].any().item()


def test_a_dialog_the_batch_cuts_or_a_prompt_that_does_not_continue_is_refused():
    with pytest.raises(
        ValueError, match=r"row 2 is not done .* rows \[2\].*yield_completed_trajectories=True"
    ):
        convert([*dialog(), step([1, 41], [9, EOS], done=False)])
    with pytest.raises(ValueError, match=r"row 0 is not done .*dialog of rows \[0\]"):
        convert([step([1, 40], [7, EOS], done=False, traj=0), *dialog(traj=1)])
    rerendered = dialog()
    rerendered[1]["tokens", "prompt"] = torch.tensor(
        [1, 40, 7, 50, 51]
    )  # EOS dropped by a template
    with pytest.raises(
        ValueError,
        match=r"row 1 \(turn 1 of its dialog\): its prompt does not continue the dialog token for "
        r"token: at position 3 the dialog has '<\|im_end\|>', TorchRL's prompt 'OP'.*re-tokenizes",
    ):
        convert(rerendered)
    short = dialog()
    short[0]["tokens", "response"] = torch.tensor(
        [7]
    )  # neither EOS nor max_new_tokens: lost tokens
    with pytest.raises(ValueError, match=r"row 0 has 1 generated tokens, does not end with EOS"):
        convert(short)


def test_each_turn_keeps_its_version_when_mixed_versions_are_allowed():
    with pytest.raises(
        ValueError, match=r"row 1 has .* \[4\], row 0 has 0: one batch.*allow_mixed"
    ):
        convert(dialog(version1=4))
    td = convert(dialog(version1=4), allow_mixed_versions=True)
    versions = td["policy_version"][0][td["loss_mask"][0]].tolist()
    assert versions == [0, 0, 4, 4]
    assert td["policy_version"][0][~td["loss_mask"][0]].unique().tolist() == [0]  # the oldest


def test_engine_log_probs_per_turn_are_kept_with_raise():
    steps = dialog()
    steps[0]["log_probs", "response"] = torch.tensor([-0.5, -0.25])
    steps[1]["log_probs", "response"] = torch.tensor([-1.0, -2.0])
    td = convert(steps, rollout_log_prob="raise")
    assert td["rollout_log_prob"][0][td["loss_mask"][0]].tolist() == [-0.5, -0.25, -1.0, -2.0]
    assert (td["rollout_log_prob"][0][~td["loss_mask"][0]] == 0).all()
