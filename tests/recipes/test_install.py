"""``pip install <wheel>`` in a fresh virtual environment gives a runnable recipe that ends in an HF
checkpoint: the wheel carries the configs and the console script, the CPU default runs from an
unrelated directory with ``ar-torchrl-dapo``, and ``python -m ar_torchrl.recipes.dapo_ppo`` answers
``--help`` and a typo'd key the same way.

It builds the wheel from a copy of the sources (a stale ``build/`` of the checkout never leaks in),
installs torch from the local CPU wheel first (``torch==2.13.0``: pip never pulls a CUDA build) and
the wheel's dependencies from the package registries (pip's cache is reused). About 3-4 minutes on
a 2-core machine, most of it installing torch and transformers into the new environment.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import venv
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest
from support.hf_export import weight_names
from transformers import AutoModelForCausalLM

from ar_torchrl.recipes.config import CONFIG_DIR

ROOT = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"


def _env(**extra: str) -> dict:
    """The environment of the installed tools: no PYTHONPATH (the checkout must not be imported)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return {**env, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "OMP_NUM_THREADS": "1", **extra}


def _run(cmd, cwd: Path, timeout: float, **env: str) -> subprocess.CompletedProcess:
    cmd = [str(c) for c in cmd]
    return subprocess.run(
        cmd, cwd=cwd, env=_env(**env), capture_output=True, text=True, timeout=timeout
    )


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"{proc.args}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def build_wheel(tmp: Path) -> Path:
    """The wheel of the checkout's sources (copied first), without its dependencies."""
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "ar_torchrl", src / "ar_torchrl", ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    isolation = [] if int(version("setuptools").split(".")[0]) < 77 else ["--no-build-isolation"]
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-w", tmp / "dist", src]
    _ok(_run(cmd, tmp, 600))
    (wheel,) = (tmp / "dist").glob("ar_torchrl-*.whl")
    return wheel


def check_wheel_contents(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        scripts = z.read(entry_points).decode()
    shipped = {
        f"ar_torchrl/configs/{p.relative_to(CONFIG_DIR)}" for p in CONFIG_DIR.rglob("*.yaml")
    }
    assert len(shipped) >= 20 and shipped <= names, sorted(shipped - names)
    assert "ar_torchrl/recipes/dapo_ppo/__main__.py" in names
    assert not any(n.startswith(("configs/", "tests/", "examples/")) for n in names)
    assert "ar-torchrl-dapo = ar_torchrl.recipes.dapo_ppo.main:cli" in scripts


@pytest.mark.slow
def test_the_wheel_in_a_fresh_venv_runs_the_cpu_default_and_exports_the_policy(tmp_path, cache_dir):
    started = time.perf_counter()
    wheel = build_wheel(tmp_path)
    check_wheel_contents(wheel)
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py, bin_dir = env_dir / "bin" / "python", env_dir / "bin"
    pip = [py, "-m", "pip", "install", "-q", "--no-compile"]  # no .pyc of all torch: ~50 s less
    _ok(_run([*pip, TORCH], tmp_path, 900))  # the local CPU wheel first
    _ok(_run([*pip, wheel], tmp_path, 900))
    _ok(_run([py, "-m", "pip", "check"], tmp_path, 120))
    setup_s = time.perf_counter() - started

    work = tmp_path / "elsewhere"  # any directory: the configs come from the package
    work.mkdir()
    where = _ok(_run([py, "-c", "import ar_torchrl; print(ar_torchrl.__file__)"], work, 120))
    assert Path(where.stdout.strip()).is_relative_to(env_dir), where.stdout

    help_ = _ok(_run([py, "-m", "ar_torchrl.recipes.dapo_ppo", "--help"], work, 120)).stdout
    assert "Config groups (pick one with group=option):" in help_
    assert "export: true" in help_  # train.export, with its comment
    assert help_.rstrip().endswith(
        "Run: python -m ar_torchrl.recipes.dapo_ppo [group=option ...] [key=value ...]"
    )
    named = [bin_dir / "ar-torchrl-dapo", "--config-name", "critic_arithmetic", "--help"]
    assert "Keys of critic_arithmetic.yaml" in _ok(_run(named, work, 120)).stdout
    typo = _run([py, "-m", "ar_torchrl.recipes.dapo_ppo", "algo.lrr=1"], work, 120)
    assert typo.returncode == 1
    assert "dapo_ppo: config: no key 'algo.lrr' (did you mean 'algo.lr'?)" in typo.stderr

    args = ["train.iterations=2", "train.eval_every=0", "logger=none", "rollout.prompts_per_iter=8"]
    run_started = time.perf_counter()
    proc = _ok(
        _run(
            [bin_dir / "ar-torchrl-dapo", *args],
            work,
            900,
            AR_TORCHRL_CACHE=str(cache_dir),
            TQDM_DISABLE="1",
            HYDRA_FULL_ERROR="1",
        )
    )
    run_s = time.perf_counter() - run_started
    (run_dir,) = (work / "outputs").glob("*/*")  # Hydra's run directory, under the cwd
    assert f"run directory: {run_dir}" in proc.stdout
    assert f"exported policy: {run_dir / 'policy'}" in proc.stdout
    assert f" {bin_dir / 'ar-torchrl-dapo'} train.eval_every=0 " in proc.stdout  # train further
    # matplotlib is the [plot] extra: the run says so at the start and ends without curves.png
    assert "matplotlib is not installed: no curves.png" in (run_dir / "dapo_ppo.log").read_text()
    assert not (run_dir / "curves.png").exists()
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2  # steps 1, 2
    policy = run_dir / "policy"
    assert not any(n.startswith("value_head") for n in weight_names(policy))
    model = AutoModelForCausalLM.from_pretrained(policy)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    print(f"wheel + venv + installs {setup_s:.0f} s, 2-iteration run {run_s:.0f} s")
