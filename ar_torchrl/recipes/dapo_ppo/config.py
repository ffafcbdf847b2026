"""The DAPO-PPO recipe's configuration: its own sections, and the registries' group options.

The values live in ``ar_torchrl/configs/`` (every key commented there). Group options come from the component
registries, each with its schema (:func:`schemas`): ``model`` (:data:`ar_torchrl.models.config.MODELS`),
``backend`` (:data:`ar_torchrl.backends.registry.BACKENDS`), ``data``
(:data:`ar_torchrl.data.registry.TASKS`), ``reward`` (:data:`ar_torchrl.rewards.REWARDS`); the
advantage estimators' options are the ``algo.<name>`` sections of :class:`AlgoConfig`
(:data:`ar_torchrl.objectives.registry.ADVANTAGES`). This module defines the recipe's own sections
(``algo``, ``rollout``, ``train``, ``logger``, ``dist``, ``checkpoint``) and the whole :class:`Config`, whose
``check()`` applies the same range checks the library applies (:mod:`ar_torchrl.utils.checks`).

Nothing here imports torch: the recipe answers ``--help`` and rejects a bad configuration in under a
second, before it loads the training stack.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any, Optional

from omegaconf import MISSING, DictConfig

from ar_torchrl.backends.registry import BACKENDS
from ar_torchrl.data.registry import TASKS
from ar_torchrl.envs.registry import ENV_KINDS
from ar_torchrl.models.config import MODELS
from ar_torchrl.objectives.policy_loss import POLICY_LOSSES, RolloutCorrection
from ar_torchrl.objectives.registry import ADVANTAGES, needs_critic
from ar_torchrl.recipes import config as recipe_config
from ar_torchrl.recipes.launch import world_size
from ar_torchrl.rewards.registry import REWARDS
from ar_torchrl.tools.config import ToolConfig
from ar_torchrl.utils.checks import (
    check_bool,
    check_choice,
    check_number,
    check_optimizer_args,
    check_ppo_loss_args,
    check_ppo_update_args,
    check_sampling_args,
    check_timeout,
    check_token_budget,
)
from ar_torchrl.utils.loggers import LOGGER_KINDS

# OmegaConf reads the annotations at run time: they must stay `Optional[...]`, not `X | None`.
# ruff: noqa: UP045

__all__ = [
    "GROUPS",
    "AlgoConfig",
    "CheckpointConfig",
    "Config",
    "CriticConfig",
    "DistConfig",
    "LoggerConfig",
    "RolloutConfig",
    "TrainConfig",
    "config_schema",
    "schemas",
    "validate_config",
]

#: config group -> the registry whose entries are its options.
GROUPS = {"model": MODELS, "backend": BACKENDS, "data": TASKS, "reward": REWARDS}


#: Bounds that catch typos (1e12) before they reach numpy/torch: no model has a longer context than
#: MAX_TOKENS, no batch of rollouts has more rows than MAX_BATCH_ROWS, and a machine with more than
#: MAX_THREADS cores for one trainer process does not exist yet.
MAX_TOKENS = 1 << 20
MAX_BATCH_ROWS = 1 << 20
MAX_THREADS = 1024
_TOO_LONG = "longer than any model's context"


def _count(prefix: str, key: str, value: Any, *, ge: int = 1, allow_none: bool = False) -> Any:
    return check_number(prefix, key, value, ge=ge, integer=True, allow_none=allow_none)


# --------------------------------------------------------------------------- algo
@dataclass
class _AlgoKeys:
    """The advantage estimator (by registry name), the PPO loss and the optimizer."""

    advantage_mode: str = MISSING
    gamma: float = 1.0
    clip_epsilon: list[float] = MISSING
    clip_value: Optional[float] = None
    entropy_coeff: float = 0.0
    critic_coeff: float = MISSING
    kl_coeff: float = MISSING
    kl_estimator: str = "k3"
    kl_in_reward: float = 0.0
    tis_cap: Optional[float] = None
    policy_loss: str = "clip"
    rollout_correction: RolloutCorrection = field(default_factory=RolloutCorrection)
    loss_agg_mode: str = "token_mean"
    ppo_epochs: int = MISSING
    num_minibatches: int = 1
    lr: float = MISSING
    value_lr: Optional[float] = None
    value_lr_schedule: str = "constant"
    value_lr_warmup_iters: int = 0
    value_lr_min_ratio: float = 0.0
    weight_decay: float = 0.0
    grad_clip: Optional[float] = 1.0
    critic_warmup_iters: int = 0
    critic_warmup_until_ev: Optional[float] = None
    value_norm: str = "none"
    popart_beta: float = 0.1
    critic_epochs: int = 1

    def advantage_options(self) -> Any:
        """The selected estimator's options: its ``algo.<advantage_mode>`` section."""
        return getattr(self, self.advantage_mode, None)

    def policy_loss_options(self) -> Any:
        """The selected policy loss's options: its ``algo.<policy_loss>`` section."""
        return getattr(self, self.policy_loss, None)

    def check(self, *, norm_length: int) -> None:
        """Ranges of the library's own checks; ``norm_length`` is the recipe's max_new_tokens."""
        p = "config: algo."
        check_choice(p, "policy_loss", self.policy_loss, POLICY_LOSSES.names())
        for entry in POLICY_LOSSES.entries():  # a section per loss with options (None: defaults)
            POLICY_LOSSES.options(
                entry.name, getattr(self, entry.name, None), prefix=f"{p}{entry.name}."
            )
        self.rollout_correction.check(f"{p}rollout_correction.")
        if self.tis_cap is not None and self.rollout_correction.resolved().is_level is not None:
            raise ValueError(
                f"config: algo.tis_cap={self.tis_cap} and algo.rollout_correction (is_level="
                f"{self.rollout_correction.resolved().is_level!r}) both set an importance weight: "
                "keep one (tis_cap is rollout_correction.is_level=token with is_cap=tis_cap)"
            )
        check_choice(p, "advantage_mode", self.advantage_mode, ADVANTAGES.names())
        if needs_critic(self.advantage_mode) and not self.critic_coeff > 0:
            raise ValueError(
                f"config: algo.advantage_mode={self.advantage_mode} needs the value head: set "
                f"algo.critic_coeff > 0 (got {self.critic_coeff})"
            )
        check_number(p, "gamma", self.gamma, ge=0, le=1)
        for entry in ADVANTAGES.entries():
            if entry.config is not None:
                ADVANTAGES.options(
                    entry.name, getattr(self, entry.name, None), prefix=f"{p}{entry.name}."
                )
        clip = self.clip_epsilon  # a list; an interpolation may give a number (checked there)
        check_ppo_loss_args(
            p,
            clip_epsilon=list(clip)
            if isinstance(clip, Iterable) and not isinstance(clip, str)
            else clip,
            clip_value=self.clip_value,
            entropy_coeff=self.entropy_coeff,
            critic_coeff=self.critic_coeff,
            kl_coeff=self.kl_coeff,
            loss_agg_mode=self.loss_agg_mode,
            norm_length=norm_length,
            kl_estimator=self.kl_estimator,
            tis_cap=self.tis_cap,
        )
        check_number(p, "kl_in_reward", self.kl_in_reward, ge=0)
        if self.kl_in_reward > 0 and not needs_critic(self.advantage_mode):
            raise ValueError(
                f"config: algo.kl_in_reward={self.kl_in_reward} shapes the per-token rewards that "
                f"GAE turns into advantages; advantage_mode={self.advantage_mode} scores whole "
                "episodes: use algo.kl_coeff (the KL as a loss term) there, or advantage_mode=gae"
            )
        _count(p, "ppo_epochs", self.ppo_epochs)  # ppo_update's `epochs`
        check_ppo_update_args(p, num_minibatches=self.num_minibatches, grad_clip=self.grad_clip)
        check_optimizer_args(p, lr=self.lr, value_lr=self.value_lr, weight_decay=self.weight_decay)
        check_choice(p, "value_lr_schedule", self.value_lr_schedule, VALUE_LR_SCHEDULES)
        _count(p, "value_lr_warmup_iters", self.value_lr_warmup_iters, ge=0)
        check_number(p, "value_lr_min_ratio", self.value_lr_min_ratio, ge=0, le=1)
        _count(p, "critic_warmup_iters", self.critic_warmup_iters, ge=0)
        _count(p, "critic_epochs", self.critic_epochs)
        if self.critic_epochs > 1 and not self.critic_coeff > 0:
            raise ValueError(
                f"config: algo.critic_epochs={self.critic_epochs} adds value-loss passes; "
                f"algo.critic_coeff={self.critic_coeff} trains no value head: set critic_coeff > 0"
            )
        check_choice(p, "value_norm", self.value_norm, ("none", "popart"))
        check_number(p, "popart_beta", self.popart_beta, gt=0, le=1)
        if self.value_norm != "none" and not self.critic_coeff > 0:
            raise ValueError(
                f"config: algo.value_norm={self.value_norm} normalises the value head's targets; "
                f"algo.critic_coeff={self.critic_coeff} trains no value head: set critic_coeff > 0 "
                "or value_norm=none"
            )
        check_number(
            p, "critic_warmup_until_ev", self.critic_warmup_until_ev, le=1, allow_none=True
        )
        if self.critic_warmup_iters and not self.critic_coeff > 0:
            raise ValueError(
                f"config: algo.critic_warmup_iters={self.critic_warmup_iters} trains only the value "
                f"head, which algo.critic_coeff={self.critic_coeff} switches off: set critic_coeff > 0"
            )


