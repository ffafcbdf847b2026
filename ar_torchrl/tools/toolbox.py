"""The :class:`Toolbox`: a model turn's text in, the tool messages (and counters) out.

``Toolbox.handle(text)`` parses the calls with its :class:`~ar_torchrl.tools.base.CallParser`,
runs each known tool through :func:`~ar_torchrl.tools.base.run_tool` and returns a
:class:`ToolTurn`: the calls, their results (the tool messages' contents) and counters by error
kind. A turn without a call ends the episode (``turn.ended``). Nothing here imports torch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ar_torchrl.tools.base import (
    ERROR_KINDS,
    CallParser,
    Tool,
    ToolCall,
    ToolCallError,
    ToolResult,
    error_result,
    known_names,
    run_tool,
    truncate,
)
from ar_torchrl.utils.checks import check_number, check_timeout

__all__ = ["COUNTERS", "ToolTurn", "Toolbox", "check_toolbox_args"]

logger = logging.getLogger(__name__)

#: The keys of :attr:`ToolTurn.counts` (always all present, so counts add up across turns).
COUNTERS: tuple[str, ...] = ("calls", "errors", "dropped", *ERROR_KINDS)


def check_toolbox_args(
    owner: str = "Toolbox",
    *,
    timeout_s: Any = 5.0,
    max_output_chars: Any = 512,
    max_calls_per_turn: Any = 1,
) -> dict[str, Any]:
    """Arguments of :class:`Toolbox` (``timeout_s > 0`` or ``None``; integers ``>= 1``).

    Example:
        >>> check_toolbox_args(timeout_s=0)
        Traceback (most recent call last):
        ...
        ValueError: Toolbox: timeout_s must be > 0, got 0 (None: no deadline)
    """
    return {
        "timeout_s": check_timeout(owner, "timeout_s", timeout_s, allow_none=True),
        "max_output_chars": check_number(
            owner, "max_output_chars", max_output_chars, ge=1, integer=True
        ),
        "max_calls_per_turn": check_number(
            owner, "max_calls_per_turn", max_calls_per_turn, ge=1, integer=True
        ),
    }


@dataclass
class ToolTurn:
    """What one model turn's calls produced.

    Attributes:
        calls: the calls that were run (``results[i]`` answers ``calls[i]``); empty when the text
            had no call or a malformed one.
        results: one result per call run, or a single ``"malformed"`` result when the parser could
            not read the text. Their contents are the tool messages, in order.
        dropped: calls found beyond ``max_calls_per_turn`` (not run, no message).

    Example:
        >>> turn = ToolTurn([], [ToolResult("error: ...", ok=False, error="malformed")])
        >>> turn.ended, turn.counts["calls"], turn.counts["malformed"], turn.contents
        (False, 1, 1, ['error: ...'])
    """

    calls: list[ToolCall]
    results: list[ToolResult]
    dropped: int = 0

    @property
    def ended(self) -> bool:
        """No call in the text: the episode ends with this turn."""
        return not self.results

    @property
    def contents(self) -> list[str]:
        """The tool messages' contents, in order."""
        return [r.content for r in self.results]

    def messages(self, role: str = "tool") -> list[dict[str, str]]:
        """The tool messages as chat messages (``[{"role": role, "content": ...}, ...]``)."""
        return [{"role": role, "content": r.content} for r in self.results]

    @property
    def counts(self) -> dict[str, int]:
        """``calls`` (results, malformed ones included), ``errors``, ``dropped`` and one count
        per error kind (:data:`COUNTERS`)."""
        counts = dict.fromkeys(COUNTERS, 0)
        counts.update(calls=len(self.results), dropped=self.dropped)
        for result in self.results:
            if result.error is not None:
                counts["errors"] += 1
                counts[result.error] += 1
        return counts


