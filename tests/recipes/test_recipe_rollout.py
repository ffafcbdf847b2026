"""The recipe's rollout side end to end: DAPO dynamic sampling (refill, unbiased metrics, a skipped
update when no group has a spread) and an unreachable ``backend.url`` said once."""

from __future__ import annotations

import math

import pytest
from support.recipe_runs import run_recipe

from ar_torchrl.backends.sglang import free_port

QUIET = ["train.eval_every=0", "train.plot=false", "train.checkpoint_every=0"]


@pytest.mark.slow
def test_grpo_dynamic_sampling_refills_and_logs_unbiased_metrics(tmp_path, cache_dir):
    _, history = run_recipe(
        tmp_path,
        cache_dir,
        "algo=grpo",
        "rollout.dynamic_sampling=true",
        "train.iterations=3",
        *QUIET,
    )
    assert [h["step"] for h in history] == [1, 2, 3]
    for h in history:
        # warm-started tiny model: ~1/3 of the groups are all wrong (zero spread), refilled
        assert h["rollout/groups_generated"] == 16 * h["rollout/sampling_rounds"]
        assert h["rollout/groups_kept"] == 16 and h["train/update_skipped"] == 0.0
        assert h["rollout/groups_dropped"] == h["rollout/groups_generated"] - 16
        assert -1.0 <= h["rollout/reward_mean"] <= 1.0 and 0.0 <= h["rollout/accuracy"] <= 1.0
        assert math.isfinite(h["train/loss_objective"])
    assert any(h["rollout/sampling_rounds"] > 1 for h in history)


@pytest.mark.slow
def test_dynamic_sampling_with_every_answer_wrong_skips_the_update(tmp_path, cache_dir):
    # one new token can never hold "Answer: X": every reward is -1, no group has a spread. One key
    # switches dynamic sampling on (the old algo.grpo.drop_zero_spread is gone: tests/recipes/test_configs.py)
    proc, history = run_recipe(
        tmp_path,
        cache_dir,
        "algo=grpo",
        "rollout.dynamic_sampling=true",
        "rollout.max_new_tokens=1",
        "rollout.max_sampling_rounds=2",
        "train.iterations=2",
        *QUIET,
    )
    assert [h["step"] for h in history] == [1, 2]
    for h in history:
        assert h["train/update_skipped"] == 1.0 and "train/loss_objective" not in h
        assert h["rollout/groups_kept"] == 0 and h["rollout/groups_generated"] == 32
        assert h["rollout/sampling_rounds"] == 2 and h["rollout/groups_zero_spread"] == 32
        assert (
            h["rollout/reward_mean"] == -1.0 and h["rollout/accuracy"] == 0.0
        )  # over every sample
    assert "update skipped" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_an_unreachable_backend_url_is_said_once(tmp_path, cache_dir):
    url = f"http://127.0.0.1:{free_port()}"
    proc, history = run_recipe(
        tmp_path,
        cache_dir,
        "backend=sglang",
        f"backend.url={url}",
        "train.iterations=1",
        *QUIET,
        check=False,
    )
    assert proc.returncode != 0 and not history
    message = f"backend.url=['{url}']: no SGLang server answers GET /health there"
    assert proc.stderr.count(message) == 1, proc.stderr[-3000:]
    assert "WeightSyncError" not in proc.stderr and "weight sync" not in proc.stderr


