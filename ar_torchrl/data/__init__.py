"""Micro-batch planning, datasets and collation to the token-trajectory layout."""

from ar_torchrl.data.micro_batch import MicroBatch, MicroBatchPlan, plan_micro_batches

__all__ = ["MicroBatch", "MicroBatchPlan", "plan_micro_batches"]
