"""The one protocol every weight-sync method implements, and the lazy helpers they share.

A sender receives ``(hf_name, tensor)`` pairs and a version number. It consumes the pairs
**lazily**: a caller may pass a generator that materialises each full tensor just in time (an FSDP
rank 0 gathering shards, converted to the engine's dtype), so no sender ever holds the whole model
in memory: the trainside sender copies tensor by tensor, the SGLang senders work bucket by bucket
(:func:`iter_buckets`). Every sender drops ``value_head.*`` (:func:`policy_only`), which is
train-only. Senders never import backends: a backend is *given* a sender
(:mod:`ar_torchrl.weight_sync.registry` builds them by name).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Protocol, TypeVar, runtime_checkable

import torch

from ar_torchrl.weight_sync.errors import WeightSyncError
from ar_torchrl.weight_sync.names import policy_only

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "NamedTensors",
    "WeightSender",
    "iter_buckets",
    "policy_only",
    "with_last",
]

logger = logging.getLogger(__name__)

NamedTensors = list[tuple[str, torch.Tensor]]
DEFAULT_BUCKET_BYTES = 256 << 20
T = TypeVar("T")


@runtime_checkable
class WeightSender(Protocol):
    """Ships policy weights into a rollout engine.

    ``send`` loads ``named_tensors`` (HF names; ``value_head.*`` is dropped) and tags them
    ``version``; it raises :class:`~ar_torchrl.weight_sync.errors.WeightSyncError` on any failure.
    ``close`` releases what the sender holds (process groups, temp dirs). Implementations:
    :class:`~ar_torchrl.backends.transformers.sender.TrainsideSender` (``copy`` / ``share``),
    :class:`~ar_torchrl.backends.sglang.senders.disk.DiskWeightSender`,
    :class:`~ar_torchrl.backends.sglang.senders.tensor.TensorWeightSender`,
    :class:`~ar_torchrl.backends.sglang.senders.distributed.DistributedWeightSender`.

    Example:
        >>> class Recorder:
        ...     def __init__(self): self.names = []
        ...     def send(self, named_tensors, version): self.names += [n for n, _ in policy_only(named_tensors)]
        ...     def close(self): pass
        >>> isinstance(Recorder(), WeightSender)
        True
    """

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None: ...

    def close(self) -> None: ...


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[NamedTensors]:
    """Group pairs into buckets of at most ``bucket_bytes``, consuming the input lazily.

    A tensor bigger than ``bucket_bytes`` gets a bucket of its own. Inside a bucket tensors are
    ordered by decreasing element size, so every tensor starts at a byte offset aligned to its
    dtype in a flattened ``uint8`` buffer (SGLang checks this). ``value_head.*`` is dropped.

    Raises:
        WeightSyncError: the input held no policy tensor at all.

    Example:
        >>> items = [("a", torch.zeros(4)), ("b", torch.zeros(4)), ("c", torch.zeros(8))]
        >>> [[n for n, _ in b] for b in iter_buckets(items, bucket_bytes=32)]
        [['a', 'b'], ['c']]
    """
    if bucket_bytes < 1:
        raise ValueError(f"iter_buckets: bucket_bytes must be >= 1, got {bucket_bytes}")
    bucket: NamedTensors = []
    size, sent = 0, False
    for name, tensor in policy_only(named_tensors):
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield sorted(bucket, key=lambda it: -it[1].element_size())
            bucket, size, sent = [], 0, True
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield sorted(bucket, key=lambda it: -it[1].element_size())
    elif not sent:
        raise WeightSyncError("weight sync: no policy tensors to send (got an empty iterable?)")


def with_last(items: Iterable[T]) -> Iterator[tuple[T, bool]]:
    """Yield ``(item, is_last)`` with one item of look-ahead (the last bucket carries the version).

    Example:
        >>> list(with_last("ab"))
        [('a', False), ('b', True)]
    """
    it = iter(items)
    try:
        current = next(it)
    except StopIteration:
        return
    for following in it:
        yield current, False
        current = following
    yield current, True
