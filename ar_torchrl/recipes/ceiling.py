"""The critic's ceiling of a frozen policy: what a perfect critic of it could explain.

``benchmarks/critic_ceiling.py`` is the command line; this is its library part. For a fixed policy
(a run's checkpoint, or the starting policy of a configuration: the warm start), sample ``K``
responses for each of ``P`` prompts with the recipe's own environment (its sampling settings,
reward and reward shaping, multi-turn tool episodes), then group by state and estimate
(:func:`ar_torchrl.functional.ev_ceiling`):

- **token level**: every trained token, its Monte-Carlo return (``gamma = 1``: the sum of the
  rewards from that token on, i.e. the outcome plus any later per-token shaping), grouped by its
  state, the prompt and the response prefix before it (tool tokens included:
  :func:`ar_torchrl.functional.prefix_state_ids`). This is the population
  ``critic/explained_variance`` is computed on, so quote that metric as "EV x of ceiling y".
- **prompt level**: every sample, its return, grouped by prompt (identical prompt tokens are one
  prompt): what a critic that reads only the prompt could explain of the episode's return.
- **by position**: the token-level ceiling of the first, middle and last third of each response's
  trained tokens (where in the response the outcome becomes knowable).

The standard errors are bootstraps over prompts; singletons (states seen once) are excluded from
the within-state variance and counted (the rule and its bias: :mod:`ar_torchrl.functional.ceiling`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDictBase

from ar_torchrl.functional import token_gae
from ar_torchrl.functional.ceiling import (
    CeilingEstimate,
    ev_ceiling,
    ev_ceiling_within_groups,
    prefix_state_ids,
)

__all__ = ["POSITION_BUCKETS", "CeilingReport", "ceiling_from_trajectories", "measure_ceiling"]

logger = logging.getLogger(__name__)

#: The thirds of each response's trained tokens that ``by_position`` reports.
POSITION_BUCKETS = ("early", "middle", "late")


@dataclass
class CeilingReport:
    """The ceilings of one policy (see the module docstring).

    Attributes:
        token: token-level ceiling (every trained token, grouped by prompt + response prefix).
        prompt: prompt-level ceiling (every sample's return, grouped by prompt).
        by_position: token-level ceiling of the early / middle / late third of the responses.
        prompts: distinct prompts sampled (rows with the same prompt tokens count once);
            samples_per_prompt: ``K``.
        return_mean: mean return of the samples; response_length: mean trained tokens per sample.
        per_prompt: ``{"prompt_id", "samples", "return_mean"}`` of every prompt row sampled.
        within_prompt: ``1 - E[Var(R | s)] / E[Var(R | prompt)]`` over the trained tokens
            (:func:`~ar_torchrl.functional.ev_ceiling_within_groups`), the bound of
            ``critic/explained_variance_within_prompt``: what a critic can know beyond the prompt.
    """

    token: CeilingEstimate
    prompt: CeilingEstimate
    by_position: dict[str, CeilingEstimate]
    prompts: int
    samples_per_prompt: int
    return_mean: float
    response_length: float
    per_prompt: list[dict] = field(default_factory=list)
    within_prompt: CeilingEstimate | None = None

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["by_position"] = {k: v.as_dict() for k, v in self.by_position.items()}
        return out


def _padded(td: TensorDictBase, key, width: int, value) -> torch.Tensor:
    x = td.get(key)
    x = x.squeeze(-1) if x.ndim == 3 else x
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)


def _stack(trajectories: list[TensorDictBase]) -> dict[str, torch.Tensor]:
    """The keys the ceiling reads, right-padded to one width (masks say what is real)."""
    width = max(td.shape[1] for td in trajectories)
    keys = {
        "tokens": ("tokens", 0),
        "attention_mask": ("attention_mask", False),
        "loss_mask": ("loss_mask", False),
        "reward": (("next", "reward"), 0.0),
        "prompt_id": ("prompt_id", -1),
    }
    return {
        name: torch.cat([_padded(td, key, width, value) for td in trajectories])
        for name, (key, value) in keys.items()
    }


def _position_bucket(loss_mask: torch.Tensor) -> torch.Tensor:
    """``[B, L]``: 0 / 1 / 2 for the first / middle / last third of each row's trained tokens."""
    index = loss_mask.long().cumsum(-1) - 1
    count = loss_mask.sum(-1, keepdim=True).clamp_min(1)
    return (3 * index).div(count, rounding_mode="floor").clamp(0, 2)


def ceiling_from_trajectories(
    trajectories: list[TensorDictBase],
    *,
    samples_per_prompt: int,
    bootstrap: int = 200,
    generator: torch.Generator | None = None,
) -> CeilingReport:
    """The ceilings of sampled token trajectories (design section 1's layout; any widths).

    Args:
        trajectories: ``[B, L]`` batches with ``tokens``, ``attention_mask``, ``loss_mask``,
            ``("next", "reward")`` and ``prompt_id``: all samples of a prompt must be present
            (rows of one prompt are grouped by their prompt tokens).
        samples_per_prompt: ``K`` (reported).
        bootstrap: bootstrap replicates of the standard errors (0: none).
        generator: RNG of the bootstrap.

    Raises:
        ValueError: no trajectory, or fewer than two samples.
    """
    if not trajectories:
        raise ValueError("ceiling_from_trajectories: no trajectories given")
    b = _stack(trajectories)
    mask = b["loss_mask"]
    returns, _ = token_gae(
        b["reward"], torch.zeros_like(b["reward"]), mask, gamma=1.0, lmbda=1.0
    )  # lambda = 1 and V = 0: the advantage is the Monte-Carlo return
    states = prefix_state_ids(b["tokens"], b["attention_mask"])
    first = mask.long().argmax(-1, keepdim=True)  # each row's first trained token: its prompt
    prompt = states.gather(1, first).expand_as(states)
    est = dict(bootstrap=bootstrap, generator=generator)
    token = ev_ceiling(returns[mask], states[mask], prompt[mask], **est)
    rows = torch.arange(mask.shape[0]).unsqueeze(-1).expand_as(mask)
    within_prompt = ev_ceiling_within_groups(
        returns[mask], states[mask], prompt[mask], rows[mask], **est
    )
    sample_return = returns.gather(1, first).squeeze(1)
    by_prompt = ev_ceiling(sample_return, prompt[:, 0], prompt[:, 0], **est)
    bucket = _position_bucket(mask)
    by_position = {}
    for i, name in enumerate(POSITION_BUCKETS):
        sel = mask & (bucket == i)
        if int(sel.sum()) >= 2:  # responses of one or two tokens leave a third empty
            by_position[name] = ev_ceiling(returns[sel], states[sel], prompt[sel], **est)
    return CeilingReport(
        token=token,
        prompt=by_prompt,
        by_position=by_position,
        prompts=by_prompt.states,
        samples_per_prompt=samples_per_prompt,
        return_mean=float(sample_return.mean()),
        response_length=float(mask.sum(-1).float().mean()),
        per_prompt=_per_prompt(b["prompt_id"][:, 0], sample_return),
        within_prompt=within_prompt,
    )


def _per_prompt(prompt_id: torch.Tensor, sample_return: torch.Tensor) -> list[dict]:
    ids, inverse = torch.unique(prompt_id, return_inverse=True)
    n = torch.bincount(inverse, minlength=len(ids))
    total = torch.zeros(len(ids), dtype=torch.float64).index_add_(
        0, inverse, sample_return.double()
    )
    return [
        {"prompt_id": int(i), "samples": int(k), "return_mean": float(s / k)}
        for i, k, s in zip(ids, n, total)
    ]


def measure_ceiling(
    env: Any,
    prompts: int,
    *,
    bootstrap: int = 200,
    seed: int = 0,
) -> CeilingReport:
    """Sample ``prompts`` prompts (``env.num_samples`` responses each) from ``env`` and report the
    ceilings of the policy behind its backend.

    Args:
        env: an :class:`~ar_torchrl.envs.LLMEnv` (or ``ToolEnv``): its dataset, backend, sampling
            settings and reward are what is measured; ``env.collect()`` is called
            ``ceil(prompts / env.prompts_per_batch)`` times (the last batch's extra prompts are
            kept: every prompt keeps its ``K`` samples).
        prompts: how many prompts to sample (at least 2).
        bootstrap: bootstrap replicates of the standard errors.
        seed: the bootstrap's seed.

    Example:
        >>> from ar_torchrl.backends import SamplingParams, TransformersBackend
        >>> from ar_torchrl.data.datasets import arithmetic_dataset
        >>> from ar_torchrl.envs import LLMEnv
        >>> from ar_torchrl.models import build_char_tokenizer, build_tiny_qwen3
        >>> tok = build_char_tokenizer()
        >>> backend = TransformersBackend(build_tiny_qwen3(len(tok)))
        >>> env = LLMEnv(arithmetic_dataset(8), tok, backend, num_samples=3, prompts_per_batch=2,
        ...              sampling=SamplingParams(max_new_tokens=4))
        >>> report = measure_ceiling(env, 4, bootstrap=0)
        >>> report.prompts, report.samples_per_prompt, report.token.items <= 4 * 3 * 4
        (4, 3, True)
    """
    if prompts < 2:
        raise ValueError(f"measure_ceiling: prompts must be >= 2, got {prompts}")
    if env.num_samples < 2:
        raise ValueError(
            f"measure_ceiling: the env samples {env.num_samples} response per prompt; the "
            "within-prompt variance needs at least 2 (build it with num_samples=K >= 2)"
        )
    batches = math.ceil(prompts / env.prompts_per_batch)
    trajectories = [env.collect() for _ in range(batches)]
    report = ceiling_from_trajectories(
        trajectories,
        samples_per_prompt=env.num_samples,
        bootstrap=bootstrap,
        generator=torch.Generator().manual_seed(seed),
    )
    logger.info(
        "ceiling over %d prompts x %d samples: prompt-level %.3f +- %.3f, token-level %.3f +- %.3f",
        report.prompts,
        report.samples_per_prompt,
        report.prompt.ceiling,
        report.prompt.stderr,
        report.token.ceiling,
        report.token.stderr,
    )
    return report


def policy_for_ceiling(cfg: Any, checkpoint: str | Path | None = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of a recipe configuration, built as the recipe builds its policy:
    the starting policy (warm-started when configured), with ``checkpoint``'s weights when given
    (a single-process ``.pt`` checkpoint of a run with this configuration)."""
    from ar_torchrl.recipes.strategy import LocalStrategy

    strategy = LocalStrategy(cfg.device)
    separate = cfg.critic.kind == "separate"
    model, tokenizer, _ = strategy.build_policy(cfg.model, cfg.cache_dir, value_head=not separate)
    if checkpoint is not None:
        from ar_torchrl.checkpoint.local import load_checkpoint

        path = Path(checkpoint)
        if path.is_dir():
            raise ValueError(
                f"{path} is a distributed (FSDP2) checkpoint directory; the ceiling tool reads "
                "single-process .pt checkpoints"
            )
        critic = None
        if separate:  # the checkpoint holds both models: the critic is read and left unused
            critic = strategy.build_critic(model, tokenizer, None, cfg.critic.model_path)[0].model
        if cfg.critic.confidence_features:  # the head's MLP is in the checkpoint: same modules
            from ar_torchrl.modules import attach_confidence_features

            attach_confidence_features(model if critic is None else critic)
        load_checkpoint(path, model=model, critic=critic, restore_rng=False)
    return model.eval(), tokenizer


def ceiling_of_config(
    cfg: Any,
    *,
    checkpoint: str | Path | None = None,
    prompts: int = 64,
    samples_per_prompt: int = 16,
    split: str = "train",
    prompts_per_batch: int = 16,
    bootstrap: int = 200,
    seed: int = 0,
) -> CeilingReport:
    """:func:`measure_ceiling` of a recipe configuration's policy (:func:`policy_for_ceiling`) on
    its training (``split="train"``) or held-out prompts, sampled in-process with the recipe's
    ``rollout`` settings (temperature, top-p/top-k, ``max_new_tokens``, overlong shaping, tools) and
    its reward, ``samples_per_prompt`` responses per prompt.

    Args:
        cfg: the typed recipe configuration (:func:`ar_torchrl.recipes.dapo_ppo.validate_config`).
        checkpoint: a ``.pt`` checkpoint of a run of ``cfg`` (``None``: the starting policy).
        prompts: prompts to sample; samples_per_prompt: ``K`` (at least 2).
        split: ``"train"`` (the training rows, a seeded shuffle) or ``"holdout"``.
        prompts_per_batch: prompts per generation batch.
        bootstrap: bootstrap replicates of the standard errors; seed: the prompt order, the
            backend's sampling and the bootstrap (the global RNGs are not touched).
    """
    env, _ = sampling_env_of_config(
        cfg,
        checkpoint=checkpoint,
        prompts=prompts,
        samples_per_prompt=samples_per_prompt,
        split=split,
        prompts_per_batch=prompts_per_batch,
        seed=seed,
    )
    with torch.no_grad():
        return measure_ceiling(env, prompts, bootstrap=bootstrap, seed=seed)


def sampling_env_of_config(
    cfg: Any,
    *,
    checkpoint: str | Path | None = None,
    prompts: int = 64,
    samples_per_prompt: int = 16,
    split: str = "train",
    prompts_per_batch: int = 16,
    seed: int = 0,
) -> tuple[Any, Any]:
    """``(env, policy model)``: the env :func:`ceiling_of_config` samples from: the configuration's policy
    (:func:`policy_for_ceiling`) on a trainside backend, its training (``split="train"``) or
    held-out prompts, the recipe's ``rollout`` settings and reward, ``samples_per_prompt``
    responses per prompt, ``min(prompts_per_batch, prompts)`` prompts per ``env.collect()``; the
    model is the policy behind its backend (e.g. to copy as a critic of what it samples)."""
    from ar_torchrl.backends import TransformersBackend
    from ar_torchrl.backends.transformers.config import TrainsideBackendConfig
    from ar_torchrl.recipes.dapo_ppo import build

    if split not in ("train", "holdout"):
        raise ValueError(f"ceiling_of_config: split must be 'train' or 'holdout', got {split!r}")
    model, tokenizer = policy_for_ceiling(cfg, checkpoint)
    rows, held = cfg.data.build()
    chosen = rows if split == "train" else held
    trainside = isinstance(cfg.backend, TrainsideBackendConfig)  # else: all rows at once
    batch = cfg.backend.max_batch_size if trainside else None
    backend = TransformersBackend(model, mode="share", max_batch_size=batch, seed=seed)
    context = build.context_length(model, backend)
    chosen, _ = build.fit_prompts(cfg, (chosen, held), tokenizer, context)
    rollout = dataclasses.replace(
        cfg.rollout,
        samples_per_prompt=samples_per_prompt,
        prompts_per_iter=min(prompts_per_batch, prompts),
    )
    run_cfg = dataclasses.replace(cfg, rollout=rollout, seed=seed)
    env, _ = build.build_envs(
        run_cfg, chosen, held, tokenizer, backend, model, trainer_can_generate=True
    )
    return env, model
