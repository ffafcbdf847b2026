"""``LMActorCritic``: one backbone forward -> per-token log-probs of ``"tokens"`` and ``state_value``.

Alignment (docs/design.md section 1): ``log_prob[t] = log pi(tokens[t] | tokens[<t])`` from the logits at
``t - 1``, and ``state_value[t] = V(h[t - 1])`` (the state before token ``t``); position 0 gets 0 for
both. Position ids are ``cumsum(attention_mask) - 1`` so left padding never shifts positions.

The ``[B, L, V]`` float32 logits are never materialised for the whole batch: the LM head and
log-softmax run over chunks sized by a memory budget (:mod:`ar_torchrl.modules.log_probs`).

A micro-batch crop carrying ``PACKED_KEY = True`` (set by a packing
:class:`~ar_torchrl.data.MicroBatchPlan`) runs padding-free: its rows' real tokens share backbone
sequences (:mod:`ar_torchrl.modules.packing`) and the outputs come back in the crop's ``[b, w]``
layout, 0 on padding and on each row's first real token. A crop carrying ``SHARED_KEY`` (a
shared-prefix plan) computes the prefix its rows share once per group
(:mod:`ar_torchrl.modules.shared_prefix`), with the outputs of the padded forward.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey
from torch import Tensor, nn

from ar_torchrl.modules.log_probs import (
    LOGITS_MEMORY_BUDGET,
    _chunked_log_probs,
    _vocab_size,
    chunk_tokens_for_budget,
    token_log_probs,
)
from ar_torchrl.modules.packing import PACKED_KEY, PackedLayout, is_varlen, packed_layout
from ar_torchrl.modules.shared_prefix import (
    SHARED_KEY,
    SharedPrefix,
    TreeLayout,
    per_row,
    shared_hidden_states,
    tree_hidden_states,
    why_not_shared,
    why_not_tree,
)
from ar_torchrl.modules.value_head import confidence_of
from ar_torchrl.utils.checks import check_actor_args, check_bool

__all__ = ["LMActorCritic", "token_log_probs"]


class LMActorCritic(TensorDictModuleBase):
    """Actor-critic over an HF causal LM with an attached value head (one backbone forward).

    Reads ``tokens`` and ``attention_mask`` (``[B, L]``) and writes ``log_prob`` ``[B, L]``,
    ``state_value`` ``[B, L, 1]`` (``V(h[t-1])``), ``("next", "state_value")`` ``[B, L, 1]``
    (``V(h[t])``, the value after token ``t``: the bootstrap for truncated responses) and, with
    ``return_entropy``, ``entropy`` ``[B, L]``. With ``critic=False`` (an actor only, e.g. the frozen
    reference policy of the KL term) no value head is needed and no value key is written.

    Keys are TorchRL-style: declared once in :class:`_AcceptedKeys` and changed with
    :meth:`set_keys`; :func:`~ar_torchrl.objectives.recompute_old_log_probs_and_values` and
    :class:`~ar_torchrl.objectives.TokenPPOLoss` read them from the module.

    Args:
        model: an HF causal LM (``get_decoder()`` and ``get_output_embeddings()``) carrying a
            ``value_head`` when ``critic`` (see :func:`~ar_torchrl.modules.attach_value_head`). Only
            models whose logits are ``lm_head(last_hidden_state)`` are supported (no final-logit
            soft-capping).
        return_entropy: also compute per-token entropies.
        temperature: logits are divided by it (use the rollout sampling temperature), ``> 0``.
        logits_chunk_tokens: token positions per LM-head / log-softmax chunk, ``>= 1`` (default:
            sized by ``logits_memory_budget``, see :func:`~ar_torchrl.modules.chunk_tokens_for_budget`).
        critic: compute ``state_value`` with ``model.value_head`` (``False``: an actor only).
        logits_memory_budget: bytes the float32 ``[chunk, V]`` buffers of one chunk may take.

    Example:
        >>> from tensordict import TensorDict
        >>> from ar_torchrl.models.tiny import build_tiny_qwen3
        >>> from ar_torchrl.modules import attach_value_head
        >>> ac = LMActorCritic(attach_value_head(build_tiny_qwen3(99)))
        >>> td = TensorDict({"tokens": torch.randint(3, 99, (2, 6)),
        ...                  "attention_mask": torch.ones(2, 6, dtype=torch.bool)}, [2, 6])
        >>> out = ac(td)
        >>> out["log_prob"].shape, out["state_value"].shape, out["state_value"].abs().sum().item()
        (torch.Size([2, 6]), torch.Size([2, 6, 1]), 0.0)
        >>> ref = LMActorCritic(build_tiny_qwen3(99), critic=False)  # no value head needed
        >>> ref.set_keys(log_prob=("ref", "log_prob")).out_keys
        [('ref', 'log_prob')]
    """

    @dataclass
    class _AcceptedKeys:
        """Keys read (``tokens``, ``attention_mask``) and written; ``next_value`` follows ``value``
        (``("next", *value)``, where TorchRL's value estimators look) unless set explicitly."""

        tokens: NestedKey = "tokens"
        attention_mask: NestedKey = "attention_mask"
        log_prob: NestedKey = "log_prob"
        value: NestedKey = "state_value"
        next_value: NestedKey = ("next", "state_value")
        entropy: NestedKey = "entropy"
        rollout_log_prob: NestedKey = "rollout_log_prob"
        loss_mask: NestedKey = "loss_mask"

    default_keys = _AcceptedKeys

    def __init__(
        self,
        model: nn.Module,
        *,
        return_entropy: bool = False,
        temperature: float = 1.0,
        logits_chunk_tokens: int | None = None,
        critic: bool = True,
        logits_memory_budget: int = LOGITS_MEMORY_BUDGET,
    ) -> None:
        super().__init__()
        args = check_actor_args(
            "LMActorCritic",
            temperature=temperature,
            return_entropy=return_entropy,
            logits_chunk_tokens=logits_chunk_tokens,
            critic=critic,
            logits_memory_budget=logits_memory_budget,
        )
        if critic and not isinstance(getattr(model, "value_head", None), nn.Module):
            raise ValueError(
                f"LMActorCritic: {type(model).__name__} has no `value_head`; call "
                "ar_torchrl.modules.attach_value_head(model) first, or pass critic=False for an "
                "actor without values (e.g. the reference policy)"
            )
        self.model = model
        self.temperature = args["temperature"]
        self.logits_chunk_tokens = args["logits_chunk_tokens"]
        self.critic = args["critic"]
        self.logits_memory_budget = args["logits_memory_budget"]
        self.tensor_keys = self._AcceptedKeys()
        self.return_entropy = args["return_entropy"]  # also sets in_keys / out_keys

    @property
    def return_entropy(self) -> bool:
        """Whether :meth:`forward` also writes per-token entropies (the ``entropy`` key).

        Setting it updates :attr:`out_keys`; a loss that needs entropies (``TokenPPOLoss`` with
        ``entropy_coeff > 0``) turns it on.

        Example:
            >>> from ar_torchrl.models.tiny import build_tiny_qwen3
            >>> actor = LMActorCritic(build_tiny_qwen3(99), critic=False)
            >>> actor.return_entropy = True
            >>> actor.out_keys
            ['log_prob', 'entropy']
        """
        return self._return_entropy

    @return_entropy.setter
    def return_entropy(self, value: bool) -> None:
        self._return_entropy = check_bool("LMActorCritic", "return_entropy", value)
        self._refresh_keys()

    def set_keys(self, **keys: NestedKey) -> LMActorCritic:
        """Rename keys: ``tokens``, ``attention_mask``, ``log_prob``, ``value``, ``next_value``, ``entropy``.

        Setting ``value`` alone also moves ``next_value`` to ``("next", *value)``.
        """
        rename_keys(self, keys)
        return self

    def _refresh_keys(self) -> None:
        k = self.tensor_keys
        self.in_keys = [k.tokens, k.attention_mask]
        self.out_keys = [k.log_prob] + ([k.value, k.next_value] if self.critic else [])
        if self.return_entropy:
            self.out_keys.append(k.entropy)

    # ``<name>_key`` read-only views of :attr:`tensor_keys` (the names used before ``_AcceptedKeys``).
    tokens_key = property(lambda self: self.tensor_keys.tokens)
    attention_mask_key = property(lambda self: self.tensor_keys.attention_mask)
    log_prob_key = property(lambda self: self.tensor_keys.log_prob)
    value_key = property(lambda self: self.tensor_keys.value)
    next_value_key = property(lambda self: self.tensor_keys.next_value)
    entropy_key = property(lambda self: self.tensor_keys.entropy)

    def select_inputs(self, tensordict: TensorDictBase) -> TensorDictBase:
        """The entries :meth:`forward` reads: ``in_keys`` and, when present, ``PACKED_KEY`` and
        ``SHARED_KEY``.

        Callers that hand the module a selection (``recompute_old_log_probs_and_values``,
        ``TokenPPOLoss``) use it so a packed (shared-prefix) micro-batch crop stays packed (shared).
        """
        keys = list(self.in_keys)
        keys += [k for k in (PACKED_KEY, SHARED_KEY) if k in tensordict.keys()]
        if (
            self.critic and confidence_of(self.model) is not None
        ):  # value_head.confidence reads them
            k = self.tensor_keys
            present = tensordict.keys(include_nested=True)  # a missing one: forward names it
            keys += [x for x in (k.rollout_log_prob, k.loss_mask) if x in present and x not in keys]
        return tensordict.select(*keys)

    def hidden_states(self, tokens: Tensor, attention_mask: Tensor) -> Tensor:
        """Final hidden states ``[B, L, H]`` of the backbone (position ids from the mask)."""
        return backbone_hidden_states(self.model, tokens, attention_mask)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        tokens = tensordict.get(self.tokens_key)
        attention_mask = tensordict.get(self.attention_mask_key)
        if tokens.ndim != 2 or attention_mask.shape != tokens.shape:
            raise ValueError(
                f"LMActorCritic expects {self.tokens_key!r} and {self.attention_mask_key!r} of one "
                f"shape [B, L]; got {tuple(tokens.shape)} and {tuple(attention_mask.shape)}"
            )
        shared = shared_prefix_of(tensordict, self.model)
        packed = tensordict.get_non_tensor(PACKED_KEY, False)
        if packed and shared is not None:
            log_prob, value, next_value, entropy = self._tree(tokens, attention_mask, shared)
        elif packed:
            log_prob, value, next_value, entropy = self._packed(tokens, attention_mask)
        elif shared is not None:
            log_prob, value, next_value, entropy = self._shared(tokens, attention_mask, shared)
        else:
            log_prob, value, next_value, entropy = self._padded(tokens, attention_mask)
        tensordict.set(self.log_prob_key, log_prob)
        if self.critic:
            value, next_value = add_confidence(
                self.model, tensordict, value, next_value, self.tensor_keys, "LMActorCritic"
            )
            tensordict.set(self.value_key, value)
            tensordict.set(self.next_value_key, next_value)
        if self.return_entropy:
            tensordict.set(self.entropy_key, entropy)
        return tensordict

    def _chunk_tokens(self) -> int:
        if self.logits_chunk_tokens is not None:
            return self.logits_chunk_tokens
        vocab = _vocab_size(self.model.get_output_embeddings())
        return chunk_tokens_for_budget(vocab, self.logits_memory_budget)

    def _padded(self, tokens: Tensor, attention_mask: Tensor) -> tuple[Tensor | None, ...]:
        hidden = self.hidden_states(tokens, attention_mask)
        log_prob, entropy = token_log_probs(
            hidden,
            tokens,
            self.model.get_output_embeddings(),
            temperature=self.temperature,
            chunk_tokens=self._chunk_tokens(),
            with_entropy=self.return_entropy,
        )
        if not self.critic:
            return log_prob, None, None, entropy
        value, next_value = shifted_values(self.model.value_head, hidden)
        return log_prob, value, next_value, entropy

    def _shared(
        self, tokens: Tensor, attention_mask: Tensor, shared: SharedPrefix
    ) -> tuple[Tensor | None, ...]:
        """Shared-prefix forward; the LM head also runs once per group on the prefix positions
        (a row's first own log-prob comes from its group's last prefix state)."""
        prefix, rest = shared_hidden_states(self.model, tokens, attention_mask, shared)
        reps = torch.tensor(shared.representatives, device=tokens.device)
        width, head = shared.width, self.model.get_output_embeddings()
        kwargs = dict(
            temperature=self.temperature,
            chunk_tokens=self._chunk_tokens(),
            with_entropy=self.return_entropy,
        )
        lp_prefix, ent_prefix = token_log_probs(prefix, tokens[reps, :width], head, **kwargs)
        boundary = per_row(shared, prefix[:, -1:], rest)
        lp_rest, ent_rest = token_log_probs(boundary, tokens[:, width - 1 :], head, **kwargs)
        log_prob = per_row(shared, lp_prefix, lp_rest[:, 1:])
        entropy = None
        if self.return_entropy:
            entropy = per_row(shared, ent_prefix, ent_rest[:, 1:])
        if not self.critic:
            return log_prob, None, None, entropy
        hidden = per_row(shared, prefix, rest)
        value, next_value = shifted_values(self.model.value_head, hidden)
        return log_prob, value, next_value, entropy

    def _tree(
        self, tokens: Tensor, attention_mask: Tensor, shared: SharedPrefix
    ) -> tuple[Tensor | None, ...]:
        """Packed shared-prefix forward (:class:`~ar_torchrl.modules.shared_prefix.TreeLayout`):
        one backbone call; the LM head and the value head run once per packed position, so a
        group's prefix log-probs are computed once."""
        hidden, layout = tree_hidden_states(self.model, tokens, attention_mask, shared)
        has = layout.parent >= 0  # packed tokens with a token before them in their row
        lp, ent = _chunked_log_probs(
            hidden[layout.parent[has]],
            layout.input_ids.reshape(-1)[has],
            self.model.get_output_embeddings(),
            temperature=self.temperature,
            chunk_tokens=self._chunk_tokens(),
            with_entropy=self.return_entropy,
            use_checkpoint=torch.is_grad_enabled(),
        )
        log_prob = tree_per_row(layout, lp, has)
        entropy = tree_per_row(layout, ent, has) if ent is not None else None
        if not self.critic:
            return log_prob, None, None, entropy
        value, next_value = tree_values(self.model.value_head, hidden, layout)
        return log_prob, value, next_value, entropy

    def _packed(self, tokens: Tensor, attention_mask: Tensor) -> tuple[Tensor | None, ...]:
        """Padding-free forward; outputs in the ``[b, w]`` layout, 0 where nothing is defined
        (padding, and each row's first real token for ``log_prob``/``state_value``/``entropy``)."""
        hidden, layout = packed_hidden_states(self.model, tokens, attention_mask)
        prev = layout.previous
        here = layout.index[prev]  # packed position of each token that has a log-prob
        lp, ent = _chunked_log_probs(
            hidden[here - 1],
            tokens[prev],
            self.model.get_output_embeddings(),
            temperature=self.temperature,
            chunk_tokens=self._chunk_tokens(),
            with_entropy=self.return_entropy,
            use_checkpoint=torch.is_grad_enabled(),
        )
        zeros = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
        entropy = zeros.masked_scatter(prev, ent) if ent is not None else None
        if not self.critic:
            return zeros.masked_scatter(prev, lp), None, None, entropy
        value, next_value = packed_values(self.model.value_head, hidden, layout, attention_mask)
        return zeros.masked_scatter(prev, lp), value, next_value, entropy


# --------------------------------------------------------------------------- shared with LMCritic
def add_confidence(
    model: nn.Module,
    tensordict: TensorDictBase,
    value: Tensor,
    next_value: Tensor,
    keys,
    owner: str,
) -> tuple[Tensor, Tensor]:
    """``value`` and ``next_value`` plus ``model.value_head.confidence``'s terms (unchanged without
    one), from the crop's ``rollout_log_prob`` and ``loss_mask`` (``[b, w]``: every plan's layout)."""
    feats = confidence_of(model)
    if feats is None:
        return value, next_value
    inputs = []
    for name in ("rollout_log_prob", "loss_mask"):
        key = getattr(keys, name)
        if key not in tensordict.keys(include_nested=True):
            raise KeyError(
                f"{owner}: the value head has confidence features (value_head.confidence), which "
                f"read {key!r} ([B, L], the {'sampling log-prob of each token' if name != 'loss_mask' else 'trained tokens'}); "
                f"the batch has no such key. Keep it in the batch (the recipe's trajectories carry "
                f"it), rename it with set_keys({name}=...), or build the critic without them"
            )
        inputs.append(tensordict.get(key))
    log_prob, mask = inputs
    if log_prob.shape != value.shape[:-1] or mask.shape != value.shape[:-1]:
        raise ValueError(
            f"{owner}: confidence features need rollout_log_prob and loss_mask of the values' "
            f"shape {tuple(value.shape[:-1])}, got {tuple(log_prob.shape)} and {tuple(mask.shape)}"
        )
    extra, next_extra = feats(log_prob, mask.bool())
    return value + extra.to(value.dtype), next_value + next_extra.to(next_value.dtype)


def rename_keys(module: TensorDictModuleBase, keys: dict[str, NestedKey]) -> None:
    """``module.set_keys(**keys)`` of a module with ``_AcceptedKeys`` and ``tensor_keys``: an
    unknown name raises; ``value`` alone also moves ``next_value`` to ``("next", *value)``."""
    owner = type(module).__name__
    names = [f.name for f in fields(module._AcceptedKeys)]
    for name, key in keys.items():
        if name not in names:
            raise KeyError(f"{owner}.set_keys: unknown key name {name!r}; expected one of {names}")
        setattr(module.tensor_keys, name, key)
    if "value" in keys and "next_value" not in keys:
        value = keys["value"]
        module.tensor_keys.next_value = ("next", *((value,) if isinstance(value, str) else value))
    module._refresh_keys()


def shared_prefix_of(tensordict: TensorDictBase, model: nn.Module) -> SharedPrefix | None:
    """The crop's :class:`SharedPrefix` (``None``: an ordinary crop).

    Raises:
        ValueError: the crop shares prefixes but ``model`` cannot run that (its padded forward
            would compute more tokens than the plan budgeted): a padded crop needs
            :func:`~ar_torchrl.modules.why_not_shared`, a packed one (the tree layout)
            :func:`~ar_torchrl.modules.shared_prefix.why_not_tree`, to say ``None``.
    """
    shared = tensordict.get_non_tensor(SHARED_KEY, None)
    if shared is None:
        return None
    packed = tensordict.get_non_tensor(PACKED_KEY, False)
    if (reason := (why_not_tree if packed else why_not_shared)(model)) is not None:
        raise ValueError(
            f"a shared-prefix micro-batch reached {type(model).__name__}, which cannot compute a "
            f"prefix once per group: {reason}; plan without shared_prefix "
            "(plan_micro_batches(..., shared_prefix=False); supports_shared_prefix(model) says "
            "when it can)"
        )
    return shared


def backbone_hidden_states(model: nn.Module, tokens: Tensor, attention_mask: Tensor) -> Tensor:
    """Final hidden states ``[B, L, H]`` of an HF causal LM's backbone (``get_decoder()``), with
    position ids ``cumsum(attention_mask) - 1`` so left padding never shifts positions."""
    mask = attention_mask.long()
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
    out = model.get_decoder()(
        input_ids=tokens, attention_mask=mask, position_ids=position_ids, use_cache=False
    )
    return out.last_hidden_state


def shifted_values(head: nn.Module, hidden: Tensor) -> tuple[Tensor, Tensor]:
    """``(state_value, next_state_value)``, both ``[B, L, 1]``, from hidden states ``[B, L, H]``:
    ``next[t] = V(h[t])`` and ``value[t] = V(h[t - 1])`` (0 at ``t = 0``)."""
    next_value = head(hidden)
    value = torch.cat([next_value.new_zeros(next_value.shape[0], 1, 1), next_value[:, :-1]], dim=1)
    return value, next_value


def packed_hidden_states(
    model: nn.Module, tokens: Tensor, attention_mask: Tensor
) -> tuple[Tensor, PackedLayout]:
    """The backbone over the rows' real tokens packed into shared sequences: hidden states
    ``[N, H]`` (one per packed position) and the :class:`PackedLayout` that maps them back."""
    implementation = getattr(model.config, "_attn_implementation", None)
    layout = packed_layout(tokens, attention_mask, varlen=is_varlen(implementation))
    out = model.get_decoder()(
        input_ids=layout.input_ids, position_ids=layout.position_ids, use_cache=False
    )
    return out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1]), layout


