"""The metric history of a run: one JSON record per line (``metrics.jsonl``), resumable.

A process killed while appending leaves a *torn* last line (part of a record, no newline):
:func:`read_jsonl` drops it with a warning naming the file. Any other line that is not JSON is an
error naming the file and the line. :func:`truncate_jsonl` keeps the records up to a step, which is
how a resumed run drops the iterations after its checkpoint (they are recomputed).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["append_jsonl", "read_jsonl", "truncate_jsonl"]

logger = logging.getLogger(__name__)


def append_jsonl(path: str | os.PathLike, record: Mapping[str, float | int]) -> None:
    """Append one JSON record (NaN/inf written as ``null``) and flush.

    Example:
        >>> import tempfile
        >>> p = Path(tempfile.mkdtemp()) / "m.jsonl"
        >>> append_jsonl(p, {"step": 1, "x": float("nan")}); read_jsonl(p)
        [{'step': 1, 'x': None}]
    """
    clean = {
        k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()
    }
    with open(path, "a") as f:
        f.write(json.dumps(clean) + "\n")


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read the records :func:`append_jsonl` wrote; a torn last line is dropped with a warning.

    Raises:
        ValueError: a line other than an unterminated last one is not JSON (names file and line).

    Example:
        >>> import tempfile
        >>> p = Path(tempfile.mkdtemp()) / "m.jsonl"
        >>> _ = p.write_text('{"step": 1}\\n{"step": 2, "x": 0.')  # killed mid-write
        >>> read_jsonl(p)
        [{'step': 1}]
    """
    text = Path(path).read_text()
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number == len(lines):  # no newline after it: the process died while writing it
                logger.warning("%s: dropping a torn last line (%d characters)", path, len(line))
                continue
            raise ValueError(f"{path}: line {number} is not JSON ({err}): {line[:80]!r}") from None
    return records


def truncate_jsonl(path: str | os.PathLike, max_step: int, *, step_key: str = "step") -> int:
    """Keep only the records with ``record[step_key] <= max_step`` (and no torn line); atomic.

    Returns:
        how many records were dropped (``0`` if the file does not exist).

    Example:
        >>> import tempfile
        >>> p = Path(tempfile.mkdtemp()) / "m.jsonl"
        >>> for s in (0, 1, 2, 3): append_jsonl(p, {"step": s})
        >>> truncate_jsonl(p, 1), [r["step"] for r in read_jsonl(p)]
        (2, [0, 1])
    """
    path = Path(path)
    if not path.exists():
        return 0
    records = read_jsonl(path)
    kept = [r for r in records if r[step_key] <= max_step]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)
    return len(records) - len(kept)
