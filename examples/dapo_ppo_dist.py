"""The recipe under torchrun: the process group, rank 0's decisions, the sharded policy.

With one process and a float32 model (the CPU default) nothing here changes the recipe: no process
group, no FSDP, ``.pt`` checkpoints. Under ``torchrun --nproc-per-node N examples/dapo_ppo.py`` (and
with ``model.dtype=bfloat16``, on a one-rank group) ``cfg.sharded`` is true and the recipe trains
with FSDP2 (:mod:`ar_torchrl.distributed`, docs/design.md section 7): one controller, rank 0, owns
the collector, the logs, the evaluation and the checkpoint metadata; every rank holds the batch,
trains on its token-balanced share of the micro-batch plan, takes part in the weight push and
writes its shards of each ``torch.distributed.checkpoint``. Every collective is reached by every
rank in the same order, including the decision to stop (:func:`agree_to_stop`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from dapo_ppo_config import Config, PretrainedModelConfig

from ar_torchrl.distributed import (
    DistContext,
    build_meta_model,
    checkpoint_decoder_layers,
    distributed,
    load_pretrained_weights,
    shard_actor_critic,
)
from ar_torchrl.models import check_tokenizer, load_hf_tokenizer
from ar_torchrl.modules import LMActorCritic, attach_value_head

#: ``dist.backend`` -> ``init_distributed(backend=...)`` (NCCL for GPU tensors, gloo for CPU ones).
BACKENDS = {"auto": None, "gloo": "gloo", "nccl": "cpu:gloo,cuda:nccl"}


# --------------------------------------------------------------------------- the launch
@contextlib.contextmanager
def process_group(cfg: Config) -> Iterator[DistContext]:
    """This process's :class:`DistContext`: torchrun's group (or a one-rank group) when
    ``cfg.sharded``, else a plain single process on ``cfg.device``; the group is closed at exit.
    Ranks > 0 log warnings and errors only (rank 0 speaks for the run)."""
    if not cfg.sharded:
        yield DistContext(device=torch.device(cfg.device))
        return
    if int(os.environ.get("RANK", "0")) > 0:
        logging.getLogger().setLevel(logging.WARNING)
    with distributed(
        cfg.device,
        process_group=True,
        backend=BACKENDS[cfg.dist.backend],
        timeout_s=cfg.dist.timeout_s,
    ) as ctx:
        yield ctx


def rank_0_run_dir(ctx: DistContext, run_dir: Path) -> Path:
    """Rank 0's run directory, on every rank (each rank's Hydra stamped its own start time).

    Ranks > 0 write no Hydra files (examples/dapo_ppo.py), so a directory of their own that differs
    is empty and is removed.
    """
    shared = ctx.broadcast_object(run_dir)
    if shared != run_dir:
        with contextlib.suppress(OSError):
            run_dir.rmdir()
    return shared


def on_rank_0(ctx: DistContext, fn, *args):
    """``fn(*args)`` on rank 0 (which reads and writes the run directory), its result on every rank.

    A user error there (``TypeError``, ``ValueError``, ``FileNotFoundError``) ends every rank; rank 0
    prints it as ``dapo_ppo: <message>``.
    """
    result = error = None
    if ctx.is_main:
        try:
            result = fn(*args)
        except (TypeError, ValueError, FileNotFoundError) as err:
            error = str(err)
    result, error = ctx.broadcast_object((result, error))
    if error is not None:
        sys.exit(f"dapo_ppo: {error}" if ctx.is_main else 1)
    return result


def agree_to_stop(ctx: DistContext, stop) -> bool:
    """Whether a signal asked any rank to stop (the same answer on every rank).

    torchrun forwards SIGTERM/SIGINT to every rank, but not at the same instant: the ranks agree
    once per iteration, so that all of them save the same checkpoint and leave the loop together
    (a rank that left alone would leave the others waiting in a collective). ``stop`` is the entry
    point's ``StopOnSignal``; it takes the agreed signal number.
    """
    if ctx.is_distributed and ctx.world_size > 1:
        signum = int(ctx.all_reduce(torch.tensor([stop.signum or 0]), op="max").item())
        if signum and not stop.requested:
            stop.signum = signum
    return stop.requested


# --------------------------------------------------------------------------- the sharded policy
def build_policy(cfg: Config, ctx: DistContext, build_model):
    """The starting policy with its value head on every rank: ``(model, tokenizer, start_dir)``.

    A pretrained model (``model.path``) without warm start is built on the meta device (no rank holds
    a full copy) and filled by :func:`shard` from ``start_dir``, shard by shard. Any other model is
    built eagerly on every rank, rank 0 first (it fills the warm-start and conversion caches that
    the others then read): the way for small models.
    """
    m = cfg.model
    if isinstance(m, PretrainedModelConfig) and not m.warm_start.enabled:
        tokenizer = load_hf_tokenizer(m.path)
        check_tokenizer(tokenizer, where=f"the tokenizer of model.path={m.path}")
        return (
            build_meta_model(m.path, attn_implementation=m.attn_implementation),
            tokenizer,
            Path(m.path),
        )
    built = None
    for turn in (True, False):  # rank 0, then the others
        if ctx.is_main == turn:
            built = build_model(cfg)
        ctx.barrier()
    model, tokenizer = built
    return attach_value_head(model).to(ctx.device), tokenizer, None


def build_reference(
    cfg: Config, model, start_dir: Path | None, temperature: float
) -> LMActorCritic:
    """The frozen starting policy of the KL term (an actor, no value head), sharded by :func:`shard`."""
    attn = getattr(cfg.model, "attn_implementation", None)
    ref = (
        copy.deepcopy(model)
        if start_dir is None
        else build_meta_model(start_dir, attn_implementation=attn)
    )
    del ref.value_head
    return LMActorCritic(ref.eval().requires_grad_(False), temperature=temperature, critic=False)


def prepare_for_training(
    cfg: Config, ctx: DistContext, modules: list[LMActorCritic | None], start_dir: Path | None
) -> None:
    """FSDP2 over every rank when ``cfg.sharded``: fp32 master shards, compute in ``model.dtype``
    (the value head in fp32); meta-built modules are then loaded from ``start_dir``. Activation
    checkpointing (``model.gradient_checkpointing``) in either case. Call it after the rollout
    engine copied the policy (the copy must not share the wrapped layers)."""
    m = cfg.model
    for module in [mod for mod in modules if mod is not None]:
        if not cfg.sharded:
            if m.gradient_checkpointing and module.critic:
                checkpoint_decoder_layers(module.model)
            continue
        shard_actor_critic(
            module,
            ctx,
            compute_dtype=m.dtype,
            activation_checkpointing=m.gradient_checkpointing,
            reshard_after_forward=cfg.dist.reshard_after_forward,
        )
        if start_dir is not None:
            load_pretrained_weights(module, start_dir, device=ctx.device)
