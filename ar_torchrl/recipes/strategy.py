"""The execution strategy: how a recipe runs, in one process or as FSDP2 ranks under torchrun.

A recipe never branches on "sharded": it asks its :class:`ExecutionStrategy` to build and wrap the
policy and its reference, recompute the old log-probs and values, push the weights, share the batch
and agree on stopping. Checkpoints are not its business: the run's
:class:`~ar_torchrl.checkpoint.CheckpointStore` (:func:`~ar_torchrl.checkpoint.checkpoint_store`)
saves and loads them. Two implementations:

- :class:`LocalStrategy`: one float32 process, no process group. This is what
  ``python examples/dapo_ppo.py`` runs.
- :class:`FSDP2Strategy`: ``torch.distributed`` FSDP2 (``fully_shard`` with fp32 master shards and
  low-precision compute, :mod:`ar_torchrl.distributed`), under torchrun or on a one-rank group when
  the compute dtype is not float32. One controller:
  rank 0 owns the collector, the logs, the evaluation and the checkpoint metadata; every rank holds
  the batch, trains on its token-balanced share of the micro-batch plan (its own old log-probs and values, ratio
  exactly 1 per rank), takes part in the weight push and writes its shards of each checkpoint.
  Every collective is reached by every rank in the same order, the decision to stop included.

:func:`open_strategy` is the one place that chooses.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from tensordict import TensorDictBase

from ar_torchrl.distributed.context import DistContext
from ar_torchrl.modules import LMActorCritic, LMCritic, attach_value_head
from ar_torchrl.training.micro_batch import MicroBatchPlan

__all__ = ["ExecutionStrategy", "FSDP2Strategy", "LocalStrategy", "open_strategy"]

logger = logging.getLogger(__name__)

#: ``dist.backend`` -> ``init_distributed(backend=...)`` (NCCL for GPU tensors, gloo for CPU ones).
PROCESS_GROUP_BACKENDS = {"auto": None, "gloo": "gloo", "nccl": "cpu:gloo,cuda:nccl"}


class ExecutionStrategy(Protocol):
    """What a recipe asks of its execution (see the module docstring)."""

    ctx: DistContext
    #: whether the trainer's own module can decode (the evaluation's trainside engine)
    trainer_can_generate: bool

    def build_policy(
        self, model_cfg: Any, cache_dir: str, *, value_head: bool = True
    ) -> tuple[Any, Any, Path | None]: ...
    def build_reference(self, model: Any, start_dir: Path | None, temperature: float) -> Any: ...
    def build_critic(
        self, model: Any, tokenizer: Any, start_dir: Path | None, model_path: str | None
    ) -> tuple[Any, Path | None]: ...
    def prepare(self, modules: list[tuple[Any, Path | None]]) -> None: ...
    def old_log_probs_and_values(
        self, actor_critic: Any, td: TensorDictBase, plan: MicroBatchPlan, ref: Any, critic: Any
    ): ...
    def push_weights(
        self, actor_critic: Any, collector: Any, *, resync: bool, dtype: Any
    ) -> None: ...
    def broadcast_batch(self, td: TensorDictBase | None) -> TensorDictBase: ...
    def on_main(self, fn: Callable[..., Any], *args: Any) -> Any: ...
    def shared_run_dir(self, run_dir: Path) -> Path: ...
    def agree_to_stop(self, stop: Any) -> bool: ...


# --------------------------------------------------------------------------- one process
class LocalStrategy:
    """One process on ``device`` in float32: no process group.

    Args:
        device: the trainer's device.
        gradient_checkpointing: recompute each decoder layer of the trained policy in backward.

    Example:
        >>> s = LocalStrategy("cpu")
        >>> s.ctx.world_size, s.trainer_can_generate, s.on_main(len, [1, 2])
        (1, True, 2)
    """

    trainer_can_generate = True

    def __init__(self, device: str = "cpu", *, gradient_checkpointing: bool = False) -> None:
        self.ctx = DistContext(device=torch.device(device))
        self.gradient_checkpointing = gradient_checkpointing

    def build_policy(
        self, model_cfg: Any, cache_dir: str, *, value_head: bool = True
    ) -> tuple[Any, Any, Path | None]:
        """``(policy, tokenizer, None)`` on this process's device, with a zero value head unless
        ``value_head=False`` (a separate critic computes the values)."""
        model, tokenizer = model_cfg.build(cache_dir=cache_dir)
        model = attach_value_head(model) if value_head else model
        return model.to(self.ctx.device), tokenizer, None

    def build_reference(self, model: Any, start_dir: Path | None, temperature: float) -> Any:
        """A frozen copy of the starting policy (log-probs only), for the KL term."""
        ref = copy.deepcopy(model)
        if hasattr(ref, "value_head"):
            del ref.value_head
        ref = ref.to(self.ctx.device).eval().requires_grad_(False)
        return LMActorCritic(ref, temperature=temperature, critic=False)

    def build_critic(
        self, model: Any, tokenizer: Any, start_dir: Path | None, model_path: str | None
    ) -> tuple[LMCritic, Path | None]:
        """The separate critic: a copy of the starting ``model`` or the HF model at
        ``model_path`` (same tokenizer), with a fresh zero value head."""
        return _eager_critic(model, tokenizer, model_path, self.ctx.device), None

    def prepare(self, modules: list[tuple[Any, Path | None]]) -> None:
        """Activation checkpointing of the trained modules (those with trainable parameters)
        when asked for."""
        from ar_torchrl.distributed.fsdp import checkpoint_decoder_layers

        for module, _ in modules:
            if module is not None and self.gradient_checkpointing and _trained(module):
                checkpoint_decoder_layers(module.model)

    def old_log_probs_and_values(self, actor_critic, td, plan, ref, critic=None):
        from ar_torchrl.training import recompute_old_log_probs_and_values

        recompute_old_log_probs_and_values(actor_critic, td, plan, ref_actor=ref, critic=critic)
        return plan

    def push_weights(self, actor_critic, collector, *, resync: bool, dtype: Any) -> None:
        collector.resync_policy_weights_() if resync else collector.update_policy_weights_()

    def broadcast_batch(self, td: TensorDictBase | None) -> TensorDictBase:
        return td.to(self.ctx.device)

    def on_main(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)

    def shared_run_dir(self, run_dir: Path) -> Path:
        return run_dir

    def agree_to_stop(self, stop: Any) -> bool:
        return stop.requested


def _trained(module: Any) -> bool:
    return any(p.requires_grad for p in module.parameters())


def _eager_critic(
    model: Any, tokenizer: Any, model_path: str | None, device: torch.device
) -> LMCritic:
    """A separate critic built in memory: a copy of ``model`` or the HF model at ``model_path``
    (float32, checked to have the policy's tokenizer)."""
    from ar_torchrl.modules import build_separate_critic

    critic_model = None
    if model_path is not None:
        critic_model = _load_critic_model(model_path, tokenizer)
    return build_separate_critic(model, critic_model).to(device)


def _load_critic_model(model_path: str, tokenizer: Any) -> Any:
    from ar_torchrl.models.hf import load_hf_model
    from ar_torchrl.modules import check_same_tokenizer

    if not Path(model_path).is_dir():
        raise FileNotFoundError(
            f"config: critic.model_path={model_path!r} is not a directory: give a local Hugging "
            "Face model directory (config.json, weights, tokenizer) or null for a copy of the policy"
        )
    critic_model, critic_tokenizer = load_hf_model(model_path, dtype="float32")
    check_same_tokenizer(tokenizer, critic_tokenizer, where=f"critic.model_path={model_path}")
    return critic_model


# --------------------------------------------------------------------------- FSDP2
class FSDP2Strategy:
    """FSDP2 over every rank of ``ctx`` (see the module docstring).

    Args:
        ctx: this rank's process group context (:func:`ar_torchrl.distributed.distributed`).
        compute_dtype: the compute dtype name (masters and optimizer states stay float32).
        gradient_checkpointing: recompute each decoder layer in backward.
        reshard_after_forward: FSDP2's option (free gathered layers after forward).
    """

    trainer_can_generate = False  # the trainer holds shards: the rollout copy decodes

    def __init__(
        self,
        ctx: DistContext,
        *,
        compute_dtype: str = "bfloat16",
        gradient_checkpointing: bool = False,
        reshard_after_forward: bool = True,
    ) -> None:
        self.ctx, self.compute_dtype = ctx, compute_dtype
        self.gradient_checkpointing = gradient_checkpointing
        self.reshard_after_forward = reshard_after_forward
        self._attn: str | None = None

    def build_policy(
        self, model_cfg: Any, cache_dir: str, *, value_head: bool = True
    ) -> tuple[Any, Any, Path | None]:
        """The starting policy (with its value head unless ``value_head=False``) on every rank:
        ``(model, tokenizer, start_dir)``.

        A model with a ``meta_source()`` (a pretrained HF directory, no warm start) is built on the
        meta device (no rank holds a full copy) and filled in :meth:`prepare` from that directory,
        shard by shard. Any other model is built eagerly on every rank, rank 0 first (it fills the
        warm-start and conversion caches that the others then read): the way for small models.
        """
        from ar_torchrl.distributed.loading import build_meta_model
        from ar_torchrl.models.hf import check_tokenizer, load_hf_tokenizer

        start_dir = model_cfg.meta_source()
        self._attn = getattr(model_cfg, "attn_implementation", None)
        if start_dir is not None:
            tokenizer = load_hf_tokenizer(start_dir)
            check_tokenizer(tokenizer, where=f"the tokenizer of model.path={start_dir}")
            model = build_meta_model(
                start_dir, attn_implementation=self._attn, value_head=value_head
            )
            return model, tokenizer, start_dir
        built = None
        for turn in (True, False):  # rank 0, then the others
            if self.ctx.is_main == turn:
                built = model_cfg.build(cache_dir=cache_dir)
            self.ctx.barrier()
        model, tokenizer = built
        model = attach_value_head(model) if value_head else model
        return model.to(self.ctx.device), tokenizer, None

    def build_reference(self, model: Any, start_dir: Path | None, temperature: float) -> Any:
        """The frozen starting policy of the KL term (an actor, no value head), sharded in
        :meth:`prepare`."""
        from ar_torchrl.distributed.loading import build_meta_model

        if start_dir is None:
            ref = copy.deepcopy(model)
        else:
            ref = build_meta_model(start_dir, attn_implementation=self._attn, value_head=False)
        if hasattr(ref, "value_head"):
            del ref.value_head
        return LMActorCritic(
            ref.eval().requires_grad_(False), temperature=temperature, critic=False
        )

    def build_critic(
        self, model: Any, tokenizer: Any, start_dir: Path | None, model_path: str | None
    ) -> tuple[LMCritic, Path | None]:
        """The separate critic and the directory :meth:`prepare` loads it from: on the meta device
        from ``model_path`` or the policy's ``start_dir`` (no rank holds a full copy), else a copy
        of the eagerly built ``model`` (or ``model_path`` loaded on every rank)."""
        from ar_torchrl.distributed.loading import build_meta_model
        from ar_torchrl.models.hf import load_hf_tokenizer
        from ar_torchrl.modules import check_same_tokenizer

        source = Path(model_path) if model_path is not None else start_dir
        if source is None:
            return _eager_critic(model, tokenizer, None, self.ctx.device), None
        if model_path is not None:
            if not source.is_dir():
                _load_critic_model(model_path, tokenizer)  # raises naming the key
            where = f"critic.model_path={model_path}"
            check_same_tokenizer(tokenizer, load_hf_tokenizer(source), where=where)
        critic = build_meta_model(source, attn_implementation=self._attn)
        return LMCritic(critic), source

    def prepare(self, modules: list[tuple[Any, Path | None]]) -> None:
        """FSDP2 over every rank: fp32 master shards, compute in ``compute_dtype`` (the value head
        in fp32); meta-built modules are then loaded from their directory (``(module, dir)``
        pairs). Call it after the rollout engine copied the policy (the copy must not share the
        wrapped layers)."""
        from ar_torchrl.distributed.fsdp import shard_actor_critic
        from ar_torchrl.distributed.loading import load_pretrained_weights

        for module, start_dir in [(m, d) for m, d in modules if m is not None]:
            shard_actor_critic(
                module,
                self.ctx,
                compute_dtype=self.compute_dtype,
                activation_checkpointing=self.gradient_checkpointing,
                reshard_after_forward=self.reshard_after_forward,
            )
            if start_dir is not None:
                load_pretrained_weights(module, start_dir, device=self.ctx.device)

    def old_log_probs_and_values(self, actor_critic, td, plan, ref, critic=None):
        """This rank's :class:`~ar_torchrl.distributed.ShardedPlan` and its old log-probs and values (summed)."""
        from ar_torchrl.distributed.batch import recompute_sharded_old_log_probs_and_values
        from ar_torchrl.distributed.plan import shard_plan

        sharded = shard_plan(plan, td, rank=self.ctx.rank, world_size=self.ctx.world_size)
        recompute_sharded_old_log_probs_and_values(
            actor_critic, td, sharded, ref_actor=ref, critic=critic
        )
        return sharded

    def push_weights(self, actor_critic, collector, *, resync: bool, dtype: Any) -> None:
        """Every rank gathers the tensors one by one; rank 0's collector sends them."""
        from ar_torchrl.distributed.weights import push_weights

        sync = None
        if collector is not None:
            sync = collector.resync_policy_weights_ if resync else collector.update_policy_weights_
        push_weights(actor_critic, self.ctx, sync, dtype=dtype)

    def broadcast_batch(self, td: TensorDictBase | None) -> TensorDictBase:
        from ar_torchrl.distributed.batch import broadcast_batch

        return broadcast_batch(td, self.ctx)

    def on_main(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on rank 0 (which reads and writes the run directory), its result on every
        rank. A user error there (``TypeError``, ``ValueError``, ``FileNotFoundError``) is raised on
        every rank as a ``ValueError`` with rank 0's message."""
        result = error = None
        if self.ctx.is_main:
            try:
                result = fn(*args)
            except (TypeError, ValueError, FileNotFoundError) as err:
                error = (type(err), str(err))
        result, error = self.ctx.broadcast_object((result, error))
        if error is not None:
            raise error[0](error[1])
        return result

    def shared_run_dir(self, run_dir: Path) -> Path:
        """Rank 0's run directory, on every rank (each rank's Hydra stamped its own start time);
        a differing, empty directory of this rank is removed."""
        shared = self.ctx.broadcast_object(run_dir)
        if shared != run_dir:
            with contextlib.suppress(OSError):
                run_dir.rmdir()
        return shared

    def agree_to_stop(self, stop: Any) -> bool:
        """Whether a signal asked any rank to stop (the same answer on every rank).

        torchrun forwards SIGTERM/SIGINT to every rank, but not at the same instant: the ranks agree
        once per iteration, so that all of them save the same checkpoint and leave the loop together
        (a rank that left alone would leave the others waiting in a collective). ``stop`` takes the
        agreed signal number.
        """
        if self.ctx.world_size > 1:
            signum = int(self.ctx.all_reduce(torch.tensor([stop.signum or 0]), op="max").item())
            if signum and not stop.requested:
                stop.signum = signum
        return stop.requested


# --------------------------------------------------------------------------- choosing
@contextlib.contextmanager
def open_strategy(
    *,
    sharded: bool,
    device: str,
    compute_dtype: str = "float32",
    gradient_checkpointing: bool = False,
    reshard_after_forward: bool = True,
    backend: str = "auto",
    timeout_s: float = 1800.0,
) -> Iterator[ExecutionStrategy]:
    """The strategy of this launch: :class:`FSDP2Strategy` on torchrun's group (or a one-rank group)
    when ``sharded``, else :class:`LocalStrategy`; the group is closed at exit. Ranks > 0 log
    warnings and errors only (rank 0 speaks for the run)."""
    if not sharded:
        yield LocalStrategy(device, gradient_checkpointing=gradient_checkpointing)
        return
    from ar_torchrl.distributed.context import distributed

    if int(os.environ.get("RANK", "0")) > 0:
        logging.getLogger().setLevel(logging.WARNING)
    with distributed(
        device,
        process_group=True,
        backend=PROCESS_GROUP_BACKENDS[backend],
        timeout_s=timeout_s,
    ) as ctx:
        yield FSDP2Strategy(
            ctx,
            compute_dtype=compute_dtype,
            gradient_checkpointing=gradient_checkpointing,
            reshard_after_forward=reshard_after_forward,
        )
