"""Property-based (hypothesis) tests of the call formats: any text gives calls or a ToolCallError
(and, through the Toolbox, a result, never an exception); well-formed calls round-trip, alone and
inside prose."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.fuzz import fuzz

from ar_torchrl.tools import (
    ERROR_KINDS,
    Calculator,
    HermesParser,
    TagParser,
    Toolbox,
    ToolCall,
    ToolCallError,
    ToolTurn,
)

PARSER_TYPES = {"tag": TagParser, "hermes": HermesParser}

#: Pieces of both grammars (and of chat templates), so that random texts come close to calls.
FRAGMENTS = [
    "<tool",
    "<tool ",
    "<tools>",
    ' name="',
    "calculator",
    '">',
    "</tool>",
    "<tool_call>",
    "</tool_call>",
    "\n",
    "{",
    "}",
    "[",
    "]",
    '"name"',
    '"arguments"',
    '"expression"',
    '"calculator"',
    ": ",
    ", ",
    '"',
    "\\",
    "12*34",
    "1e999",
    "-0",
    "NaN",
    "null",
    "<|im_end|>",
    "<|im_start|>assistant\n",
]

texts = st.one_of(
    st.text(max_size=80),
    st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=4)), max_size=24).map("".join),
    # nested far past the recursion limit, in each place a call holds JSON
    st.tuples(
        st.sampled_from(["[", '{"a": ', '{"name": "calculator", "arguments": {"x": ']),
        st.integers(0, 3000),
    ).map(lambda p: "<tool_call>" + p[0] * p[1] + "</tool_call>"),
    st.integers(4000, 6000).map(
        lambda n: '<tool_call>{"name": "c", "arguments": {"x": ' + "7" * n + "}}</tool_call>"
    ),
)

names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.-]{0,12}", fullmatch=True)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


@fuzz(200)
@pytest.mark.parametrize("kind", sorted(PARSER_TYPES))
@given(text=texts)
def test_any_text_gives_calls_or_a_tool_call_error_and_a_toolbox_result(kind, text):
    parser = PARSER_TYPES[kind]()
    try:
        calls = parser.parse(text)
    except ToolCallError:
        calls = None
    else:
        assert all(isinstance(c, ToolCall) and isinstance(c.name, str) for c in calls)
        assert all(c.text in text for c in calls)
    turn = Toolbox([Calculator()], parser, timeout_s=None, max_calls_per_turn=3).handle(text)
    assert isinstance(turn, ToolTurn)
    assert all(r.error in (None, *ERROR_KINDS) for r in turn.results)
    if calls is None:
        assert [r.error for r in turn.results] == ["malformed"]
    else:
        assert len(turn.results) == min(len(calls), 3) and turn.dropped == max(len(calls) - 3, 0)


def _prose(text: str) -> str:
    return text.replace("<tool", "(tool")


@fuzz(150)
@given(
    name=names,
    arguments=st.text(max_size=40),
    before=st.text(max_size=20),
    after=st.text(max_size=20),
)
def test_tag_calls_round_trip_alone_and_in_prose(name, arguments, before, after):
    parser = TagParser()
    call = ToolCall(name, arguments, "")
    try:
        written = parser.format(call)
    except ValueError as err:  # the only arguments it refuses: ones holding <tool or </tool>
        assert "<tool" in arguments or "</tool>" in arguments, err
        return
    assert parser.parse(written) == [replace(call, text=written)]
    assert parser.parse(_prose(before) + written + _prose(after)) == [replace(call, text=written)]


@fuzz(120)
@given(
    name=names,
    arguments=st.dictionaries(st.text(max_size=8), json_values, max_size=4),
    before=st.text(max_size=20),
    after=st.text(max_size=20),
)
def test_hermes_calls_round_trip_alone_and_in_prose(name, arguments, before, after):
    parser = HermesParser()
    call = ToolCall(name, arguments, "")
    try:
        written = parser.format(call)
    except ValueError as err:  # the only ones it refuses: JSON holding <tool_call> or </tool_call>
        assert "tool_call>" in json.dumps(arguments, ensure_ascii=False), err
        return
    prose = (
        before.replace("<tool_call>", "(tool_call)"),
        after.replace("<tool_call>", "(tool_call)"),
    )
    assert parser.parse(written) == [replace(call, text=written)]
    assert parser.parse(prose[0] + written + prose[1]) == [replace(call, text=written)]
