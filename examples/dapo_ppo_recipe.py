"""The DAPO-math PPO recipe: ``setup`` builds every piece, ``train`` is the loop.

examples/dapo_ppo.py runs it: it checks the configuration (examples/dapo_ppo_config.py), finds the
checkpoint to resume and handles signals, then imports this module (torch, transformers, TorchRL:
the slow imports) and calls ``setup(cfg, ...)`` and ``train(run, stop)``.

One iteration: collect a batch of rollouts -> recompute the PPO anchors (old log-probs and values)
with the trainer's own model and micro-batch plan -> advantages (a registered estimator: GAE or
GRPO) -> ``ppo_epochs`` over mini-batches of the plan's micro-batches (gradient accumulation,
gradient clipping) -> push the new weights to the rollout backend.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from dapo_ppo_config import (
    ArithmeticDataConfig,
    Config,
    SmolLM2ModelConfig,
    TinyModelConfig,
    TrainsideBackendConfig,
)
from tqdm.auto import tqdm

from ar_torchrl.backends import SamplingParams, TransformersBackend
from ar_torchrl.checkpoint import load_checkpoint, save_checkpoint
from ar_torchrl.collectors import WeightSyncCollector
from ar_torchrl.data import plan_micro_batches
from ar_torchrl.data.datasets import arithmetic_dataset, load_dapo_math, train_holdout_split
from ar_torchrl.envs import LLMEnv
from ar_torchrl.functional import masked_mean
from ar_torchrl.models import build_tiny_model, check_tokenizer, load_hf_model, load_smollm2_135m
from ar_torchrl.modules import LMActorCritic, attach_value_head, save_policy
from ar_torchrl.objectives import TokenPPOLoss, make_advantage, recompute_anchors
from ar_torchrl.training import ppo_update
from ar_torchrl.utils import StageTimer, append_jsonl, log_metrics, make_logger
from ar_torchrl.warmstart import cached_warm_start
from ar_torchrl.weight_sync import named_policy_tensors

log = logging.getLogger("dapo_ppo")


# --------------------------------------------------------------------------- building blocks
def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_datasets(cfg: Config) -> tuple[list[dict], list[dict]]:
    """Training rows and held-out evaluation rows (DAPO-Math schema)."""
    d = cfg.data
    if isinstance(d, ArithmeticDataConfig):
        rows = arithmetic_dataset(d.num_rows, seed=d.seed, template=d.template, max_operand=d.max_operand)  # fmt: skip
    else:
        rows = load_dapo_math(d.path, skip_invalid=d.skip_invalid, limit=d.limit)
        if rows.num_skipped:
            log.warning("data: skipped %d malformed rows of %s", rows.num_skipped, d.path)
    train_rows, eval_rows = train_holdout_split(rows, d.holdout, seed=d.seed)
    return list(train_rows), list(eval_rows)[: cfg.train.eval_prompts]


def build_model(cfg: Config):
    """The starting policy (before the value head) and its tokenizer; warm-started when configured."""
    m = cfg.model
    if isinstance(m, TinyModelConfig):
        model, tok = build_tiny_model(hidden_size=m.hidden_size, num_layers=m.num_layers,
                                      num_heads=m.num_heads, seed=m.init_seed)  # fmt: skip
        source = "model=tiny"
    elif isinstance(m, SmolLM2ModelConfig):
        model, tok = load_smollm2_135m(cfg.cache_dir)
        source = "model=smollm2_135m"
    else:
        model, tok = load_hf_model(m.path, dtype=m.dtype, attn_implementation=m.attn_implementation)
        source = f"model.path={m.path}"
    check_tokenizer(tok, where=f"the tokenizer of {source}")
    ws = m.warm_start
    if ws.enabled:
        rows = arithmetic_dataset(ws.num_rows, seed=ws.data_seed, template=ws.template)
        model, _ = cached_warm_start(
            model, tok, list(rows), cache_dir=Path(cfg.cache_dir) / "warmstart",
            steps=ws.steps, batch_size=ws.batch_size, lr=ws.lr, final_lr_ratio=ws.final_lr_ratio,
            correct_fraction=ws.correct_fraction, seed=ws.data_seed,
        )  # fmt: skip
    return model, tok


def build_backend(cfg: Config, model, tokenizer, run_dir: Path, stack: contextlib.ExitStack):
    """The rollout engine: a private copy of the policy in this process, or an SGLang server."""
    b = cfg.backend
    if isinstance(b, TrainsideBackendConfig):
        backend = TransformersBackend(model, mode="copy", max_batch_size=b.max_batch_size, seed=cfg.seed)  # fmt: skip
        stack.callback(backend.close)
        return backend
    from ar_torchrl.backends.sglang import (
        SGLangBackend,
        SGLangUnavailableError,
        launch_sglang_server,
    )

    url = b.url  # one URL, a list of them, or an sglang-router URL
    if url is None:  # launch a local server on the starting policy, stopped when the run ends
        model_dir = run_dir / "sglang_model"  # the server's start weights: deleted when it stops
        stack.callback(shutil.rmtree, model_dir, ignore_errors=True)
        save_policy(model, model_dir, tokenizer)
        server = stack.enter_context(launch_sglang_server(
            model_dir, python=b.python, device=b.device, extra_args=list(b.extra_args),
            log_file=run_dir / "sglang_server.log",
        ))  # fmt: skip
        url = server.url
    urls = [url] if isinstance(url, str) else list(url)
    backend = SGLangBackend(urls, weight_sync=b.weight_sync, vocab_size=model.config.vocab_size,
                            show_progress=False)  # fmt: skip
    stack.callback(backend.close)
    if not backend.health():  # said once, before anything reads as a weight-sync failure
        raise SGLangUnavailableError(
            f"backend.url={urls}: no SGLang server answers GET /health there; start it (or set "
            "backend.url=null to launch one) and check the URL"
        )
    if b.url is not None:  # a running server holds other weights: push the starting policy
        backend.sync_weights(named_policy_tensors(model), version=0)
    return backend


def build_envs(cfg: Config, rows, eval_rows, tokenizer, backend, model) -> tuple[LLMEnv, LLMEnv]:
    """Prompts in, scored token trajectories out: sampled for training, greedy for evaluation."""
    r = cfg.rollout
    sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                              top_p=r.top_p, top_k=r.top_k)  # fmt: skip
    env = LLMEnv(rows, tokenizer, backend, num_samples=r.samples_per_prompt,
                 prompts_per_batch=r.prompts_per_iter, sampling=sampling,
                 overlong_buffer_len=r.overlong_buffer, overlong_penalty_factor=r.overlong_penalty,
                 seed=cfg.seed)  # fmt: skip
    # Evaluation decodes greedily from the trainer's own weights (trainside) or the server.
    trainside = isinstance(cfg.backend, TrainsideBackendConfig)
    eval_backend = TransformersBackend(model, mode="share") if trainside else backend
    greedy = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=0.0)
    eval_env = LLMEnv(eval_rows, tokenizer, eval_backend, num_samples=1,
                      prompts_per_batch=len(eval_rows), sampling=greedy, shuffle=False)  # fmt: skip
    return env, eval_env


def build_advantage(cfg: Config):
    """``algo.advantage_mode`` from the registry; the value head (critic_coeff > 0) is its critic.

    GRPO with a value head trains the head on Monte-Carlo returns (README: the one-key swap).
    Zero-spread groups are left to the collector's dynamic sampling (:func:`dynamic_sampling`).
    """
    a = cfg.algo
    kwargs = a.advantage_kwargs()
    kwargs.pop("drop_zero_spread", None)
    return make_advantage(a.advantage_mode, critic=a.critic_coeff > 0, **kwargs)


def dynamic_sampling(cfg: Config) -> bool:
    """DAPO dynamic sampling (refill with groups whose rewards differ): ``rollout.dynamic_sampling``,
    or its older spelling ``algo.grpo.drop_zero_spread`` (which applies with GRPO only)."""
    grpo = cfg.algo.advantage_mode == "grpo" and cfg.algo.grpo.drop_zero_spread
    return bool(cfg.rollout.dynamic_sampling or grpo)


def build_optimizer(cfg: Config, model) -> torch.optim.Optimizer:
    """AdamW with its own param group (learning rate) for the value head."""
    a = cfg.algo
    head = list(model.value_head.parameters())
    head_ids = {id(p) for p in head}
    policy = [p for p in model.parameters() if id(p) not in head_ids]
    groups = [{"params": policy, "lr": a.lr, "name": "policy"}]
    if a.critic_coeff > 0:
        value_lr = a.lr if a.value_lr is None else a.value_lr  # 0: a frozen head
        groups.append({"params": head, "lr": value_lr, "name": "value_head"})
    return torch.optim.AdamW(groups, weight_decay=a.weight_decay)


# --------------------------------------------------------------------------- setup
@dataclass
class Run:
    """The pieces of a run, built by :func:`setup` and used by :func:`train`."""

    cfg: Config
    run_dir: Path
    model: torch.nn.Module
    actor_critic: LMActorCritic
    ref_actor: LMActorCritic | None
    collector: WeightSyncCollector
    eval_env: LLMEnv
    advantage: Any
    loss_fn: TokenPPOLoss
    optimizer: torch.optim.Optimizer
    shuffle_rng: torch.Generator
    logger: Any = None
    start: int = 0
    timer: StageTimer = field(default_factory=StageTimer)


def setup(cfg: Config, run_dir: Path, checkpoint: Path | None, stack: contextlib.ExitStack) -> Run:
    """Build everything a run needs; continue from ``checkpoint`` when given."""
    torch.set_num_threads(cfg.num_threads)
    seed_everything(cfg.seed)
    # 1. Data: training prompts and held-out evaluation prompts, DAPO-Math schema.
    rows, eval_rows = build_datasets(cfg)
    # 2. Model: policy + zero-initialised value head; a frozen copy of the start policy for KL.
    #    Log-probs are those of the sampling distribution (temperature-scaled; greedy: T = 1).
    model, tokenizer = build_model(cfg)
    temperature = cfg.rollout.temperature or 1.0
    ref_actor = None
    if cfg.algo.kl_coeff > 0:
        ref = copy.deepcopy(model).to(cfg.device).eval().requires_grad_(False)
        ref_actor = LMActorCritic(ref, temperature=temperature, critic=False)  # log-probs only
    model = attach_value_head(model).to(cfg.device)
    actor_critic = LMActorCritic(model, temperature=temperature)
    # 3. Rollouts: backend -> LLMEnv -> WeightSyncCollector (async: next batch in the background).
    backend = build_backend(cfg, model, tokenizer, run_dir, stack)
    env, eval_env = build_envs(cfg, rows, eval_rows, tokenizer, backend, model)
    collector = WeightSyncCollector(env, model, mode=cfg.train.mode, max_policy_lag=1,
                                    dynamic_sampling=dynamic_sampling(cfg),
                                    max_sampling_rounds=cfg.rollout.max_sampling_rounds)  # fmt: skip
    stack.callback(collector.shutdown)  # also on errors: waits for an in-flight background batch
    # 4. Advantage estimator, PPO loss, optimizer (value head in its own group).
    a = cfg.algo
    loss_fn = TokenPPOLoss(actor_critic, clip_epsilon=tuple(a.clip_epsilon), clip_value=a.clip_value,
                           entropy_coeff=a.entropy_coeff, critic_coeff=a.critic_coeff,
                           kl_coeff=a.kl_coeff, loss_agg_mode=a.loss_agg_mode,
                           norm_length=cfg.rollout.max_new_tokens)  # fmt: skip
    run = Run(cfg, run_dir, model, actor_critic, ref_actor, collector, eval_env,
              build_advantage(cfg), loss_fn, build_optimizer(cfg, model),
              torch.Generator().manual_seed(cfg.seed))  # fmt: skip
    # 5. Resume: model + value head, optimizer, RNG states, data position, versions, step.
    if checkpoint is not None:
        run.start = restore(run, checkpoint)
    run.logger = make_logger(cfg.logger.kind, log_dir=run_dir / "logs", exp_name=cfg.logger.exp_name,
                             project=cfg.logger.project)  # fmt: skip
    run.collector.total_batches = cfg.train.iterations - run.start  # batches left in this run
    return run


def restore(run: Run, checkpoint: Path) -> int:
    """Load ``checkpoint`` into the run; returns its step."""
    state = load_checkpoint(checkpoint, model=run.model, optimizer=run.optimizer)  # + RNG states
    run.collector.load_state_dict(state["extra"]["collector"])  # data position, policy version
    run.shuffle_rng.set_state(state["extra"]["shuffle_rng"])
    run.collector.resync_policy_weights_()  # the backend still holds the starting weights
    log.info("resumed from %s (step %d)", checkpoint, state["step"])
    return state["step"]


# --------------------------------------------------------------------------- the loop
def train(run: Run, stop) -> int:
    """The PPO loop from ``run.start`` to ``train.iterations``; returns the last finished step.

    ``stop.requested`` (SIGINT/SIGTERM) ends it after the current step, with a checkpoint.
    """
    cfg, r, t = run.cfg, run.cfg.rollout, run.cfg.train
    if t.eval_every and run.start == 0:  # baseline: the starting policy, logged as step 0
        record(run, 0, evaluate(run))
    batches, step = iter(run.collector), run.start
    for step in tqdm(range(run.start + 1, t.iterations + 1), desc="PPO", initial=run.start,
                     total=t.iterations):  # fmt: skip
        # 1. Rollouts: wait for the batch (async: mostly generated during the last update).
        with run.timer("generate"):
            td = next(batches).to(cfg.device)
        losses = {"train/update_skipped": float(td.shape[0] == 0)}
        if td.shape[0] == 0:  # dynamic sampling kept no group (every answer equal): skip the update
            log.warning("step %d: no group with a reward spread after rollout.max_sampling_rounds; "
                        "update skipped", step)  # fmt: skip
        else:
            # 2. Anchors: old log-probs and values (+ reference log-probs), training geometry.
            with run.timer("anchors"):
                plan = plan_micro_batches(td, r.token_budget, r.max_rows, packing=r.packing)
                recompute_anchors(run.actor_critic, td, plan, ref_actor=run.ref_actor)
            # 3. Advantages (GAE or GRPO).
            with run.timer("advantage"):
                td = run.advantage(td)
            # 4. PPO epochs over mini-batches of micro-batches (critic warm-up: value head only).
            with run.timer("update"):
                losses.update(
                    update(run, td, plan, critic_only=step <= cfg.algo.critic_warmup_iters)
                )
            # 5. Push the new weights (never the value head) to the rollout backend.
            with run.timer("sync"):
                run.collector.update_policy_weights_()
        # 6. Log; evaluate and checkpoint on schedule (rank-0 work once training is distributed).
        metrics = {**rollout_metrics(run, td), **losses, **run.timer.pop()}
        if t.eval_every and (step % t.eval_every == 0 or step == t.iterations):
            metrics.update(evaluate(run))
        record(run, step, metrics)
        last = step == t.iterations or stop.requested
        if last or (t.checkpoint_every and step % t.checkpoint_every == 0):
            save(run, step)
        if stop.requested:
            break
    run.collector.shutdown()
    return step


def update(run: Run, td, plan, *, critic_only: bool) -> dict[str, float]:
    """``algo.ppo_epochs`` x mini-batches; ``critic_only``: only the value head's loss and weights."""
    a = run.cfg.algo
    head = list(run.model.value_head.parameters())
    if a.num_minibatches > len(plan):
        log.warning("algo.num_minibatches=%d but the batch has only %d micro-batches: using %d "
                    "(train/optimizer_steps shows it)", a.num_minibatches, len(plan), len(plan))  # fmt: skip
    return ppo_update(
        run.loss_fn, run.optimizer, td, plan, epochs=a.ppo_epochs,
        num_minibatches=min(a.num_minibatches, len(plan)), grad_clip=a.grad_clip,
        loss_keys=("loss_critic",) if critic_only else None,
        trainable=head if critic_only else None, generator=run.shuffle_rng,
    )  # fmt: skip


