"""The real-model configuration (configs/smollm2_arithmetic.yaml): it composes, its data split is
disjoint, and two iterations of it run end to end on SmolLM2-135M-Instruct (CI smoke run; the
learning curves in the README are a benchmark run, not a test)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "dapo_ppo.py"
CONFIG = "smollm2_arithmetic"


def recipe_module():
    spec = importlib.util.spec_from_file_location("dapo_ppo", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load(overrides=()):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name=CONFIG, overrides=list(overrides))


@pytest.mark.parametrize("overrides", [[], ["algo=grpo"], ["backend=sglang"]])
def test_config_composes_and_validates(overrides):
    cfg = load(overrides)
    recipe = recipe_module()
    recipe.validate_config(cfg)
    assert cfg.model.name == "smollm2_135m" and cfg.data.name == "fewshot_arithmetic"
    assert cfg.algo.lr == 1e-5 and cfg.algo.kl_coeff == 0.0 and not cfg.model.ref_policy
    train, held_out = recipe.build_datasets(cfg.data)
    assert (len(train), len(held_out)) == (cfg.data.num_rows, cfg.data.holdout)
    seen = {m["content"] for r in train for m in r["prompt"]}
    assert not {r["prompt"][-1]["content"] for r in held_out} & seen  # never tune on eval prompts


@pytest.mark.slow
def test_two_iterations_on_the_real_model(tmp_path):
    """The README's PPO command with 2 iterations and 2 prompts (model conversion + load ~45 s)."""
    cache, run_dir = tmp_path / "cache", tmp_path / "run"
    env = {**os.environ, "AR_TORCHRL_CACHE": str(cache), "OMP_NUM_THREADS": "1",
           "HYDRA_FULL_ERROR": "1", "TQDM_DISABLE": "1"}  # fmt: skip
    cmd = [sys.executable, str(SCRIPT), "--config-name", CONFIG,
           f"hydra.run.dir={run_dir}", "train.iterations=2", "train.eval_every=2",
           "train.eval_prompts=4", "rollout.prompts_per_iter=2", "train.plot=false"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    history = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [0, 1, 2]
    for h in history[1:]:
        assert -1.0 <= h["rollout/reward_mean"] <= 1.0 and math.isfinite(h["train/loss_objective"])
        assert h["train/skipped_steps"] == 0 and h["train/optimizer_steps"] >= 1
        assert h["rollout/logprob_drift"] < 1e-4  # trainside rollouts == trainer log-probs
        assert math.isfinite(h["train/loss_critic"])  # the value head trains
    assert -1.0 <= history[-1]["eval/reward_mean"] <= 1.0
