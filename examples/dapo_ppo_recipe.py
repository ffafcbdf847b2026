"""The DAPO-math PPO recipe: ``setup`` builds every piece, ``train`` is the loop.

examples/dapo_ppo.py runs it: it checks the configuration (examples/dapo_ppo_config.py), finds the
checkpoint to resume and handles signals, then imports this module (torch, transformers, TorchRL:
the slow imports) and calls ``setup(cfg, ...)`` and ``train(run, stop)``. The building blocks are in
dapo_ppo_build.py, the data-parallel plumbing (torchrun, FSDP2) in dapo_ppo_dist.py.

One iteration: collect a batch of rollouts -> recompute the PPO anchors (old log-probs and values)
with the trainer's own model and micro-batch plan -> advantages (a registered estimator: GAE or
GRPO) -> ``ppo_epochs`` over mini-batches of the plan's micro-batches (gradient accumulation,
gradient clipping) -> push the new weights to the rollout backend. Under torchrun rank 0 collects
and every rank trains on its share of the plan (its own anchors, the same advantages).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dapo_ppo_dist as parallel
import torch
from dapo_ppo_build import (  # noqa: F401 (build_datasets and build_model: tests reach them here)
    build_advantage,
    build_backend,
    build_datasets,
    build_envs,
    build_model,
    build_optimizer,
    dynamic_sampling,
    seed_everything,
)
from dapo_ppo_config import Config
from tqdm.auto import tqdm

from ar_torchrl.checkpoint import load_checkpoint, save_checkpoint
from ar_torchrl.collectors import WeightSyncCollector
from ar_torchrl.data import plan_micro_batches
from ar_torchrl.distributed import (
    DistContext,
    broadcast_batch,
    load_distributed_checkpoint,
    push_weights,
    recompute_sharded_anchors,
    save_distributed_checkpoint,
    shard_plan,
)
from ar_torchrl.envs import LLMEnv
from ar_torchrl.functional import masked_mean
from ar_torchrl.modules import LMActorCritic, attach_value_head
from ar_torchrl.objectives import TokenPPOLoss, recompute_anchors
from ar_torchrl.training import ppo_update
from ar_torchrl.utils import StageTimer, append_jsonl, log_metrics, make_logger

log = logging.getLogger("dapo_ppo")


# --------------------------------------------------------------------------- setup
@dataclass
class Run:
    """The pieces of a run, built by :func:`setup` and used by :func:`train`.

    Under torchrun only rank 0 has a ``collector``, an ``eval_env`` and a ``logger`` (``None``
    elsewhere); ``push_dtype`` is the rollout engine's dtype, the same on every rank.
    """

    cfg: Config
    run_dir: Path
    ctx: DistContext
    model: torch.nn.Module
    actor_critic: LMActorCritic
    ref_actor: LMActorCritic | None
    collector: WeightSyncCollector | None
    eval_env: LLMEnv | None
    advantage: Any
    loss_fn: TokenPPOLoss
    optimizer: torch.optim.Optimizer
    shuffle_rng: torch.Generator
    push_dtype: torch.dtype | None = None
    logger: Any = None
    start: int = 0
    timer: StageTimer = field(default_factory=StageTimer)


def setup(
    cfg: Config,
    run_dir: Path,
    checkpoint: Path | None,
    stack: contextlib.ExitStack,
    ctx: DistContext | None = None,
) -> Run:
    """Build everything a run needs (``ctx``: this rank; default one process); continue from
    ``checkpoint`` when given."""
    ctx = ctx or DistContext(device=torch.device(cfg.device))
    torch.set_num_threads(cfg.num_threads)
    seed_everything(cfg.seed)
    # 1. Data: training prompts and held-out evaluation prompts, DAPO-Math schema (rank 0 samples).
    rows, eval_rows = build_datasets(cfg) if ctx.is_main else ([], [])
    # 2. Model: policy + zero-initialised value head; a frozen copy of the start policy for KL.
    #    Log-probs are those of the sampling distribution (temperature-scaled; greedy: T = 1).
    model, tokenizer, ref_actor, start_dir = build_policy(cfg, ctx)
    actor_critic = LMActorCritic(model, temperature=cfg.rollout.temperature or 1.0)
    # 3. Rollouts (rank 0): backend -> LLMEnv -> WeightSyncCollector (async: next batch in the
    #    background).
    collector = eval_env = backend = None
    if ctx.is_main:
        backend = build_backend(cfg, model, tokenizer, run_dir, stack, start_dir=start_dir)
        env, eval_env = build_envs(cfg, rows, eval_rows, tokenizer, backend, model)
        collector = WeightSyncCollector(
            env,
            model,
            mode=cfg.train.mode,
            max_policy_lag=1,
            dynamic_sampling=dynamic_sampling(cfg),
            max_sampling_rounds=cfg.rollout.max_sampling_rounds,
        )
        stack.callback(collector.shutdown)  # also on errors: waits for an in-flight batch
    # 4. FSDP2 (torchrun, or compute in bf16 over fp32 masters), activation checkpointing.
    parallel.prepare_for_training(cfg, ctx, [actor_critic, ref_actor], start_dir)
    # 5. Advantage estimator, PPO loss, optimizer (value head in its own group).
    a = cfg.algo
    loss_fn = TokenPPOLoss(
        actor_critic,
        clip_epsilon=tuple(a.clip_epsilon),
        clip_value=a.clip_value,
        entropy_coeff=a.entropy_coeff,
        critic_coeff=a.critic_coeff,
        kl_coeff=a.kl_coeff,
        loss_agg_mode=a.loss_agg_mode,
        norm_length=cfg.rollout.max_new_tokens,
    )
    run = Run(
        cfg,
        run_dir,
        ctx,
        model,
        actor_critic,
        ref_actor,
        collector,
        eval_env,
        build_advantage(cfg),
        loss_fn,
        build_optimizer(cfg, model),
        torch.Generator().manual_seed(cfg.seed),
        ctx.broadcast_object(getattr(backend, "weight_dtype", None)),
    )
    # 6. Resume: model + value head, optimizer, RNG states, data position, versions, step.
    if checkpoint is not None:
        run.start = restore(run, checkpoint)
    elif start_dir is not None and getattr(cfg.backend, "url", None) is not None:
        push_policy(run, resync=True)  # a running server holds other weights
    if ctx.is_main:
        run.logger = make_logger(
            cfg.logger.kind,
            log_dir=run_dir / "logs",
            exp_name=cfg.logger.exp_name,
            project=cfg.logger.project,
        )
        collector.total_batches = cfg.train.iterations - run.start  # batches left in this run
    return run


def build_policy(cfg: Config, ctx: DistContext):
    """``(policy with value head, tokenizer, reference actor or None, start_dir)``; ``start_dir``
    is the HF directory a meta-built (FSDP2) policy is loaded from, else ``None``."""
    temperature = cfg.rollout.temperature or 1.0
    if cfg.sharded:  # every rank (dapo_ppo_dist.py)
        model, tokenizer, start_dir = parallel.build_policy(cfg, ctx, build_model)
        ref_actor = None
        if cfg.algo.kl_coeff > 0:
            ref_actor = parallel.build_reference(cfg, model, start_dir, temperature)
        return model, tokenizer, ref_actor, start_dir
    model, tokenizer = build_model(cfg)
    ref_actor = None
    if cfg.algo.kl_coeff > 0:
        ref = copy.deepcopy(model).to(ctx.device).eval().requires_grad_(False)
        ref_actor = LMActorCritic(ref, temperature=temperature, critic=False)  # log-probs only
    return attach_value_head(model).to(ctx.device), tokenizer, ref_actor, None


def restore(run: Run, checkpoint: Path) -> int:
    """Load ``checkpoint`` into the run (every rank under FSDP2); returns its step."""
    if run.cfg.sharded:  # this rank's model and optimizer shards, its RNG states
        state = load_distributed_checkpoint(
            checkpoint, model=run.actor_critic, optimizer=run.optimizer, ctx=run.ctx
        )
    else:  # + RNG states
        state = load_checkpoint(checkpoint, model=run.model, optimizer=run.optimizer)
    if run.collector is not None:  # data position, policy version
        run.collector.load_state_dict(state["extra"]["collector"])
    run.shuffle_rng.set_state(state["extra"]["shuffle_rng"])
    push_policy(run, resync=True)  # the backend still holds the starting weights
    log.info("resumed from %s (step %d)", checkpoint, state["step"])
    return state["step"]


# --------------------------------------------------------------------------- the loop
def train(run: Run, stop) -> int:
    """The PPO loop from ``run.start`` to ``train.iterations``; returns the last finished step.

    ``stop.requested`` (SIGINT/SIGTERM) ends it after the current step, with a checkpoint.
    """
    cfg, t = run.cfg, run.cfg.train
    if t.eval_every and run.start == 0:  # baseline: the starting policy, logged as step 0
        record(run, 0, evaluate(run))
    batches, step = iter(run.collector) if run.collector else None, run.start
    steps = range(run.start + 1, t.iterations + 1)
    for step in (
        tqdm(steps, desc="PPO", initial=run.start, total=t.iterations) if run.ctx.is_main else steps
    ):
        # 1. Rollouts: wait for the batch (async: mostly generated during the last update); under
        #    torchrun rank 0 collects it and every rank receives it.
        with run.timer("generate"):
            td = broadcast_batch(next(batches) if batches else None, run.ctx)
        losses = {"train/update_skipped": float(td.shape[0] == 0)}
        if td.shape[0] == 0:  # dynamic sampling kept no group (every answer equal): skip the update
            log.warning(
                "step %d: no group with a reward spread after rollout.max_sampling_rounds; "
                "update skipped",
                step,
            )
        else:
            # 2. Anchors: old log-probs and values (+ reference log-probs), training geometry
            #    (under torchrun: each rank's share of the plan; the same anchors on every rank).
            with run.timer("anchors"):
                plan = anchors(run, td)
            # 3. Advantages (GAE or GRPO), identical on every rank.
            with run.timer("advantage"):
                td = run.advantage(td)
            # 4. PPO epochs over mini-batches of micro-batches (critic warm-up: value head only).
            with run.timer("update"):
                losses.update(
                    update(run, td, plan, critic_only=step <= cfg.algo.critic_warmup_iters)
                )
            # 5. Push the new weights (never the value head) to the rollout backend.
            with run.timer("sync"):
                push_policy(run)
        # 6. Log and evaluate (rank 0); checkpoint on schedule or when a signal reached any rank.
        metrics = {**rollout_metrics(run, td), **losses, **run.timer.pop()}
        if t.eval_every and (step % t.eval_every == 0 or step == t.iterations):
            metrics.update(evaluate(run))
        record(run, step, metrics)
        stopping = parallel.agree_to_stop(run.ctx, stop)
        if (
            stopping
            or step == t.iterations
            or (t.checkpoint_every and step % t.checkpoint_every == 0)
        ):
            save(run, step)
        if stopping:
            break
    if run.collector:
        run.collector.shutdown()
    return step


def anchors(run: Run, td):
    """The micro-batch plan (this rank's :class:`ShardedPlan` under FSDP2) and the anchors of
    ``td`` computed with exactly those micro-batches (ratio exactly 1 on the first update)."""
    r = run.cfg.rollout
    plan = plan_micro_batches(td, r.token_budget, r.max_rows, packing=r.packing)
    if not run.cfg.sharded:
        recompute_anchors(run.actor_critic, td, plan, ref_actor=run.ref_actor)
        return plan
    plan = shard_plan(plan, td, rank=run.ctx.rank, world_size=run.ctx.world_size)
    recompute_sharded_anchors(run.actor_critic, td, plan, ref_actor=run.ref_actor)
    return plan


def push_policy(run: Run, *, resync: bool = False) -> None:
    """The policy to the rollout engine as the next version (``resync``: again, as the restored
    one). Under FSDP2 every rank gathers the tensors one by one and rank 0's collector sends them."""
    collector = run.collector
    if not run.cfg.sharded:
        collector.resync_policy_weights_() if resync else collector.update_policy_weights_()
        return
    sync = None
    if collector is not None:
        sync = collector.resync_policy_weights_ if resync else collector.update_policy_weights_
    push_weights(run.actor_critic, run.ctx, sync, dtype=run.push_dtype)


def update(run: Run, td, plan, *, critic_only: bool) -> dict[str, float]:
    """``algo.ppo_epochs`` x mini-batches; ``critic_only``: only the value head's loss and weights."""
    a = run.cfg.algo
    head = list(run.model.value_head.parameters())
    if a.num_minibatches > len(plan):
        log.warning(
            "algo.num_minibatches=%d but the batch has only %d micro-batches: using %d "
            "(train/optimizer_steps shows it)",
            a.num_minibatches,
            len(plan),
            len(plan),
        )
    return ppo_update(
        run.loss_fn,
        run.optimizer,
        td,
        plan,
        epochs=a.ppo_epochs,
        num_minibatches=min(a.num_minibatches, len(plan)),
        grad_clip=a.grad_clip,
        loss_keys=("loss_critic",) if critic_only else None,
        trainable=head if critic_only else None,
        generator=run.shuffle_rng,
    )


def rollout_metrics(run: Run, td) -> dict[str, float]:
    """Reward and accuracy over EVERY generated sample (the collector's stats: unbiased when
    dynamic sampling dropped groups), groups generated / kept / dropped, and the trained batch's
    response length and rollout-vs-trainer log-prob drift over generated tokens (rank 0)."""
    if run.collector is None:
        return {}
    stats = {k: v for k, v in run.collector.last_batch_stats.items() if k != "samples"}
    out = {
        **{f"rollout/{k}": float(v) for k, v in stats.items()},
        "rollout/policy_lag": float(run.collector.last_policy_lag),
    }
    if td.shape[0]:
        mask = td["loss_mask"]
        drift = (td["rollout_log_prob"] - td["sample_log_prob"]).abs()
        out["rollout/response_length"] = float(mask.sum(-1).float().mean())
        out["rollout/logprob_drift"] = float(masked_mean(drift, mask))
        grpo = getattr(run.advantage, "stats", {})  # e.g. GRPO's group counts
        out.update({f"rollout/{k}": float(v) for k, v in grpo.items()})
    return out


def evaluate(run: Run) -> dict[str, float]:
    """Greedy decoding on the held-out prompts: mean reward and accuracy (rank 0, on the rollout
    engine: the other ranks go on to the next collective and wait there)."""
    if run.eval_env is None:
        return {}
    td = run.eval_env.rollout()
    reward = td["next", "reward"].squeeze(-1).sum(-1)
    return {
        "eval/reward_mean": float(reward.mean()),
        "eval/accuracy": float((reward > 0).float().mean()),
    }


def record(run: Run, step: int, metrics: dict[str, float]) -> None:
    """Append to ``metrics.jsonl`` (what resuming and the plot read) and the TorchRL logger (rank 0)."""
    if not run.ctx.is_main:
        return
    append_jsonl(run.run_dir / "metrics.jsonl", {"step": step, **metrics})
    log_metrics(run.logger, metrics, step)


def save(run: Run, step: int) -> Path:
    """An atomic checkpoint; in async mode it includes the batch generated in the background.

    Under FSDP2 a ``torch.distributed.checkpoint`` directory: every rank writes its shards and RNG
    states, rank 0 the metadata (the collector state included).
    """
    extra = {"shuffle_rng": run.shuffle_rng.get_state()}
    if run.collector is not None:
        extra["collector"] = run.collector.state_dict(include_pending=True)
    directory, keep = run.run_dir / "checkpoints", run.cfg.train.keep_checkpoints
    if run.cfg.sharded:
        return save_distributed_checkpoint(
            directory,
            step=step,
            model=run.actor_critic,
            optimizer=run.optimizer,
            ctx=run.ctx,
            extra=extra,
            keep_last=keep,
        )
    return save_checkpoint(
        directory, step=step, model=run.model, optimizer=run.optimizer, extra=extra, keep_last=keep
    )
