"""The house tooling: ruff lint and format are clean (configured in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_and_format_are_clean():
    for args in (["check", "."], ["format", "--check", "."]):
        proc = subprocess.run(
            [sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True
        )
        assert proc.returncode == 0, (
            f"ruff {' '.join(args)}:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}"
        )
