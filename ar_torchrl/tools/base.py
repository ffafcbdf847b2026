"""The tool protocol: calls, results, parsers, and :func:`run_tool`, which never raises.

A multi-turn episode alternates the model's turns with tool messages. Each model turn is handed to
a :class:`CallParser`, which finds the :class:`ToolCall` spans in the text; each call runs through
:func:`run_tool`, which turns every fault of the tool (an exception, a deadline, an oversized
answer) into a :class:`ToolResult` whose ``content`` is the message the model reads next. Nothing
here imports torch.

Error kinds (``ToolResult.error``): ``"malformed"`` (the parser could not read the call),
``"unknown_tool"``, ``"raised"`` (the tool raised, or returned something that is not a string),
``"timeout"`` and ``"oversized"`` (the answer was longer than ``max_output_chars``; it is truncated,
with a marker, and the result is not ok).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, get_args, runtime_checkable

__all__ = [
    "ERROR_KINDS",
    "CallParser",
    "ErrorKind",
    "Tool",
    "ToolCall",
    "ToolCallError",
    "ToolResult",
    "error_result",
    "run_tool",
    "truncate",
]

logger = logging.getLogger(__name__)

ErrorKind = Literal["malformed", "unknown_tool", "raised", "timeout", "oversized"]
ERROR_KINDS: tuple[str, ...] = get_args(ErrorKind)


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote.

    Attributes:
        name: the tool's name.
        arguments: what the parser read as the arguments (a string for the ``tag`` parser, a JSON
            object for ``hermes``).
        text: the raw span of the model's output that the call was read from.

    Example:
        >>> ToolCall("calculator", "12*34", '<tool name="calculator">12*34</tool>').name
        'calculator'
    """

    name: str
    arguments: Any
    text: str


@dataclass(frozen=True)
class ToolResult:
    """What a call produced: ``content`` is the tool message the model reads next.

    Attributes:
        content: the tool's answer, or the error message for the model.
        ok: the tool answered in time, within the size limit.
        error: the :data:`ErrorKind` when not ok, ``None`` when ok.

    Example:
        >>> ToolResult("408", ok=True, error=None).ok
        True
    """

    content: str
    ok: bool
    error: ErrorKind | None = None

    def __post_init__(self) -> None:
        if self.ok != (self.error is None):
            raise ValueError(f"ToolResult: ok={self.ok} with error={self.error!r}")
        if self.error is not None and self.error not in ERROR_KINDS:
            raise ValueError(f"ToolResult: error={self.error!r} is not one of {list(ERROR_KINDS)}")


class ToolCallError(ValueError):
    """A parser could not read a call in the model's output (a ``"malformed"`` result)."""


@runtime_checkable
class Tool(Protocol):
    """A tool: a name, the text that describes it in the prompt, and ``tool(arguments) -> str``.

    A tool may raise: :func:`run_tool` turns the exception into an error message for the model.

    Example:
        >>> from ar_torchrl.tools import Calculator
        >>> isinstance(Calculator(), Tool), Calculator().name
        (True, 'calculator')
    """

    name: str
    description: str

    def __call__(self, arguments: Any) -> str: ...


@runtime_checkable
class CallParser(Protocol):
    """A call format: finds calls in the model's text and writes them.

    Attributes:
        name: the registered name (``"tag"``, ``"hermes"``).
        syntax: how the prompt describes the format to the model (one line).

    ``parse(text)`` returns the calls in order (``[]``: no call, the episode ends) and raises
    :class:`ToolCallError` for a malformed one, and nothing else for any text (the
    :class:`~ar_torchrl.tools.toolbox.Toolbox` still answers any other exception as a malformed
    call); ``format(call)`` is the exact text a model should
    write for ``call`` (warm-start traces), so that ``parse(format(call))`` is ``[call]`` with
    ``text`` the formatted span.

    Example:
        >>> from ar_torchrl.tools import TagParser
        >>> parser = TagParser()
        >>> isinstance(parser, CallParser), parser.parse(parser.format(ToolCall("calculator", "1+1", "")))
        (True, [ToolCall(name='calculator', arguments='1+1', text='<tool name="calculator">1+1</tool>')])
    """

    name: str
    syntax: str

    def parse(self, text: str) -> list[ToolCall]: ...

    def format(self, call: ToolCall) -> str: ...


def truncate(text: str, max_chars: int) -> tuple[str, bool]:
    """``text`` cut to ``max_chars`` characters with a marker naming what was cut, and whether it was.

    Example:
        >>> truncate("0123456789", 4)
        ('0123... [truncated: 6 more characters]', True)
        >>> truncate("0123", 4)
        ('0123', False)
    """
    if len(text) <= max_chars:
        return text, False
    return f"{text[:max_chars]}... [truncated: {len(text) - max_chars} more characters]", True


