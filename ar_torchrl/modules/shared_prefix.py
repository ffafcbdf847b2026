"""Shared-prefix forwards: rows that begin with the same tokens (the ``n`` samples of a prompt)
compute that prefix once.

A micro-batch crop carrying ``SHARED_KEY`` (set by a shared-prefix
:class:`~ar_torchrl.training.MicroBatchPlan`) holds a :class:`SharedPrefix`: the crop's first
``width`` columns are the same in every row of a group (tokens and attention mask), and
``groups[i]`` is the group of row ``i``. The backbone then runs twice:

1. on the prefix of one row per group, ``[G, width]``, keeping its key/value cache;
2. on the rest of every row, ``[R, w - width]``, attending to its group's prefix keys/values
   (the cache rows picked per row) and to its own earlier tokens.

The hidden states of the prefix are its group's (picked per row), so every output has the layout
and, to float rounding, the values of the unshared forward; gradients flow back through the picked
keys, values and hidden states into the one prefix computation (their sum over the group's rows).
The LM head runs once per group on the prefix positions too. The anchor pass and the training
forward use the same plan, so both run this same computation: the first update's ratio stays
exactly 1.

It needs a backbone whose cache layers are all full attention and no activation checkpointing
(Hugging Face turns the cache off under it; a recomputed layer would write the cache twice):
:func:`supports_shared_prefix` says whether a model can; a shared-prefix crop given to one that
cannot is an error (its padded forward would compute more tokens than the plan's budget).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = [
    "SHARED_KEY",
    "SharedPrefix",
    "per_row",
    "shared_hidden_states",
    "supports_shared_prefix",
    "why_not_shared",
]

#: Non-tensor entry of a micro-batch crop: a :class:`SharedPrefix` asks for a shared-prefix forward.
SHARED_KEY = "shared_prefix"


@dataclass(frozen=True)
class SharedPrefix:
    """The shared part of a micro-batch crop.

    Attributes:
        width: the crop's leading columns that are the same within each group (``>= 1``).
        groups: group index of each row of the crop (``0 .. G - 1``, every index used).

    Example:
        >>> SharedPrefix(3, (0, 0, 1)).representatives
        (0, 2)
    """

    width: int
    groups: tuple[int, ...]

    @property
    def num_groups(self) -> int:
        return max(self.groups) + 1

    @property
    def representatives(self) -> tuple[int, ...]:
        """The first row of each group (whose prefix is computed)."""
        first: dict[int, int] = {}
        for row, group in enumerate(self.groups):
            first.setdefault(group, row)
        return tuple(first[g] for g in range(self.num_groups))


def supports_shared_prefix(model: nn.Module) -> bool:
    """Whether ``model``'s backbone can run a shared-prefix forward: only full-attention cache
    layers, and no activation checkpointing (Hugging Face's returns no cache; a recomputed layer
    would write the cache twice).

    Example:
        >>> from ar_torchrl.models.tiny import build_tiny_qwen3
        >>> supports_shared_prefix(build_tiny_qwen3(99))
        True
    """
    return why_not_shared(model) is None


def why_not_shared(model: nn.Module) -> str | None:
    """Why ``model`` cannot run a shared-prefix forward (``None``: it can)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    # Hugging Face's gradient checkpointing (``gradient_checkpointing`` on its layers) drops the
    # cache; ours (``distributed.fsdp.checkpoint_decoder_layers`` marks ``_ar_checkpointed``)
    # would replay the cache writes in backward
    if any(
        getattr(m, "gradient_checkpointing", False) or getattr(m, "_ar_checkpointed", False)
        for m in model.modules()
    ):
        return "it runs activation checkpointing"
    layers = DynamicCache(config=model.config).layers
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        return "its cache has layers other than full attention (e.g. sliding windows)"
    return None


def shared_hidden_states(
    model: nn.Module, tokens: Tensor, attention_mask: Tensor, shared: SharedPrefix
) -> tuple[Tensor, Tensor]:
    """Final hidden states of a shared-prefix crop (see the module docstring).

    Args:
        model: an HF causal LM (``get_decoder()``); :func:`supports_shared_prefix` must hold.
        tokens, attention_mask: ``[R, w]`` the crop.
        shared: its :class:`SharedPrefix`.

    Returns:
        ``(prefix [G, width, H], rest [R, w - width, H])``: the hidden states of each group's
        prefix and of every row's remaining columns (position ids ``cumsum(mask) - 1``).
    """
    from transformers import DynamicCache

    decoder, width = model.get_decoder(), shared.width
    mask = attention_mask.long()
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    reps = torch.tensor(shared.representatives, device=tokens.device)
    groups = torch.tensor(shared.groups, device=tokens.device)
    cache_kwarg = "cache" if "cache" in inspect.signature(decoder.forward).parameters else None
    cache_kwarg = cache_kwarg or "past_key_values"
    kept = DynamicCache(config=model.config)  # filled by the prefix forward
    prefix = decoder(
        input_ids=tokens[reps, :width],
        attention_mask=mask[reps, :width],
        position_ids=positions[reps, :width],
        use_cache=True,
        **{cache_kwarg: kept},
    )
    per_row = DynamicCache(config=model.config)
    for index, layer in enumerate(kept.layers):
        per_row.update(
            layer.keys.index_select(0, groups), layer.values.index_select(0, groups), index
        )
    rest = decoder(
        input_ids=tokens[:, width:],
        attention_mask=mask,
        position_ids=positions[:, width:],
        use_cache=True,
        **{cache_kwarg: per_row},
    )
    return prefix.last_hidden_state, rest.last_hidden_state


def per_row(shared: SharedPrefix, prefix_part: Tensor, rest: Tensor) -> Tensor:
    """Every row's full ``[R, ...]`` tensor: its group's ``prefix_part`` (``[G, p, ...]``) followed
    along dim 1 by its own ``rest`` (``[R, r, ...]``); gradients flow into the one prefix part.

    Example:
        >>> per_row(SharedPrefix(1, (0, 0, 1)), torch.tensor([[1], [2]]), torch.zeros(3, 1, dtype=torch.long))
        tensor([[1, 0],
                [1, 0],
                [2, 0]])
    """
    groups = torch.tensor(shared.groups, device=prefix_part.device)
    return torch.cat([prefix_part.index_select(0, groups), rest], dim=1)
