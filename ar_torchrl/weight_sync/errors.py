"""Errors of the weight-sync senders."""

from __future__ import annotations

__all__ = ["WeightSyncError"]


class WeightSyncError(RuntimeError):
    """A weight sync failed or was rejected by the rollout engine; the message has its reason.

    After this error the engine may hold its previous weights or (distributed and bucketed tensor
    paths) a partial update: sync again before generating.

    Example:
        >>> raise WeightSyncError("server said: no such parameter")
        Traceback (most recent call last):
        ...
        ar_torchrl.weight_sync.errors.WeightSyncError: server said: no such parameter
    """
