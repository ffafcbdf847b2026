"""Hydra configs: every key commented, the CPU default and the GPU recipe compose and validate, and
the GPU recipe instantiates everything up to the point that needs a GPU (model weights, server)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from ar_torchrl.assets import build_tiny_qwen3
from ar_torchrl.backends import SamplingParams
from ar_torchrl.modules import LMActorCritic, attach_value_head
from ar_torchrl.objectives import GRPOAdvantage, TokenGAE, TokenPPOLoss

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
torch.set_num_threads(1)


def recipe_module():
    spec = importlib.util.spec_from_file_location("dapo_ppo", ROOT / "examples" / "dapo_ppo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load(name: str, overrides: list[str] | None = None):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name=name, overrides=overrides or [])


def test_every_key_is_commented():
    files = sorted(CONFIGS.rglob("*.yaml"))
    assert len(files) >= 14
    missing = []
    for f in files:
        for no, line in enumerate(f.read_text().splitlines(), 1):
            if re.match(r"^\s*[A-Za-z_][\w]*:", line) and "#" not in line:
                if line.strip() != "defaults:":
                    missing.append(f"{f.relative_to(ROOT)}:{no}: {line.strip()}")
    assert not missing, "uncommented keys:\n" + "\n".join(missing)


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["algo=grpo"],
        ["model=smollm2_135m", "backend=sglang"],
        ["data=dapo_math", "logger=none"],
    ],
)
def test_cpu_default_and_groups_compose_and_validate(overrides):
    cfg = load("dapo_ppo", overrides)
    recipe_module().validate_config(cfg)
    assert cfg.rollout.prompts_per_iter == 16 and cfg.rollout.samples_per_prompt == 4


def test_gpu_recipe_values():
    cfg = load("qwen3_4b_base_dapo_sglang")
    OmegaConf.resolve(cfg)  # every interpolation resolves
    recipe_module().validate_config(cfg)
    assert cfg.model.name == "pretrained" and cfg.model.path.endswith("Qwen3-4B-Base")
    assert cfg.backend.name == "sglang" and cfg.data.name == "dapo_math"
    assert cfg.data.path.endswith(".parquet")
    r, a = cfg.rollout, cfg.algo
    assert (r.prompts_per_iter, r.samples_per_prompt, r.max_new_tokens) == (64, 8, 8192)
    assert r.overlong_buffer == 4096 and r.token_budget > 0
    assert list(a.clip_epsilon) == [0.2, 0.28] and a.clip_value == 0.2
    assert (a.gamma, a.lmbda, a.lr, a.loss_agg_mode) == (1.0, 0.95, 1e-6, "token_mean")
    assert a.drop_zero_spread is True and a.kl_coeff == 0.0


def test_gpu_recipe_instantiates_up_to_the_gpu(tmp_path):
    """Everything but the 4B weights and the server: data, advantage (both modes), loss, optimizer."""
    import json

    recipe = recipe_module()
    data = tmp_path / "dapo.jsonl"
    from ar_torchrl.data.datasets import make_row

    rows = [make_row(f"What is {i} + 1?", str(i + 1), index=i) for i in range(300)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load("qwen3_4b_base_dapo_sglang", [f"data.path={data}"])
    train_rows, eval_rows = recipe.build_datasets(cfg.data)
    assert (len(train_rows), len(eval_rows)) == (44, 256)
    assert isinstance(recipe.build_advantage(cfg), TokenGAE)
    grpo = load("qwen3_4b_base_dapo_sglang", ["algo.advantage_mode=grpo"])
    adv = recipe.build_advantage(grpo)
    assert isinstance(adv, GRPOAdvantage) and adv.drop_zero_spread  # DAPO dynamic sampling
    model = attach_value_head(build_tiny_qwen3(99))  # stands in for Qwen3-4B-Base
    a = cfg.algo
    loss = TokenPPOLoss(LMActorCritic(model), clip_epsilon=tuple(a.clip_epsilon),
                        clip_value=a.clip_value, critic_coeff=a.critic_coeff, kl_coeff=a.kl_coeff,
                        loss_agg_mode=a.loss_agg_mode)  # fmt: skip
    assert (loss.clip_epsilon_low.item(), loss.clip_epsilon_high.item()) == pytest.approx(
        (0.2, 0.28)
    )
    opt = recipe.build_optimizer(cfg, model)
    assert [g["lr"] for g in opt.param_groups] == [1e-6, 1e-5]
    assert SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens).max_new_tokens == 8192
    with pytest.raises(FileNotFoundError, match="is not a HF model directory"):
        recipe.build_model(load("qwen3_4b_base_dapo_sglang", ["model.path=/nonexistent/Qwen3-4B"]))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["algo.advantage_mode=vtrace"],
            r"algo.advantage_mode='vtrace' is not one of \['gae', 'grpo'\]",
        ),
        (["train.mode=threads"], r"train.mode='threads' is not one of \['sync', 'async'\]"),
        (["rollout.max_new_tokens=0"], r"rollout.max_new_tokens=0 must be an integer >= 1"),
        (["algo.clip_epsilon=[0.2]"], r"algo.clip_epsilon=\[0.2\] must be \[low, high\]"),
        (["algo.critic_coeff=0"], r"advantage_mode=gae needs algo.critic_coeff > 0"),
        (
            ["rollout.packing=sometimes"],
            r"rollout.packing='sometimes' is not one of \[False, True, 'auto'\]",
        ),
    ],
)
def test_bad_values_get_clear_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        recipe_module().validate_config(load("dapo_ppo", overrides))


def test_unknown_key_is_rejected_by_hydra():
    with pytest.raises(ConfigCompositionException, match="rollout.max_new_token"):
        load("dapo_ppo", ["rollout.max_new_token=3"])
