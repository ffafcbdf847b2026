"""Weight sync: which tensors the rollout engine gets, the ``WeightSender`` protocol, the registry.

The senders live with their engine: :mod:`ar_torchrl.backends.transformers` (``copy`` / ``share``)
and :mod:`ar_torchrl.backends.sglang.senders` (``disk`` / ``tensor`` / ``distributed``); the
registry (:mod:`.registry`) builds them by name. Their old names here (``DiskWeightSender``, ...)
still resolve for one release. Names are imported on first use (the registry needs no torch).
"""

from __future__ import annotations

from ar_torchrl._lazy import lazy_exports

_EXPORTS = {
    "WeightSender": "base",
    "iter_buckets": "base",
    "policy_only": "names",
    "is_policy_tensor": "names",
    "WeightSyncError": "errors",
    "VALUE_HEAD_PREFIX": "names",
    "named_policy_tensors": "names",
    "SYNC_METHODS": "registry",
    "make_sender": "registry",
    "register_sync_method": "registry",
    "sync_methods": "registry",
}
__all__ = sorted(_EXPORTS)

# Moved to their engines' packages (issue 15); kept here for one release.
_MOVED = {
    "DiskWeightSender": "ar_torchrl.backends.sglang.senders.disk",
    "DistributedWeightSender": "ar_torchrl.backends.sglang.senders.distributed",
    "TensorWeightSender": "ar_torchrl.backends.sglang.senders.tensor",
    "TrainsideSender": "ar_torchrl.backends.transformers.sender",
}
__getattr__, __dir__ = lazy_exports(__name__, {**_EXPORTS, **_MOVED})
