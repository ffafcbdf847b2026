"""The real-model configuration (ar_torchrl/configs/smollm2_arithmetic.yaml): it composes to the typed schema,
bad task values are rejected naming the key, its data split is disjoint, and two iterations of it
run end to end on SmolLM2-135M-Instruct (CI smoke run; the learning curves in the README are a
benchmark run, not a test)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.recipe_helpers import load as _load

from ar_torchrl.data.tasks import FewshotArithmeticDataConfig
from ar_torchrl.models.config import SmolLM2ModelConfig
from ar_torchrl.recipes.dapo_ppo import config as recipe_config

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "dapo_ppo.py"
CONFIG = "smollm2_arithmetic"


def load(overrides=(), name: str = CONFIG):
    return _load(overrides, name)


@pytest.mark.parametrize("overrides", [[], ["algo=grpo"], ["backend=sglang"]])
def test_config_composes_and_validates(overrides):
    cfg = recipe_config.validate_config(load(overrides))
    assert isinstance(cfg.model, SmolLM2ModelConfig)
    assert isinstance(cfg.data, FewshotArithmeticDataConfig)
    assert cfg.algo.lr == 1e-5 and cfg.algo.kl_coeff == 0.0  # kl 0: no frozen reference copy
    assert cfg.data.ops == ["+", "*"] and cfg.data.shots == 1


def test_split_is_disjoint_and_evaluation_uses_every_held_out_problem():
    from ar_torchrl.recipes.dapo_ppo import build  # torch, transformers, TorchRL

    cfg = recipe_config.validate_config(load())
    train, held_out = build.build_datasets(cfg)
    assert (len(train), len(held_out)) == (cfg.data.num_rows, cfg.data.holdout)
    seen = {m["content"] for r in train for m in r["prompt"]}
    assert not {r["prompt"][-1]["content"] for r in held_out} & seen  # never tune on eval prompts


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.ops=[/]", r"data\.ops must be a non-empty list of \+, -, \*; got \['/'\]"),
        ("data.ops=[]", r"data\.ops must be a non-empty list"),
        ("data.max_operand=-1", r"data\.max_operand"),
        ("data.shots=-1", r"data\.shots"),
        ("data.holdout=200", r"data\.holdout=200 must be < 200, the number of distinct problems"),
    ],
)
def test_bad_task_values_name_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        recipe_config.validate_config(load([override]))


def test_fewshot_task_is_a_data_option_of_the_default_recipe():
    cfg = recipe_config.validate_config(load(["data=fewshot_arithmetic"], name="dapo_ppo"))
    assert isinstance(cfg.data, FewshotArithmeticDataConfig) and cfg.data.holdout == 64


@pytest.mark.slow
def test_two_iterations_on_the_real_model(tmp_path):
    """The README's PPO command, 2 iterations of 2 prompts x 2 samples (GGUF conversion + load ~45 s)."""
    cache, run_dir = tmp_path / "cache", tmp_path / "run"
    env = {
        **os.environ,
        "AR_TORCHRL_CACHE": str(cache),
        "OMP_NUM_THREADS": "1",
        "HYDRA_FULL_ERROR": "1",
        "TQDM_DISABLE": "1",
    }
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--config-name",
        CONFIG,
        f"hydra.run.dir={run_dir}",
        "train.iterations=2",
        "train.eval_every=2",
        "train.eval_prompts=4",
        "rollout.prompts_per_iter=2",
        "rollout.samples_per_prompt=2",
        "train.plot=false",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    history = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [0, 1, 2]
    for h in history[1:]:
        assert -1.0 <= h["rollout/reward_mean"] <= 1.0 and math.isfinite(h["train/loss_objective"])
        assert h["train/optimizer_steps"] >= 1 and math.isfinite(h["train/loss_critic"])
        assert h["rollout/logprob_drift"] < 1e-4  # trainside rollouts == trainer log-probs
    assert -1.0 <= history[-1]["eval/reward_mean"] <= 1.0