def algo_sections() -> tuple[tuple[str, type], ...]:
    """``(name, schema)`` of every estimator and policy loss registered now: the ``algo.<name>``
    sections (registering one adds its section)."""
    sections = tuple(
        (e.name, e.config)
        for registry in (ADVANTAGES, POLICY_LOSSES)
        for e in registry.entries()
        if e.config is not None
    )
    keys = {f.name for f in fields(_AlgoKeys)}
    clash = [name for name, _ in sections if name in keys]
    if clash:
        raise ValueError(
            f"config: the estimator / policy loss name(s) {clash} are algo keys; register them "
            "under other names (their options are the algo.<name> section)"
        )
    return sections


def _algo_schema(sections: tuple[tuple[str, type], ...]) -> type:
    return make_dataclass(
        "AlgoConfig",
        [(name, schema, field(default_factory=schema)) for name, schema in sections],
        bases=(_AlgoKeys,),
    )


#: ``algo``: :class:`_AlgoKeys` plus one section per registered estimator with options
#: (``algo.gae``, ``algo.grpo``, ``algo.rloo``) and per registered policy loss (``algo.clip``,
#: ``algo.gspo``, ``algo.gspo_token``, ``algo.cispo``): the built-ins'; :func:`config_schema` adds
#: those registered later (a user's ``imports:``).
_BUILTIN_SECTIONS = algo_sections()
AlgoConfig = _algo_schema(_BUILTIN_SECTIONS)


