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
    "TreeLayout",
    "per_row",
    "shared_hidden_states",
    "supports_shared_prefix",
    "tree_hidden_states",
    "tree_layout",
    "tree_unit_lengths",
    "why_not_shared",
    "why_not_tree",
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


# --------------------------------------------------------------------------- packed: the tree layout
#: Attention kernels that take the tree layout's dense 4D mask (variable-length kernels cannot).
TREE_KERNELS = ("sdpa", "eager")


def why_not_tree(model: nn.Module) -> str | None:
    """Why ``model`` cannot run a packed shared-prefix (tree) forward (``None``: it can).

    The tree forward is one backbone call without a cache, so activation checkpointing and FSDP2
    are fine; it needs an attention kernel that takes a dense 4D mask (``sdpa``, ``eager``) and
    only full-attention layers (a 4D mask given to Hugging Face replaces its sliding windows).
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    kernel = getattr(model.config, "_attn_implementation", None) or "eager"
    if kernel not in TREE_KERNELS:
        return (
            f"its attention kernel {kernel!r} takes no dense 4D mask (the tree layout needs one "
            f"of {list(TREE_KERNELS)})"
        )
    layers = DynamicCache(config=model.config).layers
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        return "its cache has layers other than full attention (e.g. sliding windows)"
    return None


@dataclass(frozen=True)
class TreeLayout:
    """A packed shared-prefix crop: each group is one *unit*, its prefix (once) followed by every
    row's remaining real tokens, units placed first-fit in bins of the longest unit's width ``W``
    (:func:`~ar_torchrl.modules.pack_rows`); a 4D mask lets a token see its unit's prefix and the
    earlier tokens of its own row only.

    Attributes:
        input_ids, position_ids: ``[bins, W]`` (0 in the slack; positions ``cumsum(mask) - 1`` of
            the crop, so a row's tokens keep their padded-forward positions).
        attention_mask: ``[bins, 1, W, W]`` bool, True where a query may attend a key (slack
            attends to itself only).
        index: ``[R, w]`` int64 flat packed position of each real token (-1 on padding); the
            prefix columns of a group's rows share their group's positions.
        parent: ``[bins * W]`` int64 flat position of the real token before each packed token in
            its row (-1: a row's first real token, and slack).
        previous: ``[R, w]`` bool, real tokens with a real token before them in their row.

    Example:
        >>> mask = torch.ones(2, 3, dtype=torch.bool)  # two rows sharing their first 2 tokens
        >>> layout = tree_layout(torch.tensor([[5, 6, 7], [5, 6, 8]]), mask, SharedPrefix(2, (0, 0)))
        >>> layout.input_ids.tolist(), layout.index.tolist()
        ([[5, 6, 7, 8]], [[0, 1, 2], [0, 1, 3]])
        >>> layout.attention_mask[0, 0].int().tolist()  # token 8 sees 5, 6 and itself, not 7
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]]
    """

    input_ids: Tensor
    position_ids: Tensor
    attention_mask: Tensor
    index: Tensor
    parent: Tensor
    previous: Tensor


def tree_unit_lengths(attention_mask: Tensor, shared: SharedPrefix) -> list[int]:
    """Real tokens of each group's unit: its prefix's (once) plus each row's after ``width``.

    Example:
        >>> mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 1, 1, 1]], dtype=torch.bool)
        >>> tree_unit_lengths(mask, SharedPrefix(2, (0, 0, 1)))  # 2 + 1 + 2, then 1 + 2
        [5, 3]
    """
    mask = attention_mask.bool()
    prefix = mask[:, : shared.width].sum(-1).tolist()
    rest = mask[:, shared.width :].sum(-1).tolist()
    lengths = [prefix[rep] for rep in shared.representatives]
    for row, group in enumerate(shared.groups):
        lengths[group] += rest[row]
    return lengths


def tree_layout(tokens: Tensor, attention_mask: Tensor, shared: SharedPrefix) -> TreeLayout:
    """Lay out a shared-prefix crop ``[R, w]`` as a :class:`TreeLayout`.

    Example:
        >>> mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 1, 1, 1]], dtype=torch.bool)
        >>> tokens = torch.tensor([[1, 2, 3, 0], [1, 2, 4, 5], [0, 6, 7, 8]])
        >>> layout = tree_layout(tokens, mask, SharedPrefix(2, (0, 0, 1)))
        >>> layout.input_ids.tolist()  # unit 0: prefix 1 2, row 0's 3, row 1's 4 5; unit 1
        [[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]]
        >>> layout.position_ids.tolist()
        [[0, 1, 2, 2, 3], [0, 1, 2, 0, 0]]
        >>> layout.parent.tolist()  # row 1's first own token (4) follows the prefix's last (2)
        [-1, 0, 1, 1, 3, -1, 5, 6, -1, -1]
    """
    from ar_torchrl.modules.packing import pack_rows

    mask, width, device = attention_mask.bool(), shared.width, tokens.device
    rows, w = mask.shape
    if len(shared.groups) != rows or not 0 <= width <= w:
        raise ValueError(
            f"tree_layout: SharedPrefix(width={width}, {len(shared.groups)} rows) does not fit a "
            f"crop of shape {tuple(mask.shape)}"
        )
    lengths = tree_unit_lengths(mask, shared)
    if min(lengths) == 0:
        raise ValueError(f"tree_layout: a group without any real token (unit lengths {lengths})")
    bins, slots = pack_rows(lengths)
    size = max(lengths)
    unit_start = [b * size + o for b, o in slots]
    groups = torch.tensor(shared.groups, device=device)
    reps = torch.tensor(shared.representatives, device=device)
    # each row's rest follows its unit's prefix and the rests of the group's earlier rows
    prefix_len = mask[reps, :width].sum(-1)
    rest_len = mask[:, width:].sum(-1).tolist()
    offset, used = [0] * rows, [int(n) for n in prefix_len.tolist()]
    for row, group in enumerate(shared.groups):
        offset[row], used[group] = used[group], used[group] + rest_len[row]
    start = torch.tensor(unit_start, device=device)
    rank = mask.long().cumsum(-1) - 1  # real-token rank in the row: the position id too
    in_prefix = torch.arange(w, device=device) < width
    own = torch.tensor(offset, device=device)[:, None] + rank - prefix_len[groups][:, None]
    index = torch.where(in_prefix, rank, own) + start[groups][:, None]
    index = torch.where(mask, index, -1)
    flat = bins * size
    input_ids = tokens.new_zeros(flat)
    input_ids[index[mask]] = tokens[mask]
    position_ids = torch.zeros(flat, dtype=torch.long, device=device)
    position_ids[index[mask]] = rank[mask]
    # the real token before each one in its row
    cols = torch.arange(w, device=device).expand(rows, w)
    last_real = torch.where(mask, cols, -1).cummax(-1).values
    before = torch.cat([last_real.new_full((rows, 1), -1), last_real[:, :-1]], dim=1)
    previous = mask & (before >= 0)
    parent = torch.full((flat,), -1, dtype=torch.long, device=device)
    parent[index[previous]] = index.gather(1, before.clamp_min(0))[previous]
    # who may attend whom: same unit, not later, and the key in the prefix or the query's row
    unit = torch.full((flat,), -1, dtype=torch.long, device=device)
    row_of = torch.full((flat,), -1, dtype=torch.long, device=device)  # -1: a prefix token
    unit[index[mask]] = groups[:, None].expand(rows, w)[mask]
    own_rows = mask & ~in_prefix
    row_of[index[own_rows]] = torch.arange(rows, device=device)[:, None].expand(rows, w)[own_rows]
    unit, row_of = unit.view(bins, size), row_of.view(bins, size)
    q_unit, k_unit = unit[:, :, None], unit[:, None, :]
    causal = torch.ones(size, size, dtype=torch.bool, device=device).tril()
    allowed = (q_unit == k_unit) & (q_unit >= 0) & causal
    allowed &= (row_of[:, None, :] == -1) | (row_of[:, None, :] == row_of[:, :, None])
    allowed |= torch.eye(size, dtype=torch.bool, device=device)  # slack sees itself
    return TreeLayout(
        input_ids.view(bins, size),
        position_ids.view(bins, size),
        allowed[:, None],
        index,
        parent,
        previous,
    )


def tree_hidden_states(
    model: nn.Module, tokens: Tensor, attention_mask: Tensor, shared: SharedPrefix
) -> tuple[Tensor, TreeLayout]:
    """The backbone over a shared-prefix crop's :class:`TreeLayout`, in one call: hidden states
    ``[bins * W, H]`` (one per packed position) and the layout that maps them back.

    A dense kernel takes the mask additively (``eager``) or as is; it is given as 0 / the dtype's
    minimum in the model's dtype so both read it the same.
    """
    layout = tree_layout(tokens, attention_mask, shared)
    dtype = next(model.parameters()).dtype
    additive = torch.zeros(layout.attention_mask.shape, dtype=dtype, device=tokens.device)
    additive.masked_fill_(~layout.attention_mask, torch.finfo(dtype).min)
    out = model.get_decoder()(
        input_ids=layout.input_ids,
        attention_mask=additive,
        position_ids=layout.position_ids,
        use_cache=False,
    )
    hidden = out.last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1]), layout