@dataclass
class Toolbox:
    """Tools, the call format, and the limits every call runs under.

    Args:
        tools: the tools (distinct names).
        parser: the call format (:data:`~ar_torchrl.tools.registry.PARSERS`).
        timeout_s: each call's deadline (``None``: none; see
            :func:`~ar_torchrl.tools.base.run_tool` for abandoned threads).
        max_output_chars: longer answers are truncated and count as ``"oversized"``.
        max_calls_per_turn: calls run per turn; further ones are dropped (counted).

    Example:
        >>> from ar_torchrl.tools import Calculator, TagParser
        >>> box = Toolbox([Calculator()], TagParser())
        >>> turn = box.handle('<tool name="calculator">12*34</tool>')
        >>> turn.contents, turn.ended
        (['408'], False)
        >>> box.handle('<tool name="search">cats</tool>').contents
        ["error: unknown tool 'search'; known tools: calculator"]
        >>> box.handle("The answer is 408.").ended
        True
        >>> box.format_call("calculator", "7*6")
        '<tool name="calculator">7*6</tool>'
    """

    tools: Iterable[Tool] | Mapping[str, Tool]
    parser: CallParser
    timeout_s: float | None = 5.0
    max_output_chars: int = 512
    max_calls_per_turn: int = 1
    _by_name: dict[str, Tool] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        args = check_toolbox_args(
            timeout_s=self.timeout_s,
            max_output_chars=self.max_output_chars,
            max_calls_per_turn=self.max_calls_per_turn,
        )
        self.timeout_s = args["timeout_s"]
        tools = list(self.tools.values() if isinstance(self.tools, Mapping) else self.tools)
        names = [t.name for t in tools]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"Toolbox: two tools are named {duplicates}; give them distinct names")
        self.tools = tools
        self._by_name = dict(zip(names, tools))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._by_name)

    @property
    def description(self) -> str:
        """The prompt text that lists the tools and says how to call them."""
        lines = ["Tools:"] + [f"- {tool.description}" for tool in self.tools]
        lines.append(f"To call a tool, write {self.parser.syntax}")
        lines.append("Its answer comes back in the next message.")
        return "\n".join(lines)

    def format_call(self, name: str, arguments: Any) -> str:
        """The text a model writes to call ``name`` with ``arguments`` (warm-start traces)."""
        return self.parser.format(ToolCall(name, arguments, ""))

    def handle(self, text: str) -> ToolTurn:
        """Parse ``text`` (a model turn), run its calls, return the :class:`ToolTurn`; never raises
        for a fault of the model or of a tool: any exception a parser raises on the text is a
        ``"malformed"`` result, anything a tool raises (``SystemExit`` and ``KeyboardInterrupt``
        included) a ``"raised"`` one. Only a signal to the process (Ctrl-C, SIGTERM) comes
        through (:func:`~ar_torchrl.tools.base.run_tool`)."""
        try:
            calls = self.parser.parse(text)
        except ToolCallError as err:
            message = f"malformed tool call: {err}. The format is {self.parser.syntax}"
            return ToolTurn([], [error_result("malformed", message)])
        except Exception as err:  # a parser that let the model's text break it: still malformed
            logger.warning(
                "the %r parser raised %s on a model turn (a parser should raise ToolCallError); "
                "answered as a malformed call",
                self.parser.name,
                type(err).__name__,
                exc_info=True,
            )
            why = truncate(f"{type(err).__name__}: {err}", 200)[0]
            message = f"malformed tool call: {why}. The format is {self.parser.syntax}"
            return ToolTurn([], [error_result("malformed", message)])
        run, dropped = calls[: self.max_calls_per_turn], len(calls) - self.max_calls_per_turn
        return ToolTurn(run, [self.call(c) for c in run], dropped=max(dropped, 0))

    def call(self, call: ToolCall) -> ToolResult:
        """The result of one call: an ``"unknown_tool"`` error, or :func:`run_tool`'s result."""
        tool = self._by_name.get(call.name) if isinstance(call.name, str) else None
        if tool is None:
            name = truncate(str(call.name), 40)[0]
            message = f"unknown tool {name!r}; known tools: {known_names(self.tools)}"
            return error_result("unknown_tool", message)
        return run_tool(
            tool, call, timeout_s=self.timeout_s, max_output_chars=self.max_output_chars
        )
