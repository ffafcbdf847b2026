"""Data-parallel training with FSDP2 under ``torchrun`` (docs/design.md section 7).

One controller: rank 0 owns the collector; the batch reaches every rank
(:func:`broadcast_batch`); every rank trains on its token-balanced share of the micro-batch plan
(:func:`shard_plan`, :class:`ShardedPlan`) with fp32 master shards and bf16 compute
(:func:`shard_actor_critic`); the weight push gathers full tensors one at a time
(:func:`push_weights`); large models load shard by shard (:func:`build_meta_model`,
:func:`load_pretrained_weights`); checkpoints use ``torch.distributed.checkpoint``
(:mod:`ar_torchrl.checkpoint.sharded`); the end of a run writes the trained policy (and a
separate critic) as HF directories from rank 0 (:func:`export_trained`).

Names are imported on first use, so ``ar_torchrl.training`` (which only needs
:class:`ShardedPlan`) does not pay for FSDP, DCP and transformers imports.
"""

from __future__ import annotations

import importlib

from ar_torchrl import _compat

_EXPORTS = {
    "broadcast_batch": "batch",
    "recompute_sharded_old_log_probs_and_values": "batch",
    "DistContext": "context",
    "close_distributed": "context",
    "distributed": "context",
    "init_distributed": "context",
    "export_trained": "export",
    "gather_full_state": "export",
    "checkpoint_decoder_layers": "fsdp",
    "decoder_layers": "fsdp",
    "reshard": "fsdp",
    "shard_actor_critic": "fsdp",
    "build_meta_model": "loading",
    "load_pretrained_weights": "loading",
    "parameters_on_meta": "loading",
    "ShardedPlan": "plan",
    "shard_plan": "plan",
    "FullTensorStream": "weights",
    "push_weights": "weights",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:  # an old name kept for one release, or AttributeError
        return _compat.renamed(__name__, name)
    return getattr(importlib.import_module(f"ar_torchrl.distributed.{_EXPORTS[name]}"), name)


def __dir__() -> list[str]:
    return __all__
