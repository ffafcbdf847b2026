"""Data parallelism over a micro-batch plan: each rank's token-balanced share, in lockstep.

Every rank holds the whole rollout batch and the same :class:`~ar_torchrl.data.MicroBatchPlan`.
:func:`shard_plan` gives each micro-batch an owner rank (longest-processing-time first on the padded
token counts, after splitting micro-batches when there are fewer than ranks). A rank computes the
old log-probs and values of exactly the micro-batches it owns and trains on exactly those, so the first update still
sees ratio exactly 1. FSDP's collectives need the same number of forward/backward passes on every
rank: a rank with fewer micro-batches runs *padding* passes (:attr:`MicroBatch.padding`: a 1-row,
2-token crop that contributes nothing). Loss normalisers and metrics are summed over ranks
(:meth:`ShardedPlan.reduce`; maxima and minima with ``op="max"``/``"min"``), so N ranks compute
the gradient and the metrics one process computes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from tensordict import TensorDictBase
from tensordict.utils import NestedKey

from ar_torchrl.training.micro_batch import (
    MicroBatch,
    MicroBatchPlan,
    ReduceOp,
    _halve,
    _row_spans,
)

__all__ = ["ShardedPlan", "shard_plan"]

#: ``Plan.reduce``'s ``op`` -> the collective's.
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@dataclass(frozen=True)
class ShardedPlan:
    """One rank's view of a micro-batch plan shared by ``world_size`` ranks.

    Attributes:
        plan: the global plan (after any split), identical on every rank.
        owners: the owner rank of each micro-batch of ``plan``.
        filler: the padding micro-batch (``padding=True``).
        rank, world_size: this rank and the number of ranks.
        collective: sum over ranks with ``torch.distributed`` (``False``: a single process).

    Example:
        >>> from tensordict import TensorDict
        >>> from ar_torchrl.training import plan_micro_batches
        >>> td = TensorDict({"attention_mask": torch.ones(5, 4, dtype=torch.bool)}, [5, 4])
        >>> plan = plan_micro_batches(td, token_budget=8)  # 3 micro-batches: 2 + 2 + 1 rows
        >>> rank1 = shard_plan(plan, td, rank=1, world_size=2, collective=False)
        >>> rank1.owners, rank1.rank_tokens()  # rank 0: 8 + 4 tokens, rank 1: 8
        ((0, 1, 0), [12, 8])
        >>> [(mb.rows, mb.padding) for mb in rank1.local_plan.micro_batches]  # + a padding pass
        [((2, 3), False), ((0,), True)]
    """

    plan: MicroBatchPlan
    owners: tuple[int, ...]
    filler: MicroBatch
    rank: int
    world_size: int
    collective: bool = field(default=True)

    @property
    def batch_size(self) -> tuple[int, int]:
        return self.plan.batch_size

    def __len__(self) -> int:
        return len(self.plan)

    def owned(self, rank: int | None = None) -> tuple[MicroBatch, ...]:
        """The micro-batches ``rank`` (default: this rank) owns, in plan order."""
        rank = self.rank if rank is None else rank
        return tuple(mb for mb, o in zip(self.plan.micro_batches, self.owners) if o == rank)

    def rank_tokens(self) -> list[int]:
        """Padded tokens (``rows x width``) each rank computes, by rank."""
        loads = [0] * self.world_size
        for mb, owner in zip(self.plan.micro_batches, self.owners):
            loads[owner] += mb.num_tokens
        return loads

    @property
    def local_plan(self) -> MicroBatchPlan:
        """This rank's micro-batches plus padding passes up to the largest rank's count.

        Pass it to :func:`~ar_torchrl.objectives.recompute_old_log_probs_and_values`: every rank runs the same
        number of forwards, each fills the old log-probs and values of its own rows (then :meth:`all_reduce_` them).
        """
        most = max(sum(o == r for o in self.owners) for r in range(self.world_size))
        mine = self.owned()
        padded = mine + (self.filler,) * (most - len(mine))
        return MicroBatchPlan(padded, self.plan.batch_size, self.plan.token_budget)

    def crop(self, td: TensorDictBase, mb: MicroBatch) -> TensorDictBase:
        return self.plan.crop(td, mb)

    def minibatches(
        self, num_minibatches: int, generator: torch.Generator | None = None
    ) -> list[list[MicroBatch]]:
        """This rank's part of each of ``num_minibatches`` mini-batches, padded to equal counts.

        One permutation of the whole plan is drawn (the generator advances as in
        :meth:`MicroBatchPlan.minibatches`, identically on every rank); each rank's micro-batches in
        that order are concatenated rank after rank and dealt round-robin into the mini-batches. At
        world size 1 this is exactly :meth:`MicroBatchPlan.minibatches`. Each mini-batch gives every
        rank the same number of passes (padding where a rank has fewer).
        """
        n = len(self.plan)
        if not 1 <= num_minibatches <= n:
            raise ValueError(
                f"cannot make {num_minibatches} mini-batches from {n} micro-batches; "
                "lower num_minibatches or the token_budget / max_rows of the plan"
            )
        order = torch.randperm(n, generator=generator).tolist()
        dealt = [i for r in range(self.world_size) for i in order if self.owners[i] == r]
        groups = []
        for k in range(num_minibatches):
            members = dealt[k::num_minibatches]
            counts = [sum(self.owners[i] == r for i in members) for r in range(self.world_size)]
            mine = [self.plan.micro_batches[i] for i in members if self.owners[i] == self.rank]
            groups.append(mine + [self.filler] * (max(counts) - len(mine)))
        return groups

    @property
    def spans_ranks(self) -> bool:
        """Always: a rank's share runs in lockstep with the other ranks' (every backward pass runs,
        :class:`~ar_torchrl.training.micro_batch.Plan`); at world size 1 :meth:`reduce` is the identity."""
        return True

    def reduce(self, values: Mapping[str, float], op: ReduceOp = "sum") -> dict[str, float]:
        """Sum (``op="max"``/``"min"``: the extreme of) scalar ``values`` over ranks, in one
        collective; every rank passes the same keys (none: no collective)."""
        keys = sorted(values)
        if not self.collective or self.world_size == 1 or not keys:
            return {k: float(values[k]) for k in keys}
        packed = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
        dist.all_reduce(packed, op=_OPS[op])
        return dict(zip(keys, packed.tolist()))

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks in place (old log-probs and values: each rank filled its own rows, 0 elsewhere)."""
        if self.collective and self.world_size > 1:
            dist.all_reduce(tensor)
        return tensor


