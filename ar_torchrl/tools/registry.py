"""The registries of tools (:data:`TOOLS`) and of call formats (:data:`PARSERS`).

A tool's entry carries its torch-free config schema, whose ``build()`` returns the tool
(``calculator`` in :mod:`ar_torchrl.tools.calculator`); a parser's entry builds the parser
(``tag`` and ``hermes`` in :mod:`ar_torchrl.tools.parsers`). Both are
:class:`~ar_torchrl.registry.Registry` instances, so a recipe lists and checks them before it
imports anything heavy.

Example:
    >>> TOOLS.names(), PARSERS.names()
    (('calculator',), ('tag', 'hermes'))
    >>> TOOLS.build("calculator", {"max_digits": 30})("2**10")
    '1024'
"""

from __future__ import annotations

from collections.abc import Callable

from ar_torchrl.registry import Registry

__all__ = ["PARSERS", "TOOLS", "register_tool"]

TOOLS = Registry("tool", builtins=("ar_torchrl.tools.calculator",))
PARSERS = Registry("tool call parser", builtins=("ar_torchrl.tools.parsers",))


def register_tool(name: str, *, help: str) -> Callable[[type], type]:
    """Class decorator: register a tool schema (``build()`` returns the tool) as ``name``."""

    def decorator(schema: type) -> type:
        TOOLS.register(name, config=schema, help=help)(lambda options: options.build())
        return schema

    return decorator
