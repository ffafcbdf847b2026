"""The registry of rollout engines (:data:`BACKENDS`): name -> factory + torch-free config schema.

An entry's factory is called as ``factory(options, context)`` with a :class:`BackendContext` (what a
training run gives an engine: the trainer's policy and tokenizer, where to put files, what closes
it) and returns a started :class:`~ar_torchrl.backends.GenerationBackend`; it never changes the
engine's weights (the run decides its first weights, once). Built-ins are registered by the engines'
torch-free config modules: ``trainside`` (:mod:`ar_torchrl.backends.transformers.config`) and
``sglang`` (:mod:`ar_torchrl.backends.sglang.config`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ar_torchrl.registry import Registry

__all__ = ["BACKENDS", "BackendContext", "register_backend"]

F = TypeVar("F", bound=Callable[..., Any])

BACKENDS = Registry(
    "rollout backend",
    builtins=("ar_torchrl.backends.transformers.config", "ar_torchrl.backends.sglang.config"),
)


@dataclass
class BackendContext:
    """What a run hands an engine's factory.

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


def register_backend(name: str, *, help: str) -> Callable[[type], type]:
    """Class decorator for an engine's config schema: registers ``schema.build(context)`` as the
    factory of engine ``name``; the schema says whether the engine starts on the trainer's own
    weights (``starts_with_trainer_weights(context)``, default ``True``)."""

    def decorator(schema: type) -> type:
        BACKENDS.register(name, config=schema, help=help)(
            lambda options, context: options.build(context)
        )
        return schema

    return decorator
