"""The README: a front door of <= 250 lines whose composition example runs as written and says what
each iteration did, and whose links (and those of docs/) lead somewhere."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def composition_block() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == 1, "the README should hold exactly one python example"
    return blocks[0]


#: One printed line per iteration of the composition block, then the last line.
ITERATION_LINE = re.compile(r"iteration (\d): reward ([+-]\d\.\d\d), loss ([+-]\d+\.\d{4})")


def check_printed(out: str) -> None:
    """The block says what each of its 3 iterations did, and that it finished."""
    lines = out.strip().splitlines()
    assert len(lines) == 4, out
    for i, line in enumerate(lines[:3]):
        match = ITERATION_LINE.fullmatch(line)
        assert match, line
        assert int(match[1]) == i and -1.0 <= float(match[2]) <= 1.0
        assert abs(float(match[3])) < 1e3
    assert lines[3] == "done: 3 weight versions pushed to the rollout engine"


def test_readme_composition_example_runs(capsys):
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
    out = capsys.readouterr().out
    check_printed(out)
    last = ITERATION_LINE.fullmatch(out.splitlines()[2])
    assert float(last[3]) == pytest.approx(metrics["train/loss_objective"], abs=5e-5)
    assert float(last[2]) == pytest.approx(scope["collector"].last_batch_stats["reward_mean"])


def test_readme_grpo_swap_runs_as_its_comment_says(capsys):
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
    check_printed(capsys.readouterr().out)


def test_readme_is_a_front_door():
    """<= 250 lines (STYLE.md rule 13): the two commands, the block, one results table, links."""
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    assert "bash scripts/setup.sh && .venv/bin/python examples/dapo_ppo.py" in text
    tables = re.findall(r"^\| task \(model\) \|", text, flags=re.M)
    assert len(tables) == 1
    for marker in (
        "<!-- readme_figures:begin",
        "<!-- algo_options:begin",
        "critic_budget_cpu:begin",
    ):
        assert marker not in text  # measured blocks live in docs/evidence.md


#: Pages the README links to that other changes of the same release add.
def heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    titles = re.findall(r"^#{1,6} (.+)$", markdown, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", t.strip().lower()).replace(" ", "-") for t in titles}


def test_links_of_the_readme_and_docs_lead_somewhere():
    """Every relative link of README.md and docs/*.md names a file that exists, and its #anchor a
    heading of that file."""
    root = README.parent
    broken = []
    for page in [README, *sorted((root / "docs").glob("*.md"))]:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", page.read_text()):
            if "://" in target:
                continue
            path = (page.parent / target).resolve() if target else page
            if not path.exists():
                broken.append(f"{page.relative_to(root)}: {target}")
            elif (
                anchor and path.suffix == ".md" and anchor not in heading_anchors(path.read_text())
            ):
                broken.append(f"{page.relative_to(root)}: {target}#{anchor}")
    assert not broken, "\n".join(broken)


def test_heading_anchors_follow_github():
    assert heading_anchors(
        "## Composition (plain TorchRL style)\n# A real model: SmolLM2-135M\n"
    ) == {
        "composition-plain-torchrl-style",
        "a-real-model-smollm2-135m",
    }


def test_missing_value_targets_name_the_grpo_switch():
    """README: "GRPOAdvantage(): same call" failed in its own block with a bare missing-key error."""
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
