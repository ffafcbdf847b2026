"""Old import paths of modules that moved (kept for one release, 0.1.x; removed in 0.2).

``import ar_torchrl.checkpoint`` (and every other path in :data:`MOVED`) still works: a meta-path
finder, installed by ``ar_torchrl/__init__.py``, imports the module's new home, emits a
``DeprecationWarning`` naming it, and registers the same module object under the old name, so
``from ar_torchrl.checkpoint import save_checkpoint`` gives the very function of
``ar_torchrl.recipes.checkpoint``. This is the only place that knows the old layout.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

__all__ = ["MOVED", "install"]

#: old module path -> new module path (the 0.1 reorganisation, issue 15).
MOVED: dict[str, str] = {
    "ar_torchrl.assets": "ar_torchrl.models.tiny",
    "ar_torchrl.warmstart": "ar_torchrl.models.warmstart",
    "ar_torchrl.checks": "ar_torchrl.utils.checks",
    "ar_torchrl.checkpoint": "ar_torchrl.recipes.checkpoint",
    "ar_torchrl.reaper": "ar_torchrl.backends.sglang.reaper",
    "ar_torchrl.weight_sync.sglang_base": "ar_torchrl.backends.sglang.senders.base",
    "ar_torchrl.weight_sync.disk": "ar_torchrl.backends.sglang.senders.disk",
    "ar_torchrl.weight_sync.tensor": "ar_torchrl.backends.sglang.senders.tensor",
    "ar_torchrl.weight_sync.distributed": "ar_torchrl.backends.sglang.senders.distributed",
    "ar_torchrl.weight_sync.trainside": "ar_torchrl.backends.transformers.sender",
    "ar_torchrl.backends.kv_cache": "ar_torchrl.backends.transformers.kv_cache",
    "ar_torchrl.backends.token_sampling": "ar_torchrl.backends.transformers.token_sampling",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec):
        warnings.warn(
            f"{spec.name} moved to {self.new}; the old path is removed in ar_torchrl 0.2",
            DeprecationWarning,
            stacklevel=3,
        )
        return importlib.import_module(self.new)

    def exec_module(self, module) -> None:  # the new module is already executed
        pass


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
