"""What every benchmark script shares: the machine it ran on and writing its JSON result.

The scripts run as ``python benchmarks/<name>.py``, so this directory is on ``sys.path`` and they
import this module as ``_common``.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def machine_info() -> dict[str, Any]:
    """Platform, CPU, core count, Python/torch versions and the 1-minute load average now.

    Example:
        >>> sorted(machine_info())[:3]
        ['cpu', 'cpu_count', 'gpu']
    """
    import torch

    return {
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0],
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def code_version() -> dict:
    """The commit measured, and whether the library's files (``ar_torchrl/``) differ from it."""

    def git(*cmd: str) -> str:
        return subprocess.run(
            ["git", "-C", str(ROOT), *cmd], capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        return {
            "commit": git("rev-parse", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--", "ar_torchrl")),
        }
    except (OSError, subprocess.CalledProcessError) as err:
        return {"commit": None, "dirty": None, "git_error": str(err)}


def read_history(run_dir: Path) -> list[dict]:
    """A recipe run's ``metrics.jsonl`` records (``[]`` before its first; a torn last line, from a
    run killed mid-write, is dropped with a warning: :func:`ar_torchrl.utils.read_jsonl`)."""
    from ar_torchrl.utils import read_jsonl

    path = Path(run_dir) / "metrics.jsonl"
    return read_jsonl(path) if path.exists() else []


def write_json(result: dict[str, Any], out: Path) -> None:
    """Write ``result`` to ``out`` atomically (a ``.json.tmp`` then a rename), making its folder."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(out)


def replace_marked_block(readme: Path, begin: str, end: str, block: str) -> None:
    """Replace ``readme``'s text from the ``begin`` marker to the ``end`` marker (both included)
    with ``block``, which carries the markers itself.

    Raises:
        SystemExit: the page has no such block (naming the markers).
    """
    text = readme.read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"{readme} has no {begin} ... {end} block to replace")
    head, rest = text.split(begin, 1)
    readme.write_text(head + block + rest.split(end, 1)[1])
