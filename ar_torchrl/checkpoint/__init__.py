"""Training checkpoints: one ``torch.save`` file per step (:mod:`.local`, one process) or a sharded
``torch.distributed.checkpoint`` directory per step (:mod:`.sharded`, FSDP2 ranks).

Names are imported on first use: finding and verifying checkpoints needs no torch.
"""

from __future__ import annotations

from ar_torchrl._lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(
        [
            "capture_rng_state",
            "checkpoint_step",
            "latest_checkpoint",
            "load_checkpoint",
            "load_critic_weights",
            "remove_partial_checkpoints",
            "restore_rng_state",
            "save_checkpoint",
            "verify_checkpoint_file",
        ],
        "local",
    ),
    **dict.fromkeys(
        [
            "latest_distributed_checkpoint",
            "load_distributed_checkpoint",
            "load_distributed_critic",
            "save_distributed_checkpoint",
            "verify_checkpoint",
        ],
        "sharded",
    ),
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
