"""Weight sync: which tensors the rollout engine gets, and senders for each backend."""

from ar_torchrl.weight_sync.names import VALUE_HEAD_PREFIX, named_policy_tensors

__all__ = ["VALUE_HEAD_PREFIX", "named_policy_tensors"]
from ar_torchrl.weight_sync.trainside import TrainsideSender, WeightSyncError  # noqa: E402

__all__ += ["TrainsideSender", "WeightSyncError"]
from ar_torchrl.weight_sync.sglang import (  # noqa: E402
    DiskWeightSender,
    DistributedWeightSender,
    TensorWeightSender,
)

__all__ += ["DiskWeightSender", "DistributedWeightSender", "TensorWeightSender"]
