"""The schemas of the recipe's own sections: ``algo``, ``logger``, ``rollout``, ``train``.

Part of the recipe's configuration (examples/dapo_ppo_config.py holds the whole :class:`Config`,
the schemas of the swappable group options, ``dist``, and the validation); split off to keep each
file short. Ranges come from :mod:`ar_torchrl.checks`, the checks the library itself applies. Nothing
here imports torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from ar_torchrl.checks import (
    check_choice,
    check_gae_args,
    check_grpo_args,
    check_optimizer_args,
    check_ppo_loss_args,
    check_ppo_update_args,
)
from ar_torchrl.checks import check_number as _check_number
from ar_torchrl.objectives.registry import advantage_names, needs_critic
from ar_torchrl.utils.loggers import LOGGER_KINDS

# OmegaConf reads the annotations at run time: they must stay `Optional[...]`, not `X | None`.
# ruff: noqa: UP045


def check_number(key: str, value: Any, **bounds: Any) -> Any:
    return _check_number("config", key, value, **bounds)


def check_count(key: str, value: Any, *, ge: int = 1, allow_none: bool = False) -> Any:
    return _check_number("config", key, value, ge=ge, integer=True, allow_none=allow_none)


# --------------------------------------------------------------------------- algo, logger
@dataclass
class GAEConfig:
    """Arguments of ``make_advantage("gae")`` (``TokenGAE``) besides ``gamma``."""

    lmbda: float = 0.95
    normalize_advantage: bool = True

    def check(self) -> None:
        check_gae_args("config: algo.gae.", **asdict(self))


@dataclass
class GRPOConfig:
    """Arguments of ``make_advantage("grpo")`` (``GRPOAdvantage``) besides ``gamma``."""

    scale: bool = True
    drop_zero_spread: bool = False

    def check(self) -> None:
        check_grpo_args("config: algo.grpo.", **asdict(self))


@dataclass
class AlgoConfig:
    """The advantage estimator (by registry name), the PPO loss and the optimizer."""

    advantage_mode: str = MISSING
    gamma: float = 1.0
    gae: GAEConfig = field(default_factory=GAEConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    clip_epsilon: list[float] = MISSING
    clip_value: Optional[float] = None
    entropy_coeff: float = 0.0
    critic_coeff: float = MISSING
    kl_coeff: float = MISSING
    loss_agg_mode: str = "token_mean"
    ppo_epochs: int = MISSING
    num_minibatches: int = 1
    lr: float = MISSING
    value_lr: Optional[float] = None
    weight_decay: float = 0.0
    grad_clip: Optional[float] = 1.0
    critic_warmup_iters: int = 0

    def advantage_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the estimator: ``gamma`` and its own section (``algo.<mode>``)."""
        section = getattr(self, self.advantage_mode, None)
        return {"gamma": self.gamma, **(asdict(section) if section is not None else {})}

    def check(self, *, norm_length: int) -> None:
        """Ranges of the library's own checks; ``norm_length`` is the recipe's max_new_tokens."""
        key = "config: algo."
        check_choice(key, "advantage_mode", self.advantage_mode, advantage_names())
        if needs_critic(self.advantage_mode) and not self.critic_coeff > 0:
            raise ValueError(
                f"config: algo.advantage_mode={self.advantage_mode} needs the value head: set "
                f"algo.critic_coeff > 0 (got {self.critic_coeff})"
            )
        check_number("algo.gamma", self.gamma, ge=0, le=1)
        self.gae.check()
        self.grpo.check()
        check_ppo_loss_args(
            key,
            clip_epsilon=list(self.clip_epsilon),
            clip_value=self.clip_value,
            entropy_coeff=self.entropy_coeff,
            critic_coeff=self.critic_coeff,
            kl_coeff=self.kl_coeff,
            loss_agg_mode=self.loss_agg_mode,
            norm_length=norm_length,
        )
        check_count("algo.ppo_epochs", self.ppo_epochs)  # ppo_update's `epochs`
        check_ppo_update_args(key, num_minibatches=self.num_minibatches, grad_clip=self.grad_clip)
        check_optimizer_args(
            key, lr=self.lr, value_lr=self.value_lr, weight_decay=self.weight_decay
        )
        check_count("algo.critic_warmup_iters", self.critic_warmup_iters, ge=0)
        if self.critic_warmup_iters and not self.critic_coeff > 0:
            raise ValueError(
                f"config: algo.critic_warmup_iters={self.critic_warmup_iters} trains only the value "
                f"head, which algo.critic_coeff={self.critic_coeff} switches off: set critic_coeff > 0"
            )


@dataclass
class LoggerConfig:
    """TorchRL's metric logger (``ar_torchrl.utils.make_logger``)."""

    kind: str = "csv"
    exp_name: str = "dapo_ppo"
    project: str = "ar_torchrl"

    def check(self) -> None:
        check_choice("config", "logger.kind", self.kind, LOGGER_KINDS)


# --------------------------------------------------------------------------- rollout, train
@dataclass
class RolloutConfig:
    """How prompts are sampled and completions generated (``rollout.*``)."""

    prompts_per_iter: int = MISSING
    samples_per_prompt: int = MISSING
    max_new_tokens: int = MISSING
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    token_budget: int = MISSING
    max_rows: Optional[int] = None
    packing: Any = False  # False | True | "auto" (plan_micro_batches)
    overlong_buffer: Optional[int] = None
    overlong_penalty: float = 1.0
    dynamic_sampling: bool = False  # DAPO: keep groups whose rewards differ, refill (the collector)
    max_sampling_rounds: int = 4

    def check(self) -> None:
        for key in (
            "prompts_per_iter",
            "samples_per_prompt",
            "max_new_tokens",
            "token_budget",
            "max_sampling_rounds",
        ):
            check_count(f"rollout.{key}", getattr(self, key))
        check_number("rollout.temperature", self.temperature, ge=0)
        check_number("rollout.top_p", self.top_p, gt=0, le=1)
        if not (self.top_k == -1 or self.top_k >= 1):
            raise ValueError(f"config: rollout.top_k must be -1 (off) or >= 1, got {self.top_k}")
        check_count("rollout.max_rows", self.max_rows, allow_none=True)
        if not (isinstance(self.packing, bool) or self.packing == "auto"):
            raise ValueError(
                f"config: rollout.packing={self.packing!r} must be false, true or auto"
            )
        check_number(
            "rollout.overlong_buffer",
            self.overlong_buffer,
            ge=1,
            le=self.max_new_tokens,
            integer=True,
            allow_none=True,
        )
        check_number("rollout.overlong_penalty", self.overlong_penalty, ge=0)


@dataclass
class TrainConfig:
    """The loop, evaluation, checkpoints and resuming (``train.*``)."""

    iterations: int = MISSING
    mode: str = "sync"
    eval_every: int = 0
    eval_prompts: int = 64
    checkpoint_every: int = 0
    keep_checkpoints: Optional[int] = 2
    resume_from: Optional[str] = None
    plot: bool = True

    def check(self) -> None:
        check_count("train.iterations", self.iterations)
        check_choice("config", "train.mode", self.mode, ("sync", "async"))
        check_count("train.eval_every", self.eval_every, ge=0)  # 0 = off
        check_count("train.eval_prompts", self.eval_prompts)
        check_count("train.checkpoint_every", self.checkpoint_every, ge=0)  # 0 = only at the end
        check_count("train.keep_checkpoints", self.keep_checkpoints, allow_none=True)  # null: all
        if self.resume_from is not None and not self.resume_from.strip():
            raise ValueError("config: train.resume_from must be null, 'auto' or a path, got ''")
