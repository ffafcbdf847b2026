"""Anchors: old log-probs and old values from the trainer's own model, over a micro-batch plan."""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey

from ar_torchrl.data.micro_batch import MicroBatchPlan
from ar_torchrl.modules import LMActorCritic

__all__ = ["recompute_anchors"]


@torch.no_grad()
def recompute_anchors(
    actor_critic: LMActorCritic,
    td: TensorDictBase,
    plan: MicroBatchPlan,
    *,
    ref_actor: LMActorCritic | None = None,
    log_prob_key: NestedKey = "sample_log_prob",
    value_key: NestedKey = "state_value",
    next_value_key: NestedKey = ("next", "state_value"),
    ref_log_prob_key: NestedKey = "ref_log_prob",
) -> TensorDictBase:
    """Fill the PPO anchors of ``td`` in place (no grad), one forward per micro-batch of ``plan``.

    Writes ``sample_log_prob`` ``[B, L]``, ``state_value`` ``[B, L, 1]`` and
    ``("next", "state_value")`` ``[B, L, 1]`` (bootstrap values), and with ``ref_actor`` the
    reference policy's ``ref_log_prob`` ``[B, L]``. Each micro-batch is cropped exactly as
    ``plan.split`` crops it for training, so at unchanged weights the training forward reproduces
    these numbers bit for bit (ratio exactly 1). Positions outside every crop (padding) get 0.

    Example:
        >>> from tensordict import TensorDict
        >>> from ar_torchrl.assets import build_tiny_qwen3
        >>> from ar_torchrl.data import plan_micro_batches
        >>> from ar_torchrl.modules import attach_value_head
        >>> ac = LMActorCritic(attach_value_head(build_tiny_qwen3(99)))
        >>> td = TensorDict({"tokens": torch.randint(3, 99, (3, 5)),
        ...                  "attention_mask": torch.ones(3, 5, dtype=torch.bool)}, [3, 5])
        >>> _ = recompute_anchors(ac, td, plan_micro_batches(td, token_budget=10))
        >>> td["sample_log_prob"].shape, td["state_value"].shape
        (torch.Size([3, 5]), torch.Size([3, 5, 1]))
    """
    outputs: dict[NestedKey, tuple[LMActorCritic, NestedKey]] = {
        log_prob_key: (actor_critic, actor_critic.log_prob_key),
        value_key: (actor_critic, actor_critic.value_key),
        next_value_key: (actor_critic, actor_critic.next_value_key),
    }
    if ref_actor is not None:
        outputs[ref_log_prob_key] = (ref_actor, ref_actor.log_prob_key)
    full = {key: None for key in outputs}
    for mb, sub in zip(plan.micro_batches, plan.split(td)):
        results = {id(actor_critic): actor_critic(sub.select(*actor_critic.in_keys))}
        if ref_actor is not None:
            results[id(ref_actor)] = ref_actor(sub.select(*ref_actor.in_keys))
        for key, (module, out_key) in outputs.items():
            values = results[id(module)].get(out_key)
            if full[key] is None:
                full[key] = values.new_zeros((*plan.batch_size, *values.shape[2:]))
            plan.scatter(full[key], mb, values)
    for key, values in full.items():
        td.set(key, values)
    return td
