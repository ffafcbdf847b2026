"""FSDP2 for the actor-critic: fp32 master shards, bf16 compute, an fp32 value head.

:func:`shard_actor_critic` applies ``torch.distributed.fsdp.fully_shard`` to every decoder layer,
to the value head (its own unit, with an fp32 policy: the critic computes in fp32 whatever the
backbone does) and to the :class:`~ar_torchrl.modules.LMActorCritic` itself as the root (it owns
the embedding, the final norm and the tied LM head, which ``LMActorCritic.forward`` uses without
calling the HF model's own ``forward``). Parameters are stored as fp32 shards (the optimizer's master
weights and states); ``MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=float32)``
all-gathers them in the compute dtype and reduces gradients in fp32. Gradients are *summed* over
ranks (not averaged): each rank's loss is already divided by the global normaliser
(:class:`~ar_torchrl.distributed.ShardedPlan`), so N ranks produce the single-process gradient.

Activation checkpointing (:func:`checkpoint_decoder_layers`) recomputes each decoder layer in
backward; it wraps the layer's ``forward`` only, so FSDP's hooks stay outside the recomputation.

A single process with a bf16 (or fp16) compute dtype uses the same FSDP2 wrapping on a one-rank
process group (``init_distributed(process_group=True)``), not ``torch.autocast``: measured by
``benchmarks/bench_mixed_precision.py``, both move >= 99.9 % of the fp32 masters per lr-1e-6 AdamW
step (bf16 storage: ~2 %), but FSDP2's forward equals the bf16 model's forward bit for bit (what a
bf16 rollout engine computes from the pushed weights) and equals N ranks' numerics, while autocast
computes a third variant (fp32 norms and residuals). fp32 single-process runs stay unwrapped.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from ar_torchrl.distributed.context import DistContext
from ar_torchrl.modules import LMActorCritic
from ar_torchrl.modules.value_head import confidence_of

__all__ = ["checkpoint_decoder_layers", "decoder_layers", "reshard", "shard_actor_critic"]

ComputeDType = Literal["float32", "bfloat16", "float16"]


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of an HF causal LM (``model.get_decoder().layers``).

    Example:
        >>> from ar_torchrl.models.tiny import build_tiny_qwen3
        >>> len(decoder_layers(build_tiny_qwen3(99, num_layers=3)))
        3
    """
    layers = getattr(model.get_decoder(), "layers", None) if hasattr(model, "get_decoder") else None
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            f"decoder_layers: {type(model).__name__} has no `get_decoder().layers` ModuleList; "
            "pass an HF causal LM (e.g. Qwen3ForCausalLM, LlamaForCausalLM)"
        )
    return list(layers)


def checkpoint_decoder_layers(model: nn.Module) -> int:
    """Recompute each decoder layer's forward in backward (activation checkpointing); idempotent.

    Only the layer inputs are kept for backward. Works in eval mode too (unlike HF's
    ``gradient_checkpointing_enable``, which needs ``model.train()``); without grad the layer runs
    as is. Returns the number of layers wrapped.

    Example:
        >>> from ar_torchrl.models.tiny import build_tiny_qwen3
        >>> checkpoint_decoder_layers(build_tiny_qwen3(99))
        2
    """
    layers = decoder_layers(model)
    for layer in layers:
        if getattr(layer, "_ar_checkpointed", False):
            continue
        inner = layer.forward

        @functools.wraps(inner)
        def forward(*args, _inner=inner, **kwargs):
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        layer.forward = forward  # an instance attribute: FSDP's module hooks stay outside
        layer._ar_checkpointed = True
    return len(layers)


def _dtype(name: str) -> torch.dtype:
    if name not in ("float32", "bfloat16", "float16"):
        raise ValueError(
            f"shard_actor_critic: compute_dtype must be float32, bfloat16 or float16, got {name!r}"
        )
    return getattr(torch, name)


def shard_actor_critic(
    actor_critic: LMActorCritic,
    ctx: DistContext,
    *,
    compute_dtype: ComputeDType = "bfloat16",
    activation_checkpointing: bool = False,
    reshard_after_forward: bool = True,
) -> LMActorCritic:
    """Shard ``actor_critic`` with FSDP2 over ``ctx.mesh`` (in place; returns it).

    Build the optimizer right after this call, before any forward: its parameters must be the fp32
    DTensor shards (FSDP2 leaves the root's gathered parameters registered after a forward without
    backward until :func:`reshard`; :func:`~ar_torchrl.distributed.recompute_sharded_old_log_probs_and_values`
    reshards). Works on meta-device models too (then materialise with
    :func:`~ar_torchrl.distributed.load_pretrained_weights`).

    Args:
        actor_critic: the policy + value head; its floating parameters are cast to fp32 first.
        ctx: a :class:`DistContext` with a process group (``init_distributed(process_group=True)``
            at world size 1).
        compute_dtype: the dtype of the forward/backward (the all-gathered parameters).
            ``float32``: no mixed precision.
        activation_checkpointing: recompute decoder layers in backward.
        reshard_after_forward: free the gathered decoder layers after forward (re-gather in
            backward); ``False`` trades memory for less communication.

    Example:
        >>> from ar_torchrl.models.tiny import build_tiny_qwen3
        >>> from ar_torchrl.distributed import distributed
        >>> from ar_torchrl.modules import attach_value_head
        >>> with distributed("cpu", process_group=True) as ctx:
        ...     ac = shard_actor_critic(LMActorCritic(attach_value_head(build_tiny_qwen3(99))), ctx)
        ...     w = ac.model.lm_head.weight
        ...     type(w).__name__, w.dtype
        ('DTensor', torch.float32)
    """
    dtype = _dtype(compute_dtype)
    model = actor_critic.model.float()  # fp32 masters (exact from bf16; tied weights stay tied)
    if activation_checkpointing:
        checkpoint_decoder_layers(model)
    mesh = ctx.mesh
    param_dtype = None if dtype == torch.float32 else dtype
    policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    head = getattr(model, "value_head", None)
    if isinstance(head, nn.Module):  # its own unit: the critic computes in fp32
        fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        feats = confidence_of(model)
        if feats is not None:  # called apart from the head's forward (add_confidence): a unit
            fully_shard(feats, mesh=mesh, mp_policy=fp32)  # that gathers its own parameters
        fully_shard(head, mesh=mesh, mp_policy=fp32)
    fully_shard(actor_critic, mesh=mesh, mp_policy=policy)
    for module in actor_critic.modules():
        if isinstance(module, FSDPModule):
            # Sum, not average, over ranks; plain SUM collectives (gloo has no PREMUL_SUM).
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return actor_critic


def reshard(module: nn.Module) -> None:
    """Reshard every FSDP unit of ``module`` (the root keeps its gathered parameters after a
    forward without backward, e.g. the old-log-prob pass); a no-op on plain modules."""
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()
