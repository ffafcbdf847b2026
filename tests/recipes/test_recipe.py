"""examples/dapo_ppo.py end to end through a subprocess (the README's command with short overrides),
and its run-directory logic (resuming, history, stopping) in process.

The warm start is cached once per test session in a temporary cache directory, exactly as a user's
first run caches it under ``~/.cache/ar_torchrl``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shlex
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from support.recipe_helpers import load
from support.recipe_runs import COMMON, mean, read_history, recipe_env, run_recipe, same_runs

from ar_torchrl.checkpoint import LocalStore, local
from ar_torchrl.data.datasets import make_row
from ar_torchrl.models.tiny import save_tiny_model
from ar_torchrl.recipes import dapo_ppo
from ar_torchrl.recipes.dapo_ppo import build as recipe
from ar_torchrl.recipes.dapo_ppo import config as recipe_config
from ar_torchrl.recipes.launch import find_checkpoint, prepare_run_dir
from ar_torchrl.recipes.strategy import LocalStrategy

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "dapo_ppo.py"
torch.set_num_threads(1)

#: The CI version of the CPU default: same config, 100 iterations instead of 300 (see README).
SHORT = ["train.iterations=100", "train.eval_every=100", "train.checkpoint_every=0"]
#: Measured (seeds 0-4, 100 iterations, benchmarks/experiments/readme_figures.py): the mean reward of iterations
#: 81-100 minus that of 1-20 was +0.43, +0.32, +0.25, +0.27, +0.43; the test asserts half the smallest.
MIN_RISE = 0.12


def stop_after_first_step(run_dir: Path, cache: Path, signum: int, *overrides: str):
    """Start the recipe, send ``signum`` once step 1 is in metrics.jsonl, wait for it to exit."""
    cmd = [sys.executable, str(SCRIPT), f"hydra.run.dir={run_dir}", *overrides]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=recipe_env(cache),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 600
        while not any(h["step"] == 1 for h in read_history(run_dir)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][
                -3000:
            ]
            time.sleep(0.05)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out, err


@pytest.fixture(scope="session")
def straight(tmp_path_factory, cache_dir) -> list[dict]:
    """The uninterrupted sync run the resume tests compare against."""
    return run_recipe(tmp_path_factory.mktemp("straight"), cache_dir, *COMMON)[1]


# ----------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_cpu_default_short_run_learns(tmp_path, cache_dir):
    proc, history = run_recipe(tmp_path, cache_dir, *SHORT)
    assert [h["step"] for h in history] == list(range(0, 101))
    baseline, history = history[0], history[1:]  # step 0: greedy evaluation of the start policy
    assert set(baseline) == {"step", "eval/reward_mean", "eval/accuracy"}
    rewards = [h["rollout/reward_mean"] for h in history]
    first, last = mean(rewards[:20]), mean(rewards[-20:])
    assert last - first > MIN_RISE, f"reward did not rise: first {first:.3f} last {last:.3f}"
    assert f"rise={last - first:+.4f}" in proc.stdout
    final = history[-1]  # the end of a run says where it is, how it ended and how to go on
    assert f"run directory: {tmp_path}" in proc.stdout
    assert (
        f"final evaluation (step 100): eval/reward_mean={final['eval/reward_mean']:+.4f}"
        in proc.stdout
    )
    assert f"train.resume_from={tmp_path} train.iterations=200" in proc.stdout
    for h in history:  # every stage timed, every loss finite, nothing skipped
        assert {
            "time/generate",
            "time/old_log_probs",
            "time/advantage",
            "time/update",
            "time/sync",
        } <= set(h)
        assert math.isfinite(h["train/loss_objective"]) and math.isfinite(h["train/loss_critic"])
        assert h["train/skipped_steps"] == 0 and h["train/optimizer_steps"] == 2
        assert h["rollout/logprob_drift"] < 1e-4  # trainside rollouts == trainer log-probs
    assert -1.0 <= final["eval/reward_mean"] <= 1.0
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    scalars = tmp_path / "logs" / "dapo_ppo" / "scalars"
    assert len((scalars / "rollout" / "reward_mean.csv").read_text().splitlines()) == 100
    assert (tmp_path / "checkpoints" / "step_100.pt").exists()


@pytest.mark.slow
def test_grpo_end_to_end(tmp_path, cache_dir):
    _, history = run_recipe(
        tmp_path, cache_dir, "algo=grpo", "train.iterations=4", "train.eval_every=2"
    )
    assert [h["step"] for h in history] == [0, 1, 2, 3, 4]
    history = history[1:]
    for h in history:
        assert math.isfinite(h["train/loss_objective"]) and "train/loss_critic" not in h
        assert h["rollout/groups_generated"] == 16  # this batch's groups (the collector's count)
        assert 0 <= h["rollout/groups_zero_spread"] <= h["rollout/groups_generated"]
        assert "rollout/zero_spread_groups" not in h and "rollout/groups" not in h  # one name each
    assert "eval/reward_mean" in history[1] and "eval/reward_mean" in history[3]
    # the run's logs are private (issue 16: dapo_ppo.log was 0644)
    assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "dapo_ppo.log").stat().st_mode) == 0o600


@pytest.mark.slow
def test_a_reward_reading_a_non_dapo_field_and_the_token_count_from_the_config(tmp_path, cache_dir):
    """reward=arithmetic scores the value of extra_info.problem (not DAPO's ground truth) minus a
    per-token length penalty, chosen from the config for a CPU run."""
    _, history = run_recipe(
        tmp_path,
        cache_dir,
        "data=fewshot_arithmetic",
        "reward=arithmetic",
        "reward.length_penalty=0.01",
        "train.iterations=2",
        "train.eval_every=2",
        "train.plot=false",
    )
    assert [h["step"] for h in history] == [0, 1, 2]
    for h in history[1:]:
        reward, length = h["rollout/reward_mean"], h["rollout/response_length"]
        assert math.isfinite(h["train/loss_objective"])
        # every answer is +1 or -1, minus 0.01 per token: the mean is off the +-1 grid by the length
        assert -1.0 - 0.01 * 12 <= reward <= 1.0 - 0.01
        assert 0.0 <= h["rollout/accuracy"] <= 1.0 and length >= 1
    assert 0.0 <= history[-1]["eval/accuracy"] <= 1.0


@pytest.mark.slow
def test_async_end_to_end_with_critic_warmup_resumes_exactly(tmp_path, cache_dir):
    async_ = ["train.mode=async", "algo.critic_warmup_iters=2", *COMMON]
    _, history = run_recipe(tmp_path / "straight", cache_dir, *async_)
    assert [h["step"] for h in history] == [0, 1, 2, 3, 4]
    steps = history[1:]
    # batch k+1 is generated in the background while step k trains: it lags one version
    assert [h["rollout/policy_lag"] for h in steps] == [0.0, 1.0, 1.0, 1.0]
    assert all(math.isfinite(h["train/loss_objective"]) for h in steps)
    # decoupled PPO by default: min(pi_old / pi_behaviour, 2) on each token's policy loss
    # (weights 1 while the sampling policy equals the anchors' one: lag 0, then the critic-only
    # warm-up leaves the policy as it was; step 4's batch was sampled before step 3's update)
    assert [abs(h["train/tis_weight_mean"] - 1.0) < 1e-4 for h in steps] == [True] * 3 + [False]
    # critic-only warm-up: the policy stays the reference policy (KL exactly 0), then moves
    assert [h["train/kl_ref"] == 0.0 for h in steps] == [True, True, False, False]
    assert all(h["train/optimizer_steps"] == 2 for h in steps)
    # ... bit for bit (critic=shared; test_recipe_critic.py checks critic=separate)
    from support.recipe_runs import assert_policy_is_the_start, start_policy

    step_2 = torch.load(tmp_path / "straight" / "checkpoints" / "step_2.pt", weights_only=True)
    assert_policy_is_the_start(step_2, start_policy(cache_dir))
    # The step-2 checkpoint holds the batch that was being generated: resuming from it is exact
    # (main regenerated that batch with the newer weights: lag 0, other samples).
    checkpoint = tmp_path / "straight" / "checkpoints" / "step_2.pt"
    _, resumed = run_recipe(
        tmp_path / "resumed", cache_dir, *async_, f"train.resume_from={checkpoint}"
    )
    same_runs(history, resumed)


@pytest.mark.slow
def test_resume_continues_exactly(tmp_path, cache_dir, straight):
    """Re-running into the same run directory continues from its newest checkpoint."""
    run_recipe(tmp_path, cache_dir, *COMMON, "train.iterations=2")
    proc, resumed = run_recipe(tmp_path, cache_dir, *COMMON)
    output = proc.stdout + proc.stderr  # hydra logs to stdout
    assert "resumed from" in output and "(step 2)" in output
    same_runs(straight, resumed)
    csv = tmp_path / "logs" / "dapo_ppo" / "scalars" / "rollout" / "reward_mean.csv"
    assert [int(r.split(",")[0]) for r in csv.read_text().splitlines()] == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_checkpoint_of_the_previous_layout_resumes_exactly(tmp_path, cache_dir):
    """A .pt checkpoint written before the recipe moved into the library, on another machine
    (tests/support/fixtures/legacy_run): today's loader reads every tensor of it bit for bit, it has
    the layout today's recipe writes, and resuming it gives step for step what resuming the same
    state re-saved by today's store gives. Both runs are made here: a run recomputed from scratch
    equals the fixture's only where every float kernel matches the machine that wrote it (ATen's
    softmax differs between its AVX2 and AVX-512 kernels, so the warm start already differs)."""
    import shutil

    from support.recipe_helpers import typed
    from support.recipe_runs import start_policy

    from ar_torchrl.checkpoint import capture_rng_state, restore_rng_state
    from ar_torchrl.modules import LMActorCritic

    legacy = tmp_path / "legacy"
    shutil.copytree(ROOT / "tests" / "support" / "fixtures" / "legacy_run", legacy)
    common = ["train.eval_every=3", "train.plot=false", "logger=none", "train.iterations=8"]
    checkpoint = legacy / "checkpoints" / "step_6.pt"
    assert not (legacy / "checkpoints" / ".step_6.pt.manifest.json").exists()  # before manifests
    _, resumed = run_recipe(
        tmp_path / "resumed", cache_dir, *common, f"train.resume_from={checkpoint}"
    )
    assert [h["step"] for h in resumed] == list(range(9))  # steps 0-6: the legacy run's history
    # Today's loader, into the recipe's own policy and optimizer: the file's tensors, bit for bit.
    raw = torch.load(checkpoint, weights_only=True)
    actor_critic = LMActorCritic(start_policy(cache_dir))
    optimizer = recipe.build_optimizer(typed(common), actor_critic.model)
    outer_rng, store = capture_rng_state(), LocalStore()
    state = store.load(checkpoint, actor_critic=actor_critic, optimizer=optimizer)
    loaded = actor_critic.model.state_dict()
    assert loaded.keys() == raw["model"].keys()
    assert all(torch.equal(loaded[k], v) for k, v in raw["model"].items())
    # ... re-saved by today's store (the RNG states the load restored are captured again)
    resaved = store.save(
        tmp_path / "resaved" / "checkpoints",
        state["step"],
        actor_critic=actor_critic,
        optimizer=optimizer,
        extra=state["extra"],
    )
    restore_rng_state(outer_rng)
    assert store.verify(resaved) is None  # today's format: with its manifest
    assert_same_tree(torch.load(resaved, weights_only=True), raw, values=True)
    _, from_today = run_recipe(
        tmp_path / "today", cache_dir, *common, f"train.resume_from={resaved}"
    )
    assert [h["step"] for h in from_today] == [7, 8]
    same_runs(resumed[7:], from_today)  # the steps trained after resuming: exactly equal
    written = torch.load(tmp_path / "today" / "checkpoints" / "step_8.pt", weights_only=True)
    # the layout today's recipe writes: the legacy one plus the keys added since (read as their
    # defaults when absent)
    assert_same_tree(written, raw, values=False, added=ADDED_SINCE_LEGACY)


#: Checkpoint entries written since the legacy layout, each read as a default when absent.
ADDED_SINCE_LEGACY = {
    "checkpoint['extra']['collector']": {"interruptions"},
    # the value head's own gradient-clip group (build.critic_clip_groups re-applies it on resume)
    "checkpoint['optimizer']['param_groups'][1]": {"clip_group"},
}


def assert_same_tree(
    a, b, *, values: bool, where: str = "checkpoint", added: dict[str, set] | None = None
) -> None:
    """``a`` and ``b`` have the same keys, containers, tensor dtypes and shapes (``values``: and
    the same tensors, bit for bit, and the same plain values); ``added`` names, per place, the keys
    ``a`` may hold that ``b`` lacks."""
    added = added or {}
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        extra = added.get(where, set())
        assert a.keys() - extra == b.keys(), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        a = {k: v for k, v in a.items() if k not in extra}
        for k in a:
            assert_same_tree(a[k], b[k], values=values, where=f"{where}[{k!r}]", added=added)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: {len(a)} vs {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, values=values, where=f"{where}[{i}]", added=added)
    elif isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{where}: {a.dtype}{list(a.shape)}"
        assert not values or torch.equal(a, b), f"{where}: other values"
    else:
        assert not values or a == b, f"{where}: {a!r} vs {b!r}"


@pytest.mark.slow
def test_sigterm_stops_cleanly_and_auto_resume_continues_exactly(tmp_path, cache_dir, straight):
    first = tmp_path / "runs" / "first"
    runs = f"runs_dir={tmp_path / 'runs'}"
    rc, out, err = stop_after_first_step(first, cache_dir, signal.SIGTERM, *COMMON, runs)
    assert rc == 128 + signal.SIGTERM and "Traceback" not in err, err[-3000:]
    steps = [h["step"] for h in read_history(first)]
    stopped = steps[-1]
    assert steps == list(range(stopped + 1)) and 1 <= stopped < 4  # finished its iteration
    assert f"stopped by SIGTERM after iteration {stopped}" in out
    assert sorted(p.name for p in (first / "checkpoints").iterdir())[-1] == f"step_{stopped}.pt"
    _, resumed = run_recipe(
        tmp_path / "runs" / "second", cache_dir, *COMMON, runs, "train.resume_from=auto"
    )
    same_runs(straight, resumed)


@pytest.mark.slow
def test_ctrl_c_stops_with_the_resume_command_not_a_traceback(tmp_path, cache_dir):
    rc, out, err = stop_after_first_step(tmp_path, cache_dir, signal.SIGINT, *COMMON)
    assert rc == 128 + signal.SIGINT and "Traceback" not in err + out, err[-3000:]
    assert "SIGINT: stopping after this iteration" in out + err  # logged (Hydra: to stdout)
    resume = next(line for line in out.splitlines() if line.startswith("resume: "))
    assert shlex.split(resume)[-1] == f"train.resume_from={tmp_path}"
    assert (tmp_path / "checkpoints" / f"step_{read_history(tmp_path)[-1]['step']}.pt").exists()


def imported_modules(stderr: str) -> set[str]:
    return {
        ln.split("|")[-1].strip() for ln in stderr.splitlines() if ln.startswith("import time:")
    }


@pytest.mark.parametrize(
    ("args", "rc", "message"),
    [
        (["--help"], 0, "Override any key"),
        (["algo.grad_clip=-1"], 1, "dapo_ppo: config: algo.grad_clip must be > 0, got -1.0"),
        (
            ["algo.advantage_mode=ppo"],
            1,
            "algo.advantage_mode='ppo' is not one of ['gae', 'grpo', 'rloo', 'reinforce_pp']",
        ),
        (["+algo.lrr=1e-4"], 1, "no schema has the key(s) algo.lrr (did you mean 'algo.lr'?)"),
        (["backend=sglang", "backend.url=notaurl"], 1, "backend.url='notaurl' is not a server URL"),
        (
            ["algo.lr_typo=1"],
            1,
            "dapo_ppo: config: no key 'algo.lr_typo' (did you mean 'algo.lr'?)",
        ),
        (["train.iterations=true"], 1, "full_key: train.iterations"),
    ],
)
def test_help_and_bad_config_answer_before_the_training_stack_is_imported(
    tmp_path, args, rc, message
):
    """main imported torch, transformers and TorchRL (10-38 s on a loaded machine) before anything."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-X", "importtime", str(SCRIPT), f"hydra.run.dir={run_dir}", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == rc and message in proc.stdout + proc.stderr, proc.stderr[-2000:]
    assert not {"torch", "transformers", "torchrl"} & imported_modules(proc.stderr)
    assert not run_dir.exists()  # a rejected configuration leaves no (empty) run directory behind


