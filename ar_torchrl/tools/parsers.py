"""The call formats (:data:`~ar_torchrl.tools.registry.PARSERS`): ``tag`` and ``hermes``.

``tag`` (:class:`TagParser`), small enough for a character-level model::

    <tool name="calculator">12*34</tool>

The name is an identifier (letters, digits, ``_ . -``); the arguments are the raw text up to the
first ``</tool>`` (a string, given to the tool as is). Any ``<tool`` followed by a space or ``>``
opens a call, so ``<tools>`` in prose is not one, and a call that does not follow the grammar is
malformed.

``hermes`` (:class:`HermesParser`), the format Qwen2.5 / Qwen3 (and Hermes-2-Pro) are trained on,
as their chat templates render an assistant's ``tool_calls`` and as their system prompt asks the
model to write them::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12*34"}}
    </tool_call>

(the JSON object is ``json.dumps`` with ``ensure_ascii=False``: the templates' ``tojson``). The body
must be a JSON object with a string ``name`` and an object ``arguments`` (a JSON string holding an
object is accepted too, as some models write it). Reference: the ``tool_call`` rendering and the
``# Tools`` system block of the chat template in Qwen/Qwen3-8B's ``tokenizer_config.json`` and
Qwen2.5-*-Instruct's; the Qwen docs' "Function Calling" page (Hermes-style tool use).

Both read the model's text and nothing else can break them: any text gives the calls or a
:class:`~ar_torchrl.tools.base.ToolCallError` (a JSON body nested past the recursion limit, or with
an integer past Python's 4300 digits, is a malformed call like any other), and ``format`` refuses a
call it could not read back (``tests/tools/test_parsers.py`` checks both with hypothesis).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ar_torchrl.tools.base import ToolCall, ToolCallError
from ar_torchrl.tools.registry import register_parser

__all__ = ["HermesParser", "TagParser"]

_NAME = r"[A-Za-z_][A-Za-z0-9_.-]*"


def _snippet(text: str, start: int, width: int = 60) -> str:
    piece = text[start : start + width]
    return piece + ("..." if len(text) > start + width else "")


def _json_error(err: Exception) -> str:
    """Why ``json.loads`` refused the model's text: the decoder's message, or what went wrong
    beyond it (brackets nested past the recursion limit, an integer past Python's 4300 digits)."""
    if isinstance(err, json.JSONDecodeError):
        return str(err)
    if isinstance(err, RecursionError):
        return "brackets nested too deeply"
    return f"{type(err).__name__}: {str(err).split(';')[0][:120]}"


class TagParser:
    """``<tool name="NAME">ARGUMENTS</tool>`` (see the module docstring).

    Example:
        >>> parser = TagParser()
        >>> parser.parse('So <tool name="calculator">12*34</tool>')
        [ToolCall(name='calculator', arguments='12*34', text='<tool name="calculator">12*34</tool>')]
        >>> parser.parse("no call here"), parser.format(ToolCall("calculator", "1+1", ""))
        ([], '<tool name="calculator">1+1</tool>')
        >>> parser.parse('<tool name="calculator">12*34')
        Traceback (most recent call last):
        ...
        ar_torchrl.tools.base.ToolCallError: the call '<tool name="calculator">12*34' is not closed with </tool>
    """

    name = "tag"
    syntax = '<tool name="NAME">ARGUMENTS</tool>'
    _OPEN = re.compile(r"<tool(?=[\s>])")
    _HEAD = re.compile(r'<tool name="([^"<>]*)">')
    _CALL = re.compile(rf'<tool name="({_NAME})">(.*?)</tool>', re.DOTALL)

    def parse(self, text: str) -> list[ToolCall]:
        calls, pos = [], 0
        while (opening := self._OPEN.search(text, pos)) is not None:
            match = self._CALL.match(text, opening.start())
            if match is None or self._OPEN.search(match[2]):
                raise ToolCallError(self._why(text, opening.start(), match))
            calls.append(ToolCall(match[1], match[2], match[0]))
            pos = match.end()
        return calls

    def _why(self, text: str, start: int, match: re.Match | None) -> str:
        head = self._HEAD.match(text, start)
        if match is not None:
            return f"a call inside the call {_snippet(text, start)!r}"
        if head is None:
            return f'expected <tool name="NAME">, got {_snippet(text, start)!r}'
        if re.fullmatch(_NAME, head[1]) is None:
            return f"invalid tool name {head[1]!r}"
        return f"the call {_snippet(text, start)!r} is not closed with </tool>"

    def format(self, call: ToolCall) -> str:
        arguments = call.arguments
        if not isinstance(arguments, str) or "</tool>" in arguments or self._OPEN.search(arguments):
            raise ValueError(
                f"tag format: arguments must be a string without <tool or </tool>, got {arguments!r}"
            )
        if re.fullmatch(_NAME, call.name) is None:
            raise ValueError(f"tag format: invalid tool name {call.name!r}")
        return f'<tool name="{call.name}">{arguments}</tool>'


class HermesParser:
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (the module docstring).

    Example:
        >>> parser = HermesParser()
        >>> text = parser.format(ToolCall("calculator", {"expression": "12*34"}, ""))
        >>> print(text)
        <tool_call>
        {"name": "calculator", "arguments": {"expression": "12*34"}}
        </tool_call>
        >>> parser.parse("Let me compute. " + text)[0].arguments
        {'expression': '12*34'}
        >>> parser.parse('<tool_call>{"name": "calculator"}</tool_call>')
        Traceback (most recent call last):
        ...
        ar_torchrl.tools.base.ToolCallError: the call has no "arguments" object: '<tool_call>{"name": "calculator"}</tool_call>'
    """

    name = "hermes"
    syntax = '<tool_call>\n{"name": "NAME", "arguments": {ARGUMENTS AS JSON}}\n</tool_call>'
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    _OPEN = "<tool_call>"

    def parse(self, text: str) -> list[ToolCall]:
        calls, pos = [], 0
        while (start := text.find(self._OPEN, pos)) != -1:
            match = self._CALL.match(text, start)
            if match is None:
                raise ToolCallError(
                    f"the call {_snippet(text, start)!r} is not closed with </tool_call>"
                )
            calls.append(self._read(match[1], match[0]))
            pos = match.end()
        return calls

    def _read(self, body: str, span: str) -> ToolCall:
        if self._OPEN in body:
            raise ToolCallError(f"a call inside the call {_snippet(span, 0)!r}")
        try:
            obj = json.loads(body)
        except Exception as err:  # any fault of the model's text is a malformed call
            raise ToolCallError(
                f"the call is not valid JSON ({_json_error(err)}): {_snippet(span, 0)!r}"
            ) from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            raise ToolCallError(f'the call has no "name" string: {_snippet(span, 0)!r}')
        arguments = obj.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except Exception:  # not JSON: refused below (no object)
                pass
        if not isinstance(arguments, dict):
            raise ToolCallError(f'the call has no "arguments" object: {_snippet(span, 0)!r}')
        return ToolCall(obj["name"], arguments, span)

    def format(self, call: ToolCall) -> str:
        if not isinstance(call.arguments, dict):
            raise ValueError(f"hermes format: arguments must be a dict, got {call.arguments!r}")
        if not isinstance(call.name, str) or not call.name:
            raise ValueError(
                f"hermes format: the name must be a non-empty string, got {call.name!r}"
            )
        body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
        if self._OPEN in body or "</tool_call>" in body:
            raise ValueError(
                f"hermes format: the name and arguments must not contain <tool_call> or "
                f"</tool_call> (the call could not be read back), got {_snippet(body, 0)!r}"
            )
        return f"<tool_call>\n{body}\n</tool_call>"


@register_parser("tag", help='<tool name="NAME">ARGUMENTS</tool> (small models)')
@dataclass
class TagParserConfig:
    """``tool_parser: tag`` (no options)."""

    def build(self) -> TagParser:
        return TagParser()


@register_parser("hermes", help="Qwen / Hermes JSON calls in <tool_call> tags")
@dataclass
class HermesParserConfig:
    """``tool_parser: hermes`` (no options)."""

    def build(self) -> HermesParser:
        return HermesParser()
