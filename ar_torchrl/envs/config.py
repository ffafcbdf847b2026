"""The built-in environment kinds' torch-free schemas (:data:`~ar_torchrl.envs.registry.ENV_KINDS`).

``single_turn``: one prompt, one completion (:class:`~ar_torchrl.envs.LLMEnv`); ``tool``: multi-turn
episodes whose turns may call the recipe's tools (:class:`~ar_torchrl.envs.ToolEnv`). Neither has
options of its own: the multi-turn limits are the recipe's ``rollout.*`` keys, the tools its
``tools`` section. ``build`` imports the environment when called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ar_torchrl.envs.registry import EnvContext, register_env_kind

__all__ = ["SingleTurnEnvConfig", "ToolEnvConfig"]


@register_env_kind("single_turn", help="one prompt, one completion, one reward (LLMEnv)")
@dataclass
class SingleTurnEnvConfig:
    """``rollout.env=single_turn``: :class:`~ar_torchrl.envs.LLMEnv`."""

    def build(self, context: EnvContext) -> Any:
        from ar_torchrl.envs.llm_env import LLMEnv

        args, kwargs = context.env_args()
        return LLMEnv(*args, **kwargs)


@register_env_kind(
    "tool",
    help="multi-turn episodes whose turns call tools (ToolEnv)",
    multi_turn=True,
    needs_tools=True,
)
@dataclass
class ToolEnvConfig:
    """``rollout.env=tool``: :class:`~ar_torchrl.envs.ToolEnv` over the recipe's tools."""

    def build(self, context: EnvContext) -> Any:
        from ar_torchrl.envs.tool_env import ToolEnv

        args, kwargs = context.env_args()
        return ToolEnv(
            *args,
            toolbox=context.toolbox,
            max_turns=context.max_turns,
            max_total_tokens=context.max_total_tokens,
            tool_error_penalty=context.tool_error_penalty,
            template_check=context.template_check,
            **kwargs,
        )
