"""ar_torchrl.envs.registry: environment kinds by name (single_turn -> LLMEnv, tool -> ToolEnv), the
kind a recipe config implies (rollout.env, else tools), and a kind of one's own built by the recipe's
builder."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch
from support.recipe_helpers import typed
from support.scripted_backend import ScriptedBackend

from ar_torchrl.backends import SamplingParams
from ar_torchrl.data import arithmetic_dataset
from ar_torchrl.envs import LLMEnv, ToolEnv
from ar_torchrl.envs.registry import ENV_KINDS, EnvContext, register_env_kind
from ar_torchrl.models.tiny import build_char_tokenizer
from ar_torchrl.rewards import dapo_math_reward
from ar_torchrl.tools import ToolConfig

torch.set_num_threads(1)


@pytest.fixture
def tok():
    return build_char_tokenizer()


def context(tok, **kw):
    return EnvContext(
        arithmetic_dataset(12, seed=0),
        tok,
        ScriptedBackend(tok),
        reward_fn=dapo_math_reward,
        sampling=SamplingParams(max_new_tokens=12),
        num_samples=2,
        prompts_per_batch=3,
        **kw,
    )


def test_builtin_kinds_build_their_envs(tok):
    assert ENV_KINDS.names() == ("single_turn", "tool")
    single = ENV_KINDS.build("single_turn", None, context=context(tok))
    assert type(single) is LLMEnv and single.batch_size == (6,)
    batch = single.collect()
    rewards = batch["next", "reward"].squeeze(-1).sum(-1)  # sample 0 of each prompt is right
    assert rewards.tolist() == [1.0, -1.0, 1.0, -1.0, 1.0, -1.0]
    tool = ENV_KINDS.build(
        "tool",
        None,
        context=context(tok, toolbox=ToolConfig().build(), max_turns=2, max_total_tokens=256),
    )
    assert type(tool) is ToolEnv and (tool.max_turns, tool.max_total_tokens) == (2, 256)
    assert (ENV_KINDS["tool"].multi_turn, ENV_KINDS["tool"].needs_tools) == (True, True)


def test_the_config_picks_the_kind_it_implies():
    assert typed().env_kind == "single_turn"
    assert typed(name="tool_arithmetic").env_kind == "tool"
    assert typed(["rollout.env=single_turn"]).env_kind == "single_turn"
    with pytest.raises(ValueError, match=r"config: rollout.env=tool runs tool calls: set tools"):
        typed(["rollout.env=tool"])
    with pytest.raises(ValueError, match=r"tools are set but rollout.env=single_turn calls none"):
        typed(["rollout.env=single_turn"], name="tool_arithmetic")
    with pytest.raises(
        ValueError, match=r"rollout.env: unknown environment kind 'tools' \(did you"
    ):
        typed(["rollout.env=tools"])
    with pytest.raises(ValueError, match=r"rollout.max_turns=3 needs tools"):
        typed(["rollout.max_turns=3"])
    with pytest.raises(ValueError, match=r"rollout.env_options.x: environment kind 'single_turn'"):
        typed(["+rollout.env_options.x=1"])


@dataclasses.dataclass
class EchoEnvConfig:
    """A kind of one's own: the single-turn env with every prompt sampled ``copies`` times."""

    copies: int = 1

    def build(self, context: EnvContext) -> LLMEnv:
        args, kwargs = context.env_args()
        return LLMEnv(*args, **{**kwargs, "num_samples": self.copies})


def test_a_registered_kind_is_built_by_the_recipe(tok, monkeypatch):
    from ar_torchrl.recipes.dapo_ppo import build

    before = dict(zip(ENV_KINDS.names(), ENV_KINDS.entries()))
    register_env_kind("echo", help="LLMEnv, copies per prompt")(EchoEnvConfig)
    try:
        cfg = typed(["rollout.env=echo", "+rollout.env_options.copies=3"])
        assert cfg.env_kind == "echo"
        monkeypatch.setattr(build, "build_reward", lambda cfg: dapo_math_reward)
        rows = arithmetic_dataset(8, seed=0)
        env, eval_env = build.build_envs(
            cfg, rows, rows, tok, ScriptedBackend(tok), None, trainer_can_generate=False
        )
        assert (env.num_samples, eval_env.num_samples) == (3, 3)
        assert eval_env.sampling.greedy and not env.sampling.greedy
    finally:
        ENV_KINDS._entries.clear()
        ENV_KINDS._entries.update(before)


def test_the_registry_imports_no_torch():
    code = (
        "import sys\n"
        "from ar_torchrl.envs.registry import ENV_KINDS\n"
        "print(ENV_KINDS.names(), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "('single_turn', 'tool') False"
