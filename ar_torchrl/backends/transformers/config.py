"""Torch-free config schemas of the trainside engine, registered beside it.

- the backend (``backend=trainside`` in the recipe): :class:`TrainsideBackendConfig`;
- its weight-sync methods ``copy`` and ``share`` (:class:`~.sender.TrainsideSender`; no options):
  :class:`CopySyncOptions`, :class:`ShareSyncOptions`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ar_torchrl.backends.registry import BackendConfig, BackendContext, register_backend
from ar_torchrl.utils.checks import check_max_batch_size
from ar_torchrl.weight_sync.registry import register_sync_method

# OmegaConf reads the annotations at run time: they must stay `Optional[...]`, not `X | None`.
# ruff: noqa: UP045

__all__ = [
    "CopySyncOptions",
    "ShareSyncOptions",
    "TrainsideBackendConfig",
    "check_max_batch_size",
]


@register_backend("trainside", help="a copy of the policy samples in the trainer's process")
@dataclass
class TrainsideBackendConfig(BackendConfig):
    """``backend=trainside``: :class:`~ar_torchrl.backends.TransformersBackend` in ``copy`` mode."""

    max_batch_size: Optional[int] = None  # most sequences per generation forward (None: all)

    def check(self, prefix: str) -> None:
        check_max_batch_size(prefix, self.max_batch_size)

    def starts_with_trainer_weights(self) -> bool:
        """The engine copies the trainer's policy when it is built."""
        return True

    def build(self, context: BackendContext) -> Any:
        """A private copy of the policy (loaded from ``context.start_dir`` when the trainer holds
        only shards) on the trainer's device, computing in the trainer's compute dtype."""
        import torch

        from ar_torchrl.backends.transformers.backend import TransformersBackend

        model = context.model
        if context.start_dir is not None:  # the engine's own full copy, on this rank's device
            from ar_torchrl.models.hf import load_hf_model

            model = load_hf_model(context.start_dir, dtype=context.dtype)[0].to(context.device)
        backend = TransformersBackend(
            model, mode="copy", max_batch_size=self.max_batch_size, seed=context.seed
        )
        backend.model.to(getattr(torch, context.dtype))  # float32: as is
        context.stack.callback(backend.close)
        return backend


@register_sync_method(
    "copy", engine="trainside", help="copy into a private in-process rollout model"
)
@dataclass
class CopySyncOptions:
    """``copy``: :class:`~ar_torchrl.backends.transformers.sender.TrainsideSender` (no options)."""

    def build(self, *, target: Any) -> Any:
        from ar_torchrl.backends.transformers.sender import TrainsideSender

        return TrainsideSender(target, mode="copy")


@register_sync_method(
    "share",
    engine="trainside",
    help="the rollout model is the trainer's module (names checked only)",
)
@dataclass
class ShareSyncOptions:
    """``share``: :class:`~ar_torchrl.backends.transformers.sender.TrainsideSender` (no options)."""

    def build(self, *, target: Any) -> Any:
        from ar_torchrl.backends.transformers.sender import TrainsideSender

        return TrainsideSender(target, mode="share")