#: ``algo.value_lr_schedule``: the critic's learning rate over the iterations (after the warm-up).
VALUE_LR_SCHEDULES = ("constant", "linear", "cosine")


# --------------------------------------------------------------------------- critic
#: ``critic``: where the values come from.
CRITIC_KINDS = ("shared", "separate")


@dataclass
class CriticConfig:
    """``critic=shared|separate``: the value head on the policy LM, or a second model with its own
    head (:class:`~ar_torchrl.modules.LMCritic`), and an optional warm start of either from an
    earlier run's checkpoint."""

    kind: str = "shared"
    model_path: Optional[str] = None  # separate: a local HF causal LM with the policy's tokenizer
    init_from: Optional[str] = None  # an earlier run's checkpoint (or run directory)
    pretrain_from: Optional[str] = None  # an earlier run dir whose saved rollouts train the critic
    pretrain_epochs: int = 10  # passes over those rollouts at most (the cap)
    confidence_features: bool = False  # the value head also reads the sampling log-probs so far

    def check(self, prefix: str) -> None:
        check_choice(prefix, "kind", self.kind, CRITIC_KINDS)
        check_bool(prefix, "confidence_features", self.confidence_features)
        _count(prefix, "pretrain_epochs", self.pretrain_epochs)
        if self.model_path is not None and self.kind != "separate":
            raise ValueError(
                f"{prefix}model_path={self.model_path!r} is the separate critic's model: it needs "
                f"critic=separate (got {prefix.rsplit(' ', 1)[-1]}kind={self.kind})"
            )
        for key in ("model_path", "init_from", "pretrain_from"):
            value = getattr(self, key)
            if value is not None and not str(value).strip():
                raise ValueError(f"{prefix}{key} must be null or a path, got ''")


