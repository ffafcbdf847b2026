"""Trainside weight sync: load the trainer's policy tensors into an in-process rollout model.

Two modes (docs/design.md section 3, "Weight sync"):

- ``"copy"``: the rollout model is its own module; every tensor of
  :func:`~ar_torchrl.weight_sync.named_policy_tensors` is validated (names, shapes) and then copied
  in place. Validation happens before any copy, so a rejected sync leaves the rollout weights as
  they were.
- ``"share"``: the rollout model *is* the trainer's module, so there is nothing to copy; the names
  are still checked (no ``value_head.*`` may arrive).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Literal

import torch
from torch import nn

from ar_torchrl.weight_sync.errors import WeightSyncError
from ar_torchrl.weight_sync.names import VALUE_HEAD_PREFIX

__all__ = ["TrainsideSender"]

logger = logging.getLogger(__name__)


class TrainsideSender:
    """Push HF-named policy tensors into an in-process rollout model.

    Args:
        target: the rollout model (an HF causal LM). In ``"share"`` mode this is the trainer's own
            module.
        mode: ``"copy"`` (validate, then ``copy_`` every tensor into ``target``) or ``"share"``
            (validate names only; the weights are already shared).

    Example:
        >>> import copy
        >>> from ar_torchrl.assets import build_tiny_qwen3
        >>> from ar_torchrl.weight_sync import named_policy_tensors
        >>> trainer, rollout = build_tiny_qwen3(99, seed=0), build_tiny_qwen3(99, seed=1)
        >>> sender = TrainsideSender(rollout, mode="copy")
        >>> sender.send(named_policy_tensors(trainer)) > 0
        True
        >>> bool((rollout.lm_head.weight == trainer.lm_head.weight).all())
        True
    """

    def __init__(self, target: nn.Module, mode: Literal["copy", "share"] = "copy") -> None:
        if mode not in ("copy", "share"):
            raise ValueError(f"TrainsideSender: mode must be 'copy' or 'share', got {mode!r}")
        self.target = target
        self.mode = mode

    def _expected(self) -> dict[str, torch.Tensor]:
        return {
            k: v for k, v in self.target.state_dict().items() if not k.startswith(VALUE_HEAD_PREFIX)
        }

    def _validate(self, items: list[tuple[str, torch.Tensor]]) -> None:
        names = [n for n, _ in items]
        bad = [n for n in names if n.startswith(VALUE_HEAD_PREFIX)]
        if bad:
            raise WeightSyncError(
                f"TrainsideSender: received train-only tensors {bad}; send "
                "`named_policy_tensors(model)`, which never yields `value_head.*`"
            )
        if self.mode == "share":
            return
        expected = self._expected()
        unknown = sorted(set(names) - set(expected))
        missing = sorted(set(expected) - set(names))
        if unknown or missing:
            raise WeightSyncError(
                f"TrainsideSender: tensor names do not match the rollout model: unknown {unknown[:5]} "
                f"({len(unknown)}), missing {missing[:5]} ({len(missing)}); send every tensor of "
                "`named_policy_tensors(model)` of the same architecture"
            )
        for name, tensor in items:
            if tuple(tensor.shape) != tuple(expected[name].shape):
                raise WeightSyncError(
                    f"TrainsideSender: shape of {name!r} is {tuple(tensor.shape)}, the rollout model "
                    f"expects {tuple(expected[name].shape)}"
                )

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Validate and load ``named_tensors``; return how many tensors were received.

        Raises:
            WeightSyncError: on a ``value_head.*`` name, an unknown or missing name, or a shape
                mismatch. Nothing is copied in that case.
        """
        items = list(named_tensors)
        self._validate(items)
        if self.mode == "copy":
            expected = self._expected()
            with torch.no_grad():
                for name, tensor in items:
                    expected[name].copy_(tensor)
        logger.debug("TrainsideSender(%s): loaded %d tensors", self.mode, len(items))
        return len(items)
