"""One controller: rank 0's rollout batch reaches every rank; old log-probs and values are computed per rank, shared.

Rank 0 owns the collector (rollouts and rewards). :func:`broadcast_batch` sends its ``[B, L]``
TensorDict to every rank (tensordict's consolidated broadcast: one metadata message and one storage
buffer). Each rank then computes the old log-probs and values of the micro-batches it owns
(:func:`recompute_sharded_old_log_probs_and_values`) and the ranks sum them, so every rank holds the anchors of the
whole batch (needed by whole-batch statistics such as advantage whitening) while each rank's own
rows carry exactly the numbers its own forward produced (ratio exactly 1 on the first update).
"""

from __future__ import annotations

from tensordict import TensorDict, TensorDictBase
from torchrl.objectives import LossModule

from ar_torchrl.distributed.context import DistContext
from ar_torchrl.distributed.fsdp import reshard
from ar_torchrl.distributed.plan import ShardedPlan
from ar_torchrl.modules import LMActorCritic, LMCritic
from ar_torchrl.training.old_log_probs import _output_keys, recompute_old_log_probs_and_values

__all__ = ["broadcast_batch", "recompute_sharded_old_log_probs_and_values"]


def broadcast_batch(td: TensorDictBase | None, ctx: DistContext, src: int = 0) -> TensorDictBase:
    """Rank ``src``'s ``td`` on every rank, on ``ctx.device`` (other ranks pass ``None``).

    Without a process group (or at world size 1) ``td`` is returned moved to ``ctx.device``.

    Example:
        >>> import torch
        >>> td = TensorDict({"tokens": torch.ones(2, 3, dtype=torch.long)}, [2, 3])
        >>> broadcast_batch(td, DistContext())["tokens"].shape
        torch.Size([2, 3])
    """
    if ctx.rank == src and td is None:
        raise ValueError(f"broadcast_batch: rank {src} (the source) must pass the batch, got None")
    if not ctx.is_distributed or ctx.world_size == 1:
        return td.to(ctx.device)
    if ctx.rank == src:
        out = td.to(ctx.device).broadcast(src, device=ctx.device)
    else:
        out = TensorDict().broadcast(src, device=ctx.device)
    return out.unlock_()  # consolidated TensorDicts come locked; the old log-probs are added to it


def recompute_sharded_old_log_probs_and_values(
    actor_critic: LMActorCritic,
    td: TensorDictBase,
    sharded: ShardedPlan,
    *,
    ref_actor: LMActorCritic | None = None,
    loss: LossModule | None = None,
    critic: LMCritic | None = None,
) -> TensorDictBase:
    """:func:`~ar_torchrl.objectives.recompute_old_log_probs_and_values` over this rank's micro-batches, then summed.

    Every rank runs the same number of forwards (its micro-batches plus padding passes, which FSDP's
    all-gathers need); each writes the old log-probs and values of its own rows and zeros elsewhere; the sum over ranks
    is exact (``x + 0 = x``). Arguments and keys are those of ``recompute_old_log_probs_and_values``; returns ``td``.
    Afterwards the FSDP roots are resharded (FSDP2 keeps a root gathered after a forward without
    backward, which would also hide the fp32 shards from an optimizer built now).
    """
    if critic is None and getattr(loss, "separate_critic", False):
        critic = loss.critic_network
    recompute_old_log_probs_and_values(
        actor_critic, td, sharded.local_plan, ref_actor=ref_actor, loss=loss, critic=critic
    )
    for key in _output_keys(actor_critic, ref_actor, loss, critic):
        sharded.all_reduce_(td.get(key))
    for module in (actor_critic, ref_actor, critic):
        if module is not None:
            reshard(module)
    return td