# --------------------------------------------------------------------------- logger, rollout, train
@dataclass
class LoggerConfig:
    """TorchRL's metric logger (``ar_torchrl.utils.make_logger``)."""

    kind: str = "csv"
    exp_name: str = "dapo_ppo"
    project: str = "ar_torchrl"

    def check(self, prefix: str) -> None:
        check_choice(prefix, "kind", self.kind, LOGGER_KINDS)


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
    packing: Any = "auto"  # False | True | "auto" (plan_micro_batches; measured faster on CPU)
    shared_prefix: Any = "auto"  # False | True | "auto": a prompt's samples compute it once
    overlong_buffer: Optional[int] = None
    overlong_penalty: float = 1.0
    dynamic_sampling: bool = False  # DAPO: keep groups whose rewards differ, refill (the collector)
    max_sampling_rounds: int = 4
    critic_flat_groups: bool = False  # dynamic sampling: zero-spread groups train the critic only
    env: Optional[str] = (
        None  # environment kind (ENV_KINDS); None: tool with `tools`, else single_turn
    )
    env_options: dict[str, Any] = field(default_factory=dict)  # that kind's options
    max_turns: int = 1  # model turns per episode (> 1 needs a multi-turn env kind: tool)
    max_total_tokens: Optional[int] = None  # multi-turn: tokens per episode (None: the context)
    tool_error_penalty: float = 0.0  # multi-turn: reward added per failed tool call of a turn
    template_check: str = (
        "raise"  # multi-turn: raise | warn | off when a template is not prefix-stable
    )

    def check(self, prefix: str) -> None:
        for key in ("prompts_per_iter", "samples_per_prompt"):
            _count(prefix, key, getattr(self, key))
        check_sampling_args(  # SamplingParams' own checks
            prefix,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
        )
        check_token_budget(prefix, self.token_budget)  # plan_micro_batches' own check
        check_number(prefix, "max_new_tokens", self.max_new_tokens, le=MAX_TOKENS, hint=_TOO_LONG)
        rows = self.prompts_per_iter * self.samples_per_prompt
        if rows > MAX_BATCH_ROWS:
            raise ValueError(
                f"{prefix}prompts_per_iter x {prefix.rsplit(' ', 1)[-1]}samples_per_prompt = "
                f"{self.prompts_per_iter} x {self.samples_per_prompt} = {rows} rows per batch, more "
                f"than {MAX_BATCH_ROWS}: lower them (every row is generated and trained each step)"
            )
        _count(prefix, "max_sampling_rounds", self.max_sampling_rounds)
        _count(prefix, "max_rows", self.max_rows, allow_none=True)
        if not (isinstance(self.packing, bool) or self.packing == "auto"):
            raise ValueError(f"{prefix}packing={self.packing!r} must be false, true or auto")
        if not (isinstance(self.shared_prefix, bool) or self.shared_prefix == "auto"):
            raise ValueError(
                f"{prefix}shared_prefix={self.shared_prefix!r} must be false, true or auto"
            )
        check_number(
            prefix,
            "overlong_buffer",
            self.overlong_buffer,
            ge=1,
            le=self.max_new_tokens,
            integer=True,
            allow_none=True,
        )
        check_number(prefix, "overlong_penalty", self.overlong_penalty, ge=0)
        _count(prefix, "max_turns", self.max_turns)
        _count(prefix, "max_total_tokens", self.max_total_tokens, allow_none=True)
        if self.max_total_tokens is not None and self.max_total_tokens <= self.max_new_tokens:
            raise ValueError(
                f"{prefix}max_total_tokens={self.max_total_tokens} must be > "
                f"{prefix.rsplit(' ', 1)[-1]}max_new_tokens={self.max_new_tokens} (room for a prompt)"
            )
        check_number(prefix, "tool_error_penalty", self.tool_error_penalty)
        check_choice(prefix, "template_check", self.template_check, ("raise", "warn", "off"))
        if self.env is not None:
            ENV_KINDS.lookup(self.env, key=f"{prefix}env")


