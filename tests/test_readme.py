"""The README's composition example runs as written."""

from __future__ import annotations

import re
import subprocess
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
