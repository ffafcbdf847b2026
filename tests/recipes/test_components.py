"""Components from outside the library, chosen from a config: the ``imports:`` list, a group option's
``_component_`` path, and the typo'd-key answer that comes before Hydra's (``launch_argv``).

The outside module is tests/support/external_components.py (a task ``sums``, an estimator
``batch_baseline``), one file as a user would write it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from support.recipe_helpers import CONFIGS, load
from support.recipe_runs import read_history, recipe_env

from ar_torchrl.recipes import dapo_ppo
from ar_torchrl.recipes.config import component_imports
from ar_torchrl.recipes.dapo_ppo import build
from ar_torchrl.registry import registries

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "dapo_ppo.py"
SUPPORT = ROOT / "tests" / "support"
OUTSIDE = ["imports=[external_components]", "algo=grpo", "algo.advantage_mode=batch_baseline"]


@pytest.fixture
def outside(monkeypatch):
    """``external_components`` importable (as a user's module on the PYTHONPATH); the registries
    hold only the built-ins again afterwards."""
    monkeypatch.syspath_prepend(str(SUPPORT))
    before = {r: dict(zip(r.names(), r.entries())) for r in registries()}  # built-ins loaded
    yield
    for registry, entries in before.items():
        registry._entries.clear()
        registry._entries.update(entries)
    sys.modules.pop("external_components", None)


def sums_yaml(config_dir: Path) -> Path:
    """A ``data`` option that names its schema by dotted path (torchtune's ``_component_``)."""
    (config_dir / "data").mkdir(parents=True)
    (config_dir / "data" / "sums.yaml").write_text(
        "_component_: external_components.SumsTaskConfig  # registered by its module\n"
        "num_rows: 64\n"
        "holdout: 8\n"
    )
    return config_dir


def test_imports_make_an_outside_estimator_selectable_with_its_options(outside):
    argv = ["dapo_ppo.py", *OUTSIDE, "algo.batch_baseline.scale=2"]
    assert component_imports([CONFIGS], "dapo_ppo", argv[1:]) == ["external_components"]
    assert dapo_ppo.launch_argv(CONFIGS, argv) == argv  # imported: its keys are known
    with pytest.raises(
        ValueError, match=r"'algo.batch_baseline.scalee' \(did you mean 'algo.batch_b"
    ):
        dapo_ppo.launch_argv(CONFIGS, [*argv, "algo.batch_baseline.scalee=2"])
    cfg = dapo_ppo.validate_config(load(argv[1:]))
    assert (cfg.algo.advantage_mode, cfg.algo.batch_baseline.scale) == ("batch_baseline", 2.0)
    assert type(build.build_advantage(cfg)).__name__ == "BatchBaseline"
    with pytest.raises(ValueError, match=r"config: algo.batch_baseline.scale must be > 0, got -1"):
        dapo_ppo.validate_config(load([*argv[1:], "algo.batch_baseline.scale=-1"]))


def test_a_group_option_named_by_component_path(outside):
    raw = load(OUTSIDE)
    raw.data = OmegaConf.create(
        {"_component_": "external_components.SumsTaskConfig", "num_rows": 100, "holdout": 64}
    )
    cfg = dapo_ppo.validate_config(raw)
    assert type(cfg.data).__name__ == "SumsTaskConfig" and cfg.data.num_rows == 100
    train, held_out = cfg.data.build()
    assert (len(train), len(held_out)) == (36, 64)
    raw.data = OmegaConf.create({"_component_": "external_components.BatchBaselineConfig"})
    with pytest.raises(
        ValueError, match=r"config: data._component_: .*BatchBaselineConfig is not a"
    ):
        dapo_ppo.validate_config(raw)


def test_an_import_that_fails_is_named_before_hydra():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "imports=[my_pkg.nope]"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "dapo_ppo: config: imports: cannot import 'my_pkg.nope'" in proc.stderr, proc.stderr


def test_a_typod_key_gets_the_library_answer_first():
    """Hydra's own answer to ``algo.lrr=1e-4`` is to append the key with ``+``."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "algo.lrr=1e-4"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    first = proc.stderr.strip().splitlines()[0]
    assert (
        first
        == "dapo_ppo: config: no key 'algo.lrr' (did you mean 'algo.lr'?); `--help` lists every key"
    )
    assert "+algo.lrr" not in proc.stderr


@pytest.mark.slow
def test_an_outside_task_and_estimator_run_in_the_recipe(tmp_path, cache_dir):
    """The task by ``_component_`` in the user's own config directory, the estimator by
    ``imports:``; two iterations of the recipe."""
    configs = sums_yaml(tmp_path / "configs")
    run_dir = tmp_path / "run"
    env = recipe_env(cache_dir)
    env["PYTHONPATH"] = f"{SUPPORT}:{env.get('PYTHONPATH', '')}"
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--config-dir",
        str(configs),
        f"hydra.run.dir={run_dir}",
        "data=sums",
        *OUTSIDE,
        "algo.batch_baseline.scale=0.5",
        "rollout.prompts_per_iter=4",
        "rollout.samples_per_prompt=2",
        "train.iterations=2",
        "train.eval_every=2",
        "train.eval_prompts=8",
        "train.checkpoint_every=0",
        "train.plot=false",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    history = read_history(run_dir)
    assert [h["step"] for h in history if h["step"] > 0] == [1, 2]
    assert all(-1.0 <= h["rollout/reward_mean"] <= 1.0 for h in history if h["step"] > 0)
    assert "eval/accuracy" in history[-1]
    saved = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    assert saved.data._component_ == "external_components.SumsTaskConfig"
    assert (saved.algo.advantage_mode, saved.algo.batch_baseline.scale) == ("batch_baseline", 0.5)
