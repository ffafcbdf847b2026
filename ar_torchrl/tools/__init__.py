"""Tools for multi-turn episodes: the protocol, the registries, the calculator, the call formats,
and the chat template's token deltas for tool messages. Nothing here imports torch.

- :mod:`ar_torchrl.tools.base`: :class:`ToolCall`, :class:`ToolResult`, the :class:`Tool` and
  :class:`CallParser` protocols, :func:`run_tool` (never raises: faults become error messages).
- :mod:`ar_torchrl.tools.toolbox`: :class:`Toolbox` (``handle(text) -> ToolTurn``).
- :mod:`ar_torchrl.tools.parsers`: ``tag`` and ``hermes`` (:data:`PARSERS`).
- :mod:`ar_torchrl.tools.calculator`: ``calculator`` (:data:`TOOLS`), an ``ast`` evaluator.
- :mod:`ar_torchrl.tools.config`: :class:`ToolConfig`, the recipe's schema.
- :mod:`ar_torchrl.tools.template`: :func:`tool_delta_ids`, :func:`check_prefix_stable`.
"""

from ar_torchrl.tools.base import (
    ERROR_KINDS,
    CallParser,
    ErrorKind,
    Tool,
    ToolCall,
    ToolCallError,
    ToolResult,
    run_tool,
    truncate,
)
from ar_torchrl.tools.calculator import Calculator, CalculatorConfig, CalculatorError, format_number
from ar_torchrl.tools.config import ToolConfig
from ar_torchrl.tools.parsers import HermesParser, TagParser
from ar_torchrl.tools.registry import PARSERS, TOOLS, register_parser, register_tool
from ar_torchrl.tools.template import (
    PrefixCheck,
    PrefixMismatchError,
    PrefixMismatchWarning,
    check_prefix_stable,
    render_ids,
    tool_delta_ids,
    tool_delta_text,
)
from ar_torchrl.tools.toolbox import COUNTERS, Toolbox, ToolTurn

__all__ = [
    "COUNTERS",
    "ERROR_KINDS",
    "PARSERS",
    "TOOLS",
    "Calculator",
    "CalculatorConfig",
    "CalculatorError",
    "CallParser",
    "ErrorKind",
    "HermesParser",
    "PrefixCheck",
    "PrefixMismatchError",
    "PrefixMismatchWarning",
    "TagParser",
    "Tool",
    "ToolCall",
    "ToolCallError",
    "ToolConfig",
    "ToolResult",
    "ToolTurn",
    "Toolbox",
    "check_prefix_stable",
    "format_number",
    "register_parser",
    "register_tool",
    "render_ids",
    "run_tool",
    "tool_delta_ids",
    "tool_delta_text",
    "truncate",
]