@dataclass
class TrainConfig:
    """The loop, evaluation, checkpoints and resuming (``train.*``)."""

    iterations: int = MISSING
    mode: str = "sync"
    async_correction: str = "decoupled"
    max_policy_lag: int = 1
    partial_rollouts: bool = False
    eval_every: int = 0
    eval_prompts: int = 64
    checkpoint_every: int = 0
    keep_checkpoints: Optional[int] = 2
    resume_from: Optional[str] = None
    plot: bool = True
    export: bool = True
    critic_warn_iters: int = 20  # warn when critic/explained_variance <= 0 this long (0 = off)
    save_rollouts: bool = False  # <run_dir>/rollouts/: each trained batch (critic.pretrain_from)

    def check(self, prefix: str) -> None:
        _count(prefix, "iterations", self.iterations)
        _count(prefix, "critic_warn_iters", self.critic_warn_iters, ge=0)
        check_choice(prefix, "mode", self.mode, ("sync", "async"))
        check_choice(prefix, "async_correction", self.async_correction, ("decoupled", "none"))
        _count(prefix, "max_policy_lag", self.max_policy_lag)
        key = prefix.rsplit(" ", 1)[-1]
        if self.mode != "async" and (self.max_policy_lag > 1 or self.partial_rollouts):
            what = (
                f"{key}max_policy_lag={self.max_policy_lag}"
                if self.max_policy_lag > 1
                else f"{key}partial_rollouts=true"
            )
            raise ValueError(
                f"{prefix}mode={self.mode}: {what} generates batches ahead of the trainer, which "
                f"needs {key}mode=async"
            )
        _count(prefix, "eval_every", self.eval_every, ge=0)  # 0 = off
        _count(prefix, "eval_prompts", self.eval_prompts)
        _count(prefix, "checkpoint_every", self.checkpoint_every, ge=0)  # 0 = only at the end
        _count(prefix, "keep_checkpoints", self.keep_checkpoints, allow_none=True)  # null: all
        if self.resume_from is not None and not self.resume_from.strip():
            raise ValueError(f"{prefix}resume_from must be null, 'auto' or a path, got ''")


# --------------------------------------------------------------------------- dist
@dataclass
class DistConfig:
    """``dist``: data parallelism with FSDP2 under torchrun (``ar_torchrl.distributed``)."""

    backend: str = "auto"
    fsdp: Any = "auto"  # "auto" | True | False
    reshard_after_forward: bool = True
    timeout_s: float = 1800.0

    def check(self, prefix: str) -> None:
        check_choice(prefix, "backend", self.backend, ("auto", "gloo", "nccl"))
        if not (isinstance(self.fsdp, bool) or self.fsdp == "auto"):
            raise ValueError(f"{prefix}fsdp={self.fsdp!r} must be auto, true or false")
        check_timeout(prefix, "timeout_s", self.timeout_s)


# --------------------------------------------------------------------------- checkpoint
@dataclass
class CheckpointConfig:
    """``checkpoint``: how checkpoints are trusted (docs/checkpoints.md)."""

    hmac_key_env: Optional[str] = None  # the NAME of the environment variable holding the key

    def check(self, prefix: str) -> None:
        if self.hmac_key_env is not None:  # the key itself is read (and checked) here, never shown
            from ar_torchrl.checkpoint.signing import CheckpointSigner

            CheckpointSigner.from_env(self.hmac_key_env, option=f"{prefix}hmac_key_env")


