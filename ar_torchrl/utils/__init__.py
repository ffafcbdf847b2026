"""Run plumbing for the recipe: per-stage timing, TorchRL logger factory, metric files, PNG plots.

Importing this package is cheap (TorchRL and matplotlib are imported when first used).
"""

from __future__ import annotations

from ar_torchrl.utils.history import append_jsonl, read_jsonl, truncate_jsonl
from ar_torchrl.utils.loggers import log_metrics, make_logger, truncate_csv_logs
from ar_torchrl.utils.plotting import plot_training_curves
from ar_torchrl.utils.timer import StageTimer

__all__ = [
    "StageTimer",
    "append_jsonl",
    "log_metrics",
    "make_logger",
    "plot_training_curves",
    "read_jsonl",
    "truncate_csv_logs",
    "truncate_jsonl",
]
