"""TorchRL logger factory, and trimming of TorchRL's CSV logs when a run resumes.

TorchRL is imported by :func:`make_logger` (importing this module stays cheap).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    from torchrl.record.loggers import Logger

__all__ = ["LOGGER_KINDS", "LoggerKind", "log_metrics", "make_logger", "truncate_csv_logs"]

logger = logging.getLogger(__name__)

LoggerKind = Literal["csv", "tensorboard", "wandb", "none"]
LOGGER_KINDS: tuple[str, ...] = get_args(LoggerKind)
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
    if kind not in LOGGER_KINDS:
        raise ValueError(f"logger.kind={kind!r} is not one of {list(LOGGER_KINDS)}")
    if kind == "csv":
        from torchrl.record.loggers import CSVLogger

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


def truncate_csv_logs(log_dir: str | os.PathLike, max_step: int) -> int:
    """Drop the rows after ``max_step`` from every ``scalars/*.csv`` of TorchRL's ``CSVLogger``.

    A resumed run recomputes the iterations after its checkpoint; without this their old rows
    would stay in the CSV files next to the new ones. Files are rewritten atomically; a torn last
    row (a process killed mid-write) is dropped too.

    Args:
        log_dir: the directory given to :func:`make_logger` (its ``<exp_name>/scalars`` are trimmed).
        max_step: the last step to keep.

    Returns:
        how many rows were dropped over all files.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> log = make_logger("csv", log_dir=d, exp_name="run")
        >>> for step in (1, 2, 3): log_metrics(log, {"rollout/reward": step / 10}, step)
        >>> truncate_csv_logs(d, 2)
        1
        >>> (Path(d) / "run" / "scalars" / "rollout" / "reward.csv").read_text().split()
        ['1,0.1', '2,0.2']
    """
    dropped = 0
    for path in sorted(Path(log_dir).glob("*/scalars/**/*.csv")):
        *rows, torn = path.read_text().split("\n")  # torn: text after the last newline
        kept = [r for r in rows if _csv_step(r) is not None and _csv_step(r) <= max_step]
        dropped += len(rows) - len(kept) + bool(torn)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(r + "\n" for r in kept))
        os.replace(tmp, path)
    if dropped:
        logger.info("%s: dropped %d CSV rows after step %d", log_dir, dropped, max_step)
    return dropped


def _csv_step(row: str) -> int | None:
    """The step of a ``step,value`` row (``None`` for an empty or torn row)."""
    step, sep, value = row.partition(",")
    try:
        float(value)
        return int(step) if sep else None
    except ValueError:
        return None
