"""The recipe's building blocks: each turns one part of the configuration into library objects by
registry lookup (data, rollout engine, environments, advantage estimator, loss, optimizer).

:func:`ar_torchrl.recipes.dapo_ppo.loop.setup` calls them in order; the policy itself is built by
the execution strategy (:mod:`ar_torchrl.recipes.strategy`) from the ``model`` option's schema.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ar_torchrl.backends import SamplingParams, TransformersBackend
from ar_torchrl.backends.registry import BackendContext
from ar_torchrl.data.datasets import MathDataset
from ar_torchrl.data.prompts import check_prompts
from ar_torchrl.envs import LLMEnv
from ar_torchrl.envs.registry import ENV_KINDS, EnvContext
from ar_torchrl.objectives import TokenPPOLoss, make_advantage
from ar_torchrl.recipes.dapo_ppo.config import Config
from ar_torchrl.rewards.registry import OverlongPenalty

logger = logging.getLogger(__name__)

__all__ = [
    "build_advantage",
    "build_backend",
    "build_datasets",
    "context_length",
    "fit_prompts",
    "build_envs",
    "build_loss",
    "build_optimizer",
    "build_reward",
    "critic_clip_groups",
    "seed_everything",
]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_datasets(cfg: Config) -> tuple[MathDataset, MathDataset]:
    """Training rows and the held-out evaluation rows (the first ``train.eval_prompts``)."""
    train_rows, eval_rows = cfg.data.build()
    return train_rows, eval_rows.subset(range(min(len(eval_rows), cfg.train.eval_prompts)))


def fit_prompts(
    cfg: Config, datasets: tuple[MathDataset, MathDataset], tokenizer: Any, context: int
) -> tuple[MathDataset, MathDataset]:
    """The rows whose prompts leave ``rollout.max_new_tokens`` of the ``context``: checked once,
    at load (:func:`ar_torchrl.data.check_prompts`: an error naming the row's source, or with
    ``data.skip_invalid`` skipped and counted; characters the tokenizer drops are warned about)."""
    limit = min(context, cfg.rollout.max_total_tokens or context) - cfg.rollout.max_new_tokens
    skip = bool(getattr(cfg.data, "skip_invalid", False))
    fitted = []
    for name, rows in zip(("data", "data (held-out rows)"), datasets):
        found = check_prompts(
            rows, tokenizer, max_prompt_tokens=limit, skip_invalid=skip, name=name
        )
        fitted.append(rows if len(found.kept) == len(rows) else rows.subset(found.kept))
    return fitted[0], fitted[1]


def context_length(model: torch.nn.Module, backend: Any) -> int:
    """The tokens a sequence may have: the model's ``max_position_embeddings`` and the rollout
    engine's own limit (``backend.context_length``, e.g. a server's ``--context-length``)."""
    limits = [getattr(model.config, "max_position_embeddings", None)]
    limits.append(backend.context_length)
    known = [int(x) for x in limits if x]
    if not known:
        raise ValueError(
            f"{type(model).__name__}.config has no max_position_embeddings and the backend says no "
            "context length: the recipe cannot check prompt lengths"
        )
    return min(known)


def build_reward(cfg: Config) -> Any:
    """The ``reward`` option's reward (it also says what counts as correct)."""
    return cfg.reward.build()


def build_backend(
    cfg: Config,
    model: torch.nn.Module,
    tokenizer: Any,
    run_dir: Path,
    stack: contextlib.ExitStack,
    *,
    start_dir: Path | None = None,
) -> Any:
    """The ``backend`` option's rollout engine, closed by ``stack`` (see :class:`BackendContext`)."""
    context = BackendContext(
        model=model,
        tokenizer=tokenizer,
        run_dir=run_dir,
        stack=stack,
        device=cfg.device,
        dtype=cfg.model.dtype,
        seed=cfg.seed,
        start_dir=start_dir,
    )
    return cfg.backend.build(context)


