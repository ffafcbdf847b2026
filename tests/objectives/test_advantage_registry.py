"""ar_torchrl.objectives.registry: advantage estimators by name, each with its config schema; the
recipe's accepted names; the generic registry (ar_torchrl.registry)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.trajectories import make_trajectory

from ar_torchrl.objectives import (
    GRPOAdvantage,
    RLOOAdvantage,
    TokenGAE,
    advantage_names,
    make_advantage,
    needs_critic,
    register_advantage,
)
from ar_torchrl.objectives import registry as advantage_registry
from ar_torchrl.objectives.config import RLOOConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def scratch_registry():
    """Names registered by a test are removed afterwards."""
    before = dict(advantage_registry.ADVANTAGES._entries)
    yield
    advantage_registry.ADVANTAGES._entries.clear()
    advantage_registry.ADVANTAGES._entries.update(before)


def test_builtin_estimators_and_their_arguments():
    assert advantage_names()[:3] == ("gae", "grpo", "rloo")
    assert (needs_critic("gae"), needs_critic("grpo"), needs_critic("rloo")) == (True, False, False)
    gae = make_advantage("gae", critic=True, gamma=0.9, lmbda=0.8, normalize_advantage=True)
    assert isinstance(gae, TokenGAE) and (gae.gamma, gae.lmbda) == (0.9, 0.8)
    grpo = make_advantage("grpo", critic=False, scale=False)
    assert isinstance(grpo, GRPOAdvantage) and not grpo.critic_targets and not grpo.scale
    assert make_advantage("grpo", critic=True).critic_targets  # the one-key swap's rule
    rloo = make_advantage("rloo", critic=True, gamma=0.5)
    assert isinstance(rloo, RLOOAdvantage) and rloo.critic_targets and rloo.gamma == 0.5
    # each entry carries its torch-free schema, with the library's own range checks
    assert [f.name for f in dataclasses.fields(advantage_registry.ADVANTAGES["gae"].config)] == [
        "lmbda",
        "critic_lmbda",
        "normalize_advantage",
        "timestep",
    ]
    with pytest.raises(ValueError, match=r"config: algo.gae.lmbda must be >= 0 and <= 1, got 2"):
        advantage_registry.ADVANTAGES.options("gae", {"lmbda": 2}, prefix="config: algo.gae.")


def trajectory():
    td = make_trajectory([3, 2, 4, 3, 1, 2, 3, 4], [4, 5, 2, 3, 3, 1, 4, 2], group_size=4)
    td["state_value"] = torch.randn(*td.shape, 1, generator=torch.Generator().manual_seed(0))
    return td


def test_registered_estimators_run_on_a_trajectory():
    for name in ("gae", "grpo", "rloo", "reinforce_pp"):
        td = trajectory()
        out = make_advantage(name, critic=True)(td)
        assert out["advantage"].shape == out["value_target"].shape == (*td.shape, 1)
        assert (out["advantage"][~td["loss_mask"]] == 0).all()


def test_errors_name_the_estimator():
    with pytest.raises(
        ValueError,
        match=r"unknown advantage estimator 'vtrace'; registered: \['gae', 'grpo', 'rloo'",
    ):
        make_advantage("vtrace")
    with pytest.raises(ValueError, match=r"'gae' needs a value head \(critic=True\).*\['grpo'"):
        make_advantage("gae", critic=False)
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        needs_critic("nope")
    with pytest.raises(  # a wrong argument is not silently dropped
        ValueError,
        match=r"advantage estimator 'grpo' has no option 'lmbda'; its options: \['scale'\]",
    ):
        make_advantage("grpo", critic=False, lmbda=0.9)
    with pytest.raises(ValueError, match=r"did you mean 'lmbda'"):
        make_advantage("gae", critic=True, lambda_=0.9)


@dataclasses.dataclass
class SequenceReward:
    """An estimator in the one registration shape: the options' dataclass, with ``build``."""

    scale: float = 1.0

    def build(self, *, critic: bool, gamma: float):
        return lambda td: td.set("advantage", self.scale * td["next", "reward"])


def test_register_a_new_estimator(scratch_registry):
    register_advantage("sequence_reward", help="the reward as the advantage")(SequenceReward)
    assert advantage_names()[-1] == "sequence_reward" and not needs_critic("sequence_reward")
    register_advantage("sequence_reward")(SequenceReward)  # the same schema again: fine
    with pytest.raises(ValueError, match="'sequence_reward' is already registered"):
        register_advantage("sequence_reward")(
            dataclasses.dataclass(type("Other", (SequenceReward,), {}))
        )
    td = trajectory()
    out = make_advantage("sequence_reward", scale=2.0)(td)
    torch.testing.assert_close(out["advantage"], 2.0 * td["next", "reward"])


def test_recipe_accepts_exactly_the_registered_names(scratch_registry):
    from support.recipe_helpers import typed as recipe_config

    def typed(mode):
        return recipe_config([f"algo.advantage_mode={mode}"])

    with pytest.raises(ValueError, match="algo.advantage_mode='sequence_reward' is not one of"):
        typed("sequence_reward")
    register_advantage("sequence_reward", help="the reward as the advantage")(SequenceReward)
    cfg = typed("sequence_reward")
    assert cfg.algo.advantage_options() == SequenceReward()  # its schema: its algo section
    assert typed("rloo").algo.advantage_options() == RLOOConfig()


def test_registry_imports_no_torch():
    code = "import sys, ar_torchrl.objectives.registry as r; print(r.advantage_names(), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "('gae', 'grpo', 'rloo', 'reinforce_pp') False"
