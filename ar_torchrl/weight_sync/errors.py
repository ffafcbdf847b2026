"""Errors of the weight-sync senders."""

from __future__ import annotations

__all__ = ["WeightSyncError"]


class WeightSyncError(RuntimeError):
    """A weight sync failed or was rejected by the rollout engine; the message has its reason.

    The engine's ``policy_version`` is unchanged after this error. ``partial`` says whether the
    engine may hold a partial update (some tensors, or some servers, already updated): a backend
    then refuses to generate until the next successful sync, so that no batch is sampled from
    mixed weights. ``partial=False`` means nothing was applied (e.g. a shape check refused the
    tensors before any request).

    Example:
        >>> err = WeightSyncError("server said: no such parameter", partial=True)
        >>> err.partial
        True
        >>> raise err
        Traceback (most recent call last):
        ...
        ar_torchrl.weight_sync.errors.WeightSyncError: server said: no such parameter
    """

    def __init__(self, message: str, *, partial: bool = False) -> None:
        super().__init__(message)
        self.partial = partial