# ----------------------------------------------------------------------------- run directories
def fake_run(run_dir: Path, steps: int, checkpoint_steps=(), raw=None) -> None:
    """A run directory as the recipe leaves it (tiny checkpoints: damaged ones would be skipped)."""
    (run_dir / "checkpoints").mkdir(parents=True)
    scalars = run_dir / "logs" / "dapo_ppo" / "scalars" / "rollout"
    scalars.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s}) + "\n" for s in range(steps + 1))
    )
    (scalars / "reward_mean.csv").write_text("".join(f"{s},0.5\n" for s in range(1, steps + 1)))
    for s in checkpoint_steps:
        local.save(run_dir / "checkpoints", step=s, model=torch.nn.Linear(1, 1))
    if raw is not None:
        (run_dir / ".hydra").mkdir()
        (run_dir / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(raw))


def test_rerun_before_the_first_checkpoint_starts_a_clean_history(tmp_path):
    """main appended to the killed run's history: steps 1 2 1 2 3 ..."""
    fake_run(tmp_path, 2)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "rollout/rew')  # killed while writing
    (tmp_path / "checkpoints" / ".step_3.pt-x8k2.tmp").write_bytes(b"half")
    prepare_run_dir(tmp_path, None)
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    assert (
        tmp_path / "logs" / "dapo_ppo" / "scalars" / "rollout" / "reward_mean.csv"
    ).read_text() == ""
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_resume_from_another_run_copies_its_history_up_to_the_checkpoint(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    fake_run(old, 5, checkpoint_steps=(2, 4))
    new.mkdir()
    prepare_run_dir(new, old / "checkpoints" / "step_2.pt")
    assert [h["step"] for h in read_history(new)] == [0, 1, 2]
    assert (
        new / "logs" / "dapo_ppo" / "scalars" / "rollout" / "reward_mean.csv"
    ).read_text() == "1,0.5\n2,0.5\n"
    assert [h["step"] for h in read_history(old)] == [0, 1, 2, 3, 4, 5]  # the old run is untouched


def test_find_checkpoint(tmp_path):
    runs, here = tmp_path / "runs", tmp_path / "runs" / "now"
    raw = load([f"runs_dir={runs}", "train.resume_from=auto"])
    cfg = recipe_config.validate_config(raw)
    with pytest.raises(
        FileNotFoundError, match="train.resume_from=auto: no run directory under runs_dir="
    ):
        dapo_ppo.checkpoint_to_resume(cfg, raw, here, LocalStore())
    fake_run(runs / "a", 4, (2, 4), raw=load([f"runs_dir={runs}", "train.iterations=4"]))
    time.sleep(0.01)  # b's checkpoint is newer, but b is another configuration (seed)
    fake_run(runs / "b", 6, (6,), raw=load([f"runs_dir={runs}", "seed=1"]))
    assert (
        dapo_ppo.checkpoint_to_resume(cfg, raw, here, LocalStore())
        == runs / "a" / "checkpoints" / "step_4.pt"
    )
    explicit = load([f"train.resume_from={runs / 'b'}"])
    assert (
        dapo_ppo.checkpoint_to_resume(
            recipe_config.validate_config(explicit), explicit, here, LocalStore()
        ).name
        == "step_6.pt"
    )
    done = load([f"train.resume_from={runs / 'b'}", "train.iterations=6"])
    with pytest.raises(ValueError, match="is at step 6, train.iterations=6: nothing left to do"):
        dapo_ppo.checkpoint_to_resume(recipe_config.validate_config(done), done, here, LocalStore())
    missing = load([f"train.resume_from={tmp_path / 'nope'}"])
    with pytest.raises(
        FileNotFoundError,
        match=r"neither a checkpoint nor a run directory with checkpoints/step_<N>\.pt ",
    ):
        dapo_ppo.checkpoint_to_resume(
            recipe_config.validate_config(missing), missing, here, LocalStore()
        )
    plain = load()  # no resume_from: the run directory's own checkpoints (hydra.run.dir=<it>)
    assert (
        dapo_ppo.checkpoint_to_resume(
            recipe_config.validate_config(plain), plain, runs / "a", LocalStore()
        ).name
        == "step_4.pt"
    )
    assert (
        dapo_ppo.checkpoint_to_resume(
            recipe_config.validate_config(plain), plain, here, LocalStore()
        )
        is None
    )


def test_find_checkpoint_of_before_the_store_still_works_with_a_warning(tmp_path):
    """``dapo_ppo.find_checkpoint(cfg, raw, run_dir, strategy)`` and ``run.find_checkpoint`` with
    the strategy's callables (``latest=``, ``check=``, ``kind=``) are kept for one release."""
    fake_run(tmp_path / "a", 4, (2, 4))
    raw = load([f"train.resume_from={tmp_path / 'a'}"])
    with pytest.warns(DeprecationWarning, match=r"dapo_ppo.checkpoint_to_resume\(cfg, raw, run_"):
        found = dapo_ppo.find_checkpoint(
            recipe_config.validate_config(raw), raw, tmp_path, LocalStrategy()
        )
    assert found == tmp_path / "a" / "checkpoints" / "step_4.pt"
    store = LocalStore()
    with pytest.warns(DeprecationWarning, match=r"is now find_checkpoint\(store=\)"):
        found = find_checkpoint(
            str(tmp_path / "a"),
            run_dir=tmp_path,
            runs_dir=tmp_path,
            iterations=8,
            latest=store.latest,
            check=store.check,
            kind=store.pattern,
            matches=lambda saved: True,
            resumable=(),
        )
    assert found == tmp_path / "a" / "checkpoints" / "step_4.pt"


def test_failed_sglang_launch_leaves_no_model_copy(tmp_path):
    """main saved the policy into <run_dir>/sglang_model and left it there when the launch failed."""
    from ar_torchrl.models import build_tiny_model
    from ar_torchrl.modules import attach_value_head

    cfg = recipe_config.validate_config(
        load(["backend=sglang", "backend.python=/nonexistent/python"])
    )
    model, tok = build_tiny_model()
    model = attach_value_head(model)
    with pytest.raises(FileNotFoundError, match="SGLang server python /nonexistent/python"):
        with contextlib.ExitStack() as stack:
            recipe.build_backend(cfg, model, tok, tmp_path, stack)
    assert not (tmp_path / "sglang_model").exists()


# ----------------------------------------------------------------------------- bad input
def test_missing_dataset_file():
    cfg = recipe_config.validate_config(
        load(["data=dapo_math", "data.path=/nonexistent/dapo.parquet"])
    )
    with pytest.raises(FileNotFoundError, match="no file at /nonexistent/dapo.parquet"):
        recipe.build_datasets(cfg)


def test_malformed_dataset_rows_fail_or_are_skipped_and_counted(tmp_path):
    rows = [make_row(f"What is {i} + 1?", str(i + 1), index=i) for i in range(20)]
    rows[3] = {"prompt": [{"role": "user", "content": "1+1?"}]}  # no reward_model
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = ["data=dapo_math", f"data.path={path}", "data.holdout=4", "train.eval_prompts=4"]
    with pytest.raises(
        ValueError, match=r"bad.jsonl: line 4: field 'reward_model.ground_truth' is missing"
    ):
        recipe.build_datasets(recipe_config.validate_config(load(data)))
    train, held_out = recipe.build_datasets(
        recipe_config.validate_config(load([*data, "data.skip_invalid=true"]))
    )
    assert len(train) + len(held_out) == 19  # the bad row is skipped and counted, nothing else lost


def test_an_over_long_prompt_is_named_by_its_line_at_load_or_skipped_and_counted(tmp_path, caplog):
    """Issue 16: a row longer than the context passed loading (also with skip_invalid) and ended
    the run whenever the sampler drew it, naming its index in the generate call."""
    from ar_torchrl.models import build_char_tokenizer

    rows = [make_row(f"What is {i} + 1?", str(i + 1), index=i) for i in range(20)]
    rows[6] = make_row("What is " + "1 + " * 200 + "1?", "201", index=6)  # ~900 characters
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = ["data=dapo_math", f"data.path={path}", "data.holdout=4", "train.eval_prompts=4"]
    tok = build_char_tokenizer()
    cfg = recipe_config.validate_config(load(data))
    with pytest.raises(ValueError, match=r"long.jsonl line 7 has \d+ tokens, more than the 500 "):
        recipe.fit_prompts(cfg, recipe.build_datasets(cfg), tok, context=512)
    cfg = recipe_config.validate_config(load([*data, "data.skip_invalid=true"]))
    train, held_out = recipe.fit_prompts(cfg, recipe.build_datasets(cfg), tok, context=512)
    assert len(train) + len(held_out) == 19  # the long row skipped, nothing else lost
    assert "skipped 1 prompt(s) longer than the 500 tokens" in caplog.text


def test_characters_the_tokenizer_drops_are_named(caplog):
    """Issue 16: "Compute √2 × π" became "Compute 2  " with no warning."""
    from ar_torchrl.data import MathDataset, check_prompts
    from ar_torchrl.models import build_char_tokenizer

    ds = MathDataset(
        [make_row("Compute √2 × π", "4.44", index=0), make_row("1 + 1?", "2", index=1)]
    )
    found = check_prompts(ds, build_char_tokenizer(), max_prompt_tokens=500)
    assert found.kept == [0, 1] and set(found.lost_characters[0]) == set("×√π")
    assert set(found.lost_characters) == {0}
    assert "drops characters of 1 prompt(s)" in caplog.text and "dataset row 0" in caplog.text


@pytest.mark.parametrize("value", [None, [1], 1j, "1", True])
def test_a_reward_of_the_wrong_type_names_the_function_and_the_row(value):
    """Issue 16: None / [1] / 1j gave a bare TypeError, "1" and True silently became 1.0."""
    from ar_torchrl.backends import SamplingParams, TransformersBackend
    from ar_torchrl.data import arithmetic_dataset
    from ar_torchrl.envs import LLMEnv
    from ar_torchrl.models import build_char_tokenizer, build_tiny_qwen3
    from ar_torchrl.rewards.scoring import RewardError

    def my_reward(text, truth):
        return value

    tok = build_char_tokenizer()
    env = LLMEnv(
        arithmetic_dataset(4),
        tok,
        TransformersBackend(build_tiny_qwen3(len(tok))),
        reward_fn=my_reward,
        num_samples=1,
        prompts_per_batch=1,
        sampling=SamplingParams(max_new_tokens=2),
    )
    with pytest.raises(
        RewardError,
        match=rf"reward .*my_reward returned {re.escape(repr(value))} .*for batch row 0 \(prompt",
    ):
        env.collect()


def test_tokenizer_without_chat_template(tmp_path):
    model_dir = save_tiny_model(tmp_path / "m")
    (model_dir / "chat_template.jinja").unlink()
    cfg = recipe_config.validate_config(
        load(
            [
                "model=qwen3_4b_base",
                f"model.path={model_dir}",
                "model.dtype=float32",
                "model.attn_implementation=null",
            ]
        )
    )
    with pytest.raises(
        ValueError, match=f"tokenizer of model.path={model_dir} has no chat template"
    ):
        LocalStrategy().build_policy(cfg.model, cfg.cache_dir)


@pytest.mark.slow
def test_compose_torchrl_script_runs(cache_dir):
    env = {**os.environ, "AR_TORCHRL_CACHE": str(cache_dir), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "examples" / "compose_torchrl.py"), "--iterations", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "Initialized LazyTensorStorage" not in proc.stdout + proc.stderr
    )  # was once per iteration
    lines = [line for line in proc.stdout.splitlines() if line.startswith("iter")]
    assert len(lines) == 2
    for line in lines:  # "iter   0  reward -0.688  loss +0.4495  ratio 0.9952"
        fields = line.split()
        assert -1.0 <= float(fields[3]) <= 1.0 and math.isfinite(float(fields[5]))
        assert 0.5 < float(fields[7]) < 2.0


