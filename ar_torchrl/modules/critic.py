"""``LMCritic``: a separate critic model, an HF causal LM's backbone with a value head on top.

The other way to have a critic (``critic=separate`` in the recipe): the policy is an actor only
(:class:`~ar_torchrl.modules.LMActorCritic` with ``critic=False``) and the values come from a second
model, by default the same architecture initialised from the same checkpoint, or any smaller model
with the same tokenizer (:func:`build_separate_critic`). Every production framework that trains a
critic does it this way (verl, OpenRLHF, NeMo-RL, ...); sharing the trunk can hurt early training
(Stiennon et al. 2020, App. G.1).

The critic writes the same keys with the same alignment as the shared head
(``state_value[t] = V(h[t - 1])``, the state before token ``t``; ``("next", "state_value")[t] =
V(h[t])``), over padded, packed or shared-prefix micro-batch crops, so :class:`~ar_torchrl.objectives.TokenGAE`,
:class:`~ar_torchrl.objectives.GRPOAdvantage`, :func:`~ar_torchrl.objectives.recompute_old_log_probs_and_values`
and :class:`~ar_torchrl.objectives.TokenPPOLoss` serve both. Its LM head is never used; it is never
sent to the rollout engine.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey
from torch import nn

from ar_torchrl.modules.actor_critic import (
    LMActorCritic,
    add_confidence,
    backbone_hidden_states,
    packed_hidden_states,
    packed_values,
    rename_keys,
    shared_prefix_of,
    shifted_values,
    tree_values,
)
from ar_torchrl.modules.packing import PACKED_KEY
from ar_torchrl.modules.shared_prefix import per_row, shared_hidden_states, tree_hidden_states
from ar_torchrl.modules.value_head import attach_value_head

__all__ = ["LMCritic", "build_separate_critic", "check_same_tokenizer"]


class LMCritic(TensorDictModuleBase):
    """Values of every token position from a separate causal LM with a value head.

    Reads ``tokens`` and ``attention_mask`` (``[B, L]``) and writes ``state_value`` ``[B, L, 1]``
    (``V(h[t-1])``, 0 at ``t = 0``) and ``("next", "state_value")`` ``[B, L, 1]`` (``V(h[t])``).
    Keys change with :meth:`set_keys` (setting ``value`` alone moves ``next_value`` to
    ``("next", *value)``), as on :class:`~ar_torchrl.modules.LMActorCritic`.

    Args:
        model: an HF causal LM carrying a ``value_head``
            (:func:`~ar_torchrl.modules.attach_value_head`); only its backbone (``get_decoder()``)
            and head run.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from ar_torchrl.models.tiny import build_tiny_qwen3
        >>> critic = LMCritic(attach_value_head(build_tiny_qwen3(99)))
        >>> td = TensorDict({"tokens": torch.randint(3, 99, (2, 6)),
        ...                  "attention_mask": torch.ones(2, 6, dtype=torch.bool)}, [2, 6])
        >>> out = critic(td)
        >>> out["state_value"].shape, out["next", "state_value"].shape, "log_prob" in out.keys()
        (torch.Size([2, 6, 1]), torch.Size([2, 6, 1]), False)
    """

    @dataclass
    class _AcceptedKeys:
        """Keys read (``tokens``, ``attention_mask``) and written (``value``, ``next_value``)."""

        tokens: NestedKey = "tokens"
        attention_mask: NestedKey = "attention_mask"
        value: NestedKey = "state_value"
        next_value: NestedKey = ("next", "state_value")
        rollout_log_prob: NestedKey = "rollout_log_prob"
        loss_mask: NestedKey = "loss_mask"

    default_keys = _AcceptedKeys
    #: the module computes values (``LMActorCritic.critic`` is the same flag on the shared module)
    critic = True

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        if not isinstance(getattr(model, "value_head", None), nn.Module):
            raise ValueError(
                f"LMCritic: {type(model).__name__} has no `value_head`; call "
                "ar_torchrl.modules.attach_value_head(model) first"
            )
        self.model = model
        self.tensor_keys = self._AcceptedKeys()
        self._refresh_keys()

    def set_keys(self, **keys: NestedKey) -> LMCritic:
        """Rename keys: ``tokens``, ``attention_mask``, ``value``, ``next_value``."""
        rename_keys(self, keys)
        return self

    def _refresh_keys(self) -> None:
        k = self.tensor_keys
        self.in_keys = [k.tokens, k.attention_mask]
        self.out_keys = [k.value, k.next_value]

    value_key = property(lambda self: self.tensor_keys.value)
    next_value_key = property(lambda self: self.tensor_keys.next_value)

    select_inputs = LMActorCritic.select_inputs  # in_keys and, when present, PACKED_/SHARED_KEY

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        k = self.tensor_keys
        tokens, attention_mask = tensordict.get(k.tokens), tensordict.get(k.attention_mask)
        if tokens.ndim != 2 or attention_mask.shape != tokens.shape:
            raise ValueError(
                f"LMCritic expects {k.tokens!r} and {k.attention_mask!r} of one shape [B, L]; got "
                f"{tuple(tokens.shape)} and {tuple(attention_mask.shape)}"
            )
        head, shared = self.model.value_head, shared_prefix_of(tensordict, self.model)
        packed = tensordict.get_non_tensor(PACKED_KEY, False)
        if packed and shared is not None:  # packed shared prefixes: the tree layout
            hidden, tree = tree_hidden_states(self.model, tokens, attention_mask, shared)
            value, next_value = tree_values(head, hidden, tree)
        elif packed:
            hidden, layout = packed_hidden_states(self.model, tokens, attention_mask)
            value, next_value = packed_values(head, hidden, layout, attention_mask)
        elif shared is not None:  # the shared prefix once per group (modules.shared_prefix)
            hidden = per_row(
                shared, *shared_hidden_states(self.model, tokens, attention_mask, shared)
            )
            value, next_value = shifted_values(head, hidden)
        else:
            hidden = backbone_hidden_states(self.model, tokens, attention_mask)
            value, next_value = shifted_values(head, hidden)
        value, next_value = add_confidence(self.model, tensordict, value, next_value, k, "LMCritic")
        tensordict.set(k.value, value)
        tensordict.set(k.next_value, next_value)
        return tensordict


def check_same_tokenizer(policy_tokenizer, critic_tokenizer, *, where: str) -> None:
    """Raise unless both tokenizers map every token to the same id (the critic reads the policy's
    token ids): ``where`` names the critic's source in the message."""
    mine, theirs = policy_tokenizer.get_vocab(), critic_tokenizer.get_vocab()
    if mine == theirs:
        return
    differ = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda kv: kv[1])[:3]
    raise ValueError(
        f"{where}: the critic's tokenizer differs from the policy's ({len(theirs)} vs "
        f"{len(mine)} tokens; first differences {differ}): a separate critic reads the policy's "
        "token ids, so it needs the same tokenizer"
    )


def build_separate_critic(policy: nn.Module, critic_model: nn.Module | None = None) -> LMCritic:
    """An :class:`LMCritic` with a fresh zero-initialised fp32 value head: over ``critic_model``,
    or, by default, over a copy of ``policy`` (the same architecture and weights; the policy's own
    value head, if any, is not copied).

    Example:
        >>> from ar_torchrl.models.tiny import build_tiny_qwen3
        >>> policy = build_tiny_qwen3(99)
        >>> critic = build_separate_critic(policy)
        >>> critic.model is policy, critic.model.value_head.weight.abs().sum().item()
        (False, 0.0)
    """
    if critic_model is None:
        critic_model = copy.deepcopy(policy)
        if isinstance(getattr(critic_model, "value_head", None), nn.Module):
            del critic_model.value_head  # the critic gets its own zero head below
    return LMCritic(attach_value_head(critic_model))
