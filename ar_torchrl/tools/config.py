"""The torch-free config schema of a recipe's tools: :class:`ToolConfig` builds the :class:`Toolbox`.

A recipe says::

    tools:
      tools: [calculator]
      tool_parser: tag
      timeout_s: 5.0
      max_output_chars: 512
      max_calls_per_turn: 1
      tool_options:
        calculator: {max_digits: 30}

Every name is looked up in the registries (:data:`~ar_torchrl.tools.registry.TOOLS`,
:data:`~ar_torchrl.tools.registry.PARSERS`) and every option checked before anything is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ar_torchrl.tools.registry import PARSERS, TOOLS
from ar_torchrl.tools.toolbox import Toolbox, check_toolbox_args

__all__ = ["ToolConfig"]


@dataclass
class ToolConfig:
    """Which tools, which call format, and the limits of every call.

    Example:
        >>> cfg = ToolConfig(tools=["calculator"], tool_parser="tag", timeout_s=2.0)
        >>> cfg.check("config: env.")
        >>> cfg.build().handle('<tool name="calculator">2**10</tool>').contents
        ['1024']
        >>> ToolConfig(tools=["calculater"]).check("config: env.")
        Traceback (most recent call last):
        ...
        ValueError: config: env.tools: unknown tool 'calculater' (did you mean 'calculator'?); registered: ['calculator']
    """

    tools: list[str] = field(default_factory=lambda: ["calculator"])  # registered tool names
    tool_parser: str = "tag"  # call format: tag | hermes
    timeout_s: float | None = 5.0  # each call's deadline (None: no deadline)
    max_output_chars: int = 512  # longer answers are truncated (an "oversized" error)
    max_calls_per_turn: int = 1  # further calls in one turn are dropped (counted)
    tool_options: dict[str, Any] = field(default_factory=dict)  # per tool: {name: {option: value}}

    def check(self, prefix: str = "") -> None:
        check_toolbox_args(
            prefix or "ToolConfig",
            timeout_s=self.timeout_s,
            max_output_chars=self.max_output_chars,
            max_calls_per_turn=self.max_calls_per_turn,
        )
        tools = list(self.tools) if not isinstance(self.tools, str) else None
        if not tools:
            raise ValueError(
                f"{prefix}tools must be a non-empty list of tool names, got {self.tools!r}; "
                f"registered: {list(TOOLS.names())}"
            )
        for name in tools:
            TOOLS.lookup(name, key=f"{prefix}tools")
        if len(set(tools)) != len(tools):
            raise ValueError(f"{prefix}tools lists a tool twice: {tools}")
        PARSERS.lookup(self.tool_parser, key=f"{prefix}tool_parser")
        for name, values in dict(self.tool_options or {}).items():
            if name not in tools:
                raise ValueError(
                    f"{prefix}tool_options.{name}: {name!r} is not in {prefix}tools {tools}"
                )
            TOOLS.options(name, values, prefix=f"{prefix}tool_options.{name}.")

    def build(self) -> Toolbox:
        """The checked :class:`Toolbox`."""
        self.check()
        options = dict(self.tool_options or {})
        return Toolbox(
            [TOOLS.build(name, options.get(name)) for name in self.tools],
            PARSERS.build(self.tool_parser),
            timeout_s=self.timeout_s,
            max_output_chars=self.max_output_chars,
            max_calls_per_turn=self.max_calls_per_turn,
        )
