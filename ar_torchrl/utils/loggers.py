"""TorchRL logger factory and a JSON-lines metric history (what the plot and resume read back)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from torchrl.record.loggers import CSVLogger, Logger

__all__ = ["LoggerKind", "append_jsonl", "log_metrics", "make_logger", "read_jsonl"]

LoggerKind = Literal["csv", "tensorboard", "wandb", "none"]
_EXTRA = {"tensorboard": "tensorboard", "wandb": "wandb"}


def make_logger(
    kind: LoggerKind, *, log_dir: str | os.PathLike, exp_name: str, project: str = "ar_torchrl"
) -> Logger | None:
    """Build TorchRL's ``CSVLogger`` (default), ``TensorboardLogger`` or ``WandbLogger``.

    Args:
        kind: ``"csv"`` | ``"tensorboard"`` | ``"wandb"`` | ``"none"`` (returns ``None``).
        log_dir: root directory of the logs.
        exp_name: experiment name (a sub-directory for csv/tensorboard, the run name for W&B).
        project: W&B project.

    Example:
        >>> import tempfile
        >>> logger = make_logger("csv", log_dir=tempfile.mkdtemp(), exp_name="run")
        >>> log_metrics(logger, {"rollout/reward_mean": 0.5}, step=1)
        >>> type(logger).__name__
        'CSVLogger'
        >>> make_logger("mlflow", log_dir=".", exp_name="x")
        Traceback (most recent call last):
        ...
        ValueError: logger.kind='mlflow' is not one of ['csv', 'tensorboard', 'wandb', 'none']
    """
    if kind == "none":
        return None
    if kind not in ("csv", "tensorboard", "wandb"):
        raise ValueError(
            f"logger.kind={kind!r} is not one of ['csv', 'tensorboard', 'wandb', 'none']"
        )
    if kind == "csv":
        return CSVLogger(exp_name=exp_name, log_dir=str(log_dir))
    if importlib.util.find_spec(_EXTRA[kind]) is None:
        raise ModuleNotFoundError(
            f"logger.kind={kind!r} needs the `{_EXTRA[kind]}` package: "
            f"`pip install 'ar_torchrl[{_EXTRA[kind]}]'`, or use logger.kind=csv."
        )
    if kind == "tensorboard":
        from torchrl.record.loggers import TensorboardLogger

        return TensorboardLogger(exp_name=exp_name, log_dir=str(log_dir))
    from torchrl.record.loggers import WandbLogger

    return WandbLogger(exp_name=exp_name, save_dir=str(log_dir), project=project, offline=True)


def log_metrics(logger: Logger | None, metrics: Mapping[str, float], step: int) -> None:
    """Send every scalar of ``metrics`` to ``logger`` at ``step`` (no-op for ``None``)."""
    if logger is None:
        return
    for name, value in metrics.items():
        logger.log_scalar(name, float(value), step=step)


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
    """Read the records :func:`append_jsonl` wrote (see its example)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
