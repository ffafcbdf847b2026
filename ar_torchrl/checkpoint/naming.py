"""The one naming rule of checkpoints (no torch): where a step's checkpoint lives, which entries of
a ``checkpoints/`` directory are checkpoints, and which are the leftovers of a save that never
finished.

- A single-process checkpoint is the file ``step_<N>.pt`` with its manifest
  ``.step_<N>.pt.manifest.json``; a save writes ``.step_<N>.pt-<random>.tmp`` first.
- A distributed (FSDP2) checkpoint is the directory ``step_<N>/``; a save writes ``.step_<N>.tmp/``
  first, and a replaced one is ``.step_<N>.old/`` until it is deleted.

``<N>`` is the number of completed training iterations. Every other module asks this one.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

__all__ = [
    "checkpoint_name",
    "checkpoint_pattern",
    "checkpoint_step",
    "is_checkpoint_name",
    "list_checkpoints",
    "manifest_path",
    "remove_partial_checkpoints",
]

logger = logging.getLogger(__name__)

_FILE = re.compile(r"^step_(\d+)\.pt$")
_DIR = re.compile(r"^step_(\d+)$")
_PARTIAL_FILE = re.compile(r"^\.step_\d+\.pt(\.manifest\.json)?-.*\.tmp$")
_PARTIAL_DIR = re.compile(r"^\.step_\d+\.(tmp|old)$")


def checkpoint_name(step: int, *, sharded: bool) -> str:
    """The name of step ``step``'s checkpoint: ``step_<N>.pt``, or ``step_<N>`` when ``sharded``.

    Example:
        >>> checkpoint_name(40, sharded=False), checkpoint_name(8, sharded=True)
        ('step_40.pt', 'step_8')
    """
    return f"step_{int(step)}" if sharded else f"step_{int(step)}.pt"


def checkpoint_pattern(*, sharded: bool) -> str:
    """How checkpoints are named, for messages: ``step_<N>.pt`` or ``step_<N>``.

    Example:
        >>> checkpoint_pattern(sharded=False)
        'step_<N>.pt'
    """
    return checkpoint_name(0, sharded=sharded).replace("0", "<N>")


def is_checkpoint_name(name: str, *, sharded: bool | None = None) -> bool:
    """Whether ``name`` is a checkpoint's name (of either kind when ``sharded`` is ``None``).

    Example:
        >>> is_checkpoint_name("step_3.pt"), is_checkpoint_name("step_3", sharded=False)
        (True, False)
    """
    patterns = {None: (_FILE, _DIR), False: (_FILE,), True: (_DIR,)}[sharded]
    return any(p.match(name) for p in patterns)


def checkpoint_step(path: str | os.PathLike) -> int:
    """The step of a checkpoint: a file ``step_<step>.pt`` or a distributed checkpoint directory
    ``step_<step>``.

    Example:
        >>> checkpoint_step("runs/a/checkpoints/step_40.pt"), checkpoint_step("runs/b/checkpoints/step_8")
        (40, 8)
    """
    name = Path(path).name
    match = _FILE.match(name) or _DIR.match(name)
    if match is None:
        raise ValueError(
            f"{str(path)!r} is not a checkpoint name (step_<N>.pt, or step_<N> for a distributed one)"
        )
    return int(match.group(1))


def list_checkpoints(directory: str | os.PathLike, *, sharded: bool) -> list[Path]:
    """The checkpoints of one kind in ``directory``, oldest step first (none when it is missing).

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp())
        >>> for name in ("step_10.pt", "step_9.pt", ".step_11.pt-x.tmp"): _ = (d / name).write_bytes(b"")
        >>> [p.name for p in list_checkpoints(d, sharded=False)], list_checkpoints(d, sharded=True)
        (['step_9.pt', 'step_10.pt'], [])
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    pattern = _DIR if sharded else _FILE
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := pattern.match(p.name))]
    return [p for _, p in sorted(found)]


def manifest_path(checkpoint: str | os.PathLike) -> Path:
    """Where the manifest (size, SHA-256, optional HMAC) of a ``step_<N>.pt`` file lives.

    Example:
        >>> manifest_path("ckpts/step_4.pt").name
        '.step_4.pt.manifest.json'
    """
    checkpoint = Path(checkpoint)
    return checkpoint.with_name(f".{checkpoint.name}.manifest.json")


def temp_file_prefix(target: Path) -> str:
    """The prefix of the temporary file a save of ``target`` (a file) writes first."""
    return f".{target.name}-"


def temp_dir(final: Path) -> Path:
    """Where a distributed save of ``final`` (``step_<N>``) writes before its rename."""
    return final.with_name(f".{final.name}.tmp")


def replaced_dir(final: Path) -> Path:
    """Where a distributed checkpoint being replaced by a new save of its step waits for deletion."""
    return final.with_name(f".{final.name}.old")


def remove_partial_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Delete the temporary files of saves that were killed mid-write; return what was deleted.

    Also the temporary (``.step_<N>.tmp``) and replaced (``.step_<N>.old``) directories of
    distributed checkpoints. Only one process may write checkpoints into ``directory`` (a
    temporary file of a save still in progress elsewhere would be deleted too).

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp()); _ = (d / ".step_3.pt-x1y2.tmp").write_bytes(b"half")
        >>> [p.name for p in remove_partial_checkpoints(d)], list(d.iterdir())
        (['.step_3.pt-x1y2.tmp'], [])
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = sorted(
        p
        for p in directory.iterdir()
        if _PARTIAL_FILE.match(p.name) or (p.is_dir() and _PARTIAL_DIR.match(p.name))
    )
    for path in removed:
        logger.warning("removing %s: a checkpoint save that did not finish", path)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return removed
