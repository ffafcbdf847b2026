"""The weight push from sharded training: full tensors gathered one at a time, for rank 0's engine.

A rollout engine loads whole HF tensors. Under FSDP2 every parameter is a DTensor sharded over the
ranks, so each tensor is all-gathered (``DTensor.full_tensor()``, every rank taking part in the same
order), cast to the engine's dtype *before* the gather (half the traffic for bf16), handed to rank 0's
consumer and dropped: at most one full tensor exists at a time beyond what the sender buffers, never
the whole model twice. ``value_head.*`` is never sent
(:func:`~ar_torchrl.weight_sync.named_policy_tensors`).

Rank 0's consumer is the rollout engine's own entry point, so the engine keeps owning its weight
version: ``collector.update_policy_weights_`` (which calls ``backend.sync_weights(stream,
version + 1)``) or ``lambda stream: backend.sync_weights(stream, version)``. It consumes the stream
lazily, bucket by bucket (the ``WeightSender`` protocol). If it fails half-way, rank 0 still gathers
the remaining tensors so that no rank is left waiting in a collective, then every rank raises.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from ar_torchrl.distributed.context import DistContext
from ar_torchrl.distributed.fsdp import reshard
from ar_torchrl.modules import LMActorCritic
from ar_torchrl.weight_sync.names import named_policy_tensors

__all__ = ["FullTensorStream", "push_weights"]

logger = logging.getLogger(__name__)


NamedTensors = Iterable[tuple[str, Tensor]]


class FullTensorStream:
    """Iterator of ``(hf_name, full tensor)`` gathered from a (possibly sharded) policy.

    Every rank must consume it to the end, in lockstep (each step is a collective under FSDP);
    :meth:`drain` finishes the remaining gathers without keeping them. Non-sharded tensors are
    passed through (cast, detached). ``keep=False`` (ranks other than 0) drops every tensor.

    Args:
        model: the HF model (``actor_critic.model``) or the :class:`LMActorCritic` itself.
        dtype: cast to this dtype (e.g. the rollout engine's ``torch.bfloat16``); ``None``: as is.
        keep: yield the tensors (rank 0) or only take part in the gathers.

    Example:
        >>> from ar_torchrl.models.tiny import build_tiny_qwen3
        >>> from ar_torchrl.modules import attach_value_head
        >>> stream = FullTensorStream(attach_value_head(build_tiny_qwen3(99)), dtype=torch.bfloat16)
        >>> name, t = next(stream)
        >>> name, t.dtype, len(stream), any(n.startswith("value_head") for n, _ in stream)
        ('model.embed_tokens.weight', torch.bfloat16, 25, False)
    """

    def __init__(self, model: nn.Module, *, dtype: torch.dtype | None = None, keep: bool = True):
        reshard(model)  # registered parameters must be the shards (not a gathered root)
        policy = model.model if isinstance(model, LMActorCritic) else model
        self._items = list(named_policy_tensors(policy))
        self._next = 0
        self.dtype, self.keep = dtype, keep

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        return self

    def __next__(self) -> tuple[str, Tensor]:
        while self._next < len(self._items):
            name, tensor = self._items[self._next]
            self._next += 1
            full = self._gather(tensor)
            if self.keep:
                return name, full
        raise StopIteration

    def _gather(self, tensor: Tensor) -> Tensor:
        if self.dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(self.dtype)
        if isinstance(tensor, DTensor):
            return tensor.full_tensor()
        return tensor

    def drain(self) -> int:
        """Take part in every remaining gather, keeping nothing; returns how many were left."""
        left = len(self._items) - self._next
        while self._next < len(self._items):
            self._gather(self._items[self._next][1])
            self._next += 1
        return left


def push_weights(
    model: nn.Module,
    ctx: DistContext,
    sync: Callable[[NamedTensors], object] | None,
    *,
    dtype: torch.dtype | None = None,
) -> None:
    """Every rank: gather the policy tensor by tensor; rank 0 feeds them to ``sync``.

    Args:
        model: the (sharded) policy, as for :class:`FullTensorStream`.
        ctx: this process's :class:`DistContext`.
        sync: rank 0's consumer of the ``(name, tensor)`` stream (ignored elsewhere; pass
            ``None``): ``collector.update_policy_weights_``, ``collector.resync_policy_weights_``
            or ``lambda s: backend.sync_weights(s, version)``; the engine stamps the version.
        dtype: the rollout engine's dtype (e.g. ``torch.bfloat16``), the same on every rank.

    Raises:
        RuntimeError: on every rank when rank 0's consumer failed (rank 0 re-raises its own error).

    Example:
        >>> from ar_torchrl.models.tiny import build_tiny_qwen3
        >>> from ar_torchrl.backends import TransformersBackend
        >>> trainer, engine = build_tiny_qwen3(99, seed=0), TransformersBackend(build_tiny_qwen3(99, seed=1))
        >>> push_weights(trainer, DistContext(), lambda s: engine.sync_weights(s, 3), dtype=torch.float32)
        >>> engine.policy_version, torch.equal(engine.model.lm_head.weight, trainer.lm_head.weight)
        (3, True)
    """
    stream = FullTensorStream(model, dtype=dtype, keep=ctx.is_main)
    error: BaseException | None = None
    if ctx.is_main:
        if sync is None:
            raise ValueError(
                "push_weights: rank 0 needs a consumer of the weights (sync), got None"
            )
        try:
            sync(stream)
        except Exception as err:  # noqa: BLE001 - re-raised below, after the other ranks are free
            error = err
        left = stream.drain()
        if left and error is None:
            error = RuntimeError(f"push_weights: the consumer stopped with {left} tensors unread")
    else:
        stream.drain()
    failed = ctx.all_reduce(torch.tensor([float(error is not None)]), op="max").item()
    if error is not None:
        raise error
    if failed:
        raise RuntimeError("push_weights: rank 0 failed to push the weights to its rollout engine")
