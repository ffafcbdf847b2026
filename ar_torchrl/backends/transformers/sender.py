"""Trainside weight sync: load the trainer's policy tensors into an in-process rollout model.

Two modes (the ``copy`` and ``share`` entries of the sync-method registry):

- ``"copy"``: the rollout model is its own module; each arriving tensor is checked (name, shape)
  and copied in place (converted to the rollout model's dtype), one at a time, so the stream is
  never held in memory. A sync that is refused at its first tensor changes nothing; one refused
  later raises :class:`WeightSyncError` with ``partial=True`` (the backend then refuses to generate
  until a successful sync).
- ``"share"``: the rollout model *is* the trainer's module, so there is nothing to copy; the names
  are still checked.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Literal

import torch
from torch import nn

from ar_torchrl.weight_sync.errors import WeightSyncError
from ar_torchrl.weight_sync.names import policy_only

__all__ = ["TrainsideSender"]

logger = logging.getLogger(__name__)


class TrainsideSender:
    """Push HF-named policy tensors into an in-process rollout model (a ``WeightSender``).

    Args:
        target: the rollout model (an HF causal LM). In ``"share"`` mode this is the trainer's own
            module.
        mode: ``"copy"`` (check, then ``copy_`` every tensor into ``target``) or ``"share"``
            (check names only; the weights are already shared).

    Example:
        >>> from ar_torchrl.models.tiny import build_tiny_qwen3
        >>> from ar_torchrl.weight_sync import named_policy_tensors
        >>> trainer, rollout = build_tiny_qwen3(99, seed=0), build_tiny_qwen3(99, seed=1)
        >>> sender = TrainsideSender(rollout, mode="copy")
        >>> sender.send(named_policy_tensors(trainer), version=1)
        >>> bool((rollout.lm_head.weight == trainer.lm_head.weight).all()), sender.last_count > 0
        (True, True)
    """

    def __init__(self, target: nn.Module, mode: Literal["copy", "share"] = "copy") -> None:
        if mode not in ("copy", "share"):
            raise ValueError(f"TrainsideSender: mode must be 'copy' or 'share', got {mode!r}")
        self.target = target
        self.mode = mode
        self.last_count = 0

    def _expected(self) -> dict[str, torch.Tensor]:
        return dict(policy_only(self.target.state_dict().items()))

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Check and load ``named_tensors`` tensor by tensor (``version`` is the backend's to keep).

        Raises:
            WeightSyncError: an unknown or missing name, or a shape mismatch.
        """
        expected, seen = self._expected(), set()
        with torch.no_grad():
            for name, tensor in policy_only(named_tensors):
                self._check(name, tensor, expected, partial=bool(seen) and self.mode == "copy")
                if self.mode == "copy":
                    expected[name].copy_(tensor)
                seen.add(name)
        missing = sorted(set(expected) - seen)
        if missing:
            raise WeightSyncError(
                f"TrainsideSender: tensor names do not match the rollout model: missing "
                f"{missing[:5]} ({len(missing)}); send every tensor of `named_policy_tensors(model)` "
                "of the same architecture",
                partial=bool(seen) and self.mode == "copy",
            )
        self.last_count = len(seen)
        logger.debug(
            "TrainsideSender(%s): loaded %d tensors (version %d)", self.mode, len(seen), version
        )

    @staticmethod
    def _check(name: str, tensor: torch.Tensor, expected: dict, *, partial: bool) -> None:
        if name not in expected:
            raise WeightSyncError(
                f"TrainsideSender: tensor names do not match the rollout model: unknown {name!r}; "
                "send `named_policy_tensors(model)` of the same architecture",
                partial=partial,
            )
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise WeightSyncError(
                f"TrainsideSender: shape of {name!r} is {tuple(tensor.shape)}, the rollout model "
                f"expects {tuple(expected[name].shape)}",
                partial=partial,
            )

    def close(self) -> None:
        """Nothing to release."""