def _filler(first: torch.Tensor, last: torch.Tensor, length: int) -> MicroBatch:
    """A 1-row, 2-token padding pass over real tokens of the shortest row that has two."""
    if length < 2:
        raise ValueError(f"shard_plan: sequences of length {length} cannot make a padding pass")
    spans = sorted(range(len(first)), key=lambda r: (int(last[r] - first[r]), r))
    row = next((r for r in spans if int(last[r] - first[r]) >= 2), spans[0])
    start = min(int(first[row]), length - 2)
    return MicroBatch((row,), start, start + 2, padding=True)


def _assign(micro: list[MicroBatch], world_size: int) -> tuple[int, ...]:
    """Longest-processing-time first: the largest micro-batch goes to the least-loaded rank."""
    loads, counts, owners = [0] * world_size, [0] * world_size, [0] * len(micro)
    for i in sorted(range(len(micro)), key=lambda i: (-micro[i].num_tokens, i)):
        rank = min(range(world_size), key=lambda r: (loads[r], counts[r], r))
        owners[i] = rank
        loads[rank] += micro[i].num_tokens
        counts[rank] += 1
    return tuple(owners)


def shard_plan(
    plan: MicroBatchPlan,
    td: TensorDictBase,
    *,
    rank: int,
    world_size: int,
    collective: bool = True,
    attention_mask_key: NestedKey = "attention_mask",
) -> ShardedPlan:
    """Give every micro-batch of ``plan`` an owner rank, balancing padded tokens.

    While there are fewer micro-batches than ranks, the largest one with at least two rows is split
    in two (padded: its longer and shorter rows; packed and shared ones keep their layout, shared
    ones split between whole groups; each half re-cropped), so no rank idles when the rows allow it.
    Every rank must call this with the same ``plan`` and ``td`` (it is deterministic).

    Args:
        plan: the micro-batch plan of ``td`` (:func:`~ar_torchrl.data.plan_micro_batches`).
        td: the ``[B, L]`` batch (its ``attention_mask`` places splits and the padding pass).
        rank, world_size: this rank and the number of ranks (``DistContext.rank/world_size``).
        collective: sum normalisers, metrics and old log-probs with ``torch.distributed``.

    Raises:
        ValueError: a ``td`` of another batch size than ``plan``, or bad rank/world size.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"shard_plan: need 0 <= rank < world_size, got {rank=}, {world_size=}")
    if tuple(td.batch_size[:2]) != plan.batch_size:
        raise ValueError(
            f"shard_plan: plan was made for batch size {plan.batch_size}, got {tuple(td.batch_size)}"
        )
    mask = td.get(attention_mask_key).bool()
    first, last = _row_spans(mask)
    micro = list(plan.micro_batches)
    while len(micro) < world_size:
        splittable = [mb for mb in micro if len(mb.rows) > 1]
        if not splittable:
            break
        largest = max(splittable, key=lambda mb: (mb.num_tokens, -micro.index(mb)))
        at = micro.index(largest)
        micro[at : at + 1] = _halve(largest, mask)
    new_plan = MicroBatchPlan(tuple(micro), plan.batch_size, plan.token_budget)
    return ShardedPlan(
        new_plan,
        _assign(micro, world_size),
        _filler(first, last, plan.batch_size[1]),
        rank,
        world_size,
        collective,
    )