# --------------------------------------------------------------------------- the whole config
@dataclass
class Config:
    """The recipe's configuration (ar_torchrl/configs/dapo_ppo.yaml and its groups)."""

    model: Any = MISSING
    backend: Any = MISSING
    algo: AlgoConfig = MISSING
    critic: CriticConfig = field(default_factory=CriticConfig)
    data: Any = MISSING
    reward: Any = MISSING
    logger: LoggerConfig = MISSING
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    tools: Optional[ToolConfig] = None  # tools for multi-turn episodes (None: single-turn LLMEnv)
    imports: list[str] = field(default_factory=list)  # modules that register your own components
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    seed: int = 0
    device: str = "cpu"
    num_threads: int = 1
    cache_dir: str = MISSING
    runs_dir: str = "outputs"

    def check(self) -> None:
        for name in (
            "model",
            "backend",
            "data",
            "reward",
            "logger",
            "rollout",
            "train",
            "dist",
            "critic",
            "checkpoint",
        ):
            getattr(self, name).check(f"config: {name}.")
        if self.tools is not None:
            self.tools.check("config: tools.")
        self.check_env()
        self.algo.check(norm_length=self.rollout.max_new_tokens)
        if self.backend.releases_memory_during_update() and self.train.mode != "sync":
            raise ValueError(
                f"config: backend.release_memory_during_update=true needs train.mode=sync (got "
                f"{self.train.mode}): async generation runs during the update, on the memory it "
                "would release; set train.mode=sync or backend.release_memory_during_update=false"
            )
        if self.critic.kind == "separate" and not self.algo.critic_coeff > 0:
            raise ValueError(
                f"config: critic=separate trains a second model on the value loss, which "
                f"algo.critic_coeff={self.algo.critic_coeff} switches off: set algo.critic_coeff "
                "> 0 or critic=shared"
            )
        if self.critic.init_from is not None and not self.algo.critic_coeff > 0:
            raise ValueError(
                f"config: critic.init_from={self.critic.init_from!r} loads a critic, but "
                f"algo.critic_coeff={self.algo.critic_coeff} trains none: set algo.critic_coeff > 0"
            )
        a = self.algo
        if self.critic.confidence_features and not a.critic_coeff > 0:
            raise ValueError(
                "config: critic.confidence_features=true adds to the critic's values, but "
                f"algo.critic_coeff={a.critic_coeff} trains no critic: set algo.critic_coeff > 0"
            )
        if self.critic.confidence_features and a.value_norm == "popart":
            raise ValueError(
                "config: critic.confidence_features=true adds to unnormalised values and "
                "algo.value_norm=popart's head predicts normalised ones: choose one"
            )
        if self.critic.pretrain_from is not None and not a.critic_coeff > 0:
            raise ValueError(
                f"config: critic.pretrain_from={self.critic.pretrain_from!r} trains a critic, but "
                f"algo.critic_coeff={a.critic_coeff} trains none: set algo.critic_coeff > 0"
            )
        if a.critic_warmup_until_ev is not None and not (
            a.critic_warmup_iters > 0 or self.critic.pretrain_from is not None
        ):
            raise ValueError(
                f"config: algo.critic_warmup_until_ev={a.critic_warmup_until_ev} is the critic's "
                "target for a warm-up, and none is set: add algo.critic_warmup_iters=N (the most "
                "critic-only iterations) and/or critic.pretrain_from=<run dir> (offline)"
            )
        if self.rollout.critic_flat_groups and not (
            self.rollout.dynamic_sampling and self.algo.critic_coeff > 0
        ):
            raise ValueError(
                "config: rollout.critic_flat_groups=true keeps the groups dynamic sampling drops "
                "for the value loss: it needs rollout.dynamic_sampling=true and a value head "
                f"(algo.critic_coeff > 0); got dynamic_sampling={self.rollout.dynamic_sampling}, "
                f"critic_coeff={self.algo.critic_coeff}"
            )
        _count("config", "seed", self.seed, ge=0)
        check_number("config", "seed", self.seed, le=2**32 - 1, integer=True)
        _count("config", "num_threads", self.num_threads)
        check_number("config", "num_threads", self.num_threads, le=MAX_THREADS)
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"config: device={self.device!r} must be cpu, cuda or cuda:<index>")
        if not str(self.runs_dir).strip():
            raise ValueError("config: runs_dir must name a directory, got ''")
        if self.train.eval_every and self.train.eval_prompts > self.data.holdout:
            raise ValueError(
                f"config: train.eval_prompts={self.train.eval_prompts} must be <= "
                f"data.holdout={self.data.holdout} (the held-out rows evaluation draws from)"
            )
        self.check_dist()

    @property
    def env_kind(self) -> str:
        """``rollout.env``, else the kind the config implies: ``tool`` when ``tools`` is set,
        ``single_turn`` otherwise."""
        if self.rollout.env is not None:
            return self.rollout.env
        return "tool" if self.tools is not None else "single_turn"

    def check_env(self) -> None:
        """The environment kind against the tools and the turns, and its options."""
        kind, r = self.env_kind, self.rollout
        entry = ENV_KINDS.lookup(kind, key="config: rollout.env")
        if entry.needs_tools and self.tools is None:
            raise ValueError(
                f"config: rollout.env={kind} runs tool calls: set tools (e.g. --config-name "
                "tool_arithmetic)"
            )
        if self.tools is not None and not entry.needs_tools:
            raise ValueError(
                f"config: tools are set but rollout.env={kind} calls none: set rollout.env=tool "
                "(or null), or tools=null"
            )
        if r.max_turns > 1 and not entry.multi_turn:
            raise ValueError(
                f"config: rollout.max_turns={r.max_turns} needs tools (a multi-turn episode "
                f"continues after a tool answer; rollout.env={kind} has one turn): set tools (e.g. "
                "--config-name tool_arithmetic)"
            )
        ENV_KINDS.options(kind, dict(r.env_options), prefix="config: rollout.env_options.")

    @property
    def sharded(self) -> bool:
        """Train with FSDP2: ``dist.fsdp=true``, or ``auto`` under torchrun (more than one process)
        or with a compute dtype other than float32 (fp32 masters, bf16 compute)."""
        fsdp = self.dist.fsdp
        return fsdp is True or (
            fsdp == "auto" and (world_size() > 1 or self.model.dtype != "float32")
        )

    @property
    def model_checkpoints(self) -> bool:
        """``model.gradient_checkpointing`` (recompute decoder layers in backward)."""
        return bool(getattr(self.model, "gradient_checkpointing", False))

    def check_dist(self) -> None:
        """The ``dist`` settings against the model, the device and the launch (``WORLD_SIZE``)."""
        d = self.dist
        if d.fsdp is False and (world_size() > 1 or self.model.dtype != "float32"):
            why = (
                f"WORLD_SIZE={world_size()}"
                if world_size() > 1
                else f"model.dtype={self.model.dtype}"
            )
            raise ValueError(
                f"config: dist.fsdp=false but {why} needs FSDP2 (data parallelism, or fp32 masters "
                "with low-precision compute; bf16 storage would round lr-1e-6 updates away): set "
                "dist.fsdp=auto"
            )
        if d.backend == "nccl" and not self.device.startswith("cuda"):
            raise ValueError(
                f"config: dist.backend=nccl needs device=cuda, got device={self.device}"
            )
        r = self.rollout
        if (
            r.shared_prefix is True
            and r.packing is False
            and (self.sharded or self.model_checkpoints)
        ):
            why = (
                "model.gradient_checkpointing=true (a recomputed layer would write the prefix's "
                "cache twice)"
                if self.model_checkpoints
                else "FSDP2 (dist.fsdp, torchrun or model.dtype): its two backbone calls per "
                "forward are not verified under fully_shard"
            )
            raise ValueError(
                f"config: rollout.shared_prefix=true with rollout.packing=false (padded shared "
                f"micro-batches) cannot run with {why}; set rollout.packing=auto or true (packed "
                "shared micro-batches, one backbone call) or rollout.shared_prefix=false"
            )
        if self.sharded and self.device.startswith("cuda:"):
            raise ValueError(
                f"config: device={self.device}: with FSDP2 each rank uses cuda:LOCAL_RANK; set "
                "device=cuda (choose the GPUs with CUDA_VISIBLE_DEVICES)"
            )


