"""Running the recipe (``examples/dapo_ppo.py``) in a subprocess, as a user would, and comparing runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from ar_torchrl.recipes.strategy import LocalStrategy
from support.recipe_helpers import typed

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "dapo_ppo.py"


#: Resume tests: 4 iterations, checkpoints and evaluations every 2.
COMMON = [
    "train.iterations=4",
    "train.checkpoint_every=2",
    "train.eval_every=2",
    "train.plot=false",
]


def recipe_env(cache: Path) -> dict:
    return {
        **os.environ,
        "AR_TORCHRL_CACHE": str(cache),
        "OMP_NUM_THREADS": "1",
        "HYDRA_FULL_ERROR": "1",
        "TQDM_DISABLE": "1",
    }


def read_history(run_dir: Path) -> list[dict]:
    metrics = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []


def run_recipe(
    run_dir: Path, cache: Path, *overrides: str, check: bool = True, config_name: str | None = None
):
    name = ["--config-name", config_name] if config_name else []
    cmd = [sys.executable, str(SCRIPT), *name, f"hydra.run.dir={run_dir}", *overrides]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=recipe_env(cache), capture_output=True, text=True, timeout=900
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"recipe failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc, read_history(run_dir)


def same_runs(a: list[dict], b: list[dict]) -> None:
    assert [h["step"] for h in a] == [h["step"] for h in b]
    for x, y in zip(a, b):
        keys = {k for k in x if not k.startswith("time/")}
        assert keys == {k for k in y if not k.startswith("time/")}
        assert {k: x[k] for k in keys} == {k: y[k] for k in keys}, f"step {x['step']} differs"


def mean(xs):
    return sum(xs) / len(xs)


TOOLS = [
    "model.warm_start.steps=100",
    "model.warm_start.tool_fraction=1.0",
    "rollout.prompts_per_iter=4",
    "rollout.samples_per_prompt=2",
    "rollout.max_turns=3",
    "rollout.tool_error_penalty=-0.1",
    "data.holdout=8",
    "train.eval_prompts=8",
    "train.iterations=3",
    "train.checkpoint_every=2",
    "train.eval_every=3",
    "train.plot=false",
]


#: The tool task, 3 iterations, a checkpoint after each (step 2's is resumed); iteration 1 trains
#: the critic only; the critic's lr warms up over 1 iteration, then decays linearly to 0.
TOOL_CONFIG = "tool_arithmetic"


SEPARATE = [
    *(o for o in TOOLS if not o.startswith("train.")),
    "critic=separate",
    "train.iterations=3",
    "train.checkpoint_every=1",
    "train.keep_checkpoints=null",
    "train.eval_every=3",
    "train.eval_prompts=8",
    "train.plot=false",
    "algo.critic_warmup_iters=1",
    "algo.value_lr_schedule=linear",
    "algo.value_lr_warmup_iters=1",
]
#: ``critic.confidence_features=true`` on top of :data:`SEPARATE` (the value head also reads the
#: sampling log-probs), with the end-of-run export
CONFIDENCE = ("critic.confidence_features=true", "train.export=true")


def start_policy(cache_dir, overrides=(), name="dapo_ppo", *, value_head=True):
    """The run's starting policy (warm start from the session's cache), built as the recipe does."""
    model = typed(list(overrides), name).model
    return LocalStrategy().build_policy(model, str(cache_dir), value_head=value_head)[0]


def assert_policy_is_the_start(state: dict, start: torch.nn.Module) -> None:
    """The checkpoint's policy weights are the starting policy's, bit for bit (critic warm-up);
    the shared case is checked on tests/recipes/test_recipe.py's async run."""
    want = policy_tensors(start.state_dict())
    assert policy_tensors(state["model"]).keys() == want.keys()
    assert all(torch.equal(state["model"][k], v) for k, v in want.items())


def policy_tensors(state: dict) -> dict:
    return {k: v for k, v in state.items() if not k.startswith("value_head.")}