def tree_per_row(layout: TreeLayout, values: Tensor, has: Tensor) -> Tensor:
    """``[R, w]`` float32: each row's value of the packed tokens ``values`` (``[has.sum()]``, one
    per packed token with a parent), 0 where a row's token has no real token before it."""
    flat = values.new_zeros(has.shape).masked_scatter(has, values)
    prev = layout.previous
    out = torch.zeros(prev.shape, dtype=values.dtype, device=values.device)
    return out.masked_scatter(prev, flat[layout.index[prev]])


def tree_values(head: nn.Module, hidden: Tensor, layout: TreeLayout) -> tuple[Tensor, Tensor]:
    """:func:`shifted_values` of a tree forward, in the crop's ``[R, w, 1]`` layout: 0 on
    padding (and, for ``state_value``, on each row's first real token)."""
    real, prev = layout.index >= 0, layout.previous
    values = head(hidden)  # [N, 1]: V(h) at every packed position
    zeros = torch.zeros((*real.shape, 1), dtype=values.dtype, device=values.device)
    next_value = zeros.masked_scatter(real[..., None], values[layout.index[real]])
    value = zeros.masked_scatter(prev[..., None], values[layout.parent[layout.index[prev]]])
    return value, next_value


def packed_values(
    head: nn.Module, hidden: Tensor, layout: PackedLayout, attention_mask: Tensor
) -> tuple[Tensor, Tensor]:
    """:func:`shifted_values` of a packed forward, in the crop's ``[b, w, 1]`` layout: 0 on
    padding (and, for ``state_value``, on each row's first real token)."""
    mask, prev = attention_mask.bool(), layout.previous
    values = head(hidden)  # [N, 1]: V(h) at every packed position
    zeros = torch.zeros((*attention_mask.shape, 1), dtype=values.dtype, device=values.device)
    next_value = zeros.masked_scatter(mask[..., None], values[layout.index[mask]])
    value = zeros.masked_scatter(prev[..., None], values[layout.index[prev] - 1])
    return value, next_value
