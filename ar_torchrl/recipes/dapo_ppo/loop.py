"""The DAPO-PPO loop: :func:`setup` builds every piece of a run, :func:`train` runs it.

One iteration: collect a batch of rollouts -> recompute the old log-probs and values
with the trainer's own model and micro-batch plan -> advantages (a registered estimator: GAE, GRPO,
RLOO) -> ``ppo_epochs`` over mini-batches of the plan's micro-batches (gradient accumulation,
gradient clipping) -> push the new weights to the rollout engine. The execution strategy
(:mod:`ar_torchrl.recipes.strategy`) decides how each step runs (one process, or FSDP2 ranks of
which rank 0 collects and every rank trains on its share of the plan).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict
from tqdm.auto import tqdm

from ar_torchrl.checkpoint import CheckpointStore, checkpoint_store
from ar_torchrl.collectors import WeightSyncCollector
from ar_torchrl.collectors.sampling import episode_stats
from ar_torchrl.envs import LLMEnv
from ar_torchrl.functional import masked_mean
from ar_torchrl.modules import (
    LMActorCritic,
    LMCritic,
    attach_confidence_features,
    why_not_shared,
    why_not_tree,
)
from ar_torchrl.objectives import TokenPPOLoss
from ar_torchrl.objectives.metrics import critic_health
from ar_torchrl.recipes.dapo_ppo import build, rollouts
from ar_torchrl.recipes.dapo_ppo.config import Config
from ar_torchrl.recipes.strategy import ExecutionStrategy
from ar_torchrl.training import lr_schedule_factor, plan_micro_batches, ppo_update
from ar_torchrl.utils import StageTimer, append_jsonl, log_metrics, make_logger

__all__ = ["CriticWarmup", "CriticWatch", "Run", "export", "pretrain_critic", "setup", "train"]

logger = logging.getLogger(__name__)


#: How to measure what a critic could know (the warning of :class:`CriticWatch`).
CEILING_HINT = "python benchmarks/critic_ceiling.py --run {run_dir}"


class CriticWatch:
    """``train.critic_warn_iters``: warn once per streak when ``critic/explained_variance`` stays
    ``<= 0`` for ``iters`` consecutive iterations that define it (an iteration where it is
    undefined, every return equal, neither counts nor breaks the streak); ``0``: never.

    Example:
        >>> watch = CriticWatch(2, run_dir="runs/x")
        >>> [watch.update(ev) for ev in (-0.1, None, 0.0, -0.3, 0.2, -0.1, -0.1)]
        [False, False, True, False, False, False, True]
    """

    def __init__(self, iters: int, *, run_dir: str | Path) -> None:
        self.iters, self.run_dir = int(iters), run_dir
        self.streak = 0

    def update(self, ev: float | None, step: int | None = None) -> bool:
        """Count this iteration's EV (``None``: undefined); ``True`` (and a logged warning) when a
        streak reaches ``iters``."""
        if not self.iters or ev is None:
            return False
        self.streak = self.streak + 1 if ev <= 0 else 0
        if self.streak != self.iters:
            return False
        logger.warning(
            "%scritic/explained_variance has been <= 0 for %d iterations: the critic predicts "
            "nothing (its values of each fresh batch explain none of the returns' variance). That "
            "is the optimum when the prompt and the response prefix carry no information about the "
            "outcome; check how much they carry with `%s` (the EV ceiling of this run's policy): "
            "an EV near 0 under a ceiling near 0 is right, under a high ceiling the critic is not "
            "learning (docs/critic.md)",
            "" if step is None else f"step {step}: ",
            self.iters,
            CEILING_HINT.format(run_dir=self.run_dir),
        )
        return True


class CriticWarmup:
    """``algo.critic_warmup_iters`` and ``algo.critic_warmup_until_ev``: which iterations train
    only the critic (the policy's weights stay bit-identical).

    Without a target the first ``iters`` iterations do. With ``until_ev = x`` the warm-up ends at
    the first iteration whose batch the critic already predicts, ``critic/explained_variance >= x``
    (measured on the batch's old values, before the update: that iteration trains the policy
    too), and at the latest after ``iters`` iterations (the cap; a warning says the target was
    not reached). Once ended it stays ended (:attr:`done` is saved in checkpoints).

    Example:
        >>> w = CriticWarmup(3, until_ev=0.5)
        >>> [w.critic_only(step, ev) for step, ev in ((1, 0.1), (2, 0.6), (3, 0.1))]
        [True, False, False]
        >>> [CriticWarmup(2).critic_only(step, None) for step in (1, 2, 3)]
        [True, True, False]
    """

    def __init__(self, iters: int, *, until_ev: float | None = None, done: bool = False) -> None:
        self.iters, self.until_ev, self.done = int(iters), until_ev, bool(done)

    def critic_only(self, step: int, ev: float | None) -> bool:
        """Whether iteration ``step`` (1-based) trains only the critic, given its batch's
        ``critic/explained_variance`` (``None``: undefined)."""
        if self.done or step > self.iters:
            if not self.done and self.until_ev is not None and step == self.iters + 1:
                logger.warning(
                    "critic warm-up: %d critic-only iterations (algo.critic_warmup_iters) without "
                    "reaching algo.critic_warmup_until_ev=%g (critic/explained_variance %s); the "
                    "policy trains from step %d on",
                    self.iters,
                    self.until_ev,
                    "undefined" if ev is None else f"{ev:.3f}",
                    step,
                )
            self.done = self.done or self.until_ev is not None
            return False
        if self.until_ev is not None and ev is not None and ev >= self.until_ev:
            logger.info(
                "critic warm-up: critic/explained_variance %.3f >= %g at step %d; the policy "
                "trains from this step on",
                ev,
                self.until_ev,
                step,
            )
            self.done = True
            return False
        return True


@dataclass
class Run:
    """The pieces of a run, built by :func:`setup` and used by :func:`train`.

    Under torchrun only rank 0 has a ``collector``, an ``eval_env`` and a ``logger`` (``None``
    elsewhere); ``push_dtype`` is the rollout engine's dtype, the same on every rank. ``critic``
    is the separate critic (``critic=separate``; ``None``: the values come from ``actor_critic``'s
    value head). ``store`` saves and loads the run's checkpoints.
    """

    cfg: Config
    run_dir: Path
    strategy: ExecutionStrategy
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
    kl_reward: Any = None  # KLRewardShaping when algo.kl_in_reward > 0 (before the advantage)
    critic: LMCritic | None = None
    store: CheckpointStore | None = None
    tokenizer: Any = None  # the policy's, written with the exported models
    warmup: CriticWarmup | None = None  # algo.critic_warmup_iters / critic_warmup_until_ev
    watch: CriticWatch | None = None  # train.critic_warn_iters
    # (rollout.shared_prefix, shared_padded, shared_packed) as the plans take them: shared_prefix_mode
    shared_prefix: Any = (False, True, True)

    @property
    def is_main(self) -> bool:
        return self.strategy.ctx.is_main

    @property
    def value_model(self) -> torch.nn.Module:
        """The HF model carrying the value head: the separate critic's, else the policy."""
        return self.model if self.critic is None else self.critic.model

    def critic_parameters(self) -> list[torch.nn.Parameter]:
        """What a critic-only pass trains: the separate critic, else the policy's value head."""
        module = self.critic if self.critic is not None else self.model.value_head
        return list(module.parameters())


# --------------------------------------------------------------------------- setup
def setup(
    cfg: Config,
    run_dir: Path,
    checkpoint: Path | None,
    stack: contextlib.ExitStack,
    strategy: ExecutionStrategy,
    critic_source: Path | None = None,
    *,
    store: CheckpointStore | None = None,
) -> Run:
    """Build everything a run needs; continue from ``checkpoint`` when given, else warm-start the
    critic from ``critic_source`` (an earlier run's checkpoint) when given. ``store``: the run's
    checkpoint store (``None``: the one ``cfg`` asks for)."""
    ctx = strategy.ctx
    if store is None:
        store = checkpoint_store(
            sharded=cfg.sharded, ctx=ctx, hmac_key_env=cfg.checkpoint.hmac_key_env
        )
    torch.set_num_threads(cfg.num_threads)
    build.seed_everything(cfg.seed)
    # 1. Data: training prompts and held-out evaluation prompts (rank 0 samples).
    datasets = build.build_datasets(cfg) if ctx.is_main else None
    # 2. Model: policy + zero-initialised value head; a frozen copy of the start policy for KL.
    #    Log-probs are those of the sampling distribution (temperature-scaled; greedy: T = 1).
    #    critic=separate: the policy has no value head; a second model (a copy of the starting
    #    policy, or critic.model_path) carries one.
    temperature = cfg.rollout.temperature or 1.0
    separate = cfg.critic.kind == "separate"
    model, tokenizer, start_dir = strategy.build_policy(
        cfg.model, cfg.cache_dir, value_head=not separate
    )
    critic = critic_dir = None
    if separate:
        critic, critic_dir = strategy.build_critic(
            model, tokenizer, start_dir, cfg.critic.model_path
        )
    if cfg.algo.value_norm == "popart":  # normalised value targets (before FSDP2 shards the head)
        build.use_popart(model if critic is None else critic.model, cfg.algo.popart_beta)
    if cfg.critic.confidence_features:  # the value head also reads rollout_log_prob
        attach_confidence_features(model if critic is None else critic.model)
    ref_actor = None
    if cfg.algo.kl_coeff > 0 or cfg.algo.kl_in_reward > 0:
        ref_actor = strategy.build_reference(model, start_dir, temperature)
    actor_critic = LMActorCritic(model, temperature=temperature, critic=not separate)
    # 3. Rollouts (rank 0): backend -> LLMEnv -> WeightSyncCollector (async: next batch in the
    #    background).
    collector = eval_env = backend = None
    if ctx.is_main:
        backend = build.build_backend(cfg, model, tokenizer, run_dir, stack, start_dir=start_dir)
        backend.partial_rollouts = cfg.train.partial_rollouts  # a sync interrupts generation
        # every prompt checked once against the context (the model's and the engine's)
        context = build.context_length(model, backend)
        rows, eval_rows = build.fit_prompts(cfg, datasets, tokenizer, context)
        env, eval_env = build.build_envs(
            cfg,
            rows,
            eval_rows,
            tokenizer,
            backend,
            model,
            trainer_can_generate=strategy.trainer_can_generate,
        )
        r = cfg.rollout
        collector = WeightSyncCollector(
            env,
            model,
            mode=cfg.train.mode,
            max_policy_lag=cfg.train.max_policy_lag,
            dynamic_sampling=r.dynamic_sampling,
            max_sampling_rounds=r.max_sampling_rounds,
            critic_flat_groups=r.critic_flat_groups,
        )
        stack.callback(collector.shutdown)  # also on errors: waits for an in-flight batch
    # 4. Wrap for training (FSDP2 under torchrun or bf16 compute; activation checkpointing).
    strategy.prepare([(actor_critic, start_dir), (ref_actor, start_dir), (critic, critic_dir)])
    # 5. Advantage estimator, PPO loss, optimizer (the critic in its own group).
    run = Run(
        cfg,
        run_dir,
        strategy,
        model,
        actor_critic,
        ref_actor,
        collector,
        eval_env,
        build.build_advantage(cfg),
        build.build_loss(cfg, actor_critic, critic),
        build.build_optimizer(cfg, model, critic),
        torch.Generator().manual_seed(cfg.seed),
        ctx.broadcast_object(backend.weight_dtype if backend is not None else None),
        critic=critic,
        store=store,
        tokenizer=tokenizer,
    )
    if cfg.algo.kl_in_reward > 0:  # the KL as a per-token reward (k1), before GAE
        from ar_torchrl.objectives import KLRewardShaping

        run.kl_reward = KLRewardShaping(cfg.algo.kl_in_reward)
    run.warmup = CriticWarmup(
        cfg.algo.critic_warmup_iters, until_ev=cfg.algo.critic_warmup_until_ev
    )
    run.watch = CriticWatch(cfg.train.critic_warn_iters, run_dir=run_dir)
    run.shared_prefix = shared_prefix_mode(cfg, actor_critic, ref_actor, critic)
    # 6. The engine's first weights (the one place that decides them): a checkpoint's, or the
    #    trainer's when the engine does not start with them (servers that were already running).
    starts_with_ours = ctx.broadcast_object(
        cfg.backend.starts_with_trainer_weights() if ctx.is_main else None
    )
    if checkpoint is not None:
        run.start = restore(run, checkpoint)
    elif critic_source is not None:  # critic warm start: weights only, a fresh optimizer state
        what = store.load_critic(critic_source, critic=critic, actor_critic=actor_critic)
        logger.info("critic.init_from: the critic starts from %s", what)
    if checkpoint is not None or not starts_with_ours:
        push_policy(run, resync=True)
    if ctx.is_main:
        run.logger = make_logger(
            cfg.logger.kind,
            log_dir=run_dir / "logs",
            exp_name=cfg.logger.exp_name,
            project=cfg.logger.project,
        )
        collector.total_batches = cfg.train.iterations - run.start  # batches left in this run
    return run


def restore(run: Run, checkpoint: Path) -> int:
    """Load ``checkpoint`` into the run (every rank under FSDP2); returns its step."""
    state = run.store.load(
        checkpoint, actor_critic=run.actor_critic, optimizer=run.optimizer, critic=run.critic
    )
    if run.collector is not None:  # data position, policy version
        run.collector.load_state_dict(state["extra"]["collector"])
    run.shuffle_rng.set_state(state["extra"]["shuffle_rng"])
    run.warmup.done = bool(state["extra"].get("critic_warmup_done", False))
    build.critic_clip_groups(run.optimizer)  # a checkpoint saved before they had their own
    logger.info("resumed from %s (step %d)", checkpoint, state["step"])
    return state["step"]


# --------------------------------------------------------------------------- the loop
def train(run: Run, stop: Any) -> int:
    """The PPO loop from ``run.start`` to ``train.iterations``; returns the last finished step.

    ``stop.requested`` (SIGINT/SIGTERM) ends it after the current step, with a checkpoint.
    """
    cfg, t = run.cfg, run.cfg.train
    if cfg.critic.pretrain_from is not None and run.start == 0:  # offline, before the first batch
        engine_memory(run, release=True)
        pretrain_critic(run, Path(cfg.critic.pretrain_from))
        engine_memory(run, release=False)
        if cfg.backend.releases_memory_during_update():
            push_policy(run, resync=True)  # the same weights again: the engine generates
    if t.eval_every and run.start == 0:  # baseline: the starting policy, logged as step 0
        record(run, 0, evaluate(run, announce=True))
    batches, step = iter(run.collector) if run.collector else None, run.start
    steps = range(run.start + 1, t.iterations + 1)
    bar = None
    if run.is_main:
        desc = cfg.algo.advantage_mode.upper()
        steps = bar = tqdm(steps, desc=desc, initial=run.start, total=t.iterations)
    for step in steps:
        # 1. Rollouts: wait for the batch (async: mostly generated during the last update); under
        #    torchrun rank 0 collects it and every rank receives it.
        with run.timer("generate"):
            td = run.strategy.broadcast_batch(next(batches) if batches else None)
        losses = {"train/update_skipped": float(td.shape[0] == 0)}
        if td.shape[0] == 0:  # dynamic sampling kept no group (every answer equal): skip the update
            logger.warning(
                "step %d: no group with a reward spread after rollout.max_sampling_rounds; "
                "update skipped",
                step,
            )
        else:
            # 2. Anchors: old log-probs and values (+ reference log-probs), training geometry
            #    (under torchrun: each rank's share of the plan; the same old log-probs and values on every rank);
            #    a colocated engine first releases its memory (backend.release_memory_during_update).
            engine_memory(run, release=True)
            with run.timer("old_log_probs"):
                plan = old_log_probs_and_values(run, td)
            losses.update(plan_metrics(plan))
            # 3. Advantages (GAE, GRPO or RLOO), identical on every rank; the critic's health:
            #    its old values (before the update) against the Monte-Carlo returns.
            with run.timer("advantage"):
                td = advantages(run, td, losses)
            health = critic_metrics(run, td)
            losses.update(health)
            ev = health.get("critic/explained_variance")
            if run.is_main:
                run.watch.update(ev, step)
                if t.save_rollouts:  # the batch as trained on (critic.pretrain_from)
                    rollouts.save_rollout(run.run_dir, step, td)
            # 4. PPO epochs over mini-batches of micro-batches (critic warm-up: the critic only),
            #    the critic's learning rate on its schedule.
            losses["train/critic_lr"] = set_critic_lr(run, step)
            critic_only = run.warmup.critic_only(step, ev)
            if cfg.algo.critic_warmup_iters:
                losses["train/critic_warmup"] = float(critic_only)
            with run.timer("update"):
                losses.update(update(run, td, plan, critic_only=critic_only))
            engine_memory(run, release=False)  # resumed; the push below lets it generate again
            # 5. Push the new weights (never the value head) to the rollout backend.
            with run.timer("sync"):
                push_policy(run)
        # 6. Log and evaluate (rank 0); checkpoint on schedule or when a signal reached any rank.
        metrics = {**rollout_metrics(run, td), **losses, **run.timer.pop()}
        if t.eval_every and (step % t.eval_every == 0 or step == t.iterations):
            metrics.update(evaluate(run))
        record(run, step, metrics)
        if bar is not None:
            bar.set_postfix(progress_fields(metrics), refresh=False)
        stopping = run.strategy.agree_to_stop(stop)
        scheduled = t.checkpoint_every and step % t.checkpoint_every == 0
        if stopping or step == t.iterations or scheduled:
            save(run, step)
        if stopping:
            break
    if run.collector:
        run.collector.shutdown()
    return step


def export(run: Run) -> dict[str, Path]:
    """The trained models as HF directories (``train.export``): ``run_dir/policy/`` (safetensors,
    tokenizer, no ``value_head.*``) and, with a separate critic, ``run_dir/critic/``; under FSDP2
    every rank gathers, rank 0 writes (:func:`~ar_torchrl.distributed.export_trained`). Returns
    what rank 0 wrote."""
    if not run.cfg.train.export:
        return {}
    from ar_torchrl.distributed.export import export_trained

    started = time.perf_counter()
    written = export_trained(
        run.strategy.ctx, run.run_dir, policy=run.model, tokenizer=run.tokenizer, critic=run.critic
    )
    for name, path in written.items():
        logger.info("exported the %s to %s (%.1f s)", name, path, time.perf_counter() - started)
    return written


def progress_fields(metrics: dict[str, float]) -> dict[str, str]:
    """What the progress bar shows: reward, accuracy, (when evaluated) held-out accuracy, and (with
    a critic, when defined) the critic's out-of-sample ``critic/explained_variance``."""
    shown = {
        "reward": "rollout/reward_mean",
        "acc": "rollout/accuracy",
        "eval": "eval/accuracy",
        "ev": "critic/explained_variance",
    }
    return {k: f"{metrics[v]:.2f}" for k, v in shown.items() if metrics.get(v) is not None}


def advantages(run: Run, td, losses: dict[str, float]):
    """The KL reward shaping (``algo.kl_in_reward``), the advantage estimator and the PopArt
    statistics (``algo.value_norm=popart``) on a batch with its anchors; their metrics go to
    ``losses``. The same full batch on every rank."""
    if run.kl_reward is not None:  # -beta * k1 on every trained token, before GAE
        td = run.kl_reward(td)
        losses["train/kl_in_reward"] = run.kl_reward.last_kl
    td = run.advantage(td)
    if run.cfg.algo.value_norm == "popart":
        head = run.value_model.value_head
        head.update_statistics(td["value_target"][td["loss_mask"]])
        losses["train/value_norm_mu"] = float(head.mu)
        losses["train/value_norm_sigma"] = float(head.sigma)
    return td


def critic_metrics(run: Run, td) -> dict[str, float]:
    """:func:`~ar_torchrl.objectives.metrics.critic_health` of the batch (its old values against
    its Monte-Carlo returns at ``algo.gamma``; within prompts when ``rollout.samples_per_prompt
    >= 2``) when the run has a critic, else nothing."""
    if not run.cfg.algo.critic_coeff > 0:
        return {}
    keys = run.loss_fn.tensor_keys
    # within prompts only with groups: at one sample per prompt the few prompts a batch happens
    # to draw twice would make a number out of a handful of tokens
    groups = "prompt_id" if run.cfg.rollout.samples_per_prompt >= 2 else None
    return critic_health(
        td,
        run.cfg.algo.gamma,
        value_key=keys.value,
        reward_key=("next", keys.reward),
        mask_key=keys.loss_mask,
        group_key=groups,
    )


def old_log_probs_and_values(run: Run, td):
    """The micro-batch plan (this rank's share under FSDP2) and the old log-probs and values of ``td`` computed with
    exactly those micro-batches (ratio exactly 1 on the first update)."""
    r = run.cfg.rollout
    mode, shared_padded, shared_packed = run.shared_prefix
    plan = plan_micro_batches(
        td,
        r.token_budget,
        r.max_rows,
        packing=r.packing,
        shared_prefix=mode,
        shared_padded=shared_padded,
        shared_packed=shared_packed,
    )
    return run.strategy.old_log_probs_and_values(
        run.actor_critic, td, plan, run.ref_actor, run.critic
    )


def plan_metrics(plan) -> dict[str, float]:
    """The geometry the old-log-prob pass and the update ran (the whole plan, every rank's share):
    ``plan/micro_batches``, how many were ``plan/packed`` and ``plan/shared`` (both: the tree
    layout), and ``plan/computed_tokens`` (padding and bin slack included)."""
    whole = getattr(plan, "plan", plan)  # a ShardedPlan's global plan
    micro = whole.micro_batches
    return {
        "plan/micro_batches": float(len(micro)),
        "plan/packed": float(sum(mb.packed for mb in micro)),
        "plan/shared": float(sum(mb.shared is not None for mb in micro)),
        "plan/computed_tokens": float(whole.num_tokens),
    }


def shared_prefix_mode(
    cfg: Config, *modules: LMActorCritic | LMCritic | None
) -> tuple[bool | str, bool, bool]:
    """``(rollout.shared_prefix, shared_padded, shared_packed)`` as the run's plans take them (the
    old-log-prob pass and the update share one plan, so one geometry). Padded shared micro-batches
    (two backbone calls, the prefix's cache) are left out under FSDP2 and when a model cannot run
    them (:func:`~ar_torchrl.modules.why_not_shared`: activation checkpointing); packed ones (the
    tree layout, one call) when a model cannot run them (:func:`~ar_torchrl.modules.why_not_tree`:
    a kernel without dense masks) or ``rollout.packing=false``. With neither, ``auto`` plans
    without sharing and ``true`` is an error naming the key."""
    mode, packing = cfg.rollout.shared_prefix, cfg.rollout.packing
    if mode is False:
        return False, True, True
    models = [m.model for m in modules if m is not None]
    padded_reason = "FSDP2 runs it unverified" if cfg.sharded else None
    padded_reason = padded_reason or next(filter(None, map(why_not_shared, models)), None)
    tree_reason = "rollout.packing=false" if packing is False else None
    tree_reason = tree_reason or next(filter(None, map(why_not_tree, models)), None)
    if padded_reason is None or tree_reason is None:
        for layout, reason in (("packed", padded_reason), ("padded", tree_reason)):
            if reason is not None:
                logger.info(
                    "rollout.shared_prefix: %s shared micro-batches only (%s)", layout, reason
                )
        return mode, padded_reason is None, tree_reason is None
    reason = f"padded ones: {padded_reason}; packed ones: {tree_reason}"
    if mode is True:
        raise ValueError(
            f"config: rollout.shared_prefix=true, but no shared-prefix forward can run ({reason}); "
            "set rollout.shared_prefix=false or auto"
        )
    logger.info("rollout.shared_prefix=auto plans without shared prefixes (%s)", reason)
    return False, True, True


def engine_memory(run: Run, *, release: bool) -> None:
    """``backend.release_memory_during_update``: a colocated SGLang engine releases its GPU memory
    before the trainer allocates (every rank waits for it) and resumes it after the update (every
    rank done first); nothing otherwise. The weight push after the update resumes generation."""
    if not run.cfg.backend.releases_memory_during_update():
        return
    backend = run.collector.env.backend if run.collector is not None else None
    if not release:
        run.strategy.ctx.barrier()
    if backend is not None:
        backend.release_memory() if release else backend.resume_memory()
    if release:
        run.strategy.ctx.barrier()


def push_policy(run: Run, *, resync: bool = False) -> None:
    """The policy to the rollout engine as the next version (``resync``: again, as the current or
    restored one)."""
    run.strategy.push_weights(run.actor_critic, run.collector, resync=resync, dtype=run.push_dtype)


def set_critic_lr(run: Run, step: int) -> float:
    """The critic's param group gets ``algo.value_lr`` (or ``algo.lr``) times its schedule's factor
    at ``step`` (:func:`~ar_torchrl.training.lr_schedule_factor`); returns that learning rate."""
    a = run.cfg.algo
    base = a.lr if a.value_lr is None else a.value_lr
    factor = lr_schedule_factor(
        step,
        run.cfg.train.iterations,
        schedule=a.value_lr_schedule,
        warmup=a.value_lr_warmup_iters,
        min_ratio=a.value_lr_min_ratio,
    )
    for group in run.optimizer.param_groups:
        if group.get("name") in build.CRITIC_GROUPS:
            group["lr"] = base * factor
    return base * factor


def update(run: Run, td, plan, *, critic_only: bool) -> dict[str, float]:
    """``algo.ppo_epochs`` x mini-batches; ``critic_only``: only the critic's loss and weights (the
    value head, or the separate critic)."""
    a = run.cfg.algo
    head = run.critic_parameters()
    if a.num_minibatches > len(plan):
        logger.warning(
            "algo.num_minibatches=%d but the batch has only %d micro-batches: using %d "
            "(train/optimizer_steps shows it)",
            a.num_minibatches,
            len(plan),
            len(plan),
        )
    passes = partial(
        ppo_update,
        run.loss_fn,
        run.optimizer,
        td,
        plan,
        num_minibatches=min(a.num_minibatches, len(plan)),
        grad_clip=a.grad_clip,
        generator=run.shuffle_rng,
    )
    value_only = {"loss_keys": ("loss_critic",), "trainable": head}
    out = passes(epochs=a.ppo_epochs, **(value_only if critic_only else {}))
    if a.critic_epochs > 1 and not critic_only:
        # algo.critic_epochs = K: K - 1 more value-loss passes per actor pass, after the joint
        # ones, on the critic only (a shared trunk stays the policy's: the head alone).
        extra = passes(epochs=(a.critic_epochs - 1) * a.ppo_epochs, **value_only)
        for key in ("loss_critic", "explained_variance", "optimizer_steps"):
            if f"train/{key}" in extra:
                out[f"train/critic_extra/{key}"] = extra[f"train/{key}"]
    return out


#: ``critic.pretrain_from``: every HOLDOUT_EVERY-th saved batch is held out (never trained on) to
#: measure the critic's out-of-sample ``critic/explained_variance`` after each epoch.
HOLDOUT_EVERY = 10

#: The file in the run directory where :func:`pretrain_critic` records each epoch.
PRETRAIN_LOG = "critic_pretrain.jsonl"


def pretrain_critic(run: Run, source: Path) -> list[dict[str, float]]:
    """``critic.pretrain_from``: train the critic offline on the batches an earlier run saved
    (``train.save_rollouts=true``) before this run generates anything; the policy's weights stay
    bit-identical (critic-only steps, as in the warm-up).

    Every :data:`HOLDOUT_EVERY`-th saved batch (the last one when there are fewer) is held out; the
    others are the training set. One epoch treats each training batch exactly like an online
    critic-only iteration without the generation: anchors (old values) from the *current* critic,
    the run's own advantage estimator for the value targets (``algo.gae.critic_lmbda = 1``:
    Monte-Carlo returns; below 1 they bootstrap from the current critic, so they are recomputed
    as it learns, as online), then ``algo.ppo_epochs`` critic-only passes at ``algo.value_lr``.
    After each epoch the held-out batches' ``critic/explained_variance`` (old values against
    Monte-Carlo returns, pooled over their trained tokens) is measured; pretraining stops when it
    reaches ``algo.critic_warmup_until_ev`` or after ``critic.pretrain_epochs`` epochs. Each
    epoch is logged and appended to ``<run_dir>/critic_pretrain.jsonl``; returns those records.
    """
    cfg, a = run.cfg, run.cfg.algo
    files = run.strategy.ctx.broadcast_object(
        rollouts.rollout_files(source) if run.is_main else None
    )
    if len(files) < 2:
        raise ValueError(
            f"critic.pretrain_from={str(source)!r}: {len(files)} saved batch; pretraining holds "
            "one out to measure the critic, so it needs at least 2 (a longer earlier run)"
        )
    held = files[HOLDOUT_EVERY - 1 :: HOLDOUT_EVERY] or files[-1:]
    trained = [f for f in files if f not in held]
    base = a.lr if a.value_lr is None else a.value_lr
    for group in run.optimizer.param_groups:
        if group.get("name") in build.CRITIC_GROUPS:
            group["lr"] = base
    target = a.critic_warmup_until_ev
    logger.info(
        "critic.pretrain_from: %d saved batches of %s (%d held out), at most %d epochs%s",
        len(files),
        source,
        len(held),
        cfg.critic.pretrain_epochs,
        "" if target is None else f", until critic/explained_variance >= {target:g}",
    )
    records, started = [], time.perf_counter()
    for epoch in range(1, cfg.critic.pretrain_epochs + 1):
        totals: dict[str, float] = {}
        for path in trained:
            td, plan = _saved_batch(run, path)
            td = advantages(run, td, {})
            out = update(run, td, plan, critic_only=True)
            for key in ("train/loss_critic", "train/explained_variance"):
                if key in out:
                    totals[key] = totals.get(key, 0.0) + out[key] / len(trained)
        health = _held_out_health(run, held)
        ev = health.get("critic/explained_variance")
        record = {"epoch": epoch, **totals, **health}
        records.append(record)
        if run.is_main:
            append_jsonl(run.run_dir / PRETRAIN_LOG, record)
        logger.info(
            "critic.pretrain_from: epoch %d: held-out critic/explained_variance %s (within "
            "prompts %s), value loss %.4f (%.1f s)",
            epoch,
            "undefined" if ev is None else f"{ev:.3f}",
            _fmt(health.get("critic/explained_variance_within_prompt")),
            totals.get("train/loss_critic", float("nan")),
            time.perf_counter() - started,
        )
        if target is not None and ev is not None and ev >= target:
            break
    else:
        if target is not None:
            logger.warning(
                "critic.pretrain_from: %d epochs (critic.pretrain_epochs) without reaching "
                "algo.critic_warmup_until_ev=%g",
                cfg.critic.pretrain_epochs,
                target,
            )
    return records


def _saved_batch(run: Run, path: Path):
    """A saved batch on every rank, with the current anchors and the plan they were computed with."""
    td = run.strategy.broadcast_batch(rollouts.load_rollout(path) if run.is_main else None)
    return td, old_log_probs_and_values(run, td)


def _fmt(x: float | None) -> str:
    return "undefined" if x is None else f"{x:.3f}"


def _held_out_health(run: Run, paths: list[Path]) -> dict[str, float]:
    """:func:`~ar_torchrl.objectives.metrics.critic_health` of the held-out batches pooled (right-
    padded to one width; each batch's prompt ids kept apart): ``critic/explained_variance``, its
    thirds and ``critic/explained_variance_within_prompt`` over all their trained tokens."""
    keys = run.loss_fn.tensor_keys
    parts, offset = [], 0
    for path in paths:
        td, _ = _saved_batch(run, path)
        mask = td.get(keys.loss_mask)
        part = {
            "loss_mask": mask,
            "state_value": td.get(keys.value).reshape(mask.shape),
            "reward": td.get(("next", keys.reward)).reshape(mask.shape),
        }
        if "prompt_id" in td.keys() and run.cfg.rollout.samples_per_prompt >= 2:
            pid = td.get("prompt_id")
            pid = pid.reshape(mask.shape) if pid.numel() == mask.numel() else pid
            part["prompt_id"] = pid + offset - int(pid.min())
            offset += int(pid.max()) - int(pid.min()) + 1
        parts.append(part)
    return pooled_critic_health(parts, run.cfg.algo.gamma)


def pooled_critic_health(parts: list[dict], gamma: float) -> dict[str, float]:
    """The ``critic/explained_variance*`` keys of
    :func:`~ar_torchrl.objectives.metrics.critic_health` over several batches as one: each part
    is ``{"loss_mask", "state_value", "reward"}`` (``[B_i, L_i]``, widths may differ; right-padded
    with masked positions) and optionally ``"prompt_id"`` (``[B_i, L_i]`` or ``[B_i]``, already
    disjoint between parts)."""
    width = max(p["loss_mask"].shape[1] for p in parts)

    def cat(name):
        pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1]))  # noqa: E731
        return torch.cat([pad(p[name]) if p[name].ndim == 2 else p[name] for p in parts])

    pooled = {"loss_mask": cat("loss_mask"), "state_value": cat("state_value")}
    pooled["next"] = {"reward": cat("reward")}
    if all("prompt_id" in p for p in parts):
        pooled["prompt_id"] = cat("prompt_id")
    td = TensorDict(pooled, batch_size=pooled["loss_mask"].shape[:1])
    health = critic_health(td, gamma)
    return {k: v for k, v in health.items() if k.startswith("critic/explained_variance")}