@pytest.mark.slow
def test_readme_one_key_grpo_swap_runs(tmp_path, cache_dir):
    """The README's one-key swap (`algo.advantage_mode=grpo` on the PPO config), exactly as written."""
    import re

    readme = (ROOT / "README.md").read_text()
    lines = [
        ln for ln in re.findall(r"```bash\n(.*?)```", readme, flags=re.S)[1].splitlines() if ln
    ]
    assert lines == [".venv/bin/python examples/dapo_ppo.py algo.advantage_mode=grpo"]
    args = shlex.split(lines[0])[2:]
    _, history = run_recipe(tmp_path, cache_dir, *args, "train.iterations=3", "train.eval_every=3")
    assert [h["step"] for h in history] == [0, 1, 2, 3]
    for h in history[1:]:  # GRPO advantages; the value head keeps training on Monte-Carlo returns
        assert math.isfinite(h["train/loss_objective"]) and math.isfinite(h["train/loss_critic"])
        assert h["train/skipped_steps"] == 0 and "rollout/groups_zero_spread" in h


@pytest.mark.slow
@pytest.mark.sglang
def test_sglang_backend_end_to_end(tmp_path, cache_dir):
    """The recipe launches a real local SGLang server on the warm-started policy and syncs to it."""
    _, history = run_recipe(
        tmp_path, cache_dir, "backend=sglang", "train.iterations=2", "train.eval_every=2"
    )
    assert [h["step"] for h in history] == [0, 1, 2]
    for h in history[1:]:
        # the server samples from the trainer's weights (synced after step 1): its log-probs agree
        # with the trainer's anchors (train/rollout_log_prob_abs_diff also includes the policy's
        # own movement over the PPO epochs, so it only has to be finite)
        assert h["rollout/logprob_drift"] < 1e-4
        assert math.isfinite(h["train/rollout_log_prob_abs_diff"])
        assert math.isfinite(h["train/loss_objective"]) and h["time/sync"] > 0
    assert -1.0 <= history[-1]["eval/reward_mean"] <= 1.0
    assert stat.S_IMODE((tmp_path / "sglang_server.log").stat().st_mode) == 0o600
    assert not (
        tmp_path / "sglang_model"
    ).exists()  # the server's start weights are not left behind