def error_result(kind: ErrorKind, message: str) -> ToolResult:
    """A non-ok result whose content is ``"error: " + message``."""
    return ToolResult(f"error: {message}", ok=False, error=kind)


def run_tool(
    tool: Tool, call: ToolCall, *, timeout_s: float | None, max_output_chars: int
) -> ToolResult:
    """Run ``tool(call.arguments)`` and return its result; never raises for the tool's fault.

    The tool runs in a daemon worker thread that is joined with the deadline ``timeout_s``
    (``None``: no deadline); a tool still running then is **abandoned** (Python cannot stop a
    thread): its thread runs on until the tool returns, and its answer is dropped. Tools should
    therefore be bounded by themselves (the calculator is); a tool that may hang for good belongs
    in a subprocess.

    Whatever the tool raises is its own, ``BaseException`` included: a ``SystemExit`` or
    ``KeyboardInterrupt`` raised by the tool is a ``"raised"`` result like any exception (Python
    delivers signals to the main thread only, never to the worker). A signal to the process
    (Ctrl-C, SIGTERM) interrupts the caller's wait instead, and what its handler raises (the
    recipe's :class:`~ar_torchrl.recipes.launch.StopOnSignal`: ``KeyboardInterrupt``) propagates
    from here, so it still stops the run; a handler that returns lets the wait go on.

    Args:
        tool: the tool.
        call: the call (``call.arguments`` goes to the tool).
        timeout_s: the deadline in seconds, or ``None``.
        max_output_chars: longer answers are cut (with a marker) and the result is ``"oversized"``.

    Returns:
        ``ToolResult(answer, ok=True)``, or an error result whose content says what went wrong:
        ``"raised"`` (an exception, or an answer that is not a ``str``), ``"timeout"``,
        ``"oversized"``.

    Example:
        >>> from ar_torchrl.tools import Calculator
        >>> run_tool(Calculator(), ToolCall("calculator", "1/0", ""), timeout_s=1.0, max_output_chars=64)
        ToolResult(content='error: calculator failed: ZeroDivisionError: division by zero', ok=False, error='raised')
        >>> run_tool(Calculator(), ToolCall("calculator", "2**99", ""), timeout_s=None, max_output_chars=8)
        ToolResult(content='63382530... [truncated: 22 more characters]', ok=False, error='oversized')
    """
    outcome = _call_with_deadline(tool, call.arguments, timeout_s)
    if outcome is None:
        logger.warning("tool %r timed out after %g s (thread abandoned)", tool.name, timeout_s)
        return error_result("timeout", f"{tool.name} timed out after {timeout_s:g} s")
    answer, err = outcome
    if err is not None:
        detail = truncate(_text_of(err), max_output_chars)[0]  # the exception's text is the tool's
        message = f"{type(err).__name__}: {detail}" if detail else type(err).__name__
        return error_result("raised", f"{tool.name} failed: {message}")
    if not isinstance(answer, str):
        return error_result(
            "raised", f"{tool.name} returned {type(answer).__name__}, expected a string"
        )
    content, cut = truncate(answer, max_output_chars)
    if cut:
        return ToolResult(content, ok=False, error="oversized")
    return ToolResult(content, ok=True)


def _call(tool: Tool, arguments: Any) -> tuple[Any, BaseException | None]:
    try:
        return tool(arguments), None
    except BaseException as err:  # in the worker thread: the tool's own raise, never a signal
        return None, err


def _text_of(err: BaseException) -> str:
    try:
        return str(err)
    except Exception:  # an exception whose __str__ raises: its class names it
        return ""


def _call_with_deadline(
    tool: Tool, arguments: Any, timeout_s: float | None
) -> tuple[Any, BaseException | None] | None:
    """``_call`` in a daemon thread joined with a deadline (``None``: none); ``None`` when it is
    still running. A signal's handler runs in the caller's thread during ``join``: what it raises
    propagates."""
    box: list[tuple[Any, BaseException | None]] = []
    worker = threading.Thread(
        target=lambda: box.append(_call(tool, arguments)), name=f"tool-{tool.name}", daemon=True
    )
    worker.start()
    worker.join(timeout_s)
    return box[0] if box else None


def known_names(tools: Sequence[Tool]) -> str:
    """``"a, b"``: the tools' names, for messages."""
    return ", ".join(t.name for t in tools) or "(none)"