def test_rollout_shared_prefix_is_the_plan_of_the_old_log_prob_pass_and_the_update():
    """``rollout.shared_prefix`` reaches the one plan both passes use; ``auto`` plans without sharing
    (and ``true`` is an error naming the key) when a model cannot share a prefix."""
    from types import SimpleNamespace

    from support.recipe_helpers import typed
    from support.trajectories import shared_prompt_batch, tiny_actor_critic

    from ar_torchrl.distributed.fsdp import checkpoint_decoder_layers
    from ar_torchrl.recipes.dapo_ppo import loop
    from ar_torchrl.recipes.strategy import LocalStrategy

    td = shared_prompt_batch(groups=4, n=4)
    for value, packing, shared in (
        ("true", "auto", True),
        ("auto", "auto", True),
        ("true", "false", True),
        ("false", "auto", False),
    ):
        cfg = typed(
            [
                f"rollout.shared_prefix={value}",
                "rollout.token_budget=64",
                f"rollout.packing={packing}",
            ]
        )
        ac = tiny_actor_critic()
        mode = loop.shared_prefix_mode(cfg, ac, None, None)
        run = SimpleNamespace(
            cfg=cfg,
            shared_prefix=mode,
            strategy=LocalStrategy(),
            actor_critic=ac,
            ref_actor=None,
            critic=None,
        )
        plan = loop.old_log_probs_and_values(run, td.clone())
        assert len(plan) > 1, value
        assert all(bool(mb.shared) == shared for mb in plan.micro_batches), value
        if shared:  # packing=auto: the tree layout (packed), packing=false: padded
            assert all(mb.packed == (packing == "auto") for mb in plan.micro_batches), value
    # activation checkpointing: packed shared micro-batches only (the tree: one call, no cache)
    checkpointed = tiny_actor_critic()
    checkpoint_decoder_layers(checkpointed.model)
    auto, true = typed(["rollout.shared_prefix=auto"]), typed(["rollout.shared_prefix=true"])
    assert loop.shared_prefix_mode(auto, tiny_actor_critic(), None, checkpointed) == (
        "auto",
        False,
        True,
    )
    assert loop.shared_prefix_mode(true, tiny_actor_critic(), None, checkpointed) == (
        True,
        False,
        True,
    )
    padded_only = ["rollout.packing=false"]
    auto, true = (
        typed(["rollout.shared_prefix=auto", *padded_only]),
        typed(["rollout.shared_prefix=true", *padded_only]),
    )
    assert loop.shared_prefix_mode(auto, tiny_actor_critic(), None, checkpointed) == (
        False,
        True,
        True,
    )
    with pytest.raises(
        ValueError,
        match=r"config: rollout.shared_prefix=true, but no shared-prefix forward can run \(padded "
        r"ones: it runs activation checkpointing; packed ones: rollout.packing=false\); set "
        r"rollout.shared_prefix=false or auto",
    ):
        loop.shared_prefix_mode(true, tiny_actor_critic(), None, checkpointed)
    # a kernel without dense masks: padded shared micro-batches only, planned so with
    # packing=auto (the tree would reach a model that cannot run it)
    flash = tiny_actor_critic()
    flash.model.config._attn_implementation = "flash_attention_2"  # read, never run
    auto = typed(["rollout.shared_prefix=auto", "rollout.token_budget=64"])
    mode = loop.shared_prefix_mode(auto, flash)
    assert mode == ("auto", True, False)
    shared_prefix, shared_padded, shared_packed = mode
    plan = loop.plan_micro_batches(
        td,
        64,
        packing="auto",
        shared_prefix=shared_prefix,
        shared_padded=shared_padded,
        shared_packed=shared_packed,
    )
    assert all(mb.shared and not mb.packed for mb in plan.micro_batches)
    # a model that can run neither (a kernel without dense masks, and checkpointing)
    checkpoint_decoder_layers(flash.model)
    assert loop.shared_prefix_mode(typed(["rollout.shared_prefix=auto"]), flash) == (
        False,
        True,
        True,
    )


@pytest.mark.slow
def test_a_run_with_shared_prefixes_trains_as_the_padded_run(tmp_path, cache_dir):
    """Two iterations with ``rollout.shared_prefix=true`` (16 prompts x 4 samples): the first
    iteration's rollouts are the padded run's, its update the same to float rounding."""
    args = ["train.iterations=2", *QUIET]
    _, shared = run_recipe(tmp_path / "shared", cache_dir, "rollout.shared_prefix=true", *args)
    _, padded = run_recipe(tmp_path / "padded", cache_dir, "rollout.shared_prefix=false", *args)
    assert [h["step"] for h in shared] == [h["step"] for h in padded] == [1, 2]
    for h in shared:
        assert h["train/skipped_steps"] == 0.0 and math.isfinite(h["train/loss_objective"])
    first, want = shared[0], padded[0]
    assert all(h["plan/shared"] == h["plan/packed"] > 0 for h in shared)  # the tree layout
    assert all(h["plan/shared"] == 0 for h in padded)
    assert first["plan/computed_tokens"] < want["plan/computed_tokens"]
    drift = "rollout/logprob_drift"  # the trainer's old log-probs against the engine's
    sampled = {k for k in want if k.startswith("rollout/")} - {drift}
    assert {k: first[k] for k in sampled} == {k: want[k] for k in sampled}
    assert first[drift] == pytest.approx(want[drift], abs=1e-8)
    for key in ("train/loss_objective", "train/loss_critic", "train/mean_ratio", "train/grad_norm"):
        assert first[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
