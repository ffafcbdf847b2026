"""Micro-batch planning, datasets and collation to the token-trajectory layout."""

from ar_torchrl.data.micro_batch import MicroBatch, MicroBatchPlan, plan_micro_batches

__all__ = ["MicroBatch", "MicroBatchPlan", "plan_micro_batches"]
from ar_torchrl.data.collate import completions_to_trajectory  # noqa: E402
from ar_torchrl.data.datasets import (  # noqa: E402
    DAPO_TEMPLATE,
    SHORT_TEMPLATE,
    MathDataset,
    arithmetic_dataset,
    load_dapo_math,
    make_row,
    train_holdout_split,
    validate_row,
)

__all__ += [
    "DAPO_TEMPLATE",
    "SHORT_TEMPLATE",
    "MathDataset",
    "arithmetic_dataset",
    "completions_to_trajectory",
    "load_dapo_math",
    "make_row",
    "train_holdout_split",
    "validate_row",
]
