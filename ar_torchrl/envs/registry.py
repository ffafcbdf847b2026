"""The registry of environment kinds (:data:`ENV_KINDS`): how a run turns prompts into episodes.

A kind is registered by decorating its options' dataclass (the one shape of
:mod:`ar_torchrl.registry`)::

    @register_env_kind("tool", help="multi-turn episodes with tool calls", multi_turn=True)
    @dataclass
    class ToolEnvConfig:
        def build(self, context: EnvContext) -> LLMEnv: ...

``build`` gets an :class:`EnvContext` (what a run hands every kind: the rows, the tokenizer, the
rollout engine, the reward, how to sample, and the multi-turn limits) and returns a TorchRL env
whose ``collect()`` gives a token trajectory (:class:`~ar_torchrl.envs.LLMEnv`'s contract).
Metadata: ``multi_turn`` (the kind runs several model turns per episode: the recipe gives it the
episode's token budget and allows ``rollout.max_turns > 1``) and ``needs_tools`` (it needs the
recipe's ``tools``). Built in (:mod:`ar_torchrl.envs.config`): ``single_turn``
(:class:`~ar_torchrl.envs.LLMEnv`) and ``tool`` (:class:`~ar_torchrl.envs.ToolEnv`). Nothing here
imports torch.

Example:
    >>> ENV_KINDS.names(), ENV_KINDS["tool"].multi_turn, ENV_KINDS["single_turn"].needs_tools
    (('single_turn', 'tool'), True, False)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ar_torchrl.registry import Registry

__all__ = ["ENV_KINDS", "EnvContext", "register_env_kind"]

ENV_KINDS = Registry(
    "environment kind",
    builtins=("ar_torchrl.envs.config",),
    decorator="register_env_kind",
    build="build(self, context: EnvContext) -> LLMEnv",
    meta={"multi_turn": False, "needs_tools": False},
)

#: ``@register_env_kind(name, help=..., multi_turn=..., needs_tools=...)`` on the kind's options
#: dataclass (:meth:`ar_torchrl.registry.Registry.register` of :data:`ENV_KINDS`).
register_env_kind = ENV_KINDS.register


@dataclass
class EnvContext:
    """What a run hands an environment kind's ``build``.

    Attributes:
        rows: the prompts (a dataset of DAPO-schema rows).
        tokenizer, backend: the policy's tokenizer and the rollout engine.
        reward_fn: the reward over a whole sample (:mod:`ar_torchrl.rewards`).
        sampling: how to sample one model turn (``SamplingParams``).
        num_samples, prompts_per_batch: completions per prompt, prompts per batch.
        seed, shuffle: the prompt sampler's seed and whether it shuffles.
        toolbox: the tools of an episode (``None``: the run has no tools).
        max_turns, max_total_tokens, tool_error_penalty, template_check: the multi-turn limits
            (``max_total_tokens`` is set for ``multi_turn`` kinds only).
    """

    rows: Any
    tokenizer: Any
    backend: Any
    reward_fn: Any
    sampling: Any
    num_samples: int
    prompts_per_batch: int
    seed: int = 0
    shuffle: bool = True
    toolbox: Any = None
    max_turns: int = 1
    max_total_tokens: int | None = None
    tool_error_penalty: float = 0.0
    template_check: str = "raise"

    def env_args(self) -> tuple[tuple[Any, Any, Any], dict[str, Any]]:
        """``(args, kwargs)`` of :class:`~ar_torchrl.envs.LLMEnv` (what every kind passes on)."""
        kwargs = {
            "reward_fn": self.reward_fn,
            "num_samples": self.num_samples,
            "prompts_per_batch": self.prompts_per_batch,
            "sampling": self.sampling,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }
        return (self.rows, self.tokenizer, self.backend), kwargs
