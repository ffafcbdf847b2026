"""Collectors: iterate token-trajectory batches and keep the rollout weights in sync."""

from ar_torchrl.collectors.sampling import gather_batch
from ar_torchrl.collectors.weight_sync_collector import WeightSyncCollector, batch_policy_version

__all__ = ["WeightSyncCollector", "batch_policy_version", "gather_batch"]
