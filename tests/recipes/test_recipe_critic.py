"""The recipe's critic options end to end: ``critic=separate`` (a second model) and ``critic=shared``
(the value head), the critic's warm start from an earlier run (``critic.init_from``), critic-only
warm-up iterations, the critic's learning-rate schedule, and their configuration errors.

The ``critic=separate`` runs play the multi-turn tool task (``--config-name tool_arithmetic`` with
tests/recipes/test_recipe_tools.py's lean warm start: episodes of several turns, where a critic matters
most); tests/recipes/test_recipe_torchrun.py runs the same configuration on 2 ranks."""

from __future__ import annotations

import math

import pytest
import torch
from support.recipe_helpers import typed
from support.recipe_runs import (
    CONFIDENCE,
    SEPARATE,
    TOOL_CONFIG,
    assert_policy_is_the_start,
    run_recipe,
    same_runs,
    start_policy,
)

from ar_torchrl.checkpoint import local
from ar_torchrl.models.tiny import build_tiny_qwen3, save_tiny_model
from ar_torchrl.modules import attach_value_head
from ar_torchrl.recipes.strategy import LocalStrategy
from ar_torchrl.training import lr_schedule_factor


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.mark.slow
def test_separate_critic_trains_checkpoints_and_resumes_exactly(separate_run, tmp_path, cache_dir):
    run_dir, history = separate_run
    assert [h["step"] for h in history] == [0, 1, 2, 3]
    assert history[1]["rollout/turns"] > 1.0  # multi-turn episodes (observation tokens between)
    for h in history[1:]:
        assert math.isfinite(h["train/loss_critic"]) and h["train/grad_norm_critic"] > 0
        assert (h["train/grad_norm"] > 0) == (h["step"] > 1)  # step 1: the critic only
        assert h["train/skipped_steps"] == 0
    # the critic's own schedule: warm-up (1 iteration), then linear from value_lr to 0
    assert [h["train/critic_lr"] for h in history[1:]] == [3e-3, 3e-3, 0.0]
    state = _load(run_dir / "checkpoints" / "step_3.pt")
    assert not any(k.startswith("value_head.") for k in state["model"])  # the policy has no head
    assert {"value_head.weight", "value_head.bias"} <= set(state["critic"])
    assert state["critic"]["value_head.weight"].abs().sum() > 0  # trained from zero
    assert [g["name"] for g in state["optimizer"]["param_groups"]] == ["policy", "critic"]
    _, resumed = run_recipe(
        tmp_path,
        cache_dir,
        *SEPARATE,
        f"train.resume_from={run_dir / 'checkpoints/step_2.pt'}",
        config_name=TOOL_CONFIG,
    )
    same_runs(history, resumed)


@pytest.mark.slow
def test_critic_init_from_loads_exactly_the_saved_critic(separate_run, tmp_path, cache_dir):
    """A new run warm-starts its separate critic from the earlier run's newest checkpoint (the run
    directory is named): with the critic's lr at 0 its critic ends equal to the saved one, bit for
    bit; its optimizer state is rebuilt (2 AdamW steps, not the earlier run's 6) and its policy is
    the fresh starting policy."""
    run_dir, _ = separate_run
    saved = _load(run_dir / "checkpoints" / "step_3.pt")
    proc, _ = run_recipe(
        tmp_path,
        cache_dir,
        *(o for o in SEPARATE if not o.startswith(("train.", "algo."))),
        f"critic.init_from={run_dir}",
        "algo.value_lr=0",
        "train.iterations=1",
        "train.eval_every=0",
        "train.plot=false",
        config_name=TOOL_CONFIG,
    )
    assert "the critic starts from the separate critic of step_3.pt" in proc.stdout + proc.stderr
    new = _load(tmp_path / "checkpoints" / "step_1.pt")
    assert new["critic"].keys() == saved["critic"].keys()
    assert all(torch.equal(new["critic"][k], saved["critic"][k]) for k in saved["critic"])
    critic_group = new["optimizer"]["param_groups"][1]
    steps = {float(new["optimizer"]["state"][i]["step"]) for i in critic_group["params"]}
    assert steps == {2.0}  # 1 iteration x 2 epochs here; the earlier run's state had 6
    start = start_policy(cache_dir, SEPARATE, TOOL_CONFIG, value_head=False)
    policy_moved = [not torch.equal(v, saved["model"][k]) for k, v in start.state_dict().items()]
    assert any(policy_moved)  # the earlier run's policy is not what this one started from


