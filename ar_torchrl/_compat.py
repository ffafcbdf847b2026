"""Old import paths and names that moved (kept for one release, 0.1.x; removed in 0.2).

- Modules: ``import ar_torchrl.recipes.checkpoint`` (and every other path in :data:`MOVED`) still
  works: a meta-path finder, installed by ``ar_torchrl/__init__.py``, imports the module's new home,
  emits a ``DeprecationWarning`` naming it, and registers the same module object under the old name.
- Names: ``from ar_torchrl.data import plan_micro_batches`` (and every name in :data:`RENAMED`)
  still works: the package's lazy ``__getattr__`` (:mod:`ar_torchrl._lazy`) asks :func:`renamed`,
  which warns with the new name and returns the very object found there.

This is the only place that knows the old layout.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

__all__ = ["MOVED", "RENAMED", "install", "renamed"]

#: old module path -> new module path (the 0.1 reorganisation, issue 15).
MOVED: dict[str, str] = {
    "ar_torchrl.assets": "ar_torchrl.models.tiny",
    "ar_torchrl.warmstart": "ar_torchrl.models.warmstart",
    "ar_torchrl.checks": "ar_torchrl.utils.checks",
    "ar_torchrl.reaper": "ar_torchrl.backends.sglang.reaper",
    "ar_torchrl.weight_sync.sglang_base": "ar_torchrl.backends.sglang.senders.base",
    "ar_torchrl.weight_sync.disk": "ar_torchrl.backends.sglang.senders.disk",
    "ar_torchrl.weight_sync.tensor": "ar_torchrl.backends.sglang.senders.tensor",
    "ar_torchrl.weight_sync.distributed": "ar_torchrl.backends.sglang.senders.distributed",
    "ar_torchrl.weight_sync.trainside": "ar_torchrl.backends.transformers.sender",
    "ar_torchrl.backends.kv_cache": "ar_torchrl.backends.transformers.kv_cache",
    "ar_torchrl.backends.token_sampling": "ar_torchrl.backends.transformers.token_sampling",
    # the house layout (issue 28): training/, checkpoint/, the converter's collation in interop/
    "ar_torchrl.data.micro_batch": "ar_torchrl.training.micro_batch",
    "ar_torchrl.objectives.anchors": "ar_torchrl.training.old_log_probs",
    "ar_torchrl.data.collate": "ar_torchrl.interop.collate",
    "ar_torchrl.recipes.checkpoint": "ar_torchrl.checkpoint.local",
    "ar_torchrl.distributed.checkpoint": "ar_torchrl.checkpoint.sharded",
    # run management is the launch module (Run, run and runs read as three things)
    "ar_torchrl.recipes.run": "ar_torchrl.recipes.launch",
}

#: the checkpoint functions of before the store -> ``<format module>.<store verb>``
_CKPT = {
    "save_checkpoint": "local.save",
    "load_checkpoint": "local.load",
    "latest_checkpoint": "local.latest",
    "verify_checkpoint_file": "local.verify",
    "load_critic_weights": "local.load_critic",
    "save_distributed_checkpoint": "sharded.save",
    "load_distributed_checkpoint": "sharded.load",
    "latest_distributed_checkpoint": "sharded.latest",
    "verify_checkpoint": "sharded.verify",
    "load_distributed_critic": "sharded.load_critic",
}

#: old public name (``package.name``) -> its new home (``module.name``), same object.
RENAMED: dict[str, str] = {
    **{
        f"ar_torchrl.data.{name}": f"ar_torchrl.training.{name}"
        for name in ("MicroBatch", "MicroBatchPlan", "Plan", "plan_micro_batches")
    },
    "ar_torchrl.data.completions_to_trajectory": "ar_torchrl.interop.completions_to_trajectory",
    "ar_torchrl.objectives.recompute_anchors": (
        "ar_torchrl.training.recompute_old_log_probs_and_values"
    ),
    "ar_torchrl.distributed.recompute_sharded_anchors": (
        "ar_torchrl.distributed.recompute_sharded_old_log_probs_and_values"
    ),
    # every policy loss in one module, k3_kl beside kl_penalty (the package-level names are unchanged)
    **{
        f"ar_torchrl.functional.losses.{name}": f"ar_torchrl.functional.policy_losses.{name}"
        for name in ("LOG_RATIO_CLAMP", "clipped_surrogate", "masked_log_ratio", "pessimistic_clip")
    },
    "ar_torchrl.functional.losses.k3_kl": "ar_torchrl.functional.kl.k3_kl",
    # one checkpoint store (issue 28): each format module's functions under the store's verbs,
    # at the package, in their module, and (the sharded ones) where they lived before
    **{
        f"ar_torchrl.checkpoint.{old}": f"ar_torchrl.checkpoint.{new}" for old, new in _CKPT.items()
    },
    **{
        f"ar_torchrl.checkpoint.{new.split('.')[0]}.{old}": f"ar_torchrl.checkpoint.{new}"
        for old, new in _CKPT.items()
    },
    **{
        f"ar_torchrl.distributed.{old}": f"ar_torchrl.checkpoint.{new}"
        for old, new in _CKPT.items()
        if new.startswith("sharded.")
    },
    **{
        f"ar_torchrl.checkpoint.local.{name}": f"ar_torchrl.checkpoint.naming.{name}"
        for name in ("checkpoint_step", "remove_partial_checkpoints")
    },
}


def renamed(package: str, name: str) -> object:
    """The object an old public name ``package.name`` now is, with a ``DeprecationWarning`` naming
    its new home; ``AttributeError`` when ``name`` was never a public name of ``package``.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     fn = renamed("ar_torchrl.objectives", "recompute_anchors")
        >>> fn.__name__, str(caught[0].message).split(";")[0]
        ('recompute_old_log_probs_and_values', 'ar_torchrl.objectives.recompute_anchors is now ar_torchrl.training.recompute_old_log_probs_and_values')
    """
    new = RENAMED.get(f"{package}.{name}")
    if new is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    module, _, attr = new.rpartition(".")
    warnings.warn(
        f"{package}.{name} is now {new}; the old name is removed in ar_torchrl 0.2",
        DeprecationWarning,
        stacklevel=3,
    )
    return getattr(importlib.import_module(module), attr)


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