def rollout_metrics(run: Run, td) -> dict[str, float]:
    """Reward and accuracy over EVERY generated sample (the collector's stats: unbiased when
    dynamic sampling dropped groups), groups generated / zero-spread / kept / dropped, and the
    trained batch's response length and rollout-vs-trainer log-prob drift over generated tokens
    (rank 0)."""
    if run.collector is None:
        return {}
    c = run.collector
    stats = {k: v for k, v in c.last_batch_stats.items() if k != "samples"}
    out = {
        **{f"rollout/{k}": float(v) for k, v in stats.items()},
        "rollout/policy_lag": float(c.last_policy_lag),
    }
    if c.pipelined:  # bounded staleness: trained tokens by lag, and interrupted generations
        tokens = sum(c.last_token_lags.values()) or 1
        for lag in range(c.max_policy_lag + 1):
            out[f"rollout/token_lag_{lag}"] = c.last_token_lags.get(lag, 0) / tokens
        out["rollout/interruptions"] = float(c.env.backend.interruptions)
    if td.shape[0]:
        mask = td["loss_mask"]
        drift = (td["rollout_log_prob"] - td["sample_log_prob"]).abs()
        out["rollout/response_length"] = float(mask.sum(-1).float().mean())  # trained tokens
        answered = mask.long().cumsum(-1) > 0  # from the first trained token on
        tool = td["attention_mask"] & ~mask & answered
        if "turn_id" in td.keys():  # multi-turn rows: tool answers (observation tokens, untrained)
            out["rollout/observation_tokens"] = float(tool.sum(-1).float().mean())
        out["rollout/logprob_drift"] = float(masked_mean(drift, mask))
    return out


