"""Smoke test: ``benchmarks/critic_ceiling.py`` runs on a configuration's starting policy and on a
run's checkpoint, prints its table and writes a consistent JSON (so it can't rot)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.recipe_helpers import typed

from ar_torchrl.checkpoint.local import save_checkpoint
from ar_torchrl.recipes.ceiling import policy_for_ceiling

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "critic_ceiling.py"
COLD = ["model.warm_start.enabled=false", "data.num_rows=100", "rollout.max_new_tokens=4"]


def run_script(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPT), "--samples", "2", "--prompts", "4", "--bootstrap", "20"]
    proc = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow  # a benchmark script: full tier only (~20 s, mostly imports)
def test_critic_ceiling_script_on_a_config_and_on_a_run(tmp_path):
    out = tmp_path / "ceiling.json"
    sets = [a for s in COLD for a in ("--set", s)]
    proc = run_script("--config-name", "dapo_ppo", *sets, "--out", str(out))
    assert "| token |" in proc.stdout and "| prompt (samples) |" in proc.stdout
    data = json.loads(out.read_text())
    cfg, result = data["config"], data["results"]
    assert (cfg["samples_per_prompt"], cfg["prompts"], cfg["checkpoint"]) == (2, 4, None)
    assert len(cfg["commit"]) == 40 and cfg["overrides"] == COLD
    assert result["samples_per_prompt"] == 2 and result["prompt"]["items"] == 8
    assert set(result["by_position"]) <= {"early", "middle", "late"}
    assert 0 < result["token"]["items"] <= 8 * 4 and result["response_length"] <= 4
    # a run directory: its config from .hydra/, its newest checkpoint
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "hydra.yaml").write_text("hydra:\n  job:\n    config_name: dapo_ppo\n")
    (run / ".hydra" / "overrides.yaml").write_text(
        "".join(f"- {o}\n" for o in [*COLD, "hydra.run.dir=x"])
    )
    model, _ = policy_for_ceiling(typed(COLD))
    checkpoint = save_checkpoint(run / "checkpoints", step=2, model=model)
    run_script("--run", str(run), "--out", str(out))
    data = json.loads(out.read_text())
    assert data["config"]["checkpoint"] == str(checkpoint)
    assert data["config"]["overrides"] == COLD  # hydra.* overrides dropped
