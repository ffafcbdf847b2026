"""The README's composition example runs as written."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def composition_block() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == 1, "the README should hold exactly one python example"
    return blocks[0]


def test_readme_composition_example_runs():
    code = composition_block()
    assert len(code.strip().splitlines()) <= 25
    torch.manual_seed(0)
    torch.set_num_threads(1)
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)
    metrics = scope["metrics"]
    assert metrics["train/optimizer_steps"] == 2.0 and metrics["train/skipped_steps"] == 0.0
    assert scope["collector"].policy_version == 3
    assert all(abs(v) < float("inf") for k, v in metrics.items() if k.startswith("train/loss"))


def test_readme_grpo_swap_runs_as_its_comment_says():
    """The comment on the advantage line names the swap; run the block with it, as written."""
    code = composition_block()
    line = next(ln for ln in code.splitlines() if ln.startswith("advantage = "))
    swap = line.split("# or ", 1)[1].split(":", 1)[0]
    assert swap == "GRPOAdvantage(critic_targets=True)"
    torch.manual_seed(0)
    torch.set_num_threads(1)
    scope: dict = {}
    exec(compile(code.replace(line, f"advantage = {swap}"), str(README), "exec"), scope)
    metrics = scope["metrics"]
    assert metrics["train/optimizer_steps"] == 2.0 and metrics["train/skipped_steps"] == 0.0
    assert all(abs(v) < float("inf") for k, v in metrics.items() if k.startswith("train/loss"))


def test_missing_value_targets_name_the_grpo_switch():
    """README: "GRPOAdvantage(): same call" failed in its own block with a bare missing-key error."""
    import pytest
    from tensordict import TensorDict

    from ar_torchrl.models import build_tiny_qwen3
    from ar_torchrl.modules import LMActorCritic, attach_value_head
    from ar_torchrl.objectives import TokenPPOLoss

    loss = TokenPPOLoss(LMActorCritic(attach_value_head(build_tiny_qwen3(99))))
    shape = (2, 3)
    td = TensorDict(
        {
            "tokens": torch.ones(shape, dtype=torch.long),
            "attention_mask": torch.ones(shape, dtype=torch.bool),
            "loss_mask": torch.ones(shape, dtype=torch.bool),
            "sample_log_prob": torch.zeros(shape),
            "state_value": torch.zeros(*shape, 1),
            "advantage": torch.zeros(*shape, 1),
        },
        list(shape),
    )
    with pytest.raises(KeyError, match=r"GRPOAdvantage\(critic_targets=True\)"):
        loss(td)


def test_readme_test_command_is_what_ci_runs():
    ci = (README.parent / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in README.read_text() and "bash scripts/test.sh" in ci


def test_nothing_refers_outside_the_repository():
    """The repo carries its own design document; no file points at one a user does not have."""
    root = README.parent
    files = subprocess.run(
        ["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True
    )
    bad = []
    for name in files.stdout.split():
        path = root / name
        if not path.is_file() or path.suffix in {".json", ".png"}:
            continue
        text = path.read_text(errors="replace")
        for pattern in ("../" + "shared", "/work/" + "shared", "DESIGN" + ".md"):  # not this file
            bad += [f"{name}: {pattern}" for _ in range(text.count(pattern))]
    assert not bad, "\n".join(bad)


def test_cited_design_sections_exist():
    root = README.parent
    design = (root / "docs" / "design.md").read_text()
    sections = set(re.findall(r"^#{2,3} (\d+b?)\. ", design, flags=re.M))
    files = subprocess.run(
        ["git", "ls-files", "*.py", "*.md", "*.yaml"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    cited = {
        (name, n)
        for name in files
        for n in re.findall(r"docs/design\.md`?\)? section (\d+b?)", (root / name).read_text())
    }
    assert len(cited) >= 15
    assert not {c for c in cited if c[1] not in sections}, sorted(sections)