def evaluate(run: Run, announce: bool = False) -> dict[str, float]:
    """Greedy decoding on the held-out prompts: mean reward and accuracy (what the reward calls
    correct); rank 0, on the rollout engine (the other ranks go on to the next collective and wait
    there). ``announce``: log its start and result (the step-0 evaluation, before the progress bar
    exists; later ones show on the bar)."""
    if run.eval_env is None:
        return {}
    env = run.eval_env
    started = time.perf_counter()
    if announce:
        logger.info("step 0: evaluating the starting policy (greedy, held-out prompts)")
    seq = env.episodes(env.rollout(env.max_turns))
    samples = env.samples(seq)
    out = {
        "eval/reward_mean": float(seq["next", "reward"].mean()),
        "eval/accuracy": sum(s.correct for s in samples) / len(samples),
    }
    out.update({f"eval/{k}": v for k, v in episode_stats(samples).items()})
    if announce:
        logger.info(
            "step 0: eval/accuracy %.3f on %d prompts in %.1f s; training starts",
            out["eval/accuracy"],
            len(samples),
            time.perf_counter() - started,
        )
    return out


def record(run: Run, step: int, metrics: dict[str, float]) -> None:
    """Append to ``metrics.jsonl`` (what resuming and the plot read) and the TorchRL logger (rank 0)."""
    if not run.is_main:
        return
    append_jsonl(run.run_dir / "metrics.jsonl", {"step": step, **metrics})
    log_metrics(run.logger, metrics, step)


def save(run: Run, step: int) -> Path:
    """An atomic checkpoint; in async mode it includes the batch generated in the background.

    Under FSDP2 a ``torch.distributed.checkpoint`` directory: every rank writes its shards and RNG
    states, rank 0 the metadata (the collector state included).
    """
    extra = {"shuffle_rng": run.shuffle_rng.get_state()}
    if run.warmup is not None and run.warmup.until_ev is not None:
        extra["critic_warmup_done"] = run.warmup.done
    if run.collector is not None:
        extra["collector"] = run.collector.state_dict(include_pending=True)
    return run.store.save(
        run.run_dir / "checkpoints",
        step,
        actor_critic=run.actor_critic,
        optimizer=run.optimizer,
        extra=extra,
        keep_last=run.cfg.train.keep_checkpoints,
        critic=run.critic,
    )
