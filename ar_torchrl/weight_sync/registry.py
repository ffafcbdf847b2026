"""The one registry of weight-sync methods (:data:`SYNC_METHODS`): name -> sender schema.

A method is registered by decorating its options' dataclass (the one shape of
:mod:`ar_torchrl.registry`)::

    @register_sync_method("disk", engine="sglang", help="safetensors shards + /update_weights_from_disk")
    @dataclass
    class DiskSyncOptions:
        bucket_bytes: Optional[int] = None  # a field left None: the sender's own default
        def build(self, *, target) -> WeightSender: ...

An entry serves one rollout engine (``engine``: a name of
:data:`~ar_torchrl.backends.registry.BACKENDS`, the engines' registry; this protocol package imports
no engine, a test checks the names), says in one line what it does (``help``) and its
fields are the keyword arguments of the sender, with their range checks. ``build(target=...)``
returns the :class:`~ar_torchrl.weight_sync.WeightSender`: the trainside senders' target is the
in-process rollout model, the SGLang senders' target is the client (an ``SGLangBackend``). Backends
build their sender from here by name; a recipe validates ``backend.weight_sync_options`` against the
same schema before it imports torch. The built-in methods are registered beside their engines'
schemas, in :mod:`ar_torchrl.backends.transformers.config`, :mod:`ar_torchrl.backends.sglang.config`
and :mod:`ar_torchrl.backends.torchrl.config`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ar_torchrl.registry import Registry, closest

__all__ = ["SYNC_METHODS", "make_sender", "register_sync_method", "sender_options", "sync_methods"]

SYNC_METHODS = Registry(
    "weight sync method",
    builtins=(
        "ar_torchrl.backends.transformers.config",
        "ar_torchrl.backends.sglang.config",
        "ar_torchrl.backends.torchrl.config",
    ),
    decorator="register_sync_method",
    build="build(self, *, target) -> WeightSender",
    required=("engine",),
)

#: ``@register_sync_method(name, engine=..., help=...)`` on the sender's options dataclass
#: (:meth:`ar_torchrl.registry.Registry.register` of :data:`SYNC_METHODS`).
register_sync_method = SYNC_METHODS.register


def sync_methods(engine: str) -> list[str]:
    """Names of the methods that serve ``engine`` (a name of the backend registry).

    Example:
        >>> sync_methods("sglang")
        ['disk', 'tensor', 'distributed']
        >>> sync_methods("sglangg")
        Traceback (most recent call last):
        ...
        ValueError: no weight sync method serves the rollout engine 'sglangg' (did you mean 'sglang'?); engines with sync methods: ['sglang', 'torchrl', 'trainside']
    """
    found = [e.name for e in SYNC_METHODS.entries() if e.engine == engine]
    if not found:
        engines = sorted({e.engine for e in SYNC_METHODS.entries()})
        raise ValueError(
            f"no weight sync method serves the rollout engine {engine!r}"
            f"{closest(str(engine), engines)}; engines with sync methods: {engines}"
        )
    return found


def _entry(method: str, engine: str):
    if method not in SYNC_METHODS or SYNC_METHODS[method].engine != engine:
        what = "is unknown" if method not in SYNC_METHODS else f"does not serve {engine}"
        raise ValueError(
            f"weight sync method {method!r} {what}; choose one of {sync_methods(engine)}"
        )
    return SYNC_METHODS[method]


def sender_options(method: str, options: Any = None, *, engine: str, prefix: str = "") -> Any:
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


def make_sender(method: str, target: Any, *, engine: str, **options: Any) -> Any:
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
