"""Weight sync: which tensors the rollout engine gets, the ``WeightSender`` protocol, its senders."""

from ar_torchrl.weight_sync.base import WeightSender, iter_buckets, policy_only
from ar_torchrl.weight_sync.disk import DiskWeightSender
from ar_torchrl.weight_sync.distributed import DistributedWeightSender
from ar_torchrl.weight_sync.errors import WeightSyncError
from ar_torchrl.weight_sync.names import VALUE_HEAD_PREFIX, named_policy_tensors
from ar_torchrl.weight_sync.registry import SYNC_METHODS, make_sender, sync_methods
from ar_torchrl.weight_sync.tensor import TensorWeightSender
from ar_torchrl.weight_sync.trainside import TrainsideSender

__all__ = [
    "SYNC_METHODS",
    "VALUE_HEAD_PREFIX",
    "DiskWeightSender",
    "DistributedWeightSender",
    "TensorWeightSender",
    "TrainsideSender",
    "WeightSender",
    "WeightSyncError",
    "iter_buckets",
    "make_sender",
    "named_policy_tensors",
    "policy_only",
    "sync_methods",
]