def build_envs(
    cfg: Config, rows, eval_rows, tokenizer, backend, model, *, trainer_can_generate: bool
) -> tuple[LLMEnv, LLMEnv]:
    """Prompts in, scored token trajectories out: sampled for training, greedy for evaluation, by
    the environment kind ``rollout.env`` (:data:`~ar_torchrl.envs.registry.ENV_KINDS`; default:
    multi-turn tool-use episodes when ``tools`` is set, else single-turn).

    Evaluation decodes greedily from the trainer's own weights when the trainer can generate and
    the rollouts are trainside (a shared-weights engine, no copy); otherwise on the rollout engine
    (synced after each update).
    """
    r, reward = cfg.rollout, build_reward(cfg)
    if r.overlong_buffer is not None:  # DAPO's soft overlong punishment: a wrapper of the reward
        reward = OverlongPenalty(reward, r.max_new_tokens, r.overlong_buffer, r.overlong_penalty)
    sampling = SamplingParams(
        max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k
    )
    greedy = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=0.0)
    kind = cfg.env_kind
    options = ENV_KINDS.options(kind, r.env_options)
    multi_turn = ENV_KINDS[kind].multi_turn
    context = EnvContext(
        rows,
        tokenizer,
        backend,
        reward_fn=reward,
        sampling=sampling,
        num_samples=r.samples_per_prompt,
        prompts_per_batch=r.prompts_per_iter,
        seed=cfg.seed,
        toolbox=None if cfg.tools is None else cfg.tools.build(),
        max_turns=r.max_turns,
        max_total_tokens=(r.max_total_tokens or context_length(model, backend))
        if multi_turn
        else r.max_total_tokens,
        tool_error_penalty=r.tool_error_penalty,
        template_check=r.template_check,
    )
    env = ENV_KINDS[kind].build(options, context=context)
    trainside = isinstance(backend, TransformersBackend) and trainer_can_generate
    eval_context = dataclasses.replace(
        context,
        rows=eval_rows,
        backend=TransformersBackend(model, mode="share") if trainside else backend,
        sampling=greedy,
        num_samples=1,
        prompts_per_batch=len(eval_rows),
        seed=0,
        shuffle=False,
    )
    return env, ENV_KINDS[kind].build(options, context=eval_context)


def build_advantage(cfg: Config) -> Any:
    """``algo.advantage_mode`` from the registry, with its ``algo.<mode>`` options; the value head
    (``critic_coeff > 0``) is its critic (GRPO/RLOO then train it on Monte-Carlo returns)."""
    a = cfg.algo
    options = a.advantage_options()
    kwargs = {} if options is None else dataclasses.asdict(options)
    return make_advantage(a.advantage_mode, critic=a.critic_coeff > 0, gamma=a.gamma, **kwargs)


#: ``train.mode=async`` with ``train.async_correction=decoupled`` and no ``algo.tis_cap``: the cap
#: of the behaviour-policy weight ``pi_old / pi_behaviour`` (verl's rollout-IS threshold default).
DECOUPLED_TIS_CAP = 2.0


def tis_cap(cfg: Config) -> float | None:
    """The loss's ``tis_cap``: ``algo.tis_cap``, else in async mode the decoupled-PPO default.

    In async mode the batch was sampled by the previous weights while the old log-probs (and so the
    clip) come from the current ones: decoupled PPO (AReaL) weights each token's policy loss by
    the truncated ``pi_old / pi_behaviour``. ``train.async_correction=none`` opts out, with a warning.
    """
    if cfg.algo.tis_cap is not None or cfg.train.mode != "async":
        return cfg.algo.tis_cap
    if cfg.algo.rollout_correction.resolved().is_level is not None:
        return None  # the rollout correction's IS weight is the behaviour-policy correction
    if cfg.train.async_correction == "none":
        logger.warning(
            "train.mode=async with train.async_correction=none: the batch was sampled by the "
            "previous weights and nothing corrects for it (the clip is centred on a policy that "
            "did not generate the data); set train.async_correction=decoupled or algo.tis_cap"
        )
        return None
    return DECOUPLED_TIS_CAP


