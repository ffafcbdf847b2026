"""Weight sync: which tensors the rollout engine gets, and senders for each backend."""

from ar_torchrl.weight_sync.errors import WeightSyncError
from ar_torchrl.weight_sync.names import VALUE_HEAD_PREFIX, named_policy_tensors
from ar_torchrl.weight_sync.sglang import (
    DiskWeightSender,
    DistributedWeightSender,
    TensorWeightSender,
)
from ar_torchrl.weight_sync.trainside import TrainsideSender

__all__ = [
    "VALUE_HEAD_PREFIX",
    "DiskWeightSender",
    "DistributedWeightSender",
    "TensorWeightSender",
    "TrainsideSender",
    "WeightSyncError",
    "named_policy_tensors",
]