@pytest.mark.slow
def test_critic_warmup_leaves_the_policy_bit_identical(separate_run, cache_dir):
    run_dir, history = separate_run
    state = _load(run_dir / "checkpoints" / "step_1.pt")
    assert_policy_is_the_start(state, start_policy(cache_dir, SEPARATE, TOOL_CONFIG))
    assert state["critic"]["value_head.weight"].abs().sum() > 0  # the critic did learn
    assert history[1]["train/kl_ref"] == 0.0 and history[2]["train/kl_ref"] > 0.0


# ----------------------------------------------------------------------------- fast
def test_lr_schedule_factor_matches_a_loop():
    for schedule in ("constant", "linear", "cosine"):
        for total, warmup, low in ((10, 0, 0.0), (10, 3, 0.2), (4, 4, 0.5), (1, 0, 0.1)):
            for step in range(1, total + 1):
                if step <= warmup:
                    want = step / warmup
                elif schedule == "constant":
                    want = 1.0
                else:
                    span = total - warmup - 1
                    p = 0.0 if span <= 0 else (step - warmup - 1) / span
                    decay = 1 - p if schedule == "linear" else (1 + math.cos(math.pi * p)) / 2
                    want = low + (1 - low) * decay
                got = lr_schedule_factor(
                    step, total, schedule=schedule, warmup=warmup, min_ratio=low
                )
                assert got == pytest.approx(want, abs=1e-12), (schedule, total, warmup, step)
    with pytest.raises(ValueError, match=r"schedule must be constant, linear or cosine, got 'exp'"):
        lr_schedule_factor(1, 2, schedule="exp")


def test_shared_head_warm_start_loads_the_head_and_refuses_a_separate_critic(tmp_path):
    old = attach_value_head(build_tiny_qwen3(99, seed=1))
    torch.nn.init.normal_(old.value_head.weight)
    shared = local.save(tmp_path / "shared", step=4, model=old)
    new = attach_value_head(build_tiny_qwen3(99, seed=2))
    before = {k: v.clone() for k, v in new.model.state_dict().items()}
    assert local.load_critic(shared, critic=None, model=new) == "the value head of step_4.pt"
    assert torch.equal(new.value_head.weight, old.value_head.weight)
    assert all(torch.equal(new.model.state_dict()[k], v) for k, v in before.items())  # trunk kept
    # a separate critic from a shared run: that run's policy with its head
    critic = attach_value_head(build_tiny_qwen3(99, seed=3))
    what = local.load_critic(shared, critic=critic, model=new)
    assert what == "the policy and value head of step_4.pt (a shared critic)"
    assert all(torch.equal(critic.state_dict()[k], v) for k, v in old.state_dict().items())
    separate = local.save(tmp_path / "separate", step=5, model=new, critic=critic)
    with pytest.raises(ValueError, match=r"holds a separate critic, whose value head was trained"):
        local.load_critic(separate, critic=None, model=new)
    smaller = attach_value_head(build_tiny_qwen3(99, seed=3, hidden_size=32))
    with pytest.raises(ValueError, match=r"does not fit this run's critic .* another model"):
        local.load_critic(separate, critic=smaller, model=new)


