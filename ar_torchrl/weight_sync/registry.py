"""The one registry of weight-sync methods (:data:`SYNC_METHODS`): name -> sender factory + options.

An entry serves one engine (``meta["engine"]``: ``"trainside"`` or ``"sglang"``), says in one line
what it does (``meta["help"]``) and carries the torch-free schema of its options (the keyword
arguments of the sender, with their range checks). The factory is called as
``factory(options, target=...)``: the trainside senders' target is the in-process rollout model, the
SGLang senders' target is the client (an ``SGLangBackend``). Backends build their sender from here by
name; a recipe validates ``backend.weight_sync_options`` against the same schema before it imports
torch. The built-in methods are registered by their engines' torch-free config modules,
:mod:`ar_torchrl.backends.transformers.config` and :mod:`ar_torchrl.backends.sglang.config`.

Adding a method is one registration (``@register_sync_method``) beside its sender.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from ar_torchrl.registry import Registry

__all__ = ["SYNC_METHODS", "make_sender", "register_sync_method", "sender_options", "sync_methods"]

Engine = Literal["trainside", "sglang"]
F = TypeVar("F", bound=Callable[..., Any])

SYNC_METHODS = Registry(
    "weight sync method",
    builtins=("ar_torchrl.backends.transformers.config", "ar_torchrl.backends.sglang.config"),
)


def register_sync_method(
    name: str, *, engine: Engine, help: str, config: type | None = None
) -> Callable[[F], F]:
    """Decorator: register ``factory(options, *, target) -> WeightSender`` as method ``name``.

    ``config`` is the dataclass of its options (``None``: it takes none); a field left ``None``
    means "the sender's own default".
    """
    return SYNC_METHODS.register(name, config=config, engine=engine, help=help)


def sync_methods(engine: Engine) -> list[str]:
    """Names of the methods that serve ``engine``.

    Example:
        >>> sync_methods("sglang")
        ['disk', 'tensor', 'distributed']
    """
    return [e.name for e in SYNC_METHODS.entries() if e.engine == engine]


def _entry(method: str, engine: Engine):
    if method not in SYNC_METHODS or SYNC_METHODS[method].engine != engine:
        what = "is unknown" if method not in SYNC_METHODS else f"does not serve {engine}"
        raise ValueError(
            f"weight sync method {method!r} {what}; choose one of {sync_methods(engine)}"
        )
    return SYNC_METHODS[method]


def sender_options(method: str, options: Any = None, *, engine: Engine, prefix: str = "") -> Any:
    """The checked options of ``method`` (its schema filled from a mapping), without torch.

    Example:
        >>> sender_options("disk", {"bucket_bytes": 0}, engine="sglang", prefix="config: o.")
        Traceback (most recent call last):
        ...
        ValueError: config: o.bucket_bytes must be >= 1, got 0
    """
    _entry(method, engine)
    return SYNC_METHODS.options(method, options, prefix=prefix)


def set_options(options: Any) -> dict[str, Any]:
    """The keyword arguments a schema instance sets (``None`` fields: the sender's default)."""
    if options is None:
        return {}
    return {k: v for k, v in dataclasses.asdict(options).items() if v is not None}


def make_sender(method: str, target: Any, *, engine: Engine, **options: Any) -> Any:
    """Build the sender registered as ``method`` for ``engine``.

    Raises:
        ValueError: an unknown method, one that serves another engine, or a bad option.

    Example:
        >>> type(make_sender("disk", None, engine="sglang", config_dir="/tmp")).__name__
        'DiskWeightSender'
        >>> make_sender("copy", None, engine="sglang")
        Traceback (most recent call last):
        ...
        ValueError: weight sync method 'copy' does not serve sglang; choose one of ['disk', 'tensor', 'distributed']
    """
    _entry(method, engine)
    return SYNC_METHODS.build(method, options, target=target)
