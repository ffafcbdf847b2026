"""The README's composition example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_composition_example_runs():
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 1, "the README should hold exactly one python example"
    code = blocks[0]
    assert len(code.strip().splitlines()) <= 25
    torch.manual_seed(0)
    torch.set_num_threads(1)
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)
    metrics = scope["metrics"]
    assert metrics["train/optimizer_steps"] == 2.0 and metrics["train/skipped_steps"] == 0.0
    assert scope["collector"].policy_version == 3
    assert all(abs(v) < float("inf") for k, v in metrics.items() if k.startswith("train/loss"))


def test_readme_test_command_is_what_ci_runs():
    ci = (README.parent / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in README.read_text() and "bash scripts/test.sh" in ci