def test_a_smaller_critic_model_needs_the_policys_tokenizer(tmp_path):
    cfg = typed(["critic=separate", f"critic.model_path={tmp_path / 'small'}"])
    policy = build_tiny_qwen3(99, seed=0)
    tokenizer_dir = save_tiny_model(tmp_path / "small", seed=4, hidden_size=32, num_heads=2)
    from ar_torchrl.models.tiny import build_char_tokenizer

    critic, _ = LocalStrategy().build_critic(
        policy, build_char_tokenizer(), None, cfg.critic.model_path
    )
    assert critic.model.config.hidden_size == 32 and critic.model.value_head.in_features == 32
    assert critic.model.value_head.weight.abs().sum() == 0
    other = build_char_tokenizer()
    other.add_tokens(["<extra>"])
    with pytest.raises(
        ValueError, match=r"critic.model_path=.*small: the critic's tokenizer differs"
    ):
        LocalStrategy().build_critic(policy, other, None, str(tokenizer_dir))
    with pytest.raises(FileNotFoundError, match=r"critic.model_path='/nowhere' is not a directory"):
        LocalStrategy().build_critic(policy, other, None, "/nowhere")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["critic=separate", "algo=grpo"],
            r"critic=separate trains a second model on the value loss",
        ),
        (
            ["critic.model_path=/x"],
            r"critic.model_path='/x' is the separate critic's model: it needs critic=separate",
        ),
        (["critic.kind=both"], r"critic.kind='both' is not one of \['shared', 'separate'\]"),
        (
            ["algo=grpo", "critic.init_from=/x"],
            r"critic.init_from='/x' loads a critic, but algo.critic_coeff=0.0",
        ),
        (
            ["algo.value_lr_schedule=step"],
            r"algo.value_lr_schedule='step' is not one of \['constant', 'linear', 'cosine'\]",
        ),
        (["algo.value_lr_min_ratio=2"], r"algo.value_lr_min_ratio must be >= 0 and <= 1, got 2.0"),
    ],
)
def test_critic_config_errors_name_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        typed(overrides)


@pytest.mark.slow
def test_confidence_features_train_checkpoint_resume_and_stay_out_of_the_policy(
    confidence_run, tmp_path, cache_dir
):
    """``critic.confidence_features=true`` on the multi-turn tool task (tool tokens between the
    trained ones) with the separate critic: its MLP trains, is checkpointed with the critic,
    resumes exactly, is exported with the critic and never with the policy."""
    from safetensors.torch import load_file

    from ar_torchrl.models.export import load_critic

    conf = [*SEPARATE, *CONFIDENCE]
    run_dir, history = confidence_run
    assert [h["step"] for h in history] == [0, 1, 2, 3]
    assert all(math.isfinite(h["train/loss_critic"]) for h in history[1:])
    state = _load(run_dir / "checkpoints" / "step_3.pt")
    mlp = [k for k in state["critic"] if k.startswith("value_head.confidence.")]
    assert mlp and state["critic"]["value_head.confidence.net.2.weight"].abs().sum() > 0  # trained
    assert not any("confidence" in k for k in state["model"])
    policy = load_file(str(run_dir / "policy" / "model.safetensors"))
    assert not any(k.startswith("value_head") for k in policy)
    critic = load_critic(run_dir / "critic").model.state_dict()
    for k in mlp:
        torch.testing.assert_close(critic[k], state["critic"][k])
    # the ceiling tool rebuilds the run's modules (the MLP included) to read its checkpoint
    from ar_torchrl.recipes.ceiling import policy_for_ceiling

    cfg = typed([*conf, f"cache_dir={cache_dir}"], TOOL_CONFIG)
    model, _ = policy_for_ceiling(cfg, run_dir / "checkpoints" / "step_3.pt")
    assert torch.equal(model.state_dict()["lm_head.weight"], state["model"]["lm_head.weight"])
    _, resumed = run_recipe(
        tmp_path / "resumed",
        cache_dir,
        *conf,
        f"train.resume_from={run_dir / 'checkpoints/step_2.pt'}",
        config_name=TOOL_CONFIG,
    )
    same_runs(history, resumed)