def rollout_metrics(run: Run, td) -> dict[str, float]:
    """Reward and accuracy over EVERY generated sample (the collector's stats: unbiased when
    dynamic sampling dropped groups), groups generated / kept / dropped, and the trained batch's
    response length and rollout-vs-trainer log-prob drift over generated tokens."""
    stats = {k: v for k, v in run.collector.last_batch_stats.items() if k != "samples"}
    out = {**{f"rollout/{k}": float(v) for k, v in stats.items()},
           "rollout/policy_lag": float(run.collector.last_policy_lag)}  # fmt: skip
    if td.shape[0]:
        mask = td["loss_mask"]
        drift = (td["rollout_log_prob"] - td["sample_log_prob"]).abs()
        out["rollout/response_length"] = float(mask.sum(-1).float().mean())
        out["rollout/logprob_drift"] = float(masked_mean(drift, mask))
        grpo = getattr(run.advantage, "stats", {})  # e.g. GRPO's group counts
        out.update({f"rollout/{k}": float(v) for k, v in grpo.items()})
    return out


def evaluate(run: Run) -> dict[str, float]:
    """Greedy decoding on the held-out prompts: mean reward and accuracy."""
    td = run.eval_env.rollout()
    reward = td["next", "reward"].squeeze(-1).sum(-1)
    return {
        "eval/reward_mean": float(reward.mean()),
        "eval/accuracy": float((reward > 0).float().mean()),
    }


def record(run: Run, step: int, metrics: dict[str, float]) -> None:
    """Append to ``metrics.jsonl`` (what resuming and the plot read) and the TorchRL logger."""
    append_jsonl(run.run_dir / "metrics.jsonl", {"step": step, **metrics})
    log_metrics(run.logger, metrics, step)


def save(run: Run, step: int) -> Path:
    """An atomic checkpoint; in async mode it includes the batch generated in the background."""
    extra = {"collector": run.collector.state_dict(include_pending=True),
             "shuffle_rng": run.shuffle_rng.get_state()}  # fmt: skip
    return save_checkpoint(run.run_dir / "checkpoints", step=step, model=run.model,
                           optimizer=run.optimizer, extra=extra,
                           keep_last=run.cfg.train.keep_checkpoints)  # fmt: skip
