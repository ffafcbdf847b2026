"""Atomic training checkpoints: model (with value head), optimizer, RNG states, step, data position.

A checkpoint is one ``torch.save`` file written to a temporary name in the same directory and renamed
into place (``os.replace`` is atomic on POSIX), so a crash never leaves a half-written checkpoint
under the final name. Resuming restores every RNG stream (Python, NumPy, torch CPU and CUDA), so the
resumed run draws the same samples an uninterrupted run would.
"""

from __future__ import annotations

import logging
import os
import random
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = [
    "capture_rng_state",
    "latest_checkpoint",
    "load_checkpoint",
    "restore_rng_state",
    "save_checkpoint",
]

logger = logging.getLogger(__name__)
_NAME = re.compile(r"^step_(\d+)\.pt$")


def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy, torch CPU (and CUDA when available) RNG states.

    Example:
        >>> state = capture_rng_state(); a = torch.rand(1)
        >>> restore_rng_state(state); bool(torch.rand(1) == a)
        True
    """
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`capture_rng_state` captured (see its example)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    directory: str | os.PathLike,
    *,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
    keep_last: int | None = None,
) -> Path:
    """Write ``directory/step_<step>.pt`` atomically and return its path.

    Args:
        directory: checkpoint directory (created if missing).
        step: the number of completed training iterations.
        model: the policy; its ``state_dict`` includes ``value_head.*`` when a head is attached.
        optimizer: saved when given.
        extra: anything picklable the run needs to continue (data position, collector state,
            policy version, metric history, ...).
        keep_last: delete older ``step_*.pt`` files beyond the newest ``keep_last``.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp(); net = nn.Linear(2, 1)
        >>> p = save_checkpoint(d, step=3, model=net, extra={"data_position": 48})
        >>> p.name, load_checkpoint(p, model=net)["extra"]["data_position"]
        ('step_3.pt', 48)
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    payload = {
        "step": int(step),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "rng": capture_rng_state(),
        "extra": extra or {},
    }
    target = directory / f"step_{int(step)}.pt"
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{target.name}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("saved checkpoint %s", target)
    if keep_last is not None:
        for old in _checkpoints(directory)[:-keep_last]:
            old.unlink(missing_ok=True)
    return target


def _checkpoints(directory: Path) -> list[Path]:
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The ``step_*.pt`` with the highest step in ``directory`` (``None`` if there is none).

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp(); net = nn.Linear(2, 1)
        >>> _ = save_checkpoint(d, step=2, model=net); _ = save_checkpoint(d, step=10, model=net)
        >>> latest_checkpoint(d).name
        'step_10.pt'
    """
    directory = Path(directory)
    if not directory.is_dir():
        return None
    found = _checkpoints(directory)
    return found[-1] if found else None


def load_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint into ``model`` (strict) and ``optimizer``; restore RNG states.

    Returns:
        ``{"step": int, "extra": dict}``.

    Example:
        >>> import tempfile
        >>> net = nn.Linear(2, 1); p = save_checkpoint(tempfile.mkdtemp(), step=1, model=net)
        >>> load_checkpoint(p, model=nn.Linear(3, 1))
        Traceback (most recent call last):
        ...
        ValueError: checkpoint ... does not match the model ...
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"load_checkpoint: no checkpoint file at {str(path)!r}")
    payload = torch.load(path, map_location="cpu", weights_only=False)
    try:
        model.load_state_dict(payload["model"])
    except RuntimeError as err:
        raise ValueError(
            f"checkpoint {str(path)!r} does not match the model (was it written by a run with a "
            f"different model config?): {str(err).splitlines()[0]} ..."
        ) from err
    if optimizer is not None:
        if payload["optimizer"] is None:
            raise ValueError(f"checkpoint {str(path)!r} has no optimizer state to restore")
        optimizer.load_state_dict(payload["optimizer"])
    if restore_rng:
        restore_rng_state(payload["rng"])
    return {"step": payload["step"], "extra": payload["extra"]}
