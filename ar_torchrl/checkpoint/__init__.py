"""Training checkpoints behind one interface, :class:`CheckpointStore` (:mod:`.store`): save, load,
load the critic, latest, verify. :func:`checkpoint_store` chooses :class:`LocalStore` (one process,
a ``torch.save`` file per step: :mod:`.local`) or :class:`ShardedStore` (FSDP2 ranks, a sharded
``torch.distributed.checkpoint`` directory per step: :mod:`.sharded`); :mod:`.naming` is the one
naming rule (``step_<N>.pt`` / ``step_<N>/``).

Checkpoints are atomic, checksummed (damage detected, a damaged newest one skipped) and never
unpickle code. Checksums detect damage, not tampering: an optional HMAC key (:class:`CheckpointSigner`,
the recipe's ``checkpoint.hmac_key_env``) makes loads refuse checkpoints not signed with it
(docs/checkpoints.md). The format-specific names of before the store (``save_checkpoint``,
``latest_distributed_checkpoint``, ...) still work for one release, with a ``DeprecationWarning``
naming the new one.

Names are imported on first use: finding and verifying ``.pt`` checkpoints needs no torch.
"""

from __future__ import annotations

from ar_torchrl._lazy import lazy_exports

_EXPORTS = {
    "CheckpointStore": "store",
    "LocalStore": "store",
    "ShardedStore": "store",
    "checkpoint_store": "store",
    "CheckpointSigner": "signing",
    "capture_rng_state": "local",
    "restore_rng_state": "local",
    **dict.fromkeys(
        [
            "checkpoint_name",
            "checkpoint_pattern",
            "checkpoint_step",
            "is_checkpoint_name",
            "list_checkpoints",
            "remove_partial_checkpoints",
        ],
        "naming",
    ),
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