_SCHEMAS: dict[tuple, type] = {}


def config_schema() -> type:
    """:class:`Config`, with an ``algo.<name>`` section for every estimator and policy loss
    registered now (a user's ``imports:`` may have added some since this module was imported)."""
    sections = algo_sections()
    if sections == _BUILTIN_SECTIONS:
        return Config
    if sections not in _SCHEMAS:
        algo = _algo_schema(sections)
        _SCHEMAS[sections] = make_dataclass(
            "Config", [("algo", algo, field(default=MISSING))], bases=(Config,)
        )
    return _SCHEMAS[sections]


def schemas() -> list[tuple[str | None, str, type]]:
    """``(group, name, schema)`` for Hydra's ConfigStore: the whole config (``schema``, with the
    sections of every estimator and policy loss registered now) and every registered group option
    (``schema_<option>``); YAML files name theirs in ``defaults``."""
    return [(None, "schema", config_schema()), *recipe_config.group_schemas(GROUPS)]


def validate_config(raw: DictConfig) -> Config:
    """The typed, checked configuration (interpolations resolved).

    Raises:
        ValueError, TypeError: a value out of range, of the wrong type, missing, or a key that no
            schema reads, naming the key.
    """
    return recipe_config.validate(raw, Config, groups=GROUPS)
