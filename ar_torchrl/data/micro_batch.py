"""Micro-batch geometry shared by the anchor pass and the training forward (DESIGN.md section 4).

A :class:`MicroBatchPlan` fixes which rows go together and the column span each micro-batch is
cropped to. Running the anchor pass (:func:`~ar_torchrl.objectives.recompute_anchors`) and the
training forward over the *same* plan makes the first PPO update see ratio exactly 1: the two
forwards see identical inputs with identical shapes. Mini-batches for PPO epochs are groups of the
plan's micro-batches (:meth:`MicroBatchPlan.minibatches`), so shuffling never changes the geometry.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey

__all__ = ["MicroBatch", "MicroBatchPlan", "plan_micro_batches"]


@dataclass(frozen=True, order=True)
class MicroBatch:
    """Rows of the batch and the column span ``[start, end)`` they are cropped to.

    ``padding=True`` marks a padding pass of data-parallel training
    (:func:`ar_torchrl.distributed.shard_plan`): a rank with fewer micro-batches than the others
    still runs a forward (and backward) so that every rank makes the same collective calls, but the
    pass contributes no gradient, no metric and no anchor (:meth:`MicroBatchPlan.scatter` skips it).
    """

    rows: tuple[int, ...]
    start: int
    end: int
    padding: bool = False

    @property
    def width(self) -> int:
        return self.end - self.start

    @property
    def num_tokens(self) -> int:
        """Padded size ``rows x width`` (what the forward pays for)."""
        return len(self.rows) * self.width


@dataclass(frozen=True)
class MicroBatchPlan:
    """A partition of the rows of a ``[B, L]`` batch into cropped micro-batches.

    Example:
        >>> from tensordict import TensorDict
        >>> mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 1, 1, 0]], dtype=torch.bool)
        >>> td = TensorDict({"attention_mask": mask, "x": torch.arange(15).view(3, 5)}, [3, 5])
        >>> plan = plan_micro_batches(td, token_budget=6)
        >>> [(mb.rows, mb.start, mb.end) for mb in plan.micro_batches]
        [((1,), 0, 5), ((0, 2), 1, 4)]
        >>> [tuple(sub.batch_size) for sub in plan.split(td)]
        [(1, 5), (2, 3)]
    """

    micro_batches: tuple[MicroBatch, ...]
    batch_size: tuple[int, int]
    token_budget: int

    def __len__(self) -> int:
        return len(self.micro_batches)

    def _check(self, td: TensorDictBase) -> None:
        if tuple(td.batch_size[:2]) != self.batch_size:
            raise ValueError(
                f"MicroBatchPlan was made for a batch of size {self.batch_size}, got a TensorDict "
                f"with batch_size {tuple(td.batch_size)}; re-plan with plan_micro_batches(td, ...)"
            )

    def crop(self, td: TensorDictBase, mb: MicroBatch) -> TensorDictBase:
        """The sub-TensorDict of ``mb``: its rows, cropped to its columns (a copy)."""
        rows = torch.tensor(mb.rows, dtype=torch.long, device=td.device)
        return td[rows][:, mb.start : mb.end]

    def split(self, td: TensorDictBase) -> Iterator[TensorDictBase]:
        """Yield each micro-batch of ``td`` in plan order."""
        self._check(td)
        for mb in self.micro_batches:
            yield self.crop(td, mb)

    def minibatches(
        self, num_minibatches: int, generator: torch.Generator | None = None
    ) -> list[list[MicroBatch]]:
        """Shuffle the micro-batches and deal them into ``num_minibatches`` groups.

        Raises:
            ValueError: if there are fewer micro-batches than ``num_minibatches``.
        """
        if not 1 <= num_minibatches <= len(self):
            raise ValueError(
                f"cannot make {num_minibatches} mini-batches from {len(self)} micro-batches; "
                "lower num_minibatches or the token_budget / max_rows of the plan"
            )
        order = torch.randperm(len(self), generator=generator).tolist()
        return [
            [self.micro_batches[i] for i in order[k::num_minibatches]]
            for k in range(num_minibatches)
        ]

    def scatter(self, full: torch.Tensor, mb: MicroBatch, values: torch.Tensor) -> None:
        """Write a micro-batch result ``values`` ``[b, w, ...]`` into ``full`` ``[B, L, ...]``.

        A padding micro-batch (``mb.padding``) writes nothing.
        """
        if mb.padding:
            return
        rows = torch.tensor(mb.rows, dtype=torch.long, device=full.device)
        full[rows, mb.start : mb.end] = values.to(full.dtype)


def _row_spans(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """First and one-past-last True column of each row (``[B]`` each); empty rows give (0, 0)."""
    length = mask.shape[-1]
    pos = torch.arange(length, device=mask.device)
    has = mask.any(-1)
    first = torch.where(mask, pos, length).min(-1).values
    last = torch.where(mask, pos + 1, 0).max(-1).values
    return torch.where(has, first, 0), torch.where(has, last, 0)


def plan_micro_batches(
    td: TensorDictBase,
    token_budget: int,
    max_rows: int | None = None,
    *,
    attention_mask_key: NestedKey = "attention_mask",
) -> MicroBatchPlan:
    """Pack the rows of a ``[B, L]`` token trajectory into micro-batches of at most ``token_budget``.

    Rows are sorted by real length (longest first) and added greedily while ``rows x padded width``
    (the span from the earliest first real token to the latest last real token of the rows) stays
    within ``token_budget`` and the row count within ``max_rows``. Sorting by length removes most of
    the padding.

    Args:
        td: a TensorDict with batch size ``[B, L]`` holding ``attention_mask`` ``[B, L]`` bool.
        token_budget: max ``rows x width`` per micro-batch.
        max_rows: optional max rows per micro-batch.

    Raises:
        ValueError: a row longer than ``token_budget`` on its own, a row without any real token,
            or bad arguments.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"max_rows must be >= 1 or None, got {max_rows}")
    if td.batch_dims < 2:
        raise ValueError(
            f"plan_micro_batches expects a [B, L] TensorDict, got batch_size {tuple(td.batch_size)}"
        )
    mask = td.get(attention_mask_key).bool()
    first, last = _row_spans(mask)
    lengths = last - first
    if (lengths == 0).any():
        empty = (lengths == 0).nonzero().flatten().tolist()
        raise ValueError(
            f"plan_micro_batches: rows {empty[:8]} have no real token in {attention_mask_key!r}; "
            "drop empty rows before planning"
        )
    too_long = int(lengths.max()) if lengths.numel() else 0
    if too_long > token_budget:
        raise ValueError(
            f"token_budget={token_budget} is smaller than the longest row ({too_long} tokens); "
            f"raise token_budget to at least {too_long}"
        )
    order = sorted(range(mask.shape[0]), key=lambda i: (-int(lengths[i]), i))
    micro, current, lo, hi = [], [], 0, 0
    for i in order:
        f, l_ = int(first[i]), int(last[i])
        new_lo, new_hi = (min(lo, f), max(hi, l_)) if current else (f, l_)
        fits = (len(current) + 1) * (new_hi - new_lo) <= token_budget
        if current and (not fits or (max_rows is not None and len(current) >= max_rows)):
            micro.append(MicroBatch(tuple(sorted(current)), lo, hi))
            current, (new_lo, new_hi) = [], (f, l_)
        current.append(i)
        lo, hi = new_lo, new_hi
    if current:
        micro.append(MicroBatch(tuple(sorted(current)), lo, hi))
    return MicroBatchPlan(tuple(micro), (mask.shape[0], mask.shape[1]), token_budget)
