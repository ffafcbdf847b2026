"""The weight push from sharded training: full tensors gathered one at a time, for rank 0's sender.

A rollout engine loads whole HF tensors. Under FSDP2 every parameter is a DTensor sharded over the
ranks, so each tensor is all-gathered (``DTensor.full_tensor()``, every rank taking part in the same
order), cast to the engine's dtype *before* the gather (half the traffic for bf16), handed to rank 0's
sender and dropped: at most one full tensor exists at a time beyond what the sender buffers, never
the whole model twice. ``value_head.*`` is never sent
(:func:`~ar_torchrl.weight_sync.named_policy_tensors`).

The sender is any object with ``send(named_tensors, version)`` that consumes the iterable lazily,
bucket by bucket (the ``WeightSender`` protocol). If it fails half-way, rank 0 still gathers the
remaining tensors so that no rank is left waiting in a collective, then every rank raises.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Protocol

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from ar_torchrl.distributed.context import DistContext
from ar_torchrl.distributed.fsdp import reshard
from ar_torchrl.modules import LMActorCritic
from ar_torchrl.weight_sync.names import named_policy_tensors

__all__ = ["FullTensorStream", "push_weights"]

logger = logging.getLogger(__name__)


class _Sender(Protocol):
    def send(self, named_tensors, version: int) -> None: ...


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
        >>> from ar_torchrl.assets import build_tiny_qwen3
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
    sender: _Sender | None,
    version: int,
    *,
    dtype: torch.dtype | None = None,
) -> None:
    """Every rank: gather the policy tensor by tensor; rank 0 feeds them to ``sender.send``.

    Args:
        model: the (sharded) policy, as for :class:`FullTensorStream`.
        ctx: this process's :class:`DistContext`.
        sender: rank 0's weight sender (ignored elsewhere; pass ``None``).
        version: the weight version to stamp.
        dtype: the rollout engine's dtype (e.g. ``torch.bfloat16``).

    Raises:
        RuntimeError: on every rank when rank 0's sender failed (rank 0 re-raises its own error).

    Example:
        >>> from ar_torchrl.assets import build_tiny_qwen3
        >>> class Recorder:
        ...     def send(self, named_tensors, version):
        ...         self.got = [(n, t.dtype) for n, t in named_tensors]; self.version = version
        >>> rec = Recorder()
        >>> push_weights(build_tiny_qwen3(99), DistContext(), rec, 3, dtype=torch.bfloat16)
        >>> rec.version, len(rec.got), rec.got[0]
        (3, 25, ('model.embed_tokens.weight', torch.bfloat16))
    """
    stream = FullTensorStream(model, dtype=dtype, keep=ctx.is_main)
    error: BaseException | None = None
    if ctx.is_main:
        if sender is None:
            raise ValueError("push_weights: rank 0 needs a sender, got None")
        try:
            sender.send(stream, version)
        except Exception as err:  # noqa: BLE001 - re-raised below, after the other ranks are free
            error = err
        left = stream.drain()
        if left and error is None:
            error = RuntimeError(f"push_weights: the sender stopped with {left} tensors unread")
    else:
        stream.drain()
    failed = ctx.all_reduce(torch.tensor([float(error is not None)]), op="max").item()
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"push_weights: rank 0 failed to send weight version {version}")
