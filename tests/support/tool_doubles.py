"""A call format that reads every turn as a tool call, and a tool that answers with a length: a
random model then plays multi-turn episodes to ``max_turns`` (it never writes a real call)."""

from __future__ import annotations

from ar_torchrl.tools import ToolCall


class EveryTurnIsACall:
    """Test call format (the :class:`~ar_torchrl.tools.CallParser` protocol): the whole turn is a
    call to ``echo``, so episodes run until ``max_turns``."""

    name = "every_turn"
    syntax = "anything (every turn is a call to echo)"

    def parse(self, text: str) -> list[ToolCall]:
        return [ToolCall("echo", text, text)]

    def format(self, call: ToolCall) -> str:
        return str(call.arguments)


class Echo:
    """A tool (the :class:`~ar_torchrl.tools.Tool` protocol): the length of its argument."""

    name = "echo"
    description = "echo: answers with the number of characters it was given"

    def __call__(self, arguments) -> str:
        return str(len(arguments))
