"""The registry of rollout engines (:data:`BACKENDS`): name -> torch-free config schema.

An engine is registered by decorating its options' dataclass, a :class:`BackendConfig` (the one
shape of :mod:`ar_torchrl.registry`); its ``build(context)`` gets a :class:`BackendContext` (what a
training run gives an engine: the trainer's policy and tokenizer, where to put files, what closes
it) and returns a started :class:`~ar_torchrl.backends.GenerationBackend`; it never changes the
engine's weights (the run decides its first weights, once). The registered names are also the
``engine`` of the weight-sync methods (:mod:`ar_torchrl.weight_sync.registry`). Built-ins are
registered by the engines' torch-free config modules: ``trainside``
(:mod:`ar_torchrl.backends.transformers.config`), ``sglang``
(:mod:`ar_torchrl.backends.sglang.config`) and ``torchrl``, TorchRL's LLM wrappers
(:mod:`ar_torchrl.backends.torchrl.config`). A new engine is at most three files: its
``GenerationBackend``, its config module (this schema and its senders' schemas) and its sender.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ar_torchrl.registry import Registry

__all__ = ["BACKENDS", "BackendConfig", "BackendContext", "register_backend"]


@dataclass
class BackendContext:
    """What a run hands an engine's ``build``.

    Attributes:
        model: the trainer's policy (the trainside copy's source; its ``config.vocab_size``).
        tokenizer: the policy's tokenizer (saved beside a launched server's weights).
        run_dir: the run directory (a launched server's log and start weights go there).
        stack: closes the engine (and stops a launched server) when the run ends, also on errors.
        device, dtype, seed: the trainer's device, compute dtype name and seed.
        start_dir: the HF directory of the starting policy when ``model`` holds no full weights in
            this process (FSDP2 built on the meta device), else ``None``.
    """

    model: Any
    tokenizer: Any
    run_dir: Path
    stack: contextlib.ExitStack
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    start_dir: Path | None = None


class BackendConfig:
    """What the recipe asks every engine's schema (a dataclass subclassing this) besides its options
    and ``build(context)``: the defaults hold for an engine that starts on the trainer's weights and
    keeps its memory during the update.

    Example:
        >>> @dataclass
        ... class Mine(BackendConfig):
        ...     def build(self, context): ...
        >>> Mine().starts_with_trainer_weights(), Mine().releases_memory_during_update()
        (True, False)
    """

    def check(self, prefix: str) -> None:
        """Range checks of the options (``prefix`` names the keys: ``"config: backend."``)."""

    def starts_with_trainer_weights(self) -> bool:
        """The engine is built on the trainer's starting policy (else the run pushes it once)."""
        return True

    def releases_memory_during_update(self) -> bool:
        """The engine releases its (GPU) memory before each update and resumes it after
        (:meth:`~ar_torchrl.backends.GenerationBackend.release_memory`; sync mode only)."""
        return False


BACKENDS = Registry(
    "rollout backend",
    builtins=(
        "ar_torchrl.backends.transformers.config",
        "ar_torchrl.backends.sglang.config",
        "ar_torchrl.backends.torchrl.config",
    ),
    decorator="register_backend",
    build="build(self, context: BackendContext) -> GenerationBackend",
    base=BackendConfig,
)


#: ``@register_backend(name, help=...)`` on the engine's :class:`BackendConfig` dataclass
#: (:meth:`ar_torchrl.registry.Registry.register` of :data:`BACKENDS`).
register_backend = BACKENDS.register