def build_loss(cfg: Config, actor_critic: Any, critic: Any = None) -> TokenPPOLoss:
    """The PPO loss of ``algo``: its ``policy_loss`` (with the ``algo.<policy_loss>`` options) and
    ``rollout_correction``, ``rollout.max_new_tokens`` as the length normaliser, ``tis_cap`` from
    :func:`tis_cap`; ``critic``: a separate critic (``critic=separate``)."""
    a = cfg.algo
    return TokenPPOLoss(
        actor_critic,
        critic,
        clip_epsilon=tuple(a.clip_epsilon),
        clip_value=a.clip_value,
        entropy_coeff=a.entropy_coeff,
        critic_coeff=a.critic_coeff,
        kl_coeff=a.kl_coeff,
        kl_estimator=a.kl_estimator,
        loss_agg_mode=a.loss_agg_mode,
        norm_length=cfg.rollout.max_new_tokens,
        tis_cap=tis_cap(cfg),
        policy_loss=a.policy_loss,
        policy_loss_options=a.policy_loss_options(),
        rollout_correction=a.rollout_correction,
    )


def use_popart(model: torch.nn.Module, beta: float) -> None:
    """``algo.value_norm=popart``: replace the value head by a :class:`PopArtValueHead` holding
    its weights (with ``mu = 0, sigma = 1`` it computes the same values; the statistics move from
    the first update on)."""
    from ar_torchrl.modules import PopArtValueHead, attach_value_head

    head = model.value_head
    if isinstance(head, PopArtValueHead):
        return
    if head.weight.is_meta:  # built from model.path under FSDP2: filled when the model is loaded
        from ar_torchrl.distributed.loading import parameters_on_meta

        with parameters_on_meta():  # the layer on meta like the rest; mu = 0, sigma = 1 real
            model.value_head = PopArtValueHead(head.in_features, beta=beta)
        attach_value_head(model)
        return
    popart = PopArtValueHead(head.in_features, beta=beta).to(head.weight.device)
    with torch.no_grad():
        popart.weight.copy_(head.weight)
        popart.bias.copy_(head.bias)
    model.value_head = popart
    attach_value_head(model)  # refresh the keys save_pretrained leaves out (the buffers too)


#: Names of the optimizer's critic param group: the value head on the policy, a separate critic.
CRITIC_GROUPS = ("value_head", "critic")


#: The gradient-clip group of the critic's param group (:func:`~ar_torchrl.training.ppo_update`
#: clips it on its own and reports ``train/grad_norm_critic``).
CRITIC_CLIP_GROUP = "critic"


def build_optimizer(
    cfg: Config, model: torch.nn.Module, critic: torch.nn.Module | None = None
) -> torch.optim.Optimizer:
    """AdamW with its own param group for the critic (the policy's value head, or the whole
    separate ``critic``): its own learning rate, and its gradient clipped on its own
    (``clip_group``, :func:`~ar_torchrl.training.ppo_update`; ``train/grad_norm_critic``), so the
    value loss's gradient never shrinks the policy's step (verl clips actor and critic apart)."""
    a = cfg.algo
    value_lr = a.lr if a.value_lr is None else a.value_lr  # 0: a frozen critic
    if critic is not None:
        policy = {"params": list(model.parameters()), "lr": a.lr, "name": "policy"}
        critic_group = {"params": list(critic.parameters()), "lr": value_lr, "name": "critic"}
        groups = [policy, critic_group]
    else:
        head = list(model.value_head.parameters())
        head_ids = {id(p) for p in head}
        policy = [p for p in model.parameters() if id(p) not in head_ids]
        groups = [{"params": policy, "lr": a.lr, "name": "policy"}]
        if a.critic_coeff > 0:
            groups.append({"params": head, "lr": value_lr, "name": "value_head"})
    optimizer = torch.optim.AdamW(groups, weight_decay=a.weight_decay)
    critic_clip_groups(optimizer)
    return optimizer


def critic_clip_groups(optimizer: torch.optim.Optimizer) -> None:
    """Give the critic's param group (:data:`CRITIC_GROUPS`) its own gradient-clip group, in place:
    also after ``optimizer.load_state_dict`` of a checkpoint saved before the value head had one
    (loading replaces the group's options with the saved ones)."""
    for group in optimizer.param_groups:
        if group.get("name") in CRITIC_GROUPS:
            group["clip_group"] = CRITIC_CLIP_GROUP
