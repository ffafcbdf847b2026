"""Micro-batch geometry shared by the old-log-prob pass and the training forward (docs/design.md section 4).

A :class:`MicroBatchPlan` fixes which rows go together and the column span each micro-batch is
cropped to. Running the anchor pass (:func:`~ar_torchrl.objectives.recompute_old_log_probs_and_values`) and the
training forward over the *same* plan makes the first PPO update see ratio exactly 1: the two
forwards see identical inputs with identical shapes. Mini-batches for PPO epochs are groups of the
plan's micro-batches (:meth:`MicroBatchPlan.minibatches`), so shuffling never changes the geometry.

With ``packing`` a micro-batch is *packed*: its crop carries ``PACKED_KEY = True`` and
:class:`~ar_torchrl.modules.LMActorCritic` runs it padding-free (the rows' real tokens share
backbone sequences, :mod:`ar_torchrl.modules.packing`), so the token budget counts the tokens the
packed forward computes (real tokens plus the slack of its bins) instead of ``rows x width``.

With ``shared_prefix`` the rows that are the same up to their first trained token (the ``n``
samples of a prompt) stay in one micro-batch, whose crop carries ``SHARED_KEY`` (a
:class:`~ar_torchrl.modules.SharedPrefix`): the actor-critic and the critic compute that prefix once
per group (:mod:`ar_torchrl.modules.shared_prefix`), and the budget counts ``groups x prefix +
rows x rest``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey

from ar_torchrl.modules.packing import PACKED_KEY, pack_rows
from ar_torchrl.modules.shared_prefix import SHARED_KEY, SharedPrefix
from ar_torchrl.utils.checks import check_token_budget

__all__ = ["MicroBatch", "MicroBatchPlan", "plan_micro_batches"]

#: What :meth:`Plan.reduce` computes over ranks.
ReduceOp = Literal["sum", "max", "min"]


# "auto" packs when at least this fraction of the tokens the padded plan computes is padding. A
# packed forward computes no more backbone tokens than the padded one and runs the LM head on real
# tokens only; measured on CPU with benchmarks/bench_packing.py it was 1.3-1.9x faster at 28-43 %
# padding and neutral (0.97-1.09x) at 13 %, where the layout overhead eats the gain.
AUTO_PACKING_MIN_PADDING = 0.2
# "auto" shares prefixes when the shared plan computes at least this fraction fewer backbone tokens
# than the padded plan (benchmarks/bench_shared_prefix.py measures what that buys).
AUTO_SHARED_MIN_SAVING = 0.2
# "auto" packing lays shared micro-batches out as a tree only while its bins are at most this wide:
# the tree's dense attention mask holds bins x width^2 elements (at 4096: 16 M per bin), beyond
# that it takes the padded shared layout (the prefix's KV cache) where that can run.
AUTO_TREE_MAX_WIDTH = 4096


@dataclass(frozen=True, order=True)
class MicroBatch:
    """Rows of the batch, the column span ``[start, end)`` they are cropped to, for a packed
    micro-batch the ``(bins, bin width)`` its forward computes, and for a shared-prefix one
    ``(split column, group of each row)``: rows of a group are the same on ``[start, split)``.

    ``padding=True`` marks a padding pass of data-parallel training
    (:func:`ar_torchrl.distributed.shard_plan`): a rank with fewer micro-batches than the others
    still runs a forward (and backward) so that every rank makes the same collective calls, but the
    pass contributes no gradient, no metric and no old log-prob (:meth:`MicroBatchPlan.scatter` skips it).
    """

    rows: tuple[int, ...]
    start: int
    end: int
    padding: bool = False
    packed_shape: tuple[int, int] | None = None
    shared: tuple[int, tuple[int, ...]] | None = None

    @property
    def width(self) -> int:
        return self.end - self.start

    @property
    def packed(self) -> bool:
        return self.packed_shape is not None

    @property
    def num_tokens(self) -> int:
        """What the forward pays for: ``rows x width`` padded, ``bins x bin width`` packed,
        ``groups x prefix + rows x rest`` with a shared prefix."""
        if self.packed_shape is not None:
            return self.packed_shape[0] * self.packed_shape[1]
        if self.shared is not None:
            split, groups = self.shared
            return (max(groups) + 1) * (split - self.start) + len(self.rows) * (self.end - split)
        return len(self.rows) * self.width


@runtime_checkable
class Plan(Protocol):
    """What :func:`~ar_torchrl.training.ppo_update` and the old-log-prob pass need of a micro-batch plan.

    :class:`MicroBatchPlan` (one process) and :class:`~ar_torchrl.distributed.ShardedPlan` (this
    rank's share of a plan over several ranks) implement it. ``spans_ranks``: the plan is a rank's
    share, run in lockstep with the other ranks (every backward pass runs even after a non-finite
    loss; the ranks agree on skipping the step) and :meth:`reduce` sums (or, with ``op``, takes the
    maximum or minimum) over ranks; a one-process plan's :meth:`reduce` returns its values.
    """

    batch_size: tuple[int, int]

    @property
    def spans_ranks(self) -> bool: ...

    def __len__(self) -> int: ...

    def crop(self, td: TensorDictBase, mb: MicroBatch) -> TensorDictBase: ...

    def minibatches(
        self, num_minibatches: int, generator: torch.Generator | None = None
    ) -> list[list[MicroBatch]]: ...

    def reduce(self, values: Mapping[str, float], op: ReduceOp = "sum") -> dict[str, float]: ...


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

    #: a one-process plan: :meth:`reduce` returns its values
    spans_ranks = False

    def reduce(self, values: Mapping[str, float], op: ReduceOp = "sum") -> dict[str, float]:
        """The values as floats (the sum, or ``op`` ``"max"``/``"min"``, over the one process; see
        :class:`Plan`)."""
        return {k: float(values[k]) for k in sorted(values)}

    @property
    def num_tokens(self) -> int:
        """Tokens the forwards over the whole plan compute (padding and bin slack included)."""
        return sum(mb.num_tokens for mb in self.micro_batches)

    def _check(self, td: TensorDictBase) -> None:
        if tuple(td.batch_size[:2]) != self.batch_size:
            raise ValueError(
                f"MicroBatchPlan was made for a batch of size {self.batch_size}, got a TensorDict "
                f"with batch_size {tuple(td.batch_size)}; re-plan with plan_micro_batches(td, ...)"
            )

    def crop(self, td: TensorDictBase, mb: MicroBatch) -> TensorDictBase:
        """The sub-TensorDict of ``mb``: its rows, cropped to its columns (a copy), carrying
        ``PACKED_KEY = True`` when ``mb`` is packed and its :class:`~ar_torchrl.modules.SharedPrefix`
        (``SHARED_KEY``) when it shares prefixes."""
        rows = torch.tensor(mb.rows, dtype=torch.long, device=td.device)
        sub = td[rows][:, mb.start : mb.end]
        if mb.packed:
            sub.set_non_tensor(PACKED_KEY, True)
        if mb.shared is not None:
            split, groups = mb.shared
            sub.set_non_tensor(SHARED_KEY, SharedPrefix(split - mb.start, groups))
        return sub

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
    packing: bool | Literal["auto"] = False,
    shared_prefix: bool | Literal["auto"] = False,
    shared_padded: bool = True,
    shared_packed: bool = True,
    attention_mask_key: NestedKey = "attention_mask",
    tokens_key: NestedKey = "tokens",
    loss_mask_key: NestedKey = "loss_mask",
) -> MicroBatchPlan:
    """Pack the rows of a ``[B, L]`` token trajectory into micro-batches of at most ``token_budget``.

    Rows are sorted by real length (longest first) and added greedily while the micro-batch's
    computed tokens stay within ``token_budget`` and the row count within ``max_rows``. Padded
    (``packing=False``), that is ``rows x padded width`` (the span from the earliest first real
    token to the latest last real token of the rows); sorting by length removes most of the
    padding. Packed (``packing=True``), it is ``bins x bin width`` of the padding-free forward
    (:func:`~ar_torchrl.modules.pack_rows`: real tokens plus the slack of first-fit bins as wide as
    the micro-batch's longest row; shorter rows fill the holes of earlier micro-batches first). A
    model whose attention kernel takes variable-length sequences computes only the real tokens
    (:func:`~ar_torchrl.modules.packed_layout`), so there the budget is an upper bound. ``"auto"``
    packs when padding is at least ``AUTO_PACKING_MIN_PADDING`` of the padded plan's tokens.

    Shared prefixes (``shared_prefix=True``): rows whose tokens and attention mask are the same
    up to their first trained token (``loss_mask``) form a group; groups, longest first, fill
    micro-batches within the budget (a group too large for one is split), and each group's prefix
    is computed once (:mod:`ar_torchrl.modules.shared_prefix`). Padded (``packing=False``), a
    micro-batch costs ``groups x prefix + rows x rest`` (two backbone calls: the prefixes with
    their cache, then the rests); a micro-batch whose groups are single rows is an ordinary padded
    one. Packed (``packing=True`` or ``"auto"``: the *tree* layout, one backbone call), each group
    is one unit, its prefix once followed by its rows' real tokens, and units are packed
    first-fit like rows (``bins x bin width``); a micro-batch that shares nothing is an ordinary
    packed one (with ``packing="auto"`` only while no bin is wider than ``AUTO_TREE_MAX_WIDTH``:
    its dense mask holds ``bins x width^2`` elements; benchmarks/bench_shared_prefix.py: the tree was 1.15-1.3x the padded shared
    forward's speed at n = 4-8 on the CPU default). ``shared_padded=False`` allows only the
    packed layout (where the two-call forward cannot run: FSDP2, activation checkpointing; with
    ``packing=False`` nothing is then shared), ``shared_packed=False`` only the padded one (a
    model whose attention kernel takes no dense mask; with ``packing=True`` nothing is shared). ``"auto"`` shares when that computes at least ``AUTO_SHARED_MIN_SAVING``
    fewer tokens than the padded plan and no more than the packed plan ``packing`` would choose,
    else plans as ``packing`` says (a batch without ``tokens``/``loss_mask`` is not shared).

    Args:
        td: a TensorDict with batch size ``[B, L]`` holding ``attention_mask`` ``[B, L]`` bool
            (and, for ``shared_prefix``, ``tokens`` and ``loss_mask``).
        token_budget: max computed tokens per micro-batch.
        max_rows: optional max rows per micro-batch.
        packing: ``False`` (padded crops), ``True`` (padding-free forwards) or ``"auto"``.
        shared_prefix: ``False``, ``True`` or ``"auto"``.
        shared_padded: whether a shared micro-batch may be padded (``False``: packed only; with
            ``packing=False`` nothing is then shared, and ``shared_prefix=True`` is an error).
        shared_packed: whether it may be packed (``False``: padded only; with ``packing=True``
            nothing is then shared, and ``shared_prefix=True`` is an error).

    Raises:
        ValueError: a row longer than ``token_budget`` on its own, a row without any real token,
            or bad arguments.
    """
    check_token_budget(
        "plan_micro_batches", token_budget
    )  # the recipe's rollout.token_budget check
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"max_rows must be >= 1 or None, got {max_rows}")
    if packing not in (True, False, "auto"):
        raise ValueError(f"packing must be True, False or 'auto', got {packing!r}")
    if shared_prefix not in (True, False, "auto"):
        raise ValueError(f"shared_prefix must be True, False or 'auto', got {shared_prefix!r}")
    can_tree = packing is not False and shared_packed  # the layouts a shared plan may take
    can_pad = packing is not True and shared_padded
    if shared_prefix is True and packing is False and not can_pad:
        raise ValueError(
            "plan_micro_batches: shared_prefix=True with shared_padded=False needs packed "
            "micro-batches (the tree layout), but packing=False; use packing=True or 'auto', or "
            "shared_prefix='auto'"
        )
    if shared_prefix is True and not (can_tree or can_pad):
        raise ValueError(
            "plan_micro_batches: shared_prefix=True with shared_packed=False needs padded "
            "micro-batches, but packing=True; use packing=False or 'auto', or shared_prefix='auto'"
        )
    if td.batch_dims < 2:
        raise ValueError(
            f"plan_micro_batches expects a [B, L] TensorDict, got batch_size "
            f"{tuple(td.batch_size)}{_convert_hint(td)}"
        )
    mask = td.get(attention_mask_key, None)
    if mask is None:
        held = sorted(str(k) for k in td.keys(include_nested=True, leaves_only=True))
        raise _MissingLayoutKeyError(
            f"plan_micro_batches: the batch has no {attention_mask_key!r} (bool [B, L], True on real "
            f"tokens: a token trajectory's key, docs/design.md section 1); it holds "
            f"{held[:8]}{' ...' if len(held) > 8 else ''}{_convert_hint(td)}"
        )
    mask = mask.bool()
    keys = (tokens_key, loss_mask_key)
    first, last = (x.tolist() for x in _row_spans(mask))
    lengths = mask.sum(-1).tolist()
    _check_rows(lengths, [b - a for a, b in zip(first, last)], token_budget, attention_mask_key)
    order = sorted(range(mask.shape[0]), key=lambda i: (-lengths[i], i))
    size = (mask.shape[0], mask.shape[1])
    padded = MicroBatchPlan(
        _group_padded(order, first, last, token_budget, max_rows), size, token_budget
    )
    shared = None
    if shared_prefix is not False and (can_tree or can_pad):
        tree = can_tree  # one backbone call: faster where it can run (bench)
        shared = _shared_plan(
            td, mask, first, last, token_budget, max_rows, keys, shared_prefix, tree
        )
        if tree and can_pad and _too_wide(shared):
            shared = _shared_plan(
                td, mask, first, last, token_budget, max_rows, keys, shared_prefix, False
            )
        if shared_prefix is True:
            return shared
    pack = packing is True or (
        packing == "auto" and 1 - sum(lengths) / padded.num_tokens >= AUTO_PACKING_MIN_PADDING
    )
    packed = None
    if pack:
        micro = _group_packed(order, first, last, lengths, token_budget, max_rows)
        packed = MicroBatchPlan(micro, size, token_budget)
    if shared is not None and 1 - shared.num_tokens / padded.num_tokens >= AUTO_SHARED_MIN_SAVING:
        if packed is None or shared.num_tokens <= packed.num_tokens:
            return shared
    return packed if packed is not None else padded


def _too_wide(plan: MicroBatchPlan | None) -> bool:
    """Whether a tree plan has a bin wider than ``AUTO_TREE_MAX_WIDTH`` (its dense mask would
    hold ``bins x W x W`` elements)."""
    widths = [mb.packed_shape[1] for mb in plan.micro_batches if mb.packed] if plan else []
    return max(widths, default=0) > AUTO_TREE_MAX_WIDTH


def _shared_plan(
    td, mask, first, last, budget, max_rows, keys, mode, tree
) -> MicroBatchPlan | None:
    """The shared-prefix plan, padded or (``tree``) packed (``None`` for ``"auto"`` on a batch
    without the keys it needs)."""
    present = [k for k in keys if k in td.keys(include_nested=True)]
    if len(present) < len(keys):
        if mode == "auto":
            return None
        raise ValueError(
            f"plan_micro_batches: shared_prefix=True groups rows by {keys[0]!r} before their "
            f"first trained token ({keys[1]!r}); the batch has no {sorted(set(keys) - set(present))}"
        )
    tokens, loss_mask = td.get(keys[0]), td.get(keys[1]).bool()
    groups = _prefix_groups(tokens, mask, loss_mask)
    counts = _real_counts(mask) if tree else None
    micro = _group_shared(groups, first, last, budget, max_rows, counts)
    return MicroBatchPlan(micro, (mask.shape[0], mask.shape[1]), budget)


class _MissingLayoutKeyError(KeyError):
    """A key of the token-trajectory layout is missing (a ``KeyError`` whose message prints as
    written)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _convert_hint(td: TensorDictBase) -> str:
    """How to convert a raw TorchRL LLM batch (it holds ``("tokens", "response")``)."""
    if ("tokens", "response") not in td.keys(include_nested=True):  # ragged: never stacked
        return ""
    return (
        ". This is a raw TorchRL LLM batch (('tokens', 'response') per step): convert it first, "
        "with LLMCollector(..., postproc=TokenTrajectory.from_policy(policy)) or "
        "ar_torchrl.interop.TokenTrajectory(tokenizer, max_new_tokens=...)(batch)"
    )


def _check_rows(lengths: list[int], spans: list[int], budget: int, key: NestedKey) -> None:
    empty = [i for i, n in enumerate(lengths) if n == 0]
    if empty:
        raise ValueError(
            f"plan_micro_batches: rows {empty[:8]} have no real token in {key!r}; "
            "drop empty rows before planning"
        )
    too_long = max(spans, default=0)
    if too_long > budget:
        raise ValueError(
            f"token_budget={budget} is smaller than the longest row ({too_long} tokens); "
            f"raise token_budget to at least {too_long}"
        )


def _group_padded(order, first, last, budget, max_rows) -> tuple[MicroBatch, ...]:
    micro, current, lo, hi = [], [], 0, 0
    for i in order:
        new_lo, new_hi = (min(lo, first[i]), max(hi, last[i])) if current else (first[i], last[i])
        fits = (len(current) + 1) * (new_hi - new_lo) <= budget
        if current and (not fits or (max_rows is not None and len(current) >= max_rows)):
            micro.append(MicroBatch(tuple(sorted(current)), lo, hi))
            current, (new_lo, new_hi) = [], (first[i], last[i])
        current.append(i)
        lo, hi = new_lo, new_hi
    if current:
        micro.append(MicroBatch(tuple(sorted(current)), lo, hi))
    return tuple(micro)


def _group_packed(order, first, last, lengths, budget, max_rows) -> tuple[MicroBatch, ...]:
    """Micro-batches of first-fit bins as wide as their longest row, at most ``budget`` tokens.

    The longest remaining row opens a micro-batch; every remaining row, longest first, goes into
    the first bin with room, a new bin while ``bins x width <= budget``, or waits for a later
    micro-batch (so short rows fill the holes next to long ones). The rows of a micro-batch are
    placed in the order :func:`~ar_torchrl.modules.pack_rows` places them, so its bins are exactly
    the ones the packed forward lays out.
    """
    micro, remaining = [], list(order)
    while remaining:
        width = lengths[remaining[0]]
        room: list[int] = []
        current, waiting = [], []
        for i in remaining:
            b = next((k for k, free in enumerate(room) if free >= lengths[i]), len(room))
            full = max_rows is not None and len(current) >= max_rows
            if full or (b == len(room) and (b + 1) * width > budget):
                waiting.append(i)
                continue
            if b == len(room):
                room.append(width)
            room[b] -= lengths[i]
            current.append(i)
        rows = tuple(sorted(current))
        span = (min(first[i] for i in rows), max(last[i] for i in rows))
        micro.append(MicroBatch(rows, *span, packed_shape=(len(room), width)))
        remaining = waiting
    return tuple(micro)


@dataclass(frozen=True)
class _Group:
    """Rows the same on every column before ``split`` (their first trained token)."""

    rows: tuple[int, ...]
    split: int
    start: int
    end: int


def _prefix_groups(
    tokens: torch.Tensor, mask: torch.Tensor, loss_mask: torch.Tensor
) -> list[_Group]:
    """Rows grouped by their tokens and attention mask before their first trained token (a row
    with no trained token, or whose first real token is trained, is a group of its own)."""
    first, last = (x.tolist() for x in _row_spans(mask))
    trained = loss_mask & mask
    split = torch.where(trained.any(-1), trained.int().argmax(-1), -1).tolist()
    keys: dict[object, list[int]] = {}
    real = torch.where(mask, tokens, -1).tolist()  # padding apart from any token (holes too)
    for row, cut in enumerate(split):
        shareable = cut > first[row]
        key = (cut, tuple(real[row][first[row] : cut]), first[row]) if shareable else ("own", row)
        keys.setdefault(key, []).append(row)
    return [
        _Group(tuple(rows), split[rows[0]], first[rows[0]], max(last[r] for r in rows))
        for rows in keys.values()
    ]


def _group_shared(
    groups: list[_Group], first, last, budget, max_rows, counts=None
) -> tuple[MicroBatch, ...]:
    """Micro-batches of whole groups (longest first) within ``budget``, counted as ``groups x
    prefix + rows x rest`` (padded) or, given ``counts`` (``[B][L + 1]`` real tokens before each
    column), as the tree layout's ``bins x bin width``; a group too large for one micro-batch is
    split into several (sized by the padded count, which is never below the tree's)."""
    units = [piece for g in groups for piece in _split_group(g, first, last, budget, max_rows)]
    units.sort(key=lambda u: (-(u.end - u.start), u.rows[0]))

    def make(current: list[_Group]) -> MicroBatch:
        if counts is None:
            return _shared_micro_batch(current)
        return _tree_micro_batch(current, counts)

    micro, current = [], []
    for unit in units:
        candidate = [*current, unit]
        rows = sum(len(u.rows) for u in candidate)
        if current and (
            (_shared_cost(candidate) if counts is None else make(candidate).num_tokens) > budget
            or (max_rows is not None and rows > max_rows)
        ):
            micro.append(make(current))
            candidate = [unit]
        current = candidate
    if current:
        micro.append(make(current))
    return tuple(micro)


def _split_group(group: _Group, first, last, budget, max_rows) -> list[_Group]:
    """``group`` in pieces of at most as many rows as fit ``budget`` (and ``max_rows``) alone."""
    if group.split <= group.start:  # nothing shared: single rows
        return [_Group((r,), group.split, first[r], last[r]) for r in group.rows]
    rest = max(group.end - group.split, 1)
    fit = max(1, (budget - (group.split - group.start)) // rest)
    size = min(fit, max_rows or fit)
    pieces = [group.rows[k : k + size] for k in range(0, len(group.rows), size)]
    return [_Group(p, group.split, group.start, max(last[r] for r in p)) for p in pieces]


def _shared_cost(units: list[_Group]) -> int:
    start, end = min(u.start for u in units), max(u.end for u in units)
    split = min(u.split for u in units)
    rows = sum(len(u.rows) for u in units)
    if all(len(u.rows) == 1 for u in units) or split <= start:
        return rows * (end - start)  # an ordinary padded micro-batch
    return len(units) * (split - start) + rows * (end - split)


def _shared_micro_batch(units: list[_Group]) -> MicroBatch:
    start, end = min(u.start for u in units), max(u.end for u in units)
    split = min(u.split for u in units)
    rows = tuple(sorted(r for u in units for r in u.rows))
    if all(len(u.rows) == 1 for u in units) or split <= start:
        return MicroBatch(rows, start, end)
    group_of = {r: k for k, u in enumerate(units) for r in u.rows}
    return MicroBatch(rows, start, end, shared=(split, tuple(group_of[r] for r in rows)))


def _real_counts(mask: torch.Tensor) -> list[list[int]]:
    """``[B][L + 1]``: each row's real tokens before each column (``counts[r][b] - counts[r][a]``
    are the real tokens of ``[a, b)``)."""
    return torch.nn.functional.pad(mask.long().cumsum(-1), (1, 0)).tolist()


def _tree_micro_batch(units: list[_Group], counts: list[list[int]]) -> MicroBatch:
    """:func:`_shared_micro_batch` of ``units``, packed: the tree layout (each unit its prefix
    once, then its rows' own tokens; :func:`~ar_torchrl.modules.shared_prefix.tree_layout`) when
    they share a prefix, else an ordinary packed micro-batch; ``packed_shape`` from the same
    :func:`pack_rows` call the forward makes, on the same lengths in the same (group) order."""
    mb = _shared_micro_batch(units)
    if mb.shared is None:
        lengths = [counts[r][mb.end] - counts[r][mb.start] for r in mb.rows]
    else:
        split = mb.shared[0]
        lengths = [
            counts[u.rows[0]][split]
            - counts[u.rows[0]][mb.start]
            + sum(counts[r][mb.end] - counts[r][split] for r in u.rows)
            for u in units
        ]
    bins, _ = pack_rows(lengths)
    return dataclasses.replace(mb, packed_shape=(bins, max(lengths)))


def _halve(mb: MicroBatch, mask: torch.Tensor) -> list[MicroBatch]:
    """Two micro-batches from ``mb``'s rows (:func:`~ar_torchrl.distributed.shard_plan`, when
    there are fewer micro-batches than ranks), each re-cropped and keeping ``mb``'s layout: a
    padded one splits into its longer and shorter rows; a packed one into two packed halves; a
    shared one into two halves of whole groups (a single group: of its rows), balanced by the
    tokens they compute, each sharing as ``mb`` did."""
    first, last = (x.tolist() for x in _row_spans(mask))
    if mb.shared is None and not mb.packed:
        rows = sorted(mb.rows, key=lambda r: (-(last[r] - first[r]), r))
        halves = [rows[: len(rows) // 2], rows[len(rows) // 2 :]]
        return [
            MicroBatch(tuple(sorted(h)), min(first[r] for r in h), max(last[r] for r in h))
            for h in halves
        ]
    if mb.shared is None:  # packed rows: single-row units share nothing
        units = [[r] for r in mb.rows]
        split = -1
    else:
        split, groups = mb.shared
        by_group: dict[int, list[int]] = {}
        for row, group in zip(mb.rows, groups):
            by_group.setdefault(group, []).append(row)
        units = list(by_group.values())
        if len(units) == 1:
            rows = units[0]
            units = [rows[: len(rows) // 2], rows[len(rows) // 2 :]]
    counts = _real_counts(mask)
    size = [sum(counts[r][last[r]] - counts[r][first[r]] for r in u) for u in units]
    halves: list[list[list[int]]] = [[], []]
    load = [0, 0]
    for k in sorted(range(len(units)), key=lambda k: (-size[k], k)):
        side = 0 if load[0] <= load[1] else 1
        halves[side].append(units[k])
        load[side] += size[k]
    out = []
    for half in halves:
        pieces = [
            _Group(tuple(u), split, min(first[r] for r in u), max(last[r] for r in u)) for u in half
        ]
        out.append(_tree_micro_batch(pieces, counts) if mb.packed else _shared_micro_batch(pieces))
    return out
