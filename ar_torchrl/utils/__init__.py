"""Run plumbing for the recipe: per-stage timing, TorchRL logger factory, metric files, PNG plots."""

from __future__ import annotations

from ar_torchrl.utils.loggers import append_jsonl, log_metrics, make_logger, read_jsonl
from ar_torchrl.utils.plotting import plot_training_curves
from ar_torchrl.utils.timer import StageTimer

__all__ = [
    "StageTimer",
    "append_jsonl",
    "log_metrics",
    "make_logger",
    "plot_training_curves",
    "read_jsonl",
]
