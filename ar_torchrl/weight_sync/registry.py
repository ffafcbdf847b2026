"""The one registry of weight-sync methods: adding a method is one entry here (plus its module).

Each entry names a factory ``factory(target, **options) -> WeightSender`` and the engine it serves:
the trainside senders' target is the in-process rollout model, the SGLang senders' target is the
client (an ``SGLangBackend``). Backends build their sender from here by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

from ar_torchrl.weight_sync.base import WeightSender
from ar_torchrl.weight_sync.disk import DiskWeightSender
from ar_torchrl.weight_sync.distributed import DistributedWeightSender
from ar_torchrl.weight_sync.tensor import TensorWeightSender
from ar_torchrl.weight_sync.trainside import TrainsideSender

__all__ = ["SYNC_METHODS", "SyncMethod", "make_sender", "sync_methods"]

Engine = Literal["trainside", "sglang"]


@dataclass(frozen=True)
class SyncMethod:
    """A registered way to ship weights: its factory, the engine it serves, one line of help.

    Example:
        >>> SYNC_METHODS["disk"].engine
        'sglang'
    """

    factory: Callable[..., WeightSender]
    engine: Engine
    help: str


SYNC_METHODS: dict[str, SyncMethod] = {
    "copy": SyncMethod(
        partial(TrainsideSender, mode="copy"),
        "trainside",
        "copy into a private in-process rollout model",
    ),
    "share": SyncMethod(
        partial(TrainsideSender, mode="share"),
        "trainside",
        "the rollout model is the trainer's module (names checked only)",
    ),
    "disk": SyncMethod(
        DiskWeightSender,
        "sglang",
        "safetensors shards in a temp dir + /update_weights_from_disk (shared filesystem)",
    ),
    "tensor": SyncMethod(
        TensorWeightSender,
        "sglang",
        "buckets through shared memory + /update_weights_from_tensor (same machine)",
    ),
    "distributed": SyncMethod(
        DistributedWeightSender,
        "sglang",
        "broadcast over a gloo/nccl group + /update_weights_from_distributed",
    ),
}


def sync_methods(engine: Engine) -> list[str]:
    """Names of the methods that serve ``engine``.

    Example:
        >>> sync_methods("sglang")
        ['disk', 'tensor', 'distributed']
    """
    return [name for name, m in SYNC_METHODS.items() if m.engine == engine]


def make_sender(method: str, target: Any, *, engine: Engine, **options: Any) -> WeightSender:
    """Build the sender registered as ``method`` for ``engine``.

    Raises:
        ValueError: an unknown method, or one that serves another engine.

    Example:
        >>> type(make_sender("disk", None, engine="sglang", config_dir="/tmp")).__name__
        'DiskWeightSender'
        >>> make_sender("copy", None, engine="sglang")
        Traceback (most recent call last):
        ...
        ValueError: weight sync method 'copy' does not serve sglang; choose one of ['disk', 'tensor', 'distributed']
    """
    found = SYNC_METHODS.get(method)
    if found is None or found.engine != engine:
        what = "is unknown" if found is None else f"does not serve {engine}"
        raise ValueError(
            f"weight sync method {method!r} {what}; choose one of {sync_methods(engine)}"
        )
    return found.factory(target, **options)
