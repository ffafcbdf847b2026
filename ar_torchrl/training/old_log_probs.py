"""Anchors: old log-probs and old values from the trainer's own model, over a micro-batch plan."""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey
from torchrl.objectives import LossModule

from ar_torchrl.modules import LMActorCritic, LMCritic
from ar_torchrl.training.micro_batch import MicroBatchPlan

__all__ = ["recompute_old_log_probs_and_values"]


@torch.no_grad()
def recompute_old_log_probs_and_values(
    actor_critic: LMActorCritic,
    td: TensorDictBase,
    plan: MicroBatchPlan,
    *,
    ref_actor: LMActorCritic | None = None,
    loss: LossModule | None = None,
    critic: LMCritic | None = None,
) -> TensorDictBase:
    """Fill the old log-probs and values of ``td`` in place (no grad), one forward per micro-batch of ``plan``.

    Writes the old log-probs ``sample_log_prob`` ``[B, L]``, and when ``actor_critic`` has a critic
    (or a separate ``critic`` is given) the old values ``state_value`` ``[B, L, 1]`` and
    ``("next", "state_value")`` ``[B, L, 1]`` (bootstrap values), from the same crops; with ``ref_actor`` (an actor, ``critic=False`` is enough) the reference
    policy's ``ref_log_prob`` ``[B, L]``. Each micro-batch is cropped exactly as ``plan.split`` crops
    it for training, so at unchanged weights the training forward reproduces these numbers bit for
    bit (ratio exactly 1). Positions outside every crop (padding) get 0.

    Keys: the modules' own. Values go to the critic's (``actor_critic``'s or ``critic``'s)
    ``value``/``next_value`` keys; the
    old log-probs to ``loss.tensor_keys.sample_log_prob`` / ``ref_log_prob`` when ``loss`` (the
    :class:`~ar_torchrl.objectives.TokenPPOLoss` that will read them) is given, else to TorchRL's
    default names ``"sample_log_prob"`` and ``"ref_log_prob"``. With ``loss``, the values go to its
    ``value`` key and ``("next", *value)`` (where the loss and its :class:`TokenGAE` read them), and
    a loss built with a separate ``critic_network`` is the default ``critic``.

    Example:
        >>> from tensordict import TensorDict
        >>> from ar_torchrl.models.tiny import build_tiny_qwen3
        >>> from ar_torchrl.training import plan_micro_batches
        >>> from ar_torchrl.modules import attach_value_head
        >>> ac = LMActorCritic(attach_value_head(build_tiny_qwen3(99)))
        >>> td = TensorDict({"tokens": torch.randint(3, 99, (3, 5)),
        ...                  "attention_mask": torch.ones(3, 5, dtype=torch.bool)}, [3, 5])
        >>> _ = recompute_old_log_probs_and_values(ac, td, plan_micro_batches(td, token_budget=10))
        >>> td["sample_log_prob"].shape, td["state_value"].shape
        (torch.Size([3, 5]), torch.Size([3, 5, 1]))
    """
    if critic is None and getattr(loss, "separate_critic", False):
        critic = loss.critic_network  # the loss's own separate critic
    outputs = _output_keys(actor_critic, ref_actor, loss, critic)
    full: dict[NestedKey, torch.Tensor | None] = {key: None for key in outputs}
    for mb, sub in zip(plan.micro_batches, plan.split(td)):
        results = {id(actor_critic): actor_critic(actor_critic.select_inputs(sub))}
        for module in (ref_actor, critic):
            if module is not None:
                results[id(module)] = module(module.select_inputs(sub))
        for key, (module, out_key) in outputs.items():
            values = results[id(module)].get(out_key)
            if full[key] is None:
                full[key] = values.new_zeros((*plan.batch_size, *values.shape[2:]))
            plan.scatter(full[key], mb, values)
    for key, values in full.items():
        td.set(key, values)
    return td


def _output_keys(
    actor_critic: LMActorCritic,
    ref_actor: LMActorCritic | None,
    loss: LossModule | None,
    critic: LMCritic | None = None,
) -> dict[NestedKey, tuple[LMActorCritic | LMCritic, NestedKey]]:
    """Destination key -> (module, the module's output key)."""
    if critic is not None and actor_critic.critic:
        raise ValueError(
            "recompute_old_log_probs_and_values: a separate critic was given but actor_critic computes values too "
            "(its value head); pass the actor as LMActorCritic(model, critic=False)"
        )
    k = actor_critic.tensor_keys
    values = critic if critic is not None else actor_critic if actor_critic.critic else None
    lp_key, ref_key = "sample_log_prob", "ref_log_prob"
    value_key = next_key = None
    if values is not None:
        value_key, next_key = values.tensor_keys.value, values.tensor_keys.next_value
    if loss is not None:
        lk = loss.tensor_keys
        lp_key, ref_key = lk.sample_log_prob, getattr(lk, "ref_log_prob", ref_key)
        value_key = lk.value
        next_key = ("next", *((value_key,) if isinstance(value_key, str) else value_key))
    outputs = {lp_key: (actor_critic, k.log_prob)}
    if values is not None:
        outputs[value_key] = (values, values.tensor_keys.value)
        outputs[next_key] = (values, values.tensor_keys.next_value)
    if ref_actor is not None:
        outputs[ref_key] = (ref_actor, ref_actor.tensor_keys.log_prob)
    return outputs
