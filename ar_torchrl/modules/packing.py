"""Padding-free ("packed") forwards: the rows of a ``[b, w]`` micro-batch share backbone sequences.

A packed forward computes only real tokens (plus, with a dense attention kernel, a little slack).
Position ids restart at 0 for every row, and no attention mask and no cache are passed:
transformers then detects the packed sequences from the position ids and keeps attention inside
each row. Two layouts, by attention kernel (:func:`is_varlen`):

* variable-length kernels (``flash_attention_*``: varlen from the position ids of one row;
  ``flex_attention``: a block mask that skips other rows' blocks): all rows end to end in one row
  ``[1, real tokens]``, nothing else computed;
* dense kernels (``sdpa``, ``eager``: a block-diagonal causal mask, every block computed): each
  row's real tokens are placed, in order, in *bins* of width ``W`` (the longest row's real
  length), first-fit decreasing, so the backbone runs on ``[bins, W]`` instead of ``[b, w]`` and
  the attention work per token stays at most that of the padded crop. The slack at the end of a
  bin gets its own restarting position ids (a separate, discarded sequence).

:func:`pack_rows` is the one geometry function: :func:`~ar_torchrl.data.plan_micro_batches`
sizes packed micro-batches with it and :class:`~ar_torchrl.modules.LMActorCritic` lays a packed
crop out with it, so the plan's token count is what the forward computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["PACKED_KEY", "PackedLayout", "is_varlen", "pack_rows", "packed_layout"]

#: Non-tensor entry of a micro-batch crop: ``True`` asks ``LMActorCritic`` for a packed forward.
PACKED_KEY = "packed"


def is_varlen(attn_implementation: str | None) -> bool:
    """Whether an HF attention implementation runs packed rows without computing across them.

    Example:
        >>> is_varlen("flash_attention_2"), is_varlen("flex_attention"), is_varlen("sdpa")
        (True, True, False)
    """
    name = attn_implementation or ""
    return "flash" in name or name == "flex_attention"


def pack_rows(lengths: Sequence[int]) -> tuple[int, list[tuple[int, int]]]:
    """First-fit-decreasing placement of rows in bins of width ``max(lengths)``.

    Rows are placed longest first (ties: lower index first), each in the first bin with room.

    Args:
        lengths: real-token count of each row (all >= 1).

    Returns:
        ``(num_bins, slots)`` with ``slots[i] = (bin, offset)`` of row ``i``.

    Example:
        >>> pack_rows([5, 2, 3, 1, 4])  # bins of 5: [5], [4, 1], [3, 2]
        (3, [(0, 0), (2, 3), (2, 0), (1, 4), (1, 0)])
    """
    if not lengths:
        return 0, []
    width = max(lengths)
    room: list[int] = []
    slots: list[tuple[int, int]] = [(0, 0)] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        b = next((k for k, free in enumerate(room) if free >= lengths[i]), len(room))
        if b == len(room):
            room.append(width)
        slots[i] = (b, width - room[b])
        room[b] -= lengths[i]
    return len(room), slots


@dataclass(frozen=True)
class PackedLayout:
    """Where each real token of a ``[b, w]`` crop sits in the packed backbone input.

    Attributes:
        input_ids: ``[bins, W]`` (or ``[1, real tokens]`` for varlen) packed ids (0 in the slack).
        position_ids: same shape; restart at 0 for every row and every slack run.
        index: ``[b, w]`` int64 flat position of each real token in ``input_ids``, -1 on padding.
        previous: ``[b, w]`` bool, real tokens that have a real token before them in their row
            (where a log-prob and ``V(h[t-1])`` exist).
    """

    input_ids: Tensor
    position_ids: Tensor
    index: Tensor
    previous: Tensor


def packed_layout(tokens: Tensor, attention_mask: Tensor, *, varlen: bool = False) -> PackedLayout:
    """Lay out the real tokens of ``tokens`` ``[b, w]`` (``attention_mask`` bool) for a packed forward.

    Each row's real tokens keep their order; a row with gaps in its mask is packed as one run (its
    position ids count real tokens, ``cumsum(mask) - 1``, as in the padded forward).

    Args:
        varlen: rows end to end in one row, no slack (for variable-length kernels); else
            first-fit bins of the longest row's width (:func:`pack_rows`).

    Example:
        >>> mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0], [0, 0, 1, 0]], dtype=torch.bool)
        >>> layout = packed_layout(torch.arange(12).view(3, 4), mask)
        >>> layout.input_ids.tolist(), layout.position_ids.tolist()
        ([[1, 2, 3], [4, 5, 10]], [[0, 1, 2], [0, 1, 0]])
        >>> packed_layout(torch.arange(12).view(3, 4), mask, varlen=True).position_ids.tolist()
        [[0, 1, 2, 0, 1, 0]]
    """
    mask = attention_mask.bool()
    lengths = mask.sum(-1)
    if bool((lengths == 0).any()):
        raise ValueError(
            f"packed_layout: rows {(lengths == 0).nonzero().flatten().tolist()[:8]} have no real "
            "token; a packed micro-batch needs at least one per row"
        )
    rank = mask.long().cumsum(-1) - 1
    if varlen:
        start = lengths.cumsum(0) - lengths
        shape, starts = (1, int(lengths.sum())), start
    else:
        lengths_list = lengths.tolist()
        bins, slots = pack_rows(lengths_list)
        width = max(lengths_list)
        start = torch.tensor([b * width + o for b, o in slots], device=tokens.device)
        used = torch.zeros(bins, dtype=torch.long).index_add_(
            0, torch.tensor([b for b, _ in slots]), torch.tensor(lengths_list)
        )
        slack = (used < width).nonzero().flatten()  # each slack run starts its own sequence
        shape, starts = (bins, width), torch.cat([start, (slack * width + used[slack]).to(start)])
    index = torch.where(mask, start[:, None] + rank, -1)
    input_ids = tokens.new_zeros(shape[0] * shape[1])
    input_ids[index[mask]] = tokens[mask]
    pos = torch.arange(input_ids.numel(), device=tokens.device)
    is_start = torch.zeros_like(pos, dtype=torch.bool).index_fill_(0, starts, True)
    position_ids = pos - torch.where(is_start, pos, 0).cummax(0).values
    return PackedLayout(input_ids.view(shape), position_ids.view(shape), index, mask & (rank > 0))
